"""Offload for ComfyUI: a memory plan per run and, where ComfyUI has no block prefetch, block streaming.

`install_offload(model_patcher, mode, reserve_gib=None) -> OffloadReport` is what
loaders call; `SetOffload` does the same on a clone of any MODEL.

How it shares the work with ComfyUI (features detected, never versions):

- ComfyUI with dynamic VRAM (comfy-aimdo, `patcher.is_dynamic()`) keeps weights
  in host memory and faults them in per op, with `comfy.model_prefetch`'s block
  lookahead where the model uses it. The pack only plans and reports there.
  ComfyUI faults in only its own layers' weights: a QuantLinear's scales are
  moved to the GPU, its weight and bias stay in RAM and are copied per call.
- Otherwise (0.3.75, or upstream with dynamic VRAM off) ComfyUI loads what its
  budget allows (lowvram partial load) and casts the rest per op on the compute
  path. For the sampling's duration the pack (1) answers
  `BaseModel.memory_required` with the larger of ComfyUI's estimate and its own
  (activations, two staging blocks, the reserve), so ComfyUI's budget leaves
  room for them and other models (text encoder, VAE) are unloaded first; and
  (2) wraps the diffusion model's forward: blocks with tensors ComfyUI left in
  RAM are streamed with one-block lookahead (loaders/streaming.py), so the
  per-op cast finds them on the GPU already and does nothing.
  What is loaded, `model_size`, loaded memory and partial unloads for other
  models stay ComfyUI's own accounting: the pack moves no tensor ComfyUI counts
  as loaded and holds no GPU memory between samplings.
- On a CPU load device nothing is offloaded; "auto" then streams the plan's
  streamed blocks host-to-host, which runs the same hooks (used by the tests).

Two modes: "auto" streams what does not fit, "none" streams nothing and fails
when the model does not fit. An old "layerwise" (which ran as "auto") is read as
"auto", with a log line.
"""
from __future__ import annotations

import importlib.util
from contextlib import contextmanager
from typing import Callable, NamedTuple

import torch

import comfy.model_management
import comfy.patcher_extension

from ..pack_logging import pack_logger
from ..loaders.memory_plan import (BLOCK_LIST_NAMES, CUDA_WORKSPACE_BYTES, GIB, MemoryPlan, RunShape, block_ranges,
                                   activation_bytes, find_blocks, infer_shape, latent_tokens,
                                   max_resident_tokens, module_bytes, plan_for_model, size_text)
from ..loaders.options import OFFLOAD_MODES
from ..loaders.streaming import HostPins, LayerwiseStreamer, normalize_device, offloaded_blocks
from . import categories
from .comfy_compat import module_view, quantized_layers
from .node_report import node_output, show_on_node

log = pack_logger(__name__)

WRAPPER_KEY = "bigdit_offload"


class OffloadReport(NamedTuple):
    brief: str  # one line for the node: mode, device, the plan's summary
    full: str   # the whole plan, for the log and the help page


class OffloadError(RuntimeError):
    """The model cannot run as asked (mode "none" that does not fit); the message holds the plan."""


def comfy_places_weights(patcher) -> bool:
    """True where ComfyUI's dynamic VRAM manages weight placement itself."""
    return bool(getattr(patcher, "is_dynamic", lambda: False)())


def comfy_has_block_prefetch() -> bool:
    return importlib.util.find_spec("comfy.model_prefetch") is not None


class _Session:
    """One sampling run: its plan, the streamer (attached at the first forward) and the pins to release."""

    def __init__(self, plan: MemoryPlan, device: torch.device, streams: bool):
        self.plan = plan
        self.device = device
        self.streams = streams
        self.pins = HostPins()
        self.streamer: LayerwiseStreamer | None = None
        self.started = False

    def start(self, diffusion_model) -> None:
        """Attach to the blocks that stream: the plan's on a CPU device, else those ComfyUI left in RAM."""
        self.started = True
        blocks = [block for _, block in find_blocks(diffusion_model)]
        if self.device.type == "cpu":
            streamed = list(self.plan.streamed)
        else:
            streamed = offloaded_blocks(blocks, self.device)
        if streamed:
            self.streamer = LayerwiseStreamer(blocks, self.device, streamed, pins=self.pins)
            self.streamer.attach()

    def close(self) -> str | None:
        """Detach and unpin; a summary line if anything streamed."""
        if self.streamer is None:
            return None
        self.streamer.detach()
        self.pins.release()
        return (f"streamed {len(self.streamer.order)} of {self.plan.n_blocks} blocks "
                f"({block_ranges(self.streamer.order)}); {self.streamer.stats.render()}")


class _Offload:
    def __init__(self, mode: str, reserve_gib: float | None, vram_gib: float | None,
                 on_run: Callable[[str], None] | None = None):
        self.mode = mode
        self.on_run = on_run  # gets one line per sampling: the plan with activations, and what streamed
        self.reserve_bytes = None if reserve_gib is None else int(reserve_gib * GIB)
        self.vram_bytes = int(vram_gib * GIB) if vram_gib else None
        self.session: _Session | None = None

    # -- memory --------------------------------------------------------------
    def reserve(self) -> int:
        """The user's reserve, else ComfyUI's own (--reserve-vram)."""
        if self.reserve_bytes is not None:
            return self.reserve_bytes
        return int(comfy.model_management.extra_reserved_memory())

    @staticmethod
    def available(device: torch.device) -> int:
        """Free memory plus what ComfyUI could unload from this device (other models included)."""
        free = int(comfy.model_management.get_free_memory(device))
        if device.type == "cpu":
            return free
        for loaded in getattr(comfy.model_management, "current_loaded_models", []):
            if loaded.device == device and loaded.model is not None:
                free += int(loaded.model_loaded_memory())
        return free

    def capacity(self, device: torch.device) -> tuple[int, int]:
        """(capacity this plan uses, memory really available)."""
        real = self.available(device)
        return (min(real, self.vram_bytes) if self.vram_bytes else real), real

    # -- the plan ------------------------------------------------------------
    @staticmethod
    def model_parts(patcher):
        """The diffusion model as this patcher defines it (whichever clone is loaded), and its blocks."""
        diffusion, overrides = module_view(patcher)
        blocks = [(path, overrides.get(path, block)) for path, block in find_blocks(diffusion)]
        return diffusion, overrides, blocks

    @staticmethod
    def run_shape(patcher, diffusion, blocks, latent_shape) -> RunShape | None:
        """The blocks' shape for a latent of `latent_shape` ([B, C, *spatial]); None without blocks."""
        if not blocks:
            return None
        dtype = getattr(patcher.model, "manual_cast_dtype", None) or patcher.model_dtype()
        tokens = latent_tokens(latent_shape, getattr(diffusion, "patch_size", None))
        heads = getattr(diffusion, "num_heads", None)
        return infer_shape(blocks[0][1], tokens, dtype, batch=int(latent_shape[0]),
                           heads=heads if isinstance(heads, int) else None)

    def plan(self, patcher, latent_shape=None) -> MemoryPlan:
        diffusion, overrides, blocks = self.model_parts(patcher)
        device = normalize_device(patcher.load_device)
        shape = None if latent_shape is None else self.run_shape(patcher, diffusion, blocks, latent_shape)
        capacity, _ = self.capacity(device)
        workspace = CUDA_WORKSPACE_BYTES if device.type == "cuda" else 0
        return plan_for_model(diffusion, blocks, shape, capacity, self.reserve(), overrides, workspace)

    def brief(self, patcher, plan: MemoryPlan) -> str:
        dynamic = "; ComfyUI's dynamic VRAM places the weights" if comfy_places_weights(patcher) else ""
        return f"offload: {self.mode} on {normalize_device(patcher.load_device)}; {plan.summary_line()}{dynamic}"

    def describe(self, patcher, plan: MemoryPlan) -> str:
        device = normalize_device(patcher.load_device)
        if comfy_places_weights(patcher):
            how = ("ComfyUI's dynamic VRAM places the weights"
                   + (" with block prefetch" if comfy_has_block_prefetch() else "") + "; the pack only plans")
            if quantized_layers(patcher):  # ComfyUI faults in only its own layers' weights
                how += "; quantized layers copy their weight and bias from RAM at every call"
        elif device.type == "cpu":
            how = "CPU device: streamed blocks are copied host-to-host, running the same hooks"
        else:
            how = ("ComfyUI loads what fits and would cast the rest per op; the pack streams "
                   "offloaded blocks one block ahead on a side stream")
        diffusion, overrides, blocks = self.model_parts(patcher)
        shape = self.run_shape(patcher, diffusion, blocks, (1, 1))  # one token, one sample
        lines = [f"offload: {self.mode} on {device} ({how})", plan.render()]
        if shape is None:
            lines.append(f"{type(diffusion).__name__} has no block list (looked for "
                         f"{', '.join(BLOCK_LIST_NAMES)}): nothing can stream; ComfyUI's own loading applies")
        else:
            lines.append("activations are added when the sampler knows the latent size; all blocks stay resident "
                         f"up to about {max_resident_tokens(plan, shape):,} tokens per sample")
        lines.append(f"ComfyUI accounts {size_text(patcher.model_size())} for this model; the plan counts "
                     f"{size_text(module_bytes(diffusion, overrides))} in the diffusion model")
        return "\n".join(lines)

    # -- ComfyUI wrappers ------------------------------------------------------
    def outer_sample(self, executor, noise, *args, **kwargs):
        patcher = executor.class_obj.model_patcher
        plan = self.plan(patcher, tuple(noise.shape))
        log.info("offload (%s): %s", self.mode, plan.summary_line())
        log.debug("offload plan:\n%s", plan.render())
        if self.mode == "none" and not fits_resident(plan):
            raise OffloadError("offload 'none' needs every block resident, which does not fit; use 'auto'.\n"
                               + plan.render())
        if comfy_places_weights(patcher):
            try:
                return executor(noise, *args, **kwargs)
            finally:
                self._ran(f"{plan.summary_line()}; ComfyUI's dynamic VRAM placed the weights")
        session = _Session(plan, normalize_device(patcher.load_device), streams=self.mode != "none")
        self.session = session
        try:
            with _memory_estimate_at_least(patcher.model, self.estimate(patcher, plan, session)):
                return executor(noise, *args, **kwargs)
        finally:
            self.session = None
            summary = session.close()
            if summary:
                log.info("offload: %s", summary)
            self._ran(f"{plan.summary_line()}; {summary or 'nothing streamed'}")

    def _ran(self, line: str) -> None:
        if self.on_run is not None:
            self.on_run(line)

    def estimate(self, patcher, plan: MemoryPlan, session: _Session):
        """ComfyUI's memory_required(input_shape) as this plan sees it: what the weights must leave free."""
        diffusion, _, blocks = self.model_parts(patcher)
        capacity, real = self.capacity(session.device)
        extra = (plan.workspace_bytes + (plan.staging_bytes if session.streams else 0)
                 + max(0, self.reserve() - int(comfy.model_management.extra_reserved_memory()))
                 + (real - capacity))

        def memory_required(input_shape) -> int:
            shape = self.run_shape(patcher, diffusion, blocks, input_shape)
            return (0 if shape is None else activation_bytes(shape)) + extra
        return memory_required

    def diffusion_model(self, executor, *args, **kwargs):
        session = self.session
        if session is not None and session.streams and not session.started:
            session.start(executor.class_obj)
        return executor(*args, **kwargs)


@contextmanager
def _memory_estimate_at_least(base_model, estimate):
    """BaseModel.memory_required answers at least `estimate(input_shape)` inside the block."""
    previous = vars(base_model).get("memory_required")
    comfy_estimate = base_model.memory_required

    def memory_required(input_shape, *args, **kwargs):
        return max(comfy_estimate(input_shape, *args, **kwargs), estimate(input_shape))

    base_model.memory_required = memory_required
    try:
        yield
    finally:
        if previous is None:
            del base_model.memory_required
        else:
            base_model.memory_required = previous


def fits_resident(plan: MemoryPlan) -> bool:
    """Whether every block fits on the device (what mode "none" needs; a plan that fits by streaming does not)."""
    return plan.fits and plan.all_resident


def install_offload(model_patcher, mode: str, reserve_gib: float | None = None, *,
                    vram_gib: float | None = None, on_run: Callable[[str], None] | None = None) -> OffloadReport:
    """Plan and install offload on `model_patcher` (the caller's clone); returns the report, brief and full.

    mode "none": everything resident, OffloadError with the plan if it cannot fit;
    "auto": resident when it fits, else stream the blocks that do not (an old "layerwise" reads as "auto").
    reserve_gib: VRAM to leave free (None: ComfyUI's --reserve-vram). vram_gib:
    plan as if the device had this much memory (None: what is free). on_run: called
    after each sampling with one line, the run's plan and what streamed.
    Installing again replaces the previous install.
    """
    mode = OFFLOAD_MODES.read(mode)
    offload = _Offload(mode, reserve_gib, vram_gib, on_run)
    plan = offload.plan(model_patcher)
    report = offload.describe(model_patcher, plan)
    if mode == "none" and not fits_resident(plan):
        raise OffloadError("offload 'none' needs every block resident, and the weights alone do not fit; use "
                           "'auto'.\n" + report)
    for wrapper_type, wrapper in ((comfy.patcher_extension.WrappersMP.OUTER_SAMPLE, offload.outer_sample),
                                  (comfy.patcher_extension.WrappersMP.DIFFUSION_MODEL, offload.diffusion_model)):
        model_patcher.remove_wrappers_with_key(wrapper_type, WRAPPER_KEY)
        model_patcher.add_wrapper_with_key(wrapper_type, WRAPPER_KEY, wrapper)
    return OffloadReport(offload.brief(model_patcher, plan), report)


class SetOffload:
    DESCRIPTION = (
        "Plans the diffusion model's GPU memory for each run and streams the transformer blocks that do not fit "
        "from host memory, one block ahead of the compute, on a copy of the MODEL. Works on models from any "
        "loader. Where ComfyUI's dynamic VRAM already manages the weights, it only plans and reports."
    )
    CATEGORY = categories.MODEL_PATCHES
    FUNCTION = "apply"
    RETURN_TYPES = ("MODEL", "STRING")
    RETURN_NAMES = ("model", "report")
    OUTPUT_TOOLTIPS = ("The model with offload installed (a clone).",
                       "The memory plan: blocks resident and streamed, the estimated peak against the budget.")

    @classmethod
    def INPUT_TYPES(cls):
        return {
            "required": {
                "model": ("MODEL", {"tooltip": "The diffusion model. It is cloned, never changed."}),
                "mode": (list(OFFLOAD_MODES.values), {
                    "default": "auto",
                    "tooltip": "auto: keep everything on the GPU when it fits, else stream the blocks that do "
                               "not fit, one block ahead of the compute. none: everything on the GPU; fails with "
                               "the plan if it cannot fit.",
                }),
                "reserve_gib": ("FLOAT", {
                    "default": -1.0, "min": -1.0, "max": 1024.0, "step": 0.1,
                    "tooltip": "GPU memory (GiB) to leave free for other programs. -1: ComfyUI's own reserve "
                               "(--reserve-vram).",
                }),
            },
            "optional": {
                "vram_gib": ("FLOAT", {
                    "default": 0.0, "min": 0.0, "max": 1024.0, "step": 0.5,
                    "tooltip": "Plan as if the GPU had only this much memory (GiB), e.g. to share it or to try a "
                               "24 GB plan on a bigger card. 0: the memory ComfyUI reports free.",
                }),
            },
            "hidden": {"unique_id": "UNIQUE_ID"},
        }

    # Naming an input here replaces ComfyUI's own min/max (or list) check of it, so it is checked here too
    # (`mode` is named so that an old value of a saved workflow still loads).
    # NaN passes every comparison: without this it would plan with a NaN reserve.
    _RANGES = {"reserve_gib": (-1.0, 1024.0), "vram_gib": (0.0, 1024.0)}

    @classmethod
    def VALIDATE_INPUTS(cls, mode="auto", reserve_gib=-1.0, vram_gib=0.0):
        checks = (OFFLOAD_MODES.problem(mode), cls._out_of_range("reserve_gib", reserve_gib),
                  cls._out_of_range("vram_gib", vram_gib))
        problems = [problem for problem in checks if problem]
        return "; ".join(problems) or True

    @classmethod
    def _out_of_range(cls, name, value):
        low, high = cls._RANGES[name]
        if not isinstance(value, (int, float)) or not low <= value <= high:  # False for NaN
            return f"{name} must be a number from {low:g} to {high:g}, got {value!r}"
        return None

    def apply(self, model, mode, reserve_gib, vram_gib=0.0, unique_id=None):
        problem = self._out_of_range("reserve_gib", reserve_gib) or self._out_of_range("vram_gib", vram_gib)
        if problem:  # a value linked from another node is only known here
            raise ValueError(f"SetOffload: {problem}")
        patched = model.clone()
        report = install_offload(patched, mode, None if reserve_gib < 0 else reserve_gib, vram_gib=vram_gib or None,
                                 on_run=lambda line: show_on_node(unique_id, f"{report.brief}\nlast run: {line}"))
        return node_output("SetOffload", report.brief, report.full, (patched, report.full))


NODES = {"SetOffload": (SetOffload, "Set Offload")}
