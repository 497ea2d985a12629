"""ConvRot W4A4 layers (upstream ComfyUI's `convrot_w4a4` markers), through comfy-kitchen's
TensorCoreConvRotW4A4Layout.

Stored tensors, exactly as the kitchen layout serializes them:
  weight        int8 [N, K/2]  two signed int4 codes per byte (low nibble = even column), of the weight
                               rotated per group of `convrot_groupsize` inputs by a regular Hadamard matrix
  weight_scale  fp32 [N]       one scale per output row
Marker: {"format": "convrot_w4a4", "convrot_groupsize": 256}, optionally "linear_dtype": "int4" | "int8".

Kitchen's linear rotates and quantizes the activations to int4 per token itself, on every device (its
int4 tensor-core GEMM on CUDA, its eager reference on CPU), so the layer computes as upstream's does.
"""
from __future__ import annotations

import torch

from .descriptor import Contract, MarkerParam, QuantFormat, power_of_4
from .kitchen_layout import KitchenLayoutMethod
from .registry import register_format

NAME = "convrot_w4a4"
LAYOUT = "TensorCoreConvRotW4A4Layout"
QUANT_GROUP = 64          # kitchen's int4 GEMM takes this group only
LINEAR_DTYPES = ("int4", "int8")


class ConvRotW4A4Method(KitchenLayoutMethod):
    name = NAME
    layout = LAYOUT

    def __init__(self, group_size: int = 256, linear_dtype: str = "int4"):
        self.group_size = group_size
        self.linear_dtype = linear_dtype

    def describe(self) -> str:
        return f"{NAME}(g={self.group_size})"

    def skip_reason(self, in_features: int, out_features: int) -> str | None:
        if in_features % self.group_size or in_features % QUANT_GROUP:
            return f"in_features {in_features} not divisible by group size {self.group_size} and {QUANT_GROUP}"
        return None

    def rotation_group(self) -> int:
        return self.group_size

    def quantize_weight(self, weight: torch.Tensor) -> dict[str, torch.Tensor]:
        qdata, params = self.on_kitchen(lambda: self.layout_class().quantize(
            weight, convrot_groupsize=self.group_size, linear_dtype=self.linear_dtype))
        return {"weight": qdata, "weight_scale": params.scale.float().reshape(-1)}

    def layout_params(self, tensors, layer, dtype):
        return self.layout_class().Params(
            scale=tensors["weight_scale"], orig_dtype=dtype, orig_shape=(layer.out_features, layer.in_features),
            convrot_groupsize=self.group_size, quant_group_size=QUANT_GROUP, linear_dtype=self.linear_dtype)


def _marker(group_size: int, linear_dtype: str) -> dict:
    marker = {"format": NAME, "convrot_groupsize": int(group_size)}
    if linear_dtype != "int4":
        marker["linear_dtype"] = linear_dtype
    return marker


@register_format
class ConvRotW4A4Format(QuantFormat):
    name = NAME
    marker = True
    online = True
    rotation_group = True
    fit_rank = 1  # the smaller and less accurate one
    summary = ("4-bit weights and activations with ConvRot, a quarter of bf16's weight memory (comfy-kitchen's "
               "int4 tensor-core GEMM, native on RTX 20 to 40; INT8 GEMMs on Hopper and Blackwell)")
    kitchen_layouts = (LAYOUT,)
    contract = Contract(required=frozenset({"weight", "weight_scale"}), weight_dtypes=("I8",),
                        weight_note="packed signed int4 pairs", pack=2,
                        shapes={"weight_scale": "N"}, dtypes={"weight_scale": ("F32",)},
                        encodings={"weight_scale": "float"}, stored_max=8.0)   # int4's -8
    marker_params = {
        "convrot_groupsize": MarkerParam((int,), 256, power_of_4, "a power of 4 from 4 up"),
        "linear_dtype": MarkerParam((str,), "int4", lambda v: v in LINEAR_DTYPES, " or ".join(LINEAR_DTYPES)),
    }

    def method(self, group_size: int = 256, linear_dtype: str = "int4", **_) -> ConvRotW4A4Method:
        return ConvRotW4A4Method(group_size, linear_dtype)

    def native(self, device: torch.device) -> bool:
        return ConvRotW4A4Method().native_supported(device)

    def marker_options(self, values: dict, in_features: int) -> dict:
        group = values["convrot_groupsize"]
        if in_features % group or in_features % QUANT_GROUP:
            raise ValueError(f"bad marker: convrot_groupsize {group} and kitchen's int4 group {QUANT_GROUP} must "
                             f"divide in_features {in_features}")
        return {"group_size": group, "linear_dtype": values["linear_dtype"]}

    def saved_marker(self, method) -> dict:
        return _marker(method.group_size, method.linear_dtype)

    def kitchen_marker(self, params: dict) -> dict:
        return _marker(params.get("convrot_groupsize", 256), params.get("linear_dtype", "int4"))
