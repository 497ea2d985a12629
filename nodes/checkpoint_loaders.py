"""Loaders for quantized checkpoints: per-layer markers and Quanto files, and online quantization while loading."""
from __future__ import annotations

import folder_paths

from ..loaders import LayerBuilder, inspect_checkpoint
from ..loaders.options import (OFFLOAD_MODES, QUANTIZATIONS, online_config, online_method, parse_prefix_rules,
                               progress_total)
from ..quant.int8_convrot import GROUP_SIZES
from ..quant.keep import describe_keep
from . import categories, checkpoint_compat as compat
from .comfy_compat import compute_device, quantized_layers
from .kitchen import require_kitchen
from .lora_fold import install_lora_fold
from .node_report import NodeRun, node_output, watch_quantized_layers
from .offload import install_offload

_NVFP4_TOOLTIP = ("NVFP4 layers run natively only on sm100+ GPUs. auto: native there, elsewhere dequantized before "
                  "each matmul (correct, saves memory, not fast). requantize: elsewhere, re-quantize them at load "
                  "to this GPU's fastest native format (FP8 on sm89/sm90, INT8 ConvRot before that and on CPU); "
                  "the report says which happened.")


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
    short, full = "\n".join(builder.report.brief()), builder.report.render()
    if clip_type is None:
        # on the node: the layers' lines, then the plan, which each sampling's `last run:` line replaces
        run = NodeRun(node_id, short)
        if offload is not None:
            offload_report = install_offload(loaded, offload, on_run=lambda line: run.add("offload", line))
            short, full = f"{short}\n{offload_report.brief}", "\n".join([full, offload_report.full])
        watch_quantized_layers(loaded, run, quantized_layers(loaded), title)
        install_lora_fold(loaded)
    return node_output(title, short, full, (loaded, full))


class MixedCheckpointLoader:
    DESCRIPTION = (
        "Loads a diffusion model saved with quantized layers: ComfyUI per-layer markers (int8_tensorwise with or "
        "without ConvRot, float8_e4m3fn, nvfp4, mxfp8, mixed in one file, markers as comfy_quant tensors or in the "
        "header), ComfyUI's scaled_fp8 files (*_fp8_scaled) or a self-describing Quanto qint8 file; the format is "
        "detected. ComfyUI's own model detection "
        "picks the architecture, so any model ComfyUI knows loads, on ComfyUI versions without these formats too. "
        "The file is checked before anything is built; a bad file fails with an error naming the layer."
    )
    CATEGORY = categories.LOADERS
    FUNCTION = "load"
    RETURN_TYPES = ("MODEL", "STRING")
    RETURN_NAMES = ("model", "report")
    OUTPUT_TOOLTIPS = ("The diffusion model with each layer in its checkpoint format.",
                       "What was loaded: layers per format, the execution path of block formats, weights memory.")

    @classmethod
    def INPUT_TYPES(cls):
        return {
            "required": {
                "unet_name": (folder_paths.get_filename_list("diffusion_models"), {
                    "tooltip": "A safetensors file in models/diffusion_models with per-layer quantization markers, "
                               "a scaled_fp8 marker or a Quanto quantization map."}),
            },
            "optional": {
                "nvfp4": (["auto", "requantize"], {"default": "auto", "tooltip": _NVFP4_TOOLTIP}),
            },
            "hidden": {"unique_id": "UNIQUE_ID"},
        }

    def load(self, unet_name, nvfp4="auto", unique_id=None):
        return load_checkpoint("MixedCheckpointLoader", "diffusion_models", unet_name, nvfp4=nvfp4, node_id=unique_id)


class LoadH3Quantized:
    DESCRIPTION = (
        "Loads a bf16 or marker-quantized diffusion model (MiniMax-H3, Wan, any model ComfyUI knows) and quantizes "
        "it while loading, one layer at a time: each layer's weight is read from the file, quantized on the GPU and "
        "stored, so the full-precision model is never resident twice. AdaLN projections, output heads and patch "
        "projections stay in full precision, as do layers stored in fp32. Layers the file already quantized keep "
        "their format (scaled_fp8 files' layers stay FP8)."
    )
    CATEGORY = categories.LOADERS
    FUNCTION = "load"
    RETURN_TYPES = ("MODEL", "STRING")
    RETURN_NAMES = ("model", "report")
    OUTPUT_TOOLTIPS = ("The quantized diffusion model.",
                       "Layers per format, every layer kept with its reason, memory saved, and the offload plan.")

    @classmethod
    def INPUT_TYPES(cls):
        return {
            "required": {
                "unet_name": (folder_paths.get_filename_list("diffusion_models"), {
                    "tooltip": "A bf16/fp16 safetensors file in models/diffusion_models (marker layers in it load "
                               "as stored)."}),
                "quantization": (list(QUANTIZATIONS.values), {
                    "default": "auto",
                    "tooltip": "auto: the fastest native format of this GPU, measured per layer shape (a layer "
                               "no format speeds up stays bf16). int8_convrot: INT8 with ConvRot rotation. "
                               "float8_e4m3fn: FP8 per-channel weights, per-token activations (sm89+ native). "
                               "mxfp4: MXFP4 (native on MI350+/sm100+, emulated elsewhere). none: load as stored. "
                               "With a quantization chosen, NVFP4 layers of the file are re-quantized to this "
                               "GPU's fastest native format where it has no NVFP4 GEMM."}),
                "offload": (list(OFFLOAD_MODES.values), {
                    "default": "auto",
                    "tooltip": "auto: keep the model resident when it fits, else stream the blocks that do not "
                               "fit. none: everything resident (fails if it cannot fit)."}),
            },
            "optional": {
                "group_size": ([str(g) for g in reversed(GROUP_SIZES)], {
                    "default": "256",
                    "tooltip": "INT8 ConvRot group size (int8_convrot and auto). 256 is fastest; 64 or 16 also "
                               "quantize layers whose input width is not a multiple of 256."}),
                "ignored_layers": ("STRING", {
                    "default": "", "multiline": True,
                    "tooltip": "More layers to keep in full precision: fnmatch patterns on module names, comma "
                               f"or newline separated. Always kept ({describe_keep()})."}),
            },
            "hidden": {"unique_id": "UNIQUE_ID"},
        }

    # Naming `quantization` and `offload` here replaces ComfyUI's list check of them, so old values of
    # saved workflows still load; they are checked here instead.
    @classmethod
    def VALIDATE_INPUTS(cls, quantization="auto", offload="auto"):
        return QUANTIZATIONS.problem(quantization) or OFFLOAD_MODES.problem(offload) or True

    def load(self, unet_name, quantization, offload, group_size="256", ignored_layers="", unique_id=None):
        return load_checkpoint("LoadH3Quantized", "diffusion_models", unet_name,
                               quantization=QUANTIZATIONS.read(quantization, "LoadH3Quantized"), group_size=group_size,
                               ignored_layers=ignored_layers, offload=offload, node_id=unique_id)


class QuantizedCLIPLoader:
    DESCRIPTION = (
        "Loads a text encoder saved as self-describing Quanto qint8 (e.g. DeepBeepMeep's MiniMax-H3 encoder) or "
        "with ComfyUI per-layer markers (int8_tensorwise, float8_e4m3fn, nvfp4, mxfp8), as CLIPLoader loads a "
        "plain one. Quanto qint8 saves memory, not time: each layer's weight is dequantized just before its matmul."
    )
    CATEGORY = categories.LOADERS
    FUNCTION = "load"
    RETURN_TYPES = ("CLIP", "STRING")
    RETURN_NAMES = ("clip", "report")
    OUTPUT_TOOLTIPS = ("The text encoder.", "What was loaded: layers per format and the memory they take.")

    @classmethod
    def INPUT_TYPES(cls):
        return {
            "required": {
                "clip_name": (folder_paths.get_filename_list("text_encoders"), {
                    "tooltip": "A safetensors text encoder in models/text_encoders."}),
                "type": (compat.clip_types(), {"tooltip": "The model family, as in CLIPLoader."}),
            },
            "optional": {
                "rename_prefixes": ("STRING", {
                    "default": "", "multiline": True,
                    "tooltip": "Rename key prefixes of the file to ComfyUI's names, one 'old -> new' per line "
                               "(empty new strips the prefix). Two names mapping to one is refused."}),
                "nvfp4": (["auto", "requantize"], {"default": "auto", "tooltip": _NVFP4_TOOLTIP}),
            },
        }

    def load(self, clip_name, type, rename_prefixes="", nvfp4="auto"):
        return load_checkpoint("QuantizedCLIPLoader", "text_encoders", clip_name, clip_type=type,
                               rename_prefixes=rename_prefixes, nvfp4=nvfp4)


NODES = {
    "MixedCheckpointLoader": (MixedCheckpointLoader, "Load Quantized Diffusion Model (markers / Quanto)"),
    "LoadH3Quantized": (LoadH3Quantized, "Load Diffusion Model (quantize while loading)"),
    "QuantizedCLIPLoader": (QuantizedCLIPLoader, "Load Quantized Text Encoder (Quanto / markers)"),
}
