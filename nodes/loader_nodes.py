"""Loaders for quantized checkpoints: per-layer markers and Quanto files, and online quantization while loading."""
from __future__ import annotations

import folder_paths
from comfy_api.latest import io

from ..host import building, categories
from ..host.loading import load_checkpoint
from ..host.options import OFFLOAD_MODES, QUANTIZATIONS, load_conversions
from ..quant.keep import describe_keep
from ..quant.registry import fit_formats, group_sizes, loader_conversions, marker_format_list, online_summaries
from ..quant.registry import rotation_formats

# the loaders' inputs for what becomes of a file's stored formats, as each format declares its own
_CONVERSION_INPUTS = {
    spec.conversion_option: io.Combo.Input(spec.conversion_option, options=list(spec.conversion_modes),
                                           default=spec.conversion_modes[0], optional=True,
                                           tooltip=spec.conversion_tooltip)
    for spec in loader_conversions()}


class MixedCheckpointLoader(io.ComfyNode):
    @classmethod
    def define_schema(cls):
        return io.Schema(
            node_id="MixedCheckpointLoader",
            display_name="Load Quantized Diffusion Model (markers / Quanto)",
            category=categories.LOADERS,
            description=(
                f"Loads a diffusion model saved with quantized layers: ComfyUI per-layer markers "
                f"({marker_format_list(labels=True)}, mixed in one file, markers as comfy_quant "
                "tensors or in the header), ComfyUI's scaled_fp8 files (*_fp8_scaled) or a self-describing Quanto "
                "qint8 file; the format is detected. ComfyUI's own model detection "
                "picks the architecture, so any model ComfyUI knows loads, on ComfyUI versions without these "
                "formats too. The file is checked before anything is built; a bad file fails with an error naming "
                "the layer."
            ),
            inputs=[
                io.Combo.Input(
                    "unet_name", options=folder_paths.get_filename_list("diffusion_models"),
                    tooltip="A safetensors file in models/diffusion_models with per-layer quantization markers, "
                            "a scaled_fp8 marker or a Quanto quantization map."),
                *_CONVERSION_INPUTS.values(),
            ],
            outputs=[
                io.Model.Output(display_name="model",
                                tooltip="The diffusion model with each layer in its checkpoint format."),
                io.String.Output(display_name="report",
                                 tooltip="What was loaded: layers per format, the execution path of block formats, "
                                         "weights memory."),
            ],
            hidden=[io.Hidden.unique_id],
        )

    @classmethod
    def execute(cls, unet_name, **conversions):
        return load_checkpoint("MixedCheckpointLoader", "diffusion_models", unet_name,
                               conversions=load_conversions(conversions), node_id=cls.hidden.unique_id)


class LoadH3Quantized(io.ComfyNode):
    @classmethod
    def define_schema(cls):
        return io.Schema(
            node_id="LoadH3Quantized",
            display_name="Load Diffusion Model (quantize while loading)",
            category=categories.LOADERS,
            description=(
                "Loads a bf16 or marker-quantized diffusion model (MiniMax-H3, Wan, any model ComfyUI knows) and "
                "quantizes it while loading, one layer at a time: each layer's weight is read from the file, "
                "quantized on the GPU and stored, so the full-precision model is never resident twice. AdaLN "
                "projections, output heads and patch projections stay in full precision, as do layers stored in "
                "fp32. Layers the file already quantized keep their format (scaled_fp8 files' layers stay FP8), "
                "and in such a file the layers it left in full precision stay so, as ComfyUI runs them."
            ),
            inputs=[
                io.Combo.Input(
                    "unet_name", options=folder_paths.get_filename_list("diffusion_models"),
                    tooltip="A bf16/fp16 safetensors file in models/diffusion_models (marker layers in it load "
                            "as stored)."),
                io.Combo.Input(
                    "quantization", options=list(QUANTIZATIONS.values), default="auto",
                    tooltip="auto: the fastest native format of this GPU, measured per layer shape in the dtype "
                            "ComfyUI computes in (a layer no format speeds up stays as it is). "
                            f"{online_summaries()} none: load as stored. "
                            "With a quantization chosen, NVFP4 layers of the file are re-quantized to this "
                            "GPU's fastest native format where it has no NVFP4 GEMM."),
                io.Combo.Input(
                    "offload", options=list(OFFLOAD_MODES.values), default="auto",
                    tooltip="auto: keep the model resident when it fits, else stream the blocks that do not "
                            "fit. none: everything resident (fails if it cannot fit)."),
                io.Combo.Input(
                    "group_size", options=[str(g) for g in group_sizes()], default="256", optional=True,
                    tooltip=f"ConvRot group size ({', '.join(rotation_formats())} and auto). 256 is fastest; 64 "
                            "or 16 also quantize layers whose input width is not a multiple of 256."),
                io.String.Input(
                    "ignored_layers", default="", multiline=True, optional=True,
                    tooltip="More layers to keep in full precision: fnmatch patterns on module names, comma "
                            f"or newline separated. Always kept ({describe_keep()})."),
                io.Float.Input(
                    "fit_gib", default=0.0, min=0.0, max=4096.0, step=0.5, optional=True,
                    tooltip="The most GiB the quantized Linear layers may take (0: no limit). Where the chosen "
                            f"quantization needs more, the largest layers move to {' then '.join(fit_formats())}, "
                            "largest first, until they fit: 4-bit, less exact; the report lists what moved."),
                # a stored format a quantizing load converts by itself has no input here
                *(_CONVERSION_INPUTS[spec.conversion_option] for spec in loader_conversions(quantizing=True)),
            ],
            outputs=[
                io.Model.Output(display_name="model", tooltip="The quantized diffusion model."),
                io.String.Output(display_name="report",
                                 tooltip="Layers per format, every layer kept with its reason, memory saved, and "
                                         "the offload plan."),
            ],
            hidden=[io.Hidden.unique_id],
        )

    # Naming `quantization` and `offload` here replaces ComfyUI's list check of them, so old values of
    # saved workflows still load; they are checked here instead.
    @classmethod
    def validate_inputs(cls, quantization="auto", offload="auto"):
        return QUANTIZATIONS.problem(quantization) or OFFLOAD_MODES.problem(offload) or True

    @classmethod
    def execute(cls, unet_name, quantization, offload, group_size="256", ignored_layers="", fit_gib=0.0,
                **conversions):
        quantization = QUANTIZATIONS.read(quantization, "LoadH3Quantized")
        return load_checkpoint("LoadH3Quantized", "diffusion_models", unet_name,
                               conversions=load_conversions(conversions, quantizing=quantization != "none"),
                               quantization=quantization, group_size=group_size,
                               ignored_layers=ignored_layers, fit_gib=fit_gib, offload_input=offload,
                               cached=True, node_id=cls.hidden.unique_id)


class QuantizedCLIPLoader(io.ComfyNode):
    @classmethod
    def define_schema(cls):
        return io.Schema(
            node_id="QuantizedCLIPLoader",
            display_name="Load Quantized Text Encoder (Quanto / markers)",
            category=categories.LOADERS,
            description=(
                "Loads a text encoder saved as self-describing Quanto qint8 (e.g. DeepBeepMeep's MiniMax-H3 "
                f"encoder) or with ComfyUI per-layer markers ({marker_format_list()}), as "
                "CLIPLoader loads a plain one. Quanto qint8 saves memory, not time: each layer's weight is "
                "dequantized just before its matmul. A marker file whose NVFP4 / MXFP8 layers this GPU runs "
                "dequantized before each matmul in either loader goes to ComfyUI's own loader where that reads "
                "every layer (checked; else the pack loads it and says why): a text encoder's time is moving "
                "its weights, which ComfyUI's loader does fastest; requantize or rename_prefixes loads it here."
            ),
            inputs=[
                io.Combo.Input("clip_name", options=folder_paths.get_filename_list("text_encoders"),
                               tooltip="A safetensors text encoder in models/text_encoders."),
                io.Combo.Input("type", options=building.clip_types(), tooltip="The model family, as in CLIPLoader."),
                io.String.Input(
                    "rename_prefixes", default="", multiline=True, optional=True,
                    tooltip="Rename key prefixes of the file to ComfyUI's names, one 'old -> new' per line "
                            "(empty new strips the prefix). Two names mapping to one is refused."),
                *_CONVERSION_INPUTS.values(),
            ],
            outputs=[
                io.Clip.Output(display_name="clip", tooltip="The text encoder."),
                io.String.Output(display_name="report",
                                 tooltip="What was loaded: layers per format and the memory they take."),
            ],
        )

    @classmethod
    def execute(cls, clip_name, type, rename_prefixes="", **conversions):
        return load_checkpoint("QuantizedCLIPLoader", "text_encoders", clip_name, clip_type=type,
                               rename_prefixes=rename_prefixes, conversions=load_conversions(conversions))


NODES = (MixedCheckpointLoader, LoadH3Quantized, QuantizedCLIPLoader)
