"""The pack on a dynamic-VRAM model (upstream's `ModelPatcherDynamic`, `patcher.is_dynamic()` True).

Upstream builds that patcher only for a GPU load device (for a CPU one its
constructor returns a plain ModelPatcher), so a CPU server never samples one.
This test builds the real class the way upstream does under comfy-aimdo (the
aimdo library loaded, a CUDA load device, the model on the CPU), on the tiny
Wan that upstream's own loader read, in the host's python, and checks what
runs without a GPU: the pack sees the model as dynamic, its clone stays
dynamic with truthful size accounting, and a LoRA attached as upstream's
dynamic loading attaches it (LowVramPatch as `weight_lowvram_function`) applies
to a QuantLinear. What needs the GPU (aimdo's faulting, the offload plan
against the card's memory) is checked from upstream's code: ARCHITECTURE.md.
"""
import json
import subprocess

import pytest

from comfy_harness import PACK_ROOT

pytestmark = [pytest.mark.integration, pytest.mark.host_feature("dynamic_vram")]

PROBE = r"""
import json, os, sys, types
pack_root, unet = sys.argv[1], sys.argv[2]
sys.path.insert(0, os.getcwd())
import comfy_aimdo.control
assert comfy_aimdo.control.init(), "comfy-aimdo's library did not load"  # before its modules bind it
from comfy.cli_args import args
args.cpu = True
import torch
import comfy.model_management, comfy.model_patcher, comfy.sd, comfy.utils
pkg = types.ModuleType("bigdit"); pkg.__path__ = [pack_root]; sys.modules["bigdit"] = pkg
from bigdit.host import model as comfy_compat, offload
from bigdit.quant.quantize_pass import QuantizeOptions
from bigdit.quant import QuantConfig, get_method
from bigdit.quant.linear import QuantLinear

out = {}
plain = comfy.sd.load_diffusion_model(unet)  # --cpu: a plain ModelPatcher
Dynamic = comfy.model_patcher.ModelPatcherDynamic
out["cpu_device_class"] = type(Dynamic(plain.model, load_device=torch.device("cpu"),
                                       offload_device=torch.device("cpu"))).__name__
patcher = Dynamic(plain.model, load_device=torch.device("cuda", 0), offload_device=torch.device("cpu"))
out["class"], out["is_dynamic"] = type(patcher).__name__, patcher.is_dynamic()
out["pack_sees_dynamic"] = comfy_compat.is_dynamic(patcher)
out["plain_pack_sees_dynamic"] = comfy_compat.is_dynamic(plain)
size_before = patcher.model_size()

quantized, report, layers = comfy_compat.quantize_on_clone(patcher, QuantizeOptions("int8_convrot", 16), title="test")
out["clone_class"], out["clone_is_dynamic"] = type(quantized).__name__, quantized.is_dynamic()
out["clone_pack_sees_dynamic"] = comfy_compat.is_dynamic(quantized)
out["layers"] = len(layers)
out["input_size_kept"] = patcher.model_size() == size_before
# the bytes the clone really holds: ComfyUI's measure of the model, each replaced layer's bytes
# swapped for its QuantLinear's
size = comfy.model_management.module_size
true_size = size(patcher.model) + sum(
    size(module) - size(comfy.utils.get_attr(patcher.model, comfy_compat.DIFFUSION_PREFIX + name))
    for name, module in layers.items())
out["clone_size"], out["true_size"] = quantized.model_size(), true_size
out["size_before"] = size_before
out["quantized_layers_seen"] = len(comfy_compat.quantized_layers(quantized))

# a LoRA-like weight patch as upstream's dynamic loading attaches it (setup_param in ModelPatcherDynamic.load)
name, layer = next(iter(layers.items()))
key = comfy_compat.DIFFUSION_PREFIX + name + ".weight"
gen = torch.Generator().manual_seed(0)
diff = 0.05 * torch.randn(layer.out_features, layer.in_features, generator=gen)
lora = quantized.clone()
lora.add_patches({key: (diff,)}, 0.5)
layer.weight_lowvram_function = comfy.model_patcher.LowVramPatch(key, lora.patches)
x = torch.randn(3, layer.in_features, generator=gen)
with torch.no_grad():
    got = layer(x)
    base = layer.method.dequantize(layer, x.device).float()
    ref = torch.nn.functional.linear(x, base + 0.5 * diff, layer.bias.float())
    plain_out = torch.nn.functional.linear(x, base, layer.bias.float())
layer.weight_lowvram_function = None
out["lora_err"] = ((got - ref).norm() / ref.norm()).item()
out["lora_effect"] = ((ref - plain_out).norm() / plain_out.norm()).item()

# the forced load ModelPatcherDynamic.load gives layers of at most 16 KiB (force_load_param): the stored
# weight copied to the device through the layer's convert_weight / set_weight, no patch involved.
# The device here is the CPU; restoring the backup must bring back the original layer exactly.
with torch.no_grad():
    before = layer(x)
quantized.patch_model(load_weights=False)  # installs the object patches, as load does first
live = comfy.utils.get_attr(quantized.model, comfy_compat.DIFFUSION_PREFIX + name)
out["live_is_layer"] = live is layer
quantized.patch_weight_to_device(key, device_to=torch.device("cpu"), force_cast=True)
with torch.no_grad():
    forced = layer(x)
out["forced_weight_dtype"] = str(layer.weight.dtype).replace("torch.", "")
out["forced_err"] = ((forced - before).norm() / before.norm()).item()
quantized.restore_loaded_backups()  # what the next load and a partial unload do first
with torch.no_grad():
    out["restored_exactly"] = torch.equal(layer(x), before)
print(json.dumps(out))
"""


def test_dynamic_patcher_is_seen_and_accounted(comfy, tiny_wan):
    result = subprocess.run([str(comfy.host.python), "-c", PROBE, str(PACK_ROOT), str(tiny_wan["path"])],
                            cwd=comfy.host.comfyui, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    out = json.loads(result.stdout.strip().splitlines()[-1])
    assert out["cpu_device_class"] == "ModelPatcher"  # why a CPU server never runs dynamic VRAM
    assert (out["class"], out["is_dynamic"], out["pack_sees_dynamic"]) == ("ModelPatcherDynamic", True, True)
    assert out["plain_pack_sees_dynamic"] is False
    # the quantized clone stays dynamic, so offload steps aside for it too
    assert (out["clone_class"], out["clone_is_dynamic"], out["clone_pack_sees_dynamic"]) == (
        "ModelPatcherDynamic", True, True)
    assert out["layers"] > 0 and out["quantized_layers_seen"] == out["layers"]
    assert out["input_size_kept"]
    assert out["clone_size"] == out["true_size"] < out["size_before"], out
    assert out["lora_effect"] > 1e-2  # the patch changes the output visibly
    assert out["lora_err"] < 1e-5, out  # and applies exactly on the dequantized weight (fp32 on CPU)
    # the forced load requantizes the dequantized weight: the same layer up to rounding (measured 7e-8);
    # before the fix, convert_weight cast the dequantized weight back to int8 (error 1.0)
    assert out["live_is_layer"] and out["forced_weight_dtype"] == "int8"
    assert out["forced_err"] < 1e-4, out
    assert out["restored_exactly"]


BACKUPS_PROBE = r"""
import json, os, sys, types
pack_root, unet = sys.argv[1], sys.argv[2]
sys.path.insert(0, os.getcwd())
import comfy_aimdo.control
assert comfy_aimdo.control.init(), "comfy-aimdo's library did not load"
from comfy.cli_args import args
args.cpu = True
import torch
import comfy.model_patcher, comfy.sd, comfy.utils
pkg = types.ModuleType("bigdit"); pkg.__path__ = [pack_root]; sys.modules["bigdit"] = pkg
from bigdit.host import model as comfy_compat
from bigdit.host.dynamic_vram import prepare_dynamic_vram
from bigdit.host.layers import ComfyQuantLinear
from bigdit.quant.quantize_pass import QuantizeOptions
from bigdit.quant import QuantConfig, get_method
from bigdit.quant.quantize_pass import apply_replacements, quantize_layers
from bigdit.quant.linear import QuantLinear

cpu, cuda = torch.device("cpu"), torch.device("cuda", 0)
Dynamic = comfy.model_patcher.ModelPatcherDynamic
config = lambda: QuantConfig(method=get_method("int8_convrot", group_size=16), compute_device=cpu)
out, cast_seen = {}, set()


def snapshot(module):
    return {k: v.detach().clone() for k, v in module._parameters.items() if v is not None}


def same(module, saved):
    now = snapshot(module)
    return now.keys() == saved.keys() and all(now[k].dtype == saved[k].dtype and torch.equal(now[k], saved[k])
                                              for k in saved)


def retarget(p):
    # a patcher made for the CUDA device, moved to the CPU as upstream's device selector nodes move one
    # (a clone made of it afterwards would be a plain ModelPatcher: upstream builds no dynamic one for a CPU)
    p.load_device = cpu
    p.register_load_device(cpu)
    return p


def unload(p):
    # detach for good; upstream's partial unload (of the VRAM it never used here) asserts a GPU load device
    p.load_device = cuda
    p.detach(unpatch_all=True)


def dynamic_load(p):
    # upstream's own ModelPatcherDynamic.partially_load (unpatch, object patches, load, ON_LOAD callbacks)
    for name, module in p.model.named_modules():
        if isinstance(module, QuantLinear):
            cast_seen.add(hasattr(module, "comfy_cast_weights"))
    p.partially_load(cpu)


def with_lora(p, path, layer, gen):
    diff = 0.05 * torch.randn(layer.out_features, layer.in_features, generator=gen)
    lora = p.clone()
    lora.add_patches({path + ".weight": (diff,)}, 0.5)
    return lora, diff


plain = comfy.sd.load_diffusion_model(unet)
patcher = Dynamic(plain.model, load_device=cuda, offload_device=cpu)
quantized, _, layers = comfy_compat.quantize_on_clone(patcher, QuantizeOptions("int8_convrot", 16), title="test")
prepare_dynamic_vram(quantized)
name, layer = next(iter(layers.items()))
path = comfy_compat.DIFFUSION_PREFIX + name
original = comfy.utils.get_attr(patcher.model, path)
original_saved, layer_saved = snapshot(original), snapshot(layer)
gen = torch.Generator().manual_seed(0)
x = torch.randn(3, layer.in_features, generator=gen)
with torch.no_grad():
    before = layer(x)
    base = layer.method.dequantize(layer, cpu).float()

# 1. a LoRA clone of QuantizeModelINT8's clone, loaded twice, then unloaded for good (detach, unpatch_all)
lora, diff = with_lora(quantized, path, layer, gen)
retarget(lora)
retarget(quantized)
dynamic_load(lora)
out["live_is_layer"] = comfy.utils.get_attr(lora.model, path) is layer
with torch.no_grad():
    first = layer(x)
    ref = torch.nn.functional.linear(x, base + 0.5 * diff, layer.bias.float())
out["lora_err"] = ((first - ref).norm() / ref.norm()).item()
out["lora_effect"] = ((ref - before).norm() / before.norm()).item()
dynamic_load(lora)  # the next load restores the backups, then writes the LoRA in again
with torch.no_grad():
    out["second_load_err"] = ((layer(x) - first).norm() / first.norm()).item()
unload(lora)
out["original_kept"] = same(original, original_saved)
out["tree_has_original"] = comfy.utils.get_attr(patcher.model, path) is original
out["layer_restored"] = same(layer, layer_saved) and layer._unpatched is None
with torch.no_grad():
    out["layer_output_restored"] = torch.equal(layer(x), before)

# 2. ComfyUI switches to another clone of the model: detach without unpatching, then the other loads
dynamic_load(quantized)
quantized.detach(unpatch_all=False)
patcher.unpatch_model(unpatch_weights=False)  # what the next clone's partially_load does first
patcher.patch_model(load_weights=False)
patcher.restore_loaded_backups()
out["switch_original_kept"] = same(original, original_saved)
out["switch_layer_restored"] = same(layer, layer_saved)

# 3. a loader's layers, built in place: the LoRA folded in, the backups restored by ComfyUI
own = comfy.sd.load_diffusion_model(unet)
replacements, _ = quantize_layers(own.model.diffusion_model, config(), title="test", layer_type=ComfyQuantLinear)
apply_replacements(own.model.diffusion_model, replacements)
in_place = Dynamic(own.model, load_device=cuda, offload_device=cpu)
prepare_dynamic_vram(in_place)
own_layer = replacements[name]
own_saved = snapshot(own_layer)
with torch.no_grad():
    own_before = own_layer(x)
    own_base = own_layer.method.dequantize(own_layer, cpu).float()
own_lora, own_diff = with_lora(in_place, path, own_layer, gen)
dynamic_load(retarget(own_lora))
with torch.no_grad():
    own_ref = torch.nn.functional.linear(x, own_base + 0.5 * own_diff, own_layer.bias.float())
    out["in_place_lora_err"] = ((own_layer(x) - own_ref).norm() / own_ref.norm()).item()
unload(own_lora)
out["in_place_restored"] = same(own_layer, own_saved) and own_layer._unpatched is None
with torch.no_grad():
    out["in_place_output_restored"] = torch.equal(own_layer(x), own_before)
out["cast_layers"] = sorted(cast_seen)  # the prepared layers only

# 4. the same load and unload on a clone without the callbacks: upstream's order of restoring
bare, _, bare_layers = comfy_compat.quantize_on_clone(patcher, QuantizeOptions("int8_convrot", 16), title="test")
bare_original = comfy.utils.get_attr(patcher.model, path)
bare_saved = snapshot(bare_original)
dynamic_load(retarget(bare))
unload(bare)
out["without_original_kept"] = same(bare_original, bare_saved)
out["without_stray"] = sorted(set(bare_original._parameters) - set(bare_saved))
print(json.dumps(out))
"""


def test_dynamic_vram_pages_quantized_layers_and_restores_them(comfy, tiny_wan):
    """Under dynamic VRAM the pack's layers are cast layers to upstream's real load (their scales loaded and
    backed up, weight and bias left to the cast path), a LoRA is folded into the quantized weight once,
    and ComfyUI's backups of an object-patched layer never land on the Linear it replaced (upstream's
    unpatch_model removes the object patches before it restores the backups)."""
    result = subprocess.run([str(comfy.host.python), "-c", BACKUPS_PROBE, str(PACK_ROOT), str(tiny_wan["path"])],
                            cwd=comfy.host.comfyui, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    out = json.loads(result.stdout.strip().splitlines()[-1])
    assert out["cast_layers"] == [True], out  # cast layers: the host pages weight and bias
    assert out["live_is_layer"]
    assert out["lora_effect"] > 1e-2, out
    # the LoRA folded into the INT8 weight (host/lora_fold.py): the patched weight requantized, activations
    # quantized as without a LoRA (measured 0.012-0.013; tests/integration/test_lora_fold.py checks the fold itself)
    assert out["lora_err"] < 0.02 and out["in_place_lora_err"] < 0.02, out
    assert out["second_load_err"] == 0, out  # the fold reused, not applied twice
    assert out["original_kept"] and out["tree_has_original"], out
    assert out["layer_restored"] and out["layer_output_restored"], out
    assert out["switch_original_kept"] and out["switch_layer_restored"], out
    assert out["in_place_restored"] and out["in_place_output_restored"], out
    # what the callbacks prevent; if upstream restores in the other order one day, this says so
    assert not out["without_original_kept"] and out["without_stray"], (
        "upstream no longer puts QuantLinear backups on the original Linear: host/dynamic_vram.py may go", out)
