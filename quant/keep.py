"""Layers every quantizing node keeps in full precision by default, per architecture.

One decision for QuantizeModelINT8 (which sees the loaded model) and the
loaders (which see the file): both pass the module names they have to
`default_keep` and put the patterns before the user's ignored ones. The
patterns name what conditions every token or leaves the model (modulation,
time embedding, patch embedding, output head); a DiT stores some of them in
fp32 on purpose, which a model computing in fp32 (on CPU) no longer shows.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

from .patterns import parse_patterns


@dataclass(frozen=True)
class Architecture:
    name: str
    signature: tuple[str, ...]  # module names that together identify it
    keep: tuple[str, ...]       # fnmatch patterns on module names


ARCHITECTURES = (
    # upstream ComfyUI's comfy.ldm.minimax.model.MiniMaxH3Model: per-block and final AdaLN
    # projections, the output heads and patch projections and the time embedder (the
    # last three fp32 in the published checkpoints)
    Architecture("MiniMax-H3", ("video_patch_proj", "audio_patch_proj"),
                 ("*adaln*", "final_layer.*", "*_patch_proj", "time_embedder.*")),
    # ComfyUI's comfy.ldm.wan.model.WanModel: the output head and the time-modulation projection
    Architecture("Wan", ("head.head", "time_projection.1"), ("head.*", "time_projection.*")),
)


def architectures(module_names: Iterable[str]) -> list[Architecture]:
    """The architectures whose every signature module is among `module_names`."""
    names = set(module_names)
    return [arch for arch in ARCHITECTURES if all(s in names for s in arch.signature)]


def default_keep(module_names: Iterable[str]) -> tuple[str, ...]:
    """The keep patterns of the architectures these module names reveal (none for an unknown model)."""
    return tuple(p for arch in architectures(module_names) for p in arch.keep)


def describe_keep() -> str:
    """The defaults in one line, for tooltips: "MiniMax-H3: *adaln*, ...; Wan: head.*, ..."."""
    return "; ".join(f"{arch.name}: {', '.join(arch.keep)}" for arch in ARCHITECTURES)


def keep_patterns(module_names: Iterable[str], ignored_layers: str | None) -> tuple[str, ...]:
    """What a quantizing node keeps: the architecture's patterns, then the user's `ignored_layers` text."""
    return default_keep(module_names) + parse_patterns(ignored_layers)
