"""The nodes' option values and the old spellings saved workflows may hold (`Choices`), in plain data."""
from __future__ import annotations

import inspect
from dataclasses import dataclass, field

from ..pack_logging import pack_logger
from ..quant.registry import format_aliases, loader_conversions, online_formats

log = pack_logger(__name__)


@dataclass(frozen=True)
class Choices:
    """An option's values, and the values of earlier versions -> the value read instead.

    A node that names the option in validate_inputs replaces ComfyUI's list check of
    it, so saved workflows with an old value still load; `problem` is that check.
    """
    what: str                          # in the error: "<what> must be one of ..."
    values: tuple[str, ...]
    old: dict[str, str] = field(default_factory=dict)
    option: str = ""                   # in the log line: "<option> 'old' is read as 'new'" (default: `what`)
    why: str = ""                      # said after that line

    def problem(self, value) -> str | None:
        """Why `value` is not one of the values (old ones included), or None."""
        if value in self.values or value in self.old:
            return None
        return f"{self.what} must be one of {', '.join(self.values)}, got {value!r}"

    def read(self, value: str, title: str = "") -> str:
        """`value` as one of the values, an old one logged as it is read; ValueError for any other."""
        problem = self.problem(value)
        if problem:
            raise ValueError(problem)
        if value not in self.old:
            return value
        log.info("%s%s %r is read as %r%s", f"{title}: " if title else "", self.option or self.what, value,
                 self.old[value], f": {self.why}" if self.why else "")
        return self.old[value]


# The offload mode of SetOffload and LoadH3Quantized; "layerwise" always ran as "auto" does.
OFFLOAD_MODES = Choices("offload mode", ("auto", "none"), {"layerwise": "auto"}, option="offload",
                        why="they always ran alike (stream what does not fit)")
# LoadH3Quantized's `quantization`; old values are the spellings of earlier versions (today's is the markers' and
# the reports').
QUANTIZATIONS = Choices("quantization", ("auto", *online_formats(), "none"), format_aliases())


def load_conversions(inputs: dict[str, str], quantizing: bool = False) -> tuple[tuple[str, str], ...]:
    """(input, mode) for each conversion input of the loaders (quant.registry.loader_conversions): where the load
    quantizes, a format's `quantizing_conversion` (no input then); else the node's value, by default the first
    of the format's modes."""
    def mode(spec) -> str:
        if quantizing and spec.quantizing_conversion:
            return spec.quantizing_conversion
        return inputs.get(spec.conversion_option, spec.conversion_modes[0])
    return tuple((spec.conversion_option, mode(spec)) for spec in loader_conversions())


def validates(*names: str):
    """For a node's `validate_inputs(cls, **inputs)`: ComfyUI hands a validate function the inputs its signature
    names and skips its own range or list check of those (all of them for one that takes **kwargs), so the
    signature is made to name exactly `names` (e.g. settings a registry declares)."""
    def named(function):
        parameters = [inspect.Parameter("cls", inspect.Parameter.POSITIONAL_OR_KEYWORD)]
        parameters += [inspect.Parameter(name, inspect.Parameter.POSITIONAL_OR_KEYWORD, default=None) for name in names]
        function.__signature__ = inspect.Signature(parameters)
        return function
    return named
