"""The one place that knows ComfyUI's internals. Features are detected, never versions."""
from __future__ import annotations

import comfy.model_management
import comfy.utils

from ..quant import QuantConfig, quantize_layers
from ..quant.report import QuantReport

DIFFUSION_PREFIX = "diffusion_model."


REPORT_EVENT = "bigdit.report"  # web/js/bigdit_report.js shows {"node", "text"} on that node


def show_on_node(node_id, text: str) -> None:
    """Replace the report shown on node `node_id` in the browser that queued the prompt.

    For what is only known after the node ran (e.g. which attention kernels a
    sampling really used). Without a server (scripts, tests) it does nothing.
    """
    try:
        from server import PromptServer
    except ImportError:
        return
    instance = getattr(PromptServer, "instance", None)
    if instance is None or node_id is None:
        return
    instance.send_sync(REPORT_EVENT, {"node": str(node_id), "text": text}, getattr(instance, "client_id", None))


def compute_device():
    return comfy.model_management.get_torch_device()


def _layers_with_weight_patches(model) -> dict[str, str]:
    """Layers with pending weight patches (LoRA...) stay as they are so the patches apply to real weights."""
    keep = {}
    for key in getattr(model, "patches", {}):
        if key.startswith(DIFFUSION_PREFIX) and key.endswith(".weight"):
            keep[key[len(DIFFUSION_PREFIX):-len(".weight")]] = "has weight patches (e.g. a LoRA); kept so they apply"
    return keep


def quantize_on_clone(model, config: QuantConfig, title: str):
    """Quantize `model`'s diffusion model into a clone through object patches.

    The input ModelPatcher and its modules are untouched, so other graph
    branches still see the original weights; the cost is that the original
    weights stay in RAM next to the quantized ones while both are referenced.
    """
    patched = model.clone()
    config.overrides = {
        key[len(DIFFUSION_PREFIX):]: obj
        for key, obj in model.object_patches.items() if key.startswith(DIFFUSION_PREFIX)
    }
    config.keep.update(_layers_with_weight_patches(model))
    bar = comfy.utils.ProgressBar(1)
    replacements, report = quantize_layers(
        model.get_model_object("diffusion_model"), config,
        progress=lambda done, total: bar.update_absolute(done, total), title=title)
    for name, module in replacements.items():
        patched.add_object_patch(DIFFUSION_PREFIX + name, module)
    _set_model_size(patched, model.model_size() - _bytes_replaced(report, replacements))
    return patched, report


def _bytes_replaced(report: QuantReport, replacements: dict) -> int:
    return sum(r.bytes_before - r.bytes_after for r in report.records if r.name in replacements)


def _set_model_size(patcher, size: int) -> None:
    # ModelPatcher caches its size from the unpatched modules; memory
    # planning must see the quantized bytes instead.
    if hasattr(patcher, "size"):
        patcher.size = size
