"""QuantizeModelINT8: online INT8 ConvRot on a clone of a MODEL."""
from __future__ import annotations

from ..quant import QuantConfig
from ..quant.int8_convrot import GROUP_SIZES, Int8ConvRotMethod
from ..quant.keep import describe_keep, keep_patterns
from . import categories, comfy_compat
from .kitchen import require_kitchen
from .lora_fold import install_lora_fold
from .node_report import NodeRun, node_output, watch_quantized_layers


class QuantizeModelINT8:
    DESCRIPTION = (
        "Quantizes the diffusion model's Linear layers to INT8 with ConvRot (comfy-kitchen), layer by layer, "
        "on a clone: other branches that use the input MODEL keep the original weights. Halves the Linear "
        "weights' memory; on GPUs with INT8 tensor cores the fastest measured INT8 kernel runs per shape."
    )
    CATEGORY = categories.MODEL_PATCHES
    FUNCTION = "quantize"
    RETURN_TYPES = ("MODEL", "STRING")
    RETURN_NAMES = ("model", "report")
    OUTPUT_TOOLTIPS = ("The quantized model (a clone).", "What was quantized, the memory saved, and every layer kept with its reason.")

    @classmethod
    def INPUT_TYPES(cls):
        return {
            "required": {
                "model": ("MODEL", {"tooltip": "The diffusion model to quantize. It is cloned, never changed."}),
                "group_size": ([str(g) for g in reversed(GROUP_SIZES)], {
                    "default": "256",
                    "tooltip": "ConvRot Hadamard group size. 256 has fused CUDA kernels and is fastest; 64 or 16 "
                               "quantize more layers whose input width is not a multiple of 256, at some speed cost.",
                }),
                "ignored_layers": ("STRING", {
                    "default": "", "multiline": True,
                    "tooltip": "More layers to keep in full precision: fnmatch patterns on module names, "
                               "separated by commas or new lines (e.g. 'blocks.0.*'). '*' keeps everything. "
                               f"Always kept, as by LoadH3Quantized ({describe_keep()}).",
                }),
            },
            "optional": {
                "row_split": (["auto", "off"], {
                    "default": "auto",
                    "tooltip": "auto: on CUDA, splitting long inputs into row chunks is one of the kernels measured "
                               "per shape, and used only if faster. off: never split.",
                }),
                "requantize_fp8": ("BOOLEAN", {
                    "default": False,
                    "tooltip": "Layers that come in FP8 (an fp8 weight_dtype, a scaled_fp8 or FP8-marker file): "
                               "off keeps them as they are; on dequantizes each and quantizes it to INT8 ConvRot "
                               "(from the FP8 values, not the original weights). The report says which it did.",
                }),
            },
            "hidden": {"unique_id": "UNIQUE_ID"},
        }

    def quantize(self, model, group_size, ignored_layers, row_split="auto", requantize_fp8=False, unique_id=None):
        require_kitchen("QuantizeModelINT8")
        names = (name for name, _ in model.get_model_object("diffusion_model").named_modules())
        config = QuantConfig(
            method=Int8ConvRotMethod(int(group_size), row_split),
            # the layers LoadH3Quantized keeps for this architecture, then the user's
            ignored=keep_patterns(names, ignored_layers),
            compute_device=comfy_compat.compute_device(),
            requantize_fp8=bool(requantize_fp8),
        )
        patched, report, layers = comfy_compat.quantize_on_clone(model, config, title="QuantizeModelINT8")
        short, full = "\n".join(report.brief()), report.render()
        # after each sampling: how many of these layers ran
        watch_quantized_layers(patched, NodeRun(unique_id, short), layers, "QuantizeModelINT8")
        install_lora_fold(patched)
        return node_output("QuantizeModelINT8", short, full, (patched, full))


NODES = {"QuantizeModelINT8": (QuantizeModelINT8, "Quantize Model (INT8 ConvRot)")}
