"""comfy-kitchen beyond its public names, in one place (checked on 0.2.31 and 0.2.40).

- `apply_input_act`: kitchen's own reference of the activations its fused linear
  kernels apply (swiglu, gelu_tanh, ...), so that the pack's unfused paths compute
  what the fused ones do. It lives in the private module
  `comfy_kitchen.backends._activations`; kitchen exports no public name for it.
- `storage`: a QuantizedTensor's packed data (`_qdata`). Kitchen exposes its shape,
  dtype and bytes (`storage_shape`, `storage_dtype`, `nbytes`) but not the tensor,
  which page-locking the host copy in place needs (`state_dict()[""]` is that tensor
  in every layout today, but kitchen does not promise it is not a copy).
Everything else uses public names: `QuantizedTensor.params`, `.layout_cls`, `.nbytes`,
`.storage_dtype`, `.state_dict()`, `comfy_kitchen.tensor.get_layout_class`.
comfy-kitchen is imported only when called, so the pack starts without it.
"""
from __future__ import annotations

import dataclasses

import torch


def is_quantized_tensor(t) -> bool:
    """A comfy-kitchen QuantizedTensor (by type name: no import of comfy-kitchen)."""
    return type(t).__name__ == "QuantizedTensor"


def apply_input_act(x: torch.Tensor, input_act: str | None) -> torch.Tensor:
    from comfy_kitchen.backends._activations import apply_input_act as kitchen_apply_input_act
    return kitchen_apply_input_act(x, input_act)


def storage(t: torch.Tensor) -> torch.Tensor:
    """The tensor holding a QuantizedTensor's packed data; any other tensor itself."""
    return t._qdata if is_quantized_tensor(t) else t


def layout_name(t: torch.Tensor) -> str:
    """A QuantizedTensor's layout, e.g. "TensorWiseINT8Layout"."""
    return t.layout_cls.__name__


def tensor_bytes(t: torch.Tensor) -> int:
    """Bytes a tensor really occupies: a QuantizedTensor's packed data plus its tensor params
    (its numel and element_size describe the dequantized tensor)."""
    if is_quantized_tensor(t):
        params = t.params
        return t.nbytes + sum(value.numel() * value.element_size()
                              for value in (getattr(params, f.name) for f in dataclasses.fields(params))
                              if isinstance(value, torch.Tensor))
    return t.numel() * t.element_size()
