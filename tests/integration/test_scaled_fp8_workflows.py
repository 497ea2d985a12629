"""ComfyUI's scaled_fp8 files in a real ComfyUI: the pack's loaders against ComfyUI's own UNETLoader reading the
same file natively, and QuantizeModelINT8 keeping or re-quantizing FP8 layers.

The file is the tiny Wan (2 blocks, dim 256) in the layout of Comfy-Org's `*_fp8_scaled` files
(tests/checkpoint_files.write_scaled_fp8). On CPU ComfyUI runs such a layer as weight * scale_weight in the
compute dtype; the pack's FP8 layer also quantizes its activations per token, so latents differ by that.
"""
import pytest
import torch

from checkpoint_files import write_scaled_fp8
from graphs import chain_id, node_report, rel_l2, run_loader, wan_t2v_graph

pytestmark = pytest.mark.integration

BLOCK_LINEARS = [f"blocks.{b}.{name}" for b in range(2) for name in (
    "self_attn.q", "self_attn.k", "self_attn.v", "self_attn.o",
    "cross_attn.q", "cross_attn.k", "cross_attn.v", "cross_attn.o", "ffn.0", "ffn.2")]

# Relative L2 distance of final latents, measured on CPU on both hosts. PACK_VS_NATIVE: the pack's FP8 layers vs
# ComfyUI's native scaled_fp8 layers (0.0122 / 0.0124). FP8_VS_BF16: a run against the bf16 file's (native 0.0126,
# the pack's 0.018, only the blocks in FP8 0.0017, FP8 re-quantized to INT8 0.0123 / 0.0128).
PACK_VS_NATIVE = 0.025
FP8_VS_BF16 = 0.04


@pytest.fixture(scope="module")
def scaled(comfy, tiny_wan2):
    folder = comfy.models_dir / "diffusion_models"
    return {"all": write_scaled_fp8(tiny_wan2["path"], folder / "wan2_fp8_scaled.safetensors").name,
            "blocks": write_scaled_fp8(tiny_wan2["path"], folder / "wan2_blocks_fp8_scaled.safetensors",
                                       BLOCK_LINEARS).name}


@pytest.fixture(scope="module")
def baseline(comfy, tiny_wan2):
    return comfy.latent(comfy.run(wan_t2v_graph(tiny_wan2["unet_name"], tiny_wan2["vae_name"])), "save_latent")


@pytest.fixture(scope="module")
def native(comfy, tiny_wan2, scaled):
    """ComfyUI's own UNETLoader on the scaled_fp8 file."""
    return comfy.latent(comfy.run(wan_t2v_graph(scaled["all"], tiny_wan2["vae_name"])), "save_latent")





def test_mixed_checkpoint_loader_reads_scaled_fp8_as_comfyui_does(comfy, tiny_wan2, scaled, native, baseline):
    latent, report = run_loader(comfy, tiny_wan2["vae_name"], "MixedCheckpointLoader", {"unet_name": scaled["all"]})
    lines = report.splitlines()
    assert lines[0] == "quantized 26/26 linear layers", report
    assert "formats: float8_e4m3fn x26" in lines, report
    assert f"checkpoint {scaled['all']}: ComfyUI scaled_fp8; quantized layers in the file: float8_e4m3fn x26" in lines
    assert not torch.equal(latent, native)  # the pack's own FP8 layers ran, not ComfyUI's
    assert rel_l2(latent, native) < PACK_VS_NATIVE, rel_l2(latent, native)
    assert rel_l2(native, baseline) < FP8_VS_BF16 and rel_l2(latent, baseline) < FP8_VS_BF16


def test_load_h3_quantized_keeps_the_file_fp8_layers(comfy, tiny_wan2, scaled, native):
    """Quantizing while loading: the file's FP8 layers load as stored (not re-quantized), the rest is quantized."""
    mixed, _ = run_loader(comfy, tiny_wan2["vae_name"], "MixedCheckpointLoader", {"unet_name": scaled["all"]})
    latent, report = run_loader(comfy, tiny_wan2["vae_name"], "LoadH3Quantized", {
        "unet_name": scaled["all"], "quantization": "int8_convrot", "offload": "none"})
    assert report.splitlines()[0] == "quantized 26/26 linear layers" and "formats: float8_e4m3fn x26" in report
    assert torch.equal(latent, mixed)
    assert rel_l2(latent, native) < PACK_VS_NATIVE


def test_load_h3_quantized_on_a_partly_scaled_file(comfy, tiny_wan2, scaled, baseline):
    """The file's 20 FP8 block layers load as stored; the embeddings it left in bf16 stay so, as in ComfyUI (head and
    time projection kept by their patterns): the model MixedCheckpointLoader loads, bit for bit."""
    mixed, _ = run_loader(comfy, tiny_wan2["vae_name"], "MixedCheckpointLoader", {"unet_name": scaled["blocks"]})
    latent, report = run_loader(comfy, tiny_wan2["vae_name"], "LoadH3Quantized", {
        "unet_name": scaled["blocks"], "quantization": "int8_convrot", "offload": "none"})
    lines = report.splitlines()
    assert lines[0] == "quantized 20/26 linear layers", report
    assert "formats: float8_e4m3fn x20" in lines, report
    left = "kept as stored: the file quantizes 20 other layers and leaves this one as it is"
    assert {f"  {name}: {left}" for name in ("text_embedding.0", "text_embedding.2", "time_embedding.0",
                                             "time_embedding.2")} <= set(lines), report
    assert torch.equal(latent, mixed)
    assert rel_l2(latent, baseline) < FP8_VS_BF16, rel_l2(latent, baseline)


def quantize(requantize_fp8):
    return ("QuantizeModelINT8", {"group_size": "256", "ignored_layers": "", "requantize_fp8": requantize_fp8})


@pytest.mark.parametrize("source", ["scaled_fp8 file", "weight_dtype fp8_e4m3fn"])
def test_quantize_int8_keeps_or_requantizes_fp8_layers(comfy, tiny_wan2, scaled, baseline, source):
    if source == "scaled_fp8 file":
        unet, weight_dtype = scaled["all"], "default"
    else:
        unet, weight_dtype = tiny_wan2["unet_name"], "fp8_e4m3fn"
    runs = {}
    for requantize in (False, True):
        graph = wan_t2v_graph(unet, tiny_wan2["vae_name"], weight_dtype=weight_dtype,
                              model_chain=[quantize(requantize)])
        history = comfy.run(graph)
        runs[requantize] = comfy.latent(history, "save_latent"), node_report(history, chain_id(0))
    fp8_only = comfy.latent(comfy.run(wan_t2v_graph(unet, tiny_wan2["vae_name"], weight_dtype=weight_dtype)),
                            "save_latent")

    kept, kept_report = runs[False]
    assert kept_report.splitlines()[0] == "quantized 0/26 linear layers", kept_report
    assert "kept 26 fp8 layers as they were (requantize_fp8 is off)" in kept_report.splitlines()
    assert torch.equal(kept, fp8_only)

    redone, report = runs[True]
    lines = report.splitlines()
    assert lines[0] == "quantized 24/26 linear layers", report  # head and time projection kept by default
    assert "formats: int8_convrot x24" in lines and "re-quantized 24 fp8 layers to int8_convrot" in lines, report
    assert "kept 2 fp8 layers as they were" in lines, report
    assert not torch.equal(redone, kept)
    assert rel_l2(redone, baseline) < FP8_VS_BF16, rel_l2(redone, baseline)
