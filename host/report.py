"""What a pack node shows: its report on the node and in the log, and after each sampling its `last run:` line."""
from __future__ import annotations

from torch import nn

import comfy.patcher_extension
from comfy_api.latest import io

from ..pack_logging import pack_logger
from ..quant.witness import RunWitness

log = pack_logger(__name__)

WITNESS_KEY = "bigdit_witness"  # ON_PRE_RUN / ON_CLEANUP callbacks of the run-time witness
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


def node_output(title: str, short: str, full: str, result: tuple = ()) -> io.NodeOutput:
    """What a pack node returns: `short` (1-3 lines) shown on the node, `full` in the log and in the
    prompt's history (`ui.report`, where the web extension offers it collapsed under the short one)."""
    log.info("%s report:\n%s", title, full)
    return io.NodeOutput(*result, ui={"text": [short], "report": [full]})



class NodeRun:
    """The report one node shows, and after each sampling its `last run:` line.

    Several parts make the line (the offload plan of the run, how many quantized
    layers ran); each arrives from a callback of the same sampling, and the
    node's text is re-sent with every part. A sampling's ON_PRE_RUN starts a new line.
    """
    ORDER = ("offload", "lora", "layers")

    def __init__(self, node_id, text: str = ""):
        self.node_id = node_id
        self.text = text
        self.parts: dict[str, str] = {}

    def begin(self) -> None:
        self.parts.clear()

    def add(self, kind: str, part: str) -> None:
        self.parts[kind] = part
        line = "; ".join(self.parts[k] for k in self.ORDER if k in self.parts)
        show_on_node(self.node_id, f"{self.text}\nlast run: {line}")


def compiled_by_comfy(patcher) -> bool:
    """Whether ComfyUI's torch.compile wrapper is on this model (compiled layers are not counted)."""
    try:
        from comfy_api.torch_helpers.torch_compile import TORCH_COMPILE_KWARGS
    except ImportError:
        return False
    return TORCH_COMPILE_KWARGS in patcher.model_options


def watch_quantized_layers(patcher, run: NodeRun, layers: dict[str, nn.Module], title: str) -> None:
    """After each sampling of `patcher` (or a clone of it), add to `run` how many of `layers` executed and which
    kernels their calls ran (and any that failed), and log a warning when fewer ran than the report claims."""
    if not layers:
        return
    witness = RunWitness(layers)

    def begin(_patcher):
        run.begin()
        witness.begin()

    def end(sampled):
        count = witness.take()
        if count.ran == 0 and compiled_by_comfy(sampled):
            part = f"{count.claimed} quantized layers not counted (torch.compile)"
        else:
            part = count.render()
            if count.ran < count.claimed:
                log.warning("%s: the report says %d layers are quantized, but only %d of them ran in this sampling "
                            "(not run: %s%s). Something between this node and the sampler replaced or skipped "
                            "them%s.", title, count.claimed, count.ran, ", ".join(count.missing[:5]),
                            ", ..." if len(count.missing) > 5 else "",
                            "" if count.ran else ", or they ran under torch.compile, which is not counted")
        kernels = count.render_kernels()  # which kernels ran, counted under torch.compile too
        if kernels:
            part = f"{part}; {kernels}"
        log.info("%s, last run: %s", title, part)
        run.add("layers", part)

    callbacks = comfy.patcher_extension.CallbacksMP
    patcher.add_callback_with_key(callbacks.ON_PRE_RUN, WITNESS_KEY, begin)
    patcher.add_callback_with_key(callbacks.ON_CLEANUP, WITNESS_KEY, end)

