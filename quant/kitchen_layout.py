"""Base for formats that comfy-kitchen holds as a QuantizedTensor layout (NVFP4, MXFP8, W4A4, W4A8).

A layout whose linear quantizes the activations itself (QUANTIZES_INPUT False: ConvRot W4A4, W4A8)
runs F.linear on the float input on every device, as upstream ComfyUI runs it: kitchen picks its
kernel, or its eager reference on CPU, and the numbers are the host's. For the others, where the GPU
has the layout's native GEMM (its MIN_SM_VERSION), activations are quantized to the same layout and
F.linear dispatches to kitchen's kernel; elsewhere, CPU included, kitchen dequantizes the weight and
a plain matmul runs in the activations' dtype: correct, but it only saves memory.
"""
from __future__ import annotations

from typing import Callable, TypeVar

import torch
import torch.nn.functional as F

from ..hardware import cuda_capability
from ..pack_logging import pack_logger
from .descriptor import QuantFormat
from .kitchen_api import refuses_rotation_group
from .layer import Layer
from .linear_method import LinearMethod, output_dtype

log = pack_logger(__name__)
T = TypeVar("T")
# (layout, rotation group) whose weights kitchen's CUDA ConvRot kernel refused: learned once per process
_REFUSED_GROUPS: set[tuple[str, int | None]] = set()


class KitchenLayoutMethod(LinearMethod):
    #: comfy-kitchen layout name, e.g. "TensorCoreNVFP4Layout"
    layout: str = ""

    def layout_class(self):
        from comfy_kitchen.tensor import get_layout_class
        return get_layout_class(self.layout)

    def native_supported(self, device: torch.device) -> bool:
        capability = cuda_capability(device)  # first, so CPU never imports comfy-kitchen here
        return capability is not None and capability >= self.layout_class().MIN_SM_VERSION

    def missing(self) -> str | None:
        from importlib.metadata import version

        from comfy_kitchen.tensor import get_layout_class
        try:
            get_layout_class(self.layout)
        except KeyError:
            return f"comfy-kitchen's {self.layout}, which comfy-kitchen {version('comfy-kitchen')} lacks"
        return None

    def kitchen_backend(self, device: torch.device) -> str | None:
        """A comfy-kitchen backend this layer must run on at `device` (None: kitchen picks), where kitchen's
        own choice would take a kernel that cannot run this layer."""
        return None

    def rotation_group(self) -> int | None:
        """The ConvRot group the layer's weight is rotated in (None: not rotated)."""
        return None

    def on_kitchen(self, run: Callable[[], T]) -> T:
        """`run()`, a kitchen call on this layer's weight (its quantization or dequantization), on the backend kitchen
        picks; where kitchen's CUDA ConvRot kernel refuses the layer's rotation group (0.2.31's weight rotation takes
        256 only), on kitchen's eager backend, whose rotation is a torch product with the group's Hadamard matrix on
        the same device: the same layout, upstream's CPU numbers. Learned from the first refusal, per layout and
        group; any other error is raised."""
        known = (self.layout, self.rotation_group())
        if known not in _REFUSED_GROUPS:
            try:
                return run()
            except RuntimeError as exc:
                if not refuses_rotation_group(exc):
                    raise
                _REFUSED_GROUPS.add(known)
                log.warning("comfy-kitchen's CUDA kernel refuses %s's rotation group %s (%s): its weights are quantized "
                            "and dequantized on kitchen's eager backend, a torch rotation on the same device",
                            self.layout, known[1], exc)
        import comfy_kitchen
        with comfy_kitchen.use_backend("eager"):
            return run()

    def quantizes_input(self) -> bool:
        """Whether F.linear needs the input quantized first (else kitchen's linear quantizes it)."""
        return getattr(self.layout_class(), "QUANTIZES_INPUT", True)

    def layout_params(self, tensors: dict[str, torch.Tensor], layer, dtype: torch.dtype):
        """The layout's Params for this layer's stored tensors, dequantizing to `dtype`."""
        raise NotImplementedError

    def kitchen_tensor(self, tensors: dict[str, torch.Tensor], layer, dtype: torch.dtype | None = None):
        from comfy_kitchen.tensor import QuantizedTensor
        dtype = layer.compute_dtype if dtype is None else dtype
        return QuantizedTensor(tensors["weight"], self.layout, self.layout_params(tensors, layer, dtype))

    def quantize_input(self, x2d: torch.Tensor, tensors: dict[str, torch.Tensor]):
        from comfy_kitchen.tensor import QuantizedTensor
        return QuantizedTensor.from_float(x2d, self.layout)

    def dequantize(self, layer, device=None) -> torch.Tensor:
        weight = self.kitchen_tensor(layer.tensors_on(device), layer)
        return self.on_kitchen(weight.dequantize)

    def apply(self, layer, x: torch.Tensor, input_act: str | None = None) -> torch.Tensor:
        from .kitchen_api import apply_input_act
        t = layer.tensors_for(x)
        out_dtype = output_dtype(x, layer.compute_dtype)
        x2d = apply_input_act(x.reshape(-1, x.shape[-1]), input_act).to(out_dtype)
        bias = t.get("bias")
        bias = None if bias is None else bias.to(out_dtype)
        weight = self.kitchen_tensor(t, layer, out_dtype)
        if not self.quantizes_input():
            backend = self.kitchen_backend(x.device)
            if backend is None:
                out = F.linear(x2d, weight, bias)
            else:
                import comfy_kitchen
                with comfy_kitchen.use_backend(backend):
                    out = F.linear(x2d, weight, bias)
        elif self.native_supported(x.device):
            out = F.linear(self.quantize_input(x2d, t), weight, bias)
        else:
            out = F.linear(x2d, weight.dequantize().to(out_dtype), bias)
        return out.reshape(*x.shape[:-1], layer.out_features)


class BlockFormat(QuantFormat):
    """A block-scaled format native only on some GPUs (NVFP4, MXFP8: sm100+). Elsewhere its layers run
    dequantized before each matmul, or, under the mode "requantize" where the format offers it, are
    re-quantized at load to the device's fastest native format."""

    def stored_decision(self, layer, mode, context) -> Layer:
        if self.native(context.device):
            return layer.conversion(None, "already quantized", "native comfy-kitchen GEMM", "native GEMM")
        if mode == "requantize" and mode in self.conversion_modes:
            targets = context.fastest_native(layer)
            if targets:
                label = f"re-quantized at load to {targets[0].describe()}"
                return layer.conversion(targets[0], label, label, label)
        return layer.conversion(None, "already quantized", "dequantized before each matmul", "dequantized per call")
