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

from .kitchen_layout import KitchenLayoutMethod

LAYOUT = "TensorCoreMXFP8Layout"


def native_mxfp8_supported(device: torch.device) -> bool:
    return Mxfp8Method().native_supported(device)


class Mxfp8Method(KitchenLayoutMethod):
    name = "mxfp8"
    layout = LAYOUT

    def describe(self) -> str:
        return "mxfp8 (E4M3, power-of-two scales per 32 elements)"

    def quantize_weight(self, weight: torch.Tensor) -> dict[str, torch.Tensor]:
        qdata, params = self.layout_class().quantize(weight)
        return {"weight": qdata, "weight_scale": params.scale}

    def layout_params(self, tensors, layer):
        return self.layout_class().Params(
            scale=tensors["weight_scale"].view(torch.float8_e8m0fnu), orig_dtype=layer.compute_dtype,
            orig_shape=(layer.out_features, layer.in_features))
