"""After each sampling, a node's `last run:` line says how many of its quantized layers executed.

Read as the browser gets it: the `bigdit.report` event that replaces the
node's report (tests/report_events.py). When fewer layers ran than the report
claims, the server logs a warning naming them.
"""
import re

import pytest

from checkpoint_files import write_markers
from graphs import chain_id, wan_t2v_graph
from report_events import ReportEvents

pytestmark = pytest.mark.integration

QUANTIZE = ("QuantizeModelINT8", {"group_size": "16", "ignored_layers": ""})
WARNING = re.compile(r"the report says (\d+) layers are quantized, but only (\d+) of them ran "
                     r"in this sampling \(not run: ([^)]*)\)")


@pytest.fixture
def events(comfy):
    with ReportEvents(comfy.url) as listener:
        yield listener


def run(comfy, graph):
    """The log the prompt wrote."""
    start = len(comfy.log_text())
    comfy.run(graph)
    return comfy.log_text()[start:]


def test_quantize_node_reports_every_layer_ran(comfy, tiny_wan2, events):
    log = run(comfy, wan_t2v_graph(tiny_wan2["unet_name"], tiny_wan2["vae_name"], model_chain=[QUANTIZE]))
    text = events.wait_for(chain_id(0), "last run:")
    # the short report (the head, the time projection and the Conv3d patch embedding are kept), then the run's line:
    # the layers that ran and the INT8 kernel their calls ran (comfy-kitchen's on CPU)
    assert re.fullmatch(r"quantized 24/26 linear layers: int8_convrot x24\nweights: .*; 3 kept in original precision\n"
                        r"last run: ran 24/24 quantized layers; ran int8: kitchen x\d+ calls", text), text
    assert not WARNING.search(log), log


def test_skipped_block_is_seen_and_warned_about(comfy, tiny_wan2, events):
    """A block replaced downstream of the quantizer (ComfyUI's block-replace patch): its 10 layers never run."""
    chain = [QUANTIZE, ("BigditSkipBlock", {"block": 1})]
    log = run(comfy, wan_t2v_graph(tiny_wan2["unet_name"], tiny_wan2["vae_name"], model_chain=chain))
    assert re.search(r"\nlast run: ran 14/24 quantized layers; ran int8: kitchen x\d+ calls$",
                     events.wait_for(chain_id(0), "last run:"))
    claimed, ran, missing = WARNING.search(log).groups()
    assert (claimed, ran) == ("24", "14")
    assert all(name.startswith("blocks.1.") for name in missing.removesuffix(", ...").split(", ")), missing


def test_quantized_clone_sampled_next_to_the_plain_model(comfy, tiny_wan2, events):
    """Two samplers in one prompt: only the quantized branch reports, and all its layers ran."""
    graph = wan_t2v_graph(tiny_wan2["unet_name"], tiny_wan2["vae_name"], model_chain=[QUANTIZE])
    graph["plain_sampler"] = {**graph["sampler"], "inputs": {**graph["sampler"]["inputs"], "model": ["unet", 0]}}
    graph["plain_latent"] = {"class_type": "SaveLatent",
                             "inputs": {"samples": ["plain_sampler", 0], "filename_prefix": "bigdit/plain"}}
    log = run(comfy, graph)
    assert re.search(r"\nlast run: ran 24/24 quantized layers; ran int8: kitchen x\d+ calls$",
                     events.wait_for(chain_id(0), "last run:"))
    assert len([t for t in events.texts(chain_id(0)) if "last run:" in t]) == 1  # the plain sampling is not its run
    assert not WARNING.search(log), log


def test_marker_loader_reports_its_layers_ran(comfy, tiny_wan2, events):
    markers = {"blocks.0.self_attn.q": {"format": "int8_tensorwise"}, "blocks.1.ffn.0": {"format": "float8_e4m3fn"}}
    path = write_markers(tiny_wan2["path"], comfy.models_dir / "diffusion_models" / "wan2_witness.safetensors",
                         markers)
    graph = wan_t2v_graph(None, tiny_wan2["vae_name"], loader=("MixedCheckpointLoader", {"unet_name": path.name}))
    log = run(comfy, graph)
    text = events.wait_for("unet", "last run:")
    # the short report's two lines, then the run's
    assert re.fullmatch(r"quantized 2/26 linear layers: .*\nweights: .*\nlast run: ran 2/2 quantized layers"
                        r"; ran int8: kitchen x\d+ calls", text), text
    assert not WARNING.search(log), log


def test_h3_loader_line_has_the_offload_plan_and_the_layers(comfy, tiny_wan2, events):
    loader = ("LoadH3Quantized", {"unet_name": tiny_wan2["unet_name"], "quantization": "int8_convrot",
                                  "offload": "auto", "group_size": "64", "ignored_layers": ""})
    run(comfy, wan_t2v_graph(None, tiny_wan2["vae_name"], loader=loader))
    text = events.wait_for("unet", "streamed; ran ")  # the event that carries both parts
    # the head and time projection are kept; the run's line takes the place of the load's plan
    assert re.fullmatch(r"quantized 24/26 linear layers: int8_convrot x24\nweights: .*; 2 kept in original precision\n"
                        r"last run: resident 2/2 blocks, streaming 0; estimated peak [\d.]+ GiB of [\d.]+ GiB; "
                        r"nothing streamed; ran 24/24 quantized layers; ran int8: kitchen x\d+ calls", text), text
    # A block skipped after the loader: the loader's line says so, and the log warns.
    events.clear()
    log = run(comfy, wan_t2v_graph(None, tiny_wan2["vae_name"], loader=loader,
                                   model_chain=[("BigditSkipBlock", {"block": 0})]))
    assert re.search(r"; ran 14/24 quantized layers; ran int8: kitchen x\d+ calls$",
                     events.wait_for("unet", "streamed; ran "))
    assert WARNING.search(log).groups()[:2] == ("24", "14"), log
