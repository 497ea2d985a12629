"""QuantLinear: the module that replaces an nn.Linear whose weight was quantized.

It holds the method's stored tensors as frozen parameters (so `.to()`,
`state_dict()` and ComfyUI's size accounting see their true bytes) and
delegates the forward to the method.
"""
from __future__ import annotations

import torch
from torch import nn

from .method import LinearMethod
from .witness import count_run


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
        # Upstream's dynamic VRAM attaches a LoRA here instead of in weight_function
        # (its cast layers apply it while copying the weight in); see _patches.
        self.weight_lowvram_function = None
        self.bias_lowvram_function = None
        # While ComfyUI has a LoRA written into this layer: (the patched weight, the
        # scales it replaced); once `weight` is another tensor, ComfyUI restored it (see set_weight).
        # A tuple, so that nn.Module does not register the weight as a second parameter.
        self._patch: tuple[nn.Parameter, dict[str, nn.Parameter]] | None = None
        self.runs = 0  # calls, for the run-time witness (quant/witness.py)

    def tensors_on(self, device: torch.device | None = None) -> dict[str, torch.Tensor]:
        """This layer's parameters on `device` (default: the weight's); a per-call copy of those elsewhere.

        ComfyUI's partial loading leaves whole layers in RAM; upstream's dynamic
        VRAM leaves the weight and bias there and moves the other tensors.
        """
        self._drop_stale_patch()
        device = self.weight.device if device is None else device
        out = {}
        for key, param in self._parameters.items():
            if param is None:
                continue
            # Only host-to-device copies may be asynchronous: a tensor copied to the CPU is read at once.
            out[key] = param if param.device == device else param.to(device, non_blocking=device.type != "cpu")
        return out

    def tensors_for(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        """This layer's parameters on x's device."""
        return self.tensors_on(x.device)

    def stored_tensors(self) -> dict[str, torch.Tensor]:
        """The method's tensors by role (bias excluded), as a checkpoint stores them.

        Raises while ComfyUI has a weight patch (e.g. a LoRA) written into the
        layer: the tensors would carry it.
        """
        self._drop_stale_patch()
        if self._patch is not None:
            raise RuntimeError("a weight patch (e.g. a LoRA) is written into this layer")
        return {key: param for key, param in self._parameters.items() if param is not None and key != "bias"}

    def forward(self, x: torch.Tensor, input_act: str | None = None) -> torch.Tensor:
        count_run(self)
        weight_patches, bias_patches = self._patches("weight"), self._patches("bias")
        if weight_patches or bias_patches:
            return self._forward_patched(x, input_act, weight_patches, bias_patches)
        return self.method.apply(self, x, input_act=input_act)

    def _patches(self, name: str) -> list:
        """ComfyUI's per-call patches of `name`, in the order its own cast layers apply them."""
        lowvram = getattr(self, f"{name}_lowvram_function")
        return ([] if lowvram is None else [lowvram]) + list(getattr(self, f"{name}_function"))

    def _forward_patched(self, x: torch.Tensor, input_act: str | None, weight_patches: list,
                         bias_patches: list) -> torch.Tensor:
        """ComfyUI's per-call weight patches (LoRA under partial loading or dynamic VRAM) act on the
        dequantized weight."""
        from .kitchen_api import apply_input_act
        weight = self.method.dequantize(self, x.device).to(x.dtype)
        for patch in weight_patches:
            weight = patch(weight)
        bias = None if self.bias is None else self.bias.to(x.device, x.dtype)
        for patch in bias_patches:
            bias = patch(bias)
        return torch.nn.functional.linear(apply_input_act(x, input_act), weight, bias)

    # ComfyUI's weight-patch protocol (ModelPatcher looks these up by name):
    # LoRA is computed on the dequantized weight and written back quantized.
    def convert_weight(self, weight: torch.Tensor, inplace: bool = False, **_) -> torch.Tensor:
        # `weight` is a float copy for a LoRA, or, in upstream's dynamic VRAM forced load, a copy of the
        # stored tensor (int8, fp8, packed): a float comes back either way, never the storage dtype.
        dtype = weight.dtype if weight.dtype in (torch.float16, torch.bfloat16, torch.float32) else self.compute_dtype
        return self.method.dequantize(self, weight.device).to(dtype)

    def set_weight(self, weight: torch.Tensor, inplace_update: bool = False, seed=None, return_weight: bool = False,
                   **_) -> torch.Tensor | None:
        """Requantize a patched weight with fresh scales (a LoRA may widen a row's range).

        ComfyUI backs up and later restores only `weight`, so the scales it
        replaces are kept here and put back once the weight is restored.
        With `return_weight` (0.3.75's partial loading, model saving) nothing is
        stored: the weight this layer would compute with comes back, in `weight`'s dtype.
        """
        fresh = self.method.quantize_weight(weight.to(self.compute_dtype))
        if return_weight:
            stored = QuantLinear(self.method, self.in_features, self.out_features, fresh, None, self.compute_dtype)
            return self.method.dequantize(stored).to(weight.dtype)
        if inplace_update:
            # An in-place restore would bring back the weight but not the scales, unnoticed.
            raise RuntimeError("in-place weight patching (weight_inplace_update) of a quantized layer is not "
                               "supported; patch the model before quantizing it instead")
        self._drop_stale_patch()
        if self._patch is None:
            unpatched_scales = {k: getattr(self, k) for k in fresh if k != "weight"}
        else:  # patched again on top of a patch: the scales to restore are still the first ones
            unpatched_scales = self._patch[1]
        for key, tensor in fresh.items():
            # New Parameters, never writes into the old storage: ComfyUI's backup may share it.
            setattr(self, key, nn.Parameter(tensor.to(getattr(self, key).device), requires_grad=False))
        self._patch = (self.weight, unpatched_scales)

    def _drop_stale_patch(self) -> None:
        """Put the original scales back once ComfyUI has restored the unpatched weight.

        Runs before anything reads the layer's tensors: a restored weight read
        with the patched scales would be a wrong weight (e.g. the base of the next LoRA patch).
        """
        if self._patch is None or self.weight is self._patch[0]:
            return
        for key, param in self._patch[1].items():
            setattr(self, key, param)
        self._patch = None

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias is not None}, format={self.method.describe()}")
