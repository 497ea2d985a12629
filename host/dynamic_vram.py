"""The pack's quantized layers under upstream's dynamic VRAM (`patcher.is_dynamic()`): paged by the host like
its own layers, a LoRA as a branch beside them or folded into them, and ComfyUI's backups of object-patched
layers kept off the layers they replaced.

Dynamic loading treats a module with `comfy_cast_weights` as a cast layer: its
weight and bias get a slot in comfy-aimdo's virtual VRAM, which only the host's
cast path (`comfy.ops.cast_bias_weight`) faults in, and its other tensors (a
QuantLinear's scales) are loaded whole. `prepare_dynamic_vram(patcher)` gives
each QuantLinear `page_weights` as its `weight_pager`: each call takes weight
and bias through that cast path in their stored dtype (int8, fp8, packed), so
the host keeps them resident while the card has room, evicts them under
pressure and copies them in from pinned memory otherwise (block prefetch
included), exactly as it pages its own quantized weights. Nothing is loaded
past the card. It adds:
- an ON_LOAD callback that records the backups of object-patched layers, then
  takes the LoRA the host attached for its own cast path (`weight_lowvram_function`,
  which would requantize the patched weight as a plain dtype into the page) as a
  low-rank branch beside the layer's GEMM (host/lora_branch.py, `attach_branches`),
  else folds it into the layers' quantized weights (host/lora_fold.py, `fold_paged`);
  a layer it can do neither for gets the LoRA as a per-call patch, applied by the
  pack on the dequantized weight;
- an ON_DETACH callback: the folds taken out when the host unloads the model
  (`unfold_paged`), and the object-patched layers (QuantizeModelINT8's) put right.
  `ModelPatcherDynamic.unpatch_model` puts the object patches back before it
  restores the backups by path, so the scales it loaded (and small layers it
  loaded whole) land on the original Linear: the callback gives that Linear back its own
  tensors and the layer its originals (weight last). A switch to another clone
  detaches without unpatching, and the next load would restore the shared
  backups under that clone's object patches: there the callback takes them out first.
`PageCounter` counts what the pager copied, for the run's report.
"""
from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass

import comfy.ops
import comfy.patcher_extension
import comfy.utils
import torch
import torch.nn as nn

from ..quant.linear import QuantLinear
from .lora_branch import attach_branches
from .lora_fold import fold_paged, record_lines, unfold_paged
from .model import is_dynamic, quantized_layers

KEY = "bigdit_dynamic_vram"
_RECORD = "_bigdit_dynamic_record"  # on an object-patched layer: its backups, and the Linear it replaced
_MOVED = "_bigdit_moved_patches"  # on a layer: the host's LoRA patches on_load moved into its per-call patches


def _object_patched(patcher) -> dict[str, QuantLinear]:
    return {path: m for path, m in patcher.object_patches.items() if isinstance(m, QuantLinear)}


@dataclass
class PageCounter:
    """What the pager did since `reset`: calls, calls that copied weight and bias in, the bytes copied."""
    calls: int = 0
    copied_calls: int = 0
    copied_bytes: int = 0

    def reset(self) -> None:
        self.calls = self.copied_calls = self.copied_bytes = 0


PAGED = PageCounter()


@contextmanager
def page_weights(layer: QuantLinear, device: torch.device):
    """A QuantLinear's weight and bias on `device` for one call through the host's cast path, in their stored
    dtypes; None (the layer's own tensors) where the host gave the layer no page or holds it on `device`."""
    if not hasattr(layer, "_v") or device.type == "cpu" or layer.weight.device == device:
        yield None
        return
    prefetch = getattr(layer, "_prefetch", None)  # the host's block prefetch faulted it in already
    signature = getattr(layer, "_v_signature", None)
    patches = layer.weight_function, layer.bias_function
    layer.weight_function, layer.bias_function = [], []  # the pack applies them, on the dequantized weight
    try:
        weight, bias, offload = comfy.ops.cast_bias_weight(
            layer, None, dtype=layer.weight.dtype, device=device,
            bias_dtype=None if layer.bias is None else layer.bias.dtype, offloadable=True)
    finally:
        layer.weight_function, layer.bias_function = patches
    # a page that was resident keeps its signature; a copy sets a new one (None: copied into a cast buffer)
    after = getattr(layer, "_v_signature", None)
    copied = not prefetch["resident"] if prefetch is not None else (after is None or after is not signature)
    PAGED.calls += 1
    if copied:
        PAGED.copied_calls += 1
        PAGED.copied_bytes += sum(t.nbytes for t in (weight, bias) if t is not None)
    try:
        yield {"weight": weight, "bias": bias}
    finally:
        comfy.ops.uncast_bias_weight(layer, weight, bias, offload)


def on_load(patcher, device_to=None, *_) -> None:
    """Record object-patched layers' backups (before a fold replaces them), take the LoRA the host attached for its
    cast path as a branch, else fold it, and move what could be neither into the layers' per-call patches."""
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
    branches = attach_branches(patcher, device_to)
    record_lines(patcher, branches.lines(), fold_paged(patcher, device_to).lines())
    for module in patcher.model.modules():
        if isinstance(module, QuantLinear):
            for tensor_name in ("weight", "bias"):
                patch = getattr(module, f"{tensor_name}_lowvram_function", None)
                if patch is not None:
                    setattr(module, f"{tensor_name}_lowvram_function", None)
                    setattr(module, f"{tensor_name}_function", [patch, *getattr(module, f"{tensor_name}_function")])
                    module.__dict__.setdefault(_MOVED, []).append((tensor_name, patch))


def _restore(layer: QuantLinear, originals: dict) -> None:
    for tensor_name in sorted(originals, key=lambda name: name == "weight"):  # weight last
        tensor = originals[tensor_name]
        setattr(layer, tensor_name, tensor if isinstance(tensor, nn.Parameter)
                else nn.Parameter(tensor, requires_grad=False))


def on_detach(patcher, unpatch_all: bool = True) -> None:
    """Take out the folds (when the host unloads the model) and the LoRA patches on_load moved; put object-patched
    layers' tensors back where they belong (see the module's docstring)."""
    unfold_paged(patcher, unpatch_all)
    for layer in {*patcher.model.modules(), *_object_patched(patcher).values()}:
        for tensor_name, patch in layer.__dict__.pop(_MOVED, []):
            setattr(layer, f"{tensor_name}_function",
                    [f for f in getattr(layer, f"{tensor_name}_function") if f is not patch])
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


def prepare_dynamic_vram(patcher, layers: dict[str, QuantLinear] | None = None) -> None:
    """On a dynamic-VRAM patcher, have ComfyUI page the pack's quantized layers (see the module's docstring):
    `layers`, by default those of its diffusion model."""
    if not is_dynamic(patcher):
        return
    for layer in (quantized_layers(patcher) if layers is None else layers).values():
        layer.weight_pager = page_weights
    callbacks = comfy.patcher_extension.CallbacksMP
    for kind, function in ((callbacks.ON_LOAD, on_load), (callbacks.ON_DETACH, on_detach)):
        patcher.remove_callbacks_with_key(kind, KEY)
        patcher.add_callback_with_key(kind, KEY, function)
