"""comfy-kitchen beyond its public names, in one place (checked on 0.2.31 and 0.2.40).

- `apply_input_act`: kitchen's own reference of the activations its fused linear
  kernels apply (swiglu, gelu_tanh, ...), so that the pack's unfused paths compute
  what the fused ones do. It lives in the private module
  `comfy_kitchen.backends._activations`; kitchen exports no public name for it.
- `hadamard`: the normalized ConvRot matrix kitchen rotates weights and activations by
  (`comfy_kitchen.tensor.int8_utils._build_hadamard`), for the pack's own INT8 kernels (int8_triton.py),
  which must rotate by the very same matrix.
- `refuses_rotation_group`: kitchen's CUDA ConvRot kernels refuse a rotation group they were not built for
  with a RuntimeError and no constraint its dispatcher could read first (0.2.31's weight rotation takes 256 only:
  "convrot rotate kernel only supports group_size 256"); its message is what tells that refusal from a failure.
- `storage`: a QuantizedTensor's packed data (`_qdata`). Kitchen exposes its shape,
  dtype and bytes (`storage_shape`, `storage_dtype`, `nbytes`) but not the tensor,
  which page-locking the host copy in place needs (`state_dict()[""]` is that tensor
  in every layout today, but kitchen does not promise it is not a copy).
`require_kitchen`: the one error where a node would build quantized layers without it.
Everything else uses public names: `QuantizedTensor.params`, `.layout_cls`, `.nbytes`,
`.storage_dtype`, `.state_dict()`, `comfy_kitchen.tensor.get_layout_class`.
comfy-kitchen is imported only when called, so the pack starts without it.

ComfyUI 0.3.75 has a QuantizedTensor of its own (comfy.quant_ops, before kitchen), which its
UNETLoader builds for comfy_quant marker files: a layout name string in `layout_type` and a
dict `_layout_params` instead of `layout_cls` and `params`. The functions here read both.
"""
from __future__ import annotations

import dataclasses
import re

import torch


def is_quantized_tensor(t) -> bool:
    """A comfy-kitchen QuantizedTensor (by type name: no import of comfy-kitchen)."""
    return type(t).__name__ == "QuantizedTensor"


def apply_input_act(x: torch.Tensor, input_act: str | None) -> torch.Tensor:
    from comfy_kitchen.backends._activations import apply_input_act as kitchen_apply_input_act
    return kitchen_apply_input_act(x, input_act)


def hadamard(size: int, device: torch.device) -> torch.Tensor:
    """Kitchen's normalized regular Hadamard matrix of `size` (a power of 4), fp32, contiguous."""
    from comfy_kitchen.tensor.int8_utils import _build_hadamard
    return _build_hadamard(size, device=device, dtype=torch.float32).contiguous()


_GROUP_REFUSAL = re.compile(r"convrot \w+ kernel only supports group_size")


def refuses_rotation_group(exc: BaseException) -> bool:
    """Whether `exc` is comfy-kitchen's CUDA ConvRot kernel refusing a rotation group."""
    return isinstance(exc, RuntimeError) and _GROUP_REFUSAL.search(str(exc)) is not None


def storage(t: torch.Tensor) -> torch.Tensor:
    """The tensor holding a QuantizedTensor's packed data; any other tensor itself."""
    return t._qdata if is_quantized_tensor(t) else t


def layout_name(t: torch.Tensor) -> str:
    """A QuantizedTensor's layout, e.g. "TensorWiseINT8Layout"."""
    layout = getattr(t, "layout_cls", None) or t.layout_type
    return layout if isinstance(layout, str) else layout.__name__


def storage_dtype(t: torch.Tensor) -> torch.dtype:
    """The dtype a QuantizedTensor stores its data in (its own dtype is the dequantized one)."""
    return getattr(t, "storage_dtype", None) or storage(t).dtype


def layout_params(t: torch.Tensor) -> dict:
    """A QuantizedTensor's layout parameters by name (scales, flags)."""
    params = getattr(t, "params", None)
    if params is None:
        return dict(t._layout_params)
    return {f.name: getattr(params, f.name) for f in dataclasses.fields(params)}


def tensor_bytes(t: torch.Tensor) -> int:
    """Bytes a tensor really occupies: a QuantizedTensor's packed data plus its tensor params
    (its numel and element_size describe the dequantized tensor)."""
    if is_quantized_tensor(t):
        return t.nbytes + sum(value.numel() * value.element_size()
                              for value in layout_params(t).values() if isinstance(value, torch.Tensor))
    return t.numel() * t.element_size()


NEEDS_KITCHEN = ("QuantizeModelINT8", "MixedCheckpointLoader (quantized files)",
                 "LoadH3Quantized (a quantization other than none, or a quantized file)",
                 "QuantizedCLIPLoader (quantized files)")


class KitchenMissing(RuntimeError):
    pass


def kitchen_missing() -> str | None:
    """Why comfy-kitchen cannot be imported, or None when it can.

    Every method's forward runs on it (its activation, INT8 and block-format
    kernels, with eager CPU references), so callers check this before building
    quantized layers rather than fail at the first forward.
    """
    try:
        import comfy_kitchen  # noqa: F401
    except ImportError as exc:
        return str(exc)
    return None


def require_kitchen(node: str) -> None:
    """Where comfy-kitchen is missing the server still starts; a node that would build quantized layers
    fails when it loads, naming the package and the nodes affected."""
    why = kitchen_missing()
    if why is not None:
        raise KitchenMissing(
            f"{node} needs the package comfy-kitchen, which cannot be imported ({why}). Every quantized layer of "
            f"this pack runs on it, so without it these nodes refuse to build quantized models: "
            f"{', '.join(NEEDS_KITCHEN)}. Install it into ComfyUI's Python environment (pip install comfy-kitchen; "
            f"the pack's requirements.txt names the version).")
