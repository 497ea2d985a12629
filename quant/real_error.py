"""auto's choices checked on the model's own data: each layer's error at its first real call.

auto picks a format per layer shape by speed (quant/auto.py), and a stored
INT8 layer is converted where auto measured its target faster; whether the
format holds the layer's real weight and the activations the model produces is
known only once the model runs. So the loader gives each layer auto quantized
or converted a `RealErrorCheck` (`watch_auto_choice`, `watch_conversion`):

- the reference: a sketch of the full-precision output of the weight the layer
  was made from (the file's bf16 weight, or the stored INT8 dequantized), seen
  through a Gaussian projection (`OutputSketch`, 128 bytes per input feature);
- its fallbacks, in order: the next format in auto's order (or, for a
  conversion, the layer as the file stores it), then full precision. Each is
  rebuilt from the file's map when needed: no copy of a weight is held.

At the layer's first eager call (not while torch.compile traces, a CUDA graph
captures, or a LoRA is written into the layer) the check compares the output
that call computed anyway with the reference, on at most SAMPLE_ROWS of the
call's rows spread over all of them (quantization is per token, so each row's
error is what the full call gives it). No kernel runs for this: it is two small
products. Within ERROR_BOUND the check goes away and the layer runs as built.
Over it, each fallback computes this call in turn; the first within the bound
(full precision always is) computes this and every later call of the layer,
from host memory. The layer's own tensors are left as they are, so whatever
the host holds of them (its pages, pinned or streamed copies, a cache file)
stays true. The log and the node's `last run:` line give the numbers.

A check can be made again elsewhere from what it holds: its sketch (`OutputSketch.stored`) and its fallbacks'
labels (rebuilt by `auto_fallbacks` / `conversion_fallbacks` from the same file); `on_fallback` hears of a fallback
taken, and `take` runs a fallback an earlier check took from the first call on (loaders/entry_checks.py, the
quantize-once cache's).
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable

import torch
import torch.nn.functional as F

from ..pack_logging import pack_logger
from .kitchen_api import apply_input_act
from .linear import QuantLinear, quantized_layer
from .linear_method import LinearMethod, output_dtype

log = pack_logger(__name__)

#: The most relative L2 error (against the fp32 product of the reference weight) a layer's output may have on its
#: first real input. FP8 E4M3 rounds each value to 3 mantissa bits, which gives 0.03-0.04 on every activation
#: distribution whose rows fit its range (measured at 1024x1024 on CPU: Gaussian 0.037, Laplace 0.037, Student-t
#: 0.036, SwiGLU outputs 0.037, a few channels 1e2-1e5 times the rest 0.030-0.032), INT8 ConvRot 0.010-0.013 on the
#: same. So a well-behaved layer sits at half the bound or less, with room for the sketch's estimate. A layer over it
#: carries an error rounding alone does not explain: values a per-token scale pushed out of FP8's normal range (a
#: row whose largest value is 1e5 times the others', where those others matter: 0.13), or an INT8 grid crushed by
#: one large value (0.19 at 300 times, 0.6 at 1,000 times).
ERROR_BOUND = 0.08

#: Rows of the first call compared (evenly spread over all of them): the bound's estimate on a few hundred tokens.
SAMPLE_ROWS = 256

#: Rows of the Gaussian projection. For any matrix M of the sampled rows, |M P^T|^2 / |M|^2 has mean 1 and relative
#: standard deviation sqrt(2 / (64 s)), s the stable rank of M (1 at worst, tens for a few hundred real tokens).
#: Simulated (95% of draws), the estimated error over the true error of those rows: 0.95-1.05 where the error and
#: the output have stable rank 16, 0.90-1.09 at rank 4, 0.81-1.28 at rank 1. So even at worst a layer at FP8's usual
#: 0.04 is not rejected, nor one at 0.1 accepted.
SKETCH_DIM = 64

_SEED = 20261206
_projections: dict[tuple[int, str], torch.Tensor] = {}


def projection(out_features: int, device: torch.device) -> torch.Tensor:
    """The [SKETCH_DIM, out_features] fp32 projection every sketch of that output width shares: Gaussian, scaled by
    1/sqrt(SKETCH_DIM), drawn on the CPU from a fixed seed and rounded to bf16 values (exact in bf16, fp16 and fp32),
    so a sketch made on one device is read on any."""
    key = (out_features, str(device))
    if key not in _projections:
        gen = torch.Generator().manual_seed(_SEED + out_features)
        drawn = torch.randn(SKETCH_DIM, out_features, generator=gen) * SKETCH_DIM ** -0.5
        _projections[key] = drawn.to(torch.bfloat16).float().to(device)
    return _projections[key]


class OutputSketch:
    """A reference weight's output seen through `projection`: P (W x + b) for any input x, kept as P W (bf16,
    [SKETCH_DIM, in]) and P b in host memory, made once on the weight's device."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None):
        with torch.no_grad():
            p = projection(weight.shape[0], weight.device)
            self.weight = (p.to(weight.dtype) @ weight).to(device="cpu", dtype=torch.bfloat16)
            self.bias = None if bias is None else (p @ bias.to(weight.device).float()).cpu()
        self.out_features = weight.shape[0]

    @classmethod
    def stored(cls, weight: torch.Tensor, bias: torch.Tensor | None, out_features: int) -> "OutputSketch":
        """The sketch whose `weight` ([SKETCH_DIM, in] bf16) and `bias` ([SKETCH_DIM] fp32) were kept (a cache file's),
        of a reference weight with `out_features` rows."""
        if weight.shape[0] != SKETCH_DIM or weight.dtype != torch.bfloat16 or (
                bias is not None and (bias.shape != (SKETCH_DIM,) or bias.dtype != torch.float32)):
            raise ValueError(f"a sketch is [{SKETCH_DIM}, in] bf16 and [{SKETCH_DIM}] fp32; got "
                             f"{list(weight.shape)} {weight.dtype}" + ("" if bias is None else
                                                                       f", {list(bias.shape)} {bias.dtype}"))
        sketch = cls.__new__(cls)
        sketch.weight, sketch.bias, sketch.out_features = weight, bias, out_features
        return sketch

    def error(self, x: torch.Tensor, out: torch.Tensor) -> float:
        """Relative L2 error of `out` (rows of a layer's output) against the reference's output for `x` (the same
        rows of its input, its activation applied), both through the projection."""
        with torch.no_grad():
            p = projection(self.out_features, out.device)
            reference = x.float() @ self.weight.to(x.device).float().t()
            if self.bias is not None:
                reference += self.bias.to(x.device)
            got = out.float() @ p.t()
            return float(torch.linalg.vector_norm(got - reference)
                         / torch.linalg.vector_norm(reference).clamp_min(torch.finfo(torch.float32).tiny))


def sample_rows(rows: int, device: torch.device) -> torch.Tensor:
    """At most SAMPLE_ROWS row indices spread over `rows`: one drawn (fixed seed) from each of as many equal strata,
    so that no stride of the input's layout (frames, patches) aliases with the sample."""
    count = min(rows, SAMPLE_ROWS)
    edges = (torch.arange(count + 1, dtype=torch.float64) * (rows / count)).ceil().long()  # strata of >= 1 row
    draw = torch.rand(count, generator=torch.Generator().manual_seed(_SEED), dtype=torch.float64)
    picked = edges[:-1] + (draw * (edges[1:] - edges[:-1])).long()
    return picked.to(device)


class Unquantized(LinearMethod):
    """A reference weight in full precision, activations never quantized: the float weight as held (`source` None),
    or `source`'s stored tensors dequantized for each call."""
    name = "full precision"

    def __init__(self, source: LinearMethod | None = None):
        self.source = source

    def describe(self) -> str:
        return self.name if self.source is None else f"{self.source.name} dequantized, {self.name}"

    def quantize_weight(self, weight: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"weight": weight}

    def dequantize(self, layer, device=None) -> torch.Tensor:
        if self.source is not None:
            return self.source.dequantize(layer, device)
        return layer.tensors_on(device)["weight"].to(layer.compute_dtype)

    def apply(self, layer, x: torch.Tensor, input_act: str | None = None) -> torch.Tensor:
        dtype = output_dtype(x, layer.compute_dtype)
        bias = None if layer.bias is None else layer.bias.to(x.device, dtype)
        return F.linear(apply_input_act(x, input_act).to(dtype), self.dequantize(layer, x.device).to(dtype), bias)


@dataclass(frozen=True)
class Fallback:
    """What a checked layer may compute with instead: `label` for the report; `build(device)` makes it (a
    QuantLinear whose tensors stay in host memory), quantizing on `device` where it must."""
    label: str
    build: Callable[[torch.device], QuantLinear]


@dataclass(frozen=True)
class RealError:
    """A check's outcome: the layer's error on the sampled rows of its first real call, and what it runs."""
    name: str
    format: str
    error: float
    sampled: int
    rows: int
    runs: str | None = None                       # the fallback it computes with; None: as built
    tried: tuple[tuple[str, float], ...] = ()     # each fallback tried, with its error (the last is `runs`)

    def render(self) -> str:
        """"<name>: <format> <error> -> <fallback> <error> -> ...", each fallback tried in order."""
        return " -> ".join([f"{self.name}: {self.format} {self.error:.4f}",
                            *(f"{label} {error:.4f}" for label, error in self.tried)])


class RealErrorCheck:
    """A layer's first-call check, then (after a fallback) its route: see the module's docstring. A QuantLinear
    calls it as `real_check(layer, x, input_act)` in place of its method's `apply`."""

    def __init__(self, name: str, sketch: OutputSketch, fallbacks: list[Fallback]):
        self.name, self.sketch, self.fallbacks, self.bound = name, sketch, fallbacks, ERROR_BOUND
        self.route: QuantLinear | None = None
        self.on_fallback: Callable[[RealError], None] | None = None  # told of the fallback the check takes

    @property
    def pending(self) -> bool:
        """Whether the first-call check is still to run (no route taken)."""
        return self.route is None and self.sketch is not None

    def take(self, label: str, device: torch.device) -> bool:
        """Compute with the fallback `label` from now on, unchecked (one an earlier check of the same layer took);
        False where this check has no such fallback."""
        chosen = next((fallback for fallback in self.fallbacks if fallback.label == label), None)
        if chosen is None or not self.pending:
            return False
        self.route, self.sketch, self.fallbacks = chosen.build(device), None, []
        return True

    def __call__(self, layer: QuantLinear, x: torch.Tensor, input_act: str | None) -> torch.Tensor:
        if self.route is not None and layer._unpatched is None:  # a LoRA written into the layer: its own weights
            return self.route(x, input_act)
        if self.route is not None or not _eager() or layer._unpatched is not None or not x.numel():
            return layer.method.apply(layer, x, input_act=input_act)
        return self._check(layer, x, input_act)

    def _check(self, layer: QuantLinear, x: torch.Tensor, input_act: str | None) -> torch.Tensor:
        out = layer.method.apply(layer, x, input_act=input_act)
        x2d = x.reshape(-1, x.shape[-1])
        rows = sample_rows(x2d.shape[0], x.device)
        with torch.no_grad():
            inputs = apply_input_act(x2d[rows], input_act)
        error = self.sketch.error(inputs, out.reshape(-1, out.shape[-1])[rows])
        checked = RealError(self.name, layer.method.name, error, len(rows), x2d.shape[0])
        # (error, route, output, label) of the best so far: only its output and the latest candidate's are held
        tried, best = [], (error, None, out, None)
        del out
        for fallback in self.fallbacks if error > self.bound else ():
            candidate = fallback.build(x.device)
            candidate_out = candidate(x, input_act)
            candidate_error = self.sketch.error(inputs, candidate_out.reshape(-1, candidate_out.shape[-1])[rows])
            tried.append((fallback.label, candidate_error))
            if candidate_error < best[0]:
                best = (candidate_error, candidate, candidate_out, fallback.label)
            del candidate, candidate_out
            if candidate_error <= self.bound:
                break
        _, route, chosen, label = best
        layer.real_error = replace(checked, runs=label, tried=tuple(tried))
        if route is None:
            layer.real_check = None
            if tried:
                log.warning("%s: %s's error on its first input is %.4f (%d of %d rows), over the bound %g, and no "
                            "fallback did better (%s); it runs as built", self.name, checked.format, error,
                            checked.sampled, checked.rows, self.bound, _tried(tried))
        else:
            self.route, self.sketch, self.fallbacks = route, None, []
            log.warning("%s: %s's error on its first input is %.4f (%d of %d rows), over the bound %g; it computes "
                        "with %s from now on, from host memory (%s)", self.name, checked.format, error,
                        checked.sampled, checked.rows, self.bound, label, _tried(tried))
            if self.on_fallback is not None:
                self.on_fallback(layer.real_error)
        return chosen


def _tried(tried: list[tuple[str, float]]) -> str:
    return ", ".join(f"{label} {error:.4f}" for label, error in tried)


def _eager() -> bool:
    """Whether this call runs eagerly: not traced by torch.compile, not captured into a CUDA graph."""
    if torch.compiler.is_compiling():
        return False
    return not (torch.cuda.is_available() and torch.cuda.is_current_stream_capturing())


# ---- what the loaders attach -----------------------------------------------------------------------------------

def _requantized(method: LinearMethod, weight: torch.Tensor, bias, compute_dtype) -> Fallback:
    out_features, in_features = weight.shape
    return Fallback(method.name, lambda device: quantized_layer(
        method, weight, in_features, out_features, bias, compute_dtype, device, torch.device("cpu")))


def _as_held(method: LinearMethod, tensors: dict, in_features: int, out_features: int, bias, compute_dtype,
             label: str) -> Fallback:
    return Fallback(label, lambda device: QuantLinear(method, in_features, out_features, tensors, bias, compute_dtype))


def auto_fallbacks(selector, method: LinearMethod, source: torch.Tensor, bias: torch.Tensor | None,
                   compute_dtype: torch.dtype) -> list[Fallback] | None:
    """What a layer auto (`selector`) quantized with `method` falls back to: the later formats of auto's order, then
    full precision, each made from `source` (the file's weight, in its map: read when built). None where `method`
    is not auto's choice (a rule's, the fit's)."""
    from .auto import AutoSelector  # auto builds on the layers this module checks
    if not isinstance(selector, AutoSelector):
        return None
    out_features, in_features = source.shape
    later = selector.fallbacks(method, in_features, out_features)
    if later is None:
        return None
    fallbacks = [_requantized(later_method, source, bias, compute_dtype) for later_method in later]
    fallbacks.append(_as_held(Unquantized(), {"weight": source}, in_features, out_features, bias, compute_dtype,
                              Unquantized.name))
    return fallbacks


def conversion_fallbacks(stored: LinearMethod, tensors: dict[str, torch.Tensor], in_features: int, out_features: int,
                         bias: torch.Tensor | None, compute_dtype: torch.dtype) -> list[Fallback]:
    """What a layer converted from `stored`'s `tensors` (in the file's map) falls back to: the stored layer as the
    file holds it, then its weight in full precision."""
    k, n, dtype = in_features, out_features, compute_dtype
    return [_as_held(stored, tensors, k, n, bias, dtype, f"{stored.name} as stored"),
            _as_held(Unquantized(stored), tensors, k, n, bias, dtype, Unquantized(stored).describe())]


def watch_auto_choice(built: QuantLinear, name: str, selector, reference: torch.Tensor, source: torch.Tensor | None,
                      bias: torch.Tensor | None) -> bool:
    """Give `built` (quantized from `reference`, the file's weight on the quantizing device) its first-call check
    where auto (`selector`) chose its format: `auto_fallbacks` made from `source`, the same weight in the file's map
    (None: it is not there, and the layer is not checked). Returns whether it was given one."""
    fallbacks = None if source is None else auto_fallbacks(selector, built.method, source, bias, built.compute_dtype)
    if fallbacks is None:
        return False
    built.real_check = RealErrorCheck(name, OutputSketch(reference, bias), fallbacks)
    return True


def watch_conversion(built: QuantLinear, name: str, stored: LinearMethod, tensors: dict[str, torch.Tensor],
                     bias: torch.Tensor | None, reference: torch.Tensor) -> None:
    """Give `built` (converted from a stored layer: `stored`'s `tensors`, in the file's map) its first-call check
    against `reference`, their dequantized weight (requantized_layer's), with `conversion_fallbacks`."""
    k, n, dtype = built.in_features, built.out_features, built.compute_dtype
    built.real_check = RealErrorCheck(name, OutputSketch(reference, bias),
                                      conversion_fallbacks(stored, tensors, k, n, bias, dtype))


def summary(outcomes: list[RealError]) -> str:
    """One line for checks that finished: how many, the largest error, the layers that fell back (and any over
    the bound that no fallback did better than)."""
    bound = ERROR_BOUND
    line = (f"auto's formats on real input: {len(outcomes)} checked (bound {bound:g}), error up to "
            f"{max(o.error for o in outcomes):.4f}")
    for label, picked in (("fell back", [o for o in outcomes if o.runs is not None]),
                          ("over the bound, kept", [o for o in outcomes if o.runs is None and o.error > bound])):
        if picked:
            line += f"; {len(picked)} {label}: " + "; ".join(o.render() for o in picked[:3])
            line += "; ..." if len(picked) > 3 else ""
    return line
