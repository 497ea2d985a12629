"""A LoRA as a low-rank branch beside the pack's quantized GEMM (host/lora_branch.py), against the host's own patched
weight, on both hosts' real comfy.lora and weight adapters (in the host's python, on CPU).

The reference is what ComfyUI would compute with: comfy.lora.calculate_weight on the layer's dequantized weight
(fp32), then F.linear in bf16. The layer with its branch computes the quantized GEMM (activations quantized as
without a LoRA, ConvRot rotated, 4-bit codes unpacked by the kernel) plus the branch in bf16. Tolerance, stated
per output: the distance to the reference may exceed the base layer's own distance to F.linear on its dequantized
weight (the format's rounding, which the LoRA does not change) by at most BRANCH_ROUNDING of the reference's norm
(bf16 rounding of the branch's hidden activations and sum), and the branch alone (added to zeros) matches
x @ (W_patched - W)^T + (b_patched - b) within BRANCH_ROUNDING.
Cases: a LoRA with and without alpha, with a 1x1 mid (LoCon's linear part), in fp32, a strength other than 1, two
LoRAs stacked, a bias diff, a zero strength, a layer fed SwiGLU of a wider input (H3's fc2); on INT8 ConvRot, FP8, W4A8 and W4A4 layers (packed 4-bit weights, which
upstream skips a LoRA on). Each patch the branch cannot compute exactly (LoHa, LoKr, DoRA, a full weight diff, a
set weight, an offset, a model strength, a function) gives no branch, saying why; through a real ModelPatcher load
(no dynamic VRAM) such a layer keeps ComfyUI's fold, and the report says which path each layer took. Where the
host's LoRA adapter has upstream's bypass `h`, the branch computes the same product. Taking ComfyUI's fold out leaves
each of a layer's tensors on the device the host put it on (dynamic VRAM's scales on the card, weight in RAM).
"""
import json
import subprocess

import pytest

from comfy_harness import PACK_ROOT

pytestmark = pytest.mark.integration

# two bf16 roundings (hidden activations, the sum), relative to the output's norm; measured on both hosts: the branch
# alone at most 0.0034 from the exact delta, a layer at most 0.0005 further from the reference than its base
BRANCH_ROUNDING = 2 ** -7
FORMATS = {"int8_convrot": {"group_size": 16}, "float8_e4m3fn": {}, "asym_w4a8_int8": {"group_size": 16,
           "convrot_groupsize": 64}, "convrot_w4a4": {"convrot_groupsize": 64}}

PROBE = r"""
import json, os, sys, types
pack_root, formats = sys.argv[1], json.loads(sys.argv[2])
sys.path.insert(0, os.getcwd())
from comfy.cli_args import args
args.cpu = True
import torch
import torch.nn.functional as F
import comfy.lora, comfy.model_patcher, comfy.weight_adapter as adapters
pkg = types.ModuleType("bigdit"); pkg.__path__ = [pack_root]; sys.modules["bigdit"] = pkg
from bigdit.host.layers import ComfyQuantLinear
from bigdit.host.lora_branch import build_branch, take_out_loaded_fold
from bigdit.host.lora_fold import LAST_LINE, install_lora_fold
from bigdit.quant import get_method
from bigdit.quant.kitchen_api import apply_input_act
from bigdit.quant.linear import quantized_layer

cpu = torch.device("cpu")
OUT, IN, RANK = 96, 256, 8
gen = torch.Generator().manual_seed(0)


def randn(*shape, scale=1.0):
    return torch.randn(*shape, generator=gen) * scale


def make_layer(method):
    weight = randn(OUT, IN, scale=IN ** -0.5)
    return quantized_layer(method, weight, IN, OUT, randn(OUT, scale=0.1).bfloat16(), torch.bfloat16, cpu, cpu,
                           layer_type=ComfyQuantLinear)


def lora(rank=RANK, alpha=4.0, mid=False, dora=False, dtype=torch.bfloat16, side_by_side=1):
    up, down = randn(OUT, rank, scale=0.02).to(dtype), randn(rank, IN, scale=0.3).to(dtype)
    if side_by_side > 1:  # separate projections' LoRAs on a fused one (q, k, v on qkv): up block-diagonal
        up = up * torch.block_diag(*[torch.ones(OUT // side_by_side, rank // side_by_side)] * side_by_side).to(dtype)
    mid_t = randn(rank, rank, 1, 1, scale=0.5).to(dtype) if mid else None
    dora_t = (1 + randn(OUT, 1, scale=0.1)).to(dtype) if dora else None
    return adapters.LoRAAdapter(set(), (up, down, alpha, mid_t, dora_t, None))


def entry(v, strength=1.0, strength_model=1.0, offset=None, function=None):
    return (strength, v, strength_model, offset, function)


def rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def reference(layer, patches):
    # ComfyUI's patched weight and bias (fp32), then F.linear in bf16
    weight = layer.dequantized(cpu, torch.float32)
    bias = layer.bias.float()
    if "weight" in patches:
        weight = comfy.lora.calculate_weight(list(patches["weight"]), weight.clone(), "w")
    if "bias" in patches:
        bias = comfy.lora.calculate_weight(list(patches["bias"]), bias.clone(), "b")
    return weight, bias


CASES = {
    "lora": {"weight": [entry(lora())]},
    "no_alpha_strength": {"weight": [entry(lora(alpha=None), strength=0.6)]},
    "mid_locon": {"weight": [entry(lora(mid=True), strength=1.3)]},
    "fp32_lora": {"weight": [entry(lora(dtype=torch.float32))]},
    "stacked": {"weight": [entry(lora()), entry(lora(rank=4, alpha=1.0), strength=-0.7)]},
    "bias_diff": {"weight": [entry(lora())], "bias": [entry(("diff", (randn(OUT, scale=0.2),)), strength=0.8)]},
    "zero_strength": {"weight": [entry(lora(), strength=0.0), entry(lora(), strength=0.5)]},
    "swiglu_input": {"weight": [entry(lora())]},  # H3's fc2: the layer takes SwiGLU of a twice wider input
    "side_by_side": {"weight": [entry(lora(rank=12, side_by_side=3))]},
}
loha = adapters.LoHaAdapter(set(), (randn(OUT, 4, scale=0.3), randn(4, IN, scale=0.3), 4.0, randn(OUT, 4, scale=0.3),
                                    randn(4, IN, scale=0.3), None, None, None))
lokr = adapters.LoKrAdapter(set(), (randn(8, 8, scale=0.3), randn(12, 32, scale=0.3), 1.0, None, None, None, None,
                                    None, None))
NOT_EXPRESSIBLE = {
    "LoHa": entry(loha), "LoKr": entry(lokr), "DoRA": entry(lora(dora=True)),
    "a full weight diff": entry(("diff", (randn(OUT, IN, scale=0.01),))),
    "a set weight": entry(("set", (randn(OUT, IN, scale=0.01),))),
    "a patch on part of the tensor (offset)": entry(lora(), offset=(0, 0, OUT)),
    "a model strength other than 1": entry(lora(), strength_model=0.5),
    "a patch with a function": entry(lora(), function=lambda w: w),
}

out = {}
x_plain = randn(3, 7, IN).bfloat16()
x_wide = randn(3, 7, 2 * IN).bfloat16()
for name, options in formats.items():
    method = get_method(name, **options)
    res = out[name] = {}
    for case, patches in CASES.items():
        layer = make_layer(method)
        stored = {k: v.clone() for k, v in layer.named_parameters()}
        act = "swiglu" if case == "swiglu_input" else None
        x_in = x_wide if act else x_plain
        x = apply_input_act(x_in, act) if act else x_in  # what the GEMM multiplies
        with torch.no_grad():
            base = layer(x_in, input_act=act)
            base_own = rel(base, F.linear(x, layer.dequantized(cpu, torch.bfloat16), layer.bias))
            branch = build_branch(layer, {k: ("k." + k, tuple(v)) for k, v in patches.items()}, cpu)
            layer.lora_branch = branch
            got = layer(x_in, input_act=act)
            weight, bias = reference(layer, patches)
            ref = F.linear(x, weight.bfloat16(), bias.bfloat16())
            delta = F.linear(x.float(), weight - layer.dequantized(cpu, torch.float32), bias - layer.bias.float())
            alone = branch(x, torch.zeros_like(base))
        res[case] = {"err": rel(got, ref), "base_own": base_own, "branch_err": rel(alone, delta),
                     "effect": rel(got, base), "dtypes": sorted({str(t.dtype) for p in branch.parts
                                                                   for t in vars(p).values() if torch.is_tensor(t)}),
                     "parts": len(branch.parts), "rank": branch.rank,
                     "blocks": [getattr(p, "blocks", None) for p in branch.parts],
                     "untouched": all(torch.equal(v, stored[k]) for k, v in layer.named_parameters())}
    # upstream's bypass mode computes the same product (LoRAAdapter.h, where the host has it)
    strength, adapter = CASES["no_alpha_strength"]["weight"][0][:2]
    if hasattr(adapter, "h"):
        layer = make_layer(method)
        branch = build_branch(layer, {"weight": ("k.weight", tuple(CASES["no_alpha_strength"]["weight"]))}, cpu)
        adapter.multiplier = strength
        with torch.no_grad():
            h = adapter.h(x_plain, None)
            res["vs_bypass_h"] = rel(branch(x_plain, torch.zeros_like(h)), h)
    layer = make_layer(method)
    res["not_expressible"] = {kind: build_branch(layer, {"weight": ("k.weight", (entry(lora()), e))}, cpu)
                              for kind, e in NOT_EXPRESSIBLE.items()}

# through a real ModelPatcher load (no dynamic VRAM): LoRA'd layers take the branch, ComfyUI's set_weight fold
# taken out again; a LoHa'd layer keeps ComfyUI's fold; both against the reference; the report line
method = get_method("int8_convrot", group_size=16)
model = torch.nn.Module()
model.a, model.b, model.c = make_layer(method), make_layer(method), make_layer(method)
stored = {k: v.clone() for k, v in model.named_parameters()}
patcher = comfy.model_patcher.ModelPatcher(model, load_device=cpu, offload_device=cpu)
install_lora_fold(patcher)
lora_a, lora_b = lora(), lora(mid=True)
patched = patcher.clone()
patched.add_patches({"a.weight": lora_a, "b.weight": lora_b, "c.weight": loha}, 0.8)
patched.patch_model(cpu)


def loaded_state():
    state = {}
    for name in ("a", "b", "c"):
        layer = getattr(model, name)
        tensors = {k.split(".", 1)[1]: v for k, v in stored.items() if k.startswith(name + ".") and k != name + ".bias"}
        original = ComfyQuantLinear(layer.method, IN, OUT, tensors, stored[name + ".bias"], torch.bfloat16)
        weight, bias = reference(original, {"weight": patched.patches[name + ".weight"]})
        ref = F.linear(x, weight.bfloat16(), bias.bfloat16())
        state[name] = {"branch": layer.lora_branch is not None, "err": rel(layer(x), ref),
                       "base_own": rel(original(x), F.linear(x, original.dequantized(cpu, torch.bfloat16),
                                                             original.bias)),
                       "untouched": all(torch.equal(v, stored[f"{name}.{k}"]) for k, v in layer.named_parameters()),
                       "patch_error": layer.patch_error, "per_call": len(layer.weight_patches("weight"))}
    state["line"] = LAST_LINE[model]
    state["backup_keys"] = sorted(patched.backup)
    return state


x = x_plain
with torch.no_grad():
    load = loaded_state()  # loaded whole: ComfyUI patched each layer through set_weight
    patched.unpatch_model(cpu)
    patched.load(cpu, lowvram_model_memory=1)  # nothing fits: every layer left in RAM with a per-call LowVramPatch
    load["offloaded"] = loaded_state()
patched.unpatch_model(cpu)
load["restored"] = all(torch.equal(v, stored[k]) for k, v in model.named_parameters())
load["branches_after_unpatch"] = [getattr(model, n).lora_branch is not None for n in "abc"]
patched.detach(unpatch_all=True)
load["branches_after_detach"] = [getattr(model, n).lora_branch is not None for n in "abc"]
out["load"] = load

# upstream's dynamic VRAM pages weight and bias from RAM and loads a layer's other tensors (its scales) whole to the
# load device ("meta" stands in for the card here): with no fold to take out, each tensor stays where the host put it
layer = make_layer(method)
for key in [k for k in layer._parameters if k not in ("weight", "bias")]:
    layer._parameters[key] = torch.nn.Parameter(layer._parameters[key].to("meta"), requires_grad=False)
try:
    taken = take_out_loaded_fold(types.SimpleNamespace(backup={}), "k", layer)
except Exception as exc:  # moving a tensor the host placed on another device (here: copying out of "meta")
    taken = f"{type(exc).__name__}: {exc}"
out["dynamic_take_out"] = {"taken": taken, "devices": {k: str(v.device) for k, v in layer._parameters.items()
                                                       if v is not None}}
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def probe(comfy):
    result = subprocess.run([str(comfy.host.python), "-c", PROBE, str(PACK_ROOT), json.dumps(FORMATS)],
                            cwd=comfy.host.comfyui, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-6000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("fmt", FORMATS)
def test_branch_matches_the_hosts_patched_weight(probe, fmt):
    for case, res in probe[fmt].items():
        if case in ("not_expressible", "vs_bypass_h"):
            continue
        assert res["untouched"], (fmt, case)  # nothing folded, requantized or copied into the layer
        assert res["dtypes"] == ["torch.bfloat16"], (fmt, case, res)  # the activations' dtype, no fp32 upcast
        assert res["effect"] > 0.05, (fmt, case, res)  # the LoRA matters
        assert res["branch_err"] < BRANCH_ROUNDING, (fmt, case, res)
        assert res["err"] < res["base_own"] + BRANCH_ROUNDING, (fmt, case, res)
    assert probe[fmt]["stacked"]["parts"] == 2 and probe[fmt]["stacked"]["rank"] == 12
    assert probe[fmt]["zero_strength"]["parts"] == 1  # a zero strength adds nothing, as calculate_weight
    assert probe[fmt]["bias_diff"]["parts"] == 2
    assert probe[fmt]["side_by_side"]["blocks"] == [3] and probe[fmt]["lora"]["blocks"] == [1]
    if "vs_bypass_h" in probe[fmt]:  # upstream's bypass `h`: the same product, rounded as bf16 rounds
        assert probe[fmt]["vs_bypass_h"] < BRANCH_ROUNDING, probe[fmt]["vs_bypass_h"]


@pytest.mark.parametrize("fmt", FORMATS)
def test_each_patch_the_branch_cannot_compute_gives_no_branch(probe, fmt):
    assert probe[fmt]["not_expressible"] == {kind: kind for kind in probe[fmt]["not_expressible"]}


def test_a_load_takes_the_branch_where_it_can_and_keeps_the_fold_elsewhere(probe):
    load = probe["load"]
    for name in ("a", "b"):  # LoRA (with mid on b): the branch; ComfyUI's set_weight fold taken out again
        assert load[name]["branch"] and load[name]["untouched"] and load[name]["patch_error"] is None, (name, load)
        assert load[name]["err"] < load[name]["base_own"] + BRANCH_ROUNDING, (name, load)
    assert not load["c"]["branch"] and load["c"]["patch_error"] > 0, load  # LoHa: ComfyUI's fold
    assert load["c"]["err"] < 0.02, load  # the fold requantizes the patched weight (INT8: about 1%)
    assert load["backup_keys"] == ["c.weight"], load  # the branch layers' backups dropped with their fold
    short, full = load["line"]
    assert short.startswith("LoRA as a branch on 2 layers (rank 8), not as a branch on 1: LoHa (1); "
                            "LoRA folded into 1 quantized layers (error max "), short
    assert "ComfyUI's fold of 2 layers it loaded taken out again" in full, full
    # left in RAM: ComfyUI's per-call LowVramPatch gives way to the branch, and the pack folds the LoHa'd layer
    offloaded = load["offloaded"]
    for name in ("a", "b"):
        assert offloaded[name]["branch"] and offloaded[name]["untouched"] and offloaded[name]["per_call"] == 0
        assert offloaded[name]["err"] < offloaded[name]["base_own"] + BRANCH_ROUNDING, (name, offloaded)
    assert not offloaded["c"]["branch"] and offloaded["c"]["patch_error"] > 0 and offloaded["c"]["per_call"] == 0
    assert "(1 tensors ComfyUI left in RAM folded by the pack)" in offloaded["line"][1], offloaded["line"]
    assert load["restored"] and load["branches_after_unpatch"] == [True, True, False], load
    assert load["branches_after_detach"] == [False, False, False], load


def test_taking_a_fold_out_leaves_each_tensor_where_the_host_put_it(probe):
    # under dynamic VRAM the scales are on the card and weight and bias in RAM: none moves to the weight's device
    assert probe["dynamic_take_out"] == {"taken": 0, "devices": {"weight": "cpu", "weight_scale": "meta",
                                                                 "bias": "cpu"}}, probe["dynamic_take_out"]
