"""Fitting a model's quantized Linear weights into the bytes a user allows (LoadH3Quantized's `fit_gib`).

Each layer is decided as usual first (auto's 8-bit choice, or the format asked for). Where the
Linear layers' weights, with the kept layers at their stored size, exceed the allowance, the
largest quantized layers move to the registry's fit formats (`fit_rank`: W4A8 first), each to
the first that takes its shape, until the total fits or no layer is left to move. Layers kept on
purpose (the keep patterns, `ignored_layers`) stay as they are.

Bytes are exact, not estimated: a method's tensors for the layer's shape, from quantizing on the
meta device (no data); a format that quantizes only on a real device quantizes 16 and 32 rows
on the CPU instead, and its bytes grow linearly with the rows (per-row data plus a constant part,
such as W4A8's codebook).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..units import format_gib
from .kitchen_api import tensor_bytes
from .layer import Layer
from .linear_method import LinearMethod

_PROBE_ROWS = (16, 32)
_BYTES: dict[tuple, int] = {}


def quantized_bytes(method: LinearMethod, in_features: int, out_features: int) -> int:
    """The bytes of `method`'s stored tensors for an [out_features, in_features] weight."""
    key = (type(method), method.describe(), in_features, out_features)
    if key not in _BYTES:
        _BYTES[key] = _measure(method, in_features, out_features)
    return _BYTES[key]


def _nbytes(tensors: dict[str, torch.Tensor]) -> int:
    return sum(map(tensor_bytes, tensors.values()))


def _measure(method: LinearMethod, in_features: int, out_features: int) -> int:
    try:
        return _nbytes(method.quantize_weight(torch.empty(out_features, in_features, dtype=torch.bfloat16,
                                                          device="meta")))
    except (RuntimeError, NotImplementedError):  # e.g. a kitchen layout that asks for an accelerator
        pass
    generator = torch.Generator().manual_seed(0)
    small, large = (_nbytes(method.quantize_weight(torch.randn(rows, in_features, generator=generator,
                                                               dtype=torch.bfloat16)))
                    for rows in _PROBE_ROWS)
    per_row = (large - small) // (_PROBE_ROWS[1] - _PROBE_ROWS[0])
    return small + per_row * (out_features - _PROBE_ROWS[0])


@dataclass
class Fit:
    """What fitting did: the layers moved to a fit format, and the Linear weights' bytes before and after."""
    budget: int
    before: int
    after: int
    moved: dict[str, LinearMethod]

    def note(self) -> str:
        line = f"fit into {format_gib(self.budget)}: the Linear layers' weights take {format_gib(self.before)}"
        if self.moved:
            counts: dict[str, int] = {}
            for method in self.moved.values():
                counts[method.name] = counts.get(method.name, 0) + 1
            moved = ", ".join(f"{n} to {name}" for name, n in counts.items())
            line += f"; moved {moved} (largest first): {format_gib(self.after)}"
        if self.after > self.budget:
            line += (f"; still {format_gib(self.after - self.budget)} over, in layers kept as they are or "
                     "in 4-bit already")
        return line


def fit_layers(layers: list[Layer], budget: int, targets: list[LinearMethod]) -> Fit:
    """Move the largest quantized full-precision layers of `layers` to the first of `targets` that takes each,
    until their bytes are at most `budget` (see the module's docstring). Layers a file stores quantized
    already are not counted: they take what they take."""
    layers = [layer for layer in layers if layer.stored is None and layer.linear]
    sizes = {layer.name: (layer.plain_bytes if layer.method is None
                          else quantized_bytes(layer.method, layer.in_features, layer.out_features))
             for layer in layers}
    before = total = sum(sizes.values())
    target_names = {t.name for t in targets}
    movable = sorted((layer for layer in layers if layer.method is not None and layer.method.name not in target_names),
                     key=lambda layer: (-layer.in_features * layer.out_features, layer.name))
    moved: dict[str, LinearMethod] = {}
    for layer in movable:
        if total <= budget:
            break
        target = next((t for t in targets if t.skip_reason(layer.in_features, layer.out_features) is None), None)
        if target is None:
            continue
        size = quantized_bytes(target, layer.in_features, layer.out_features)
        if size < sizes[layer.name]:
            total += size - sizes[layer.name]
            sizes[layer.name] = size
            moved[layer.name] = target
    return Fit(budget, before, total, moved)
