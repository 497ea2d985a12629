"""`int8` auto on an INT8 ConvRot marker file (the layout of Comfy-Org's `*_int8_convrot` files), in a real ComfyUI.

The file's layers load as stored (what `keep` gives, bit for bit), nothing is measured or written (no tuning store
appears beside the cache folder), the loader's report says which path the layers took and why, and after the
sampling its `last run:` line says which INT8 kernel ran. LoadH3Quantized given the same file does the same. On
these CPU servers there is no faster native format to weigh (the GPU's side: tests/test_checkpoint_loaders.py
`test_int8_auto_follows_what_tuning_kept`, tests/test_checkpoint_gpu.py `test_int8_auto_on_this_gpu`).
"""
import re

import pytest
import torch

from checkpoint_files import write_markers
from graphs import add_preview, wan_t2v_graph
from report_events import ReportEvents

pytestmark = pytest.mark.integration

BLOCK_LINEARS = [f"blocks.{b}.{name}" for b in range(2) for name in (
    "self_attn.q", "self_attn.k", "self_attn.v", "self_attn.o",
    "cross_attn.q", "cross_attn.k", "cross_attn.v", "cross_attn.o", "ffn.0", "ffn.2")]
KEPT = "int8_tensorwise layers on cpu: kept as INT8: no faster native format on this device x20"


@pytest.fixture(scope="module")
def int8_file(comfy, tiny_wan2):
    markers = {name: {"format": "int8_tensorwise", "convrot": True, "convrot_groupsize": 256} for name in BLOCK_LINEARS}
    return write_markers(tiny_wan2["path"], comfy.models_dir / "diffusion_models" / "wan2_int8_convrot.safetensors",
                         markers).name


def run(comfy, tiny_wan2, loader):
    """(latent, the loader's report, its `last run:` line as the browser gets it)."""
    graph = wan_t2v_graph(None, tiny_wan2["vae_name"], loader=loader)
    report_node = add_preview(graph, "unet", 1)
    with ReportEvents(comfy.url) as events:
        history = comfy.run(graph)
        last_run = events.wait_for("unet", "last run:").rsplit("\n", 1)[-1]
    return comfy.latent(history, "save_latent"), history["outputs"][report_node]["text"][0], last_run


def test_int8_auto_keeps_the_files_layers_measures_nothing_and_says_so(comfy, tiny_wan2, int8_file):
    auto, report, last_run = run(comfy, tiny_wan2, ("MixedCheckpointLoader", {"unet_name": int8_file, "int8": "auto"}))
    keep, keep_report, _ = run(comfy, tiny_wan2, ("MixedCheckpointLoader", {"unet_name": int8_file, "int8": "keep"}))
    assert "formats: int8_convrot x20" in report and KEPT in report.splitlines(), report
    assert "re-quantized" not in report and "scratch file" not in report
    assert "  blocks.0.ffn.0: " not in report  # a layer kept as stored is a quantized layer, not a kept one
    assert torch.equal(auto, keep)  # the file's own INT8 weights, as `keep` loads them
    assert re.fullmatch(r"last run: ran 20/20 quantized layers; ran int8: kitchen x\d+ calls", last_run), last_run
    assert not (comfy.models_dir / "bigdit_tuning.json").exists()  # nothing tuned, nothing written


def test_load_h3_quantized_on_the_int8_file_does_the_same(comfy, tiny_wan2, int8_file):
    marker, _, _ = run(comfy, tiny_wan2, ("MixedCheckpointLoader", {"unet_name": int8_file, "int8": "keep"}))
    h3, report, last_run = run(comfy, tiny_wan2, ("LoadH3Quantized", {
        "unet_name": int8_file, "quantization": "none", "offload": "none", "int8": "auto"}))
    assert KEPT in report.splitlines() and "re-quantized" not in report, report
    assert torch.equal(h3, marker)
    assert last_run.startswith("last run: ") and "ran 20/20 quantized layers; ran int8: kitchen x" in last_run, last_run


def test_load_h3_quantized_leaves_the_files_full_precision_layers_as_stored(comfy, tiny_wan2, int8_file):
    """Asked to quantize a file that already quantizes its blocks, the loader quantizes none of the layers the
    file left in bf16 (as the host runs them): the same model as MixedCheckpointLoader's, bit for bit."""
    marker, _, _ = run(comfy, tiny_wan2, ("MixedCheckpointLoader", {"unet_name": int8_file, "int8": "keep"}))
    h3, report, _ = run(comfy, tiny_wan2, ("LoadH3Quantized", {
        "unet_name": int8_file, "quantization": "int8_convrot", "offload": "none", "int8": "keep"}))
    lines = report.splitlines()
    assert lines[0] == "quantized 20/26 linear layers" and "formats: int8_convrot x20" in lines, report
    left = "kept as stored: the file quantizes 20 other layers and leaves this one as it is"
    assert {f"  {name}: {left}" for name in ("text_embedding.0", "text_embedding.2", "time_embedding.0",
                                             "time_embedding.2")} <= set(lines), report
    assert "  head.head: ignored (matches 'head.*')" in lines, report  # a pattern's reason stays its own
    assert "quantized while loading" not in report and "scratch file" not in report, report
    assert torch.equal(h3, marker)

