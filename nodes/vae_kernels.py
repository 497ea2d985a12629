"""SetVAEKernels: a VAE's decode on the pack's kernels (host/vae.py), on a copy of the VAE."""
from comfy_api.latest import io

from ..attention import BACKENDS
from ..host import categories
from ..host.report import node_output
from ..host.vae import HOST, LINEARS, TILES, TITLE, WEIGHTS, set_vae_kernels


class SetVAEKernels(io.ComfyNode):
    @classmethod
    def define_schema(cls):
        return io.Schema(
            node_id="SetVAEKernels",
            display_name="Set VAE Kernels",
            category=categories.MODEL_PATCHES,
            description=(
                "Decodes with the pack's kernels, on a copy of the VAE (the VAE's own decode and tiling run): the "
                "layers its file stores quantized (MiniMax-H3's INT8 ConvRot decoder) on the pack's INT8 path, "
                "holding the file's tensors; its attention on the chosen backend; its weights kept on the card for "
                "the whole decode, ComfyUI asked to free the room first; its spatial tiles decoded in batches. A VAE "
                "with nothing the pack runs (Wan's) passes through unchanged, and the node says so."
            ),
            inputs=[
                io.Vae.Input("vae", tooltip="The VAE. It is copied, never changed."),
                io.Combo.Input(
                    "attention", options=[*BACKENDS, HOST], default="auto",
                    tooltip="The decoder's attention kernel, as Set Attention Backend's backend: auto times the "
                            "installed kernels at the first call of each shape and runs the fastest (an 8-bit "
                            "one only within 5% of exact attention). host: ComfyUI's own attention."),
                io.Combo.Input(
                    "linears", options=list(LINEARS), default="pack",
                    tooltip="pack: the layers the file stores quantized run on the pack's kernels (INT8: "
                            "comfy-kitchen's or the pack's Triton kernel, measured per shape). host: ComfyUI's "
                            "own layers."),
                io.Combo.Input(
                    "weights", options=list(WEIGHTS), default="resident",
                    tooltip="resident: under dynamic VRAM the pack's layers are copied onto the card once per "
                            "decode, after ComfyUI frees room for them (the sampled model's pages go first), "
                            "instead of paged per call; where they do not fit, ComfyUI pages them. host: "
                            "ComfyUI's placement."),
                io.Combo.Input(
                    "tiles", options=list(TILES), default="batched", optional=True,
                    tooltip="batched: a VAE that decodes in spatial tiles of one size (MiniMax-H3's video VAE) "
                            "runs its decoder on as many tiles at once as the card's free memory holds, instead "
                            "of one pass per tile; the VAE's own tiling and blending place them. host: one pass "
                            "per tile, as ComfyUI runs it."),
            ],
            outputs=[io.Vae.Output(display_name="vae", tooltip="The VAE decoding with these kernels (a copy).")],
            hidden=[io.Hidden.unique_id],
        )

    @classmethod
    def execute(cls, vae, attention="auto", linears="pack", weights="resident", tiles="batched"):
        patched, short, full = set_vae_kernels(vae, attention, linears, weights, cls.hidden.unique_id, tiles)
        return node_output(TITLE, short, full, (patched,))


NODES = (SetVAEKernels,)
