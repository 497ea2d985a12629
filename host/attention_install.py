"""SetAttentionBackend's router on a clone of a model (host/attention.py's override), and after each sampling
what ran, on the node."""
from __future__ import annotations

import comfy.patcher_extension
import torch

from ..attention import Router, summary
from ..pack_logging import pack_logger
from .attention import KEY, install, not_reached
from .read_ahead import hook_sampling
from .report import compiled_by_comfy, show_on_node
from .tuning import use_tuning_store

log = pack_logger(__name__)

CALLBACK_KEY = "bigdit_attention"  # of our DIFFUSION_MODEL wrapper, ON_CLEANUP callback and attachment


def install_router(model, router: Router, node_id) -> tuple[object, str]:
    """A clone of `model` whose attention runs through `router`, composed with an override already there (see
    AttentionOverride); after each sampling the node `node_id` shows what ran. Returns (clone, the node's text)."""
    use_tuning_store()  # auto's kept decisions, as on disk now
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
            show_on_node(node_id, "\n".join([text, f"last run: {summary(counts)}", *choices]))
        elif compiled_by_comfy(sampled):
            show_on_node(node_id, f"{text}\nlast run: attention calls not counted (torch.compile)")
        elif ran:  # the model ran, its attention went elsewhere (e.g. a later node's override)
            line = not_reached(sampled.model_options.get("transformer_options", {}).get(KEY), override)
            log.warning("Set Attention Backend (%s): %s", router.describe(), line)
            show_on_node(node_id, f"{text}\nlast run: {line}")

    wrappers, callbacks = comfy.patcher_extension.WrappersMP, comfy.patcher_extension.CallbacksMP
    patched.remove_wrappers_with_key(wrappers.DIFFUSION_MODEL, CALLBACK_KEY)
    patched.add_wrapper_with_key(wrappers.DIFFUSION_MODEL, CALLBACK_KEY, begin_forward)
    patched.remove_callbacks_with_key(callbacks.ON_CLEANUP, CALLBACK_KEY)
    patched.add_callback_with_key(callbacks.ON_CLEANUP, CALLBACK_KEY, report)
    # a later report reads the statistics here: model.get_attachment(CALLBACK_KEY).stats
    patched.set_attachments(CALLBACK_KEY, router)
    hook_sampling(patched)
    log.info("Set Attention Backend: %s%s", router.describe(), composed)
    return patched, text
