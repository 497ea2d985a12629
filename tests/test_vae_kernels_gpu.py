"""SetVAEKernels on a GPU under upstream ComfyUI's real dynamic VRAM, against the host's own decode.

Upstream's MiniMax-H3 video VAE with real-size decoder blocks (2 of the 36: 32 heads of 64, the block linears
INT8 ConvRot as in Comfy-Org's file; random weights, tests/bench/e2e_models.py) decodes a [1, 24, 12, 16, 32]
latent (39 frames of 256 x 512: two temporal chunks of three 256-pixel tiles) in a subprocess in this python, with
upstream's ComfyUI folder as its working directory ($BIGDIT_COMFYUI, else the test cache's comfyui-0.33.0) and
dynamic VRAM switched on as upstream's main.py does. The host's decode (its INT8 layers, PyTorch attention, its
paging) is the reference; the pack's (host.vae.set_vae_kernels: the pack's INT8 kernels, the router with `sdpa`
and with `auto`, the weights resident) must come within 40 dB PSNR of it, its weights resident on the card, its
8 INT8 layers and its attention run; with the weights left to ComfyUI, or where the card reports no room for them
(its free memory read as 0), ComfyUI's paging runs them and says so; with the tiles batched (the default) a temporal
chunk's 3 tiles take 2 decoder passes (one tile alone, its peak memory measured, then the other two), one per
tile where the card reports no room; the host's VAE decodes as before afterwards. Timings are printed (-s), not
checked: the stage's speed is the whole-job benchmark's (tests/bench/whole_job.py).

    BIGDIT_COMFYUI=<upstream 0.33.0> PYTHONPATH=<its site-packages with comfy-aimdo> python -m pytest -m gpu -s \
        tests/test_vae_kernels_gpu.py
"""
import dataclasses
import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from comfy_harness import DECODE_PROBE_HELPERS, DYNAMIC_VRAM_PRELUDE, PACK_ROOT, TESTS_DIR, cache_dir

sys.path.insert(0, str(TESTS_DIR / "bench"))
import e2e_models  # noqa: E402

COMFYUI = Path(os.environ.get("BIGDIT_COMFYUI") or cache_dir() / "comfyui-0.33.0")
LATENT = (1, 24, 12, 16, 32)
DECODER = {"num_layers": 2, "heads": 32, "dim_head": 64}  # H3's blocks at their size, 2 of its 36
MIN_PSNR_DB = 40.0


def _missing() -> str | None:
    if not torch.cuda.is_available():
        return "needs a CUDA GPU"
    source = COMFYUI / "comfy" / "ldm" / "minimax" / "vae.py"
    if not source.exists() or "class ModelPatcherDynamic" not in (COMFYUI / "comfy" / "model_patcher.py").read_text():
        return f"no ComfyUI with MiniMax-H3 and dynamic VRAM at {COMFYUI} (set BIGDIT_COMFYUI)"
    if importlib.util.find_spec("comfy_aimdo") is None:
        return "comfy-aimdo is not importable (put upstream's site-packages on PYTHONPATH)"
    return None


pytestmark = [pytest.mark.gpu, pytest.mark.skipif(_missing() is not None, reason=str(_missing()))]

PROBE = DYNAMIC_VRAM_PRELUDE + DECODE_PROBE_HELPERS + r"""
import json, logging
tests_dir, vae_path, shape = sys.argv[2], sys.argv[3], json.loads(sys.argv[4])
import comfy.sd, comfy.utils
sys.path.insert(0, os.path.join(tests_dir, "fixtures", "bigdit_testnodes"))
import tiny_vae
from bigdit.host.vae import set_vae_kernels

lines = []
class Keep(logging.Handler):
    def emit(self, record):
        lines.append(record.getMessage())
logger = logging.getLogger("bigdit.host.vae")
logger.addHandler(Keep())
logger.setLevel(logging.INFO)

torch.set_grad_enabled(False)  # as under ComfyUI's executor (inference mode)
sd, metadata = comfy.utils.load_torch_file(vae_path, return_metadata=True)
with tiny_vae.tiny_classes(json.loads(metadata["bigdit_tiny_vae"])):
    vae = comfy.sd.VAE(sd=sd, metadata=metadata)
assert vae.patcher.is_dynamic(), type(vae.patcher)
z = torch.randn(shape, generator=torch.Generator().manual_seed(0))


res = {"frames": list(timed(vae.decode, z)[0].shape), "runs": {}}  # the first decode pages the weights in
host, res["host_s"] = timed(vae.decode, z)
for attention, weights, tiles in (("sdpa", "resident", "batched"), ("auto", "resident", "batched"),
                                 ("auto", "resident", "host"), ("auto", "host", "batched")):
    ours_vae = set_vae_kernels(vae, attention, "pack", weights, tiles=tiles)[0]
    timed(ours_vae.decode, z)  # the first decode measures the kernels of each shape
    ours, seconds = timed(ours_vae.decode, z)
    res["runs"][f"{attention}/{weights}/{tiles}"] = {"s": seconds, "psnr": psnr(ours, host), "line": lines[-1]}
# a card with no room for the resident weights, as ComfyUI and comfy-aimdo count it: ComfyUI's paging stays
ours_vae = set_vae_kernels(vae, "auto", "pack", "resident")[0]
free_memory, patcher_free = mm.get_free_memory, type(ours_vae.patcher).get_free_memory
mm.get_free_memory = lambda *args, torch_free_too=False, **kwargs: (0, 0) if torch_free_too else 0
type(ours_vae.patcher).get_free_memory = lambda self, device: 0
try:
    ours, seconds = timed(ours_vae.decode, z)
finally:
    mm.get_free_memory, type(ours_vae.patcher).get_free_memory = free_memory, patcher_free
res["runs"]["auto/resident/batched, no room"] = {"s": seconds, "psnr": psnr(ours, host), "line": lines[-1]}
host_after, _ = timed(vae.decode, z)
res["host_after_max_diff"] = (host_after.float() - host.float()).abs().max().item()
print(json.dumps(res))
"""


def test_the_packs_decode_matches_the_hosts_with_resident_weights(tmp_path):
    vae = tmp_path / "h3_video_vae_2_blocks.safetensors"
    component = e2e_models.COMPONENTS["tiny_video_vae"]
    component = dataclasses.replace(component, tiny={**component.tiny, "video_decoder": DECODER})
    e2e_models.generate_component(component, vae, COMFYUI)
    result = subprocess.run([sys.executable, "-c", PROBE, str(PACK_ROOT), str(TESTS_DIR), str(vae),
                             json.dumps(LATENT)], cwd=COMFYUI, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-8000:]
    res = json.loads(result.stdout.strip().splitlines()[-1])
    print(json.dumps(res, indent=1))
    assert res["frames"] == [1, 39, 256, 512, 3], res
    placed = {"sdpa/resident/batched": "; weights resident on cuda", "auto/resident/batched": "; weights resident on cuda",
              "auto/resident/host": "; weights resident on cuda", "auto/host/batched": "; weights placed by ComfyUI;",
              "auto/resident/batched, no room": "; weights paged by ComfyUI: "}
    assert set(res["runs"]) == set(placed), res
    for name, run in res["runs"].items():
        assert run["psnr"] >= MIN_PSNR_DB, (name, run)
        assert "ran 8/8 quantized layers" in run["line"] and "attention ran " in run["line"], (name, run)
        assert placed[name] in run["line"], (name, run)
        # two temporal chunks of 3 tiles: batched, each chunk's first tile alone (its peak measured), then the rest
        # in one pass while the card has room; the host's way, one pass per tile and no count
        if "/batched" in name:
            assert re.search(r"; tiles 6 in [2-6] pass(es)?;", run["line"]), (name, run)
        else:
            assert "; tiles " not in run["line"], (name, run)
    assert "; tiles 6 in 4 passes;" in res["runs"]["auto/resident/batched"]["line"], res
    assert res["host_after_max_diff"] < 1e-5, res  # the input VAE decodes as it did: its model is as it was
