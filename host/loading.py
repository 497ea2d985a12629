"""The host side of the loaders' one load path (loaders/load.py): ComfyUI builds the model, then what a model
with quantized layers needs after each load and sampling is installed, and the report goes on the node."""
from __future__ import annotations

import folder_paths

from ..loaders.load import LoadOptions, emulated_alike, load
from ..quant.quantize_pass import QuantizeOptions
from .model import compute_device, quantize_on_clone, quantized_layers
from .building import ComfyHost, host_marker_formats, host_text_encoder
from .cache import load_with_cache
from .dynamic_vram import prepare_dynamic_vram
from .file_backed import back_with_file
from .lora_fold import install_lora_fold
from .report import NodeRun, node_output, watch_quantized_layers
from .offload import install_offload
from .read_ahead import hook_sampling
from .tuning import use_tuning_store


def comfy_host(clip_type: str | None, disable_dynamic: bool = False) -> ComfyHost:
    return ComfyHost(clip_type, folder_paths.get_folder_paths("embeddings") if clip_type is not None else None,
                     disable_dynamic=disable_dynamic)


def reload_patcher(path: str, options: LoadOptions, clip_type: str | None, cached: bool = False,
                   disable_dynamic: bool = False):
    """The file loaded again as before (through the quantize-once cache where `cached`), into a fresh patcher
    (without dynamic VRAM where asked): upstream's `cached_patcher_init` factory, which
    `clone(disable_dynamic=True)` (TorchCompileModel) and its multi-GPU clones call for a model of their own.
    They take its model only; the clone keeps the node's patches."""
    host = comfy_host(clip_type, disable_dynamic)
    loaded = (load_with_cache if cached else load)(path, options, compute_device(), host)[0]
    return loaded if clip_type is None else loaded.patcher


def load_checkpoint(title: str, folder: str, file_name: str, *, clip_type: str | None = None,
                    conversions: tuple[tuple[str, str], ...] = (), quantization: str = "none", group_size: str = "256", ignored_layers: str = "",
                    rename_prefixes: str = "", fit_gib: float = 0.0, offload_input: str | None = None,
                    cached: bool = False, node_id=None) -> dict:
    """The one load path of the three loaders: a diffusion model, or with `clip_type` a text encoder
    (loaders.load.load). `conversions`: the node's inputs that convert the file's stored formats, by name
    (LoadOptions.conversions). `offload_input` is the node's offload mode ("none" a mode too); without the
    input (None) no offload is installed, as on a text encoder. `cached`: a diffusion model goes through the
    quantize-once cache (host/cache.py)."""
    path = folder_paths.get_full_path_or_raise(folder, file_name)
    use_tuning_store()  # what auto's conversion and the kernels' configs read
    options = LoadOptions(title, text_encoder=clip_type is not None, conversions=conversions, quantization=quantization,
                          group_size=int(group_size), ignored_layers=ignored_layers, rename_prefixes=rename_prefixes,
                          fit_gib=float(fit_gib))
    host_note = None
    if clip_type is not None:
        alike = emulated_alike(path, options, compute_device(), host_marker_formats())
        if alike is not None:
            clip, host_note = host_text_encoder(path, clip_type, folder_paths.get_folder_paths("embeddings"),
                                                alike.quantized)
            if clip is not None:
                short = "loaded by ComfyUI's own text-encoder loader, as CLIPLoader loads it"
                full = (f"{short}: {alike.why}; nothing the pack does would change how it runs (requantize or "
                        f"rename_prefixes loads it through the pack)")
                return node_output(title, short, full, (clip, full))
    cached = cached and clip_type is None
    written = None
    if cached:
        loaded, report, written = load_with_cache(path, options, compute_device(), comfy_host(None))
    else:
        loaded, report = load(path, options, compute_device(), comfy_host(clip_type))
    patcher = loaded if clip_type is None else loaded.patcher
    if hasattr(patcher, "cached_patcher_init"):  # upstream's loaders leave the factory that loads them again
        patcher.cached_patcher_init = (reload_patcher, (path, options, clip_type, cached))
    if host_note is not None:
        report.notes.append(f"{host_note}, so the pack loaded it")
    backed = back_with_file(loaded, file_name, written) if clip_type is None else None
    if backed:
        report.notes.append(backed)
    short, full = "\n".join(report.brief()), report.render()
    if clip_type is None:
        # on the node: the layers' lines, then the plan, which each sampling's `last run:` line replaces
        run = NodeRun(node_id, short)
        if offload_input is not None:
            offload_report = install_offload(loaded, offload_input, on_run=lambda line: run.add("offload", line))
            short, full = f"{short}\n{offload_report.brief}", "\n".join([full, offload_report.full])
        attach_quantized(loaded, run, quantized_layers(loaded), title)
    return node_output(title, short, full, (loaded, full))


def attach_quantized(patcher, run: NodeRun, layers: dict, title: str) -> None:
    """What a model with the pack's quantized `layers` needs after each load and sampling: the count of the
    layers that ran on the node, a LoRA folded into the quantized weights, the host's paging of them under dynamic
    VRAM, the read-ahead's hooks on its sampling (host/read_ahead.py's hook_sampling)."""
    watch_quantized_layers(patcher, run, layers, title)
    install_lora_fold(patcher, run)
    prepare_dynamic_vram(patcher)
    hook_sampling(patcher)


def quantize_model_node(model, options: QuantizeOptions, title: str, node_id):
    """QuantizeModelINT8: `model`'s diffusion model quantized on a clone (host.model.quantize_on_clone), with
    what its layers need attached; the node's output."""
    patched, report, layers = quantize_on_clone(model, options, title)
    short, full = "\n".join(report.brief()), report.render()
    attach_quantized(patched, NodeRun(node_id, short), layers, title)
    return node_output(title, short, full, (patched, full))
