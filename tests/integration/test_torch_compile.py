"""A model from LoadH3Quantized under ComfyUI's own TorchCompileModel, sampled through its KSampler path on CPU:
compiled once, at the first step; under upstream's dynamic VRAM too, where the node loads the model again.

Offload's DIFFUSION_MODEL wrapper (host/offload.py) runs inside the compiled forward. The session state it read
there (`started`, the call count) became guards, and the next step compiled the whole model again: Wan 2.1 14B
on the H200 (ComfyUI 0.3.75) took 109 s, 107 s, then 1.95 s for its 3 steps. tests/test_compile.py covers the
layers, the attention router and the streamer under compile alone.
"""
import json
import subprocess

import pytest

from comfy_harness import PACK_ROOT
from cpu_sampling import CPU_SAMPLING

pytestmark = [pytest.mark.integration]

PROBE = r"""
import json, os, sys, types
pack_root, unet, kind, text_dim, dynamic = sys.argv[1], sys.argv[2], "wan", 4096, sys.argv[4] == "dynamic"
sys.path.insert(0, os.getcwd())
if dynamic:
    import comfy_aimdo.control
    assert comfy_aimdo.control.init(), "comfy-aimdo's library did not load"  # before its modules bind it
from comfy.cli_args import args
args.cpu = True
args.use_pytorch_cross_attention = True  # as on a GPU (ComfyUI's CPU attention breaks the graph on its own)
import torch
import comfy.model_patcher, folder_paths, nodes
from comfy_extras.nodes_torch_compile import TorchCompileModel
from torch._dynamo.utils import counters, guard_failures
pkg = types.ModuleType("bigdit"); pkg.__path__ = [pack_root]; sys.modules["bigdit"] = pkg
from bigdit.host.loading import load_checkpoint
from bigdit.quant.linear import QuantLinear
exec(sys.argv[3])  # tests/cpu_sampling.py: sample, on_cpu_dynamic
if dynamic:  # the patcher upstream makes for a GPU under dynamic VRAM, retargeted to the CPU
    comfy.model_patcher.CoreModelPatcher = lambda model, load_device, offload_device: on_cpu_dynamic(model)
folder_paths.add_model_folder_path("diffusion_models", os.path.dirname(unet))
loaded = load_checkpoint("LoadH3Quantized", "diffusion_models", os.path.basename(unet),
                         quantization="float8_e4m3fn", offload_input="auto")[0]
# inductor needs a C compiler; aot_eager traces and guards alike. Under dynamic VRAM the node's clone is a plain
# patcher of a model loaded again by the loader's factory (clone(disable_dynamic=True)).
compiled = TorchCompileModel.execute(loaded, "aot_eager").args[0]
graphs = []  # graphs compiled so far, after each model call
apply_model = compiled.model.apply_model
def counting(*a, **k):
    out = apply_model(*a, **k)
    graphs.append(counters["stats"]["unique_graphs"])
    return out
compiled.model.apply_model = counting
runs = [sample(compiled), sample(compiled)]
del compiled.model.apply_model
reference = sample(loaded)
print(json.dumps({"graphs": graphs, "guard_failures": [str(r) for rs in guard_failures.values() for r in rs],
                  "equal": all(torch.equal(g, r) for run in runs for g, r in zip(run, reference)),
                  "dynamic": [getattr(p, "is_dynamic", lambda: False)() for p in (loaded, compiled)],
                  "own_model": compiled.model is not loaded.model,
                  "quantized": [sum(isinstance(m, QuantLinear) for m in p.model.modules()) for p in (loaded, compiled)]}))
"""


def run(comfy, tiny_wan, mode=""):
    result = subprocess.run([str(comfy.host.python), "-c", PROBE, str(PACK_ROOT), str(tiny_wan["path"]),
                             CPU_SAMPLING, mode], cwd=comfy.host.comfyui, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    return json.loads(result.stdout.strip().splitlines()[-1])


def test_loaded_model_under_comfys_torch_compile_compiles_once(comfy, tiny_wan):
    """Two samplings of 3 steps: one graph from the first call on, no guard failed, the latents equal eager's."""
    out = run(comfy, tiny_wan)
    assert len(out["graphs"]) == 6 and out["graphs"][0] >= 1, out
    assert out["graphs"] == out["graphs"][:1] * 6 and not out["guard_failures"], out
    assert out["equal"], out
    assert out["dynamic"] == [False, False] and not out["own_model"], out  # the node's clone shares the model


@pytest.mark.host_feature("dynamic_vram")
def test_under_dynamic_vram_the_node_gets_the_model_loaded_again_without_it(comfy, tiny_wan):
    """Upstream's TorchCompileModel clones a dynamic-VRAM model with `disable_dynamic=True`, which loads it again
    through the loader's `cached_patcher_init` factory: the pack's loaders leave theirs (on the H200 it failed
    with "Cannot create non-dynamic delegate"). The clone's model is quantized as the node asked, compiles
    once, and samples the latent of the dynamic model it came from."""
    out = run(comfy, tiny_wan, "dynamic")
    assert out["dynamic"] == [True, False] and out["own_model"], out
    assert out["quantized"][0] > 0 and out["quantized"][1] == out["quantized"][0], out
    assert len(out["graphs"]) == 6 and out["graphs"] == out["graphs"][:1] * 6 and not out["guard_failures"], out
    assert out["equal"], out
