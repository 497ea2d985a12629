"""LoadH3Quantized with quantization=mxfp4 in a real ComfyUI: the tiny Wan model
(2 blocks, dim 256) samples on CPU through the emulated MXFP4 path, close to the
bf16 checkpoint's own result, and the report names that path."""
import pytest
import torch

from comfy_harness import combo_options
from graphs import add_preview, wan_t2v_graph

pytestmark = pytest.mark.integration

# Measured with every >=256-output Linear of tiny_wan2 in MXFP4 (25 of 26; the
# 64-output head stays): latent relative difference 0.018, cosine 0.99983
# against UNETLoader's run of the same file. 3x headroom for the loader's
# choices of compute dtype and kept layers.
MAX_REL_DIFF = 0.06
MIN_COSINE = 0.998


def loader(unet_name, **inputs):
    return ("LoadH3Quantized", {"unet_name": unet_name, "quantization": "mxfp4", "offload": "none", **inputs})


def rel_diff(a, b):
    return ((a - b).norm() / b.norm()).item()


def test_mxfp4_latent_close_to_bf16_and_report_names_emulated_path(comfy, tiny_wan2):
    info = comfy.object_info()
    assert "LoadH3Quantized" in info, "LoadH3Quantized is not registered (nodes/loader_nodes.py)"
    assert "mxfp4" in combo_options(info["LoadH3Quantized"]["input"]["required"]["quantization"])

    name, vae = tiny_wan2["unet_name"], tiny_wan2["vae_name"]
    baseline = comfy.latent(comfy.run(wan_t2v_graph(name, vae, seed=3)), "save_latent")
    graph = wan_t2v_graph(name, vae, seed=3, loader=loader(name, ignored_layers=""))
    report_node = add_preview(graph, "unet", 1)
    history = comfy.run(graph)
    latent = comfy.latent(history, "save_latent")
    report = history["outputs"][report_node]["text"][0]

    first = report.splitlines()[0]
    assert first.startswith("quantized ") and not first.startswith("quantized 0/"), report
    assert "mxfp4 x" in report, report
    assert "emulated: dequantize + matmul" in report, report  # --cpu: no native MXFP4 GEMM
    # LoadH3Quantized keeps output heads by default, before MXFP4's own
    # output-dimension rule (unit-tested in tests/test_quant_mxfp4.py) is asked.
    assert "head.head: ignored" in report, report

    assert torch.isfinite(latent).all()
    assert not torch.equal(latent, baseline)  # the weights really were quantized
    assert rel_diff(latent, baseline) < MAX_REL_DIFF
    assert torch.nn.functional.cosine_similarity(latent.flatten(), baseline.flatten(), dim=0) > MIN_COSINE


def test_mxfp4_ignored_layers_stay_in_full_precision(comfy, tiny_wan2):
    name, vae = tiny_wan2["unet_name"], tiny_wan2["vae_name"]
    graph = wan_t2v_graph(name, vae, loader=loader(name, ignored_layers="blocks.*.ffn.*"))
    report_node = add_preview(graph, "unet", 1)
    report = comfy.run(graph)["outputs"][report_node]["text"][0]
    for block in (0, 1):
        for layer in (0, 2):
            assert f"blocks.{block}.ffn.{layer}: ignored (matches 'blocks.*.ffn.*')" in report, report
