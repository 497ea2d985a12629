"""SetAttentionBackend: choose the attention kernel of a model."""
import comfy.patcher_extension
import torch
from comfy_api.latest import io

from ..pack_logging import pack_logger
from ..attention import BACKENDS, DENSE_BACKENDS, Router, install, summary
from ..attention.override import KEY as OVERRIDE_KEY, not_reached
from ..attention.schedule import block_count, check_layers, parse_layers
from ..attention.sol import sol_min_tokens
from . import categories
from .node_report import compiled_by_comfy, show_on_node

log = pack_logger(__name__)

# key of our DIFFUSION_MODEL wrapper, ON_CLEANUP callback and attachment
KEY = "bigdit_attention"


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
                io.Float.Input(
                    "sol_tau", default=1.0, min=0.0, max=4.0, step=0.05, optional=True,
                    tooltip="Sol routing threshold in standard deviations of the block scores: higher attends "
                            "fewer key blocks exactly, faster and less exact."),
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

    # Naming sol_tau here replaces ComfyUI's min/max check of it, so the range is checked here too
    # (NaN passes every comparison). A value linked from another node is None here, checked in execute.
    TAU_RANGE = (0.0, 4.0)

    @classmethod
    def validate_inputs(cls, sol_tau=1.0, dense_layers=""):
        problems = []
        low, high = cls.TAU_RANGE
        if sol_tau is not None and (not isinstance(sol_tau, (int, float)) or not low <= sol_tau <= high):
            problems.append(f"sol_tau must be a number from {low:g} to {high:g}, got {sol_tau!r}")
        if dense_layers is not None:
            try:
                parse_layers(dense_layers)
            except ValueError as e:
                problems.append(str(e))
        return "; ".join(problems) or True

    @classmethod
    def execute(cls, model, backend, dense_backend="auto", sol_tau=1.0, dense_steps=0, dense_layers=""):
        unique_id = cls.hidden.unique_id
        problem = cls.validate_inputs(sol_tau, dense_layers)
        if problem is not True:
            raise ValueError(f"SetAttentionBackend: {problem}")
        router = Router(backend, dense_backend, sol_tau=sol_tau, dense_steps=dense_steps, dense_layers=dense_layers,
                        sol_min_tokens=sol_min_tokens())
        blocks = block_count(model.get_model_object("diffusion_model"))
        if blocks is not None:  # the model is only known here; a model without a block list is not checked
            try:
                check_layers(router.schedule.dense_layers, blocks)
            except ValueError as e:
                raise ValueError(f"SetAttentionBackend: {e}") from None
        patched = model.clone()
        options = patched.model_options.setdefault("transformer_options", {})
        override, how = install(options, router)

        composed = {"installed": "", "replaced": "; replaced an earlier Set Attention Backend",
                    "wrapped": f"; wrapping the existing override {override.previous!r}"}[how]
        text = f"attention: {router.describe()}{composed}"

        forwards = [0]  # of the diffusion model since the last report

        # block counting restarts with every forward of the diffusion model
        def begin_forward(executor, *args, **kwargs):
            router.begin_forward()
            if not torch.compiler.is_compiling():  # under TorchCompileModel a counter read recompiles per call
                forwards[0] += 1
            return executor(*args, **kwargs)

        def report(sampled):
            counts = router.stats.take_run()
            ran, forwards[0] = forwards[0], 0
            choices = router.take_choices()
            if counts["calls"]:
                log.info("Set Attention Backend (%s): %s", router.describe(), summary(counts))
                show_on_node(unique_id, "\n".join([text, f"last run: {summary(counts)}", *choices]))
            elif compiled_by_comfy(sampled):
                show_on_node(unique_id, f"{text}\nlast run: attention calls not counted (torch.compile)")
            elif ran:  # the model ran, its attention went elsewhere (e.g. a later node's override)
                line = not_reached(sampled.model_options.get("transformer_options", {}).get(OVERRIDE_KEY), override)
                log.warning("Set Attention Backend (%s): %s", router.describe(), line)
                show_on_node(unique_id, f"{text}\nlast run: {line}")

        wrappers, callbacks = comfy.patcher_extension.WrappersMP, comfy.patcher_extension.CallbacksMP
        patched.remove_wrappers_with_key(wrappers.DIFFUSION_MODEL, KEY)
        patched.add_wrapper_with_key(wrappers.DIFFUSION_MODEL, KEY, begin_forward)
        patched.remove_callbacks_with_key(callbacks.ON_CLEANUP, KEY)
        patched.add_callback_with_key(callbacks.ON_CLEANUP, KEY, report)
        # a later report reads the statistics here: model.get_attachment(KEY).stats
        patched.set_attachments(KEY, router)

        log.info("Set Attention Backend: %s%s", router.describe(), composed)
        return io.NodeOutput(patched, ui={"text": [text]})


NODES = (SetAttentionBackend,)
