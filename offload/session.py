"""One sampling run's streaming: attach at the first forward, detach and unpin at the end."""
from __future__ import annotations

import torch

from ..pack_logging import pack_logger
from ..quant.kitchen_api import tensor_bytes
from .plan import MemoryPlan, block_ranges, find_blocks, size_text
from .streaming import HostPins, LayerwiseStreamer, PinFunction, away_bytes, block_tensors

log = pack_logger(__name__)


class StreamSession:
    """One sampling run: its plan, the streamer (attached at the first forward) and the pins to release.

    `pin` / `unpin`: the host's pin functions (see HostPins); None: the pack's own registration.
    `placed`: on a GPU, the plan redrawn on where the host put the weights, read at the first forward.
    """

    def __init__(self, plan: MemoryPlan, device: torch.device, streams: bool,
                 pin: PinFunction | None = None, unpin: PinFunction | None = None):
        self.plan = plan
        self.device = device
        self.streams = streams
        self.pins = HostPins(pin=pin, unpin=unpin)
        self.streamer: LayerwiseStreamer | None = None
        self.placed: MemoryPlan | None = None
        self.started = False

    def start(self, diffusion_model) -> None:
        """At the run's first forward, where blocks may stream: attach to those that do, the plan's on a CPU
        device, else those ComfyUI left in RAM. Later calls do nothing."""
        if self.started or not self.streams:
            return
        self.started = True
        blocks = [block for _, block in find_blocks(diffusion_model)]
        if self.device.type == "cpu":
            streamed = list(self.plan.streamed)
        else:
            self.placed = self._placed(diffusion_model, blocks)
            streamed = list(self.placed.streamed)
        if streamed:
            self.streamer = LayerwiseStreamer(blocks, self.device, streamed, pins=self.pins)
            self.streamer.attach()

    def _placed(self, diffusion_model, blocks) -> MemoryPlan:
        """The plan redrawn on where the host put the live model's tensors."""
        tensors = [[t for *_, t in block_tensors(block)] for block in blocks]
        in_blocks = {id(t) for group in tensors for t in group}
        rest = [t for *_, t in block_tensors(diffusion_model) if id(t) not in in_blocks]
        return self.plan.placed([sum(map(tensor_bytes, group)) for group in tensors],
                                [away_bytes(group, self.device) for group in tensors],
                                sum(map(tensor_bytes, rest)), away_bytes(rest, self.device))

    def close(self, allocator_peak: int | None = None) -> str:
        """Detach and unpin; one line on what streamed (logged where anything did), and where the host placed
        the weights, its estimate against what was measured (`allocator_peak`: the run's, where known)."""
        placed = ""
        if self.placed is not None:
            placed = self.placed.summary_line() + self._measured(allocator_peak)
        if self.streamer is None:
            return f"nothing streamed; {placed}" if placed else "nothing streamed"
        self.streamer.detach()
        self.pins.release()
        summary = (f"streamed {len(self.streamer.order)} of {self.plan.n_blocks} blocks "
                   f"({block_ranges(self.streamer.order)}); {self.streamer.stats.render()}")
        if placed:
            summary += f"; {placed}"
        log.info("offload: %s", summary)
        return summary

    def _measured(self, allocator_peak: int | None) -> str:
        """The placement's two estimates against the run: bytes copied per forward, and the allocator's peak."""
        stats, placed = self.streamer.stats if self.streamer else None, self.placed
        parts = []
        if stats is not None and stats.forwards and placed.streamed_bytes:
            per_forward = stats.bytes_copied / stats.forwards
            parts.append(f"measured {size_text(per_forward)} copied per forward "
                         f"({per_forward / placed.streamed_bytes:.3f}x the estimate)")
        if allocator_peak and placed.estimated_peak:
            parts.append(f"allocator peak {size_text(allocator_peak)} "
                         f"({allocator_peak / placed.estimated_peak:.3f}x the estimate)")
        return "; " + "; ".join(parts) if parts else ""
