"""QuantizeModelINT8 in a real ComfyUI, on the tiny Wan model."""
import pytest
import torch

from checkpoint_files import write_markers
from comfy_harness import combo_options
from graphs import chain_id, node_report, rel_l2, wan_t2v_graph

pytestmark = pytest.mark.integration


def quantize_node(group_size="16", ignored_layers="", **extra):
    return ("QuantizeModelINT8", {"group_size": group_size, "ignored_layers": ignored_layers, **extra})


def report_of(history, node_id=chain_id(0)) -> str:
    return node_report(history, node_id)



def test_node_inputs_as_documented(comfy):
    info = comfy.object_info()["QuantizeModelINT8"]
    assert list(info["input"]["required"]) == ["model", "group_size", "ignored_layers"]
    assert list(info["input"]["optional"]) == ["row_split", "requantize_fp8", "quantization"]
    assert combo_options(info["input"]["optional"]["quantization"]) == ["int8_convrot", "convrot_w4a4",
                                                                       "asym_w4a8_int8"]
    assert info["input"]["optional"]["requantize_fp8"][0] == "BOOLEAN"
    assert info["input"]["optional"]["requantize_fp8"][1]["default"] is False
    assert combo_options(info["input"]["required"]["group_size"]) == ["256", "64", "16"]
    assert info["input"]["required"]["group_size"][1]["default"] == "256"
    assert combo_options(info["input"]["optional"]["row_split"]) == ["auto", "off"]
    assert info["output"] == ["MODEL", "STRING"] and info["category"] == "model/patch"


@pytest.fixture(scope="module")
def baseline(comfy, tiny_wan2):
    return comfy.latent(comfy.run(wan_t2v_graph(tiny_wan2["unet_name"], tiny_wan2["vae_name"])), "save_latent")


def test_quantized_run_is_close_but_not_identical(comfy, tiny_wan2, baseline):
    history = comfy.run(wan_t2v_graph(tiny_wan2["unet_name"], tiny_wan2["vae_name"], model_chain=[quantize_node()]))
    report = report_of(history)
    first = report.splitlines()[0]
    quantized, total = map(int, first.removeprefix("quantized ").removesuffix(" linear layers").split("/"))
    assert 0 < quantized <= total
    latent = comfy.latent(history, "save_latent")
    assert not torch.equal(latent, baseline)
    # Random tiny weights, 2 sampler steps: W8A8 error stays at the percent level.
    assert rel_l2(latent, baseline) < 0.05, rel_l2(latent, baseline)


def test_group_256_keeps_narrow_layers_and_says_why(comfy, tiny_wan):
    history = comfy.run(wan_t2v_graph(tiny_wan["unet_name"], tiny_wan["vae_name"],
                                      model_chain=[quantize_node("256")]))
    report = report_of(history)
    # dim 128 is not divisible by 256: those layers stay, each listed with its reason.
    assert "not divisible by group size 256" in report


def test_ignore_everything_reproduces_baseline_exactly(comfy, tiny_wan2, baseline):
    history = comfy.run(wan_t2v_graph(tiny_wan2["unet_name"], tiny_wan2["vae_name"],
                                      model_chain=[quantize_node(ignored_layers="*")]))
    assert report_of(history).startswith("quantized 0/")
    assert torch.equal(comfy.latent(history, "save_latent"), baseline)


def test_other_branch_keeps_original_weights(comfy, tiny_wan2, baseline):
    """One loader feeds both a quantized and a plain sampler; the plain one must be untouched."""
    graph = wan_t2v_graph(tiny_wan2["unet_name"], tiny_wan2["vae_name"], model_chain=[quantize_node()])
    graph["plain_sampler"] = {**graph["sampler"], "inputs": {**graph["sampler"]["inputs"], "model": ["unet", 0]}}
    graph["plain_latent"] = {"class_type": "SaveLatent",
                             "inputs": {"samples": ["plain_sampler", 0], "filename_prefix": "bigdit/plain"}}
    history = comfy.run(graph)
    assert torch.equal(comfy.latent(history, "plain_latent"), baseline)
    assert not torch.equal(comfy.latent(history, "save_latent"), baseline)


def test_quantizing_twice_is_idempotent(comfy, tiny_wan2):
    once = comfy.run(wan_t2v_graph(tiny_wan2["unet_name"], tiny_wan2["vae_name"], model_chain=[quantize_node()]))
    twice = comfy.run(wan_t2v_graph(tiny_wan2["unet_name"], tiny_wan2["vae_name"],
                                    model_chain=[quantize_node(), quantize_node()]))
    assert report_of(once).splitlines()[0] == "quantized 24/26 linear layers"  # head, time projection kept
    # The second node did nothing: it says so, and names what the first one did.
    second = report_of(twice, chain_id(1)).splitlines()
    assert second[0] == "quantized 0/26 linear layers"
    assert "already quantized, left alone: int8_convrot x24" in second
    assert torch.equal(comfy.latent(once, "save_latent"), comfy.latent(twice, "save_latent"))


def test_fp8_input_model_is_reported_as_quantized_before(comfy, tiny_wan2):
    """UNETLoader with weight_dtype fp8_e4m3fn already quantized every Linear; this node quantizes none."""
    history = comfy.run(wan_t2v_graph(tiny_wan2["unet_name"], tiny_wan2["vae_name"], weight_dtype="fp8_e4m3fn",
                                      model_chain=[quantize_node()]))
    lines = report_of(history).splitlines()
    assert lines[0] == "quantized 0/26 linear layers"
    assert "already quantized, left alone: float8_e4m3fn x26" in lines
    assert not any(line.startswith("formats:") for line in lines)
    plain = comfy.run(wan_t2v_graph(tiny_wan2["unet_name"], tiny_wan2["vae_name"], weight_dtype="fp8_e4m3fn"))
    assert torch.equal(comfy.latent(history, "save_latent"), comfy.latent(plain, "save_latent"))


def test_marker_loader_output_counts_only_the_new_layers(comfy, tiny_wan2):
    """MixedCheckpointLoader's quantized layers are listed by format; the first line counts this node's."""
    markers = {"blocks.0.self_attn.q": {"format": "int8_tensorwise"},
               "blocks.0.ffn.0": {"format": "float8_e4m3fn"}, "blocks.1.ffn.2": {"format": "float8_e4m3fn"}}
    path = write_markers(tiny_wan2["path"], comfy.models_dir / "diffusion_models" / "wan2_three_markers.safetensors",
                         markers)
    graph = wan_t2v_graph(None, tiny_wan2["vae_name"], loader=("MixedCheckpointLoader", {"unet_name": path.name}),
                          model_chain=[quantize_node()])
    lines = report_of(comfy.run(graph)).splitlines()
    assert lines[0] == "quantized 21/26 linear layers"  # 3 from the file, head and time projection kept
    assert "formats: int8_convrot x21" in lines
    assert "already quantized, left alone: float8_e4m3fn x2, int8_tensorwise x1" in lines


def test_unetloaders_marker_layers_are_linear_like(comfy, tiny_wan2):
    """UNETLoader builds ComfyUI's mixed-precision Linear (no nn.Linear subclass) for every layer of a marker
    file: its full-precision layers are quantized like any Linear, its FP8 layers counted as earlier."""
    markers = {"blocks.0.ffn.0": {"format": "float8_e4m3fn"}, "blocks.1.ffn.2": {"format": "float8_e4m3fn"}}
    path = write_markers(tiny_wan2["path"], comfy.models_dir / "diffusion_models" / "wan2_two_fp8_markers.safetensors",
                         markers, form="both", per_tensor_fp8=True)  # both forms: each host reads its own
    graph = wan_t2v_graph(path.name, tiny_wan2["vae_name"], model_chain=[quantize_node()])
    lines = report_of(comfy.run(graph)).splitlines()
    assert lines[0] == "quantized 22/26 linear layers", lines  # 2 FP8 from the file, head and time projection kept
    assert "already quantized, left alone: float8_e4m3fn x2" in lines, lines
    assert [line.strip() for line in lines if "not Linear-like" in line] == ["patch_embedding: not Linear-like (Conv3d)"]
