"""The one load pipeline of the loader nodes: a file to a built model and its report.

`load` inspects the file whole, decides every layer, then has the host build the
model through a LayerBuilder, and gives the file's map back. The host (ComfyUI,
adapted in nodes/) is one object, `Host`: its methods are the only calls from
here back into nodes/, and only `Host.build` leads on to the quantized layers.
"""
from __future__ import annotations

import math
import os
from collections import Counter
from dataclasses import dataclass
from typing import Callable, Protocol

import torch
from torch import nn

from ..hardware import device_text
from ..quant import QuantConfig, get_method
from ..quant.keep import keep_patterns
from ..quant.kitchen_layout import BlockFormat
from ..quant.kitchen_api import require_kitchen
from ..quant.linear import QuantLinear
from ..quant.patterns import first_match
from ..quant.quantize_pass import online_method, stored_conversions
from ..quant.registry import fit_formats
from ..quant.report import QuantReport
from ..units import format_gib
from .build import LayerBuilder, header_layers
from .checkpoint import MARKER_KIND, CheckpointContents, MarkFileSlice, inspect_checkpoint
from .file_map import release_file_map


@dataclass(frozen=True)
class LoadOptions:
    """What a loader node asks for: a diffusion model, or a text encoder; what becomes of the file's stored
    formats (its inputs by their names, e.g. ("nvfp4", "requantize"): each a format's `conversion_option`),
    the online quantization, the layers it keeps and the GiB its Linear weights may take (0: any), and the
    prefix rules of a text encoder."""
    title: str
    text_encoder: bool = False
    conversions: tuple[tuple[str, str], ...] = ()
    quantization: str = "none"
    group_size: int = 256
    ignored_layers: str = ""
    rename_prefixes: str = ""
    fit_gib: float = 0.0


class Host(Protocol):
    """What loading needs of the host that builds the model."""

    def check(self) -> None:
        """Raises the host's interrupt once the user cancelled."""

    def progress(self, total: int) -> Callable[[], None]:
        """A step of the host's progress bar, about `total` steps in all."""

    def namespace(self, contents: CheckpointContents) -> CheckpointContents:
        """A diffusion model's contents in the model's own names (the host's prefix stripped)."""

    def build(self, contents: CheckpointContents, builder: LayerBuilder, state_dict: dict) -> tuple[object, nn.Module]:
        """(the host's model object, its module tree), each Linear built through `builder.build`."""

    #: The QuantLinear subclass the host's model runs (its protocols on the pack's layer).
    layer_type: type[QuantLinear]

    def file_slices(self, path: str) -> MarkFileSlice | None:
        """Where the host pages weights from their file (upstream's dynamic VRAM), what marks a tensor of the
        file's map with its offset, so the host reads the tensors kept as stored from the file; else None."""


def load(path: str, options: LoadOptions, device: torch.device, host: Host) -> tuple[object, QuantReport]:
    """(the host's model, the load's report) of the file at `path`; `builder.finish` ran inside host.build."""
    if not (math.isfinite(options.fit_gib) and options.fit_gib >= 0):
        raise ValueError(f"fit_gib must be a finite number of GiB, 0 or more; got {options.fit_gib}")
    if options.fit_gib > 0 and options.quantization == "none":
        raise ValueError("fit_gib moves quantized layers to 4-bit: it needs a quantization, and it is 'none'")
    conversions = stored_conversions(options.conversions)
    method = None
    if options.quantization != "none":
        require_kitchen(options.title)
        method = online_method(options.quantization, options.group_size, device)
    contents = model_contents(path, options, host)
    if contents.layers:
        require_kitchen(options.title)
    config = online_config(method, device, contents, options.ignored_layers)
    if config is not None and options.fit_gib > 0:
        config.fit_bytes = int(options.fit_gib * 2 ** 30)
        config.fit_targets = tuple(get_method(name, group_size=options.group_size, device=device)
                                   for name in fit_formats())
    mark = host.file_slices(path)
    with contents.open(mark) as source:
        builder = LayerBuilder(contents, source, device, online=config, conversions=conversions,
                               title=options.title, progress=host.progress(progress_total(contents)),
                               layer_type=host.layer_type)
        builder.resolve_methods()
        state_dict = contents.state_dict(source)
        loaded, modules = host.build(contents, builder, state_dict)
        del state_dict
        copied = release_file_map(modules, source.file_map, os.path.getsize(path), paged_from_file=mark is not None)
    report = builder.report
    if source.file_map.released_bytes:
        report.notes.append(f"gave back the file's pages as its tensors were consumed "
                            f"({format_gib(source.file_map.released_bytes)})")
    if copied:
        report.notes.append(f"copied the {format_gib(copied)} of the file's tensors ComfyUI kept "
                            "mapped, so the file's map is released")
    return loaded, report


@dataclass(frozen=True)
class HostAlike:
    why: str         # for the report
    quantized: int   # the file's quantized layers, which the host's load must hold as such


def emulated_alike(path: str, options: LoadOptions, device: torch.device,
                   host_formats: dict[str, frozenset[str]]) -> HostAlike | None:
    """Why the host's own loader would load the text encoder at `path` as this load would, or None.

    So where the file is a marker file whose every layer the host reads (`host_formats`: its marker formats by
    name, with the tensor roles each takes beside the weight) and whose block-format layers (NVFP4, MXFP8) this
    device runs dequantized before each matmul in either loader, with no conversion (`requantize`), renaming or
    quantization asked. A text encoder's time is moving its weights, not computing: the pack's kernels gain
    nothing there, while the host's loader keeps the weights where its memory management moves them fastest."""
    if not options.text_encoder or options.quantization != "none" or parse_prefix_rules(options.rename_prefixes):
        return None
    contents = inspect_checkpoint(path)
    if contents.kind != MARKER_KIND or not contents.layers:
        return None
    conversions = stored_conversions(options.conversions)
    emulated = Counter()
    for layer in contents.layers.values():
        roles = host_formats.get(layer.format)
        if roles is None or not set(layer.tensors) - {"weight"} <= roles:
            return None
        if conversions.get(layer.format) == "requantize":
            return None
        if isinstance(layer.spec, BlockFormat) and not layer.spec.native(device):
            emulated[layer.format] += 1
    if not emulated:
        return None
    def listed(counts: Counter) -> str:
        return ", ".join(f"{fmt} x{n}" for fmt, n in sorted(counts.items()))
    every = Counter(layer.format for layer in contents.layers.values())
    return HostAlike(f"its {listed(emulated)} layers run dequantized before each matmul on {device_text(device)} in "
                     f"either loader, and ComfyUI reads every layer of the file ({listed(every)})",
                     len(contents.layers))


def model_contents(path: str, options: LoadOptions, host: Host) -> CheckpointContents:
    """The file at `path` inspected whole, in the names of the model `load` builds from it."""
    contents = inspect_checkpoint(path, host.check)
    if not options.text_encoder:
        contents = host.namespace(contents)
    rules = parse_prefix_rules(options.rename_prefixes)
    return contents.renamed(rules) if rules else contents


def module_names(contents: CheckpointContents) -> set[str]:
    """The module names of the file's tensors (quantized layers and plain keys)."""
    return set(contents.layers) | {key.rpartition(".")[0] for key in contents.plain_keys}


def online_config(method, device, contents: CheckpointContents, ignored_layers: str) -> QuantConfig | None:
    """The quantization a loader applies while loading `contents` with `method` (None: load as stored): the
    architecture's keep patterns from the file's module names, then the user's; in a file that already
    quantizes layers, its full-precision ones stay so (`left_by_the_file`)."""
    if method is None:
        return None
    ignored = keep_patterns(module_names(contents), ignored_layers)
    return QuantConfig(method=method, compute_device=device, ignored=ignored,
                       keep=left_by_the_file(contents, ignored))


def left_by_the_file(contents: CheckpointContents, ignored: tuple[str, ...]) -> dict[str, str]:
    """{name: why} of the plain Linear layers a quantized file leaves in full precision (those no pattern keeps
    anyway): they load as stored, as the host loads them. Their author chose them; quantizing them cost a read
    and a scratch file at each load for a step no faster (H3 pruned, H100: 1.325 s, 1.323 without)."""
    if not contents.layers:
        return {}
    why = f"kept as stored: the file quantizes {len(contents.layers)} other layers and leaves this one as it is"
    return {name: why for name in header_layers(contents) if first_match(name, ignored) is None}


def progress_total(contents: CheckpointContents) -> int:
    """About one step per Linear: the quantized layers and the plain matrices."""
    plain = sum(1 for key in contents.plain_keys.values()
                if key.endswith(".weight") and len(contents.header.tensors[key].shape) == 2)
    return plain + len(contents.layers)


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
