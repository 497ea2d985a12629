"""Which calls run the dense backend by schedule: the first `dense_steps`
sampling steps and the blocks listed in `dense_layers`.

Step: ComfyUI's sampler puts the schedule in transformer_options
["sample_sigmas"] and the current sigma in ["sigmas"]; the step is the
position of that sigma in the schedule (a sampler's intermediate evaluations
between two sigmas count as the earlier step). Steps count from the first
sigma of each sampler node's own schedule.

Block: a model that reports transformer_options["block_index"] (Flux,
HunyuanVideo, Qwen-Image, and MiniMax-H3 in recent ComfyUI) is taken at its
word, in its own numbering. Models that do not (Wan in ComfyUI 0.3.75) get
their attention calls counted within one diffusion-model forward, separately
for each (query shape, key shape): the n-th self-attention call of a forward
is block n, and cross-attention calls count on their own. The counter is
reset by `begin_forward()`, which the node calls from a DIFFUSION_MODEL
wrapper at the start of every forward.
"""
from __future__ import annotations

import logging
import re

log = logging.getLogger(__name__)


def parse_layers(text: str) -> frozenset[int]:
    """'0, 1, 47-49' -> {0, 1, 47, 48, 49}; ValueError on anything else."""
    blocks = set()
    for part in re.split(r"[,\s]+", (text or "").strip()):
        if not part:
            continue
        m = re.fullmatch(r"(\d+)(?:-(\d+))?", part)
        if m is None:
            raise ValueError(f"dense_layers: {part!r} is not a block index or a range like 3-5")
        a, b = int(m.group(1)), int(m.group(2) or m.group(1))
        blocks.update(range(min(a, b), max(a, b) + 1))
    return frozenset(blocks)


class DenseSchedule:
    def __init__(self, dense_steps: int = 0, dense_layers: frozenset[int] = frozenset()):
        if dense_steps < 0:
            raise ValueError(f"dense_steps must be >= 0, got {dense_steps}")
        self.dense_steps = int(dense_steps)
        self.dense_layers = frozenset(dense_layers)
        self._counts = {}
        self._step_key = None
        self._step = None
        self._warned = False

    @property
    def active(self) -> bool:
        return bool(self.dense_steps or self.dense_layers)

    def begin_forward(self) -> None:
        self._counts.clear()

    def step(self, options: dict) -> int | None:
        sigmas, schedule = options.get("sigmas"), options.get("sample_sigmas")
        if sigmas is None or schedule is None:
            return None
        # one host sync per forward: every call of a forward shares these tensors
        if self._step_key is None or self._step_key[0] is not sigmas or self._step_key[1] is not schedule:
            sigma = float(sigmas.flatten()[0])
            tol = 1e-4 * abs(sigma) + 1e-9
            self._step = max(0, sum(1 for s in schedule.flatten().tolist() if s >= sigma - tol) - 1)
            self._step_key = (sigmas, schedule)
        return self._step

    def block(self, options: dict, key) -> int:
        index = options.get("block_index")
        if index is not None:
            return int(index)
        n = self._counts.get(key, 0)
        self._counts[key] = n + 1
        return n

    def dense_reason(self, options: dict, key) -> str | None:
        """'step' or 'layer' when this call is scheduled dense, else None.
        `key` identifies the call's shapes for block counting."""
        if self.dense_layers and self.block(options, key) in self.dense_layers:
            return "layer"
        if self.dense_steps:
            step = self.step(options)
            if step is None:
                if not self._warned:
                    self._warned = True
                    log.warning("bigdit attention: no sampling step in transformer_options "
                                "(sigmas/sample_sigmas); dense_steps is not applied to these calls")
            elif step < self.dense_steps:
                return "step"
        return None
