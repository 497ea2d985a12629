"""Dynamic VRAM: ComfyUI's backups of object-patched QuantLinear layers, kept by the layers themselves.

Upstream's `ModelPatcherDynamic.unpatch_model` puts the object patches back
(the original Linear returns to its path) before it restores the weight
backups by path. The backups of a QuantLinear that QuantizeModelINT8 installed
as an object patch (its scales, and the whole layer where it is at most 16 KiB,
which dynamic loading force-loads) would then land on the original Linear: its
weight replaced by the int8 one, the scales added as stray parameters, for
every clone of that model.

The same happens when ComfyUI switches to another clone of the model: it
detaches the loaded one without unpatching, and the next load restores the
shared backups with the new clone's object patches in place. And where a LoRA
is written into a force-loaded layer, the backup of its scales is taken after
the LoRA's scales replaced them, so restoring the backups in order would put
them back on the unpatched weight.

`keep_backups_on_layers(patcher)` adds an ON_LOAD callback that, after each load,
takes the backups of QuantLinear tensors out of ComfyUI's `backup` into the layer
(the first one, the original, wins), and an ON_DETACH callback that puts them
back on the layer itself, weight last. The cost: a partial unload
(`partially_unload`) no longer moves those tensors back to RAM, and ComfyUI
stops counting them as loaded; they stay on the GPU until the model is
detached (scales: a few bytes per output row, and layers of at most 16 KiB).
"""
from __future__ import annotations

import comfy.patcher_extension
import comfy.utils
import torch.nn as nn

from ..quant.linear import QuantLinear

KEY = "bigdit_dynamic_backups"
_ORIGINALS = "_bigdit_host_originals"  # {tensor name: the tensor before ComfyUI force-loaded it}


def _layer_at(patcher, path: str) -> QuantLinear | None:
    try:
        module = comfy.utils.get_attr(patcher.model, path)
    except AttributeError:
        return None
    return module if isinstance(module, QuantLinear) else None


def take_backups(patcher, *_) -> int:
    """Move ComfyUI's backups of the QuantLinear tensors in `patcher`'s live tree onto the layers;
    returns how many."""
    taken = 0
    for key in list(patcher.backup):
        path, _, tensor_name = key.rpartition(".")
        layer = _layer_at(patcher, path)
        if layer is None:
            continue
        originals = layer.__dict__.setdefault(_ORIGINALS, {})
        originals.setdefault(tensor_name, patcher.backup.pop(key).weight)
        taken += 1
    return taken


def restore_layers(patcher, *_) -> None:
    """Give `patcher`'s QuantLinear layers (object patches and the tree's own) back the tensors taken from
    ComfyUI's backup. On every detach: with `unpatch_all` False (a clone of the same model is about to
    load) the next load restores ComfyUI's backups while that clone's object patches are in place."""
    layers = {id(m): m for m in (*patcher.object_patches.values(), *patcher.model.modules())
              if isinstance(m, QuantLinear) and _ORIGINALS in m.__dict__}
    for layer in layers.values():
        originals = layer.__dict__.pop(_ORIGINALS)
        # `weight` last: assigning it also puts back the scales a LoRA replaced (QuantLinear.set_weight),
        # which are the originals where ComfyUI's backup of a scale was taken after the LoRA was written in.
        for tensor_name in sorted(originals, key=lambda name: name == "weight"):
            tensor = originals[tensor_name]
            setattr(layer, tensor_name, tensor if isinstance(tensor, nn.Parameter)
                    else nn.Parameter(tensor, requires_grad=False))


def keep_backups_on_layers(patcher) -> None:
    """On a dynamic-VRAM patcher, keep ComfyUI's backups of its QuantLinear tensors on the layers themselves."""
    if not getattr(patcher, "is_dynamic", lambda: False)():
        return
    callbacks = comfy.patcher_extension.CallbacksMP
    for kind, function in ((callbacks.ON_LOAD, take_backups), (callbacks.ON_DETACH, restore_layers)):
        patcher.remove_callbacks_with_key(kind, KEY)
        patcher.add_callback_with_key(kind, KEY, function)
