"""Host memory while LoadH3Quantized quantizes a model as it loads, and after the model sampled, in a real
ComfyUI on each host (issue 19, item 3).

The server loads a 230 MB bf16 Wan with wide layers (6 blocks, dim 1024, ffn 4096) through LoadH3Quantized
(float8_e4m3fn, on the CPU) and samples it. Before, a prompt of the tiny Wan runs the same path once
(imports and first calls are not measured), and the test node BigditHostMemory has glibc's heap give its
free pages back; the test then reads the server's resident set from /proc/<pid>/status (the baseline) and
resets its peak there. BigditHostMemory reads it after the loader and after the sampler (the peak, and what
is held once the heap's free pages went back): anonymous memory and mapped file pages alike. The budget, against the bytes of the loaded model's weights
(model_size: the FP8 layers, and the layers kept in full precision at the dtype ComfyUI computes in, fp32
on the CPU):

    loading, the peak:         peak - baseline <= 1.25 x weights + ALLOWANCE
    sampling, what it holds:   resident after sampling - baseline <= 1.10 x weights + ALLOWANCE

ALLOWANCE is fixed, 96 MiB: quantizing one layer on the CPU makes fp32 temporaries of it (the widest here,
4096 x 1024, is 16 MiB in fp32), and ComfyUI builds the model's other modules and runs the sampler.
Measured on both hosts: loading peaks at about +160 MiB and holds +123 MiB after it for 127 MiB of
weights. A loader that keeps the file's pages it read holds the whole file beside the weights (here
+1.8x the weights, for MiniMax-H3 in FP8 +1.9x), and fails the first bound. During sampling on the CPU each
model call also dequantizes a layer to fp32 (the widest: two 16 MiB temporaries, which glibc's heap then
keeps for the next calls); the in-call peak is printed, not bounded: on a GPU these are device memory,
and the benchmark (tests/bench/comfy_e2e.py host_rss_sampling_gib) measures the host there.
"""
import json

import pytest

from tiny_models import make_tiny_wan

pytestmark = pytest.mark.integration

MIB = 2 ** 20
ALLOWANCE = 96 * MIB
LOAD_RATIO, SAMPLING_RATIO = 1.25, 1.10
WIDE = {"num_layers": 6, "num_heads": 8, "dim": 1024, "ffn_dim": 4096}


def resident(pid) -> int:
    with open(f"/proc/{pid}/status") as f:
        fields = dict(line.split(":", 1) for line in f if ":" in line)
    return int(fields["VmRSS"].split()[0]) * 1024


def graph(unet_name) -> dict:
    return {
        "unet": {"class_type": "LoadH3Quantized", "inputs": {
            "unet_name": unet_name, "quantization": "float8_e4m3fn", "offload": "none"}},
        "loaded": {"class_type": "BigditHostMemory", "inputs": {"model": ["unet", 0]}},
        "cond": {"class_type": "BigditZeroConditioning", "inputs": {"length": 8}},
        "latent": {"class_type": "EmptyHunyuanLatentVideo",
                   "inputs": {"width": 64, "height": 64, "length": 1, "batch_size": 1}},
        "sampler": {"class_type": "KSampler", "inputs": {
            "model": ["loaded", 0], "seed": 0, "steps": 2, "cfg": 1.0, "sampler_name": "euler",
            "scheduler": "simple", "denoise": 1.0, "positive": ["cond", 0], "negative": ["cond", 0],
            "latent_image": ["latent", 0]}},
        # the model held until it runs (ComfyUI would drop it once the sampler is done)
        "sampled": {"class_type": "BigditHostMemory", "inputs": {"model": ["loaded", 0], "samples": ["sampler", 0]}},
    }


@pytest.fixture(scope="module")
def wide_wan(comfy):
    path = make_tiny_wan(comfy.models_dir / "diffusion_models" / "wide_wan.safetensors", host=comfy.host, **WIDE)
    yield path
    path.unlink()


def test_quantizing_while_loading_holds_one_copy_of_the_model(comfy, tiny_wan, wide_wan):
    comfy.run(graph(tiny_wan["unet_name"]))
    comfy.run({"probe": {"class_type": "BigditHostMemory", "inputs": {}}})
    baseline, start = resident(comfy.pid), len(comfy.log_text())
    with open(f"/proc/{comfy.pid}/clear_refs", "w") as f:
        f.write("5")  # the peak starts again from here
    entry = comfy.run(graph(wide_wan.name), timeout=300)
    loaded, sampled = (json.loads(entry["outputs"][node]["text"][0]) for node in ("loaded", "sampled"))
    weights = loaded["model_bytes"]
    assert weights < 0.7 * wide_wan.stat().st_size  # quantized: the file's pages would not fit the budget
    load_peak, held = loaded["peak"] - baseline, sampled["rss"] - baseline
    detail = (f"weights {weights / MIB:.0f} MiB, file {wide_wan.stat().st_size / MIB:.0f} MiB; loading peak "
              f"+{load_peak / MIB:.0f} MiB (after it +{(loaded['rss'] - baseline) / MIB:.0f}, file pages "
              f"{loaded['file'] / MIB:.0f} MiB); after sampling +{held / MIB:.0f} MiB (peak in a model call "
              f"+{(sampled['peak'] - baseline) / MIB:.0f}); baseline {baseline / MIB:.0f} MiB")
    print(detail)
    assert load_peak <= LOAD_RATIO * weights + ALLOWANCE, detail
    assert held <= SAMPLING_RATIO * weights + ALLOWANCE, detail
    log = comfy.log_text()[start:]
    assert "gave back the file's pages as its tensors were consumed" in log, log[-3000:]
