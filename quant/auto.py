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

import os
from typing import Callable

import torch
import torch.nn.functional as F

from ..dtypes import FLOAT_DTYPES, dtype_name
from ..hardware import cuda_capability
from .kernel_select import _time_ms
from .linear import quantized_layer, requantized_layer
from .linear_method import LinearMethod, default_device
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


# Measured conversions of a stored format for the process: (device, in, out, dtype, rows, stored, target) ->
# (target's format or None, reason naming the timings).
_CONVERSIONS: dict[tuple, tuple[str | None, str]] = {}


def faster_than_stored(device: torch.device, layer, stored: LinearMethod) -> tuple[LinearMethod | None, str]:
    """This device's fastest native format for `layer`'s shape where it runs faster than `stored` (the method of
    the format the file stores the layer in), else None. Measured once per shape and process; the reason gives the
    numbers. Its error is checked on the layer's real weight and first real input (quant/real_error.py)."""
    candidates = [m for m in fastest_native_methods(device, layer.in_features, layer.out_features)
                  if m.name != stored.name]
    if not candidates or device.type != "cuda":
        return None, "no faster native format on this device"
    target = candidates[0]
    dtype = layer.compute_dtype if layer.compute_dtype in FLOAT_DTYPES else torch.bfloat16
    rows = int(os.environ.get("BIGDIT_AUTO_ROWS", DEFAULT_ROWS))
    key = (str(device), layer.in_features, layer.out_features, dtype, rows, stored.describe(), target.describe())
    if key not in _CONVERSIONS:
        _CONVERSIONS[key] = _measure_conversion(device, layer.in_features, layer.out_features, dtype, rows,
                                                stored, target)
    chosen, reason = _CONVERSIONS[key]
    return (target if chosen else None), reason


def _measure_conversion(device, k: int, n: int, dtype, rows: int, stored: LinearMethod,
                        target: LinearMethod) -> tuple[str | None, str]:
    gen = torch.Generator(device=device).manual_seed(0)
    weight = torch.randn(n, k, device=device, dtype=dtype, generator=gen) * k ** -0.5
    x = torch.randn(rows, k, device=device, dtype=dtype, generator=gen)
    source = quantized_layer(stored, weight, k, n, None, dtype, device, device)
    converted = requantized_layer(source, target, device, device)
    times = {}
    for name, layer in ((stored.name, source), (target.name, converted)):
        layer(x)  # first call runs any kernel measurement of the format itself
        times[name] = _time_ms(lambda: layer(x), iters=5)
    if times[target.name] >= times[stored.name]:
        return None, f"{stored.name} as fast or faster at {k}->{n} ({_fmt(times)})"
    return target.name, f"faster at {k}->{n} ({_fmt(times)})"


@register_selector("auto")
def _auto(group_size: int = 256, device=None, **_) -> AutoSelector:
    return AutoSelector(torch.device(device) if device is not None else default_device(), group_size=group_size)




def _fmt(times: dict[str, float]) -> str:
    return ", ".join(f"{k} {v:.3f} ms" for k, v in times.items())
