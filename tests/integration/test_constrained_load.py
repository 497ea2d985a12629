"""The pack's quantized layers on a card smaller than they are, with each host's own loading (issue 19).

Upstream 0.33.0 (dynamic VRAM): its real `ModelPatcherDynamic.load`, retargeted to the CPU the way its
device-selector nodes retarget a patcher (`load_device`, `register_load_device`), so that it runs here
without comfy-aimdo's virtual VRAM. It loads whole only what it would load whole on a GPU (modules that
are not cast layers, small layers, the quantized layers' scales); weight and bias of every other cast
layer, the pack's QuantLinear included (host/dynamic_vram.py), are left to the cast path (a page on a
GPU; here, with no virtual VRAM, read from RAM). Before issue 19 the pack took `comfy_cast_weights` off its layers, and this load copied every
quantized layer whole (the OOM on a 12 GiB card). ComfyUI 0.3.75: its real partial load
(`ModelPatcher.load` with `lowvram_model_memory`), which leaves the layers past the budget in RAM.

The budget is half the quantized layers' bytes; what the host loaded is its own account
(`model_loaded_weight_memory`). A tiny model (Wan on both hosts, MiniMax-H3 from upstream's class on
0.33.0) quantized in place as a loader does (int8_convrot, group 16, the pack's default keep patterns)
samples 3 euler steps through ComfyUI's own KSampler path (`nodes.common_ksampler`) after the constrained
load and after a full load of the same quantized weights. On upstream the sampler's load_models_gpu runs
the dynamic load itself; 0.3.75's loads a CPU model fully, so there the probe makes the partial load and
the sampler finds the model loaded. What faults pages in on a GPU is not run here (tests/bench:
comfy_e2e.py's capped configurations on 0.33.0).
"""
import json
import subprocess

import pytest

from comfy_harness import PACK_ROOT
from cpu_sampling import CPU_SAMPLING

pytestmark = [pytest.mark.integration]

PROBE = r"""
import importlib.util, json, os, sys, types
pack_root, unet, kind, text_dim = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
sys.path.insert(0, os.getcwd())
if importlib.util.find_spec("comfy_aimdo") is not None:  # upstream's dynamic VRAM
    import comfy_aimdo.control
    assert comfy_aimdo.control.init(), "comfy-aimdo's library did not load"  # before its modules bind it
from comfy.cli_args import args
args.cpu = True
import torch
import comfy.model_management, comfy.model_patcher, comfy.sd
import nodes
pkg = types.ModuleType("bigdit"); pkg.__path__ = [pack_root]; sys.modules["bigdit"] = pkg
from bigdit.host.dynamic_vram import prepare_dynamic_vram
from bigdit.quant import QuantConfig, get_method
from bigdit.host.layers import ComfyQuantLinear
from bigdit.quant.quantize_pass import apply_replacements, quantize_layers
from bigdit.quant.keep import keep_patterns
from bigdit.quant.linear import QuantLinear
exec(sys.argv[5])  # tests/cpu_sampling.py: on_cpu_dynamic, latent, sample

dynamic = hasattr(comfy.model_patcher, "ModelPatcherDynamic")


def quantized():
    patcher = comfy.sd.load_diffusion_model(unet)
    diffusion = patcher.model.diffusion_model
    names = [name for name, _ in diffusion.named_modules()]
    config = QuantConfig(method=get_method("int8_convrot", group_size=16), compute_device=cpu,
                         ignored=keep_patterns(names, None))
    replacements, _ = quantize_layers(diffusion, config, title="test", layer_type=ComfyQuantLinear)
    apply_replacements(diffusion, replacements)
    return patcher, replacements


def constrained(patcher, budget):
    # `patcher` loaded by the host's own loading within `budget` bytes
    if dynamic:
        patcher = on_cpu_dynamic(patcher.model)
        prepare_dynamic_vram(patcher)
        return patcher
    # 0.3.75's load_models_gpu loads a CPU model fully: its partial load as it runs it on a small card,
    # then the sampler finds the model loaded
    comfy.model_management.load_models_gpu = lambda models, *a, **k: None
    patcher.load(cpu, lowvram_model_memory=budget)
    return patcher


out = {"dynamic": dynamic}
reference, _ = quantized()
full = sample(reference)
patcher, layers = quantized()
size = comfy.model_management.module_size
out["quantized_bytes"] = sum(size(layer) for layer in layers.values())
budget = out["quantized_bytes"] // 2
patcher = constrained(patcher, budget)
got = sample(patcher)
out["class"] = type(patcher).__name__
out["loaded"], out["budget"] = int(patcher.model.model_loaded_weight_memory), int(budget)
if dynamic:  # loaded whole: a backup holds the tensor the load replaced
    whole = {name for name in layers if f"diffusion_model.{name}.weight" in patcher.backup}
else:
    whole = {name for name, layer in layers.items() if not layer.comfy_cast_weights}
out["layers"], out["loaded_whole"] = len(layers), len(whole)
out["still_quantized"] = all(isinstance(patcher.get_model_object(f"diffusion_model.{name}"), QuantLinear)
                             for name in layers)
out["err"] = max(((g - f).norm() / f.norm()).item() for g, f in zip(got, full))
out["exact"] = all(torch.equal(g, f) for g, f in zip(got, full))
out["finite"] = all(bool(torch.isfinite(g).all()) for g in got)
print(json.dumps(out))
"""


def check(comfy, model_path, kind, text_dim):
    result = subprocess.run([str(comfy.host.python), "-c", PROBE, str(PACK_ROOT), str(model_path), kind,
                             str(text_dim), CPU_SAMPLING], cwd=comfy.host.comfyui, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    out = json.loads(result.stdout.strip().splitlines()[-1])
    assert out["class"] == ("ModelPatcherDynamic" if out["dynamic"] else "ModelPatcher")
    assert out["layers"] > 0 and out["still_quantized"], out
    assert out["budget"] < out["quantized_bytes"]
    assert out["loaded"] <= out["budget"], out  # never loaded past the card
    assert out["loaded_whole"] < out["layers"], out  # the others stayed where the host pages them
    assert out["finite"]
    # the same quantized weights, the same math: equal latents (measured bit-identical on both hosts; a small
    # layer that upstream's dynamic load loads whole is requantized from its dequantized weight, about 1e-7)
    assert out["err"] < 1e-5, out


def test_wan_within_a_budget_smaller_than_its_quantized_layers(comfy, tiny_wan2):
    check(comfy, tiny_wan2["path"], "wan", 4096)


@pytest.mark.host_feature("minimax_h3")
def test_h3_within_a_budget_smaller_than_its_quantized_layers(comfy, tiny_h3):
    check(comfy, tiny_h3["path"], "h3", tiny_h3["text_dim"])
