"""The checkpoint loader nodes in a real ComfyUI 0.3.75, against the bf16 baseline.

Quantized files are written from the tiny Wan model (2 blocks, dim 256) by
tests/checkpoint_files.py; each workflow's latent is compared with UNETLoader
on the bf16 file (same seed, 2 steps). For scale: a model with other random
weights lands at a relative latent difference of about 0.7.
"""
import json
import re
import subprocess
import time
from pathlib import Path

import pytest
import torch

from bad_checkpoints import BAD_FILES, UNIT_ONLY, many_markers_file
from checkpoint_files import (CONVERTER_MODES, QWEN3_06B_NVFP4_LAYERS, edit_checkpoint, load, save, write_converted,
                              write_dequantized, write_kitchen, write_markers, write_nvfp4_awq,
                              write_qwen3_06b_nvfp4_awq, write_quanto, write_quanto_reference)
from comfy_harness import PACK_ROOT, ComfyServer, PromptError
from graphs import rel_l2, run_loader, wan_t2v_graph
import template_workflows

pytestmark = pytest.mark.integration

BLOCK_LINEARS = [f"blocks.{b}.{name}" for b in range(2) for name in (
    "self_attn.q", "self_attn.k", "self_attn.v", "self_attn.o",
    "cross_attn.q", "cross_attn.k", "cross_attn.v", "cross_attn.o", "ffn.0", "ffn.2")]

MIXED = {
    "blocks.0.self_attn.q": {"format": "int8_tensorwise", "convrot": True, "convrot_groupsize": 256},
    "blocks.0.self_attn.k": {"format": "int8_tensorwise"},
    "blocks.0.self_attn.v": {"format": "float8_e4m3fn"},
    "blocks.0.ffn.0": {"format": "nvfp4"},
    "blocks.0.ffn.2": {"format": "mxfp8"},
    "blocks.1.ffn.0": {"format": "nvfp4"},
    "blocks.1.cross_attn.o": {"format": "float8_e4m3fn"},
}

# Relative L2 difference of the final latent from the bf16 baseline (measured on CPU:
# mixed 0.0019, header int8 + requantized nvfp4 0.0013, Quanto 0.00017, LoadH3Quantized int8 0.0012,
# fp8 0.0040, auto (INT8 on CPU) 0.0012).
TOLERANCE = {"mixed": 0.01, "header": 0.01, "quanto": 0.002, "online_int8": 0.01, "float8_e4m3fn": 0.05,
             "auto": 0.01}


@pytest.fixture(scope="module")
def files(comfy, tiny_wan2):
    folder = comfy.models_dir / "diffusion_models"
    src = tiny_wan2["path"]
    header = {name: {"format": "int8_tensorwise", "params": {"convrot": True, "convrot_groupsize": 256}}
              for name in BLOCK_LINEARS if not name.endswith("ffn.2")}
    header.update({name: {"format": "nvfp4"} for name in BLOCK_LINEARS if name.endswith("ffn.2")})
    mixed = write_markers(src, folder / "wan2_mixed.safetensors", MIXED)
    sd, _ = load(mixed)
    stray = {f"blocks.7.ffn.0.{k.rsplit('.', 1)[1]}": v for k, v in sd.items()
             if k.startswith("blocks.0.ffn.0.") and not k.endswith("bias")}
    return {
        "mixed": mixed.name,
        "header": write_markers(src, folder / "wan2_header.safetensors", header, form="header").name,
        "quanto": write_quanto_reference(src, folder / "wan2_quanto.safetensors", BLOCK_LINEARS).name,
        "unconsumed": edit_checkpoint(mixed, folder / "bad_unconsumed.safetensors", stray).name,
    }


@pytest.fixture(scope="module")
def baseline(comfy, tiny_wan2):
    return comfy.latent(comfy.run(wan_t2v_graph(tiny_wan2["unet_name"], tiny_wan2["vae_name"])), "save_latent")





def test_mixed_marker_file(comfy, tiny_wan2, files, baseline):
    latent, report = run_loader(comfy, tiny_wan2["vae_name"], "MixedCheckpointLoader", {"unet_name": files["mixed"]})
    lines = report.splitlines()
    assert lines[0] == "quantized 7/26 linear layers"
    assert "formats: float8_e4m3fn x2, int8_convrot x1, int8_tensorwise x1, mxfp8 x1, nvfp4 x2" in lines
    assert "nvfp4 layers on cpu: dequantized before each matmul x2" in lines
    assert rel_l2(latent, baseline) < TOLERANCE["mixed"]


def test_header_markers_with_nvfp4_requantized(comfy, tiny_wan2, files, baseline):
    latent, report = run_loader(comfy, tiny_wan2["vae_name"], "MixedCheckpointLoader",
                                {"unet_name": files["header"], "nvfp4": "requantize"})
    assert report.splitlines()[0] == "quantized 20/26 linear layers"
    assert "formats: int8_convrot x20" in report
    assert "markers read from _quantization_metadata x20" in report
    assert "nvfp4 layers on cpu: re-quantized at load to int8_convrot(g=256) x2" in report
    assert rel_l2(latent, baseline) < TOLERANCE["header"]


def test_quanto_file_from_optimum_quanto_and_mmgp(comfy, tiny_wan2, files, baseline):
    latent, report = run_loader(comfy, tiny_wan2["vae_name"], "MixedCheckpointLoader", {"unet_name": files["quanto"]})
    assert report.splitlines()[0] == "quantized 20/26 linear layers"
    assert "formats: quanto_qint8 x20" in report
    assert "resident-memory format, not a speed format" in report
    assert rel_l2(latent, baseline) < TOLERANCE["quanto"]


def test_load_h3_quantized_online_int8(comfy, tiny_wan2, baseline):
    latent, report = run_loader(comfy, tiny_wan2["vae_name"], "LoadH3Quantized", {
        "unet_name": tiny_wan2["unet_name"], "quantization": "int8_convrot", "offload": "auto",
        "group_size": "256", "ignored_layers": "text_embedding.*"})
    lines = report.splitlines()
    assert lines[0] == "quantized 22/26 linear layers"
    assert "  head.head: ignored (matches 'head.*')" in lines
    assert "  time_projection.1: ignored (matches 'time_projection.*')" in lines
    assert "  text_embedding.0: ignored (matches 'text_embedding.*')" in lines
    assert any(line.startswith("offload: auto on cpu") for line in lines)
    assert rel_l2(latent, baseline) < TOLERANCE["online_int8"]


@pytest.mark.parametrize("quantization, formats, how", [
    ("float8_e4m3fn", "float8_e4m3fn x24", "float8_e4m3fn (per-channel weights, per-token activations) x24"),
    # auto on CPU: the table's INT8 ConvRot (no fast format to measure here)
    ("auto", "int8_convrot x24", "auto: int8_convrot (table) x24"),
])
def test_load_h3_quantized_other_formats(comfy, tiny_wan2, baseline, quantization, formats, how):
    latent, report = run_loader(comfy, tiny_wan2["vae_name"], "LoadH3Quantized", {
        "unet_name": tiny_wan2["unet_name"], "quantization": quantization, "offload": "none"})
    lines = report.splitlines()
    assert lines[0] == "quantized 24/26 linear layers"
    assert f"formats: {formats}" in lines, report
    assert f"quantized while loading: {how}" in lines, report
    assert 0 < rel_l2(latent, baseline) < TOLERANCE[quantization], rel_l2(latent, baseline)


def test_load_h3_quantized_offload_modes_agree(comfy, tiny_wan2):
    """offload=auto runs the same model as offload=none (on CPU nothing needs to stream)."""
    latents = {}
    for mode in ("none", "auto"):
        latents[mode], report = run_loader(comfy, tiny_wan2["vae_name"], "LoadH3Quantized", {
            "unet_name": tiny_wan2["unet_name"], "quantization": "int8_convrot", "offload": mode})
        assert any(line.startswith(f"offload: {mode} on cpu") for line in report.splitlines()), report
        assert "resident 2/2 blocks, streaming 0" in report, report
    assert torch.equal(latents["none"], latents["auto"])


def test_old_option_values_of_saved_workflows_still_load(comfy, tiny_wan2):
    """A workflow saved with the earlier spellings (quantization fp8_e4m3fn, offload layerwise) runs as
    float8_e4m3fn / auto, and the log says how it read them; a value neither spelling knows is refused."""
    today, _ = run_loader(comfy, tiny_wan2["vae_name"], "LoadH3Quantized", {
        "unet_name": tiny_wan2["unet_name"], "quantization": "float8_e4m3fn", "offload": "auto"})
    start = len(comfy.log_text())
    old, report = run_loader(comfy, tiny_wan2["vae_name"], "LoadH3Quantized", {
        "unet_name": tiny_wan2["unet_name"], "quantization": "fp8_e4m3fn", "offload": "layerwise"})
    log = comfy.log_text()[start:]
    assert torch.equal(old, today)
    assert "formats: float8_e4m3fn x24" in report.splitlines() and "\noffload: auto on cpu" in report, report
    assert "[BigDiT] LoadH3Quantized: quantization 'fp8_e4m3fn' is read as 'float8_e4m3fn'" in log, log[-3000:]
    assert "[BigDiT] offload 'layerwise' is read as 'auto'" in log, log[-3000:]
    for name, value in (("quantization", "fp8"), ("offload", "sometimes")):
        inputs = {"unet_name": tiny_wan2["unet_name"], "quantization": "auto", "offload": "auto", name: value}
        with pytest.raises(PromptError, match=f"{name}.* must be one of .*got '{value}'"):
            run_loader(comfy, tiny_wan2["vae_name"], "LoadH3Quantized", inputs)


# ---- 4-bit files written by comfy-kitchen: on a host that loads them, against its own UNETLoader --------

FOUR_BIT = {"convrot_w4a4": {"format": "convrot_w4a4", "convrot_groupsize": 256},
            "asym_w4a8_int8": {"format": "asym_w4a8_int8", "group_size": 16, "convrot_groupsize": 256}}
# Relative L2 latent difference from the bf16 baseline (measured on CPU, both hosts: W4A4 0.0067, W4A8 0.0026).
# Against upstream's UNETLoader on the same file, where the host has the formats: the same latent, bit for bit
# (its Linear runs F.linear on kitchen's QuantizedTensor, the pack's layer the same call).
FOUR_BIT_TOLERANCE = {"convrot_w4a4": 0.02, "asym_w4a8_int8": 0.01}


@pytest.fixture(scope="module")
def four_bit_files(comfy, tiny_wan2):
    folder = comfy.models_dir / "diffusion_models"
    return {fmt: write_kitchen(tiny_wan2["path"], folder / f"wan2_{fmt}.safetensors",
                               dict.fromkeys(BLOCK_LINEARS, marker))[0].name for fmt, marker in FOUR_BIT.items()}


@pytest.mark.parametrize("fmt", list(FOUR_BIT))
def test_kitchen_4bit_file(comfy, tiny_wan2, four_bit_files, baseline, fmt):
    """Every block Linear in the format, as comfy-kitchen writes it: the pack's layers run kitchen's linear
    (activations quantized too) on both hosts; where upstream reads the format, its UNETLoader agrees."""
    name = four_bit_files[fmt]
    latent, report = run_loader(comfy, tiny_wan2["vae_name"], "MixedCheckpointLoader", {"unet_name": name})
    assert report.splitlines()[0] == "quantized 20/26 linear layers", report
    assert f"formats: {fmt} x20" in report.splitlines(), report
    assert 1e-4 < rel_l2(latent, baseline) < FOUR_BIT_TOLERANCE[fmt], rel_l2(latent, baseline)
    if comfy.host.lacks("four_bit_markers") is None:
        upstream = comfy.latent(comfy.run(wan_t2v_graph(name, tiny_wan2["vae_name"])), "save_latent")
        assert torch.equal(latent, upstream), rel_l2(latent, upstream)


# ---- files written by convert_to_quant 1.3.4 -----------------------------------

# Relative L2 latent difference from UNETLoader on the same file dequantized by the converter's own code
# (tests/checkpoint_files.write_dequantized, bf16), measured on CPU: int8 row-wise ConvRot 0.0035, row-wise
# 0.0033, tensor-wise 0.0034 (only the activations' quantization differs), fp8 0.012, nvfp4 0.0008
# (dequantized per call; the reference rounds the weights to bf16).
CONVERTED_TOLERANCE = {"int8_row_convrot": 0.01, "int8_row": 0.01, "int8_tensor": 0.01, "fp8": 0.03,
                       "nvfp4": 0.003}


@pytest.fixture(scope="module")
def converted(comfy, tiny_wan2):
    """{mode: (converted file, its dequantized twin)} in diffusion_models/."""
    folder = comfy.models_dir / "diffusion_models"
    files = {folder / f"wan2_ctq_{mode}.safetensors": mode for mode in CONVERTER_MODES}
    write_converted(tiny_wan2["path"], files)
    return {mode: (path.name, write_dequantized(path, folder / f"wan2_ctq_{mode}_dequantized.safetensors").name)
            for path, mode in files.items()}


@pytest.mark.parametrize("mode", list(CONVERTER_MODES))
def test_convert_to_quant_file(comfy, tiny_wan2, converted, mode):
    """Its markers come in both forms, the tensor form adding keys ("per_row"): merged, and the model runs
    what the file stores."""
    name, dequantized = converted[mode]
    reference = comfy.latent(comfy.run(wan_t2v_graph(dequantized, tiny_wan2["vae_name"])), "save_latent")
    log_start = len(comfy.log_text())
    latent, report = run_loader(comfy, tiny_wan2["vae_name"], "MixedCheckpointLoader", {"unet_name": name})
    quantized = int(re.match(r"quantized (\d+)/26 linear layers", report).group(1))
    assert quantized >= 20, report  # every block Linear at least
    assert f"markers read from both forms x{quantized}" in report, report
    assert rel_l2(latent, reference) < CONVERTED_TOLERANCE[mode], rel_l2(latent, reference)
    assert not re.search(r"unet (missing|unexpected)", comfy.log_text()[log_start:])


# ---- what loading logs ---------------------------------------------------------------

@pytest.mark.parametrize("loader", ["LoadH3Quantized", "MixedCheckpointLoader"])
def test_loading_logs_no_missing_or_unexpected_keys(comfy, tiny_wan, tiny_wan2, files, loader):
    """The layers built while loading are not submodules of the Linear they replace, so ComfyUI's
    load_state_dict finds no `<layer>.built.*` keys to call missing (one line of 46,000 characters on a
    Wan 14B)."""
    inputs = ({"unet_name": tiny_wan["unet_name"], "quantization": "int8_convrot", "offload": "none"}
              if loader == "LoadH3Quantized" else {"unet_name": files["mixed"]})
    log_start = len(comfy.log_text())
    run_loader(comfy, (tiny_wan if loader == "LoadH3Quantized" else tiny_wan2)["vae_name"], loader, inputs)
    log = comfy.log_text()[log_start:]
    assert f"[BigDiT] {loader} report:\nquantized" in log  # the load's own report: this is the load's log
    assert not re.search(r"unet (missing|unexpected)", log), log[:2000]


# ---- hostile inputs: bounded, interruptible, refused clearly --------------------------

@pytest.mark.parametrize("node", ["LoadH3Quantized", "QuantizeModelINT8"])
def test_hostile_ignored_layers_are_refused_fast(comfy, tiny_wan, tiny_wan2, baseline, node):
    patterns = "[" * 40_000
    if node == "LoadH3Quantized":
        graph = wan_t2v_graph(None, tiny_wan["vae_name"], loader=(node, {
            "unet_name": tiny_wan["unet_name"], "quantization": "int8_convrot", "offload": "none",
            "ignored_layers": patterns}))
    else:
        graph = wan_t2v_graph(tiny_wan["unet_name"], tiny_wan["vae_name"], model_chain=[
            (node, {"group_size": "64", "ignored_layers": patterns})])
    start = time.monotonic()
    with pytest.raises(PromptError) as info:
        comfy.run(graph, timeout=60)
    assert time.monotonic() - start < 10
    assert info.value.node_type == node
    assert "ignored_layers: 40000 characters, over the bound" in info.value.message, info.value.message
    assert_server_keeps_serving(comfy, tiny_wan2, baseline)


def _queue(comfy, graph):
    return comfy._request("/prompt", {"prompt": graph})["prompt_id"]


def _wait_running(comfy, prompt_id, timeout=60):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if any(item[1] == prompt_id for item in comfy._request("/queue")["queue_running"]):
            return
        time.sleep(0.05)
    raise TimeoutError(f"prompt {prompt_id} never started")


def test_long_inspection_stops_on_interrupt(comfy, tiny_wan2, baseline):
    """200,000 markers (a 30 MB header) whose layers all lack weight_scale: inspected to the end, the load
    fails with that; /interrupt during the inspection stops it with ComfyUI's interrupt instead."""
    bad = many_markers_file(comfy.models_dir / "diffusion_models" / "bad_many_markers.safetensors", 200_000,
                            scales=False)
    graph = wan_t2v_graph(None, tiny_wan2["vae_name"], loader=("MixedCheckpointLoader", {"unet_name": bad.name}))
    prompt_id = _queue(comfy, graph)
    _wait_running(comfy, prompt_id)
    time.sleep(0.5)  # past the executor's reset of the interrupt flag at the prompt's start
    comfy._request("/interrupt", {})
    deadline = time.monotonic() + 120
    while not (entry := comfy._request(f"/history/{prompt_id}").get(prompt_id)):
        assert time.monotonic() < deadline
        time.sleep(0.1)
    kinds = [kind for kind, _ in entry["status"]["messages"]]
    assert "execution_interrupted" in kinds and "execution_error" not in kinds, entry["status"]
    assert_server_keeps_serving(comfy, tiny_wan2, baseline)


def bad_file_cases():
    return [(case, *expected) for case, (_, *expected) in BAD_FILES.items() if case not in UNIT_ONLY] + [
        ("unconsumed", "unconsumed markers", "blocks.7.ffn.0")]  # found only once the model is built


@pytest.fixture(scope="module")
def bad_files(comfy, tiny_wan2, files, tmp_path_factory):
    """Every bad file of tests/bad_checkpoints.py, written from the tiny Wan into diffusion_models/."""
    folder, workdir = comfy.models_dir / "diffusion_models", tmp_path_factory.mktemp("bad")
    written = {"unconsumed": files["unconsumed"]}
    for i, (case, (writer, _, _)) in enumerate(BAD_FILES.items()):
        if case in UNIT_ONLY:
            continue
        written[case] = writer(tiny_wan2["path"], workdir, folder / f"bad_{i:02d}.safetensors").name
    return written


def assert_server_keeps_serving(comfy, tiny_wan2, baseline):
    assert comfy.alive()
    again = comfy.latent(comfy.run(wan_t2v_graph(tiny_wan2["unet_name"], tiny_wan2["vae_name"])), "save_latent")
    assert torch.equal(again, baseline)


@pytest.mark.parametrize("case, words, layer", bad_file_cases(), ids=[c[0] for c in bad_file_cases()])
def test_bad_file_fails_clearly_and_the_server_keeps_serving(comfy, tiny_wan2, bad_files, baseline, case, words,
                                                             layer):
    with pytest.raises(PromptError) as info:
        run_loader(comfy, tiny_wan2["vae_name"], "MixedCheckpointLoader", {"unet_name": bad_files[case]})
    assert info.value.node_type == "MixedCheckpointLoader"
    assert "CheckpointError" in info.value.message
    assert f"{bad_files[case]}: " in info.value.message and words in info.value.message, info.value.message
    assert layer in info.value.message, info.value.message
    assert_server_keeps_serving(comfy, tiny_wan2, baseline)


def test_mapping_collision_fails_clearly_and_the_server_keeps_serving(comfy, tiny_wan2, baseline, tmp_path):
    """Two Quanto prefixes that the loader's renaming maps onto one name: refused before anything loads."""
    folder = comfy.models_dir / "text_encoders"
    folder.mkdir(exist_ok=True)
    sd, _ = load(tiny_wan2["path"])
    layer = {k[len("blocks.0.ffn.0."):]: v for k, v in sd.items() if k.startswith("blocks.0.ffn.0.")}
    save({f"{side}.ffn.{k}": v.clone() for side in ("a", "b") for k, v in layer.items()}, tmp_path / "two.safetensors")
    bad = write_quanto(tmp_path / "two.safetensors", folder / "bad_collision.safetensors", ["a.ffn", "b.ffn"])
    graph = {"clip": {"class_type": "QuantizedCLIPLoader", "inputs": {
        "clip_name": bad.name, "type": "stable_diffusion", "rename_prefixes": "a. -> \nb. -> "}}}
    graph["report"] = {"class_type": "PreviewAny", "inputs": {"source": ["clip", 1]}}
    with pytest.raises(PromptError) as info:
        comfy.run(graph)
    assert info.value.node_type == "QuantizedCLIPLoader"
    assert (f"{bad.name}: mapping collision: 2 name(s) map onto another ('a.ffn' and 'b.ffn' both become "
            f"'ffn.weight') (layers: a.ffn, b.ffn, a.ffn.bias, b.ffn.bias)") in info.value.message, info.value.message
    assert_server_keeps_serving(comfy, tiny_wan2, baseline)


# ---- text encoder --------------------------------------------------------------

_CLIP_L = """
import sys
from comfy.cli_args import args
args.cpu = True
import torch, comfy.ops, comfy.sd1_clip, safetensors.torch
sys.path.insert(0, sys.argv[2])
from tiny_models import _random_state_dict
clip = comfy.sd1_clip.SDClipModel(device="cpu", dtype=torch.float32,
                                  model_options={"custom_operations": comfy.ops.manual_cast})
sd = {k: v.to(torch.bfloat16) for k, v in _random_state_dict(clip.transformer, 0).items()}
safetensors.torch.save_file(sd, sys.argv[1])
"""


def _floats(text: str) -> torch.Tensor:
    return torch.tensor([float(v) for v in re.findall(r"-?\d+\.\d+(?:e-?\d+)?", text)])


@pytest.fixture(scope="module")
def clip_l(comfy):
    """A random CLIP-L (ComfyUI 0.3.75's smallest text encoder, 123M parameters) in bf16: (file, Linear names)."""
    folder = comfy.models_dir / "text_encoders"
    folder.mkdir(exist_ok=True)
    plain = folder / "clip_l_random.safetensors"
    tests_dir = str(Path(__file__).resolve().parent.parent)
    subprocess.run([str(comfy.python), "-c", _CLIP_L, str(plain), tests_dir], cwd=comfy.comfyui, check=True)
    sd, _ = load(plain)
    linears = [k[:-len(".weight")] for k, v in sd.items() if k.endswith(".weight") and v.dim() == 2
               and "embedding" not in k]
    return plain, linears


def encode(comfy, class_type, name, inputs=None):
    """`inputs`: the loader's inputs but clip_name (default: type stable_diffusion)."""
    inputs = inputs or {"type": "stable_diffusion"}
    graph = {"clip": {"class_type": class_type, "inputs": {**inputs, "clip_name": name}},
             "encode": {"class_type": "CLIPTextEncode", "inputs": {"text": "a cat", "clip": ["clip", 0]}},
             "cond": {"class_type": "PreviewAny", "inputs": {"source": ["encode", 0]}}}
    if class_type == "QuantizedCLIPLoader":
        graph["report"] = {"class_type": "PreviewAny", "inputs": {"source": ["clip", 1]}}
    return comfy.run(graph)["outputs"]


def encoded_difference(comfy, clip_l, quantized_name, inputs=None):
    """(report, max |difference| of the printed conditioning values) against CLIPLoader on the bf16 file, both
    with the loader inputs `inputs` (default: type stable_diffusion)."""
    reference = encode(comfy, "CLIPLoader", clip_l[0].name, inputs and {"type": inputs["type"]})
    outputs = encode(comfy, "QuantizedCLIPLoader", quantized_name, inputs)
    expected, got = _floats(reference["cond"]["text"][0]), _floats(outputs["cond"]["text"][0])
    assert expected.numel() > 20 and got.shape == expected.shape
    return outputs["report"]["text"][0], (got - expected).abs().max().item()


def test_quantized_clip_loader_quanto_clip_l(comfy, clip_l):
    """All 73 Linear layers of the CLIP-L Quanto qint8: the encoded prompt's printed values agree."""
    plain, linears = clip_l
    quanto = write_quanto(plain, plain.parent / "clip_l_quanto.safetensors", linears)
    report, difference = encoded_difference(comfy, clip_l, quanto.name)
    assert report.splitlines()[0] == f"quantized {len(linears)}/{len(linears)} linear layers"
    # Values of about 0.05 printed to 4 decimals; per-channel qint8 moves them by a few 1e-4.
    assert 0 < difference < 2e-3


def test_quantized_clip_loader_marker_clip_l(comfy, clip_l):
    """The CLIP-L with comfy_quant markers, INT8 (ConvRot) and FP8 layers mixed."""
    plain, linears = clip_l
    markers = {name: ({"format": "int8_tensorwise", "convrot": True, "convrot_groupsize": 256} if i % 2 else
                      {"format": "float8_e4m3fn"}) for i, name in enumerate(linears)}
    marked = write_markers(plain, plain.parent / "clip_l_markers.safetensors", markers)
    report, difference = encoded_difference(comfy, clip_l, marked.name)
    lines = report.splitlines()
    assert lines[0] == f"quantized {len(linears)}/{len(linears)} linear layers"
    n_fp8 = (len(linears) + 1) // 2
    assert f"formats: float8_e4m3fn x{n_fp8}, int8_convrot x{len(linears) - n_fp8}" in lines, report
    # measured 8e-4: W8A8 on every layer moves the printed values more than weight-only qint8
    assert 0 < difference < 4e-3


def test_quantized_clip_loader_int8_token_embedding(comfy, clip_l):
    """Comfy-Org's MiniMax-H3 encoder stores its token embedding in INT8 with a marker, as upstream's CLIPLoader
    reads it. A lookup table is no Linear: the loader dequantizes it at load (the record says so) and the
    encoded prompt stays near the bf16 encoder's."""
    plain, linears = clip_l
    sd, _ = load(plain)
    (embedding,) = [k[:-len(".weight")] for k in sd if k.endswith("token_embedding.weight")]
    markers = {name: {"format": "int8_tensorwise", "convrot": True, "convrot_groupsize": 256} for name in linears}
    markers[embedding] = {"format": "int8_tensorwise"}  # per row, no rotation: a row is one token's vector
    marked = write_markers(plain, plain.parent / "clip_l_int8_embedding.safetensors", markers)
    report, difference = encoded_difference(comfy, clip_l, marked.name)
    assert report.splitlines()[0] == f"quantized {len(linears)}/{len(linears)} linear layers", report
    assert f"  {embedding}: int8_tensorwise embedding, dequantized at load" in report.splitlines(), report
    # per-row INT8 embeddings on top of INT8 linears (as the marker test above, measured 8e-4)
    assert 0 < difference < 4e-3


@pytest.fixture(scope="module")
def comfy_sdpa(comfy, clip_l, tmp_path_factory):
    """A second server with --use-pytorch-cross-attention: on CPU ComfyUI's default attention is not SDPA."""
    server = ComfyServer(tmp_path_factory.mktemp("comfy_sdpa"), comfy.comfyui,
                         extra_args=["--use-pytorch-cross-attention"])
    (server.models_dir / "text_encoders").mkdir(exist_ok=True)
    (server.models_dir / "text_encoders" / clip_l[0].name).symlink_to(clip_l[0])
    yield server
    server.stop()


def test_quantized_clip_loader_fp8_qk_int8_v_under_sdpa(comfy_sdpa, clip_l):
    """FP8 q and k with INT8 v in every attention, into SDPA: all three projections return one dtype."""
    plain, linears = clip_l
    int8 = {"format": "int8_tensorwise", "convrot": True, "convrot_groupsize": 256}
    markers = {name: int8 if name.endswith(("v_proj", "fc1")) else {"format": "float8_e4m3fn"}
               for name in linears if ".layers." in name}
    assert sum(name.endswith("q_proj") for name in markers) == 12
    marked = write_markers(plain, comfy_sdpa.models_dir / "text_encoders" / "clip_l_fp8_qk_int8_v.safetensors",
                           markers)
    report, difference = encoded_difference(comfy_sdpa, clip_l, marked.name)
    assert report.splitlines()[0] == f"quantized {len(markers)}/{len(linears)} linear layers", report
    assert f"formats: float8_e4m3fn x{len(markers) - 24}, int8_convrot x24" in report.splitlines(), report
    # as the alternating marker file above (measured 7e-4)
    assert 0 < difference < 4e-3


def test_quantized_clip_loader_nvfp4_awq_clip_l(comfy, clip_l):
    """Every Linear of the CLIP-L in NVFP4 with AWQ's pre_quant_scale, laid out as ModelOpt exports Comfy-Org's
    `*_nvfp4_awq` text encoders: the encoded values stay near the bf16 encoder's. (Upstream's CLIPLoader reads
    markers only for its LLM text encoders, not a CLIP-L: test_awq_layer_matches_upstreams_linear compares
    the layers with upstream's own.)"""
    plain, linears = clip_l
    awq = plain.parent / "clip_l_nvfp4_awq.safetensors"
    write_nvfp4_awq(plain, awq, linears)
    report, difference = encoded_difference(comfy, clip_l, awq.name)
    assert report.splitlines()[0] == f"quantized {len(linears)}/{len(linears)} linear layers", report
    assert f"formats: nvfp4 x{len(linears)}" in report.splitlines(), report
    # weight-only E2M1 on every layer (measured 0.0074 on both hosts)
    assert 0 < difference < 2e-2


@pytest.fixture(scope="module")
def qwen3_06b(comfy):
    """checkpoint_files' random Qwen3-0.6B with 14 NVFP4-AWQ layers, in the server's text_encoders folder:
    (file, NVFP4 layers)."""
    folder = comfy.models_dir / "text_encoders"
    folder.mkdir(exist_ok=True)
    awq = folder / "qwen3_06b_nvfp4_awq.safetensors"
    write_qwen3_06b_nvfp4_awq(awq, comfy.python, comfy.comfyui)
    return awq, QWEN3_06B_NVFP4_LAYERS


@pytest.mark.host_feature("nvfp4_pre_quant_scale")
def test_quantized_clip_loader_hands_an_emulated_file_to_the_hosts_loader(comfy, qwen3_06b):
    """A text encoder whose NVFP4 layers this device would run dequantized before each matmul in either loader,
    in a family whose loader reads markers: QuantizedCLIPLoader hands it to ComfyUI's own loader (its memory
    management moves the weights of a second prompt faster), so the conditioning is CLIPLoader's, bit for bit;
    `nvfp4: requantize` loads it through the pack, which converts the layers."""
    awq, layers = qwen3_06b
    reference = encode(comfy, "CLIPLoader", awq.name)
    handed = encode(comfy, "QuantizedCLIPLoader", awq.name)
    report = handed["report"]["text"][0]
    assert report.startswith("loaded by ComfyUI's own text-encoder loader, as CLIPLoader loads it: its nvfp4 "
                             f"x{len(layers)} layers run dequantized before each matmul on cpu"), report
    expected, got = _floats(reference["cond"]["text"][0]), _floats(handed["cond"]["text"][0])
    assert expected.numel() > 20 and torch.equal(got, expected)
    converted = encode(comfy, "QuantizedCLIPLoader", awq.name, {"type": "stable_diffusion", "nvfp4": "requantize"})
    lines = converted["report"]["text"][0].splitlines()
    assert lines[0].startswith("quantized "), lines
    assert f"nvfp4 layers on cpu: re-quantized at load to int8_convrot(g=256) x{len(layers)}" in lines, lines
    moved = (_floats(converted["cond"]["text"][0]) - expected).abs().max().item()
    assert 0 < moved < 5e-2, moved


H3_EXAMPLES = [Path(__file__).resolve().parents[2] / "example_workflows" / "api" / f"{name}.json"
               for name in template_workflows.EXAMPLES]


@pytest.mark.host_feature("minimax_h3")
def test_quantized_clip_loader_as_the_h3_examples_configure_it(comfy, clip_l):
    """QuantizedCLIPLoader with the inputs the MiniMax-H3 examples give it (type minimax, nvfp4 auto) on an
    NVFP4-AWQ file. The examples' own runs (test_examples_and_ui.py) swap the encoder: upstream builds the H3
    encoder (Qwen3-VL-32B) with its fixed config from a 50-layer file, which has no tiny form. So the file is the
    CLIP-L, which upstream's `minimax` type loads with the CLIP-L recipe, against CLIPLoader of that type."""
    (inputs,) = {json.dumps({k: v for k, v in node["inputs"].items() if k != "clip_name"}, sort_keys=True)
                 for path in H3_EXAMPLES for node in json.loads(path.read_text()).values()
                 if node["class_type"] == "QuantizedCLIPLoader"}
    inputs = json.loads(inputs)
    assert inputs["type"] == "minimax", inputs
    plain, linears = clip_l
    awq = plain.parent / "clip_l_nvfp4_awq_minimax.safetensors"
    write_nvfp4_awq(plain, awq, linears)
    report, difference = encoded_difference(comfy, clip_l, awq.name, inputs)
    assert report.splitlines()[0] == f"quantized {len(linears)}/{len(linears)} linear layers", report
    assert f"formats: nvfp4 x{len(linears)}" in report.splitlines(), report
    # upstream reads no markers for a CLIP-L: its loader was tried and the pack loaded the file, saying why
    assert re.search(r"^ComfyUI's own loader (failed|kept 0 of the file's \d+ quantized layers).*so the pack loaded "
                     r"it$", report, re.M), report
    # as test_quantized_clip_loader_nvfp4_awq_clip_l (measured 0.0074)
    assert 0 < difference < 2e-2


_UPSTREAM_LINEAR = """
import sys, json
from comfy.cli_args import args
args.cpu = True
import torch, comfy.ops, safetensors.torch
src, x_path, out_path, layers = sys.argv[1], sys.argv[2], sys.argv[3], json.loads(sys.argv[4])
sd, xs = safetensors.torch.load_file(src), safetensors.torch.load_file(x_path)
ops = comfy.ops.mixed_precision_ops({}, torch.float32, disabled={"nvfp4"})   # no NVFP4 GEMM on CPU
out = {}
for name, (n_out, n_in) in layers.items():
    linear = ops.Linear(n_in, n_out, bias=True)
    linear.load_state_dict({k[len(name) + 1:]: v for k, v in sd.items() if k.startswith(name + ".")}, strict=False)
    out[name] = linear(xs[name])
safetensors.torch.save_file(out, out_path)
"""


@pytest.mark.host_feature("nvfp4_pre_quant_scale")
def test_awq_layer_matches_upstreams_linear(comfy, clip_l, tmp_path):
    """Upstream's own MixedPrecisionOps.Linear, loading the AWQ layers from the file, against the pack's layers
    built from it: the same output, bit for bit (both multiply the input by pre_quant_scale, then run the
    dequantized NVFP4 weight, as upstream does on a device without NVFP4 GEMMs)."""
    import safetensors.torch

    from bigdit.loaders import LayerBuilder, inspect_checkpoint
    plain, linears = clip_l
    awq = tmp_path / "awq.safetensors"
    names = linears[:4]
    write_nvfp4_awq(plain, awq, names)
    sd, _ = load(awq)
    shapes = {name: list(sd[f"{name}.bias"].shape) + [sd[f"{name}.pre_quant_scale"].shape[0]] for name in names}
    gen = torch.Generator().manual_seed(3)
    xs = {name: torch.randn(2, 5, n_in, generator=gen) for name, (_, n_in) in shapes.items()}
    safetensors.torch.save_file(xs, str(tmp_path / "x.safetensors"))
    subprocess.run([str(comfy.python), "-c", _UPSTREAM_LINEAR, str(awq), str(tmp_path / "x.safetensors"),
                    str(tmp_path / "out.safetensors"), json.dumps(shapes)], cwd=comfy.comfyui, check=True)
    upstream = safetensors.torch.load_file(str(tmp_path / "out.safetensors"))
    plan = inspect_checkpoint(awq)
    with plan.open() as source:
        builder = LayerBuilder(plan, source, torch.device("cpu"))
        builder.resolve_methods()
        for name, (n_out, n_in) in shapes.items():
            layer = builder.build(name, None, n_in, n_out, sd[f"{name}.bias"], torch.float32, None)
            assert torch.equal(layer(xs[name]), upstream[name]), name


_CLIP_CLONE = r"""
import json, os, sys, types
pack_root, folder, name = sys.argv[1], sys.argv[2], sys.argv[3]
sys.path.insert(0, os.getcwd())
import comfy_aimdo.control
assert comfy_aimdo.control.init(), "comfy-aimdo's library did not load"  # before its modules bind it
from comfy.cli_args import args
args.cpu = True
import torch
import comfy.model_patcher, folder_paths
pkg = types.ModuleType("bigdit"); pkg.__path__ = [pack_root]; sys.modules["bigdit"] = pkg
from bigdit.host.loading import load_checkpoint
from bigdit.quant.linear import QuantLinear
cpu = torch.device("cpu")
def on_cpu_dynamic(model):  # the patcher upstream makes for a GPU under dynamic VRAM, retargeted to the CPU
    patcher = comfy.model_patcher.ModelPatcherDynamic(model, load_device=torch.device("cuda", 0), offload_device=cpu)
    patcher.load_device = cpu
    patcher.register_load_device(cpu)
    return patcher
comfy.model_patcher.CoreModelPatcher = lambda model, load_device, offload_device: on_cpu_dynamic(model)
folder_paths.add_model_folder_path("text_encoders", folder)
clip = load_checkpoint("QuantizedCLIPLoader", "text_encoders", name, clip_type="stable_diffusion")[0]
plain = clip.clone(disable_dynamic=True)  # what upstream's CLIP hook nodes do
def layers(patcher):
    return {n: m for n, m in patcher.model.named_modules() if isinstance(m, QuantLinear)}
a, b = layers(clip.patcher), layers(plain.patcher)
print(json.dumps({"dynamic": [clip.patcher.is_dynamic(), plain.patcher.is_dynamic()],
                  "own_model": plain.patcher.model is not clip.patcher.model, "layers": [len(a), len(b)],
                  "equal": sorted(a) == sorted(b) and all(
                      torch.equal(ta, tb) for n in a for ta, tb in zip(a[n].state_dict().values(),
                                                                        b[n].state_dict().values()))}))
"""


@pytest.mark.host_feature("dynamic_vram")
def test_quantized_clip_loader_leaves_upstreams_reload_factory(comfy, clip_l):
    """A dynamic-VRAM text encoder cloned with `disable_dynamic=True` (upstream's CLIP hook nodes) is loaded again
    through the loader's `cached_patcher_init`: a plain patcher whose model holds the same quantized layers."""
    plain, linears = clip_l
    markers = {name: {"format": "float8_e4m3fn"} for name in linears[::2]}
    marked = write_markers(plain, plain.parent / "clip_l_fp8_half.safetensors", markers)
    result = subprocess.run([str(comfy.host.python), "-c", _CLIP_CLONE, str(PACK_ROOT), str(marked.parent),
                             marked.name], cwd=comfy.host.comfyui, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    out = json.loads(result.stdout.strip().splitlines()[-1])
    assert out["dynamic"] == [True, False] and out["own_model"], out
    assert out["layers"] == [len(markers)] * 2 and out["equal"], out
