"""A LoRA on quantized layers that ComfyUI leaves in RAM: folded in once per load, not applied per call.

ComfyUI's partial loading (a model larger than free VRAM) gives every layer it
leaves offloaded with a weight patch a per-call `LowVramPatch` in its
`weight_function`: a QuantLinear would dequantize its weight, patch it (and,
on 0.3.75, requantize it) at every call, then compute in float.

`install_lora_fold(patcher)` adds an ON_LOAD callback that, after each load,
patches those layers once with the patcher's own `patch_weight_to_device`, as
ComfyUI patches the layers it loads: ComfyUI's patch math, its backup of the
unpatched weight (which unpatch_model and partially_unload restore), and
QuantLinear.set_weight requantizing with the layer's own method. The math runs
on the load device; the patched weight stays in RAM, pinned where ComfyUI had
pinned the original, so ComfyUI's per-op copy and the pack's block streaming
(offload/streaming.py) move the folded weight. A layer ComfyUI offloads later
(partially_unload, between loads) runs per call until the next load.

Under upstream's dynamic VRAM (`patcher.is_dynamic()`) ComfyUI attaches a LoRA
differently (weight_lowvram_function); it is left per call there.
"""
from __future__ import annotations

import comfy.model_patcher
import comfy.patcher_extension

from ..pack_logging import pack_logger
from .model import is_dynamic, weight_patched_quant_tensors

log = pack_logger(__name__)

FOLD_KEY = "bigdit_lora_fold"


def _per_call_patch(function) -> bool:
    lowvram_patch = getattr(comfy.model_patcher, "LowVramPatch", None)
    return lowvram_patch is not None and isinstance(function, lowvram_patch)


def fold_offloaded_patches(patcher, device_to=None, *_) -> int:
    """Write the per-call weight patches of `patcher`'s offloaded QuantLinear layers into their weights;
    returns how many tensors were patched."""
    if is_dynamic(patcher):
        return 0
    pinned = getattr(patcher, "pinned", set())
    folded = 0
    for key, module, tensor_name in weight_patched_quant_tensors(patcher):
        functions = getattr(module, f"{tensor_name}_function")
        if not any(_per_call_patch(f) for f in functions):
            continue
        was_pinned = key in pinned
        patcher.unpin_weight(key)  # the unpatched tensor now only waits in the backup
        patcher.patch_weight_to_device(key, device_to=device_to)
        setattr(module, f"{tensor_name}_function", [f for f in functions if not _per_call_patch(f)])
        if was_pinned:
            patcher.pin_weight_to_device(key)
        folded += 1
    if folded:
        counter = getattr(patcher.model, "lowvram_patch_counter", None)
        if isinstance(counter, int):
            patcher.model.lowvram_patch_counter = max(0, counter - folded)
        log.info("folded the weight patches (LoRA) of %d offloaded quantized tensors into their weights",
                 folded)
    return folded


def install_lora_fold(patcher) -> None:
    """Fold weight patches into `patcher`'s offloaded quantized layers after each of its loads (and its clones')."""
    on_load = comfy.patcher_extension.CallbacksMP.ON_LOAD
    patcher.remove_callbacks_with_key(on_load, FOLD_KEY)
    patcher.add_callback_with_key(on_load, FOLD_KEY, fold_offloaded_patches)
