"""SetAttentionBackend: choose the attention kernel of a model."""
from comfy_api.latest import io

from ..attention import BACKENDS, DENSE_BACKENDS, Router, backend_params
from ..attention.schedule import block_count, check_layers, parse_layers
from ..host import categories
from ..host.attention_install import install_router
from ..host.options import validates


class SetAttentionBackend(io.ComfyNode):
    @classmethod
    def define_schema(cls):
        return io.Schema(
            node_id="SetAttentionBackend",
            display_name="Set Attention Backend",
            category=categories.MODEL_PATCHES,
            description=(
                "Runs the model's attention with the chosen kernel: sdpa (PyTorch), flash (the best installed "
                "FlashAttention, else PyTorch's flash kernel), fa3_fp8 (FlashAttention 3 in FP8, Hopper), "
                "sage (SageAttention 2's kernel for this GPU, or SageAttention 1), kitchen_int8 (comfy-kitchen INT8), "
                "sol (comfy-kitchen's Sol sparse attention, with a dense stage) or auto (the fastest dense kernel, "
                "measured on this GPU for each shape at first use). A call the kernel cannot take runs the dense backend, then PyTorch SDPA, "
                "with one warning per reason. An attention override already on the model is kept and gets this "
                "backend as the attention it falls back to; an earlier Set Attention Backend is replaced."
            ),
            inputs=[
                io.Model.Input("model", tooltip="The diffusion model whose attention to replace."),
                io.Combo.Input(
                    "backend", options=list(BACKENDS), default="auto",
                    tooltip="Attention kernel. auto: times the installed kernels on this GPU at the first call of "
                            "each shape and runs the fastest; an 8-bit one (sage, fa3_fp8, kitchen_int8) only "
                            "where a probe of the call is within 5% (relative L2) of exact attention (SDPA on "
                            "CPU). sage: SageAttention 2's kernel for this GPU (INT8 QK, FP8 or FP16 PV), else "
                            "SageAttention 1. fa3_fp8: FP8 q/k/v, about 3-5% error. sol: sparse; pays off above "
                            "about 12k tokens."),
                io.Combo.Input(
                    "dense_backend", options=list(DENSE_BACKENDS), default="auto", optional=True,
                    tooltip="What runs wherever the backend does not: the dense steps and blocks below, and any "
                            "call the backend cannot take (mask, head dim, dtype, device, short sequence)."),
                # each backend's own settings, as it declares them (Sol's sol_tau)
                *(io.Float.Input(p.name, default=p.default, min=p.low, max=p.high, step=p.step, optional=True,
                                 tooltip=p.tooltip) for p in backend_params()),
                io.Int.Input(
                    "dense_steps", default=0, min=0, max=10000, optional=True,
                    tooltip="The first this many sampling steps run the dense backend (counted within each "
                            "sampler's schedule). Meant for sol; applies to any backend."),
                io.String.Input(
                    "dense_layers", default="", optional=True,
                    tooltip="Transformer blocks that always run the dense backend, e.g. '0,1' or '0, 47-49'."),
            ],
            outputs=[io.Model.Output(
                tooltip="The model with the attention backend installed (the input model is unchanged).")],
            hidden=[io.Hidden.unique_id],
        )

    # Naming the backends' settings here replaces ComfyUI's min/max check of them, so their ranges are checked
    # here too (NaN passes every comparison). A value linked from another node is None here, checked in execute.
    @classmethod
    @validates("dense_layers", *(p.name for p in backend_params()))
    def validate_inputs(cls, dense_layers="", **settings):
        problems = [p.problem(settings[p.name]) for p in backend_params() if settings.get(p.name) is not None]
        if dense_layers is not None:
            try:
                parse_layers(dense_layers)
            except ValueError as e:
                problems.append(str(e))
        return "; ".join(problem for problem in problems if problem) or True

    @classmethod
    def execute(cls, model, backend, dense_backend="auto", dense_steps=0, dense_layers="", **settings):
        problem = cls.validate_inputs(dense_layers, **settings)
        if problem is not True:
            raise ValueError(f"SetAttentionBackend: {problem}")
        router = Router(backend, dense_backend, dense_steps=dense_steps, dense_layers=dense_layers, **settings)
        blocks = block_count(model.get_model_object("diffusion_model"))
        if blocks is not None:  # the model is only known here; a model without a block list is not checked
            try:
                check_layers(router.schedule.dense_layers, blocks)
            except ValueError as e:
                raise ValueError(f"SetAttentionBackend: {e}") from None
        patched, text = install_router(model, router, cls.hidden.unique_id)
        return io.NodeOutput(patched, ui={"text": [text]})


NODES = (SetAttentionBackend,)
