"""QuantLinear: the module that replaces an nn.Linear whose weight was quantized.

It holds the method's stored tensors as frozen parameters (so `.to()`,
`state_dict()` and ComfyUI's size accounting see their true bytes) and
delegates the forward to the method.
"""
from __future__ import annotations

import torch
from torch import nn

from .method import LinearMethod


class QuantLinear(nn.Module):
    def __init__(self, method: LinearMethod, in_features: int, out_features: int,
                 tensors: dict[str, torch.Tensor], bias: torch.Tensor | None,
                 compute_dtype: torch.dtype):
        super().__init__()
        self.method = method
        self.in_features = in_features
        self.out_features = out_features
        self.compute_dtype = compute_dtype
        for key, tensor in tensors.items():
            self.register_parameter(key, nn.Parameter(tensor, requires_grad=False))
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)
        # ComfyUI's partial loading marks modules it leaves in RAM with
        # comfy_cast_weights; such a layer is then moved per call (see tensors_for).
        self.comfy_cast_weights = False
        self.weight_function: list = []
        self.bias_function: list = []
        # While ComfyUI has a LoRA written into this layer: the scales it replaced,
        # and the patched weight, whose replacement means the patch is gone (see set_weight).
        self._unpatched_scales: dict[str, nn.Parameter] | None = None
        self._patched_weight: nn.Parameter | None = None

    def tensors_for(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        """This layer's parameters on x's device (a per-call copy when offloaded)."""
        out = {}
        for key, param in self._parameters.items():
            if param is None:
                continue
            out[key] = param if param.device == x.device else param.to(x.device, non_blocking=True)
        return out

    def forward(self, x: torch.Tensor, input_act: str | None = None) -> torch.Tensor:
        self._drop_stale_patch()
        if self.weight_function or self.bias_function:
            return self._forward_patched(x, input_act)
        return self.method.apply(self, x, input_act=input_act)

    def _forward_patched(self, x: torch.Tensor, input_act: str | None) -> torch.Tensor:
        """ComfyUI's per-call weight patches (LoRA under partial loading) act on the dequantized weight."""
        from .kitchen_api import apply_input_act
        weight = self.method.dequantize(self).to(x.device, x.dtype)
        for patch in self.weight_function:
            weight = patch(weight)
        bias = None if self.bias is None else self.bias.to(x.device, x.dtype)
        for patch in self.bias_function:
            bias = patch(bias)
        return torch.nn.functional.linear(apply_input_act(x, input_act), weight, bias)

    # ComfyUI's weight-patch protocol (ModelPatcher looks these up by name):
    # LoRA is computed on the dequantized weight and written back quantized.
    def convert_weight(self, weight: torch.Tensor, inplace: bool = False, **_) -> torch.Tensor:
        return self.method.dequantize(self).to(device=weight.device, dtype=weight.dtype)

    def set_weight(self, weight: torch.Tensor, inplace_update: bool = False, seed=None, **_) -> None:
        """Requantize a patched weight with fresh scales (a LoRA may widen a row's range).

        ComfyUI backs up and later restores only `weight`, so the scales it
        replaces are kept here and put back once the weight is restored.
        """
        if inplace_update:
            # An in-place restore would bring back the weight but not the scales, unnoticed.
            raise RuntimeError("in-place weight patching (weight_inplace_update) of a quantized layer is not "
                               "supported; patch the model before quantizing it instead")
        fresh = self.method.quantize_weight(weight.to(self.compute_dtype))
        if self._unpatched_scales is None:
            self._unpatched_scales = {k: getattr(self, k) for k in fresh if k != "weight"}
        for key, tensor in fresh.items():
            # New Parameters, never writes into the old storage: ComfyUI's backup may share it.
            setattr(self, key, nn.Parameter(tensor.to(getattr(self, key).device), requires_grad=False))
        self._patched_weight = self.weight

    def _drop_stale_patch(self) -> None:
        """Put the original scales back once ComfyUI has restored the unpatched weight."""
        if self._unpatched_scales is None:
            return
        if self.weight is self._patched_weight:
            return
        for key, param in self._unpatched_scales.items():
            setattr(self, key, param)
        self._unpatched_scales = self._patched_weight = None

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias is not None}, format={self.method.describe()}")
