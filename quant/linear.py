"""QuantLinear: the module that replaces an nn.Linear whose weight was quantized.

It holds the method's stored tensors as frozen parameters (so `.to()`,
`state_dict()` and ComfyUI's size accounting see their true bytes) and
delegates the forward to the method. `quantized_layer` makes one from a
full-precision weight, for every caller.
"""
from __future__ import annotations

from typing import Callable, Protocol

import torch
from torch import nn

from ..dtypes import FLOAT_DTYPES
from .descriptor import PRE_QUANT_SCALE
from .kitchen_api import apply_input_act
from .witness import count_run


class LayerMethod(Protocol):
    """What a QuantLinear needs of its method; every LinearMethod (quant/linear_method.py) is one.

    Spelled out here so that this module, which the methods build on, does not import them."""
    name: str

    def quantize_weight(self, weight: torch.Tensor) -> dict[str, torch.Tensor]: ...

    def apply(self, layer: "QuantLinear", x: torch.Tensor, input_act: str | None = None) -> torch.Tensor: ...

    def dequantize(self, layer: "QuantLinear", device: torch.device | None = None) -> torch.Tensor: ...

    def describe(self) -> str: ...


def quantized_layer(method: LayerMethod, weight: torch.Tensor, in_features: int, out_features: int,
                    bias: torch.Tensor | None, compute_dtype: torch.dtype, device: torch.device,
                    home: torch.device, to_home: Callable[[torch.Tensor], torch.Tensor] | None = None
                    ) -> "QuantLinear":
    """`weight` [out, in] quantized by `method` on `device`, as a QuantLinear whose tensors live on `home`
    (moved there by `to_home` if given: a loader's pinned staging).

    The one way a quantized layer is made from a full-precision weight: the
    quantization pass, auto's measurement and the loaders all build through it,
    so only this layer's weight is on `device` at a time. `weight` is not modified.
    """
    with torch.no_grad():
        tensors = method.quantize_weight(weight.to(device))
    move = to_home or (lambda t: t.to(home))
    tensors = {k: move(v) for k, v in tensors.items()}
    return QuantLinear(method, in_features, out_features, tensors, bias, compute_dtype)


class QuantLinear(nn.Module):
    def __init__(self, method: LayerMethod, in_features: int, out_features: int,
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
        # Where the host pages weight and bias itself (upstream's dynamic VRAM, nodes/dynamic_vram.py):
        # `weight_pager(layer, device)` is a context manager yielding {"weight", "bias"} on `device` for
        # one call, or None where the host does not page this layer.
        self.weight_pager: Callable | None = None
        self._paged: dict[str, torch.Tensor | None] | None = None
        self.weight_function: list = []
        self.bias_function: list = []
        # Upstream's dynamic VRAM attaches a LoRA here instead of in weight_function
        # (its cast layers apply it while copying the weight in); see _patches.
        self.weight_lowvram_function = None
        self.bias_lowvram_function = None
        # While ComfyUI has a LoRA written into this layer: the tensors it replaced (see set_weight).
        # A plain dict, so that nn.Module does not register them as parameters.
        self._unpatched: dict[str, nn.Parameter] | None = None
        self.runs = 0  # calls, for the run-time witness (quant/witness.py)

    def tensors_on(self, device: torch.device | None = None) -> dict[str, torch.Tensor]:
        """This layer's parameters on `device` (default: the weight's); a per-call copy of those elsewhere.

        ComfyUI's partial loading leaves whole layers in RAM; upstream's dynamic
        VRAM leaves the weight and bias there and moves the other tensors.
        """
        device = self.weight.device if device is None else device
        out = {}
        paged = self._paged if self._paged is not None and self._paged["weight"].device == device else {}
        for key, param in self._parameters.items():
            if key in paged:
                param = paged[key]
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
        if self._unpatched is not None:
            raise RuntimeError("a weight patch (e.g. a LoRA) is written into this layer")
        return {key: param for key, param in self._parameters.items() if param is not None and key != "bias"}

    def forward(self, x: torch.Tensor, input_act: str | None = None) -> torch.Tensor:
        count_run(self)
        if self.weight_pager is None:
            return self._forward(x, input_act)
        with self.weight_pager(self, x.device) as paged:
            self._paged = paged
            try:
                return self._forward(x, input_act)
            finally:
                self._paged = None

    def _forward(self, x: torch.Tensor, input_act: str | None) -> torch.Tensor:
        pre_scale = self._parameters.get(PRE_QUANT_SCALE)
        if pre_scale is not None:
            # a smoothing scale (AWQ) multiplies the input before all else, as in upstream ComfyUI's Linear:
            # under a LoRA too, which patches the stored weight
            x = apply_input_act(x, input_act) * pre_scale.to(x.device, x.dtype)
            input_act = None
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
        weight = self.method.dequantize(self, x.device).to(x.dtype)
        for patch in weight_patches:
            weight = patch(weight)
        bias = self._paged["bias"] if self._paged is not None else self.bias
        bias = None if bias is None else bias.to(x.device, x.dtype)
        for patch in bias_patches:
            bias = patch(bias)
        return torch.nn.functional.linear(apply_input_act(x, input_act), weight, bias)

    # ComfyUI's weight-patch protocol (ModelPatcher looks these up by name):
    # LoRA is computed on the dequantized weight and written back quantized.
    def convert_weight(self, weight: torch.Tensor, inplace: bool = False, **_) -> torch.Tensor:
        """The dequantized weight ComfyUI's patches apply to: the unpatched one where this layer holds it.

        ComfyUI computes a weight patch from its backup of the unpatched weight
        and expects to find that weight in the layer. A layer whose LoRA was
        folded in while it was offloaded (nodes/lora_fold.py) and that ComfyUI
        then loads onto the GPU is patched again: from the unpatched weight, or
        the LoRA would be added twice. `weight` is a float copy for a LoRA, or,
        in upstream's dynamic VRAM forced load, a copy of the stored tensor
        (int8, fp8, packed): a float comes back either way, never the storage dtype.
        """
        dtype = weight.dtype if weight.dtype in FLOAT_DTYPES else self.compute_dtype
        source = self
        if self._unpatched is not None and "weight" in self._unpatched:
            held = {k: v for k, v in self._parameters.items() if v is not None and k != "bias"}
            source = QuantLinear(self.method, self.in_features, self.out_features, {**held, **self._unpatched},
                                 None, self.compute_dtype)
        return self.method.dequantize(source, weight.device).to(dtype)

    def set_weight(self, weight: torch.Tensor, inplace_update: bool = False, seed=None, return_weight: bool = False,
                   **_) -> torch.Tensor | None:
        """Requantize a patched weight with fresh scales (a LoRA may widen a row's range).

        ComfyUI backs up and later restores only `weight`, so the tensors it
        replaces are kept here and put back when ComfyUI assigns the weight
        again (register_parameter). The unpatched weight itself is kept where it
        costs nothing: in host memory, where ComfyUI's backup is the same tensor.
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
        if self._unpatched is None:  # else a patch on top of a patch: the originals are still the first ones
            in_ram = self.weight.device.type == "cpu"
            self._unpatched = {k: getattr(self, k) for k in fresh if k != "weight" or in_ram}
        for key, tensor in fresh.items():
            # New Parameters, never writes into the old storage: ComfyUI's backup may share it. Written
            # into _parameters directly: an assignment of `weight` is ComfyUI restoring it.
            self._parameters[key] = nn.Parameter(tensor.to(getattr(self, key).device), requires_grad=False)

    def register_parameter(self, name: str, param: nn.Parameter | None) -> None:
        """Assigning `weight` while a patch is written in is ComfyUI restoring the unpatched weight
        (unpatch_model, partially_unload): the scales it replaced come back with it.

        An assignment, not a comparison with the patched tensor: the pack's
        streaming (offload/streaming.py) swaps a streamed layer's tensors for
        device copies in `_parameters` for the duration of a block.
        """
        unpatched = self.__dict__.get("_unpatched")
        if name == "weight" and unpatched is not None:
            self._unpatched = None
            for key, tensor in unpatched.items():
                if key != "weight":
                    self._parameters[key] = tensor
        super().register_parameter(name, param)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias is not None}, format={self.method.describe()}")
