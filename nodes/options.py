"""The loader nodes' options in plain data, turned into what the core takes.

An option's values and the old spellings saved workflows may hold (`Choices`),
the online quantization a loader applies (`online_config`), the prefix rules of
a text encoder (`parse_prefix_rules`) and the progress a load reports
(`progress_total`). The nodes only read their inputs and call these.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from ..pack_logging import pack_logger
from ..quant import QuantConfig, get_method
from ..quant.keep import keep_patterns
from ..quant.linear_method import LinearMethod
from ..quant.registry import format_aliases, online_formats
from ..loaders.checkpoint import CheckpointPlan

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


def online_method(name: str, group_size: int, device, **options):
    """The registered method for a quantizing node's choice (get_method names the valid ones for any other),
    or a clear error if its comfy-kitchen lacks what it needs."""
    method = get_method(name, group_size=group_size, device=device, **options)
    lacking = method.missing() if isinstance(method, LinearMethod) else None
    if lacking is not None:
        raise ValueError(f"quantization {name!r} needs {lacking}")
    return method


def module_names(plan: CheckpointPlan) -> set[str]:
    """The module names of the file's tensors (quantized layers and plain keys)."""
    return set(plan.layers) | {key.rpartition(".")[0] for key in plan.plain_keys}


def online_config(method, device, plan: CheckpointPlan, ignored_layers: str) -> QuantConfig | None:
    """The quantization a loader applies while loading `plan` with `method` (None: load as stored): the
    architecture's keep patterns from the file's module names, then the user's."""
    if method is None:
        return None
    return QuantConfig(method=method, compute_device=device,
                       ignored=keep_patterns(module_names(plan), ignored_layers))


def progress_total(plan: CheckpointPlan) -> int:
    """About one step per Linear: the quantized layers and the plain matrices."""
    plain = sum(1 for key in plan.plain_keys.values()
                if key.endswith(".weight") and len(plan.header.tensors[key].shape) == 2)
    return plain + len(plan.layers)


def parse_prefix_rules(text: str) -> list[tuple[str, str]]:
    """"old -> new" per line (new may be empty, to strip a prefix)."""
    rules = []
    for line in (text or "").splitlines():
        if not line.strip():
            continue
        old, arrow, new = line.partition("->")
        if not arrow or not old.strip():
            raise ValueError(f"rename_prefixes: expected 'old -> new', got {line.strip()!r}")
        rules.append((old.strip(), new.strip()))
    return rules
