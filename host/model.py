"""ComfyUI's model internals: the compute device, a patcher's size and module tree, quantizing on a clone.

Features are detected, never versions. What a node shows (reports, `last run:`) is in node_report.py.
"""
from __future__ import annotations

import copy
import uuid
from collections.abc import Iterator

import torch
from torch import nn

import comfy.model_management
import comfy.utils

from ..quant.linear import QuantLinear
from ..quant.quantize_pass import QuantizeOptions, quantize_model, walk_modules
from .layers import ComfyQuantLinear, fp8_weight_scale

DIFFUSION_PREFIX = "diffusion_model."


def compute_device() -> torch.device:
    return comfy.model_management.get_torch_device()


def host_reserve() -> int:
    """The VRAM ComfyUI keeps free (--reserve-vram)."""
    return int(comfy.model_management.extra_reserved_memory())


def is_dynamic(patcher) -> bool:
    """True where upstream's dynamic VRAM manages weight placement itself (`ModelPatcherDynamic`)."""
    return bool(getattr(patcher, "is_dynamic", lambda: False)())


def set_model_size(patcher, size: int = 0) -> None:
    """Set the size ModelPatcher caches from the modules it measured first, so memory planning sees the
    quantized or built layers; 0 has ComfyUI measure the modules again at its next model_size()."""
    if hasattr(patcher, "size"):
        patcher.size = size


def _layers_with_weight_patches(model) -> dict[str, str]:
    """Layers with pending weight patches (LoRA...) stay as they are so the patches apply to real weights."""
    keep = {}
    for key in getattr(model, "patches", {}):
        if key.startswith(DIFFUSION_PREFIX) and key.endswith(".weight"):
            keep[key[len(DIFFUSION_PREFIX):-len(".weight")]] = "has weight patches (e.g. a LoRA); kept so they apply"
    return keep


def _with_original_tensors(module: nn.Module, tensors: dict[str, dict]) -> nn.Module:
    """A shallow copy of `module` holding the tensors ComfyUI's backup kept of it."""
    view = copy.copy(module)
    view._parameters = dict(module._parameters)
    view._buffers = dict(module._buffers)
    for name, tensor in tensors.get("parameters", {}).items():
        if name in view._parameters:
            view._parameters[name] = (tensor if isinstance(tensor, nn.Parameter)
                                      else nn.Parameter(tensor, requires_grad=False))
    for name, tensor in tensors.get("buffers", {}).items():
        if name in view._buffers:
            view._buffers[name] = tensor
    return view


def module_view(patcher, prefix: str = DIFFUSION_PREFIX) -> tuple[nn.Module, dict[str, nn.Module]]:
    """The module tree below `prefix` as `patcher` defines it: (root, overrides), for
    `quant.quantize_pass.walk_modules` and the memory plan, with paths relative to the root (`prefix` "": the
    patcher's whole model, e.g. a VAE's).

    ComfyUI applies the loaded patcher's object patches and weight patches (a
    LoRA) to the one module tree all clones share, and leaves them there until
    another patcher loads. So the live tree may hold another clone's modules and
    weights. Clones share `object_patches_backup` and `backup`, which keep the
    originals: the view puts them back, then this patcher's own object patches
    on top. QuantLinear layers are taken as they are (they restore their own
    scales after a weight patch, see QuantLinear.set_weight).
    """
    def below(mapping) -> dict:
        return {k[len(prefix):]: v for k, v in mapping.items() if k.startswith(prefix)}

    root = patcher.get_model_object(prefix[:-1]) if prefix else patcher.model
    overrides = below(getattr(patcher, "object_patches_backup", {}))
    overrides.update(below(patcher.object_patches))
    originals: dict[str, dict[str, dict]] = {}
    for kind, backups in (("parameters", getattr(patcher, "backup", {})),
                          ("buffers", getattr(patcher, "backup_buffers", {}))):
        for key, saved in below(backups).items():
            module_name, _, tensor_name = key.rpartition(".")
            tensor = getattr(saved, "weight", saved)  # `backup` holds (weight, inplace_update) tuples
            originals.setdefault(module_name, {}).setdefault(kind, {})[tensor_name] = tensor
    if originals:
        live = dict((comfy.utils.get_attr(patcher.model, prefix[:-1]) if prefix else patcher.model).named_modules())
        for name, module in list(walk_modules(root, overrides)):
            # Only live modules were patched (the backups are theirs). Layers are leaves; a copy of a
            # block would also stand in for the block the parents' run-time counting hooks attach to.
            if (name in originals and live.get(name) is module and not module._modules
                    and not isinstance(module, QuantLinear)):
                overrides[name] = _with_original_tensors(module, originals[name])
    return root, overrides


class ComfyModelHost:
    """quant.quantize_pass.ModelHost for a ComfyUI model: the pack's layer with ComfyUI's protocols, its
    progress bar, and the per-tensor scale of ComfyUI 0.3.75's scaled_fp8 Linear."""
    layer_type = ComfyQuantLinear
    weight_scale = staticmethod(fp8_weight_scale)

    def progress(self):
        bar = comfy.utils.ProgressBar(1)
        return lambda done, total: bar.update_absolute(done, total)


def quantize_on_clone(model, options: QuantizeOptions, title: str):
    """Quantize `model`'s diffusion model into a clone through object patches.

    The input ModelPatcher and its modules are untouched, so other graph
    branches still see the original weights; the cost is that the original
    weights stay in RAM next to the quantized ones while both are referenced.
    Reads the modules as `model` defines them (module_view), whichever clone
    ComfyUI has loaded; layers with pending weight patches (a LoRA) are kept so
    the patches apply to real weights. Returns (clone, report, the new quantized
    layers by name).
    """
    patched = model.clone()
    root, overrides = module_view(model)
    replacements, report = quantize_model(root, overrides, options, compute_device(), ComfyModelHost(),
                                          keep=_layers_with_weight_patches(model), title=title)
    if replacements and hasattr(patched, "patches_uuid"):
        # ComfyUI re-patches weights on load only when patches_uuid changed, and its marks of patched
        # weights stay on the modules an object patch swaps out: a LoRA clone loaded after this one
        # would find the originals marked and skip them. A new uuid makes loading this clone start from
        # unpatched modules, as ComfyUI's own set_model_compute_dtype does.
        patched.patches_uuid = uuid.uuid4()
    for name, module in replacements.items():
        patched.add_object_patch(DIFFUSION_PREFIX + name, module)
    set_model_size(patched, model.model_size() - report.bytes_saved(replacements))
    return patched, report, replacements


def view_modules(patcher, remove_duplicate: bool = True) -> Iterator[tuple[str, nn.Module]]:
    """(name, module) of the diffusion model as `patcher` defines it (module_view), parents first."""
    root, overrides = module_view(patcher)
    return walk_modules(root, overrides, remove_duplicate)


def quantized_layers(patcher) -> dict[str, nn.Module]:
    """The QuantLinear layers of a diffusion model a loader built (what its report counts as quantized)."""
    return {name: m for name, m in view_modules(patcher) if isinstance(m, QuantLinear)}


def weight_patched_quant_tensors(patcher) -> Iterator[tuple[str, QuantLinear, str]]:
    """(patch key, layer, "weight" or "bias") for each tensor of a QuantLinear in the live module tree that
    `patcher` has a weight patch for (a LoRA): what the pack's ON_LOAD callbacks write with patch_weight_to_device."""
    for name, module in patcher.model.named_modules():
        if isinstance(module, QuantLinear):
            for tensor_name in ("weight", "bias"):
                key = f"{name}.{tensor_name}"
                if key in patcher.patches:
                    yield key, module, tensor_name
