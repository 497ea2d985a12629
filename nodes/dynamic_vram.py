"""The pack's quantized layers under upstream's dynamic VRAM (`patcher.is_dynamic()`): loaded whole, LoRA
written in, and ComfyUI's backups of object-patched layers kept off the layers they replaced.

Dynamic loading treats a module with `comfy_cast_weights` as a cast layer: its
weight and bias get a virtual-VRAM slot that only upstream's own cast path
faults in, so a QuantLinear's weight would stay in pageable RAM and be copied
at every call (README, end to end on 0.33.0). `prepare_dynamic_vram(patcher)` takes that attribute
off the QuantLinear layers, so ComfyUI loads them whole onto the GPU, counts
them as loaded and evicts them whole; it adds:
- an ON_LOAD callback that writes a LoRA into those layers with the patcher's
  own `patch_weight_to_device` (ComfyUI attaches weight patches only to cast
  layers), and records the backups of object-patched layers;
- an ON_DETACH callback for object-patched layers (QuantizeModelINT8's).
  `ModelPatcherDynamic.unpatch_model` puts the object patches back before it
  restores the backups by path, so their int8 weight and scales land on the
  original Linear: the callback gives that Linear back its own tensors and the
  layer its originals (weight last, which also restores the scales a LoRA
  replaced). A switch to another clone detaches without unpatching, and the
  next load would restore the shared backups under that clone's object
  patches: there the callback takes them out first.
"""
from __future__ import annotations

import comfy.patcher_extension
import comfy.utils
import torch.nn as nn

from ..quant.linear import QuantLinear
from .comfy_compat import is_dynamic, quantized_layers, weight_patched_quant_tensors

KEY = "bigdit_dynamic_vram"
_RECORD = "_bigdit_dynamic_record"  # on an object-patched layer: its backups, and the Linear it replaced


def _object_patched(patcher) -> dict[str, QuantLinear]:
    return {path: m for path, m in patcher.object_patches.items() if isinstance(m, QuantLinear)}


def on_load(patcher, device_to=None, *_) -> None:
    """Write weight patches into the QuantLinear layers of the live tree; record object-patched layers' backups."""
    for key, _, _ in weight_patched_quant_tensors(patcher):
        patcher.patch_weight_to_device(key, device_to=device_to)
    layers = _object_patched(patcher)
    backups: dict[str, dict] = {}
    for key, saved in patcher.backup.items():
        path, _, tensor_name = key.rpartition(".")
        if path in layers:
            backups.setdefault(path, {})[tensor_name] = saved.weight
    for path, layer in layers.items():
        if comfy.utils.get_attr(patcher.model, path) is not layer:
            continue
        record = layer.__dict__.setdefault(_RECORD, {"originals": {}, "replaced": None})
        replaced = patcher.object_patches_backup.get(path)
        if replaced is not None and record["replaced"] is None:
            record["replaced"] = (replaced, dict(replaced._parameters))
        for tensor_name, tensor in backups.get(path, {}).items():
            record["originals"].setdefault(tensor_name, tensor)  # the first one is the original


def _restore(layer: QuantLinear, originals: dict) -> None:
    for tensor_name in sorted(originals, key=lambda name: name == "weight"):  # weight last
        tensor = originals[tensor_name]
        setattr(layer, tensor_name, tensor if isinstance(tensor, nn.Parameter)
                else nn.Parameter(tensor, requires_grad=False))


def on_detach(patcher, unpatch_all: bool = True) -> None:
    """Put object-patched layers' tensors back where they belong (see the module's docstring)."""
    for path, layer in _object_patched(patcher).items():
        record = layer.__dict__.pop(_RECORD, None)
        if record is None:
            continue
        for tensor_name in record["originals"]:
            patcher.backup.pop(f"{path}.{tensor_name}", None)  # unpatched: restored already; else: not under others
        if unpatch_all and record["replaced"] is not None:
            replaced, parameters = record["replaced"]
            replaced._parameters.clear()
            replaced._parameters.update(parameters)
        _restore(layer, record["originals"])


def prepare_dynamic_vram(patcher) -> None:
    """On a dynamic-VRAM patcher, have ComfyUI load the pack's quantized layers whole (see the module's docstring)."""
    if not is_dynamic(patcher):
        return
    for layer in quantized_layers(patcher).values():
        layer.__dict__.pop("comfy_cast_weights", None)
    callbacks = comfy.patcher_extension.CallbacksMP
    for kind, function in ((callbacks.ON_LOAD, on_load), (callbacks.ON_DETACH, on_detach)):
        patcher.remove_callbacks_with_key(kind, KEY)
        patcher.add_callback_with_key(kind, KEY, function)
