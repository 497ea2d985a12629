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

    @property
    def quant_format(self) -> str:
        return self.method.name

    def tensors_for(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        """This layer's parameters on x's device (a per-call copy when offloaded)."""
        out = {}
        for key, param in self._parameters.items():
            if param is None:
                continue
            out[key] = param if param.device == x.device else param.to(x.device, non_blocking=True)
        return out

    def forward(self, x: torch.Tensor, input_act: str | None = None) -> torch.Tensor:
        return self.method.apply(self, x, input_act=input_act)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias is not None}, format={self.method.describe()}")
