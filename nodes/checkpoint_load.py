"""The one load path of the loader nodes: inspect a file whole, then have ComfyUI build the model through a
LayerBuilder, and install what a model with quantized layers needs after each load and sampling."""
from __future__ import annotations

import os

import folder_paths

from ..loaders import LayerBuilder, inspect_checkpoint
from ..loaders.file_map import release_file_map
from ..units import format_gib
from . import checkpoint_compat as compat
from .comfy_compat import compute_device, quantized_layers
from .dynamic_vram import prepare_dynamic_vram
from .file_backed import back_with_file
from .kitchen import require_kitchen
from .lora_fold import install_lora_fold
from .node_report import NodeRun, node_output, watch_quantized_layers
from .offload import install_offload
from .options import online_config, online_method, parse_prefix_rules, progress_total


def load_checkpoint(title: str, folder: str, file_name: str, *, clip_type: str | None = None, nvfp4: str = "auto",
                    quantization: str = "none", group_size: str = "256", ignored_layers: str = "",
                    rename_prefixes: str = "", offload: str | None = None, node_id=None) -> dict:
    """The one load path of the three loaders: a diffusion model, or with `clip_type` a text encoder. The file
    is inspected whole, then ComfyUI builds the model through a LayerBuilder (which quantizes online with
    `quantization`, NVFP4 layers then re-quantized); `offload` is installed on a diffusion model."""
    path = folder_paths.get_full_path_or_raise(folder, file_name)
    device = compute_device()
    method = None
    if quantization != "none":
        require_kitchen(title)
        method = online_method(quantization, int(group_size), device)
    plan = inspect_checkpoint(path, compat.interrupt_check())
    if clip_type is None:
        plan = compat.diffusion_namespace(plan)
    if plan.layers:
        require_kitchen(title)
    rules = parse_prefix_rules(rename_prefixes)
    if rules:
        plan = plan.renamed(rules)
    config = online_config(method, device, plan, ignored_layers)
    with plan.open() as source:
        builder = LayerBuilder(plan, source, device, online=config, nvfp4=nvfp4 if config is None else "requantize",
                               title=title, progress=compat.progress_counter(progress_total(plan)))
        builder.resolve_methods()
        state_dict = plan.state_dict(source)
        if clip_type is None:
            loaded = compat.load_diffusion_model(plan, builder, state_dict)
        else:
            loaded = compat.load_text_encoder(plan, builder, state_dict, clip_type,
                                              folder_paths.get_folder_paths("embeddings"))
        del state_dict
        copied = release_file_map(loaded.model if clip_type is None else loaded.cond_stage_model,
                                  source.file_map, os.path.getsize(path))
    if source.file_map.released_bytes:
        builder.report.notes.append(f"gave back the file's pages as its tensors were consumed "
                                    f"({format_gib(source.file_map.released_bytes)})")
    if copied:
        builder.report.notes.append(f"copied the {format_gib(copied)} of the file's tensors ComfyUI kept "
                                    "mapped, so the file's map is released")
    backed = back_with_file(loaded, file_name) if clip_type is None else None
    if backed:
        builder.report.notes.append(backed)
    short, full = "\n".join(builder.report.brief()), builder.report.render()
    if clip_type is None:
        # on the node: the layers' lines, then the plan, which each sampling's `last run:` line replaces
        run = NodeRun(node_id, short)
        if offload is not None:
            offload_report = install_offload(loaded, offload, on_run=lambda line: run.add("offload", line))
            short, full = f"{short}\n{offload_report.brief}", "\n".join([full, offload_report.full])
        watch_quantized_layers(loaded, run, quantized_layers(loaded), title)
        install_lora_fold(loaded)
        prepare_dynamic_vram(loaded)
    return node_output(title, short, full, (loaded, full))
