"""MXFP8 layers as ComfyUI checkpoints store them, through comfy-kitchen's TensorCoreMXFP8Layout.

Stored tensors, exactly as the kitchen layout serializes them:
  weight        float8_e4m3fn [N32, K32]  N and K padded to multiples of 32
  weight_scale  float8_e8m0fnu            power-of-two scales per 32 input elements in
                                          cuBLAS's blocked layout, [roundup(N32, 128), roundup(K32/32, 4)]
  input_scale   optional, unused: MXFP8 activations carry their own block scales

On sm100+ (the layout's MIN_SM_VERSION) activations are quantized to MXFP8 and
kitchen's `scaled_mm_mxfp8` runs; elsewhere kitchen dequantizes the weight and a
plain matmul runs in the activations' dtype.
"""
from __future__ import annotations

import torch

from .descriptor import Contract
from .kitchen_layout import BlockFormat, KitchenLayoutMethod
from .registry import register_format

NAME = "mxfp8"
LAYOUT = "TensorCoreMXFP8Layout"


class Mxfp8Method(KitchenLayoutMethod):
    name = NAME
    layout = LAYOUT

    def describe(self) -> str:
        return f"{NAME} (E4M3, power-of-two scales per 32 elements)"

    def quantize_weight(self, weight: torch.Tensor) -> dict[str, torch.Tensor]:
        qdata, params = self.layout_class().quantize(weight)
        return {"weight": qdata, "weight_scale": params.scale}

    def layout_params(self, tensors, layer, dtype):
        return self.layout_class().Params(
            scale=tensors["weight_scale"].view(torch.float8_e8m0fnu), orig_dtype=dtype,
            orig_shape=(layer.out_features, layer.in_features))


@register_format
class Mxfp8Format(BlockFormat):
    name = NAME
    marker = True
    kitchen_layouts = (LAYOUT,)
    contract = Contract(
        required=frozenset({"weight", "weight_scale"}), optional=frozenset({"input_scale"}),
        weight_dtypes=("F8_E4M3",), pad=32, block=32, block_scale_dtypes=("F8_E8M0", "U8"),
        encodings={"weight_scale": "F8_E8M0"}, views={"weight_scale": torch.float8_e8m0fnu},
        dropped=frozenset({"input_scale"}),   # its activations carry their own block scales
        stored_max=448.0)

    def method(self, **_) -> Mxfp8Method:
        return Mxfp8Method()

    def native(self, device: torch.device) -> bool:
        return Mxfp8Method().native_supported(device)
