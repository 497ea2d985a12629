"""A LoRA on the pack's quantized layers under upstream's dynamic VRAM: as a low-rank branch beside the GEMM
(host/lora_branch.py) where the branch computes it exactly, else folded (host/lora_fold.py `fold_paged`); and what
the loader's node reports on both hosts.

Dynamic VRAM: upstream's real ModelPatcherDynamic, built for a CUDA load device and
retargeted to the CPU as test_dynamic_vram.py does (a CPU server never makes one), loads
a tiny Wan whose layers the pack quantized, in place as the loaders build them and as
QuantizeModelINT8's object patches, with a LoRA file loaded by LoraLoaderModelOnly's own
function (comfy.sd.load_lora_for_models). The probe loads, switches and unloads
patchers as ComfyUI's model management does (partially_load, detach) and checks:
- a LoRA takes the branch: no patch computation at any load, nothing per call, the
  quantized tensors the very ones throughout; each layer against the exact LoRA'd layer;
  another strength reloads nothing (no patch computation, the adapter's device copies
  reused, only the scalars change); a patcher without the LoRA and an unload take the
  branch away; the log and the node's line say "as a branch";
- a LoHa (which the branch cannot compute) is folded at the first load (one patch
  computation per LoHa'd layer) and never applied per call; the folded layer against
  the exact LoHa'd layer; a second load, a clone, the same file loaded again, and a
  strength going back and forth reuse the fold; the folded weights are maps of a
  deleted scratch file (reclaimable), not anonymous memory; a patcher without the LoHa
  and an unload give back every quantized tensor bit for bit, the very tensors; the log
  line says what was folded, its error, and why it is no branch; on a host without the
  RAM for a fold (psutil's available memory emulated as none, as tests/bench/vram_cap.py
  emulates a smaller host), or whose free memory is taken (loaders/host_memory.py `free_ram`, which
  leaves out the page cache in use that psutil counts), the LoHa stays per call, exact, and the
  log says why.
What needs a GPU (comfy-aimdo's pages and pinned copies) is tests/test_lora_fold_gpu.py.

Both hosts, without dynamic VRAM: the loader's `last run:` line says which path each
layer's LoRA took, through a real workflow with LoraLoaderModelOnly.
"""
import json
import re
import subprocess

import pytest

from checkpoint_files import write_loha, write_lora
from comfy_harness import PACK_ROOT
from graphs import chain_id, wan_t2v_graph
from lora_calls import COUNT_LORA_CALLS
from report_events import ReportEvents

pytestmark = pytest.mark.integration

TARGETS = {"blocks.0.ffn.0": (512, 256), "blocks.0.ffn.2": (256, 512), "blocks.1.self_attn.q": (256, 256)}
# The folded layer against the exact LoRA'd layer (the original weight dequantized plus ComfyUI's patch, fp32 on CPU),
# relative L2: (weight) the folded weight dequantized, what requantizing the patched weight with fresh scales costs;
# (output) the layer's output, which adds the format's own activation quantization. Measured on these layers:
# INT8 ConvRot (group 16) weight 0.0066-0.0074, output 0.0071-0.0115; FP8 weight 0.026-0.027, output 0.029-0.049.
TOLERANCE = {"int8_convrot": {"weight": 0.012, "output": 0.02}, "float8_e4m3fn": {"weight": 0.04, "output": 0.075}}
# The branch: the layer's output against the exact LoRA'd layer may exceed the unpatched layer's own distance to
# F.linear on its dequantized weight (the format's rounding) by this much (the branch in the input's dtype, fp32
# here, with the adapter's tensors in bf16).
BRANCH_ROUNDING = 2 ** -7

PROBE = r"""
import json, logging, os, sys, tempfile, time, types
import psutil
pack_root, unet, lora_file, loha_file, method_name = sys.argv[1:6]
sys.path.insert(0, os.getcwd())
import comfy_aimdo.control
assert comfy_aimdo.control.init(), "comfy-aimdo's library did not load"  # before its modules bind it
from comfy.cli_args import args
args.cpu = True
import torch
import comfy.lora, comfy.model_patcher, comfy.patcher_extension, comfy.sd, comfy.utils
import folder_paths
pkg = types.ModuleType("bigdit"); pkg.__path__ = [pack_root]; sys.modules["bigdit"] = pkg
from bigdit.host import model as host_model
from bigdit.host.layers import ComfyQuantLinear
from bigdit.host.loading import attach_quantized
from bigdit.host.report import NodeRun
from bigdit.quant import QuantConfig, get_method
from bigdit.quant.linear import QuantLinear
from bigdit.quant.quantize_pass import QuantizeOptions, apply_replacements, quantize_layers

folder_paths.set_temp_directory(tempfile.mkdtemp(prefix="bigdit-lora-fold-"))
cpu, cuda = torch.device("cpu"), torch.device("cuda", 0)
Dynamic = comfy.model_patcher.ModelPatcherDynamic
lines = []
handler = logging.Handler(); handler.emit = lambda record: lines.append(record.getMessage())
logging.getLogger("bigdit").addHandler(handler); logging.getLogger("bigdit").setLevel(logging.DEBUG)
""" + COUNT_LORA_CALLS + r"""
# LoraLoaderModelOnly keeps the file's dict and reuses it
lora_sd, loha_sd = comfy.utils.load_torch_file(lora_file), comfy.utils.load_torch_file(loha_file)

gen = torch.Generator().manual_seed(0)
x = torch.randn(1, 16, 1, 8, 8, generator=gen)
context = torch.randn(1, 8, 4096, generator=gen)
sigma = torch.tensor([0.7])
current = [None]


def load(p):
    # model management's load of `p`: the clone loaded before detaches without unpatching, then p loads
    p.load_device = cpu
    p.register_load_device(cpu)
    if current[0] is not None and current[0] is not p:
        current[0].detach(unpatch_all=False)
    before = calls["patch"]
    p.partially_load(cpu)
    current[0] = p
    return calls["patch"] - before


def unload():
    # model_unload: detach for good (upstream's partial unload asserts a GPU load device)
    p = current[0]
    p.load_device = cuda
    p.detach(unpatch_all=True)
    current[0] = None


def run(p):
    before = dict(calls)
    with torch.no_grad():
        outs = [p.model.apply_model(x, sigma, c_crossattn=context).float() for _ in range(3)]
    assert all(torch.equal(o, outs[0]) for o in outs)
    return outs[0], {k: calls[k] - before[k] for k in calls}


def as_bytes(t):
    return t.detach().reshape(-1).contiguous().view(torch.uint8).clone()


def snapshot(layers):
    return {(n, k): (t, as_bytes(t)) for n, m in layers.items() for k, t in m._parameters.items() if t is not None}


def compare(layers, saved):
    # exact: bit for bit; same_data: the originals' own memory, no copy (the host wraps what it restores from its
    # backups in new Parameters); paged_same_objects: weight and bias, which the host leaves alone, the very tensors
    now = {(n, k): t for n, m in layers.items() for k, t in m._parameters.items() if t is not None}
    exact = now.keys() == saved.keys() and all(torch.equal(as_bytes(now[k]), b) for k, (_, b) in saved.items())
    return {"exact": exact,
            "same_data": all(now[k].data_ptr() == t.data_ptr() for k, (t, _) in saved.items()),
            "paged_same_objects": all(now[k] is t for k, (t, _) in saved.items() if k[1] in ("weight", "bias"))}


def scratch_mapped(t):
    # whether the tensor's memory is a map of one of the pack's scratch files (deleted once mapped)
    address = t.data_ptr()
    with open("/proc/self/maps") as f:
        for line in f:
            fields = line.split()
            low, high = (int(v, 16) for v in fields[0].split("-"))
            if low <= address < high:
                return len(fields) >= 6 and os.path.basename(fields[5]).startswith("bigdit-")
    return False


def with_lora(p, sd, strength):
    return comfy.sd.load_lora_for_models(p, None, sd, strength, 0)[0]


def lora_checks(p, layers, saved):
    # each LoRA'd layer against the exact LoRA'd layer: the original weight dequantized, ComfyUI's patch math in fp32
    out = {}
    for name, layer in layers.items():
        key = f"{host_model.DIFFUSION_PREFIX}{name}.weight"
        if key not in p.patches:
            continue
        tensors = {k: t for (n, k), (t, _) in saved.items() if n == name and k != "bias"}
        original = QuantLinear(layer.method, layer.in_features, layer.out_features, tensors, layer.bias,
                               layer.compute_dtype)
        with torch.no_grad():
            dequantized = original.method.dequantize(original).float()
            exact = real_calculate(p.patches[key], dequantized.clone(), key)
            x_l = torch.randn(4, layer.in_features, generator=torch.Generator().manual_seed(1))
            ref = torch.nn.functional.linear(x_l, exact, layer.bias.float())
            got = layer(x_l).float()
            base_own = original(x_l).float()
            folded = layer.method.dequantize(layer).float()
        out[name] = {"output_err": ((got - ref).norm() / ref.norm()).item(),
                     "weight_err": ((folded - exact).norm() / exact.norm()).item(),
                     "base_own": ((base_own - torch.nn.functional.linear(x_l, dequantized, layer.bias.float())).norm()
                                  / ref.norm()).item(),
                     "reported_err": layer.patch_error,
                     "branch": layer.lora_branch is not None,
                     "file_backed": scratch_mapped(layer.weight),
                     "lowvram": layer.weight_lowvram_function is not None,
                     "per_call": [type(f).__name__ for f in layer.weight_function]}
    return out


def device_copies(layers):
    return {n: [t.data_ptr() for part in m.lora_branch.parts for t in (part.down, part.up)]
            for n, m in layers.items() if m.lora_branch is not None}


def branch_scenario(base, layers):
    res = {}
    run_line = NodeRun(None, "")
    attach_quantized(base, run_line, layers, "test")
    l1 = with_lora(base, lora_sd, 1.0)
    l1_clone = l1.clone()
    l1_again = with_lora(base, lora_sd, 1.0)  # the same LoRA file loaded again: a new patcher, new adapters
    half = with_lora(base, lora_sd, 0.5)
    saved = snapshot(layers)
    load(base)
    plain, _ = run(base)
    del lines[:]

    res["first_calls"] = load(l1)
    res["first_line"] = [l for l in lines if "LoRA" in l]
    first, res["first_run"] = run(l1)
    res["layers"] = lora_checks(l1, layers, saved)
    res["untouched"] = compare(layers, saved)
    l1.cleanup()  # a sampling's end: the loader's `last run:` line takes the LoRA's part
    res["node_part"] = run_line.parts.get("lora")
    res["lora_effect"] = ((first - plain).norm() / plain.norm()).item()
    copies = device_copies(layers)
    for case, p in (("second", l1), ("clone", l1_clone), ("again", l1_again)):
        res[f"{case}_calls"] = load(p)
        res[f"{case}_equal"] = torch.equal(run(p)[0], first)
    res["again_reused"] = device_copies(layers) == copies
    start = time.perf_counter()
    res["half_calls"] = load(half)
    res["half_seconds"] = time.perf_counter() - start
    res["half_reused"] = device_copies(layers) == copies  # another strength: the same device copies
    half_out, res["half_run"] = run(half)
    res["half_differs"] = not torch.equal(half_out, first)
    res["half_layers"] = lora_checks(half, layers, saved)
    res["back_calls"] = load(l1)
    res["back_equal"] = torch.equal(run(l1)[0], first)

    res["restore_calls"] = load(base)
    res["restore_branches"] = sum(m.lora_branch is not None for m in layers.values())
    res["restored"] = compare(layers, saved)
    res["restored_output"] = torch.equal(run(base)[0], plain)
    load(l1)
    unload()
    res["unloaded_branches"] = sum(m.lora_branch is not None for m in layers.values())
    res["after_unload_calls"] = load(l1)
    res["after_unload_equal"] = torch.equal(run(l1)[0], first)
    unload()
    res["final"] = compare(layers, saved)
    return res


def fold_scenario(base, layers):
    res = {}
    run_line = NodeRun(None, "")
    attach_quantized(base, run_line, layers, "test")
    l1 = with_lora(base, loha_sd, 1.0)
    l1_clone = l1.clone()
    l1_again = with_lora(base, loha_sd, 1.0)  # the same file loaded again: a new patcher, new adapters, same tensors
    half = with_lora(base, loha_sd, 0.5)
    third, fourth = with_lora(base, loha_sd, 0.3), with_lora(base, loha_sd, 0.2)
    saved = snapshot(layers)
    load(base)
    res["base_calls"] = load(base)
    plain, _ = run(base)
    del lines[:]

    res["first_calls"] = load(l1)
    res["first_line"] = [l for l in lines if "LoRA" in l]
    first, res["first_run"] = run(l1)
    res["layers"] = lora_checks(l1, layers, saved)
    l1.cleanup()  # a sampling's end: the loader's `last run:` line takes the fold's part
    res["node_part"] = run_line.parts.get("lora")
    res["lora_effect"] = ((first - plain).norm() / plain.norm()).item()
    res["second_calls"] = load(l1)
    res["second_equal"] = torch.equal(run(l1)[0], first)
    res["clone_calls"] = load(l1_clone)
    res["clone_equal"] = torch.equal(run(l1_clone)[0], first)
    res["again_calls"] = load(l1_again)
    res["again_equal"] = torch.equal(run(l1_again)[0], first)

    res["half_calls"] = load(half)
    half_out, res["half_run"] = run(half)
    res["half_differs"] = not torch.equal(half_out, first)
    res["half_layers"] = lora_checks(half, layers, saved)
    res["back_calls"] = load(l1)  # a strength going back: the fold kept, written back
    res["back_equal"] = torch.equal(run(l1)[0], first)

    del lines[:]
    res["restore_calls"] = load(base)
    res["restore_line"] = [l for l in lines if "LoRA" in l]
    res["restored"] = compare(layers, saved)
    res["restored_output"] = torch.equal(run(base)[0], plain)

    res["refold_calls"] = load(l1)  # the folds stay when the LoRA goes: written back
    res["refold_equal"] = torch.equal(run(l1)[0], first)
    unload()
    res["unloaded"] = compare(layers, saved)
    res["after_unload_calls"] = load(l1)  # kept across an unload: written back, not computed
    res["after_unload_equal"] = torch.equal(run(l1)[0], first)

    # a host without the RAM for the folds (as tests/bench/vram_cap.py emulates one): per call, and said so
    real_memory = psutil.virtual_memory
    psutil.virtual_memory = lambda: real_memory()._replace(available=0)
    del lines[:]
    try:
        load(third)
    finally:
        psutil.virtual_memory = real_memory
    res["no_ram_line"] = [l for l in lines if "LoRA" in l]
    _, res["no_ram_run"] = run(third)
    res["no_ram_layers"] = lora_checks(third, layers, saved)
    # a host whose free memory is taken, psutil's `available` counting the page cache (the fold's RAM check asks
    # host_memory.free_ram, emulated here as nothing free)
    from bigdit.loaders import host_memory
    real_free = host_memory.free_ram
    host_memory.free_ram = lambda: 0
    del lines[:]
    try:
        load(fourth)
    finally:
        host_memory.free_ram = real_free
    res["no_free_line"] = [l for l in lines if "LoRA" in l]
    unload()
    res["final"] = compare(layers, saved)
    return res


def producers():
    config = QuantConfig(method=get_method(method_name, group_size=16) if method_name == "int8_convrot"
                         else get_method(method_name), compute_device=cpu)
    own = comfy.sd.load_diffusion_model(unet)  # --cpu: a plain ModelPatcher; its model is quantized in place
    replacements, _ = quantize_layers(own.model.diffusion_model, config, title="test", layer_type=ComfyQuantLinear)
    apply_replacements(own.model.diffusion_model, replacements)
    yield "in_place", Dynamic(own.model, load_device=cuda, offload_device=cpu), replacements, None
    plain = comfy.sd.load_diffusion_model(unet)
    linear_bytes = {k: v.clone() for k, v in plain.model.state_dict().items()}
    options = QuantizeOptions(method_name, 16) if method_name == "int8_convrot" else QuantizeOptions(method_name)
    object_patched, _, layers = host_model.quantize_on_clone(
        Dynamic(plain.model, load_device=cuda, offload_device=cpu), options, title="test")
    yield "object_patch", object_patched, layers, lambda: all(torch.equal(v, linear_bytes[k])
                                                              for k, v in plain.model.state_dict().items())


out = {}
for scenario in (branch_scenario, fold_scenario):
    for producer, patcher, layers, replaced_kept in producers():
        res = out[f"{scenario.__name__}/{producer}"] = scenario(patcher, layers)
        if replaced_kept is not None:
            res["replaced_kept"] = replaced_kept()
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def lora_path(comfy):
    path = comfy.models_dir / "loras" / "tiny_wan2_fold_lora.safetensors"
    write_lora(path, TARGETS, seed=5)
    return path


@pytest.fixture(scope="module")
def loha_path(comfy):
    path = comfy.models_dir / "loras" / "tiny_wan2_fold_loha.safetensors"
    write_loha(path, TARGETS, seed=6, scale=0.5)
    return path


@pytest.fixture(scope="module", params=list(TOLERANCE))
def dynamic_probe(request, comfy, tiny_wan2, lora_path, loha_path):
    if reason := comfy.host.lacks("dynamic_vram"):
        pytest.skip(reason)
    method = request.param
    result = subprocess.run([str(comfy.host.python), "-c", PROBE, str(PACK_ROOT), str(tiny_wan2["path"]),
                             str(lora_path), str(loha_path), method],
                            cwd=comfy.host.comfyui, capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-6000:]
    return method, json.loads(result.stdout.strip().splitlines()[-1])


def test_lora_is_a_branch_that_a_strength_change_does_not_reload_under_dynamic_vram(dynamic_probe):
    method, out = dynamic_probe
    n = len(TARGETS)
    for producer in ("in_place", "object_patch"):
        res, where = out[f"branch_scenario/{producer}"], (producer, method)
        assert res["lora_effect"] > 0.05, (where, res)
        # no patch computation at the load, nothing per call, the quantized tensors the very ones
        assert res["first_calls"] == 0 and res["first_run"] == {"patch": 0, "per_call": 0}, (where, res)
        assert res["untouched"]["exact"] and res["untouched"]["paged_same_objects"], (where, res)
        for checks in ("layers", "half_layers"):
            assert res[checks].keys() == set(TARGETS), (where, res[checks])
            for name, layer in res[checks].items():
                assert layer["branch"] and not layer["lowvram"] and layer["per_call"] == [], (where, name, layer)
                assert layer["reported_err"] is None, (where, name, layer)
                assert layer["output_err"] < layer["base_own"] + BRANCH_ROUNDING, (where, name, layer)
        assert any(f"LoRA as a low-rank branch beside the quantized GEMM on {n} quantized layers (rank 4" in line
                   for line in res["first_line"]), (where, res["first_line"])
        assert res["node_part"] == f"LoRA as a branch on {n} layers (rank 4)", (where, res)
        # a second load, a clone, the same file loaded again, another strength, and back: nothing computed, the
        # adapter's device copies reused; another strength changes the output
        for case in ("second", "clone", "again", "back"):
            assert res[f"{case}_calls"] == 0 and res[f"{case}_equal"], (where, case, res)
        assert res["again_reused"] and res["half_reused"], (where, res)
        assert res["half_calls"] == 0 and res["half_run"] == {"patch": 0, "per_call": 0}, (where, res)
        assert res["half_differs"] and res["half_seconds"] < 2, (where, res)
        # no LoRA: no branch, the output as before; an unload takes the branches away, the next load puts them back
        assert res["restore_branches"] == 0 and res["restored_output"], (where, res)
        assert res["restored"]["exact"] and res["restored"]["paged_same_objects"], (where, res)
        assert res["unloaded_branches"] == 0, (where, res)
        assert res["after_unload_calls"] == 0 and res["after_unload_equal"], (where, res)
        assert res["final"] == {"exact": True, "same_data": True, "paged_same_objects": True}, (where, res)
    assert out["branch_scenario/object_patch"]["replaced_kept"]


def test_loha_is_folded_once_file_backed_and_restored_exactly_under_dynamic_vram(dynamic_probe):
    method, out = dynamic_probe
    n = len(TARGETS)
    for producer in ("in_place", "object_patch"):
        res, where = out[f"fold_scenario/{producer}"], (producer, method)
        assert res["base_calls"] == 0 and res["lora_effect"] > 0.05, (where, res)
        # folded at the first load: ComfyUI's patch math once per LoHa'd layer, nothing per call
        assert res["first_calls"] == n, (where, res)
        assert res["first_run"] == {"patch": 0, "per_call": 0}, (where, res)
        assert res["half_run"] == {"patch": 0, "per_call": 0}, (where, res)
        for checks in ("layers", "half_layers"):
            assert res[checks].keys() == set(TARGETS), (where, res[checks])
            for name, layer in res[checks].items():
                assert not layer["branch"] and not layer["lowvram"] and layer["per_call"] == [], (where, name, layer)
                assert layer["file_backed"], (where, name, layer)  # a map of a scratch file, not anonymous memory
                assert layer["weight_err"] < TOLERANCE[method]["weight"], (where, name, layer)
                assert layer["output_err"] < TOLERANCE[method]["output"], (where, name, layer)
                assert abs(layer["weight_err"] - layer["reported_err"]) < 1e-5, (where, name, layer)
        # reported: why no branch, what was folded, and the error (the largest of the layers, in percent)
        worst = max(layer["reported_err"] for layer in res["layers"].values())
        mean = sum(layer["reported_err"] for layer in res["layers"].values()) / n
        expected = f"max {100 * worst:.2f}%, mean {100 * mean:.2f}%"
        assert any(f"not expressible as a branch on {n} layers, which keep the fold: LoHa ({n})" in line
                   and f"LoRA folded into {n} quantized layers ({n} computed in" in line and expected in line
                   and "of folded weights mapped from scratch files (reclaimable)" in line
                   for line in res["first_line"]), (where, res["first_line"])
        assert res["node_part"] == (f"not as a branch on {n}: LoHa ({n}); "
                                    f"LoRA folded into {n} quantized layers (error {expected})"), (where, res)
        # once per LoRA set and strength: a second load, a clone, the same file loaded again, a strength going back
        # and forth, the LoHa taken away and back, an unload: the fold reused
        for case in ("second", "clone", "again", "back", "refold", "after_unload"):
            assert res[f"{case}_calls"] == 0 and res[f"{case}_equal"], (where, case, res)
        assert res["half_calls"] == n and res["half_differs"], (where, res)
        # no LoHa: every quantized tensor back bit for bit, weight and bias the very tensors (the scales are the
        # host's device copies while it holds the model loaded), the output as before
        assert res["restored"]["exact"] and res["restored"]["paged_same_objects"], (where, res["restored"])
        assert res["restored_output"], (where, res)
        assert any(f"LoRA taken out of {n} quantized layers" in line for line in res["restore_line"]), (where, res)
        # no RAM for the folds: the LoHa per call on the dequantized weight (exact in fp32), and the log says why
        assert any(f"LoRA applied per call on {n} quantized layers, not folded: not enough free RAM" in line
                   for line in res["no_ram_line"]), (where, res["no_ram_line"])
        assert res["no_ram_run"] == {"patch": 3 * n, "per_call": 3 * n}, (where, res["no_ram_run"])
        assert any(f"LoRA applied per call on {n} quantized layers, not folded: not enough free RAM" in line
                   for line in res["no_free_line"]), (where, res["no_free_line"])
        for name, layer in res["no_ram_layers"].items():
            assert layer["per_call"] == ["LowVramPatch"] and layer["reported_err"] is None, (where, name, layer)
            assert layer["weight_err"] > 0.05, (where, name, layer)  # the stored weight stays the original
            assert layer["output_err"] < 1e-5, (where, name, layer)
        for state in ("unloaded", "final"):
            assert res[state] == {"exact": True, "same_data": True, "paged_same_objects": True}, (where, state)
    assert out["fold_scenario/object_patch"]["replaced_kept"]  # the Linear layers QuantizeModelINT8 replaced


def test_loader_reports_which_path_the_lora_took(comfy, tiny_wan2, lora_path, loha_path):
    """Without dynamic VRAM (a CPU server): ComfyUI writes the LoRA in at load through the layers' set_weight; the
    pack takes it out again and gives the layers the branch, and folds a LoHa; the loader's `last run:` line says
    which path each took, and what the fold cost."""
    loader = ("LoadH3Quantized", {"unet_name": tiny_wan2["unet_name"], "quantization": "int8_convrot",
                                  "offload": "none", "group_size": "16"})
    chain = [("LoraLoaderModelOnly", {"lora_name": lora_path.name, "strength_model": 1.0})]
    with ReportEvents(comfy.url) as events:
        comfy.run(wan_t2v_graph(tiny_wan2["unet_name"], tiny_wan2["vae_name"], model_chain=chain, loader=loader))
        text = events.wait_for("unet", "last run:")
    line = text.split("\nlast run: ", 1)[1]
    assert f"LoRA as a branch on {len(TARGETS)} layers (rank 4)" in line, line
    assert "folded" not in line, line
    assert chain_id(0) not in [e["node"] for e in events.events]  # the LoRA node itself shows nothing

    chain = [("LoraLoaderModelOnly", {"lora_name": loha_path.name, "strength_model": 1.0})]
    with ReportEvents(comfy.url) as events:
        comfy.run(wan_t2v_graph(tiny_wan2["unet_name"], tiny_wan2["vae_name"], model_chain=chain, loader=loader))
        text = events.wait_for("unet", "last run:")
    line = text.split("\nlast run: ", 1)[1]
    n = len(TARGETS)
    assert f"not as a branch on {n}: LoHa ({n})" in line, line
    found = re.search(r"LoRA folded into (\d+) quantized layers \(error max ([0-9.]+)%, mean ([0-9.]+)%\)", line)
    assert found, line
    assert int(found[1]) == n
    assert 0 < float(found[3]) <= float(found[2]) < 100 * TOLERANCE["int8_convrot"]["weight"], line
