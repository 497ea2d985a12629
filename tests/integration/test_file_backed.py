"""Quantized weights ComfyUI pages from a file, as from its own files (issue 19, item 3; host/file_backed.py).

Under upstream's dynamic VRAM the host copies a layer's weight into its own pinned memory, reading the
model file, so a loader's quantized weights in process memory would be held twice. `back_with_file`
writes them to a scratch file and loads them back with ComfyUI's own loader. Here, with upstream's real
loader (comfy.utils.load_torch_file with comfy-aimdo's file map, switched on as main.py switches it on for
a GPU) and its real `ModelPatcherDynamic`, retargeted to the CPU as tests/integration/
test_constrained_load.py does, a tiny model quantized in place (int8_convrot, group 16):
- every QuantLinear's weight and bias, and every plain cast layer's, end up mapped from the file, the
  process memory they held is freed (no reference left), and the scratch file is unlinked;
- 3 euler steps through ComfyUI's KSampler path give the same latent, bit for bit, as the same quantized
  weights held in RAM (with the file's data 40 bytes off a cache line they did not: 4.5e-7 apart, CPU
  kernels take another path; loaders/safetensors_writer.py aligns it);
- with a temp folder that cannot be made, the model keeps its tensors and the report line says why.
A file the loader keeps as stored (a marker file, through loaders.load as MixedCheckpointLoader runs it)
needs no scratch file: every paged tensor is marked as a slice of the model file, as ComfyUI's loader marks
its own, the host's own reader (comfy.memory_management.read_tensor_file_slice_into) reads each one's bytes
back from the file, nothing is written, and the latent equals the same file's loaded without file paging.
The pinned copies themselves (what the host does on a GPU) are measured by tests/bench/comfy_e2e.py
(host_rss_peak_gib, host_rss_sampling_gib).
"""
import json
import subprocess

import pytest

from checkpoint_files import write_markers
from comfy_harness import PACK_ROOT
from cpu_sampling import CPU_SAMPLING

pytestmark = [pytest.mark.integration]

# both probes: upstream's ComfyUI on the CPU with comfy-aimdo loaded, the pack importable as `bigdit`, and
# tests/cpu_sampling.py's on_cpu_dynamic, latent and sample
HOST_SETUP = r"""
import gc, json, os, sys, tempfile, types, weakref
pack_root, model_path, kind, text_dim = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
sys.path.insert(0, os.getcwd())
import comfy_aimdo.control
assert comfy_aimdo.control.init(), "comfy-aimdo's library did not load"
from comfy.cli_args import args
args.cpu = True
import torch
import comfy.memory_management, comfy.model_management, comfy.model_patcher, comfy.sd
import folder_paths, nodes
pkg = types.ModuleType("bigdit"); pkg.__path__ = [pack_root]; sys.modules["bigdit"] = pkg
from bigdit.host.file_backed import back_with_file, paged_tensors
from bigdit.quant.linear import QuantLinear
exec(sys.argv[5])
"""


def run_probe(comfy, probe, model_path, kind, text_dim) -> dict:
    """What a probe (HOST_SETUP first) printed last, run in the host's python in its ComfyUI folder."""
    result = subprocess.run([str(comfy.host.python), "-c", HOST_SETUP + probe, str(PACK_ROOT), str(model_path), kind,
                             str(text_dim), CPU_SAMPLING], cwd=comfy.host.comfyui, capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    return json.loads(result.stdout.strip().splitlines()[-1])


PROBE = r"""
from bigdit.quant import QuantConfig, get_method
from bigdit.host.layers import ComfyQuantLinear
from bigdit.quant.quantize_pass import apply_replacements, quantize_layers
from bigdit.quant.keep import keep_patterns


def quantized():
    patcher = comfy.sd.load_diffusion_model(model_path)
    diffusion = patcher.model.diffusion_model
    for p in diffusion.parameters():  # in process memory, as a quantizing loader leaves them
        p.data = p.data.clone()
    config = QuantConfig(method=get_method("int8_convrot", group_size=16), compute_device=cpu,
                         ignored=keep_patterns([n for n, _ in diffusion.named_modules()], None))
    replacements, _ = quantize_layers(diffusion, config, title="test", layer_type=ComfyQuantLinear)
    apply_replacements(diffusion, replacements)
    return on_cpu_dynamic(patcher.model)


def backed(patcher, temp):
    folder_paths.set_temp_directory(temp)
    comfy.memory_management.aimdo_enabled = True  # the host's loader maps files through comfy-aimdo
    try:
        return back_with_file(patcher, "tiny.safetensors")
    finally:
        comfy.memory_management.aimdo_enabled = False  # sampling here runs the CPU path


out = {}
reference = sample(quantized())
patcher = quantized()
model = patcher.model
paged = paged_tensors(model)
layers = [m for m in model.modules() if isinstance(m, QuantLinear)]
out["quantized_layers"], out["paged"] = len(layers), len(paged)
out["plain_paged"] = sum(not isinstance(m, QuantLinear) for m, _ in paged.values())
held = [weakref.ref(m._parameters[n]) for m, n in paged.values()]
temp = tempfile.mkdtemp()
copies = {k: m._parameters[n].detach().clone() for k, (m, n) in paged.items()}
out["line"] = backed(patcher, temp)
out["same_values"] = all(torch.equal(m._parameters[n], copies[k]) for k, (m, n) in paged.items())
out["aligned"] = all(m._parameters[n].data_ptr() % 64 == 0 for m, n in paged.values())
gc.collect()
out["freed"] = sum(r() is None for r in held)
out["left_in_ram"] = sum(not hasattr(m._parameters[n].untyped_storage(), "_comfy_tensor_file_slice")
                        for m, n in paged_tensors(model).values())
out["files_left"] = os.listdir(temp)
out["from_file"] = all(hasattr(m._parameters[n].untyped_storage(), "_comfy_tensor_file_slice")
                       for m, n in paged.values())
got = sample(patcher)
out["exact"] = all(torch.equal(g, r) for g, r in zip(got, reference))

out["finite"] = all(bool(torch.isfinite(g).all()) for g in got)

failing = quantized()
before = {k: m._parameters[n] for k, (m, n) in paged_tensors(failing.model).items()}
blocker = os.path.join(temp, "not-a-folder")
open(blocker, "w").close()
out["failed_line"] = backed(failing, os.path.join(blocker, "temp"))
out["unchanged"] = all(m._parameters[n] is before[k] for k, (m, n) in paged_tensors(failing.model).items()) \
    and len(paged_tensors(failing.model)) == len(before)
print(json.dumps(out))
"""


def check(comfy, model_path, kind, text_dim):
    out = run_probe(comfy, PROBE, model_path, kind, text_dim)
    assert out["quantized_layers"] > 0 and out["plain_paged"] > 0, out
    assert out["line"] and out["line"].startswith("put the "), out
    assert out["from_file"] and out["left_in_ram"] == 0, out
    assert out["freed"] == out["paged"], out  # the process memory they held is gone
    assert out["files_left"] == [], out  # unlinked once mapped
    assert out["same_values"] and out["aligned"], out  # byte for byte, each on a cache line (as torch allocates)
    assert out["finite"] and out["exact"], out
    assert out["failed_line"].startswith("kept the ") and "NotADirectoryError" in out["failed_line"], out
    assert out["unchanged"], out


@pytest.mark.host_feature("dynamic_vram")
def test_wan_weights_paged_from_a_file(comfy, tiny_wan2):
    check(comfy, tiny_wan2["path"], "wan", 4096)


@pytest.mark.host_feature("dynamic_vram", "minimax_h3")
def test_h3_weights_paged_from_a_file(comfy, tiny_h3):
    check(comfy, tiny_h3["path"], "h3", tiny_h3["text_dim"])


KEPT_AS_STORED = r"""
from bigdit.dtypes import SAFETENSORS_TO_TORCH
from bigdit.loaders.load import LoadOptions, load
from bigdit.host.building import ComfyHost


# the patcher ComfyUI makes for a GPU under dynamic VRAM, which loads the file's tensors with assign=True
comfy.model_patcher.CoreModelPatcher = lambda model, load_device, offload_device: on_cpu_dynamic(model)


def loaded(pages_from_files):
    comfy.memory_management.aimdo_enabled = pages_from_files  # as main.py sets it on a GPU
    try:
        patcher, report = load(model_path, LoadOptions("MixedCheckpointLoader"), cpu, ComfyHost())
        return patcher, back_with_file(patcher, os.path.basename(model_path)), report
    finally:
        comfy.memory_management.aimdo_enabled = False  # sampling here runs the CPU path


out = {}
temp = tempfile.mkdtemp()
folder_paths.set_temp_directory(temp)
reference, _, _ = loaded(False)
patcher, line, report = loaded(True)
out["line"], out["files_left"] = line, os.listdir(temp)
paged = paged_tensors(patcher.model)
out["paged"] = len(paged)
out["quantized_paged"] = sum(isinstance(m, QuantLinear) for m, _ in paged.values())
read_back = []
for module, name in paged.values():
    tensor = module._parameters[name]
    copy = torch.empty_like(tensor)
    read_back.append(comfy.memory_management.read_tensor_file_slice_into(tensor, copy)
                     and torch.equal(copy.view(torch.uint8), tensor.view(torch.uint8)))
out["read_back"] = sum(read_back)
from safetensors import safe_open
with safe_open(model_path, "pt") as f:  # what ComfyUI computes in on a CPU (fp32) is not what the file stores
    stored = {key: SAFETENSORS_TO_TORCH[f.get_slice(key).get_dtype()] for key in f.keys()}
out["not_read_converted"] = all(module._parameters[name].dtype != stored[key.removeprefix("diffusion_model.")]
                                for (key, (module, name)), ok in zip(paged.items(), read_back) if not ok)
out["weights_read_back"] = all(ok for key, ok in zip(paged, read_back) if key.endswith(".weight"))
out["notes"] = report.notes
got, want = sample(patcher), sample(reference)
out["exact"] = all(torch.equal(g, w) for g, w in zip(got, want))
out["finite"] = all(bool(torch.isfinite(g).all()) for g in got)
print(json.dumps(out))
"""

WAN_MARKERS = {f"blocks.{b}.{name}": marker for b in range(2) for name, marker in (
    ("self_attn.q", {"format": "int8_tensorwise", "convrot": True, "convrot_groupsize": 16}),
    ("self_attn.o", {"format": "int8_tensorwise"}), ("ffn.0", {"format": "float8_e4m3fn"}),
    ("ffn.2", {"format": "int8_tensorwise", "convrot": True, "convrot_groupsize": 16}))}


@pytest.mark.host_feature("dynamic_vram")
def test_a_file_kept_as_stored_is_paged_from_itself(comfy, tiny_wan2, tmp_path):
    marked = write_markers(tiny_wan2["path"], tmp_path / "wan2_markers.safetensors", WAN_MARKERS)
    out = run_probe(comfy, KEPT_AS_STORED, marked, "wan", 4096)
    assert out["quantized_paged"] >= len(WAN_MARKERS) and out["paged"] > out["quantized_paged"], out
    # every weight's offset and size are its bytes in the file; a bias converted to the compute dtype is not
    # the file's (ComfyUI computes in fp32 on a CPU) and goes to the scratch file
    assert out["weights_read_back"] and out["not_read_converted"], out
    assert out["read_back"] > out["paged"] // 2, out
    assert out["line"].startswith("ComfyUI pages the "), out
    assert out["files_left"] == [], out
    assert not any("copied" in note for note in out["notes"]), out
    assert out["finite"] and out["exact"], out
