"""Registry of quantization methods by format name."""
from __future__ import annotations

from typing import Callable

from .method import LinearMethod


def _int8_convrot(group_size: int = 256, row_split: str = "auto", **_) -> LinearMethod:
    from .int8_convrot import Int8ConvRotMethod
    return Int8ConvRotMethod(group_size=group_size, row_split=row_split)


_FACTORIES: dict[str, Callable[..., LinearMethod]] = {
    "int8_convrot": _int8_convrot,
}


def available_methods() -> tuple[str, ...]:
    return tuple(_FACTORIES)


def get_method(name: str, **options) -> LinearMethod:
    try:
        factory = _FACTORIES[name]
    except KeyError:
        raise ValueError(f"unknown quantization method {name!r}; valid: {', '.join(_FACTORIES)}") from None
    return factory(**options)
