"""A selector picks a LinearMethod per layer shape and compute dtype (auto); QuantConfig's default may be one
instead of a method."""
from __future__ import annotations

from typing import TYPE_CHECKING, Protocol, runtime_checkable

if TYPE_CHECKING:
    import torch

    from .linear_method import LinearMethod


@runtime_checkable
class Selector(Protocol):
    def select(self, in_features: int, out_features: int, dtype: "torch.dtype") -> "tuple[LinearMethod | None, str]":
        """The method for a Linear of this shape that computes in `dtype` (its QuantLinear's compute_dtype),
        or None to keep it; and the reason the report gives."""
