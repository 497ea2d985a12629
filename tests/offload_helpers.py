"""Helpers of the offload tests and the offload benchmark (tests/bench/offload.py)."""
from dataclasses import dataclass, field
from typing import Iterable, Sequence

import torch
from torch import nn

from bigdit.offload.plan import MemoryPlan, RunShape
from bigdit.offload.streaming import HostPins, LayerwiseStreamer, block_tensors
from bigdit.quant.kitchen_api import storage


def h3_shape(tokens: int, batch: int = 1, dtype: torch.dtype = torch.bfloat16) -> RunShape:
    """MiniMax-H3's DiT block: hidden 5376, 56 heads x 128, SwiGLU ffn 14336."""
    return RunShape(tokens=tokens, hidden=5376, heads=56, head_dim=128, ffn=14336, gated=True,
                    dtype=dtype, batch=batch)


def all_resident(plan: MemoryPlan) -> bool:
    return not plan.streamed


def pinned_bytes(pins: HostPins) -> int:
    """Bytes `pins` page-locked itself (not those someone else pinned)."""
    return sum(storage(t).numel() * storage(t).element_size() for t in pins._pinned.values())


def move_blocks_to_host(blocks: Sequence[nn.Module], indices: Iterable[int], pins: HostPins | None = None) -> int:
    """Moves these blocks' tensors to host memory, page-locked when `pins` is given; returns bytes moved."""
    moved = 0
    for i in indices:
        for *_, tensor in block_tensors(blocks[i]):
            if tensor.device.type != "cpu":
                tensor.data = tensor.data.to("cpu")
                moved += tensor.numel() * tensor.element_size()
            if pins is not None:
                pins.pin(tensor.data)
    return moved


@dataclass
class TracingStreamer(LayerwiseStreamer):
    """A LayerwiseStreamer whose `trace` records ("issue" | "enter" | "swap_in" | "release", block index) in order."""
    trace: list = field(default_factory=list)

    def _issue(self, i, prefetched):
        staged = super()._issue(i, prefetched)
        self.trace.append(("issue", i))
        return staged

    @torch.compiler.disable
    def _enter(self, j):
        self.trace.append(("enter", j))
        self._entering = j
        super()._enter(j)

    def _prefetch(self, i):
        j, self._entering = getattr(self, "_entering", None), None
        if j is not None and j in self._entries:  # _enter calls _prefetch right after its swap
            self.trace.append(("swap_in", j))
        super()._prefetch(i)

    def _release(self, i):
        super()._release(i)
        self.trace.append(("release", i))
