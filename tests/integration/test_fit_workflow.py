"""LoadH3Quantized's `fit_gib` in a real ComfyUI (issue 21: 4-bit to fit): the largest quantized layers move to
4-bit (W4A8 first) until the Linear weights fit; quant/fit.py.

On the tiny Wan (2 blocks, dim 256, ffn 512; every block Linear quantizable at ConvRot group 256):
- an allowance no 8-bit model meets moves every quantized layer to W4A8, and the sampled latent is the one
  LoadH3Quantized samples with `asym_w4a8_int8` asked for by name, bit for bit: the same layers, the same
  format, the same kitchen quantizer;
- an allowance the 8-bit model meets moves nothing: the latent is the `int8_convrot` one, bit for bit;
- a fit_gib that is not a number of GiB, or one with nothing to quantize, is refused naming the input.
"""
import math

import pytest
import torch

from comfy_harness import PromptError
from graphs import add_preview, wan_t2v_graph

pytestmark = pytest.mark.integration


def run(comfy, tiny_wan2, quantization, fit_gib=None):
    inputs = {"unet_name": tiny_wan2["unet_name"], "quantization": quantization, "offload": "none",
              "group_size": "256", "ignored_layers": ""}
    if fit_gib is not None:
        inputs["fit_gib"] = fit_gib
    graph = wan_t2v_graph(None, tiny_wan2["vae_name"], loader=("LoadH3Quantized", inputs))
    report_id = add_preview(graph, "unet", 1)
    entry = comfy.run(graph)
    return comfy.latent(entry, "save_latent"), entry["outputs"][report_id]["text"][0]


def test_fit_moves_layers_to_w4a8_until_the_weights_fit(comfy, tiny_wan2):
    w4a8, named = run(comfy, tiny_wan2, "asym_w4a8_int8")
    int8, _ = run(comfy, tiny_wan2, "int8_convrot")
    fitted, report = run(comfy, tiny_wan2, "int8_convrot", fit_gib=0.0001)  # 105 KB: no 8-bit model fits
    lines = report.splitlines()
    quantized = next(line for line in lines if line.startswith("formats: "))
    assert quantized == next(line for line in named.splitlines() if line.startswith("formats: ")), (report, named)
    assert "int8_convrot" not in quantized, report
    note = next(line for line in lines if line.startswith("fit into 0.00 GiB"))
    assert "moved " in note and " to asym_w4a8_int8 (largest first)" in note and "over" in note, note
    assert torch.equal(fitted, w4a8)
    assert not torch.equal(fitted, int8)

    roomy, report = run(comfy, tiny_wan2, "int8_convrot", fit_gib=1000.0)
    note = next(line for line in report.splitlines() if line.startswith("fit into 1000.00 GiB"))
    assert "moved" not in note and "over" not in note, note
    assert torch.equal(roomy, int8)


@pytest.mark.parametrize("quantization, fit_gib, message", [
    ("int8_convrot", math.nan, "fit_gib must be a finite number of GiB"),
    ("none", 10.0, "it needs a quantization, and it is 'none'"),
])
def test_fit_gib_that_makes_no_sense_is_refused(comfy, tiny_wan2, quantization, fit_gib, message):
    with pytest.raises(PromptError, match=message):
        run(comfy, tiny_wan2, quantization, fit_gib)
