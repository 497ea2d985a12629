"""Which calls run the dense backend by schedule: the first `dense_steps`
sampling steps and the blocks listed in `dense_layers`.

Each call comes with its `CallOptions` (attention/options.py), which the host
fills from its own per-call options (host/attention.py).

Step: the position of the current sigma (`sigmas`) in the sampler's schedule
(`sample_sigmas`); a sampler's intermediate evaluations between two sigmas
count as the earlier step. Steps count from the first sigma of each sampler
node's own schedule.

Block: a model that reports its block (`block_index`: Flux, HunyuanVideo,
Qwen-Image, and MiniMax-H3 in recent ComfyUI) is taken at its word, in its own
numbering. Models that do not (Wan in ComfyUI 0.3.75) get their attention
calls counted within one diffusion-model forward, separately for each (query
shape, key shape): the n-th self-attention call of a forward is block n, and
cross-attention calls count on their own. The counter is reset by
`begin_forward()`, which the node calls from a DIFFUSION_MODEL wrapper at the
start of every forward.

Under torch.compile the block is known while tracing (a constant of the
graph) but the step is data: `dense_step` gives it as a boolean tensor that
the router branches on inside the graph (torch.cond), so one graph serves
every step.
"""
from __future__ import annotations

import re

import torch
from torch import nn

from ..pack_logging import pack_logger
from .options import CallOptions

log = pack_logger(__name__)

# A block list is typed by hand: a few ranges. Bounds keep parsing a hostile string cheap.
MAX_PARTS = 1024
MAX_DIGITS = 18


class BlockRanges:
    """A set of block indices held as sorted, merged closed ranges, so '0-1000000000000' is one pair."""

    def __init__(self, ranges=()):
        merged: list[list[int]] = []
        for a, b in sorted(ranges):
            if merged and a <= merged[-1][1] + 1:
                merged[-1][1] = max(merged[-1][1], b)
            else:
                merged.append([a, b])
        self.ranges = tuple((a, b) for a, b in merged)

    def __contains__(self, block: int) -> bool:
        # a scan, not bisect: dynamo cannot trace the C bisect, and a typed list is a few ranges
        for a, b in self.ranges:
            if block <= b:
                return block >= a
        return False

    def __bool__(self) -> bool:
        return bool(self.ranges)

    def __str__(self) -> str:
        return "[" + ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in self.ranges) + "]"

    def beyond(self, count: int) -> "BlockRanges":
        """The listed blocks at or past `count` (a model's number of blocks)."""
        return BlockRanges((max(a, count), b) for a, b in self.ranges if b >= count)


def block_count(model) -> int | None:
    """How many transformer blocks `model` has, as the schedule numbers them: the longest of its
    top-level ModuleLists named "...blocks" (Wan's and H3's `blocks`; Flux numbers its double and
    single blocks each from 0). None for a model without one."""
    lengths = [len(child) for name, child in model.named_children()
               if name.endswith("blocks") and isinstance(child, nn.ModuleList)]
    return max(lengths, default=None)


def check_layers(layers: BlockRanges, block_count: int) -> None:
    """ValueError naming dense_layers when it lists a block the model does not have."""
    extra = layers.beyond(block_count)
    if extra:
        have = f"blocks 0-{block_count - 1}" if block_count > 1 else ("block 0" if block_count else "no blocks")
        raise ValueError(f"dense_layers: {str(extra)[1:-1]} out of range; this model has {block_count} "
                         f"transformer blocks ({have})")


def parse_layers(text: str) -> BlockRanges:
    """'0, 1, 47-49' -> blocks 0, 1 and 47 to 49; ValueError on anything else."""
    parts = [part for part in re.split(r"[,\s]+", (text or "").strip()) if part]
    if len(parts) > MAX_PARTS:
        raise ValueError(f"dense_layers: {len(parts)} entries, more than {MAX_PARTS}; use ranges like 3-5")
    ranges = []
    for part in parts:
        m = re.fullmatch(r"(\d+)(?:-(\d+))?", part)
        if m is None:
            raise ValueError(f"dense_layers: {part[:40]!r} is not a block index or a range like 3-5")
        if max(len(m.group(1)), len(m.group(2) or "")) > MAX_DIGITS:
            raise ValueError(f"dense_layers: {part[:40]!r} has a block index of more than {MAX_DIGITS} digits")
        a, b = int(m.group(1)), int(m.group(2) or m.group(1))
        ranges.append((min(a, b), max(a, b)))
    return BlockRanges(ranges)


class DenseSchedule:
    def __init__(self, dense_steps: int = 0, dense_layers: BlockRanges = BlockRanges()):
        if dense_steps < 0:
            raise ValueError(f"dense_steps must be >= 0, got {dense_steps}")
        self.dense_steps = int(dense_steps)
        self.dense_layers = dense_layers
        self._counts = {}
        self._step_key = None
        self._step = None
        self._warned = False

    @property
    def active(self) -> bool:
        return bool(self.dense_steps or self.dense_layers.ranges)  # torch 2.11 dynamo cannot trace a user __bool__

    def begin_forward(self) -> None:
        self._counts.clear()

    def step(self, options: CallOptions) -> int | None:
        sigmas, schedule = options.sigmas, options.sample_sigmas
        if sigmas is None or schedule is None:
            return None
        # one host sync per forward: every call of a forward shares these tensors
        if self._step_key is None or self._step_key[0] is not sigmas or self._step_key[1] is not schedule:
            sigma = float(sigmas.flatten()[0])
            tol = 1e-4 * abs(sigma) + 1e-9
            self._step = max(0, sum(1 for s in schedule.flatten().tolist() if s >= sigma - tol) - 1)
            self._step_key = (sigmas, schedule)
        return self._step

    def block(self, options: CallOptions, key) -> int:
        if options.block_index is not None:
            return options.block_index
        n = self._counts.get(key, 0)
        self._counts[key] = n + 1
        return n

    def dense_reason(self, options: CallOptions, key) -> str | None:
        """'step' or 'layer' when this call is scheduled dense, else None.
        `key` identifies the call's shapes for block counting. Under
        torch.compile the step is not read here (see `dense_step`)."""
        if self.dense_layers and self.block(options, key) in self.dense_layers:
            return "layer"
        if self.dense_steps and not torch.compiler.is_compiling():
            step = self.step(options)
            if step is None:
                self._no_step()
            elif step < self.dense_steps:
                return "step"
        return None

    def dense_step(self, options: CallOptions) -> torch.Tensor | None:
        """Whether this call's step is one of the dense steps, as a 0-d bool tensor on the sigmas' device
        (None without step information): `step`'s arithmetic in tensor ops (float64, as Python's floats),
        so that under torch.compile the step is read with no host sync and no graph break."""
        sigmas, schedule = options.sigmas, options.sample_sigmas
        if sigmas is None or schedule is None:
            self._no_step()
            return None
        sigma = sigmas.flatten()[0].double()
        tol = 1e-4 * sigma.abs() + 1e-9
        passed = (schedule.flatten().to(sigma.device, torch.float64) >= sigma - tol).sum()
        return (passed - 1).clamp(min=0) < self.dense_steps

    @torch.compiler.assume_constant_result  # under torch.compile it runs once, while tracing: no graph break
    def _no_step(self) -> bool:
        if not self._warned:
            self._warned = True
            log.warning("attention: no sampling step for these calls (the sampler's sigmas and schedule are "
                        "not known); dense_steps is not applied to them")
        return True
