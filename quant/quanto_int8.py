"""Optimum Quanto qint8 weight-only layers, as self-describing Quanto checkpoints store them.

Stored tensors (after the loader renames Quanto's `weight._data` / `weight._scale`):
  weight        int8 [N, K]
  weight_scale  float [N, 1]   per output channel, in the checkpoint's dtype

The active layer's weight is dequantized just before its matmul, so this is a
resident-memory format, not a speed format: weights take half of bf16's memory
while resident, and each call pays a dequantization on top of a bf16 GEMM.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .descriptor import Contract, QuantFormat
from .linear_method import LinearMethod, output_dtype
from .registry import register_format

NAME = "quanto_qint8"
QINT8_MIN, QINT8_MAX = -128, 127


class QuantoInt8Method(LinearMethod):
    name = NAME

    def describe(self) -> str:
        return f"{NAME} (weight-only, dequantized per call)"

    def quantize_weight(self, weight: torch.Tensor) -> dict[str, torch.Tensor]:
        # Quanto's per-axis qint8: absmax / qmax per output channel, in the weight's dtype.
        scale = weight.abs().amax(dim=1, keepdim=True) / QINT8_MAX
        scale = torch.where(scale == 0, torch.ones_like(scale), scale)
        data = torch.round(weight / scale).clamp_(QINT8_MIN, QINT8_MAX).to(torch.int8)
        return {"weight": data, "weight_scale": scale}

    def dequantize(self, layer, device=None) -> torch.Tensor:
        dtype, t = layer.compute_dtype, layer.tensors_on(device)
        return t["weight"].to(dtype) * t["weight_scale"].to(dtype)

    def apply(self, layer, x: torch.Tensor, input_act: str | None = None) -> torch.Tensor:
        from .kitchen_api import apply_input_act
        t = layer.tensors_for(x)
        dtype = output_dtype(x, layer.compute_dtype)
        weight = t["weight"].to(dtype) * t["weight_scale"].to(dtype)
        bias = t.get("bias")
        return F.linear(apply_input_act(x, input_act).to(dtype), weight, None if bias is None else bias.to(dtype))


@register_format
class QuantoQint8Format(QuantFormat):
    """Quanto's file contract itself (a quantization map, `weight._data` / `weight._scale`) is read by
    loaders/quanto.py; the roles below are the renamed tensors."""
    name = NAME
    conventions = ("quanto",)
    unsaveable = "Quanto qint8 is weight-only with its own file contract, not a ComfyUI marker format"
    contract = Contract(required=frozenset({"weight", "weight_scale"}), weight_dtypes=("I8",),
                        encodings={"weight_scale": "float"}, scales_as_stored=True, stored_max=128.0,
                        ignored=("input_scale", "output_scale"))   # weight-only layers need them to be 1

    def method(self, **_) -> LinearMethod:
        return QuantoInt8Method()
