"""`auto`: the fastest native format for this GPU, refined per layer shape by measurement.

The table gives each GPU generation's first choice (FP8 from sm89, where its
GEMMs outrun INT8 ConvRot's; INT8 before, its native fast format; the README
has the measurements). Then, once per (device, in, out, compute dtype), a
micro-benchmark times the plain GEMM against the candidates at a representative
token count, all in the dtype the layer computes in (ComfyUI may run a bf16 file
in fp16); a layer whose formats are all slower than its plain GEMM stays as it
is, so no layer gets slower. Speed is measured here on random data; accuracy on
the layer's own weight and first real input (quant/real_error.py), with the
later formats of the order as its fallbacks (`AutoSelector.fallbacks`).
"""
from __future__ import annotations

import functools
import os
import sys
import time
from typing import Callable

import torch
import torch.nn.functional as F

from ..dtypes import FLOAT_DTYPES, dtype_name
from ..hardware import cuda_capability
from .kernel_select import _time_ms
from .linear import quantized_layer, requantized_layer
from .linear_method import LinearMethod, default_device
from . import tuning
from .registry import format_spec, formats, get_method, register_selector

DEFAULT_ROWS = 8192


def preferred_formats(device: torch.device) -> tuple[str, ...]:
    """The formats auto considers on `device`, preferred first, as each declares (`auto_rank`, `auto_from`,
    `auto_on_cpu`). The 4-bit formats declare none: on speed alone auto would take W4A4 where its int4 GEMM
    is native (Turing to Ada) at about 17x INT8's layer error; they run where the user names them."""
    ranked = sorted((spec.auto_rank, name, spec) for name, spec in formats().items() if spec.auto_rank is not None)
    if device.type != "cuda":
        return tuple(name for _, name, spec in ranked if spec.auto_on_cpu)
    capability = cuda_capability(device)
    return tuple(name for _, name, spec in ranked if capability >= spec.auto_from)


def fastest_native_methods(device: torch.device, in_features: int, out_features: int) -> list[LinearMethod]:
    """Native formats of `device` that take this shape, fastest first (empty: none).

    The order is the table above (FP8 on sm89+, INT8 ConvRot on sm75+ and on CPU,
    where INT8 at least halves memory); each format takes its first variant that
    fits the shape (INT8: the largest group size that divides the input width).
    """
    methods = []
    for fmt in preferred_formats(device):
        for options in format_spec(fmt).variants():
            method = get_method(fmt, **options)
            if method.skip_reason(in_features, out_features) is None:
                methods.append(method)
                break
    return methods


# Measured decisions for the process: (device, in, out, dtype, rows, group size, formats) ->
# (format or None to keep the layer, reason naming the timings). Every load of the same model shares them.
_MEASURED: dict[tuple, tuple[str | None, str]] = {}


class AutoSelector:
    """A Selector (quant/selector.py): picks a method per layer shape; `select` returns (method or None, reason).

    It measures on CUDA only; `time_ms(fn)` times one call of `fn` with CUDA events.
    """

    def __init__(self, device: torch.device, group_size: int = 256):
        self.device = device
        self.group_size = group_size
        self.order = preferred_formats(device)
        self.methods: dict[str, LinearMethod] = {fmt: get_method(fmt, group_size=group_size) for fmt in self.order}
        self.measure = device.type == "cuda"
        self.rows = int(os.environ.get("BIGDIT_AUTO_ROWS", DEFAULT_ROWS))

    def time_ms(self, fn: Callable[[], object]) -> float:
        return _time_ms(fn, iters=5)

    def select(self, in_features: int, out_features: int, dtype: torch.dtype) -> tuple[LinearMethod | None, str]:
        usable = tuple(f for f in self.order if self.methods[f].skip_reason(in_features, out_features) is None)
        if not usable:
            return None, "auto: no native format fits this shape" if self.order else "auto: no fast format on this GPU"
        if not self.measure or dtype not in FLOAT_DTYPES:
            return self.methods[usable[0]], f"auto: {usable[0]} (table)"
        key = (str(self.device), in_features, out_features, dtype, self.rows, self.group_size, usable)
        if key not in _MEASURED:
            _MEASURED[key] = self._decide(in_features, out_features, dtype, usable)
        best, reason = _MEASURED[key]
        return (None if best is None else self.methods[best]), reason

    def fallbacks(self, method: LinearMethod, in_features: int, out_features: int) -> list[LinearMethod] | None:
        """The formats after `method` in this selector's order that take the shape: what a layer it quantized with
        `method` falls back to, before full precision, where its error on real input is over the bound
        (quant/real_error.py). None where `method` is not one this selector chooses (a rule's, the fit's)."""
        chosen = [fmt for fmt, own in self.methods.items() if own is method]
        if not chosen:
            return None
        later = self.order[self.order.index(chosen[0]) + 1:]
        return [self.methods[fmt] for fmt in later if self.methods[fmt].skip_reason(in_features, out_features) is None]

    def _decide(self, k: int, n: int, dtype: torch.dtype, formats: tuple[str, ...]) -> tuple[str | None, str]:
        times = self._time(k, n, dtype, formats)
        best, plain = min(times, key=times.get), dtype_name(dtype)
        if best == plain:
            return None, f"auto: {plain} fastest at {k}->{n} ({_fmt(times)})"
        return best, f"auto: {best} at {plain} ({_fmt(times)})"

    def _time(self, k: int, n: int, dtype: torch.dtype, formats: tuple[str, ...]) -> dict[str, float]:
        """ms of the plain GEMM (keyed by the dtype's name) and of each format's layer, inputs in `dtype`."""
        gen = torch.Generator(device=self.device).manual_seed(0)
        linear = torch.nn.Linear(k, n, bias=False, device=self.device, dtype=dtype)
        with torch.no_grad():
            linear.weight.normal_(0, k ** -0.5, generator=gen)
        x = torch.randn(self.rows, k, device=self.device, dtype=dtype, generator=gen)
        times = {dtype_name(dtype): self.time_ms(lambda: F.linear(x, linear.weight))}
        for fmt in formats:
            layer = quantized_layer(self.methods[fmt], linear.weight.detach(), k, n, None, dtype,
                                    self.device, self.device)
            layer(x)  # first call runs any kernel measurement of the format itself
            times[fmt] = self.time_ms(lambda: layer(x))
            del layer
        return times


#: A conversion pays where the time it saves over one job's calls of the layer exceeds what it costs at load:
#: the calls of the shortest job the pack's templates run (MiniMax-H3's turbo LoRA, 8 steps at CFG 1).
JOB_CALLS = 8


@functools.lru_cache(maxsize=None)
def _method_version(method_type: type) -> str:
    """What a measurement of a method's speed holds for: its declared kernel version, else its module's source."""
    declared = getattr(method_type, "kernel_version", None)
    return declared or tuning.source_digest(sys.modules[method_type.__module__])


def faster_than_stored(device: torch.device, layer, stored: LinearMethod) -> tuple[LinearMethod | None, str, str]:
    """(this device's fastest native format for `layer`'s shape, or None to keep the stored format; why, for the
    report's headline; the numbers behind it, for the layer's record). Converted only where the tuning store
    holds a measurement of this shape on this GPU (made where the user asked, BIGDIT_INT8_TUNE=1, and kept) that
    says the conversion pays: faster per call by more than its cost at load over JOB_CALLS calls. Nothing is timed
    otherwise. The error on random data goes into the numbers only: a converted layer's error is checked on its real
    weight and first real input (quant/real_error.py), which falls back to the stored layer over the bound."""
    candidates = [m for m in fastest_native_methods(device, layer.in_features, layer.out_features)
                  if m.name != stored.name]
    if not candidates or device.type != "cuda":
        return None, "no faster native format on this device", "nothing to measure"
    target = candidates[0]
    dtype = layer.compute_dtype if layer.compute_dtype in FLOAT_DTYPES else torch.bfloat16
    rows = int(os.environ.get("BIGDIT_AUTO_ROWS", DEFAULT_ROWS))
    gpu = tuning.device_key(device)
    kernel = f"convert.{stored.describe()}->{target.describe()}"
    version = tuning.digest(_method_version(type(stored)), _method_version(type(target)), torch.__version__)
    shape = f"{layer.in_features}x{layer.out_features} {dtype_name(dtype)} rows={rows}"
    measured = tuning.current().get(gpu, kernel, version, shape)
    if not _is_measurement(measured):
        if not tuning.search_asked():
            return None, f"no stored measurement says {target.name} pays on this GPU", \
                f"{tuning.TUNE_ENV}=1 measures it at the next load"
        measured = _measure_conversion(device, layer.in_features, layer.out_features, dtype, rows, stored, target)
        tuning.current().put(gpu, kernel, version, shape, measured)
    pays, numbers = _pays(measured, stored, target)
    if pays:
        return target, f"a stored measurement says {target.name} pays on this GPU", numbers
    return None, f"a stored measurement says {target.name} does not pay on this GPU", numbers


def _is_measurement(value) -> bool:
    return isinstance(value, dict) and all(isinstance(value.get(key), (int, float)) for key in
                                           ("stored_ms", "target_ms", "target_error", "convert_ms"))


def _pays(measured: dict, stored: LinearMethod, target: LinearMethod) -> tuple[bool, str]:
    saved = measured["stored_ms"] - measured["target_ms"]
    numbers = (f"{stored.name} {measured['stored_ms']:.3f} ms, {target.name} {measured['target_ms']:.3f} ms a call, "
               f"error on random data {measured['target_error']:.4f}; converting {measured['convert_ms']:.1f} ms")
    if saved * JOB_CALLS <= measured["convert_ms"]:
        return False, f"{numbers}: {JOB_CALLS} calls save {max(saved, 0.0) * JOB_CALLS:.1f} ms"
    return True, f"{numbers}: {JOB_CALLS} calls save {saved * JOB_CALLS:.1f} ms"


def _measure_conversion(device, k: int, n: int, dtype, rows: int, stored: LinearMethod,
                        target: LinearMethod) -> dict:
    """Times a layer of `stored` and its re-quantization to `target` (a call of each, and the conversion as a
    load makes it: on the device, back to host memory) on a random weight, and the target's error: the tuning
    store's entry."""
    gen = torch.Generator(device=device).manual_seed(0)
    weight = torch.randn(n, k, device=device, dtype=dtype, generator=gen) * k ** -0.5
    x = torch.randn(rows, k, device=device, dtype=dtype, generator=gen)
    reference = F.linear(x.float(), weight.float())
    source = quantized_layer(stored, weight, k, n, None, dtype, device, device)
    requantized_layer(source, target, device, torch.device("cpu"))  # its kernels compiled, its buffers allocated
    start = time.perf_counter()
    converted = requantized_layer(source, target, device, torch.device("cpu"))  # the copy home waits for the GPU
    convert_ms = (time.perf_counter() - start) * 1e3
    converted = converted.to(device)
    times, errors = {}, {}
    for name, layer in (("stored", source), ("target", converted)):
        out = layer(x)
        errors[name] = float((out.float() - reference).norm() / reference.norm())
        times[name] = _time_ms(lambda: layer(x), iters=5)
    return {"stored_ms": times["stored"], "target_ms": times["target"], "target_error": errors["target"],
            "convert_ms": convert_ms}


@register_selector("auto")
def _auto(group_size: int = 256, device=None, **_) -> AutoSelector:
    return AutoSelector(torch.device(device) if device is not None else default_device(), group_size=group_size)




def _fmt(times: dict[str, float]) -> str:
    return ", ".join(f"{k} {v:.3f} ms" for k, v in times.items())
