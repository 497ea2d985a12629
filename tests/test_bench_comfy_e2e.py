"""The end-to-end benchmark's own parts on CPU: the streaming safetensors writer, the random init, the lengths,
the graph checks and issue 12's summary (tests/bench/comfy_e2e.py, tests/bench/e2e_models.py)."""
import json
import math
import sys
from pathlib import Path

import pytest
import safetensors
import safetensors.torch
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent / "bench"))
import comfy_e2e  # noqa: E402
import e2e_models  # noqa: E402


def test_streaming_writer_round_trips_through_safetensors(tmp_path):
    tensors = {"a.weight": torch.randn(3, 5).bfloat16(), "a.bias": torch.randn(5).half(),
               "b.modulation": torch.randn(1, 6, 4), "c": torch.randn(7).bfloat16()}
    path = tmp_path / "m.safetensors"
    writer = e2e_models.StreamingSafetensorsWriter(path, [(k, tuple(v.shape), v.dtype) for k, v in tensors.items()],
                                                   metadata={"note": "x"})
    for name, value in tensors.items():
        writer.write(name, value)
    writer.close()
    loaded = safetensors.torch.load_file(str(path))
    assert loaded.keys() == tensors.keys()
    for name, value in tensors.items():
        assert loaded[name].dtype == value.dtype and torch.equal(loaded[name], value)
    with safetensors.safe_open(str(path), "pt") as f:
        assert f.metadata() == {"note": "x"}
    assert not path.with_name(path.name + ".tmp").exists()


def test_streaming_writer_refuses_out_of_order_and_leaves_no_file(tmp_path):
    path = tmp_path / "m.safetensors"
    writer = e2e_models.StreamingSafetensorsWriter(path, [("a", (2,), torch.bfloat16), ("b", (3,), torch.bfloat16)])
    with pytest.raises(ValueError, match="expected a"):
        writer.write("b", torch.zeros(3, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="never written"):
        writer.close()
    assert not path.exists() and not path.with_name(path.name + ".tmp").exists()


@pytest.mark.parametrize("name, shape, kind", [
    ("blocks.0.ffn.0.weight", (13824, 5120), "matrix"),
    ("patch_embedding.weight", (5120, 16, 1, 2, 2), "matrix"),
    ("blocks.3.modulation", (1, 6, 5120), "modulation"),
    ("head.modulation", (1, 2, 5120), "modulation"),
    ("blocks.0.norm3.weight", (5120,), "ones"),
    ("blocks.0.norm3.bias", (5120,), "zeros"),
    ("blocks.0.self_attn.norm_q.weight", (5120,), "ones"),
    ("blocks.0.ffn.0.bias", (13824,), "vector"),
])
def test_init_kind(name, shape, kind):
    assert e2e_models.init_kind(name, shape) == kind


def test_draw_is_variance_preserving_and_seeded():
    w = e2e_models.draw("x.weight", (512, 2048), 7, "cpu", torch.float32)
    assert abs(w.std().item() * math.sqrt(2048) - 1) < 0.02
    conv = e2e_models.draw("p.weight", (64, 16, 1, 2, 2), 7, "cpu", torch.float32)
    assert abs(conv.std().item() * 8 - 1) < 0.05  # fan_in 16 * 1 * 2 * 2 = 64
    assert torch.equal(e2e_models.draw("x.weight", (4, 4), 3, "cpu", torch.bfloat16),
                       e2e_models.draw("x.weight", (4, 4), 3, "cpu", torch.bfloat16))
    assert not torch.equal(e2e_models.draw("x.weight", (4, 4), 3, "cpu", torch.float32),
                           e2e_models.draw("x.weight", (4, 4), 4, "cpu", torch.float32))
    # a stack of residual blocks with these weights stays finite in fp16
    x = torch.randn(256, 512)
    for seed in range(40):
        h = torch.nn.functional.layer_norm(x, (512,))
        y = torch.nn.functional.gelu(h @ e2e_models.draw("f1.weight", (1024, 512), seed, "cpu", torch.float32).T)
        x = x + y @ e2e_models.draw("f2.weight", (512, 1024), seed + 99, "cpu", torch.float32).T
    assert x.half().isfinite().all() and x.std() < 10


def test_wan14b_lengths_are_the_issue_token_counts():
    wan = e2e_models.WAN14B
    assert wan.tokens(wan.length("long")) == 32760
    assert wan.tokens(wan.length("short")) == 7800
    assert wan.tokens(wan.length("832x480x41")) == 11 * 30 * 52
    with pytest.raises(ValueError, match="unknown length"):
        e2e_models.WAN14B.length("huge")


def test_h3_lengths_count_text_video_and_audio_tokens():
    h3 = e2e_models.H3_PRUNED
    # 107 frames: 32 latent frames of 24 x 42 patches, 178 audio frames (107 / 24 s at 40 a second), 256 text
    assert h3.tokens(h3.length("long")) == 256 + 32 * 24 * 42 + 178 == 32690
    assert h3.tokens(h3.length("short")) == 256 + 7 * 24 * 42 + 37
    assert h3.tokens(h3.length("1344x768x100")) == h3.tokens(h3.length("long"))  # snapped up to 107, as upstream
    assert h3.latent_inputs(h3.length("long")) == {"width": 1344, "height": 768, "length": 107}


def test_h3_graph_measures_the_video_part_of_the_av_latent():
    configs = comfy_e2e.make_configs("fa3_fp8")
    graph = comfy_e2e.sampling_graph(configs["pack_auto"], e2e_models.TINY_H3, "m.safetensors",
                                     e2e_models.TINY_H3.length("short"), 2, 0, "p")
    assert graph["latent"] == {"class_type": "EmptyMiniMaxH3LatentAV",
                               "inputs": {"width": 64, "height": 64, "length": 5}}
    assert graph["split"] == {"class_type": "LTXVSeparateAVLatent", "inputs": {"av_latent": ["sampler", 0]}}
    assert graph["save"]["inputs"]["samples"] == graph["report"]["inputs"]["samples"] == ["split", 0]
    wan = comfy_e2e.sampling_graph(configs["pack_auto"], e2e_models.TINY_WAN, "m.safetensors",
                                   e2e_models.TINY_WAN.length("short"), 2, 0, "p")
    assert "split" not in wan and wan["save"]["inputs"]["samples"] == ["sampler", 0]
    assert wan["latent"]["inputs"]["batch_size"] == 1


def test_graph_check_names_the_missing_choice():
    configs = comfy_e2e.make_configs("fa3_fp8")
    graph = comfy_e2e.sampling_graph(configs["pack_auto_fp8attn"], e2e_models.TINY_WAN, "m.safetensors",
                                     e2e_models.TINY_WAN.length("long"), 2, 0, "p")
    assert graph["sampler"]["inputs"]["model"] == ["timer", 0]
    assert graph["timer"]["inputs"]["model"] == ["m0", 0] and graph["m0"]["inputs"]["model"] == ["unet", 0]
    info = {node["class_type"]: {"input": {"required": {}}} for node in graph.values()}
    info["SetAttentionBackend"] = {"input": {"required": {"backend": [["auto", "sdpa", "sol"], {}]}}}
    info["LoadH3Quantized"] = {"input": {"required": {"unet_name": [["other.safetensors"], {}],
                                                      "quantization": [["auto", "none"], {}]}}}
    assert "does not offer 'fa3_fp8'" in comfy_e2e.unoffered_choice(graph, info)
    info["SetAttentionBackend"]["input"]["required"]["backend"][0].append("fa3_fp8")
    assert comfy_e2e.unoffered_choice(graph, info) is None  # unet_name is not checked: the file comes later
    # V3 nodes serve a combo as ["COMBO", {"options": [...]}]
    info["SetAttentionBackend"]["input"]["required"]["backend"] = ["COMBO", {"options": ["auto", "sol"]}]
    assert "does not offer 'fa3_fp8'" in comfy_e2e.unoffered_choice(graph, info)
    info["SetAttentionBackend"]["input"]["required"]["backend"][1]["options"].append("fa3_fp8")
    assert comfy_e2e.unoffered_choice(graph, info) is None
    del info["BigditStepTimer"]
    assert comfy_e2e.unoffered_choice(graph, info) == "node BigditStepTimer is not installed"


def _rec(config, step_s, family, capped=True, sol=False, tokens=32760, peak=None, model="wan14b", cosine=0.9995,
         lora=False, own_cap=False):
    return {"config": config, "family": family, "capped": capped, "sol": sol, "tokens": tokens, "length": "x",
            "model": model, "status": "ok", "step_s": step_s, "peak_gib": peak, "cosine": cosine, "lora": lora,
            "own_cap": own_cap}


def test_summary_follows_issue_12():
    results = [
        _rec("comfy_resident", 3.0, "comfy", capped=False, peak=29.9),
        _rec("comfy_capped", 3.1, "comfy", peak=20.8),
        _rec("comfy_fp8_fast", 2.7, "comfy", peak=16.6),
        _rec("pack_auto", 2.5, "pack", peak=16.8),
        _rec("pack_int8", 3.0, "pack", peak=17.0),
        _rec("pack_auto_sol", 1.5, "pack", sol=True, peak=16.9),
        _rec("pack_auto_fp8attn", 2.0, "pack", peak=16.8, cosine=0.994),  # faster, below the cosine bar
        _rec("pack_auto", 0.5, "pack", tokens=7800, peak=18.5),  # shorter: only its peak counts
        {**_rec("pack_auto_flash", None, "pack"), "status": "error"},
        _rec("pack_auto", 0.1, "pack", model="other", peak=99.0),  # another model
        # a LoRA and a smaller card: the LoRA cost, and nothing else (faster would not make them the best)
        _rec("pack_auto_lora", 2.55, "pack", peak=16.9, cosine=0.99, lora=True),
        _rec("pack_auto_12g", 2.4, "pack", peak=11.0, own_cap=True),
        _rec("pack_auto_lora_12g", 2.52, "pack", peak=11.2, cosine=0.99, lora=True, own_cap=True),
        # the pack with no cap: the reference of its capped runs, not a dense configuration under the cap
        _rec("pack_auto_resident", 2.2, "pack", capped=False, peak=40.0),
    ]
    detail, summary = comfy_e2e.summarize(results, {"wan14b": {}, "other": {}})
    assert list(summary) == ["dense_speedup", "sol_speedup", "vs_comfy_best", "peak_gib_capped", "lora_cost"]
    assert summary["lora_cost"] == pytest.approx(2.55 / 2.5 - 1)
    assert [(x["config"], x["base"]) for x in detail["lora"]] == [("pack_auto_lora", "pack_auto"),
                                                                  ("pack_auto_lora_12g", "pack_auto_12g")]
    assert detail["lora"][1]["cost"] == pytest.approx(2.52 / 2.4 - 1)
    assert summary["dense_speedup"] == pytest.approx(3.0 / 2.5)
    assert summary["sol_speedup"] == pytest.approx(3.0 / 1.5)
    assert summary["vs_comfy_best"] == pytest.approx(2.7 / 2.5)
    assert summary["peak_gib_capped"] == 18.5
    assert detail["best_pack_dense"]["config"] == "pack_auto" and detail["best_comfy_capped"]["config"] == \
        "comfy_fp8_fast" and detail["tokens"] == 32760
    assert detail["fastest_pack_dense"]["config"] == "pack_auto_fp8attn"
    assert detail["fastest_pack_dense_speedup"] == pytest.approx(3.0 / 2.0)
    assert detail["missing"] == []
    _, partial = comfy_e2e.summarize(results[3:4], {"wan14b": {}})
    assert partial == {"dense_speedup": None, "sol_speedup": None, "vs_comfy_best": None, "peak_gib_capped": 16.8,
                       "lora_cost": None}


def test_summary_of_runs_each_on_its_own_card_names_what_is_missing():
    """--configs pack_auto_12g (or pack_auto_12g,comfy_fp8_marker_12g without comfy_resident): every run at the
    length has its own card, so issue 12's numbers have nothing to compare; the LoRA cost still comes out."""
    results = [_rec("pack_auto_12g", 2.4, "pack", peak=11.0, cosine=None, own_cap=True),
               _rec("comfy_fp8_marker_12g", 2.9, "comfy", peak=11.5, cosine=None, own_cap=True),
               _rec("pack_auto_lora_12g", 2.52, "pack", peak=11.2, cosine=None, lora=True, own_cap=True)]
    detail, summary = comfy_e2e.summarize(results, {"wan14b": {}})
    assert summary == {"dense_speedup": None, "sol_speedup": None, "vs_comfy_best": None, "peak_gib_capped": None,
                       "lora_cost": None}
    assert detail["length"] == "x" and detail["tokens"] == 32760 and detail["reference"] is None
    assert [(x["config"], x["base"]) for x in detail["lora"]] == [("pack_auto_lora_12g", "pack_auto_12g")]
    assert detail["missing"] == [
        "no comfy_resident run: dense_speedup and sol_speedup need it",
        "no capped pack dense run: dense_speedup and vs_comfy_best need one",
        "no pack Sol run: sol_speedup needs one",
        "no capped ComfyUI run: vs_comfy_best needs one",
        "no capped pack run with a peak at any length: peak_gib_capped needs one"]
    # the reference alone: a pack run under the run's cap without a cosine is not counted as the best
    detail, summary = comfy_e2e.summarize(results + [_rec("comfy_resident", 3.0, "comfy", capped=False),
                                                     _rec("pack_auto", 2.5, "pack", peak=16.8, cosine=None)],
                                          {"wan14b": {}})
    assert summary["dense_speedup"] is None and summary["peak_gib_capped"] == 16.8
    assert detail["reference"]["config"] == "comfy_resident" and detail["missing"] == [
        "no capped pack dense run with a latent cosine of at least 0.999 against its reference: dense_speedup and "
        "vs_comfy_best need one",
        "no pack Sol run: sol_speedup needs one",
        "no capped ComfyUI run: vs_comfy_best needs one"]


def test_lora_configs_chain_the_bench_lora_and_keep_their_card():
    configs = comfy_e2e.make_configs("fa3_fp8")
    graph = comfy_e2e.sampling_graph(configs["pack_auto_lora_12g"], e2e_models.WAN14B, "m.safetensors",
                                     e2e_models.WAN14B.length("long"), 3, 0, "p")
    assert graph["m0"] == {"class_type": "LoraLoaderModelOnly", "inputs": {
        "lora_name": e2e_models.LORA_FILE, "strength_model": 1.0, "model": ["unet", 0]}}
    assert graph["unet"]["inputs"]["quantization"] == "auto" and graph["timer"]["inputs"]["model"] == ["m0", 0]
    assert configs["pack_auto_lora_12g"].cap_gib == 12.0 and configs["pack_auto_lora"].cap_gib is None
    assert {n for n, c in configs.items() if c.lora} == {"pack_auto_lora", "pack_auto_lora_12g",
                                                         *(n for n in comfy_e2e.LORA_2G_CONFIGS if "_lora2g" in n)}
    assert not any(configs[n].lora for n in comfy_e2e.DEFAULT_CONFIGS)


def test_turbo_sized_lora_configs_pair_with_their_twins():
    """--configs lora2g (issue 32): the pack on bf16 (auto) and on the INT8 marker file, ComfyUI's own on that file,
    on the card and resident, each beside its twin with the 1.82 GB LoRA; the summary pairs them."""
    configs = comfy_e2e.make_configs("fa3_fp8")
    pairs = [(n, comfy_e2e.LORA_SUFFIX.sub("", n, count=1)) for n in comfy_e2e.LORA_2G_CONFIGS if "_lora2g" in n]
    assert [base for _, base in pairs] == [
        "pack_auto", "pack_auto_resident", "pack_mixed_int8", "pack_mixed_int8_resident", "comfy_int8_marker",
        "comfy_int8_marker_resident"]
    for name, base in pairs:
        twin, plain = configs[name], configs[base]
        assert twin.chain == ((("LoraLoaderModelOnly", {"lora_name": e2e_models.LORA_2G_FILE, "strength_model": 1.0}),))
        assert (twin.loader, twin.capped, twin.cap_gib, twin.model_format, twin.needs, plain.chain) == (
            plain.loader, plain.capped, plain.cap_gib, plain.model_format, plain.needs, ()), name
    assert configs["pack_mixed_int8_resident"].model_format == "int8_convrot"
    results = [_rec("pack_auto", 5.8, "pack"), _rec("pack_auto_lora2g", 5.9, "pack", lora=True),
               _rec("comfy_int8_marker_resident", 4.0, "comfy", capped=False),
               _rec("comfy_int8_marker_resident_lora2g", 4.4, "comfy", capped=False, lora=True)]
    detail, summary = comfy_e2e.summarize(results, {"wan14b": {}})
    assert [(x["config"], x["base"]) for x in detail["lora"]] == [
        ("pack_auto_lora2g", "pack_auto"), ("comfy_int8_marker_resident_lora2g", "comfy_int8_marker_resident")]
    assert detail["lora"][1]["cost"] == pytest.approx(0.1) and summary["lora_cost"] is None


def test_lora_of_a_target_size(tmp_path):
    shapes = {"blocks.0.self_attn.q.weight": (256, 256), "blocks.0.ffn.0.weight": (512, 256)}
    model = tmp_path / "m.safetensors"
    safetensors.torch.save_file({k: torch.randn(v).bfloat16() for k, v in shapes.items()}, str(model))
    per_rank = 2 * (256 + 256 + 512 + 256)
    info = e2e_models.make_lora(model, tmp_path / "l.safetensors", seed=1, target_bytes=10.4 * per_rank)
    assert info["rank"] == 10 and info["bytes"] == 10 * per_rank


def test_random_lora_covers_every_block_linear(tmp_path):
    shapes = {"blocks.0.self_attn.q.weight": (256, 256), "blocks.0.ffn.0.weight": (512, 256),
              "blocks.0.ffn.0.bias": (512,), "blocks.0.modulation": (1, 6, 256), "blocks.0.norm3.weight": (256,),
              "head.head.weight": (64, 256), "patch_embedding.weight": (256, 16, 1, 2, 2)}
    model = tmp_path / "m.safetensors"
    safetensors.torch.save_file({k: torch.randn(v).bfloat16() for k, v in shapes.items()}, str(model))
    assert e2e_models.lora_targets(shapes) == [("blocks.0.self_attn.q", 256, 256), ("blocks.0.ffn.0", 512, 256)]
    info = e2e_models.make_lora(model, tmp_path / "loras" / "l.safetensors", rank=8, seed=1)
    lora = safetensors.torch.load_file(str(tmp_path / "loras" / "l.safetensors"))
    assert info["layers"] == 2 and info["rank"] == 8
    assert lora["diffusion_model.blocks.0.ffn.0.lora_up.weight"].shape == (512, 8)
    assert lora["diffusion_model.blocks.0.ffn.0.lora_down.weight"].shape == (8, 256)
    delta = (lora["diffusion_model.blocks.0.ffn.0.lora_up.weight"].float()
             @ lora["diffusion_model.blocks.0.ffn.0.lora_down.weight"].float())
    assert 0.01 < delta.std().item() * 256 ** 0.5 < 0.04  # about 2% of a unit-variance weight's scale


def test_compare_latents():
    ref = torch.randn(1, 16, 3, 4, 4)
    assert comfy_e2e.compare(ref, ref) == {"rel_l2": 0.0, "cosine": pytest.approx(1.0), "finite": True}
    out = comfy_e2e.compare(ref * 2, ref)
    assert out["rel_l2"] == pytest.approx(1.0) and out["cosine"] == pytest.approx(1.0)
    bad = ref.clone()
    bad[0, 0, 0, 0, 0] = float("nan")
    assert comfy_e2e.compare(bad, ref)["finite"] is False


def test_options_put_the_reference_first(tmp_path):
    comfyui = tmp_path / "comfyui"
    comfyui.mkdir()
    (comfyui / "main.py").write_text("")
    opts = comfy_e2e.parse_args(["--comfyui", str(comfyui), "--configs", "pack_auto,comfy_resident",
                                 "--configs-at", "short=pack_int8", "--work", str(tmp_path)])
    assert opts.configs == ["comfy_resident", "pack_auto"] and opts.configs_at == {"short": ["pack_int8"]}
    assert opts.models == ["wan14b"] and opts.lengths == ["long", "short"] and opts.steps == 3
    with pytest.raises(SystemExit):
        comfy_e2e.parse_args(["--comfyui", str(comfyui), "--configs", "nope"])


def test_sage_configs_set_the_packs_sage_and_the_hosts_own_switches(tmp_path):
    configs = comfy_e2e.make_configs("fa3_fp8")
    length = e2e_models.WAN14B.length("long")
    pack = comfy_e2e.sampling_graph(configs["pack_auto_sage"], e2e_models.WAN14B, "m.safetensors", length, 3, 0, "p")
    assert pack["m0"]["class_type"] == "SetAttentionBackend" and pack["m0"]["inputs"]["backend"] == "sage"
    hybrid = comfy_e2e.sampling_graph(configs["pack_auto_sol_sage"], e2e_models.WAN14B, "m.safetensors", length,
                                      3, 0, "p")["m0"]["inputs"]
    assert (hybrid["backend"], hybrid["dense_backend"], hybrid["sol_tau"]) == ("sol", "sage", 1.0)
    assert configs["pack_auto_sol_sage"].sol and not configs["pack_auto_sage"].sol
    for name, flag in (("comfy_fp8_fast_sage", "--use-sage-attention"), ("comfy_fp8_fast_ck", "--use-ck-attention")):
        config = configs[name]
        assert config.family == "comfy" and config.comfy_args == (flag,) and config.chain == ()
        assert config.loader == ("UNETLoader", {"weight_dtype": "fp8_e4m3fn_fast"})
    # the host's own INT8 attention switch is read off its source
    (tmp_path / "comfy").mkdir()
    (tmp_path / "comfy" / "cli_args.py").write_text('attn_group.add_argument("--use-sage-attention")\n')
    assert comfy_e2e.host_features(tmp_path)["ck_attention"] is False
    (tmp_path / "comfy" / "cli_args.py").write_text('attn_group.add_argument("--use-ck-attention")\n')
    assert comfy_e2e.host_features(tmp_path)["ck_attention"] is True
    assert configs["comfy_fp8_fast_ck"].needs == "ck_attention"


def bench_node_module(monkeypatch):
    """The benchmark's test node module (tests/fixtures/bigdit_testnodes/bench.py). It imports ComfyUI's
    modules, which the functions tested here never touch: empty stand-ins are enough."""
    import importlib.util
    import types
    comfy = types.ModuleType("comfy")
    comfy.model_management, comfy.patcher_extension = (types.ModuleType(f"comfy.{n}")
                                                       for n in ("model_management", "patcher_extension"))
    for module in (comfy, comfy.model_management, comfy.patcher_extension):
        monkeypatch.setitem(sys.modules, module.__name__, module)
    path = Path(__file__).parent / "fixtures" / "bigdit_testnodes" / "bench.py"
    spec = importlib.util.spec_from_file_location("bigdit_testnodes_bench", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    return bench


def test_step_breakdown_sorts_kernels_by_kind(monkeypatch):
    bench = bench_node_module(monkeypatch)
    kernels = [("nvjet_hsh_256x128_64x4_2x1_v_bz_coopA_NNT", 4000.0),  # cuBLAS on Hopper
               ("sm90_xmma_gemm_e4m3bf16_e4m3f32_f32_tn_n_tilesize128x128x128", 3000.0),
               ("void flash::flash_fwd_kernel<Flash_fwd_kernel_traits<128>>", 2500.0),
               ("qk_int8_sv_f8_accum_f32_attn_inst_buf<128, 64, ...>", 2000.0),  # SageAttention 2's sm90 kernel
               ("cudnn_generated_fort_native_sdpa_sm90_knob_7", 1000.0),
               ("Memcpy HtoD (Pinned -> Device)", 500.0),
               ("triton_poi_fused_add_mul_0", 250.0), ("void at::native::vectorized_elementwise_kernel", 250.0),
               ("nvjet_hsh_256x128_64x4_2x1_v_bz_coopA_NNT", 1000.0)]
    out = bench.breakdown(kernels)
    assert (out["gemm_ms"], out["attention_ms"], out["copies_ms"], out["other_ms"]) == (8.0, 5.5, 0.5, 0.5)
    assert out["total_ms"] == 14.5
    assert out["top"][0] == {"kernel": "nvjet_hsh_256x128_64x4_2x1_v_bz_coopA_NNT", "kind": "gemm", "ms": 5.0}
    assert len(out["top"]) == 8


def test_format_configs_name_each_loadh3quantized_choice(tmp_path):
    from bigdit.host.options import QUANTIZATIONS
    configs = comfy_e2e.make_configs("fa3_fp8")
    chosen = {name: configs[name].loader[1]["quantization"] for name in comfy_e2e.FORMAT_CONFIGS[1:]
              if configs[name].model_format == "bf16"}
    nvfp4 = configs["pack_mixed_nvfp4"]  # NVFP4: the pack loads a file of the same weights (no online NVFP4)
    assert nvfp4.loader[0] == "MixedCheckpointLoader" and nvfp4.model_format == "nvfp4" and nvfp4.capped
    assert chosen == {"pack_fp8": "float8_e4m3fn", "pack_auto": "auto", "pack_int8": "int8_convrot",
                      "pack_w4a8": "asym_w4a8_int8",
                      "pack_w4a4": "convrot_w4a4"}
    assert set(chosen.values()) <= set(QUANTIZATIONS.values)  # the node's own strings, not old spellings
    assert all(configs[n].capped and configs[n].loader[0] == "LoadH3Quantized" for n in chosen)
    assert not set(chosen) - {"pack_int8", "pack_auto"} & set(comfy_e2e.DEFAULT_CONFIGS)
    comfyui = tmp_path / "comfyui"
    comfyui.mkdir()
    (comfyui / "main.py").write_text("")
    opts = comfy_e2e.parse_args(["--comfyui", str(comfyui), "--configs", "formats,pack_auto_sage", "--work", str(tmp_path)])
    assert opts.configs == [*comfy_e2e.FORMAT_CONFIGS, "pack_auto_sage"]


def _server_report(step_s, model_bytes, device_peak):
    """What BigditRunReport returns (tests/fixtures/bigdit_testnodes/bench.py), for comfy_e2e.measurements."""
    return {"step_seconds": [step_s * 2, step_s, step_s], "calls_per_step": [1, 1, 1], "first_call": 110.0,
            "timer_node": 105.0, "sample_start": 106.0, "sample_end": 120.0, "latent_shape": [1, 16, 2, 4, 4],
            "comfy_total_vram": 24 * 2 ** 30, "emulated_vram": 24 * 2 ** 30, "peak_before_sampling": 2 ** 30,
            "peak_sampling": 2 * 2 ** 30, "reserved_peak_sampling": 3 * 2 ** 30, "model_bytes": model_bytes,
            "device_used_peak_sampling": device_peak}


def _formats_payload():
    """A comfy_e2e.py payload of a formats run, records made as run_one and add_comparison make them."""
    entry = {"status": {"messages": [["execution_start", {"timestamp": 100_000}]]}}
    gen = torch.Generator().manual_seed(0)
    reference = torch.randn(1, 16, 2, 4, 4, generator=gen)
    runs = {"comfy_resident": (4.0, 28 * 2 ** 30, 33 * 2 ** 30, 0.0),
            "pack_fp8": (3.2, 14 * 2 ** 30, 18 * 2 ** 30, 0.03),
            "pack_int8": (4.0, 14 * 2 ** 30, 18.5 * 2 ** 30, 0.015),
            "pack_w4a4": (2.5, 7.5 * 2 ** 30, 11 * 2 ** 30, 0.1)}
    results = []
    for config, (step_s, weights, device_peak, noise) in runs.items():
        rec = {"config": config, "family": "comfy" if config == "comfy_resident" else "pack", "model": "wan14b",
               "length": "long", "capped": config != "comfy_resident", "status": "ok",
               **comfy_e2e.measurements(_server_report(step_s, weights, device_peak), entry)}
        rec.update(comfy_e2e.compare(reference + noise * torch.randn(reference.shape, generator=gen), reference))
        rec["vs_resident"] = 4.0 / step_s
        results.append(rec)
    results.append({"config": "pack_w4a8", "model": "wan14b", "length": "long", "status": "error", "error": "x"})
    results.append({**results[1], "length": "short"})  # another length: not in the long table
    return {"bench": "comfy-e2e", "settings": {"models": ["wan14b"]}, "models": {}, "results": results}


def test_formats_table_renders_each_format_from_the_run():
    import doc_tables
    payload = _formats_payload()
    fp8 = next(r for r in payload["results"] if r["config"] == "pack_fp8")
    assert fp8["weights_bytes"] == 14 * 2 ** 30 and fp8["weights_gib"] == 14.0
    lines = doc_tables.formats_table(payload).splitlines()
    assert lines[0] == "| format | weight GiB | latent cosine | rel L2 | s/step | vs resident | peak VRAM GiB |"
    ran = {r["config"] for r in payload["results"]}
    assert [line.split(" | ")[0] for line in lines[2:]] == [f"| {label}" for c, label in doc_tables.FORMATS
                                                            if c in ran]  # a format left out has no row
    assert [c for c, _ in doc_tables.FORMATS] == list(comfy_e2e.FORMAT_CONFIGS)
    assert lines[2] == "| bf16 (reference, ComfyUI UNETLoader) | 28.00 | 1.00000 | 0.0000 | 4.000 | 1.00x | 33.0 |"
    cells = lines[3].split(" | ")
    assert cells[1] == "14.00" and cells[4:] == ["3.200", "1.25x", "18.0 |"]
    assert 0.999 < float(cells[2]) < 1 and 0.02 < float(cells[3]) < 0.04
    assert lines[5] == "| W4A8 (`asym_w4a8_int8`) | error | — | — | — | — | — |"
    assert lines[6].startswith("| W4A4 (`convrot_w4a4`) | 7.50 |") and lines[6].endswith("| 2.500 | 1.60x | 11.0 |")
    for r in payload["results"]:  # a CPU run measures no GPU memory
        for key in ("peak_gib", "device_used_peak_sampling_gib"):
            r.pop(key, None)
    assert doc_tables.formats_table(payload).splitlines()[2].endswith("| 4.000 | 1.00x | — |")
    short = doc_tables.formats_table(payload, "wan14b", "short").splitlines()
    assert short[2].endswith("| not run | — | — | — | — | — |")
    assert short[3].startswith("| FP8 (`float8_e4m3fn`) | 14.00 |")


def test_formats_table_takes_a_format_the_run_left_out_from_another_run_against_that_runs_reference():
    import doc_tables
    payload = _formats_payload()
    other = _formats_payload()
    for r in other["results"]:  # another run: a slower reference, and the NVFP4 file
        if "step_seconds" in r:
            r["step_seconds"] = [s * 2 for s in r["step_seconds"]]
    nvfp4 = {**next(r for r in other["results"] if r["config"] == "pack_fp8"), "config": "pack_mixed_nvfp4",
             "weights_gib": 8.0}
    other["results"].append(nvfp4)
    other["results"].append({**nvfp4, "config": "pack_fp8", "weights_gib": 99.0})  # the first run has its own
    lines = doc_tables.formats_table(payload, more=(other,)).splitlines()
    assert lines[:-1] == doc_tables.formats_table(payload).splitlines()
    assert lines[-1].startswith("| NVFP4 file (`nvfp4`, MixedCheckpointLoader) | 8.00 |")
    # 6.4 s against that run's 8.0 s reference, not the first run's 4.0 s
    assert lines[-1].endswith("| 6.400 | 1.25x | 18.0 |")


def test_full_h3_marker_files_quantize_its_adaln_in_8_bits():
    """The full H3's AdaLN projections (2688 wide: ConvRot's 256 does not divide it) are plain per-channel INT8
    in the int8_convrot file and FP8 in the fp8 file; the other block linears keep the file's marker."""
    adaln, qkv = (5376 * 18, 2688), (21504, 5376)
    assert e2e_models.layer_marker("int8_convrot", "blocks.3.adaln_proj.linear.weight", adaln) == \
        {"format": "int8_tensorwise"}
    assert e2e_models.layer_marker("int8_convrot", "blocks.3.attn.qkv_proj.weight", qkv) == \
        e2e_models.FORMATS["int8_convrot"]
    assert e2e_models.layer_marker("fp8", "blocks.3.adaln_proj.linear.weight", adaln) == {"format": "float8_e4m3fn"}
    assert e2e_models.layer_marker("fp8", "blocks.3.adaln_proj.linear.bias", (96768,)) is None
    assert e2e_models.layer_marker("bf16", "blocks.3.attn.qkv_proj.weight", qkv) is None
    assert e2e_models.layer_marker("int8_convrot", "token_refiner.blocks.0.mlp.fc1.weight", (28672, 5376)) is None
    rows = (384, adaln[1])  # AdaLN's width; fewer rows keep the CPU's quantization small
    entries = e2e_models.layer_entries("int8_convrot", "blocks.0.adaln_proj.linear.weight", rows, "cpu")
    assert [(n, s, d) for n, s, d in entries[:2]] == [
        ("blocks.0.adaln_proj.linear.weight", rows, torch.int8),
        ("blocks.0.adaln_proj.linear.weight_scale", (rows[0], 1), torch.float32)]
    # written as comfy-kitchen quantizes a per-channel INT8 weight without rotation
    from comfy_kitchen.tensor.int8 import TensorWiseINT8Layout
    weight = torch.randn(64, 2688).bfloat16()
    tensors = e2e_models.quantize({"format": "int8_tensorwise"}, weight)
    qdata, params = TensorWiseINT8Layout.quantize(weight, is_weight=True, per_channel=True, convrot=False)
    assert torch.equal(tensors["weight"], qdata) and torch.equal(tensors["weight_scale"], params.scale.float())
    spec = e2e_models.MODELS["h3full"]
    assert "adaln_curve_grid" not in spec.kwargs and spec.tokens(spec.length("long")) == 32690


def test_each_configuration_compares_with_its_own_file_resident(tmp_path):
    comfyui = tmp_path / "comfyui"
    comfyui.mkdir()
    (comfyui / "main.py").write_text("")
    opts = comfy_e2e.parse_args(["--comfyui", str(comfyui), "--models", "h3full", "--configs", "full",
                                 "--work", str(tmp_path)])
    assert opts.configs[:2] == ["comfy_int8_marker_resident", "comfy_fp8_marker_resident"]  # references first
    assert set(opts.configs) == set(comfy_e2e.FULL_CONFIGS)
    configs = comfy_e2e.make_configs("fa3_fp8")
    assert configs["pack_mixed_int8"].loader[0] == "MixedCheckpointLoader" and configs["pack_mixed_int8"].capped
    assert not configs["comfy_fp8_marker_resident"].capped

    bench = comfy_e2e.Bench.__new__(comfy_e2e.Bench)
    gen = torch.Generator().manual_seed(0)
    latents = {fmt: torch.randn(1, 4, 2, 4, 4, generator=gen) for fmt in ("bf16", "int8_convrot")}
    bench.payload, bench.latents = {"results": []}, {}

    def add(config, fmt, step_s, latent):
        rec = {"config": config, "model": "h3full", "length": "long", "model_format": fmt, "status": "ok",
               "step_s": step_s}
        bench.latents[("h3full", "long", config)] = latent
        bench.payload["results"].append(rec)  # as Bench.record does
        bench.add_comparison(rec)
        return rec

    assert add("comfy_int8_marker_resident", "int8_convrot", 4.0, latents["int8_convrot"])["vs_resident"] == 1.0
    rec = add("pack_mixed_int8", "int8_convrot", 5.0, latents["int8_convrot"])
    assert rec["reference"] == "comfy_int8_marker_resident" and rec["vs_resident"] == pytest.approx(0.8)
    assert rec["cosine"] == pytest.approx(1.0)
    # no fp8 file ran resident: comfy_resident stands in, and where none ran there is no comparison
    assert add("pack_mixed_fp8", "fp8", 5.0, latents["bf16"])["reference"] is None


def test_the_steady_step_leaves_out_the_profiled_one():
    assert comfy_e2e.steady_steps([9.0, 4.0, 3.0, 3.2], 1) == [3.0, 3.2]
    assert comfy_e2e.steady_steps([9.0, 4.0, 3.0], None) == [4.0, 3.0]  # nothing profiled (CPU)
    assert comfy_e2e.steady_steps([9.0, 4.0], 1) == [4.0]  # no other step left: the profiled one
    assert comfy_e2e.steady_steps([9.0], None) == [9.0]
    # records written before the bench said which step it profiled: the second, wherever a breakdown is
    assert comfy_e2e.profiled_step({"breakdown": {"gemm_ms": 1.0}}) == 1
    assert comfy_e2e.profiled_step({"breakdown": None}) is None
    assert comfy_e2e.profiled_step({"breakdown": {"gemm_ms": 1.0}, "profiled_step": 2}) == 2
    entry = {"status": {"messages": [["execution_start", {"timestamp": 100_000}]]}}
    report = {**_server_report(3.0, 2 ** 30, 2 ** 30), "step_seconds": [9.0, 4.0, 3.0], "profiled_step": 1}
    assert comfy_e2e.measurements(report, entry)["step_s"] == 3.0


def test_a_profiled_call_is_timed_without_the_profilers_own_work(monkeypatch):
    """The profiled call's end is read before the profiler stops and its events are read (measured on the
    H200: 0.4-1.9 s more on the profiled step)."""
    import time
    bench = bench_node_module(monkeypatch)

    class SlowProfiler:  # stopping and reading events takes 0.3 s, as CUPTI's event reading does at scale
        def __init__(self, **_):
            pass

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            time.sleep(0.3)

        def events(self):
            return []

    monkeypatch.setattr(torch.profiler, "profile", SlowProfiler)
    monkeypatch.setattr(bench, "_cuda", lambda: True)
    monkeypatch.setattr(bench, "_sync", lambda: None)
    monkeypatch.setattr(bench, "_host_memory", lambda: {})
    record = bench._RECORD = bench._Record(timer_node=None, model_bytes=0)
    for t in (0.9, 0.5, 0.1):  # one call a step; the second step's is profiled
        bench._apply_model(lambda x, t: x, torch.zeros(1), torch.tensor([t]))
    report = record.as_dict()
    assert report["profiled_step"] == 1 and report["breakdown"]["timestep"] == pytest.approx(0.5)
    assert max(report["step_seconds"]) < 0.1, report["step_seconds"]


@pytest.mark.parametrize("shape", [(48, 768), (384, 512)])  # NVFP4 pads its scales' rows to 128, and no further
@pytest.mark.parametrize("fmt", ["int8_convrot", "fp8", "w4a8", "w4a4", "nvfp4"])
def test_marker_file_entries_are_what_quantize_writes(fmt, shape):
    """layer_entries gives each role the shape and dtype a real layer's quantized tensors have."""
    marker = e2e_models.layer_marker(fmt, "blocks.0.ffn.0.weight", shape)
    tensors = e2e_models.quantize(marker, torch.randn(shape).bfloat16())
    entries = e2e_models.layer_entries(fmt, "blocks.0.ffn.0.weight", shape, "cpu")
    assert entries[:-1] == [(f"blocks.0.ffn.0.{role}", tuple(t.shape), t.dtype) for role, t in tensors.items()]
    assert entries[-1][0] == "blocks.0.ffn.0.comfy_quant"
    assert json.loads(bytes(e2e_models.marker_tensor(marker).tolist())) == e2e_models.FORMATS[fmt]
    # the full H3's AdaLN (2688 wide, no ConvRot group of 256): plain INT8 in every ConvRot format
    adaln = e2e_models.layer_marker(fmt, "blocks.0.adaln_proj.linear.weight", (96768, 2688))
    assert adaln == (e2e_models.FORMATS[fmt] if fmt in ("fp8", "nvfp4") else {"format": "int8_tensorwise"})


@torch.no_grad()
def test_placement_check_reads_the_ratios_of_the_sessions_run_line():
    from bigdit.offload.plan import plan_placement
    from bigdit.offload.session import StreamSession

    model = torch.nn.Module()
    model.blocks = torch.nn.ModuleList(torch.nn.Linear(64, 64) for _ in range(3))
    model.blocks[0].to("meta")  # "meta" stands for the GPU: blocks 1 and 2 stay in host memory
    plan = plan_placement([64 * 65 * 4] * 3, 0, 0, capacity_bytes=1 << 30, reserve_bytes=0, workspace_bytes=0)
    session = StreamSession(plan, torch.device("meta"), streams=True)
    session.start(model)
    for block in model.blocks:
        block(torch.zeros(1, 64, device="meta"))
    line = session.close(allocator_peak=session.placed.estimated_peak * 3 // 2)
    lines = ["loading ...", f"[BigDiT] offload: {line}", "Prompt executed"]
    # one forward: blocks 1 and 2, then block 1 again for the next forward
    assert comfy_e2e.placement_check(lines) == {"stream_ratio": 1.5, "peak_ratio": 1.5}
    assert comfy_e2e.placement_check(["nothing streamed"]) is None
