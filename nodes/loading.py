"""The node side of the loaders' one load path (loaders/load.py): ComfyUI builds the model, then what a model
with quantized layers needs after each load and sampling is installed, and the report goes on the node."""
from __future__ import annotations

import folder_paths

from ..loaders.load import LoadOptions, load
from .comfy_compat import compute_device, quantized_layers
from .comfy_host import ComfyHost
from .dynamic_vram import prepare_dynamic_vram
from .file_backed import back_with_file
from .lora_fold import install_lora_fold
from .node_report import NodeRun, node_output, watch_quantized_layers
from .offload import install_offload


def load_checkpoint(title: str, folder: str, file_name: str, *, clip_type: str | None = None, nvfp4: str = "auto",
                    quantization: str = "none", group_size: str = "256", ignored_layers: str = "",
                    rename_prefixes: str = "", fit_gib: float = 0.0, offload_input: str | None = None,
                    node_id=None) -> dict:
    """The one load path of the three loaders: a diffusion model, or with `clip_type` a text encoder
    (loaders.load.load). `offload_input` is the node's offload mode ("none" a mode too); without the input
    (None) no offload is installed, as on a text encoder."""
    path = folder_paths.get_full_path_or_raise(folder, file_name)
    options = LoadOptions(title, text_encoder=clip_type is not None, nvfp4=nvfp4, quantization=quantization,
                          group_size=int(group_size), ignored_layers=ignored_layers, rename_prefixes=rename_prefixes,
                          fit_gib=float(fit_gib))
    host = ComfyHost(clip_type, folder_paths.get_folder_paths("embeddings") if clip_type is not None else None)
    loaded, report = load(path, options, compute_device(), host)
    backed = back_with_file(loaded, file_name) if clip_type is None else None
    if backed:
        report.notes.append(backed)
    short, full = "\n".join(report.brief()), report.render()
    if clip_type is None:
        # on the node: the layers' lines, then the plan, which each sampling's `last run:` line replaces
        run = NodeRun(node_id, short)
        if offload_input is not None:
            offload_report = install_offload(loaded, offload_input, on_run=lambda line: run.add("offload", line))
            short, full = f"{short}\n{offload_report.brief}", "\n".join([full, offload_report.full])
        watch_quantized_layers(loaded, run, quantized_layers(loaded), title)
        install_lora_fold(loaded)
        prepare_dynamic_vram(loaded)
    return node_output(title, short, full, (loaded, full))
