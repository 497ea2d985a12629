"""QuantizeModelINT8: online INT8 ConvRot (or a 4-bit ConvRot format) on a clone of a MODEL."""
from __future__ import annotations

from comfy_api.latest import io

from ..loaders.load import online_method
from ..quant import QuantConfig
from ..quant.keep import describe_keep, keep_patterns
from ..quant.registry import group_sizes, online_summaries, rotation_formats
from . import categories, comfy_compat
from ..quant.kitchen_api import require_kitchen
from .dynamic_vram import prepare_dynamic_vram
from .lora_fold import install_lora_fold
from .node_report import NodeRun, node_output, watch_quantized_layers


class QuantizeModelINT8(io.ComfyNode):
    @classmethod
    def define_schema(cls):
        return io.Schema(
            node_id="QuantizeModelINT8",
            display_name="Quantize Model (INT8 ConvRot)",
            category=categories.MODEL_PATCHES,
            description=(
                "Quantizes the diffusion model's Linear layers to INT8 with ConvRot (comfy-kitchen), layer by "
                "layer, on a clone: other branches that use the input MODEL keep the original weights. Halves the "
                "Linear weights' memory; on GPUs with INT8 tensor cores the fastest measured INT8 kernel runs per "
                "shape."
            ),
            inputs=[
                io.Model.Input("model", tooltip="The diffusion model to quantize. It is cloned, never changed."),
                io.Combo.Input(
                    "group_size", options=[str(g) for g in group_sizes()], default="256",
                    tooltip="ConvRot Hadamard group size. 256 has fused CUDA kernels and is fastest; 64 or 16 "
                            "quantize more layers whose input width is not a multiple of 256, at some speed cost."),
                io.String.Input(
                    "ignored_layers", default="", multiline=True,
                    tooltip="More layers to keep in full precision: fnmatch patterns on module names, "
                            "separated by commas or new lines (e.g. 'blocks.0.*'). '*' keeps everything. "
                            f"Always kept, as by LoadH3Quantized ({describe_keep()})."),
                io.Combo.Input(
                    "row_split", options=["auto", "off"], default="auto", optional=True,
                    tooltip="auto: on CUDA, splitting long inputs into row chunks is one of the kernels measured "
                            "per shape, and used only if faster. off: never split."),
                io.Boolean.Input(
                    "requantize_fp8", default=False, optional=True,
                    tooltip="Layers that come in FP8 (an fp8 weight_dtype, a scaled_fp8 or FP8-marker file): "
                            "off keeps them as they are; on dequantizes each and quantizes it to the chosen "
                            "format (from the FP8 values, not the original weights). The report says which it did."),
                io.Combo.Input(
                    "quantization", options=list(rotation_formats()), default=rotation_formats()[0], optional=True,
                    tooltip=online_summaries(rotation_formats())),
            ],
            outputs=[
                io.Model.Output(display_name="model", tooltip="The quantized model (a clone)."),
                io.String.Output(display_name="report",
                                 tooltip="What was quantized, the memory saved, and every layer kept with its reason."),
            ],
            hidden=[io.Hidden.unique_id],
        )

    @classmethod
    def execute(cls, model, group_size, ignored_layers, row_split="auto", requantize_fp8=False,
                quantization=None):
        unique_id = cls.hidden.unique_id
        require_kitchen("QuantizeModelINT8")
        names = (name for name, _ in model.get_model_object("diffusion_model").named_modules())
        device = comfy_compat.compute_device()
        config = QuantConfig(
            method=online_method(quantization or rotation_formats()[0], int(group_size), device, row_split=row_split),
            # the layers LoadH3Quantized keeps for this architecture, then the user's
            ignored=keep_patterns(names, ignored_layers),
            compute_device=device,
            requantize_fp8=bool(requantize_fp8),
        )
        patched, report, layers = comfy_compat.quantize_on_clone(model, config, title="QuantizeModelINT8")
        short, full = "\n".join(report.brief()), report.render()
        # after each sampling: how many of these layers ran
        watch_quantized_layers(patched, NodeRun(unique_id, short), layers, "QuantizeModelINT8")
        install_lora_fold(patched)
        prepare_dynamic_vram(patched)
        return node_output("QuantizeModelINT8", short, full, (patched, full))


NODES = (QuantizeModelINT8,)
