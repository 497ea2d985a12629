"""NVFP4 layers as ComfyUI checkpoints store them, through comfy-kitchen's TensorCoreNVFP4Layout.

Stored tensors, exactly as the kitchen layout serializes them:
  weight          uint8 [N16, K16/2]  two E2M1 codes per byte (kitchen's nibble order);
                                      N and K padded to multiples of 16
  weight_scale    float8_e4m3fn       per-16-element block scales in cuBLAS's blocked
                                      layout, [roundup(N16, 128), roundup(K16/16, 4)]
  weight_scale_2  fp32 scalar         per-tensor scale
  input_scale     fp32 scalar         optional static activation scale (native GEMM only)
  pre_quant_scale float [K]           optional AWQ smoothing of the input (ModelOpt's nvfp4_awq
                                      exports, e.g. Comfy-Org's text encoders); QuantLinear applies it

On sm100+ (the layout's MIN_SM_VERSION) activations are quantized to NVFP4 and
kitchen's `scaled_mm_nvfp4` runs. Elsewhere, CPU included, kitchen dequantizes
the weight and a plain matmul runs in the activations' dtype: correct, but it
only saves memory (loaders can re-quantize such layers to a native format).
"""
from __future__ import annotations

import torch

from .descriptor import PRE_QUANT_SCALE, Contract
from .kitchen_layout import BlockFormat, KitchenLayoutMethod
from .registry import register_format

NAME = "nvfp4"
LAYOUT = "TensorCoreNVFP4Layout"


class Nvfp4Method(KitchenLayoutMethod):
    name = NAME
    layout = LAYOUT

    def describe(self) -> str:
        return f"{NAME} (E2M1, fp8 scales per 16 elements)"

    def quantize_weight(self, weight: torch.Tensor) -> dict[str, torch.Tensor]:
        qdata, params = self.layout_class().quantize(weight)
        return {"weight": qdata, "weight_scale": params.block_scale, "weight_scale_2": params.scale}

    def layout_params(self, tensors, layer, dtype):
        return self.layout_class().Params(
            scale=tensors["weight_scale_2"], orig_dtype=dtype,
            orig_shape=(layer.out_features, layer.in_features),
            block_scale=tensors["weight_scale"].view(torch.float8_e4m3fn))

    def quantize_input(self, x2d, tensors):
        from comfy_kitchen.tensor import QuantizedTensor
        return QuantizedTensor.from_float(x2d, self.layout, scale=tensors.get("input_scale"))


@register_format
class Nvfp4Format(BlockFormat):
    name = NAME
    marker = True
    kitchen_layouts = (LAYOUT,)
    conversion_modes = ("auto", "requantize")   # requantize: off sm100+, to the GPU's fastest native format
    conversion_option = NAME
    conversion_tooltip = ("NVFP4 layers run natively only on sm100+ GPUs. auto: native there, elsewhere dequantized "
                          "before each matmul (correct, saves memory, not fast). requantize: elsewhere, re-quantize "
                          "them at load to this GPU's fastest native format (FP8 on sm89/sm90, INT8 ConvRot before "
                          "that and on CPU); the report says which happened.")
    quantizing_conversion = "requantize"   # a load that quantizes anyway converts them where they are not native
    contract = Contract(
        required=frozenset({"weight", "weight_scale", "weight_scale_2"}),
        optional=frozenset({"input_scale", PRE_QUANT_SCALE}), shapes={PRE_QUANT_SCALE: "K"},
        weight_dtypes=("U8",), weight_note="packed E2M1 pairs", pack=2, pad=16,
        block=16, block_scale_dtypes=("F8_E4M3", "U8"),
        encodings={"weight_scale": "F8_E4M3", "weight_scale_2": "float", "input_scale": "float",
                   PRE_QUANT_SCALE: "float"},
        views={"weight_scale": torch.float8_e4m3fn}, stored_max=6.0)   # E2M1's largest value

    def method(self, **_) -> Nvfp4Method:
        return Nvfp4Method()

    def native(self, device: torch.device) -> bool:
        return Nvfp4Method().native_supported(device)
