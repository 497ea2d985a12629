"""SaveQuantizedModel's side of ComfyUI: where the file goes, and a model's weight patches (a LoRA) that a saved
file would not hold; the file's contents and writing are loaders/saving.py and loaders/safetensors_writer.py."""
from __future__ import annotations

import os

import comfy.model_management
import folder_paths

from ..loaders.safetensors_writer import target_path, write_safetensors
from ..loaders.saving import SaveError, save_contents
from ..units import format_gib
from .building import progress_counter
from .model import DIFFUSION_PREFIX, view_modules
from .report import node_output

def diffusion_models_dir() -> str:
    """models/diffusion_models (ComfyUI also lists the legacy models/unet first under that name)."""
    paths = folder_paths.get_folder_paths("diffusion_models")
    for path in paths:
        if os.path.basename(os.path.normpath(path)) == "diffusion_models":
            return path
    return paths[0]


def _weights_written_in(patcher) -> bool:
    # ModelPatcher.backup is shared by all clones of a model: non-empty while any
    # loaded clone has weights (a LoRA) written into the shared modules.
    return bool(getattr(patcher, "backup", None))


def _unload_clones(patcher) -> None:
    """Unload the loaded models that share this model's modules, so they hold their own weights again."""
    loaded_models = comfy.model_management.current_loaded_models
    for i in range(len(loaded_models) - 1, -1, -1):
        other = loaded_models[i].model
        if other is not None and other.model is patcher.model:
            loaded_models[i].model_unload()
            loaded_models.pop(i)
    comfy.model_management.soft_empty_cache()


def pending_weight_patches(patcher) -> list[str]:
    return sorted(key[len(DIFFUSION_PREFIX):] for key, patches in patcher.patches.items()
                  if key.startswith(DIFFUSION_PREFIX) and patches)



def save_model(model, filename: str, overwrite: bool, title: str):
    """Write `model`'s diffusion model as a marker file under models/diffusion_models/`filename`; the node's
    output. Refuses a model with pending weight patches, and one with no quantized layers."""
    folder = diffusion_models_dir()
    path, name = target_path(folder, filename)
    if not overwrite and os.path.exists(path):
        raise FileExistsError(f"models/diffusion_models/{name} already exists; set overwrite to replace it")
    patched = pending_weight_patches(model)
    if patched:
        raise SaveError(f"the model carries weight patches (e.g. a LoRA) on {len(patched)} tensor(s) that a "
                        f"saved file would not contain; save the model before patching it", patched)
    if _weights_written_in(model):
        _unload_clones(model)
    contents = save_contents(view_modules(model, remove_duplicate=False))  # every state_dict name
    if not contents.layers:
        raise SaveError("the model has no quantized layers; quantize it first (Quantize Model INT8 or a "
                        "quantizing loader), or use ComfyUI's own model saving for a plain model")
    os.makedirs(os.path.dirname(path), exist_ok=True)
    step = progress_counter(len(contents.tensors))
    size = write_safetensors(path, contents.tensors, contents.metadata(title), overwrite=overwrite,
                             on_tensor=lambda _: step())
    saved, (layers, others) = f"saved models/diffusion_models/{name} ({format_gib(size, '.3f')})", contents.describe()
    full = "\n".join([saved, layers, others, "markers: comfy_quant tensors and the _quantization_metadata header"])
    return node_output(title, f"{saved}\n{layers}", full)
