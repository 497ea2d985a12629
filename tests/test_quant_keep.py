"""quant/keep.py: the layers every quantizing node keeps by default, per architecture.

The patterns are checked against the real module names of upstream's classes in
tests/integration/test_keep_decisions.py; here, the decision on names alone.
"""
from bigdit.quant.keep import ARCHITECTURES, architectures, default_keep, describe_keep
from bigdit.quant.patterns import first_match

H3_NAMES = ["video_patch_proj", "audio_patch_proj", "condition_proj", "time_embedder.proj_in",
            "time_embedder.proj_out", "blocks.0.attn.qkv_proj", "blocks.0.mlp.fc2", "blocks.0.adaln_proj.linear",
            "final_layer.adaln_proj.linear", "final_layer.video_out", "final_layer.audio_out"]
WAN_NAMES = ["text_embedding.0", "time_embedding.0", "time_projection.1", "blocks.0.self_attn.q",
             "blocks.0.ffn.0", "head.head"]


def kept(names):
    patterns = default_keep(names)
    return {n for n in names if first_match(n, patterns)}


def test_h3_keeps_modulation_embeddings_and_heads():
    assert [a.name for a in architectures(H3_NAMES)] == ["MiniMax-H3"]
    assert kept(H3_NAMES) == {"video_patch_proj", "audio_patch_proj", "time_embedder.proj_in",
                              "time_embedder.proj_out", "blocks.0.adaln_proj.linear",
                              "final_layer.adaln_proj.linear", "final_layer.video_out", "final_layer.audio_out"}


def test_wan_keeps_head_and_time_projection():
    assert [a.name for a in architectures(WAN_NAMES)] == ["Wan"]
    assert kept(WAN_NAMES) == {"head.head", "time_projection.1"}


def test_unknown_model_keeps_nothing_by_default():
    # a Wan-like "head.*" in another model is not Wan's head: no signature, no default
    names = ["head.proj", "blocks.0.attn.q", "final_layer.linear", "x_adaln"]
    assert architectures(names) == [] and default_keep(names) == ()


def test_one_signature_module_is_not_enough():
    assert architectures(["video_patch_proj", "blocks.0.adaln_proj.linear"]) == []


def test_every_architecture_is_in_the_tooltip():
    text = describe_keep()
    for arch in ARCHITECTURES:
        assert f"{arch.name}: {', '.join(arch.keep)}" in text
