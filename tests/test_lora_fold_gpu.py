"""A LoRA on a GPU under upstream ComfyUI's real dynamic VRAM (comfy-aimdo's pages and pinned copies): as a branch
beside the quantized GEMM (host/lora_branch.py), and a LoHa folded (host/lora_fold.py).

A subprocess in this python, with upstream's ComfyUI folder as its working directory
($BIGDIT_COMFYUI, else the test cache's comfyui-0.33.0), switches dynamic VRAM on as
upstream's main.py does, loads a tiny Wan through LoadH3Quantized's own path
(host.loading.load_checkpoint: INT8 ConvRot layers, file-backed under dynamic VRAM)
and a LoRA (then a LoHa) through LoraLoaderModelOnly's own function, and runs it through
ComfyUI's model management (load_models_gpu, partially_unload, unload_all_models). After
each step, every LoRA'd layer is run through the host's page path (its page, refilled
from its pinned copy where the page is stale) and compared with the same method on the
tensors the layer holds, and its pinned copy is compared with them: a stale page or pin
would give the other weights. Checked, for the LoRA: a branch at every load, nothing
computed or folded, its tensors read from their file to the device (not through the
file's map), the layer's bytes (page and pins included) the original ones; each
layer against the exact LoRA'd layer; another strength reloads nothing (no patch
computation, the adapter's device copies reused, under 2 s); an eviction and a reload
keep the branch; an unload takes it away. For the LoHa: the fold is computed once per
set and strength and kept (a strength going back and forth reuses it), never per call,
its weights maps of a scratch file; a patcher without the LoHa brings back the original
bytes in the layer, its page and its pins; an eviction (pages and the force-loaded
scales given back) leaves the layer consistent; an unload and a reload reuse the fold.

    BIGDIT_COMFYUI=<upstream 0.33.0> PYTHONPATH=<its site-packages with comfy-aimdo> python -m pytest -m gpu \
        tests/test_lora_fold_gpu.py
"""
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from comfy_harness import DYNAMIC_VRAM_PRELUDE, PACK_ROOT, TESTS_DIR, cache_dir
from lora_calls import COUNT_LORA_CALLS

COMFYUI = Path(os.environ.get("BIGDIT_COMFYUI") or cache_dir() / "comfyui-0.33.0")


def _missing() -> str | None:
    if not torch.cuda.is_available():
        return "needs a CUDA GPU"
    source = COMFYUI / "comfy" / "model_patcher.py"
    if not source.exists() or "class ModelPatcherDynamic" not in source.read_text(errors="replace"):
        return f"no ComfyUI with dynamic VRAM at {COMFYUI} (set BIGDIT_COMFYUI)"
    if importlib.util.find_spec("comfy_aimdo") is None:
        return "comfy-aimdo is not importable (put upstream's site-packages on PYTHONPATH)"
    return None


pytestmark = [pytest.mark.gpu, pytest.mark.skipif(_missing() is not None, reason=str(_missing()))]

TARGETS = {"blocks.0.ffn.0": (512, 256), "blocks.0.ffn.2": (256, 512), "blocks.1.self_attn.q": (256, 256)}
# A layer run through its page against the same kernel on the tensors it holds: equal unless the kernel's choice
# differs (then within bf16 rounding); a stale page or pin holds the other weights, which move a LoRA'd layer's
# output by far more (`layer_effect`, the folded against the original layer).
PAGE_SAME = 1e-3
# The branch: a layer against the exact LoRA'd layer (F.linear on calculate_weight's patched weight, fp32) may exceed
# the unpatched layer's own distance to F.linear on its dequantized weight by this much (bf16 rounding of the
# branch, tests/integration/test_lora_branch.py), plus this part of the LoRA's own part of the output: on the INT8
# kernels its hidden comes from the layer's quantized rows, with the INT8 roundings of the input and of the down
# matrix (the bound of tests/test_int8_lora_gpu.py).
BRANCH_ROUNDING = 2 ** -7
INT8_HIDDEN = 2 ** -5

PROBE = DYNAMIC_VRAM_PRELUDE + r"""
import json, tempfile, time
tests_dir = sys.argv[2]
import comfy.lora, comfy.sd, comfy.utils
import folder_paths
sys.path.insert(0, tests_dir)
import safetensors.torch
from tiny_models import _tiny_wan
from checkpoint_files import write_loha, write_lora
from bigdit.host import dynamic_vram
from bigdit.host.loading import load_checkpoint
from bigdit.quant.linear import QuantLinear

work = tempfile.mkdtemp(prefix="bigdit-lora-fold-gpu-")
folder_paths.add_model_folder_path("diffusion_models", work)
folder_paths.set_temp_directory(os.path.join(work, "temp"))
# built with dynamic VRAM off: under it comfy.ops' Linear leaves its weight unmade until a state dict loads it, so
# the module's own state dict would hold no Linear weights
comfy.memory_management.aimdo_enabled = False
safetensors.torch.save_file(_tiny_wan({"dim": 256, "ffn_dim": 512, "num_heads": 2, "num_layers": 2, "seed": 0}),
                            os.path.join(work, "tiny_wan2.safetensors"))
comfy.memory_management.aimdo_enabled = True
targets = {k: tuple(v) for k, v in json.loads(sys.argv[3]).items()}
write_lora(os.path.join(work, "lora.safetensors"), targets, seed=5)
write_loha(os.path.join(work, "loha.safetensors"), targets, seed=6, scale=0.5)
lora_sd = comfy.utils.load_torch_file(os.path.join(work, "lora.safetensors"))
loha_sd = comfy.utils.load_torch_file(os.path.join(work, "loha.safetensors"))

""" + COUNT_LORA_CALLS + r"""

base = load_checkpoint("test", "diffusion_models", "tiny_wan2.safetensors", quantization="int8_convrot",
                       group_size="16", offload_input="none").args[0]
assert base.is_dynamic()
device = base.load_device
layers = {name: base.model.get_submodule("diffusion_model." + name) for name in targets}
gen = torch.Generator().manual_seed(0)
x = torch.randn(1, 16, 1, 8, 8, generator=gen).to(device)
context = torch.randn(1, 8, 4096, generator=gen).to(device)
sigma = torch.tensor([0.7], device=device)
x_layer = {name: torch.randn(4, m.in_features, generator=gen).to(device, m.compute_dtype) for name, m in layers.items()}


def as_bytes(t):
    return t.detach().reshape(-1).contiguous().view(torch.uint8).cpu()


originals = {(n, k): as_bytes(t) for n, m in layers.items() for k, t in m._parameters.items() if t is not None}
original_tensors = {n: {k: t.detach().clone() for k, t in m._parameters.items() if t is not None}
                    for n, m in layers.items()}


def load(p):
    before = calls["patch"]
    mm.load_models_gpu([p])
    return calls["patch"] - before


def model_out(p):
    before = dict(calls)
    with torch.no_grad():
        outs = [p.model.apply_model(x, sigma, c_crossattn=context).float() for _ in range(2)]
    return outs, {k: calls[k] - before[k] for k in calls}


def scratch_mapped(t):
    address = t.data_ptr()
    with open("/proc/self/maps") as f:
        for line in f:
            fields = line.split()
            low, high = (int(v, 16) for v in fields[0].split("-"))
            if low <= address < high:
                return len(fields) >= 6 and os.path.basename(fields[5]).startswith("bigdit-")
    return False


def layer_state(p=None):
    # each LoRA'd layer through the host's page path, against the same method on the tensors it holds (no pager),
    # with its branch; its pinned copies against those tensors; whether it holds the original bytes; with `p`,
    # against the exact LoRA'd layer (calculate_weight on the original weight, fp32)
    out = {}
    for name, m in layers.items():
        held = {k: v.to(device) for k, v in m._parameters.items() if v is not None and k != "bias"}
        stand_in = QuantLinear(m.method, m.in_features, m.out_features, held, m.bias.to(device), m.compute_dtype)
        if m.lora_branch is not None:  # the same branch, by the same path (fused where the layer's is)
            stand_in.output_branches = lambda branch=m.lora_branch: [branch]
        with torch.no_grad():
            paged, direct = m(x_layer[name]), stand_in(x_layer[name])
        pins = []
        for subset, entry in (m.__dict__.get("_pins") or {}).items():
            if entry.get("pin") is not None:
                views = comfy.memory_management.interpret_gathered_like([m.weight, m.bias], entry["pin"])
                pins.append(all(torch.equal(as_bytes(v), as_bytes(t)) for v, t in zip(views, (m.weight, m.bias))))
        out[name] = {"page_vs_held": rel(paged.float(), direct.float()), "pins": pins,
                     "original": all(torch.equal(as_bytes(t), originals[(name, k)])
                                     for k, t in m._parameters.items() if t is not None),
                     "lowvram": m.weight_lowvram_function is not None, "per_call": len(m.weight_function),
                     "branch": m.lora_branch is not None, "file_backed": scratch_mapped(m.weight)}
        key = "diffusion_model." + name + ".weight"
        if p is not None and key in p.patches:
            tensors = {k: v.to(device) for k, v in original_tensors[name].items() if k != "bias"}
            original = QuantLinear(m.method, m.in_features, m.out_features, tensors,
                                   original_tensors[name]["bias"].to(device), m.compute_dtype)
            xf = x_layer[name].float()
            with torch.no_grad():
                dequantized = original.method.dequantize(original).float()
                exact = real_calculate(p.patches[key], dequantized.clone(), key)
                bias = original.bias.float()
                ref = torch.nn.functional.linear(xf, exact, bias)
                own = rel(original(x_layer[name]).float(), torch.nn.functional.linear(xf, dequantized, bias), ref)
                out[name]["exact_err"] = rel(paged.float(), ref)
                out[name]["base_own"] = own
                out[name]["part"] = rel(ref, torch.nn.functional.linear(xf, dequantized, bias), ref)
    return out


def rel(a, b, norm=None):
    return ((a - b).norm() / (b if norm is None else norm).norm()).item()


def device_copies():
    return {n: [t.data_ptr() for part in m.lora_branch.parts for t in (part.down, part.up)]
            for n, m in layers.items() if m.lora_branch is not None}


res = {}
load(base)
(plain, plain2), _ = model_out(base)
res["base"] = {"repeat": rel(plain2, plain), "layers": layer_state()}

# the LoRA: a branch, its tensors read from their file to the device (each read's outcome counted)
import bigdit.host.lora_branch as lora_branch
file_reads, real_read = [], lora_branch.read_tensor_file_slice_into
lora_branch.read_tensor_file_slice_into = lambda t, into: file_reads.append(bool(real_read(t, into))) or file_reads[-1]
l1 = comfy.sd.load_lora_for_models(base, None, lora_sd, 1.0, 0)[0]
half = comfy.sd.load_lora_for_models(base, None, lora_sd, 0.5, 0)[0]
res["branch_calls"] = load(l1)
res["branch_file_reads"] = list(file_reads)
(branched, branched2), res["branch_run"] = model_out(l1)
res["branch"] = {"repeat": rel(branched2, branched), "effect": rel(branched, plain), "layers": layer_state(l1)}
copies = device_copies()
start = time.perf_counter()
res["branch_half_calls"] = load(half)
res["branch_half_seconds"] = time.perf_counter() - start
res["branch_half_reused"] = device_copies() == copies
(half_out, _), res["branch_half_run"] = model_out(half)
res["branch_half"] = {"vs_branch": rel(half_out, branched), "layers": layer_state(half)}
res["branch_back_calls"] = load(l1)
res["branch_back_vs_branch"] = rel(model_out(l1)[0][0], branched)
l1.partially_unload(l1.offload_device, 1e30)  # pages evicted and the force-loaded scales given back, no load after
(evicted, _), res["branch_evicted_run"] = model_out(l1)
res["branch_evicted"] = {"vs_branch": rel(evicted, branched), "layers": layer_state()}
res["branch_restore_calls"] = load(base)
res["branch_restore"] = {"vs_plain": rel(model_out(base)[0][0], plain), "layers": layer_state()}
load(l1)
mm.unload_all_models()
res["branch_unloaded"] = sum(m.lora_branch is not None for m in layers.values())
res["branch_after_unload_calls"] = load(l1)
res["branch_after_unload_vs_branch"] = rel(model_out(l1)[0][0], branched)
load(base)

# the LoHa: folded
f1 = comfy.sd.load_lora_for_models(base, None, loha_sd, 1.0, 0)[0]
fhalf = comfy.sd.load_lora_for_models(base, None, loha_sd, 0.5, 0)[0]
with torch.no_grad():
    before = {name: m(x_layer[name]).float() for name, m in layers.items()}
res["fold_calls"] = load(f1)
(folded, folded2), res["fold_run"] = model_out(f1)
res["fold"] = {"repeat": rel(folded2, folded), "effect": rel(folded, plain), "layers": layer_state()}
with torch.no_grad():
    res["layer_effect"] = min(rel(m(x_layer[name]).float(), before[name]) for name, m in layers.items())
dynamic_vram.PAGED.reset()
f1.partially_unload(f1.offload_device, 1e30)
(evicted, _), res["evicted_run"] = model_out(f1)
res["evicted"] = {"vs_fold": rel(evicted, folded), "copied": dynamic_vram.PAGED.copied_calls,
                  "layers": layer_state()}
res["reload_calls"] = load(f1)
res["reload_vs_fold"] = rel(model_out(f1)[0][0], folded)

res["restore_calls"] = load(base)
(restored, _), _ = model_out(base)
res["restore"] = {"vs_plain": rel(restored, plain), "layers": layer_state()}

res["half_calls"] = load(fhalf)
(half_out, _), res["half_run"] = model_out(fhalf)
res["half"] = {"vs_fold": rel(half_out, folded), "layers": layer_state()}
res["refold_calls"] = load(f1)  # back to the first strength: its fold kept, written back
res["refold_vs_fold"] = rel(model_out(f1)[0][0], folded)

mm.unload_all_models()
res["unloaded_original"] = all(torch.equal(as_bytes(t), originals[(n, k)])
                               for n, m in layers.items() for k, t in m._parameters.items() if t is not None)
res["after_unload_calls"] = load(f1)
res["after_unload_vs_fold"] = rel(model_out(f1)[0][0], folded)
res["after_unload"] = layer_state()
print(json.dumps(res))
"""


def test_lora_branch_and_fold_pages_and_pins_under_dynamic_vram():
    result = subprocess.run([sys.executable, "-c", PROBE, str(PACK_ROOT), str(TESTS_DIR), json.dumps(TARGETS)],
                            cwd=COMFYUI, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-8000:]
    res = json.loads(result.stdout.strip().splitlines()[-1])
    n = len(TARGETS)
    same = 1e-5  # the same weights in every kernel: run to run, the model's output varies by less
    assert res["base"]["repeat"] < same and res["branch"]["repeat"] < same and res["fold"]["repeat"] < same, res

    def pages_and_pins(state, original, pinned=True, branch=False, folded_file=False):
        for name, layer in res[state]["layers"].items() if "layers" in res[state] else res[state].items():
            assert layer["page_vs_held"] < PAGE_SAME, (state, name, layer)  # the page holds what the layer holds
            assert all(layer["pins"]) and (layer["pins"] or not pinned), (state, name, layer)
            assert layer["original"] is original, (state, name, layer)
            assert not layer["lowvram"] and layer["per_call"] == 0, (state, name, layer)
            assert layer["branch"] is branch, (state, name, layer)
            assert layer["file_backed"] or not folded_file, (state, name, layer)
            if "exact_err" in layer:
                bound = layer["base_own"] + BRANCH_ROUNDING + INT8_HIDDEN * layer["part"]
                assert layer["exact_err"] < bound, (state, name, layer, bound)

    pages_and_pins("base", original=True)
    # the LoRA as a branch: nothing computed at the load or per call, the layers' bytes the originals
    assert res["branch_calls"] == 0 and res["branch_run"] == {"patch": 0, "per_call": 0}, res
    # each LoRA tensor (down and up of each layer) read from the file to the device, none through the file's map
    assert res["branch_file_reads"] == [True] * (2 * n), res
    assert res["branch"]["effect"] > 0.01, res
    pages_and_pins("branch", original=True, branch=True)
    # another strength reloads nothing: no patch computation, the adapter's device copies reused, under 2 s
    assert res["branch_half_calls"] == 0 and res["branch_half_reused"] and res["branch_half_seconds"] < 2, res
    assert res["branch_half_run"] == {"patch": 0, "per_call": 0} and res["branch_half"]["vs_branch"] > 1e-3, res
    pages_and_pins("branch_half", original=True, branch=True)
    assert res["branch_back_calls"] == 0 and res["branch_back_vs_branch"] < same, res
    # evicted: refilled from the pinned copies, the branch still on; no LoRA: no branch; an unload takes it away
    assert res["branch_evicted_run"] == {"patch": 0, "per_call": 0}, res
    assert res["branch_evicted"]["vs_branch"] < same, res
    pages_and_pins("branch_evicted", original=True, branch=True)
    assert res["branch_restore_calls"] == 0 and res["branch_restore"]["vs_plain"] < same, res
    pages_and_pins("branch_restore", original=True)
    assert res["branch_unloaded"] == 0, res
    assert res["branch_after_unload_calls"] == 0 and res["branch_after_unload_vs_branch"] < same, res

    # the LoHa folded once, at load, into weights mapped from a scratch file; nothing per call
    assert res["fold_calls"] == n and res["fold_run"] == {"patch": 0, "per_call": 0}, res
    assert res["fold"]["effect"] > 0.01 and res["layer_effect"] > 100 * PAGE_SAME, res
    pages_and_pins("fold", original=False, folded_file=True)
    # evicted: pages refilled from the pinned copies, the scales from the host's backup: the same folded model
    assert res["evicted"]["copied"] > 0 and res["evicted"]["vs_fold"] < same, res["evicted"]
    assert res["evicted_run"] == {"patch": 0, "per_call": 0}, res
    pages_and_pins("evicted", original=False, folded_file=True)
    assert res["reload_calls"] == 0 and res["reload_vs_fold"] < same, res
    # no LoHa: the original bytes in the layers, their pages and pins, and the model's output as before
    assert res["restore"]["vs_plain"] < same, res["restore"]
    pages_and_pins("restore", original=True)
    # another strength folds again; back to the first one reuses the kept fold
    assert res["half_calls"] == n and res["half_run"] == {"patch": 0, "per_call": 0}, res
    assert res["half"]["vs_fold"] > 1e-3, res
    pages_and_pins("half", original=False, folded_file=True)
    assert res["refold_calls"] == 0 and res["refold_vs_fold"] < same, res
    # unloaded: the originals; loaded again: the fold written back without computing
    assert res["unloaded_original"], res
    assert res["after_unload_calls"] == 0 and res["after_unload_vs_fold"] < same, res
    pages_and_pins("after_unload", original=False, pinned=False, folded_file=True)
