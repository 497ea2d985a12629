"""Clones of one loaded model: each node reads the model as its input defines it, never another clone's patches.

ComfyUI applies the sampled clone's object patches (a quantized layer) and
weight patches (a LoRA) to the module tree that all clones of a loaded model
share, and leaves them there until another clone is loaded. A node that read
that live tree would see the previous clone's layers: QuantizeModelINT8 took
them as "already quantized", installed nothing, and the next sampling ran the
bf16 modules while the report claimed every layer quantized.

The sequences run on a server with ComfyUI's default cache, so the loader's
model stays loaded across prompts (asserted); each result is compared with the
same graph on the session server, whose --cache-none loads the model afresh for
every prompt: on CPU the two must be bit-identical.
"""
import re

import pytest
import torch

from checkpoint_files import write_lora
from comfy_harness import ComfyServer
from graphs import add_preview, chain_id, wan_t2v_graph

pytestmark = pytest.mark.integration

LORA_TARGETS = {"blocks.0.ffn.0": (512, 256), "blocks.1.self_attn.q": (256, 256)}


def quantize(group_size):
    return ("QuantizeModelINT8", {"group_size": group_size, "ignored_layers": ""})


def lora(name):
    return ("LoraLoaderModelOnly", {"lora_name": name, "strength_model": 1.0})


def offload():
    return ("SetOffload", {"mode": "auto", "reserve_gib": -1.0, "vram_gib": 0.0})


@pytest.fixture(scope="module")
def lora_name(comfy):
    return write_lora(comfy.models_dir / "loras" / "tiny_wan2_clones_lora.safetensors", LORA_TARGETS, seed=5)


@pytest.fixture(scope="module")
def cached(comfy, tiny_wan2, lora_name, tmp_path_factory):
    """A second server with ComfyUI's default cache: the loaded model is kept between prompts."""
    server = ComfyServer(tmp_path_factory.mktemp("comfy_cached"), comfy.comfyui, classic_cache=True)
    for sub, name in (("diffusion_models", tiny_wan2["unet_name"]), ("vae", tiny_wan2["vae_name"]),
                      ("loras", lora_name)):
        (server.models_dir / sub).mkdir(parents=True, exist_ok=True)
        (server.models_dir / sub / name).symlink_to(comfy.models_dir / sub / name)
    yield server
    server.stop()


def graph_for(tiny, chain, tag):
    graph = wan_t2v_graph(tiny["unet_name"], tiny["vae_name"], model_chain=chain)
    graph["save_latent"]["inputs"]["filename_prefix"] = f"bigdit/clones-{tag}"  # a new file for every prompt
    graph["save_image"]["inputs"]["filename_prefix"] = f"bigdit/clones-{tag}"
    reports = [add_preview(graph, chain_id(i), 1) for i, (kind, _) in enumerate(chain)
               if kind in ("QuantizeModelINT8", "SetOffload")]
    return graph, reports


def run(server, tiny, chain, tag):
    """(latent, the chain's reports, the node ids ComfyUI took from its cache)."""
    graph, reports = graph_for(tiny, chain, tag)
    history = server.run(graph)
    cached_nodes = [node for kind, data in history["status"]["messages"] if kind == "execution_cached"
                    for node in data["nodes"]]
    return (server.latent(history, "save_latent"), [history["outputs"][r]["text"][0] for r in reports],
            cached_nodes)


def comparable(report):
    """A report without what depends on the memory free at the time (an offload plan's budget)."""
    if report.startswith("offload:"):
        return re.findall(r"^ComfyUI accounts .*$", report, re.M)  # the bytes of the model the plan read
    return report


def check_sequence(cached, comfy, tiny, sequence):
    """Run `sequence` on the caching server; each step must equal the same graph on a fresh load."""
    baseline, _, _ = run(comfy, tiny, [], "fresh-baseline")
    for step, chain in enumerate(sequence):
        latent, reports, cached_nodes = run(cached, tiny, chain, f"kept-{step}")
        if step:
            assert "unet" in cached_nodes, "the loader ran again: the model was not kept loaded"
        fresh, fresh_reports, _ = run(comfy, tiny, chain, f"fresh-{step}")
        label = f"step {step} {[kind for kind, _ in chain]}"
        assert torch.equal(latent, fresh), f"{label}: differs from a fresh load of the same graph"
        assert [comparable(r) for r in reports] == [comparable(r) for r in fresh_reports], label
        if any(kind != "SetOffload" for kind, _ in chain):  # offload alone leaves the numbers as they are
            assert not torch.equal(latent, baseline), f"{label}: identical to the plain model"


def test_quantized_clone_after_quantized_clone(cached, comfy, tiny_wan2):
    check_sequence(cached, comfy, tiny_wan2, [
        [], [quantize("256")], [quantize("64")], [quantize("256")], [quantize("16")], [quantize("64")], []])


def test_quantized_clone_after_a_lora_clone(cached, comfy, tiny_wan2, lora_name):
    """The LoRA clone's patched weights are live in the shared tree; quantization must read the originals."""
    check_sequence(cached, comfy, tiny_wan2, [
        [], [quantize("16")], [lora(lora_name)], [quantize("16")], [lora(lora_name)],
        [quantize("16"), lora(lora_name)], [quantize("64")], [lora(lora_name), quantize("64")]])


def test_offload_plan_after_a_quantized_clone(cached, comfy, tiny_wan2):
    """SetOffload's plan counts the bytes of its input model, not of the clone sampled before."""
    check_sequence(cached, comfy, tiny_wan2, [[quantize("16")], [offload()], [quantize("64"), offload()]])


def test_two_quantized_branches_of_one_loader_in_one_prompt(comfy, tiny_wan2):
    """The first branch's sampler runs (and leaves its clone loaded) before the second branch quantizes."""
    graph = wan_t2v_graph(tiny_wan2["unet_name"], tiny_wan2["vae_name"], model_chain=[quantize("256")])
    other = {**graph["m0"], "inputs": {**graph["m0"]["inputs"], "group_size": "64"}}
    graph["m0_other"] = other
    graph["sampler_other"] = {**graph["sampler"], "inputs": {**graph["sampler"]["inputs"], "model": ["m0_other", 0]}}
    graph["latent_other"] = {"class_type": "SaveLatent",
                             "inputs": {"samples": ["sampler_other", 0], "filename_prefix": "bigdit/other"}}
    history = comfy.run(graph)
    alone = {group: run(comfy, tiny_wan2, [quantize(group)], f"alone-{group}")[0] for group in ("256", "64")}
    assert torch.equal(comfy.latent(history, "save_latent"), alone["256"])
    assert torch.equal(comfy.latent(history, "latent_other"), alone["64"])
    assert not torch.equal(alone["256"], alone["64"])
