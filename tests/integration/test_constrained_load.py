"""The pack's quantized layers on a card smaller than they are, with each host's own loading (issue 19).

Upstream 0.33.0 (dynamic VRAM): its real `ModelPatcherDynamic.load`, retargeted to the CPU the way its
device-selector nodes retarget a patcher (`load_device`, `register_load_device`), so that it runs here
without comfy-aimdo's virtual VRAM. It loads whole only what it would load whole on a GPU (modules that
are not cast layers, small layers, the quantized layers' scales); weight and bias of every other cast
layer, the pack's QuantLinear included (nodes/dynamic_vram.py), get a page that the cast path faults in
per call. Before issue 19 the pack took `comfy_cast_weights` off its layers, and this load copied every
quantized layer whole (the OOM on a 12 GiB card). ComfyUI 0.3.75: its real partial load
(`ModelPatcher.load` with `lowvram_model_memory`), which leaves the layers past the budget in RAM.

The budget is half the quantized layers' bytes; what the host loaded is its own account
(`model_loaded_weight_memory`). A tiny model (Wan on both hosts, MiniMax-H3 from upstream's class on
0.33.0) quantized in place as a loader does (int8_convrot, group 16) samples 3 Euler steps on the
model's own sigmas after the constrained load and after a full load of the same quantized weights.
What faults pages in on a GPU is not run here (tests/bench: comfy_e2e.py's capped configurations).
"""
import json
import subprocess

import pytest
import torch

from comfy_harness import PACK_ROOT

pytestmark = [pytest.mark.integration]

PROBE = r"""
import importlib.util, json, os, sys, types
pack_root, unet = sys.argv[1], sys.argv[2]
sys.path.insert(0, os.getcwd())
if importlib.util.find_spec("comfy_aimdo") is not None:  # upstream's dynamic VRAM
    import comfy_aimdo.control
    assert comfy_aimdo.control.init(), "comfy-aimdo's library did not load"  # before its modules bind it
from comfy.cli_args import args
args.cpu = True
import torch
import comfy.model_management, comfy.model_patcher, comfy.samplers, comfy.sd
dynamic = hasattr(comfy.model_patcher, "ModelPatcherDynamic")
pkg = types.ModuleType("bigdit"); pkg.__path__ = [pack_root]; sys.modules["bigdit"] = pkg
from bigdit.nodes.dynamic_vram import prepare_dynamic_vram
from bigdit.quant import QuantConfig, get_method
from bigdit.quant.dispatch import apply_replacements, quantize_layers
from bigdit.quant.linear import QuantLinear

cpu = torch.device("cpu")


def quantized():
    patcher = comfy.sd.load_diffusion_model(unet)
    config = QuantConfig(method=get_method("int8_convrot", group_size=16), compute_device=cpu)
    replacements, _ = quantize_layers(patcher.model.diffusion_model, config, title="test")
    apply_replacements(patcher.model.diffusion_model, replacements)
    return patcher, replacements


def sample(patcher, steps=3):
    gen = torch.Generator().manual_seed(0)
    sigmas = comfy.samplers.calculate_sigmas(patcher.model.model_sampling, "simple", steps).float()
    x = torch.randn(1, 16, 1, 8, 8, generator=gen) * sigmas[0]
    context = torch.randn(1, 8, 4096, generator=gen)
    with torch.no_grad():
        for i in range(steps):
            denoised = patcher.model.apply_model(x, sigmas[i:i + 1], c_crossattn=context)
            x = x + (x - denoised) / sigmas[i] * (sigmas[i + 1] - sigmas[i])
    return x


out = {"dynamic": dynamic}
reference, _ = quantized()
reference.load(cpu, full_load=True)
full = sample(reference)

patcher, layers = quantized()
size = comfy.model_management.module_size
budget = sum(size(layer) for layer in layers.values()) // 2
if dynamic:
    patcher = comfy.model_patcher.ModelPatcherDynamic(patcher.model, load_device=torch.device("cuda", 0),
                                                      offload_device=cpu)
    patcher.load_device = cpu
    patcher.register_load_device(cpu)
    prepare_dynamic_vram(patcher)
    patcher.load(cpu)
    out["class"] = type(patcher).__name__
    # loaded whole: a backup holds the tensor the load replaced
    whole = {name for name in layers if f"diffusion_model.{name}.weight" in patcher.backup}
else:
    patcher.load(cpu, lowvram_model_memory=budget)
    whole = {name for name, layer in layers.items() if not layer.comfy_cast_weights}
out["loaded"], out["budget"] = int(patcher.model.model_loaded_weight_memory), int(budget)
out["quantized_bytes"] = sum(size(layer) for layer in layers.values())
out["layers"], out["loaded_whole"] = len(layers), len(whole)
got = sample(patcher)
out["still_quantized"] = all(isinstance(patcher.get_model_object(f"diffusion_model.{name}"), QuantLinear)
                             for name in layers)
out["err"] = ((got - full).norm() / full.norm()).item()
out["exact"] = torch.equal(got, full)
out["finite"] = bool(torch.isfinite(got).all())
print(json.dumps(out))
"""


def test_quantized_layers_load_within_a_budget_smaller_than_they_are(comfy, tiny_wan2):
    result = subprocess.run([str(comfy.host.python), "-c", PROBE, str(PACK_ROOT), str(tiny_wan2["path"])],
                            cwd=comfy.host.comfyui, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    out = json.loads(result.stdout.strip().splitlines()[-1])
    assert out["layers"] > 0 and out["still_quantized"], out
    assert out["budget"] < out["quantized_bytes"]
    assert out["loaded"] <= out["budget"], out  # never loaded past the card
    assert out["loaded_whole"] < out["layers"], out  # some quantized layers stayed where the host pages them
    assert out["finite"]
    # the same quantized weights and the same math: layers loaded whole by upstream's dynamic load of a small
    # layer are requantized from their dequantized weight (convert_weight / set_weight), measured 0
    assert out["err"] < 1e-5, out
