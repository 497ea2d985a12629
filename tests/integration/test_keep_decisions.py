"""The layers kept in full precision by default (quant/keep.py), against the real models.

- Every keep pattern of an architecture matches a Linear of the host's own model class at its full
  size, and every Linear the class pins to fp32 is kept (MiniMax-H3 on a host with native H3,
  Wan on every host).
- QuantizeModelINT8 (which sees the loaded model; on CPU every layer computes in fp32, so fp32 on
  purpose cannot be seen there) and LoadH3Quantized (which sees the file) keep the same layers
  for the same reasons.
"""
import fnmatch

import pytest

from bigdit.quant.keep import architectures, default_keep
from bigdit.quant.patterns import first_match
from graphs import add_preview, chain_id, h3_graph, node_report, wan_t2v_graph
from tiny_models import linear_layers

pytestmark = pytest.mark.integration


def check_against(linears, architecture, every_pattern_used=True):
    assert [a.name for a in architectures(linears)] == [architecture]
    (arch,) = architectures(linears)
    if every_pattern_used:
        for pattern in arch.keep:
            assert any(fnmatch.fnmatchcase(name, pattern) for name in linears), pattern
    kept = default_keep(linears)
    fp32 = [name for name, dtype in linears.items() if dtype == "float32"]
    assert all(first_match(name, kept) for name in fp32), [n for n in fp32 if not first_match(n, kept)]
    return {name for name in linears if first_match(name, kept)}, fp32


@pytest.mark.host_feature("minimax_h3")
def test_keep_patterns_match_upstreams_h3(comfy):
    linears = linear_layers("minimax_h3", comfy.host)  # 50 blocks, hidden 5376
    kept, fp32 = check_against(linears, "MiniMax-H3")
    assert sorted(fp32) == ["audio_patch_proj", "final_layer.audio_out", "final_layer.video_out",
                            "time_embedder.proj_in", "time_embedder.proj_out", "video_patch_proj"]
    # 50 block AdaLN projections + the final layer's, besides the fp32 layers; nothing of the
    # attention, MLPs, token refiner or condition projection
    assert len(kept) == len(fp32) + 51
    assert not any(first_match(n, tuple(kept)) for n in ("condition_proj", "blocks.0.attn.qkv_proj",
                                                         "blocks.49.mlp.fc2", "token_refiner.blocks.1.mlp.fc1"))


@pytest.mark.host_feature("minimax_h3")
def test_keep_patterns_hold_for_h3_with_adaln_curves(comfy):
    # the curve-form checkpoints: no time embedder, every AdaLN projection in fp32
    linears = linear_layers("minimax_h3", comfy.host, adaln_curve_grid=64)
    kept, fp32 = check_against(linears, "MiniMax-H3", every_pattern_used=False)
    assert sum(".adaln_proj." in name for name in fp32) == 51


def test_keep_patterns_match_the_hosts_wan(comfy):
    linears = linear_layers("wan", comfy.host)
    kept, _ = check_against(linears, "Wan")
    assert kept == {"head.head", "time_projection.1"}


def kept_section(report: str) -> list[str]:
    """The "  name: reason" lines of Linears kept, in order."""
    lines = report.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("kept in original precision"))
    return [line for line in lines[start + 1:] if line.startswith("  ") and "not Linear-like" not in line]


def same_decisions(comfy, quantize_graph, loader_graph):
    quantize_report = node_report(comfy.run(quantize_graph), chain_id(0))
    report_id = add_preview(loader_graph, "unet", 1)
    loader_report = comfy.run(loader_graph)["outputs"][report_id]["text"][0]
    assert quantize_report.splitlines()[0] == loader_report.splitlines()[0]
    assert kept_section(quantize_report) == kept_section(loader_report)
    return kept_section(quantize_report)


QUANTIZE = ("QuantizeModelINT8", {"group_size": "256", "ignored_layers": "", "row_split": "auto"})


def loader(unet_name):
    return ("LoadH3Quantized", {"unet_name": unet_name, "quantization": "int8_convrot", "offload": "none",
                                "group_size": "256", "ignored_layers": ""})


@pytest.mark.host_feature("minimax_h3")
def test_quantize_node_and_loader_keep_the_same_h3_layers(comfy, tiny_h3):
    kept = same_decisions(comfy, h3_graph(tiny_h3["unet_name"], tiny_h3["text_dim"], model_chain=[QUANTIZE]),
                          h3_graph(None, tiny_h3["text_dim"], loader=loader(tiny_h3["unet_name"])))
    assert kept == [
        "  video_patch_proj: ignored (matches '*_patch_proj')",
        "  audio_patch_proj: ignored (matches '*_patch_proj')",
        "  time_embedder.proj_in: ignored (matches 'time_embedder.*')",
        "  time_embedder.proj_out: ignored (matches 'time_embedder.*')",
        "  blocks.0.adaln_proj.linear: ignored (matches '*adaln*')",
        "  blocks.1.adaln_proj.linear: ignored (matches '*adaln*')",
        "  final_layer.adaln_proj.linear: ignored (matches '*adaln*')",
        "  final_layer.video_out: ignored (matches 'final_layer.*')",
        "  final_layer.audio_out: ignored (matches 'final_layer.*')",
    ]


def test_quantize_node_and_loader_keep_the_same_wan_layers(comfy, tiny_wan2):
    kept = same_decisions(comfy, wan_t2v_graph(tiny_wan2["unet_name"], tiny_wan2["vae_name"], model_chain=[QUANTIZE]),
                          wan_t2v_graph(None, tiny_wan2["vae_name"], loader=loader(tiny_wan2["unet_name"])))
    assert "  head.head: ignored (matches 'head.*')" in kept
    assert "  time_projection.1: ignored (matches 'time_projection.*')" in kept
