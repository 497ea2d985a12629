"""Registry of quantization methods by format name."""
from __future__ import annotations

from typing import Callable

from .linear_method import LinearMethod, default_device


def _int8_convrot(group_size: int = 256, row_split: str = "auto", **_) -> LinearMethod:
    from .int8_convrot import Int8ConvRotMethod
    return Int8ConvRotMethod(group_size=group_size, row_split=row_split)


def _fp8(**_) -> LinearMethod:
    from .fp8 import Fp8Method
    return Fp8Method()


def _mxfp4(min_output_dim: int | None = None, path: str = "auto", device=None, **_) -> LinearMethod:
    from .mxfp4 import MIN_OUTPUT_DIM, Mxfp4Method
    return Mxfp4Method(MIN_OUTPUT_DIM if min_output_dim is None else min_output_dim, path=path, device=device)


def _int8_tensorwise(convrot: bool = False, convrot_groupsize: int = 256, **_) -> LinearMethod:
    from .int8_convrot import Int8ConvRotMethod
    return Int8ConvRotMethod(group_size=convrot_groupsize, convrot=convrot)


def _nvfp4(**_) -> LinearMethod:
    from .nvfp4 import Nvfp4Method
    return Nvfp4Method()


def _mxfp8(**_) -> LinearMethod:
    from .mxfp8 import Mxfp8Method
    return Mxfp8Method()


def _quanto_qint8(**_) -> LinearMethod:
    from .quanto_int8 import QuantoInt8Method
    return QuantoInt8Method()


def _auto(group_size: int = 256, device=None, **_):
    import torch
    from .auto import AutoSelector
    return AutoSelector(torch.device(device) if device is not None else default_device(), group_size=group_size)


_FACTORIES: dict[str, Callable[..., LinearMethod]] = {
    "int8_convrot": _int8_convrot,
    "float8_e4m3fn": _fp8,
    "mxfp4": _mxfp4,
    "auto": _auto,
    "int8_tensorwise": _int8_tensorwise,
    "nvfp4": _nvfp4,
    "mxfp8": _mxfp8,
    "quanto_qint8": _quanto_qint8,
}


def available_methods() -> tuple[str, ...]:
    return tuple(_FACTORIES)


def get_method(name: str, **options):
    """A LinearMethod, or for `auto` a selector that picks one per layer shape."""
    try:
        factory = _FACTORIES[name]
    except KeyError:
        raise ValueError(f"unknown quantization method {name!r}; valid: {', '.join(_FACTORIES)}") from None
    return factory(**options)


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
