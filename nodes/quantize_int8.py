"""QuantizeModelINT8: online INT8 ConvRot (or a 4-bit ConvRot format) on a clone of a MODEL."""
from __future__ import annotations

from comfy_api.latest import io

from ..host import categories
from ..host.loading import quantize_model_node
from ..quant.keep import describe_keep
from ..quant.quantize_pass import QuantizeOptions
from ..quant.registry import group_sizes, online_summaries, rotation_formats


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
                "Linear weights' memory; on CUDA from sm80 the pack's Triton INT8 kernels run, elsewhere "
                "comfy-kitchen's."
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
                    tooltip="auto: on CUDA, splitting long inputs into row chunks is one of the kernels timed per "
                            "shape where tuning is asked (BIGDIT_INT8_TUNE=1), and used only if faster. off: never "
                            "split."),
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
        options = QuantizeOptions(quantization or rotation_formats()[0], int(group_size), ignored_layers, row_split,
                                  (("requantize_fp8", "requantize" if requantize_fp8 else "keep"),))
        return quantize_model_node(model, options, "QuantizeModelINT8", cls.hidden.unique_id)


NODES = (QuantizeModelINT8,)
