"""LoRA (LoraLoaderModelOnly) on quantized models in a real ComfyUI, on every host.

Every node that makes quantized layers, with every format it makes here:
QuantizeModelINT8 (INT8 ConvRot) and LoadH3Quantized (INT8 ConvRot, FP8). The
LoRA on the quantized model is compared with the same LoRA on the float model.
A loader has no model input, so "LoRA before quantization" exists only for
QuantizeModelINT8.

The same models under ComfyUI's partial loading and unloading, LoRA included:
on a CPU load device ComfyUI never offloads, so the test node BigditLoadProbe
calls the ModelPatcher's own load / partially_unload / partially_load as its
model management does on a small GPU, and reports its size accounting and how
often ComfyUI's patch math ran: the LoRA is a branch beside the quantized GEMM
(host/lora_branch.py) wherever the layer sits, never applied per forward.
"""
import json

import pytest
import torch
from safetensors.torch import load_file

from checkpoint_files import write_lora
from graphs import chain_id, node_report, rel_l2, wan_t2v_graph

pytestmark = pytest.mark.integration

# rank-4 LoRA on layers of every kind: attention, the MLP's up projection, and its down
# projection (which upstream reaches through comfy.ops.linear_input_act)
TARGETS = {"blocks.0.ffn.0": (512, 256), "blocks.0.ffn.2": (256, 512), "blocks.1.self_attn.q": (256, 256)}
QUANTIZE = ("QuantizeModelINT8", {"group_size": "16", "ignored_layers": ""})


def load_h3(unet_name, fmt):
    return ("LoadH3Quantized", {"unet_name": unet_name, "quantization": fmt, "offload": "none", "group_size": "16"})


# name: (format, model chain, loader or None for UNETLoader)
PRODUCERS = {
    "QuantizeModelINT8": ("int8_convrot", [QUANTIZE], None),
    "LoadH3Quantized-int8_convrot": ("int8_convrot", [], "int8_convrot"),
    "LoadH3Quantized-float8_e4m3fn": ("float8_e4m3fn", [], "float8_e4m3fn"),
}
# A quantized model against the float one (relative L2): a forward, or the latent of a LoRA written in before
# quantization (QuantizeModelINT8 after the LoRA loader).
TOLERANCE = {"int8_convrot": 0.02, "float8_e4m3fn": 0.06}
# Latent after 2 steps, quantized + LoRA (the LoRA a branch beside the quantized GEMM) against float + LoRA. Measured
# on both hosts: QuantizeModelINT8 0.0023, LoadH3Quantized INT8 0.0027, FP8 0.0099 (folded into the quantized
# weights, the LoRA gave 0.0075, 0.0062 and 0.023: its delta quantized a second time, FP8's LoRA-widened rows).
BRANCH_TOLERANCE = {"int8_convrot": 0.006, "float8_e4m3fn": 0.02}
# The LoRA's effect on the quantized model against its effect on the float model
# (quantized+LoRA - quantized vs float+LoRA - float); measured 0.006-0.027 (folded: 0.016-0.059).
EFFECT_TOLERANCE = 0.05



@pytest.fixture(scope="module")
def lora_name(comfy):
    return write_lora(comfy.models_dir / "loras" / "tiny_wan2_lora.safetensors", TARGETS, seed=3)


def lora(name):
    return ("LoraLoaderModelOnly", {"lora_name": name, "strength_model": 1.0})


def producer_graph_parts(tiny, producer):
    fmt, chain, loader_format = PRODUCERS[producer]
    loader = None if loader_format is None else load_h3(tiny["unet_name"], loader_format)
    return fmt, list(chain), loader


def latent(comfy, tiny, chain, loader=None):
    history = comfy.run(wan_t2v_graph(tiny["unet_name"], tiny["vae_name"], model_chain=chain, loader=loader))
    return history, comfy.latent(history, "save_latent")


@pytest.fixture(scope="module")
def float_latents(comfy, tiny_wan2, lora_name):
    return {"plain": latent(comfy, tiny_wan2, [])[1], "lora": latent(comfy, tiny_wan2, [lora(lora_name)])[1]}


@pytest.mark.parametrize("producer", PRODUCERS)
def test_lora_after_quantization_matches_lora_on_float_model(comfy, tiny_wan2, lora_name, float_latents, producer):
    fmt, chain, loader = producer_graph_parts(tiny_wan2, producer)
    _, quantized = latent(comfy, tiny_wan2, chain, loader)
    _, quantized_lora = latent(comfy, tiny_wan2, chain + [lora(lora_name)], loader)
    plain, with_lora = float_latents["plain"], float_latents["lora"]
    assert rel_l2(with_lora, plain) > 0.1  # the LoRA matters
    # Applied, not dropped (a dropped LoRA gives the quantized latent bit for bit), and
    # moving the quantized model as it moves the float model.
    assert not torch.equal(quantized_lora, quantized)
    assert rel_l2(quantized_lora - quantized, with_lora - plain) < EFFECT_TOLERANCE
    assert rel_l2(quantized_lora, with_lora) < BRANCH_TOLERANCE[fmt], rel_l2(quantized_lora, with_lora)


def test_lora_before_quantization_keeps_patched_layers(comfy, tiny_wan2, lora_name, float_latents):
    history, lora_then_quantized = latent(comfy, tiny_wan2, [lora(lora_name), QUANTIZE])
    report = node_report(history, chain_id(1))
    for module in TARGETS:
        assert f"{module}: has weight patches" in report
    assert not torch.equal(lora_then_quantized, float_latents["lora"])  # the other layers are quantized
    assert rel_l2(lora_then_quantized, float_latents["lora"]) < TOLERANCE["int8_convrot"]


# ---- partial loading and unloading ------------------------------------------

LOADED_FRACTION = 0.7  # of the model's size; what ComfyUI then loads depends on its stream buffers


def probe(comfy, tiny, name, chain, loader=None):
    """BigditLoadProbe on the chain's model: (its JSON report, its outputs per load state)."""
    graph = wan_t2v_graph(tiny["unet_name"], tiny["vae_name"], model_chain=chain, loader=loader)
    model = chain_id(len(chain) - 1) if chain else "unet"
    for node in ("sampler", "decode", "save_image", "save_latent", "vae"):
        del graph[node]
    graph["probe"] = {"class_type": "BigditLoadProbe", "inputs": {
        "model": [model, 0], "positive": ["cond", 0], "latent": ["latent", 0],
        "loaded_fraction": LOADED_FRACTION, "name": name}}
    history = comfy.run(graph)
    report = json.loads(history["outputs"]["probe"]["text"][0])
    return report, load_file(str(comfy.output_dir / "bigdit_probe" / f"{name}.safetensors"))


@pytest.fixture(scope="module")
def float_probe(comfy, tiny_wan2, lora_name):
    return probe(comfy, tiny_wan2, "float_lora", [lora(lora_name)])


@pytest.mark.parametrize("producer", PRODUCERS)
def test_partial_loading_and_unloading_with_lora(comfy, tiny_wan2, lora_name, float_probe, producer):
    fmt, chain, loader = producer_graph_parts(tiny_wan2, producer)
    report, out = probe(comfy, tiny_wan2, producer, chain + [lora(lora_name)], loader)
    float_report, float_out = float_probe

    # ComfyUI counts the bytes the quantized model holds (not its float size), in every state.
    size = report["model_size"]
    assert size == report["true_bytes"] and size < 0.5 * float_report["model_size"]
    full, partial, unloaded, reloaded = (report[k] for k in ("full", "partial", "unloaded", "reloaded"))
    assert full["loaded"] == size and full["lowvram_modules"] == 0
    assert 0 < partial["loaded"] <= LOADED_FRACTION * size and partial["lowvram_modules"] > 0
    assert partial["loaded"] + partial["lowvram_bytes"] <= size
    assert report["freed"] == partial["loaded"] and unloaded["loaded"] == 0
    assert unloaded["lowvram_modules"] > partial["lowvram_modules"]
    assert reloaded["loaded"] == size and reloaded["lowvram_modules"] == 0
    offloaded, offloaded_reloaded = report["offloaded"], report["offloaded_reloaded"]
    assert offloaded["lowvram_lora"] == len(TARGETS) and offloaded_reloaded["lowvram_modules"] == 0

    # The LoRA is a branch beside the GEMM on every LoRA'd layer, wherever it sits (host/lora_branch.py): ComfyUI
    # computes its fold for the layers it loads (set_weight: it has no hook before), which the pack takes out again;
    # a layer it leaves in RAM gets no patch computation at all; no forward patches anything.
    n = len(TARGETS)
    expected_load_calls = {"full": n, "offloaded": 0, "offloaded_reloaded": n, "partial": n, "unloaded": 0,
                           "reloaded": n}
    for name, calls in expected_load_calls.items():
        state = report[name]
        assert state["patch_calls_load"] == calls and state["patch_calls_per_forward"] == 0, (name, state)
        assert state["repeatable"]
        # the same computation wherever the layer sits: bit for bit
        assert torch.equal(out[name], out["full"]), (name, rel_l2(out[name], out["full"]))
    assert partial["lowvram_lora"] == 0  # all LoRA layers were resident, and are offloaded now
    # ComfyUI's partial unload gives the layers it offloads a per-call LowVramPatch: the branch computes it already
    assert unloaded["lowvram_patched"] == n
    assert all(report[name]["lowvram_patched"] == 0 for name in expected_load_calls if name != "unloaded")
    assert rel_l2(out["full"], float_out["full"]) < TOLERANCE[fmt]
    # Unpatched, every quantized tensor is bit for bit what it was before the LoRA was loaded.
    assert report["quantized_tensors"] > 0 and report["restored_exact"]
