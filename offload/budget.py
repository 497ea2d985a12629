"""The numbers and text around a memory plan, from plain values: modes, capacity, the estimate
ComfyUI's budget asks for, and the report.

Two modes (host/options.py: OFFLOAD_MODES): "auto" streams what does not fit, "none" streams
nothing and fails when the model does not fit.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import Callable, Mapping, NamedTuple, Sequence

import torch
from torch import nn

from ..units import GIB
from .plan import (BLOCK_LIST_NAMES, MemoryPlan, RunShape, activation_bytes, find_blocks, infer_shape,
                   latent_tokens, max_resident_tokens, module_bytes, plan_for_model, size_text)


class OffloadReport(NamedTuple):
    brief: str  # one line for the node: mode, device, the plan's summary
    full: str   # the whole plan, for the log and the help page


class OffloadError(RuntimeError):
    """The model cannot run as asked (mode "none" that does not fit); the message holds the plan."""


def check_fits(mode: str, plan: MemoryPlan, text: str, weights_only: bool = False) -> None:
    """OffloadError holding `text` (the plan) where mode "none" cannot keep every block resident."""
    if mode == "none" and not plan.fits_resident:
        why = "and the weights alone do not fit" if weights_only else "which does not fit"
        raise OffloadError(f"offload 'none' needs every block resident, {why}; use 'auto'.\n" + text)


@dataclass(frozen=True)
class Budget:
    """The user's memory settings: `reserve_bytes` to leave free (None: the host's own reserve) and
    `vram_bytes` to plan for (None: what is available)."""
    reserve_bytes: int | None = None
    vram_bytes: int | None = None

    @classmethod
    def from_gib(cls, reserve_gib: float | None, vram_gib: float | None) -> "Budget":
        return cls(None if reserve_gib is None else int(reserve_gib * GIB), int(vram_gib * GIB) if vram_gib else None)

    def reserve(self, host_reserve: int) -> int:
        return host_reserve if self.reserve_bytes is None else self.reserve_bytes

    def capacity(self, available: int) -> int:
        """The memory a plan uses: what is available, or the user's smaller `vram_bytes`."""
        return min(available, self.vram_bytes) if self.vram_bytes else available

    def estimate_extra(self, plan: MemoryPlan, streams: bool, host_reserve: int, available: int) -> int:
        """What ComfyUI's memory_required must add to the activations so that its budget leaves room for the
        plan: the workspace, staging where blocks stream, the part of the reserve above the host's own
        (which the host keeps free anyway) and the memory the plan leaves unused (`vram_bytes`)."""
        return (plan.workspace_bytes + (plan.staging_bytes if streams else 0)
                + max(0, self.reserve(host_reserve) - host_reserve) + (available - self.capacity(available)))


@dataclass(frozen=True)
class ModelView:
    """A diffusion model as a run sees it: `overrides` (dotted path -> module) stand in for the tree's
    modules at run time (ComfyUI object patches); `dtype` is the dtype its blocks compute in."""
    diffusion: nn.Module
    overrides: Mapping[str, nn.Module]
    dtype: torch.dtype

    @cached_property
    def blocks(self) -> list[tuple[str, nn.Module]]:
        return [(path, self.overrides.get(path, block)) for path, block in find_blocks(self.diffusion)]

    def run_shape(self, *latent_shapes: Sequence[int]) -> RunShape | None:
        """The blocks' shape for one sequence made of latents of `latent_shapes` ([B, C, *spatial] each): one
        latent, or the streams of an audio-video model, whose tokens add up: the first (video) patchified,
        each other one token per position of its last axis (H3's audio latent frames). None without blocks."""
        blocks = self.blocks
        if not blocks:
            return None
        first, *others = latent_shapes
        tokens = latent_tokens(first, getattr(self.diffusion, "patch_size", None)) + sum(int(s[-1]) for s in others)
        heads = getattr(self.diffusion, "num_heads", None)
        return infer_shape(blocks[0][1], tokens, self.dtype, batch=int(first[0]),
                           heads=heads if isinstance(heads, int) else None)

    def plan(self, capacity_bytes: int, reserve_bytes: int, workspace_bytes: int,
             latent_shapes: Sequence[Sequence[int]] | None = None) -> MemoryPlan:
        """The plan for a run on `latent_shapes` (as run_shape); None: the weights only (activations unknown yet)."""
        shape = None if latent_shapes is None else self.run_shape(*latent_shapes)
        return plan_for_model(self.diffusion, self.blocks, shape, capacity_bytes, reserve_bytes, self.overrides,
                              workspace_bytes)

    def memory_required(self, extra_bytes: int,
                        parts: Callable[[Sequence[int]], Sequence[Sequence[int]]] = lambda shape: [shape]
                        ) -> Callable[[Sequence[int]], int]:
        """ComfyUI's memory_required(input_shape) as a plan sees it: activations plus `extra_bytes`;
        `parts(input_shape)`: the latents a packed input stands for."""
        def memory_required(input_shape) -> int:
            shape = self.run_shape(*parts(input_shape))
            return (0 if shape is None else activation_bytes(shape)) + extra_bytes
        return memory_required


def paged_run_line(plan: MemoryPlan, model_calls: int, paged_calls: int, copied_calls: int, copied_bytes: int,
                   device_weight_bytes: int | None, allocator_peak: int | None) -> str:
    """A run under the host's dynamic VRAM, as it happened: the host paged the quantized layers through its cast
    path (`paged_calls` layer calls, `copied_calls` of them copied `copied_bytes` in over `model_calls` model
    calls); `device_weight_bytes`: the weights the host held on the device at the end; `allocator_peak`:
    PyTorch's allocator peak (activations and layers loaded whole; the host's pages are outside it)."""
    per_call = copied_bytes / model_calls if model_calls else 0.0
    line = (f"ComfyUI's dynamic VRAM paged the weights (mechanism: the host's cast path for the quantized layers); "
            f"quantized layers copied in: {size_text(per_call)} per model call ({copied_calls} of {paged_calls} "
            f"layer calls, {model_calls} model calls)")
    if device_weight_bytes is not None:
        line += f"; weights on the device at the end {size_text(device_weight_bytes)}"
    if allocator_peak is not None:
        line += f"; allocator peak {size_text(allocator_peak)}"
    return line + f"; the pack's plan, not applied: {plan.summary_line()}"


def brief_line(mode: str, device, plan: MemoryPlan, dynamic: bool) -> str:
    return (f"offload: {mode} on {device}; {plan.summary_line()}"
            + ("; ComfyUI's dynamic VRAM places the weights" if dynamic else ""))


def describe(mode: str, device: torch.device, plan: MemoryPlan, view: ModelView, *, dynamic: bool,
             block_prefetch: bool, quantized: bool, host_bytes: int) -> str:
    """The full report. `dynamic`: ComfyUI's dynamic VRAM places the weights (`block_prefetch`: with its
    block lookahead); `quantized`: the model has quantized layers; `host_bytes`: the model's size as
    ComfyUI accounts it."""
    if dynamic:
        how = ("ComfyUI's dynamic VRAM places the weights"
               + (" with block prefetch" if block_prefetch else "") + "; the pack only plans")
        if quantized:  # nodes/dynamic_vram.py
            how += "; quantized layers are paged through its cast path, as its own"
    elif device.type == "cpu":
        how = "CPU device: streamed blocks are copied host-to-host, running the same hooks"
    else:
        how = ("ComfyUI loads what fits and would cast the rest per op; the pack streams "
               "offloaded blocks one block ahead on a side stream")
    shape = view.run_shape((1, 1))  # one token, one sample
    lines = [f"offload: {mode} on {device} ({how})", plan.render()]
    if shape is None:
        lines.append(f"{type(view.diffusion).__name__} has no block list (looked for "
                     f"{', '.join(BLOCK_LIST_NAMES)}): nothing can stream; ComfyUI's own loading applies")
    else:
        lines.append("activations are added when the sampler knows the latent size; all blocks stay resident "
                     f"up to about {max_resident_tokens(plan, shape):,} tokens per sample")
    lines.append(f"ComfyUI accounts {size_text(host_bytes)} for this model; the plan counts "
                 f"{size_text(module_bytes(view.diffusion, view.overrides))} in the diffusion model")
    return "\n".join(lines)


def packed_parts(latent_shapes) -> Callable[[Sequence[int]], list[tuple[int, ...]]]:
    """shape -> the latents it stands for. Upstream samples the streams of an audio-video model (H3) packed
    into one [B, 1, N] latent and hands their shapes to OUTER_SAMPLE as `latent_shapes`."""
    if not latent_shapes or len(latent_shapes) < 2:
        return lambda shape: [tuple(shape)]
    return lambda shape: [(int(shape[0]), *tuple(part)[1:]) for part in latent_shapes]
