"""SetVAEKernels on real hosts, over HTTP.

MiniMax-H3 (upstream 0.33.0): a tiny video VAE built by upstream's own class (tests/tiny_models.make_tiny_h3_vae:
a 1-block ViT decoder of 4 heads of 64, its block linears INT8 ConvRot as in Comfy-Org's file), loaded by
BigditTinyVAELoader through comfy.sd.VAE, decodes one latent through the host's VAEDecode and through
SetVAEKernels then VAEDecode in one prompt: the pack's INT8 layers, holding the file's tensors, and its attention
router run inside upstream's tiled decode (2 x 2 tiles of 256 pixels, decoded in one batched pass and blended by
upstream's own code), and the frames match the host's within 40 dB PSNR (measured on CPU: 131 dB, float rounding only: both sides run comfy-kitchen's eager INT8 linear there).
A third decode by the host's VAE after ours gives its first frames exactly: the input VAE and its model are as
they were.

Wan 2.1 (both hosts): its VAE has nothing the pack runs, and passes through unchanged.

The batches of host/vae.py's `_decode_batches` (both hosts, in the host's python, on CPU): each tile's pixels come back in order
as that tile decoded alone gives them, tiles of more than one shape go one by one, and a batch the card cannot hold
(a decoder raising torch.OutOfMemoryError past a batch size) is halved until it fits, a single tile that does not
fit failing as the decode would. Asking the host for a decode's room (`ask_room`) keeps the VAE's own model loaded
with its patches, where the host's own free_memory would unload it.
"""
import json
import math
import re
import subprocess

import pytest
import safetensors.torch
import torch

from comfy_harness import PACK_ROOT
from tiny_models import make_tiny_h3_vae

pytestmark = pytest.mark.integration

H3_LATENT = (1, 24, 7, 20, 20)  # 320 x 320 pixels: 2 x 2 tiles; 7 latent frames: one temporal chunk, 22 frames
WAN_LATENT = (1, 16, 2, 8, 8)
MIN_PSNR_DB = 40.0
KERNELS = {"attention": "auto", "linears": "pack", "weights": "resident"}


def psnr(ours: torch.Tensor, reference: torch.Tensor) -> float:
    """PSNR in dB of frames in [0, 1] against the reference."""
    mse = (ours.float() - reference.float()).pow(2).mean().item()
    return math.inf if mse == 0 else 10 * math.log10(1 / mse)


def write_latent(comfy, name, shape, seed=0) -> str:
    """A latent file in the server's input folder, as LoadLatent reads it (version 0: no SD scaling)."""
    folder = comfy.base_dir / "input"
    folder.mkdir(exist_ok=True)
    samples = torch.randn(shape, generator=torch.Generator().manual_seed(seed))
    safetensors.torch.save_file({"latent_tensor": samples, "latent_format_version_0": torch.tensor([])},
                                str(folder / name))
    return name


def decodes(vae_node, latent_name, kernels=None) -> dict:
    """The graph: the host's decode (`host`), the decode through SetVAEKernels (`ours`), and the host's again
    once ours ran (`host_after`), each saved as float frames."""
    def decode(key, vae, samples):
        return {f"decode_{key}": {"class_type": "VAEDecode", "inputs": {"samples": samples, "vae": vae}},
                f"save_{key}": {"class_type": "BigditSaveImages", "inputs": {"images": [f"decode_{key}", 0],
                                                                              "name": key}}}
    graph = {"vae": vae_node, "latent": {"class_type": "LoadLatent", "inputs": {"latent": latent_name}},
             "kernels": {"class_type": "SetVAEKernels", "inputs": {"vae": ["vae", 0], **(kernels or KERNELS)}},
             "after": {"class_type": "BigditLatentAfter", "inputs": {"samples": ["latent", 0],
                                                                      "after": ["decode_ours", 0]}}}
    graph.update(decode("host", ["vae", 0], ["latent", 0]))
    graph.update(decode("ours", ["kernels", 0], ["latent", 0]))
    graph.update(decode("host_after", ["vae", 0], ["after", 0]))
    return graph


def frames(comfy, history, key) -> torch.Tensor:
    (path,) = comfy.output_files(history, f"save_{key}", "tensors")
    return safetensors.torch.load_file(str(path))["images"]


@pytest.fixture(scope="module")
def tiny_h3_vae(comfy):
    if reason := comfy.host.lacks("minimax_h3"):
        pytest.skip(reason)
    name = "tiny_h3_video_vae_int8_convrot.safetensors"
    make_tiny_h3_vae(comfy.models_dir / "vae" / name, host=comfy.host)
    return name


@pytest.mark.host_feature("minimax_h3")
def test_h3_decode_on_the_packs_kernels_matches_the_hosts(comfy, tiny_h3_vae):
    latent = write_latent(comfy, "h3.latent", H3_LATENT)
    start = len(comfy.log_text())
    history = comfy.run(decodes({"class_type": "BigditTinyVAELoader", "inputs": {"vae_name": tiny_h3_vae}}, latent))
    log = comfy.log_text()[start:]
    host, ours, host_after = (frames(comfy, history, key) for key in ("host", "ours", "host_after"))
    assert ours.shape == host.shape == (22, 320, 320, 3)
    assert psnr(ours, host) >= MIN_PSNR_DB, psnr(ours, host)
    assert torch.equal(host_after, host)
    text = history["outputs"]["kernels"]["text"][0]
    assert text.splitlines() == ["linears: 4 on the pack's kernels (int8_convrot x4, holding the file's tensors)",
                                 "attention: backend auto, dense auto",
                                 "weights: on the CPU (ComfyUI's VAE device)",
                                 "tiles: decoded in batches, all of a call's at once on cpu"], text
    # the 4 tiles in one batched pass: the 4 layers ran, and the decoder's one attention went through the router
    (line,) = re.findall(r"\[BigDiT\] SetVAEKernels: decode of \[1, 24, 7, 20, 20\]: .*", log)
    # the INT8 calls on CPU are kitchen's (the pack's Triton kernels want CUDA): one per layer in the one pass
    assert "weights on cpu; tiles 4 in 1 pass; ran 4/4 quantized layers; ran int8: kitchen x4 calls; attention ran " \
           "auto:sdpa x1; fallbacks none" in line, line


@pytest.mark.host_feature("minimax_h3")
def test_h3_decode_with_everything_left_to_the_host_passes_through(comfy, tiny_h3_vae):
    latent = write_latent(comfy, "h3.latent", H3_LATENT)
    host_only = {"attention": "host", "linears": "host", "weights": "host", "tiles": "host"}
    history = comfy.run(decodes({"class_type": "BigditTinyVAELoader", "inputs": {"vae_name": tiny_h3_vae}}, latent,
                                host_only))
    assert torch.equal(frames(comfy, history, "ours"), frames(comfy, history, "host"))
    assert history["outputs"]["kernels"]["text"][0] == (
        "passed through unchanged (MiniMaxH3VideoVAE: linears left to ComfyUI; attention left to ComfyUI; tiles left "
        "to ComfyUI)")


@pytest.mark.host_feature("minimax_h3")
def test_h3_tiles_batched_on_the_hosts_layers_match_its_decode(comfy, tiny_h3_vae):
    """Only the tiles batched: ComfyUI's own layers and attention decode the 4 tiles in one pass, and its own
    tiled decode blends them into the same frames."""
    latent = write_latent(comfy, "h3.latent", H3_LATENT)
    tiles_only = {"attention": "host", "linears": "host", "weights": "host", "tiles": "batched"}
    start = len(comfy.log_text())
    history = comfy.run(decodes({"class_type": "BigditTinyVAELoader", "inputs": {"vae_name": tiny_h3_vae}}, latent,
                                tiles_only))
    ours, host = frames(comfy, history, "ours"), frames(comfy, history, "host")
    assert ours.shape == host.shape == (22, 320, 320, 3)
    assert psnr(ours, host) >= MIN_PSNR_DB, psnr(ours, host)
    assert torch.equal(frames(comfy, history, "host_after"), host)
    (line,) = re.findall(r"\[BigDiT\] SetVAEKernels: decode of \[1, 24, 7, 20, 20\]: .*", comfy.log_text()[start:])
    assert line.endswith("; weights placed by ComfyUI; tiles 4 in 1 pass"), line


def test_wans_vae_passes_through_unchanged(comfy, tiny_vae):
    latent = write_latent(comfy, "wan.latent", WAN_LATENT)
    history = comfy.run(decodes({"class_type": "VAELoader", "inputs": {"vae_name": tiny_vae}}, latent))
    assert torch.equal(frames(comfy, history, "ours"), frames(comfy, history, "host"))
    assert history["outputs"]["kernels"]["text"][0] == (
        "passed through unchanged (WanVAE: no layer stored quantized; no ComfyUI attention function the pack routes; "
        "no tiles the pack batches)")


BATCHES_PROBE = r"""
import json, os, sys, types
sys.path.insert(0, os.getcwd())
from comfy.cli_args import args
args.cpu = True
import torch
pkg = types.ModuleType("bigdit"); pkg.__path__ = [sys.argv[1]]; sys.modules["bigdit"] = pkg
from bigdit.host.vae import TileCount, _decode_batches


def decoder(limit=None, calls=None):  # each tile's pixels a function of that tile alone
    def decode(z):
        calls is None or calls.append(z.shape[0])
        if limit is not None and z.shape[0] > limit:
            raise torch.OutOfMemoryError("out of memory (test)")
        return torch.tanh(z.repeat_interleave(4, dim=-1)) * 2
    return decode


z = torch.randn(1, 3, 2, 6, 28, generator=torch.Generator().manual_seed(0))
tiles = [z[..., 4 * i:4 * i + 4] for i in range(7)]
res = {}
for name, limit in (("all", None), ("limit 2", 2)):
    count, calls = TileCount(), []
    out = _decode_batches(decoder(limit, calls), tiles, count)
    res[name] = {"calls": calls, "in_order": len(out) == 7 and all(torch.equal(o, decoder()(t)) for o, t in zip(out, tiles)),
                 "count": [count.tiles, count.passes, count.alone], "line": count.render()}
count, calls = TileCount(), []
mixed = tiles[:3] + [z[..., 12:20]]  # a tile of another shape: no batch
out = _decode_batches(decoder(None, calls), mixed, count)
res["mixed"] = {"calls": calls, "in_order": all(torch.equal(o, decoder()(t)) for o, t in zip(out, mixed)),
                "count": [count.tiles, count.passes, count.alone]}
try:
    _decode_batches(decoder(0), tiles[:1], TileCount())
    res["one too big"] = "decoded"
except torch.OutOfMemoryError:
    res["one too big"] = "out of memory"
print(json.dumps(res))
"""


def test_tile_batches_keep_their_order_and_halve_where_the_card_cannot_hold_them(comfy):
    result = subprocess.run([str(comfy.host.python), "-c", BATCHES_PROBE, str(PACK_ROOT)], cwd=comfy.host.comfyui,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-4000:]
    res = json.loads(result.stdout.strip().splitlines()[-1])
    # on the CPU, a call's tiles go through at once
    assert res["all"] == {"calls": [7], "in_order": True, "count": [7, 1, 0], "line": "tiles 7 in 1 pass"}, res
    # 7 fail, 3 fail, then batches of at most 1 after a halving to 1 (3 // 2): every tile alone
    limited = res["limit 2"]
    assert limited["calls"] == [7, 3, 1, 1, 1, 1, 1, 1, 1] and limited["in_order"], res
    assert limited["count"] == [7, 7, 0] and limited["line"] == "tiles 7 in 7 passes", res
    assert res["mixed"] == {"calls": [1, 1, 1, 1], "in_order": True, "count": [4, 4, 0]}, res
    assert res["one too big"] == "out of memory", res


KEEP_PROBE = r"""
import json, os, sys, types
sys.path.insert(0, os.getcwd())
from comfy.cli_args import args
args.cpu = True
import torch
import comfy.model_management as mm
import comfy.model_patcher
pkg = types.ModuleType("bigdit"); pkg.__path__ = [sys.argv[1]]; sys.modules["bigdit"] = pkg
from bigdit.host.vae import ask_room

device = torch.device("cpu")
ours, other = torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)


def loaded(module):
    patcher = comfy.model_patcher.ModelPatcher(module, load_device=device, offload_device=device)
    patcher.add_object_patch("weight", torch.nn.Parameter(torch.zeros(4, 4), requires_grad=False))
    mm.load_models_gpu([patcher])
    return patcher


def state(patcher, module):
    return {"loaded": any(m.model is patcher for m in mm.current_loaded_models),
            "patched": bool((module.weight == 0).all())}


vae, sampled = loaded(ours), loaded(other)
res = {"before": [state(vae, ours), state(sampled, other)]}
res["room"] = ask_room(vae, 1 << 60, device) == mm.get_free_memory(device)  # more than there is: all that may go
res["keeping"] = [state(vae, ours), state(sampled, other)]
mm.free_memory(1 << 60, device)  # the host's own call, as the decode made it before
res["host"] = [state(vae, ours)]


class Dynamic:  # a patcher under dynamic VRAM (comfy-aimdo, which needs a GPU): its own count of the free bytes
    def is_dynamic(self):
        return True

    def get_free_memory(self, device):
        return 12345


asked = []
mm.free_memory = lambda required, device, keep_loaded=[], **kwargs: asked.append((required, kwargs))
res["dynamic"] = {"room": ask_room(Dynamic(), 99, device), "asked": asked}
print(json.dumps(res))
"""


def test_asking_the_host_for_room_keeps_the_decoding_vaes_model_and_its_patches(comfy):
    """ask_room (host/vae.py) in the host's python, on CPU: with two models loaded, each with an object patch (as
    SetVAEKernels installs the pack's layers), an ask for more memory than there is unloads the other one and keeps
    the VAE's, patches applied, and gives ComfyUI's free memory; the host's plain free_memory, which the decode
    called before, unloads the VAE's too and puts its original weight back. A patcher under dynamic VRAM is asked for
    with `for_dynamic` (no dynamic model unloaded whole, as ComfyUI's own decode asks) and its room is its own
    count."""
    result = subprocess.run([str(comfy.host.python), "-c", KEEP_PROBE, str(PACK_ROOT)], cwd=comfy.host.comfyui,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-4000:]
    res = json.loads(result.stdout.strip().splitlines()[-1])
    both = {"loaded": True, "patched": True}
    assert res["before"] == [both, both], res
    assert res["keeping"] == [both, {"loaded": False, "patched": False}], res
    assert res["room"] is True, res
    assert res["host"] == [{"loaded": False, "patched": False}], res
    assert res["dynamic"] == {"room": 12345, "asked": [[99, {"for_dynamic": True}]]}, res
