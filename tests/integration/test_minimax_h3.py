"""MiniMax-H3 for real: a tiny H3 built by upstream's own MiniMaxH3Model, run through upstream's H3
nodes (EmptyMiniMaxH3LatentAV, MiniMaxH3SigmaShift, ConditioningZeroOut, Separate AV Latent) and
every pack node, on a ComfyUI with native H3 (skipped elsewhere: "ComfyUI <v> lacks native
MiniMax-H3").

The text conditioning comes from a test node ([1, 8, 512] N(0, 1)): the Qwen3-VL-32B encoder has
a fixed 32B config. The reference is UNETLoader on the bf16 file (computing in fp32 on CPU), 2
euler steps at 64x64, 5 frames: a [1, 24, 2, 4, 4] video and a [1, 32, 2, 8] audio latent. For
scale: an H3 with other random weights lands at a relative L2 distance of about 1.4.
"""
import json
import re

import pytest
import torch

from checkpoint_files import write_kitchen, write_markers
from graphs import add_preview, chain_id, h3_graph, rel_l2

pytestmark = [pytest.mark.integration, pytest.mark.host_feature("minimax_h3")]

VIDEO_SHAPE, AUDIO_SHAPE = (1, 24, 2, 4, 4), (1, 32, 2, 8)
# what the tiny H3 quantizes (13 of its 22 Linears; the rest are kept by default: test_keep_decisions.py)
QUANTIZABLE = [f"{block}.{name}" for block in ("token_refiner.blocks.0", "blocks.0", "blocks.1")
               for name in ("attn.qkv_proj", "attn.out_proj", "mlp.fc1", "mlp.fc2")] + ["condition_proj"]

# Relative L2 distance of both latents from the bf16 baseline, measured on CPU:
# int8_convrot (and auto, INT8 ConvRot on CPU) 0.0024, float8_e4m3fn 0.0082.
ONLINE_TOLERANCE = {"int8_convrot": 0.01, "auto": 0.01, "float8_e4m3fn": 0.03}
# A quantized run must differ from the baseline by more than float noise.
DIFFERS = 1e-4



def run(comfy, tiny_h3, chain=(), loader=None, unet_name=None, extra=None, **kwargs):
    """(video latent, audio latent, history, id of the loader's report preview or None)."""
    graph = h3_graph(unet_name or tiny_h3["unet_name"], tiny_h3["text_dim"], model_chain=list(chain),
                     loader=loader, **kwargs)
    report = add_preview(graph, "unet", 1) if loader and loader[0] != "UNETLoader" else None
    if extra:
        extra(graph)
    history = comfy.run(graph)
    return comfy.latent(history, "save_video"), comfy.latent(history, "save_audio"), history, report


def assert_same(a, b):
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


@pytest.fixture(scope="module")
def baseline(comfy, tiny_h3):
    video, audio, _, _ = run(comfy, tiny_h3)
    return video, audio


def test_upstream_detects_and_runs_the_tiny_h3(comfy, tiny_h3, baseline):
    video, audio = baseline
    assert tuple(video.shape) == VIDEO_SHAPE and tuple(audio.shape) == AUDIO_SHAPE
    assert torch.isfinite(video).all() and torch.isfinite(audio).all()
    start = len(comfy.log_text())
    again = run(comfy, tiny_h3)
    assert "model_type FLOW_AV" in comfy.log_text()[start:]  # upstream's MiniMaxH3 model class
    assert_same(again, baseline)


def h3_loader(quantization, offload, group_size="256", ignored_layers=""):
    return ("LoadH3Quantized", {"unet_name": "tiny_h3.safetensors", "quantization": quantization,
                                "offload": offload, "group_size": group_size, "ignored_layers": ignored_layers})


@pytest.mark.parametrize("quantization", ["int8_convrot", "float8_e4m3fn", "auto", "none"])
def test_load_h3_quantized_against_unetloader(comfy, tiny_h3, baseline, quantization):
    """Each quantization with each offload mode: offload only moves weights, so the two runs of one
    quantization must be bit-identical (which also makes each reproducible)."""
    start = len(comfy.log_text())
    runs = {offload: run(comfy, tiny_h3, loader=h3_loader(quantization, offload))
            for offload in ("none", "auto")}
    if quantization == "auto":  # each layer auto chose is checked at its first real call: all within the bound here
        checked = re.findall(r"last run: ran 13/13 quantized layers; auto's formats on real input: 13 checked "
                             r"\(bound 0\.08\), error up to (0\.\d+); ran int8: \w+ x\d+ calls$",
                             comfy.log_text()[start:], re.M)
        assert len(checked) == 2 and all(float(error) < 0.08 for error in checked), comfy.log_text()[start:][-3000:]
    for offload, (video, audio, history, report_id) in runs.items():
        report = history["outputs"][report_id]["text"][0]
        assert report.splitlines()[0] == ("quantized 0/22 linear layers" if quantization == "none"
                                          else "quantized 13/22 linear layers"), report
        assert re.search(rf"^offload: {offload} on cpu", report, re.M), report
        assert_same(runs[offload][:2], runs["none"][:2])
    video, audio = runs["none"][:2]
    if quantization == "none":
        assert_same((video, audio), baseline)
        return
    for ours, reference in ((video, baseline[0]), (audio, baseline[1])):
        assert DIFFERS < rel_l2(ours, reference) < ONLINE_TOLERANCE[quantization], rel_l2(ours, reference)


def test_h3_blocks_stream_exactly(comfy, tiny_h3):
    """On CPU nothing needs streaming; a 4 MiB budget (SetOffload's vram_gib) makes both INT8 H3
    blocks stream host-to-host through the same hooks as on a GPU, bit-identical to resident."""
    loader = h3_loader("int8_convrot", "none")
    resident = run(comfy, tiny_h3, loader=loader)
    start = len(comfy.log_text())
    streamed = run(comfy, tiny_h3, [("SetOffload", {"mode": "auto", "reserve_gib": 0.0, "vram_gib": 0.004})],
                   loader=loader)
    log = comfy.log_text()[start:]
    assert_same(streamed[:2], resident[:2])
    assert "resident 0/2 blocks, streaming 2; estimated peak" in log, log[-3000:]
    # upstream samples video and audio packed into one [1, 1, N] latent: the plan counts the streams' tokens,
    # 2 x 2 x 2 video patches and 8 audio frames (the packed shape read as one latent would give 640)
    assert "offload (auto) for 16 tokens x batch 1 (" in log, log[-3000:]
    assert re.search(r"\[BigDiT\] offload: streamed 2 of 2 blocks \(0-1\); 4 streamed block loads in 2 forwards, "
                     r"4 prefetched ahead, 0 late", log), log[-3000:]


# ---- marker files: the pack's loader against upstream's own UNETLoader -----------------------

INT8 = {"format": "int8_tensorwise", "convrot": True, "convrot_groupsize": 256}
FP8 = {"format": "float8_e4m3fn"}
MARKER_FILES = {
    # written by comfy-kitchen (TensorWiseINT8Layout.quantize with ConvRot, group 256)
    "int8_convrot": ({name: INT8 for name in QUANTIZABLE[:-1]}, {}),
    # ComfyUI's scaled-FP8 layout (one weight scale per tensor), as Comfy-Org's fp8_scaled files
    "fp8": ({name: FP8 for name in QUANTIZABLE[:-1]}, {"per_tensor_fp8": True}),
    "mixed": ({name: INT8 if ".attn." in name else FP8 for name in QUANTIZABLE[:-1]}, {}),
}
# Relative L2 distance between MixedCheckpointLoader and upstream's UNETLoader on the same file,
# measured on CPU: int8_convrot 1.4e-7 (the same comfy-kitchen kernel on the same tensors; fp32
# rounding in unquantized layers can flip an INT8 activation rounding, which other tiny weights
# amplified to 2e-3), fp8 0.0055 and mixed 0.0045 (the pack quantizes FP8 activations per token,
# upstream on CPU does not).
NATIVE_TOLERANCE = {"int8_convrot": 1e-3, "fp8": 0.015, "mixed": 0.015}


@pytest.fixture(scope="module")
def marker_files(comfy, tiny_h3):
    folder = comfy.models_dir / "diffusion_models"
    return {kind: write_markers(tiny_h3["path"], folder / f"tiny_h3_{kind}.safetensors", layers, **options).name
            for kind, (layers, options) in MARKER_FILES.items()}


@pytest.mark.parametrize("kind", list(MARKER_FILES))
def test_mixed_checkpoint_loader_matches_upstreams_native_loading(comfy, tiny_h3, baseline, marker_files, kind):
    name = marker_files[kind]
    native = run(comfy, tiny_h3, unet_name=name)
    video, audio, history, report_id = run(comfy, tiny_h3, loader=("MixedCheckpointLoader", {"unet_name": name}))
    report = history["outputs"][report_id]["text"][0]
    assert report.splitlines()[0] == "quantized 12/22 linear layers", report
    assert "ComfyUI per-layer markers" in report
    for ours, upstream, plain in ((video, native[0], baseline[0]), (audio, native[1], baseline[1])):
        assert rel_l2(ours, upstream) < NATIVE_TOLERANCE[kind], rel_l2(ours, upstream)
        assert rel_l2(ours, plain) > DIFFERS  # the file's formats ran, not a float copy


# 4-bit files written by comfy-kitchen itself (its layouts' quantize and serialization). Relative L2 distance
# between MixedCheckpointLoader and upstream's UNETLoader on the same file: both run kitchen's linear on the
# same tensors (activations quantized by it in both), measured on CPU: W4A4 0 (video and audio), W4A8 1.3e-7
# and 4.7e-6 (fp32 rounding in the unquantized layers can flip an INT8 activation rounding, as for
# int8_convrot above). From the bf16 baseline: W4A4 0.045 / 0.038, W4A8 0.017 / 0.017; LoadH3Quantized
# (the file's layers kept, condition_proj quantized to INT8 too) lands 0.022-0.028 (W4A4) and 0.0013-0.0015
# (W4A8) from upstream's run.
FOUR_BIT_FILES = {"convrot_w4a4": {"format": "convrot_w4a4", "convrot_groupsize": 256},
                  "asym_w4a8_int8": {"format": "asym_w4a8_int8", "group_size": 16, "convrot_groupsize": 256}}
FOUR_BIT_TOLERANCE = 1e-3


@pytest.mark.host_feature("four_bit_markers")
@pytest.mark.parametrize("fmt", list(FOUR_BIT_FILES))
def test_4bit_files_match_upstreams_native_loading(comfy, tiny_h3, baseline, fmt):
    """MixedCheckpointLoader, and LoadH3Quantized keeping the file's layers while it quantizes the rest, against
    upstream's UNETLoader on the file."""
    name = f"tiny_h3_{fmt}.safetensors"
    write_kitchen(tiny_h3["path"], comfy.models_dir / "diffusion_models" / name,
                  dict.fromkeys(QUANTIZABLE[:-1], FOUR_BIT_FILES[fmt]))
    native = run(comfy, tiny_h3, unet_name=name)
    for loader in (("MixedCheckpointLoader", {"unet_name": name}),
                   ("LoadH3Quantized", {"unet_name": name, "quantization": "int8_convrot", "offload": "none"})):
        video, audio, history, report_id = run(comfy, tiny_h3, loader=loader)
        report = history["outputs"][report_id]["text"][0]
        assert f"{fmt} x12" in report, report
        for ours, upstream, plain in ((video, native[0], baseline[0]), (audio, native[1], baseline[1])):
            if loader[0] == "MixedCheckpointLoader":
                assert rel_l2(ours, upstream) < FOUR_BIT_TOLERANCE, rel_l2(ours, upstream)
            assert rel_l2(ours, plain) > DIFFERS


# ---- attention ----------------------------------------------------------------------------

# backend -> the fallback reason on CPU. H3 has self-attention only (text, audio and video in one
# sequence); its token refiner runs once per sampling in upstream's extra_conds, without
# transformer_options, so no attention override reaches it: 2 blocks x 2 steps = 4 calls.
CPU_FALLBACKS = {
    "auto": None, "sdpa": None,
    "flash": "needs cuda, got a cpu tensor", "sage": "needs cuda, got a cpu tensor",
    "kitchen_int8": "needs cuda, got a cpu tensor", "fa3_fp8": "needs cuda, got a cpu tensor",
    "sol": "fewer than 12288 tokens, where dense is faster",
}


def attention(backend, **inputs):
    return ("SetAttentionBackend", {"backend": backend, **inputs})


def run_logged(comfy, tiny_h3, chain):
    start = len(comfy.log_text())
    video, audio, _, _ = run(comfy, tiny_h3, chain, seed=5)
    return (video, audio), comfy.log_text()[start:]


def summary(log):
    (line,) = re.findall(r"Set Attention Backend \(.*\): ran .*", log)
    return line


@pytest.fixture(scope="module")
def sdpa_reference(comfy, tiny_h3):
    return run_logged(comfy, tiny_h3, [attention("sdpa")])[0]


def test_sdpa_backend_matches_comfyuis_attention(comfy, tiny_h3, sdpa_reference):
    default = run(comfy, tiny_h3, seed=5)
    for ours, theirs in zip(sdpa_reference, default[:2]):
        torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=0)  # measured 1.5e-7 relative


@pytest.mark.parametrize("backend", list(CPU_FALLBACKS))
def test_every_backend_on_h3_attention(comfy, tiny_h3, sdpa_reference, backend):
    latents, log = run_logged(comfy, tiny_h3, [attention(backend)])
    assert_same(latents, sdpa_reference)  # on CPU each one is SDPA in the end
    line = summary(log)
    reason = CPU_FALLBACKS[backend]
    if backend == "sol" and not comfy.host.features()["kitchen_sol"]:
        kitchen = comfy.host.package_version("comfy-kitchen")
        reason = f"comfy-kitchen {kitchen} has no sol_attn (a newer comfy-kitchen has it, 0.2.40 does)"
    ran = "ran sdpa x4" if backend == "sdpa" else "ran auto:sdpa x4"
    assert ran in line, line
    if reason is None:
        assert "fallbacks none" in line, line
    else:
        assert f"fallbacks {backend} -> auto:sdpa: {reason} x4" in line, line
        warnings = re.findall(rf"\[BigDiT\] attention: {backend} cannot take this call \((.*)\); running", log)
        assert warnings == [reason], warnings


def test_dense_schedule_counts_h3_blocks(comfy, tiny_h3):
    # step 0: both blocks dense (block 0 by step, block 1 by layer); step 1: block 1 by layer,
    # block 0 tries sage and falls back on CPU
    latents, log = run_logged(comfy, tiny_h3, [attention("sage", dense_backend="sdpa", dense_steps=1,
                                                         dense_layers="1")])
    assert all(torch.isfinite(t).all() for t in latents)
    line = summary(log)
    assert "ran sdpa x4" in line and "scheduled dense layer x2, step x1" in line, line
    assert "sage -> sdpa: needs cuda, got a cpu tensor x1" in line, line


# ---- H3's fused SwiGLU (comfy.ops.linear_input_act) on quantized layers ----------------------

def probe(model_node):
    def add(graph):
        graph["probe"] = {"class_type": "BigditSwiGLUProbe", "inputs": {"model": [model_node, 0], "seed": 0}}
    return add


MLPS = {"token_refiner.blocks.0.mlp", "blocks.0.mlp", "blocks.1.mlp"}


@pytest.mark.parametrize("producer", [
    "QuantizeModelINT8", "LoadH3Quantized-int8_convrot", "LoadH3Quantized-float8_e4m3fn"])
def test_h3s_swiglu_on_quantized_layers(comfy, tiny_h3, baseline, producer):
    """Every node's quantized layers are the pack's QuantLinear (weight: a plain tensor): upstream's
    linear_input_act then applies the SwiGLU eagerly and calls the layer (its fused INT8 kernel takes only a
    QuantizedTensor weight), with the same result as the activation applied first; the sampling stays close."""
    if producer == "QuantizeModelINT8":
        chain, loader = [("QuantizeModelINT8", {"group_size": "256", "ignored_layers": "", "row_split": "auto"})], None
        fmt, model_node = "int8_convrot", chain_id(0)
    else:
        fmt = producer.split("-")[1]
        chain, loader, model_node = [], h3_loader(fmt, "none"), "unet"
    video, audio, history, _ = run(comfy, tiny_h3, chain, loader=loader, extra=probe(model_node))
    mlps = json.loads(history["outputs"]["probe"]["text"][0])
    assert set(mlps) == MLPS
    storage = {"int8_convrot": "int8", "float8_e4m3fn": "float8_e4m3fn"}[fmt]
    for name, found in mlps.items():
        assert found["fc2"] == f"ComfyQuantLinear/Parameter({storage})", (name, found)
        assert found["fused"] == 0 and found["unfused"] == 0.0, (name, found)
    for ours, reference in ((video, baseline[0]), (audio, baseline[1])):
        assert DIFFERS < rel_l2(ours, reference) < ONLINE_TOLERANCE[fmt]
