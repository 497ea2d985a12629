"""Offload for ComfyUI, adapting offload/: `install_offload` (the loaders call it; SetOffload on a clone).
Under dynamic VRAM (`patcher.is_dynamic()`) it only plans. Elsewhere, while sampling, `memory_required` answers
at least the plan's estimate and the blocks left in RAM stream one ahead, pinned by ComfyUI's `pin_memory`."""
from __future__ import annotations

import importlib.util
from contextlib import contextmanager
from typing import Callable

import torch

import comfy.model_management
import comfy.patcher_extension

from ..pack_logging import pack_logger
from ..offload.budget import (Budget, ModelView, OffloadReport, brief_line, check_fits, describe, packed_parts,
                              paged_run_line)
from ..offload.plan import CUDA_WORKSPACE_BYTES, MemoryPlan
from ..offload.session import StreamSession
from ..offload.streaming import normalize_device
from .options import OFFLOAD_MODES
from .model import host_reserve, is_dynamic, module_view, quantized_layers
from .dynamic_vram import PAGED

log = pack_logger(__name__)
WRAPPER_KEY = "bigdit_offload"


def host_pin_functions() -> dict:
    """ComfyUI's pin_memory / unpin_memory, within its host-memory budget (none: the streamer pins itself)."""
    functions = {"pin": getattr(comfy.model_management, "pin_memory", None),
                 "unpin": getattr(comfy.model_management, "unpin_memory", None)}
    return functions if all(functions.values()) else {}


def model_view(patcher) -> ModelView:
    """The diffusion model as this patcher defines it (whichever clone is loaded)."""
    diffusion, overrides = module_view(patcher)
    return ModelView(diffusion, overrides, getattr(patcher.model, "manual_cast_dtype", None) or patcher.model_dtype())


def available(device: torch.device) -> int:
    """Free memory plus what ComfyUI could unload from this device (other models included)."""
    loaded = [] if device.type == "cpu" else getattr(comfy.model_management, "current_loaded_models", [])
    return int(comfy.model_management.get_free_memory(device)) + sum(
        int(model.model_loaded_memory()) for model in loaded if model.device == device and model.model is not None)


@contextmanager
def memory_estimate_at_least(base_model, estimate):
    """ComfyUI's BaseModel.memory_required answers at least `estimate(input_shape)` inside the block (the plan's
    activations and extra bytes: offload.budget.ModelView.memory_required)."""
    previous, comfy_estimate = vars(base_model).get("memory_required"), base_model.memory_required
    base_model.memory_required = lambda shape, *args, **kwargs: max(comfy_estimate(shape, *args, **kwargs),
                                                                     estimate(shape))
    try:
        yield
    finally:
        del base_model.memory_required
        if previous is not None:
            base_model.memory_required = previous


class _Offload:
    def __init__(self, mode: str, budget: Budget, on_run: Callable[[str], None] | None = None):
        self.mode, self.budget = mode, budget
        self.on_run = on_run or (lambda line: None)  # one line per sampling: the plan, and what streamed
        self.session: StreamSession | None = None
        self.model_calls = 0

    def plan(self, patcher, latent_shapes=None) -> MemoryPlan:
        device = normalize_device(patcher.load_device)
        return model_view(patcher).plan(self.budget.capacity(available(device)), self.budget.reserve(host_reserve()),
                                        CUDA_WORKSPACE_BYTES if device.type == "cuda" else 0, latent_shapes)

    def outer_sample(self, executor, noise, *args, **kwargs):
        patcher = executor.class_obj.model_patcher
        parts = packed_parts(kwargs.get("latent_shapes"))
        plan = self.plan(patcher, parts(tuple(noise.shape)))
        dynamic, device = is_dynamic(patcher), normalize_device(patcher.load_device)
        cuda = device.type == "cuda" and torch.cuda.is_available()
        if cuda:
            torch.cuda.reset_peak_memory_stats(device)  # the run's own allocator peak
        def allocator_peak() -> int | None:
            return torch.cuda.max_memory_allocated(device) if cuda else None
        log.info("offload (%s) for %s%s: %s", self.mode, plan.shape.describe() if plan.shape else "no block list",
                 ", a plan only (ComfyUI's dynamic VRAM places the weights)" if dynamic else "", plan.summary_line())
        log.debug("offload plan:\n%s", plan.render())
        check_fits(self.mode, plan, plan.render())
        if dynamic:
            PAGED.reset()
            self.model_calls = 0
            try:
                return executor(noise, *args, **kwargs)
            finally:
                line = self.paged_line(patcher, plan, allocator_peak())
                log.info("last run: %s", line)
                self.on_run(line)
        session = self.session = StreamSession(plan, device, streams=self.mode != "none", **host_pin_functions())
        extra = self.budget.estimate_extra(plan, session.streams, host_reserve(), available(session.device))
        try:
            with memory_estimate_at_least(patcher.model, model_view(patcher).memory_required(extra, parts)):
                return executor(noise, *args, **kwargs)
        finally:
            self.session = None
            self.on_run(f"{plan.summary_line()}; {session.close(allocator_peak())}")

    def paged_line(self, patcher, plan: MemoryPlan, allocator_peak: int | None) -> str:
        return paged_run_line(plan, self.model_calls, PAGED.calls, PAGED.copied_calls, PAGED.copied_bytes,
                              None if allocator_peak is None else int(patcher.loaded_size()), allocator_peak)

    def diffusion_model(self, executor, *args, **kwargs):
        self._begin_call(executor.class_obj)
        return executor(*args, **kwargs)

    # runs inside TorchCompileModel's compiled forward: state read while tracing was guarded on (a recompile a step)
    @torch.compiler.disable
    def _begin_call(self, diffusion_model) -> None:
        self.model_calls += 1
        if self.session is not None:
            self.session.start(diffusion_model)


def install_offload(model_patcher, mode: str, reserve_gib: float | None = None, *,
                    vram_gib: float | None = None, on_run: Callable[[str], None] | None = None) -> OffloadReport:
    """Plan and install offload on `model_patcher` (the caller's clone), replacing an earlier install. Mode
    "none" raises OffloadError with the plan where not every block fits. reserve_gib: VRAM to leave free (None:
    ComfyUI's --reserve-vram); vram_gib: plan for this much (None: what is free); on_run: gets a line per run."""
    mode = OFFLOAD_MODES.read(mode)
    offload = _Offload(mode, Budget.from_gib(reserve_gib, vram_gib), on_run)
    plan = offload.plan(model_patcher)
    device, dynamic = normalize_device(model_patcher.load_device), is_dynamic(model_patcher)
    report = describe(mode, device, plan, model_view(model_patcher), dynamic=dynamic,
                      block_prefetch=importlib.util.find_spec("comfy.model_prefetch") is not None,
                      quantized=bool(quantized_layers(model_patcher)), host_bytes=model_patcher.model_size())
    check_fits(mode, plan, report, weights_only=True)
    for wrapper_type, wrapper in ((comfy.patcher_extension.WrappersMP.OUTER_SAMPLE, offload.outer_sample),
                                  (comfy.patcher_extension.WrappersMP.DIFFUSION_MODEL, offload.diffusion_model)):
        model_patcher.remove_wrappers_with_key(wrapper_type, WRAPPER_KEY)
        model_patcher.add_wrapper_with_key(wrapper_type, WRAPPER_KEY, wrapper)
    return OffloadReport(brief_line(mode, device, plan, dynamic), report)
