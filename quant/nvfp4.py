"""NVFP4 layers as ComfyUI checkpoints store them, through comfy-kitchen's TensorCoreNVFP4Layout.

Stored tensors, exactly as the kitchen layout serializes them:
  weight          uint8 [N16, K16/2]  two E2M1 codes per byte (kitchen's nibble order);
                                      N and K padded to multiples of 16
  weight_scale    float8_e4m3fn       per-16-element block scales in cuBLAS's blocked
                                      layout, [roundup(N16, 128), roundup(K16/16, 4)]
  weight_scale_2  fp32 scalar         per-tensor scale
  input_scale     fp32 scalar         optional static activation scale (native GEMM only)

On sm100+ (the layout's MIN_SM_VERSION) activations are quantized to NVFP4 and
kitchen's `scaled_mm_nvfp4` runs. Elsewhere, CPU included, kitchen dequantizes
the weight and a plain matmul runs in the activations' dtype: correct, but it
only saves memory (loaders can re-quantize such layers to a native format).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .method import LinearMethod

LAYOUT = "TensorCoreNVFP4Layout"
_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def native_nvfp4_supported(device: torch.device) -> bool:
    from comfy_kitchen.tensor.nvfp4 import TensorCoreNVFP4Layout
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= TensorCoreNVFP4Layout.MIN_SM_VERSION


def _input_act(x: torch.Tensor, input_act: str | None) -> torch.Tensor:
    from comfy_kitchen.backends._activations import apply_input_act
    return apply_input_act(x, input_act)


class Nvfp4Method(LinearMethod):
    name = "nvfp4"

    def describe(self) -> str:
        return "nvfp4 (E2M1, fp8 scales per 16 elements)"

    def quantize_weight(self, weight: torch.Tensor) -> dict[str, torch.Tensor]:
        from comfy_kitchen.tensor.nvfp4 import TensorCoreNVFP4Layout
        qdata, params = TensorCoreNVFP4Layout.quantize(weight)
        return {"weight": qdata, "weight_scale": params.block_scale, "weight_scale_2": params.scale}

    def _kitchen_tensor(self, tensors: dict[str, torch.Tensor], layer):
        from comfy_kitchen.tensor import QuantizedTensor
        from comfy_kitchen.tensor.nvfp4 import TensorCoreNVFP4Layout
        params = TensorCoreNVFP4Layout.Params(
            scale=tensors["weight_scale_2"], orig_dtype=layer.compute_dtype,
            orig_shape=(layer.out_features, layer.in_features),
            block_scale=tensors["weight_scale"].view(torch.float8_e4m3fn))
        return QuantizedTensor(tensors["weight"], LAYOUT, params)

    def dequantize(self, layer) -> torch.Tensor:
        return self._kitchen_tensor(dict(layer.named_parameters()), layer).dequantize()

    def apply(self, layer, x: torch.Tensor, input_act: str | None = None) -> torch.Tensor:
        t = layer.tensors_for(x)
        out_dtype = x.dtype if x.dtype in _FLOAT_DTYPES else layer.compute_dtype
        lead = x.shape[:-1]
        x2d = _input_act(x.reshape(-1, x.shape[-1]), input_act).to(out_dtype)
        bias = t.get("bias")
        bias = None if bias is None else bias.to(out_dtype)
        weight = self._kitchen_tensor(t, layer)
        if native_nvfp4_supported(x.device):
            from comfy_kitchen.tensor import QuantizedTensor
            xq = QuantizedTensor.from_float(x2d, LAYOUT, scale=t.get("input_scale"))
            out = F.linear(xq, weight, bias)
        else:
            out = F.linear(x2d, weight.dequantize().to(out_dtype), bias)
        return out.reshape(*lead, layer.out_features)
