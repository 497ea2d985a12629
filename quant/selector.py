"""A selector picks a LinearMethod per layer shape (auto); QuantConfig's default may be one instead of a method."""
from __future__ import annotations

from typing import TYPE_CHECKING, Protocol, runtime_checkable

if TYPE_CHECKING:
    from .linear_method import LinearMethod


@runtime_checkable
class Selector(Protocol):
    def select(self, in_features: int, out_features: int) -> "tuple[LinearMethod | None, str]":
        """The method for a Linear of this shape, or None to keep it; and the reason the report gives."""
