"""A model from LoadH3Quantized under ComfyUI's own TorchCompileModel, sampled through its KSampler path on CPU:
compiled once, at the first step.

Offload's DIFFUSION_MODEL wrapper (nodes/offload.py) runs inside the compiled forward. The session state it read
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
pack_root, unet, kind, text_dim = sys.argv[1], sys.argv[2], "wan", 4096
sys.path.insert(0, os.getcwd())
from comfy.cli_args import args
args.cpu = True
args.use_pytorch_cross_attention = True  # as on a GPU (ComfyUI's CPU attention breaks the graph on its own)
import torch
import comfy.model_patcher, folder_paths, nodes
from comfy_extras.nodes_torch_compile import TorchCompileModel
from torch._dynamo.utils import counters, guard_failures
pkg = types.ModuleType("bigdit"); pkg.__path__ = [pack_root]; sys.modules["bigdit"] = pkg
from bigdit.nodes.loading import load_checkpoint
exec(sys.argv[3])  # tests/cpu_sampling.py: sample
folder_paths.add_model_folder_path("diffusion_models", os.path.dirname(unet))
loaded = load_checkpoint("LoadH3Quantized", "diffusion_models", os.path.basename(unet),
                         quantization="float8_e4m3fn", offload_input="auto")[0]
# inductor needs a C compiler; aot_eager traces and guards alike
compiled = TorchCompileModel.execute(loaded, "aot_eager").args[0]
graphs = []  # graphs compiled so far, after each model call
apply_model = loaded.model.apply_model
def counting(*a, **k):
    out = apply_model(*a, **k)
    graphs.append(counters["stats"]["unique_graphs"])
    return out
loaded.model.apply_model = counting
runs = [sample(compiled), sample(compiled)]
loaded.model.apply_model = apply_model
reference = sample(loaded)
print(json.dumps({"graphs": graphs, "guard_failures": [str(r) for rs in guard_failures.values() for r in rs],
                  "equal": all(torch.equal(g, r) for run in runs for g, r in zip(run, reference))}))
"""


def test_loaded_model_under_comfys_torch_compile_compiles_once(comfy, tiny_wan):
    """Two samplings of 3 steps: one graph from the first call on, no guard failed, the latents equal eager's."""
    result = subprocess.run([str(comfy.host.python), "-c", PROBE, str(PACK_ROOT), str(tiny_wan["path"]),
                             CPU_SAMPLING], cwd=comfy.host.comfyui, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    out = json.loads(result.stdout.strip().splitlines()[-1])
    assert len(out["graphs"]) == 6 and out["graphs"][0] >= 1, out
    assert out["graphs"] == out["graphs"][:1] * 6 and not out["guard_failures"], out
    assert out["equal"], out
