"""What an attention call knows of the run beside its tensors: a view that the host fills from its own per-call
options (host/attention.py, from ComfyUI's transformer_options), so that attention/ reads no host's keys."""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class PackedLayout:
    """A sequence packed from segments of several kinds (MiniMax-H3's [text | conditioning | audio | video]):
    `length` tokens, `segments` as (start, stop, kind) rows in order."""
    length: int
    segments: tuple[tuple[int, int, str], ...]


@dataclass(frozen=True)
class CallOptions:
    """The sampling step (`sigmas`: the current noise level; `sample_sigmas`: the sampler's whole schedule),
    the transformer block of the call where the model reports it, and the packed layout of its sequence where
    the model publishes one; None where the host does not know."""
    sigmas: torch.Tensor | None = None
    sample_sigmas: torch.Tensor | None = None
    block_index: int | None = None
    packed: PackedLayout | None = None


NO_OPTIONS = CallOptions()
