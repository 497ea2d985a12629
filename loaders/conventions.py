"""A file of an older quantization convention (ComfyUI's scaled_fp8, Quanto) as its format's reader sees it.

Each such convention belongs to the format whose layers its files hold, and that
format's module reads it (`QuantFormat.read_convention`, found through the
registry as `convention_formats()`). The reader needs the checked header, small
tensors read from the file and the loaders' contract checks; `ConventionFile`
hands it exactly those, so the format module imports nothing of loaders/.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from .errors import CheckpointError, name_list
from .layers import (Check, LayerFormat, Problems, check_scales, checked, expect_dtype, float_scale, is_scalar)
from .safetensors_header import HeaderReader, SafetensorsHeader, parse_json, short_repr


@dataclass
class ConventionLayers:
    """What a convention's reader found: the file's kind for the report, its layers, the keys they claim
    beyond their tensors (markers), and notes."""
    kind: str
    layers: dict[str, LayerFormat]
    claimed: set[str] = field(default_factory=set)
    notes: list[str] = field(default_factory=list)


class ConventionFile:
    def __init__(self, header: SafetensorsHeader, read: HeaderReader, check: Check = None):
        self.header, self.read, self._check = header, read, check
        self.path, self.tensors, self.metadata = header.path, header.tensors, header.metadata
        self.problems = Problems(header.path)

    def companions(self, name: str) -> dict[str, str]:
        return self.header.companions(name)

    def checked(self, items):
        """`items`, with the caller's interrupt check now and then."""
        return checked(items, self._check)

    def fail(self, problem: str, layers=()) -> None:
        raise CheckpointError(self.path, problem, list(layers))

    def parse_json(self, text, problem: str):
        return parse_json(self.path, text, problem)

    short_repr = staticmethod(short_repr)
    name_list = staticmethod(name_list)
    is_scalar = staticmethod(is_scalar)
    layer = LayerFormat
    result = ConventionLayers

    def expect_dtype(self, info, allowed: tuple[str, ...], what: str, name: str) -> bool:
        return expect_dtype(info, allowed, what, name, self.problems)

    def float_scale(self, info, what: str, name: str) -> bool:
        return float_scale(info, what, name, self.problems)

    def check_scales(self, layer: LayerFormat, names: dict[str, str] | None = None) -> None:
        check_scales(layer, self.read, self.problems, names)
