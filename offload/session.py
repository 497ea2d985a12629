"""One sampling run's streaming: attach at the first forward, detach and unpin at the end."""
from __future__ import annotations

import torch

from ..pack_logging import pack_logger
from .plan import MemoryPlan, block_ranges, find_blocks
from .streaming import HostPins, LayerwiseStreamer, PinFunction, offloaded_blocks

log = pack_logger(__name__)


class StreamSession:
    """One sampling run: its plan, the streamer (attached at the first forward) and the pins to release.

    `pin` / `unpin`: the host's pin functions (see HostPins); None: the pack's own registration.
    """

    def __init__(self, plan: MemoryPlan, device: torch.device, streams: bool,
                 pin: PinFunction | None = None, unpin: PinFunction | None = None):
        self.plan = plan
        self.device = device
        self.streams = streams
        self.pins = HostPins(pin=pin, unpin=unpin)
        self.streamer: LayerwiseStreamer | None = None
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
            streamed = offloaded_blocks(blocks, self.device)
        if streamed:
            self.streamer = LayerwiseStreamer(blocks, self.device, streamed, pins=self.pins)
            self.streamer.attach()

    def close(self) -> str:
        """Detach and unpin; one line on what streamed (logged where anything did)."""
        if self.streamer is None:
            return "nothing streamed"
        self.streamer.detach()
        self.pins.release()
        summary = (f"streamed {len(self.streamer.order)} of {self.plan.n_blocks} blocks "
                   f"({block_ranges(self.streamer.order)}); {self.streamer.stats.render()}")
        if set(self.streamer.order) != set(self.plan.streamed):  # what streams is what the host left in RAM
            summary += (f"; the host's loading left weights of these blocks in RAM, where the plan streams "
                        f"{len(self.plan.streamed)} whole blocks")
        log.info("offload: %s", summary)
        return summary
