"""A LoRA folded into the pack's quantized layers under upstream's dynamic VRAM (host/lora_fold.py `fold_paged`),
and the fold's report on both hosts.

Dynamic VRAM: upstream's real ModelPatcherDynamic, built for a CUDA load device and
retargeted to the CPU as test_dynamic_vram.py does (a CPU server never makes one), loads
a tiny Wan whose layers the pack quantized, in place as the loaders build them and as
QuantizeModelINT8's object patches, with a LoRA file loaded by LoraLoaderModelOnly's own
function (comfy.sd.load_lora_for_models). The probe loads, switches and unloads
patchers as ComfyUI's model management does (partially_load, detach) and checks: the
LoRA is folded at the first load (one patch computation per LoRA'd layer) and never
applied per call; the folded layer against the exact LoRA'd layer; a second load, a
clone and the same LoRA loaded again reuse the fold; another strength folds again;
a patcher without the LoRA, and an unload, give back every quantized tensor bit for
bit, the very tensors; the log line says what was folded and its error; on a host
without the RAM for a fold (psutil's available memory emulated as none, as
tests/bench/vram_cap.py emulates a smaller host) the LoRA stays per call, exact, and
the log says why. What needs a GPU (comfy-aimdo's pages and pinned copies) is
tests/test_lora_fold_gpu.py.

Both hosts, without dynamic VRAM: the loader's `last run:` line says what the load
folded and its error, through a real workflow with LoraLoaderModelOnly.
"""
import json
import re
import subprocess

import pytest

from checkpoint_files import write_lora
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

PROBE = r"""
import json, logging, os, sys, types
import psutil
pack_root, unet, lora_file, method_name = sys.argv[1:5]
sys.path.insert(0, os.getcwd())
import comfy_aimdo.control
assert comfy_aimdo.control.init(), "comfy-aimdo's library did not load"  # before its modules bind it
from comfy.cli_args import args
args.cpu = True
import torch
import comfy.lora, comfy.model_patcher, comfy.patcher_extension, comfy.sd, comfy.utils
pkg = types.ModuleType("bigdit"); pkg.__path__ = [pack_root]; sys.modules["bigdit"] = pkg
from bigdit.host import model as host_model
from bigdit.host.layers import ComfyQuantLinear
from bigdit.host.loading import attach_quantized
from bigdit.host.report import NodeRun
from bigdit.quant import QuantConfig, get_method
from bigdit.quant.linear import QuantLinear
from bigdit.quant.quantize_pass import QuantizeOptions, apply_replacements, quantize_layers

cpu, cuda = torch.device("cpu"), torch.device("cuda", 0)
Dynamic = comfy.model_patcher.ModelPatcherDynamic
lines = []
handler = logging.Handler(); handler.emit = lambda record: lines.append(record.getMessage())
logging.getLogger("bigdit").addHandler(handler); logging.getLogger("bigdit").setLevel(logging.DEBUG)
""" + COUNT_LORA_CALLS + r"""
lora_sd = comfy.utils.load_torch_file(lora_file)  # LoraLoaderModelOnly keeps the file's dict and reuses it

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


def with_lora(p, strength):
    return comfy.sd.load_lora_for_models(p, None, lora_sd, strength, 0)[0]


def lora_checks(p, layers, saved):
    # each LoRA'd layer against the exact LoRA'd layer: the original weight dequantized, ComfyUI's patch math in fp32
    out = {}
    for name, layer in layers.items():
        key = f"{host_model.DIFFUSION_PREFIX}{name}.weight"
        if key not in p.patches:
            continue
        tensors = {k: t for (n, k), (t, _) in saved.items() if n == name and k != "bias"}
        original = QuantLinear(layer.method, layer.in_features, layer.out_features, tensors, None, layer.compute_dtype)
        with torch.no_grad():
            exact = real_calculate(p.patches[key], original.method.dequantize(original).float(), key)
            x_l = torch.randn(4, layer.in_features, generator=torch.Generator().manual_seed(1))
            ref = torch.nn.functional.linear(x_l, exact, layer.bias.float())
            got = layer(x_l).float()
            folded = layer.method.dequantize(layer).float()
        out[name] = {"output_err": ((got - ref).norm() / ref.norm()).item(),
                     "weight_err": ((folded - exact).norm() / exact.norm()).item(),
                     "reported_err": layer.patch_error,
                     "lowvram": layer.weight_lowvram_function is not None,
                     "per_call": [type(f).__name__ for f in layer.weight_function]}
    return out


def scenario(base, layers):
    res = {}
    run_line = NodeRun(None, "")
    attach_quantized(base, run_line, layers, "test")
    l1 = with_lora(base, 1.0)
    l1_clone = l1.clone()
    l1_again = with_lora(base, 1.0)  # the same LoRA file loaded again: a new patcher, new adapters, same tensors
    half = with_lora(base, 0.5)
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

    del lines[:]
    res["restore_calls"] = load(base)
    res["restore_line"] = [l for l in lines if "LoRA" in l]
    res["restored"] = compare(layers, saved)
    res["restored_output"] = torch.equal(run(base)[0], plain)

    res["refold_calls"] = load(l1)  # the fold went with the LoRA: computed again
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
        load(half)
    finally:
        psutil.virtual_memory = real_memory
    res["no_ram_line"] = [l for l in lines if "LoRA" in l]
    _, res["no_ram_run"] = run(half)
    res["no_ram_layers"] = lora_checks(half, layers, saved)
    unload()
    res["final"] = compare(layers, saved)
    return res


out = {}
config = QuantConfig(method=get_method(method_name, group_size=16) if method_name == "int8_convrot"
                     else get_method(method_name), compute_device=cpu)
own = comfy.sd.load_diffusion_model(unet)  # --cpu: a plain ModelPatcher; its model is quantized in place
replacements, _ = quantize_layers(own.model.diffusion_model, config, title="test", layer_type=ComfyQuantLinear)
apply_replacements(own.model.diffusion_model, replacements)
in_place = Dynamic(own.model, load_device=cuda, offload_device=cpu)
out["in_place"] = scenario(in_place, replacements)

plain = comfy.sd.load_diffusion_model(unet)
linear_bytes = {k: v.clone() for k, v in plain.model.state_dict().items()}
options = QuantizeOptions(method_name, 16) if method_name == "int8_convrot" else QuantizeOptions(method_name)
object_patched, _, layers = host_model.quantize_on_clone(
    Dynamic(plain.model, load_device=cuda, offload_device=cpu), options, title="test")
out["object_patch"] = scenario(object_patched, layers)
out["object_patch"]["replaced_kept"] = all(torch.equal(v, linear_bytes[k]) for k, v in plain.model.state_dict().items())
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def lora_path(comfy):
    path = comfy.models_dir / "loras" / "tiny_wan2_fold_lora.safetensors"
    write_lora(path, TARGETS, seed=5)
    return path


@pytest.mark.host_feature("dynamic_vram")
@pytest.mark.parametrize("method", list(TOLERANCE))
def test_lora_is_folded_once_and_restored_exactly_under_dynamic_vram(comfy, tiny_wan2, lora_path, method):
    result = subprocess.run([str(comfy.host.python), "-c", PROBE, str(PACK_ROOT), str(tiny_wan2["path"]),
                             str(lora_path), method],
                            cwd=comfy.host.comfyui, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-6000:]
    out = json.loads(result.stdout.strip().splitlines()[-1])
    n = len(TARGETS)
    for producer, res in out.items():
        where = (producer, method)
        assert res["base_calls"] == 0 and res["lora_effect"] > 0.05, (where, res)
        # folded at the first load: ComfyUI's patch math once per LoRA'd layer, nothing per call
        assert res["first_calls"] == n, (where, res)
        assert res["first_run"] == {"patch": 0, "per_call": 0}, (where, res)
        assert res["half_run"] == {"patch": 0, "per_call": 0}, (where, res)
        for checks in ("layers", "half_layers"):
            assert res[checks].keys() == {name for name in TARGETS}, (where, res[checks])
            for name, layer in res[checks].items():
                assert not layer["lowvram"] and layer["per_call"] == [], (where, name, layer)
                assert layer["weight_err"] < TOLERANCE[method]["weight"], (where, name, layer)
                assert layer["output_err"] < TOLERANCE[method]["output"], (where, name, layer)
                assert abs(layer["weight_err"] - layer["reported_err"]) < 1e-5, (where, name, layer)
        # reported: what was folded, and the error (the largest of the layers, in percent)
        worst = max(layer["reported_err"] for layer in res["layers"].values())
        mean = sum(layer["reported_err"] for layer in res["layers"].values()) / n
        expected = f"max {100 * worst:.2f}%, mean {100 * mean:.2f}%"
        assert any(f"LoRA folded into {n} quantized layers ({n} computed in" in line and expected in line
                   for line in res["first_line"]), (where, res["first_line"])
        assert res["node_part"] == f"LoRA folded into {n} quantized layers (error {expected})", (where, res)
        # once per LoRA set and strength: a second load, a clone, the same file loaded again reuse the fold
        for case in ("second", "clone", "again", "after_unload"):
            assert res[f"{case}_calls"] == 0 and res[f"{case}_equal"], (where, case, res)
        assert res["half_calls"] == n and res["half_differs"], (where, res)
        # no LoRA: every quantized tensor back bit for bit, weight and bias the very tensors (the scales are the
        # host's device copies while it holds the model loaded), the output as before; the fold is dropped
        assert res["restored"]["exact"] and res["restored"]["paged_same_objects"], (where, res["restored"])
        assert res["restored_output"], (where, res)
        assert any(f"LoRA taken out of {n} quantized layers" in line for line in res["restore_line"]), (where, res)
        assert res["refold_calls"] == n and res["refold_equal"], (where, res)
        # no RAM for the folds: the LoRA per call on the dequantized weight (exact in fp32), and the log says why
        assert any(f"LoRA applied per call on {n} quantized layers, not folded: not enough free RAM" in line
                   for line in res["no_ram_line"]), (where, res["no_ram_line"])
        assert res["no_ram_run"] == {"patch": 3 * n, "per_call": 3 * n}, (where, res["no_ram_run"])
        for name, layer in res["no_ram_layers"].items():
            assert layer["per_call"] == ["LowVramPatch"] and layer["reported_err"] is None, (where, name, layer)
            assert layer["weight_err"] > 0.05, (where, name, layer)  # the stored weight stays the original
            assert layer["output_err"] < 1e-5, (where, name, layer)
        for state in ("unloaded", "final"):
            assert res[state] == {"exact": True, "same_data": True, "paged_same_objects": True}, (where, state)
    assert out["object_patch"]["replaced_kept"]  # the Linear layers QuantizeModelINT8 replaced, untouched


def test_loader_reports_the_fold_and_its_error(comfy, tiny_wan2, lora_path):
    """Without dynamic VRAM (a CPU server): ComfyUI writes the LoRA in at load through the layers' set_weight;
    the loader's `last run:` line says how many layers it folded and what that cost."""
    loader = ("LoadH3Quantized", {"unet_name": tiny_wan2["unet_name"], "quantization": "int8_convrot",
                                  "offload": "none", "group_size": "16"})
    chain = [("LoraLoaderModelOnly", {"lora_name": lora_path.name, "strength_model": 1.0})]
    with ReportEvents(comfy.url) as events:
        comfy.run(wan_t2v_graph(tiny_wan2["unet_name"], tiny_wan2["vae_name"], model_chain=chain, loader=loader))
        text = events.wait_for("unet", "last run:")
    line = text.split("\nlast run: ", 1)[1]
    found = re.search(r"LoRA folded into (\d+) quantized layers \(error max ([0-9.]+)%, mean ([0-9.]+)%\)", line)
    assert found, line
    assert int(found[1]) == len(TARGETS)
    assert 0 < float(found[3]) <= float(found[2]) < 100 * TOLERANCE["int8_convrot"]["weight"], line
    assert chain_id(0) not in [e["node"] for e in events.events]  # the LoRA node itself shows nothing
