"""SetOffload in a real ComfyUI (CPU): "auto" streams what does not fit and reproduces the resident run
exactly; "none" under the same budget refuses to run.

On a CPU load device ComfyUI offloads nothing, so "auto" streams the plan's
blocks host-to-host through the same hooks as on a GPU. `vram_gib` shrinks
the plan's memory so that 3 of the 4 blocks must stream (streaming one or two
saves nothing: their two staging slots hold as much).
"""
import json
import re
import subprocess

import pytest
import torch

from checkpoint_files import write_lora
from comfy_harness import PACK_ROOT, PromptError
from graphs import add_preview, chain_id, node_report, wan_t2v_graph
from tiny_models import make_tiny_wan

pytestmark = pytest.mark.integration

UNITS = {"MiB": 2 ** 20, "GiB": 2 ** 30}


@pytest.fixture(scope="module")
def tiny_wan4(comfy, tiny_vae):
    name = "tiny_wan4.safetensors"
    make_tiny_wan(comfy.models_dir / "diffusion_models" / name, num_layers=4, host=comfy.host)
    return {"unet_name": name, "vae_name": tiny_vae}


def offload_graph(tiny, mode, quantize, lora=None, **offload_inputs):
    chain = [("QuantizeModelINT8", {"group_size": "64", "ignored_layers": ""})] if quantize else []
    if lora:
        chain.append(("LoraLoaderModelOnly", {"lora_name": lora, "strength_model": 1.0}))
    chain.append(("SetOffload", {"mode": mode, "reserve_gib": 0.0, **offload_inputs}))
    graph = wan_t2v_graph(tiny["unet_name"], tiny["vae_name"], model_chain=chain, seed=3)
    return graph, add_preview(graph, chain_id(len(chain) - 1), 1)


def size(text, label):
    """Bytes of the first '<label><number> MiB|GiB' in a report."""
    number, unit = re.search(re.escape(label) + r"\s*([\d.]+) (MiB|GiB)", text).groups()
    return float(number) * UNITS[unit]


@pytest.fixture(scope="module")
def lora4(comfy):
    """A rank-4 LoRA on quantized layers of the blocks that stream (1-3) and of the one that does not (0)."""
    targets = {"blocks.0.ffn.0": (256, 128), "blocks.1.ffn.2": (128, 256), "blocks.2.self_attn.q": (128, 128),
               "blocks.3.ffn.0": (256, 128)}
    return write_lora(comfy.models_dir / "loras" / "tiny_wan4_lora.safetensors", targets, seed=5)


@pytest.mark.parametrize("quantize,lora", [(False, False), (True, False), (True, True)],
                         ids=["bf16", "int8", "int8-lora"])
def test_auto_streams_what_does_not_fit_exactly_where_none_refuses(comfy, tiny_wan4, lora4, quantize, lora):
    """With a LoRA written into the quantized weights, the streamed copies carry it too."""
    lora = lora4 if lora else None
    graph, report_id = offload_graph(tiny_wan4, "none", quantize, lora)
    resident = comfy.run(graph)
    report = resident["outputs"][report_id]["text"][0]
    assert "resident 4/4 blocks, streaming 0" in report
    # ComfyUI's size accounting and the plan's agree on the (possibly quantized) weights.
    assert size(report, "ComfyUI accounts") == pytest.approx(size(report, "the plan counts"), rel=0.01)

    # Room for the rest, one resident block, two staging slots and half a block (activations are KiB):
    # three blocks stream, the first of each run of 4/3 blocks: 1, 2, 3.
    largest = size(report, "(")  # "(<size> the largest)"
    budget = size(report, "+ rest") + 3.5 * largest
    graph, report_id = offload_graph(tiny_wan4, "auto", quantize, lora, vram_gib=budget / UNITS["GiB"])
    log_start = len(comfy.log_text())
    streamed = comfy.run(graph)
    log = comfy.log_text()[log_start:]
    offload_node = chain_id(int(quantize) + int(lora is not None))
    node_report(streamed, offload_node)
    # on the node, one line until a sampling ends: the plan of the weights (the sampler adds the activations)
    short = streamed["outputs"][offload_node]["text"][0]
    assert re.fullmatch(r"offload: auto on cpu; resident 1/4 blocks, streaming 3; peak before activations "
                        r"[\d.]+ MiB of [\d.]+ MiB", short), short

    assert torch.equal(comfy.latent(resident, "save_latent"), comfy.latent(streamed, "save_latent"))
    assert "lora key not loaded" not in log  # every LoRA key found its layer
    # One INFO line for the sampler's plan (with activations) and one for what the streamer did:
    # three blocks, each copy issued ahead of its block.
    assert "resident 1/4 blocks, streaming 3; estimated peak" in log, log[-3000:]
    done = re.search(r"\[BigDiT\] offload: streamed 3 of 4 blocks \(1-3\); (\d+) streamed block loads in (\d+) forwards, "
                     r"(\d+) prefetched ahead, 0 late; [\d.]+ MiB copied; at most 2 streamed blocks", log)
    assert done, log[-3000:]
    loads, forwards, prefetched = map(int, done.groups())
    assert forwards == 2 and loads == 3 * forwards == prefetched

    # the same budget with "none": nothing streams, the run is refused with the plan
    graph, _ = offload_graph(tiny_wan4, "none", quantize, lora, vram_gib=budget / UNITS["GiB"])
    with pytest.raises(PromptError, match="offload 'none' needs every block resident") as info:
        comfy.run(graph)
    assert "resident 1/4 blocks, streaming 3" in info.value.message


def test_none_that_cannot_fit_fails_with_the_plan(comfy, tiny_wan4):
    graph, _ = offload_graph(tiny_wan4, "none", False, vram_gib=0.0005)
    with pytest.raises(PromptError) as info:
        comfy.run(graph)
    assert info.value.node_type == "SetOffload"
    assert "offload 'none' needs every block resident" in info.value.message
    assert "resident 0/4 blocks, streaming 4" in info.value.message
    assert "does not fit" in info.value.message


@pytest.mark.parametrize("inputs", [{"reserve_gib": float("nan")}, {"reserve_gib": 2000.0},
                                    {"reserve_gib": 0.0, "vram_gib": float("nan")}],
                         ids=["NaN reserve", "reserve over max", "NaN vram"])
def test_bad_memory_inputs_are_validation_errors(comfy, tiny_wan, inputs):
    """NaN passes every min/max comparison; the node's own validation names it before anything runs."""
    graph = wan_t2v_graph(tiny_wan["unet_name"], tiny_wan["vae_name"],
                          model_chain=[("SetOffload", {"mode": "auto", **inputs})])
    with pytest.raises(PromptError) as info:
        comfy.run(graph)
    name = "vram_gib" if "vram_gib" in inputs else "reserve_gib"
    assert f"{name} must be a number from" in info.value.message, info.value.message
    assert info.value.node_errors and not info.value.node_type  # refused at validation, not while running


PIN_PROBE = r"""
import json, os, sys, types
sys.path.insert(0, os.getcwd())
from comfy.cli_args import args
args.cpu = True
import torch
import comfy.model_management
pkg = types.ModuleType("bigdit"); pkg.__path__ = [sys.argv[1]]; sys.modules["bigdit"] = pkg
from bigdit.host import offload
from bigdit.offload.streaming import HostPins
functions = offload.host_pin_functions()
pins = HostPins(**functions)
weight = torch.nn.Parameter(torch.zeros(2 ** 18), requires_grad=False)  # 1 MiB, as the streamer pins
pinned = pins.pin(weight)
pins.release()
print(json.dumps({"host_functions": functions == {"pin": comfy.model_management.pin_memory,
                                                  "unpin": comfy.model_management.unpin_memory},
                  "pinned": pinned}))
"""


def test_streamer_pins_through_the_hosts_own_pin_functions(comfy):
    """Both hosts have ComfyUI's budgeted pin_memory / unpin_memory; the streamer's pins take them and call
    them as ComfyUI does (one tensor). A host without a GPU has no pin budget: nothing is pinned."""
    result = subprocess.run([str(comfy.host.python), "-c", PIN_PROBE, str(PACK_ROOT)], cwd=comfy.host.comfyui,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    assert json.loads(result.stdout.strip().splitlines()[-1]) == {"host_functions": True, "pinned": False}
    assert "not pinned by ComfyUI" not in result.stderr  # nothing unpinned that ComfyUI did not pin
