"""The formats and selectors by name, filled by decorators in their own modules.

`@register_format` on a QuantFormat subclass (one per format module) and
`register_selector` (auto) are the only ways in; everything else looks formats
up here. The imports at the bottom fix the order formats are listed in.
"""
from __future__ import annotations

from typing import Callable

from .descriptor import QuantFormat
from .selector import Selector

_FORMATS: dict[str, QuantFormat] = {}
_SELECTORS: dict[str, Callable[..., Selector]] = {}


def register_format(cls: type[QuantFormat]) -> type[QuantFormat]:
    """Class decorator: registers one instance of the format under its `name`."""
    if not cls.name or cls.name in _FORMATS or cls.name in _SELECTORS:
        raise ValueError(f"format name {cls.name!r} is empty or taken")
    _FORMATS[cls.name] = cls()
    return cls


def register_selector(name: str):
    """Decorator for a factory of a Selector (options as get_method's) under `name`."""
    def register(factory: Callable[..., Selector]) -> Callable[..., Selector]:
        if name in _FORMATS or name in _SELECTORS:
            raise ValueError(f"selector name {name!r} is taken")
        _SELECTORS[name] = factory
        return factory
    return register


def formats() -> dict[str, QuantFormat]:
    return dict(_FORMATS)


def format_spec(name: str) -> QuantFormat | None:
    return _FORMATS.get(name)


def marker_formats() -> dict[str, QuantFormat]:
    """The ComfyUI marker formats the loaders read, by name."""
    return {name: spec for name, spec in _FORMATS.items() if spec.marker}


def marker_format_list(labels: bool = False) -> str:
    """The marker formats for the nodes' descriptions: "a, b, c" (with `labels`, as each format describes itself)."""
    return ", ".join((spec.label or name) if labels else name for name, spec in marker_formats().items())


def kitchen_format(layout: str) -> QuantFormat | None:
    """The format whose layers a comfy-kitchen layout holds, or None."""
    return next((spec for spec in _FORMATS.values() if layout in spec.kitchen_layouts), None)


def convention_formats() -> dict[str, QuantFormat]:
    """The formats that read an older file convention (scaled_fp8, quanto), by convention."""
    return {spec.convention: spec for spec in _FORMATS.values() if spec.convention}


def conversion_format(option: str) -> QuantFormat:
    """The format whose stored layers a loader input named `option` converts (its `conversion_option`)."""
    found = next((spec for spec in _FORMATS.values() if spec.conversion_option == option), None)
    if found is None:
        raise ValueError(f"no format converts under the option {option!r}")
    return found


def loader_conversions(quantizing: bool = False) -> list[QuantFormat]:
    """The formats whose stored layers a loader input converts (a `conversion_option` with a tooltip), in the
    inputs' order; `quantizing`: those a load that quantizes still offers an input for."""
    found = [spec for spec in _FORMATS.values() if spec.conversion_option and spec.conversion_tooltip
             and not (quantizing and spec.quantizing_conversion)]
    return sorted(found, key=lambda spec: spec.conversion_rank)


def dtype_format(dtype) -> QuantFormat | None:
    """The format whose layers a weight stored in this (non-float) torch dtype is, or None."""
    return next((spec for spec in _FORMATS.values() if dtype in spec.storage_dtypes), None)


def online_formats() -> tuple[str, ...]:
    return tuple(name for name, spec in _FORMATS.items() if spec.online)


def rotation_formats() -> tuple[str, ...]:
    """The online formats whose group_size is a ConvRot rotation group (QuantizeModelINT8's choices)."""
    return tuple(name for name, spec in _FORMATS.items() if spec.online and spec.rotation_group)


def group_sizes() -> tuple[int, ...]:
    """The nodes' group_size choices, largest first: the rotation groups the formats take."""
    return tuple(sorted({size for spec in _FORMATS.values() for size in spec.group_sizes}, reverse=True))


def online_summaries(names=None) -> str:
    """"name: summary." for each online format (or each of `names`), for the nodes' tooltips."""
    return " ".join(f"{name}: {_FORMATS[name].summary}." for name in (names or online_formats()))


def fit_formats() -> tuple[str, ...]:
    """The formats a load moves layers to when asked to fit its weights into fewer bytes, first choice first."""
    ranked = sorted((spec.fit_rank, name) for name, spec in _FORMATS.items() if spec.fit_rank is not None)
    return tuple(name for _, name in ranked)


def format_aliases() -> dict[str, str]:
    """Option spellings of earlier versions -> today's name."""
    return {alias: name for name, spec in _FORMATS.items() for alias in spec.aliases}


def available_methods() -> tuple[str, ...]:
    return (*_FORMATS, *_SELECTORS)


def get_method(name: str, **options):
    """A format's LinearMethod, or for a selector (`auto`) a Selector that picks one per layer shape."""
    if name in _FORMATS:
        return _FORMATS[name].method(**options)
    if name in _SELECTORS:
        return _SELECTORS[name](**options)
    raise ValueError(f"unknown quantization method {name!r}; valid: {', '.join(available_methods())}")


# The format modules register themselves on import; this order is the order formats are listed in.
from . import int8_convrot, fp8, nvfp4, mxfp8, mxfp4, convrot_w4a4, w4a8_int8, quanto_int8, auto  # noqa: E402,F401
