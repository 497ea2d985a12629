"""SaveQuantizedModel: a quantized diffusion model -> a safetensors file in models/diffusion_models.

The file holds every tensor of the diffusion model under its state_dict name
(what UNETLoader and the pack's loaders detect the architecture from), the
quantized layers in the layouts upstream ComfyUI loads natively, with
`comfy_quant` markers (loaders/saving.py). The next load is a plain read
instead of a quantization pass.
"""
from __future__ import annotations

from comfy_api.latest import io

from ..host import categories
from ..host.saving import save_model


class SaveQuantizedModel(io.ComfyNode):
    @classmethod
    def define_schema(cls):
        return io.Schema(
            node_id="SaveQuantizedModel",
            display_name="Save Quantized Model",
            category=categories.MODEL_SAVE,
            description=(
                "Saves a quantized diffusion model (from Quantize Model INT8 or the quantizing loaders) as a "
                "safetensors file in models/diffusion_models, with ComfyUI per-layer markers in the layouts upstream "
                "ComfyUI loads natively: the next load is a plain read (Load Diffusion Model on a ComfyUI with these "
                "formats, or Load Quantized Diffusion Model on any), not a new quantization. Written one tensor at a "
                "time; the file appears only when complete."
            ),
            inputs=[
                io.Model.Input("model", tooltip="The quantized diffusion model to save."),
                io.String.Input(
                    "filename", default="quantized/model_int8.safetensors",
                    tooltip="Path of the file inside models/diffusion_models, ending in .safetensors; "
                            "sub-folders are created."),
                io.Boolean.Input(
                    "overwrite", default=False,
                    tooltip="Replace an existing file of that name. Off: an existing file is an error and is "
                            "left untouched."),
            ],
            is_output_node=True,
        )

    @classmethod
    def execute(cls, model, filename, overwrite):
        return save_model(model, filename, overwrite, "SaveQuantizedModel")


NODES = (SaveQuantizedModel,)
