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
import torch.nn.functional as F

from .method import LinearMethod

LAYOUT = "TensorCoreMXFP8Layout"
_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def native_mxfp8_supported(device: torch.device) -> bool:
    from comfy_kitchen.tensor.mxfp8 import TensorCoreMXFP8Layout
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= TensorCoreMXFP8Layout.MIN_SM_VERSION


class Mxfp8Method(LinearMethod):
    name = "mxfp8"

    def describe(self) -> str:
        return "mxfp8 (E4M3, power-of-two scales per 32 elements)"

    def quantize_weight(self, weight: torch.Tensor) -> dict[str, torch.Tensor]:
        from comfy_kitchen.tensor.mxfp8 import TensorCoreMXFP8Layout
        qdata, params = TensorCoreMXFP8Layout.quantize(weight)
        return {"weight": qdata, "weight_scale": params.scale}

    def _kitchen_tensor(self, tensors: dict[str, torch.Tensor], layer):
        from comfy_kitchen.tensor import QuantizedTensor
        from comfy_kitchen.tensor.mxfp8 import TensorCoreMXFP8Layout
        params = TensorCoreMXFP8Layout.Params(
            scale=tensors["weight_scale"].view(torch.float8_e8m0fnu), orig_dtype=layer.compute_dtype,
            orig_shape=(layer.out_features, layer.in_features))
        return QuantizedTensor(tensors["weight"], LAYOUT, params)

    def dequantize(self, layer) -> torch.Tensor:
        return self._kitchen_tensor(dict(layer.named_parameters()), layer).dequantize()

    def apply(self, layer, x: torch.Tensor, input_act: str | None = None) -> torch.Tensor:
        from comfy_kitchen.backends._activations import apply_input_act
        t = layer.tensors_for(x)
        out_dtype = x.dtype if x.dtype in _FLOAT_DTYPES else layer.compute_dtype
        lead = x.shape[:-1]
        x2d = apply_input_act(x.reshape(-1, x.shape[-1]), input_act).to(out_dtype)
        bias = t.get("bias")
        bias = None if bias is None else bias.to(out_dtype)
        weight = self._kitchen_tensor(t, layer)
        if native_mxfp8_supported(x.device):
            from comfy_kitchen.tensor import QuantizedTensor
            out = F.linear(QuantizedTensor.from_float(x2d, LAYOUT), weight, bias)
        else:
            out = F.linear(x2d, weight.dequantize().to(out_dtype), bias)
        return out.reshape(*lead, layer.out_features)
