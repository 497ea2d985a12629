"""The whole-job benchmark (tests/bench/whole_job.py): its prompts, graphs, file layouts and timing on CPU, and
one --tiny run end to end on upstream ComfyUI 0.33.0 (integration: a template and a pack configuration)."""
import copy
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

TESTS = Path(__file__).resolve().parent
sys.path.insert(0, str(TESTS / "bench"))
import e2e_models  # noqa: E402
import whole_job  # noqa: E402
from comfy_harness import HOSTS, in_ci  # noqa: E402

PACK_OBJECT_INFO = json.loads((TESTS / "fixtures" / "object_info_0.33.0.json").read_text())
# upstream's CLIPLoader as 0.33.0 declares it (the snapshot holds the pack's nodes only)
CLIP_LOADER = {"input": {"required": {"clip_name": [["x"], {}], "type": [["minimax"], {}]},
                         "optional": {"device": [["default", "cpu"], {}]}}}


def object_info(without=(), **extra_inputs):
    """The pack's snapshot and CLIPLoader, with inputs added (`extra_inputs`) or taken out (`without`, "Node.input")."""
    info = {**copy.deepcopy(PACK_OBJECT_INFO), "CLIPLoader": CLIP_LOADER}
    for class_type, names in extra_inputs.items():
        info[class_type]["input"]["required"].update({name: [["auto"], {}] for name in names})
    for item in without:
        class_type, name = item.split(".")
        for kind in ("required", "optional"):
            info[class_type]["input"].get(kind, {}).pop(name, None)
    return info


def test_prompts_are_the_front_ends_and_differ_only_in_turbo_mode():
    assert whole_job.load_prompt("pack", "default") == json.loads(
        (TESTS.parent / "example_workflows" / "api" / "bigdit-minimax-h3-t2v.json").read_text())
    for name in ("template", "pack"):
        default, turbo = whole_job.load_prompt(name, "default"), whole_job.load_prompt(name, "turbo")
        assert [k for k in default if default[k] != turbo[k]] == ["140:139"]
        assert (default["140:139"]["inputs"], turbo["140:139"]["inputs"]) == ({"value": False}, {"value": True})
        # the template's defaults: 0.4 MP at 16:9 (864x480), 5 s, 20 steps or 8 with the turbo LoRA
        assert default["115"]["inputs"]["megapixels"] == 0.4 and default["140:133"]["inputs"]["value"] == 5
        assert [default[k]["inputs"]["value"] for k in ("140:137", "140:138")] == [20, 8]


def test_the_files_are_named_as_the_template_names_them():
    files = whole_job.template_files(whole_job.load_prompt("template", "turbo"))
    assert files == {
        "dit": ("diffusion_models", "minimax_h3_fl2va_pruned_int8_convrot.safetensors"),
        "text_encoder": ("text_encoders", "qwen3vl_32b_minimax_h3_nvfp4_awq.safetensors"),
        "video_vae": ("vae", "minimax_h3_video_vae_int8_convrot.safetensors"),
        "audio_vae": ("vae", "minimax_h3_audio_vae_fp32.safetensors"),
        "lora": ("loras", "minimax_h3_fl2v_turbo_8step_v1.0_comfyui_bf16.safetensors")}


def test_pack_fast_changes_the_loader_and_backend_and_passes_int8_only_where_listed():
    config = whole_job.CONFIGS["pack_fast"]
    graph, left_out = whole_job.job_graph(config, "turbo", object_info(without=["MixedCheckpointLoader.int8"]),
                                          "QuantizedCLIPLoader", None)
    loader = graph["140:127"]
    assert loader == {"class_type": "MixedCheckpointLoader", "_meta": loader["_meta"], "inputs": {
        "unet_name": "minimax_h3_fl2va_pruned_int8_convrot.safetensors", "nvfp4": "auto"}}
    assert left_out == ["MixedCheckpointLoader.int8"]
    listed, left_out = whole_job.job_graph(config, "turbo", object_info(), "QuantizedCLIPLoader", None)
    assert listed["140:127"]["inputs"]["int8"] == "auto" and left_out == []
    assert graph["140:141"]["inputs"]["backend"] == "sage"
    assert graph["140:128"]["class_type"] == "QuantizedCLIPLoader"
    # the same links as the shipped graph: the LoRA and the switch still take the loader's model
    assert graph["140:134"]["inputs"]["model"] == graph["140:135"]["inputs"]["on_false"] == ["140:127", 0]


def test_instrumentation_times_the_sampled_model_and_captures_the_final_latent():
    graph, _ = whole_job.job_graph(whole_job.CONFIGS["template"], "default", object_info(), "QuantizedCLIPLoader",
                                   None)
    shipped = whole_job.load_prompt("template", "default")
    assert graph["bench_timer"]["inputs"]["model"] == shipped["140:126"]["inputs"]["model"] == ["140:135", 0]
    assert graph["140:126"]["inputs"]["model"] == ["bench_timer", 0]
    assert graph["bench_split"]["inputs"]["av_latent"] == ["140:125", 0]
    assert graph["bench_video"]["inputs"]["samples"] == graph["bench_report"]["inputs"]["samples"] == ["bench_split", 0]
    assert graph["bench_audio"]["inputs"]["samples"] == ["bench_split", 1]
    assert graph["92"]["inputs"]["filename_prefix"] == "bench/template_default"
    # nothing else changed
    changed = {k for k in shipped if shipped[k] != graph[k]}
    assert changed == {"140:126", "92"}


def test_the_pack_encoder_falls_back_to_upstreams_loader():
    graph, _ = whole_job.job_graph(whole_job.CONFIGS["pack"], "turbo", object_info(), "CLIPLoader", None)
    assert graph["140:128"]["class_type"] == "CLIPLoader"
    assert graph["140:128"]["inputs"] == {"clip_name": "qwen3vl_32b_minimax_h3_nvfp4_awq.safetensors",
                                          "type": "minimax", "device": "default"}


def test_tiny_graph_swaps_the_encoder_and_the_vae_loaders_only():
    graph, _ = whole_job.job_graph(whole_job.CONFIGS["template"], "turbo", object_info(), "QuantizedCLIPLoader", 320)
    assert not whole_job.nodes_of(graph, "CLIPLoader") and not whole_job.nodes_of(graph, "MiniMaxH3ImageToVideo")
    assert graph["140:131"] == {"class_type": "BigditRandomConditioning", "inputs": {"seed": 0, "length": 16,
                                                                                     "dim": 320}}
    assert graph["140:125"]["inputs"]["latent_image"] == ["bench_latent", 0]
    assert graph["bench_latent"]["inputs"] == {"width": 64, "height": 64, "length": 22}
    assert {graph[k]["class_type"] for k in ("140:119", "140:120")} == {"BigditTinyVAELoader"}
    assert graph["140:137"]["inputs"]["value"] == graph["140:138"]["inputs"]["value"] == 2


def test_segments_partition_the_wall_clock_and_split_the_sampler_at_its_first_call():
    graph = {"a": {"class_type": "UNETLoader"}, "b": {"class_type": "SamplerCustomAdvanced"},
             "c": {"class_type": "VAEDecode"}, "d": {"class_type": "PrimitiveInt"}}
    events = [(10.5, "execution_start", {}), (11.0, "executing", {"node": "a"}), (13.0, "executing", {"node": "d"}),
              (13.5, "executing", {"node": "b"}), (20.0, "executing", {"node": "c"}),
              (25.0, "execution_success", {})]
    segs = whole_job.segments(events, graph, 10.0, 25.0, first_call=16.0)
    stages = whole_job.stage_seconds(segs)
    assert stages == {"queue": 1.0, "encoder": 0.0, "model_load": 2.0 + 2.5, "sampling": 4.0, "vae_decode": 5.0,
                      "save": 0.0, "graph": 0.5, "capture": 0.0}
    assert sum(stages.values()) == 15.0
    samples = [(12.0, 5 * 2 ** 30, None, None), (17.0, 9 * 2 ** 30, None, None), (21.0, 7 * 2 ** 30, None, None)]
    assert whole_job.peaks_by_stage(segs, samples, 1) == {"model_load": 5.0, "sampling": 9.0, "vae_decode": 7.0}


def test_summary_divides_the_reference_by_the_pack():
    def rec(config, wall, sampling):
        stages = dict.fromkeys(whole_job.STAGES, 1.0)
        stages["sampling"] = sampling
        return {"config": config, "setting": "turbo", "ram_gib": 64.0, "status": "ok", "wall_s": wall,
                "stages": stages, "host_share": 2.0 / wall}
    summary = whole_job.summarize([rec("template_sage", 20.0, 13.0), rec("pack_fast", 10.0, 3.0)])
    ratio = summary["turbo_64g"]["speedup"]["pack_fast_vs_template_sage"]
    assert ratio["whole"] == 2.0 and ratio["stages"]["sampling"] == 13.0 / 3.0 and ratio["stages"]["encoder"] == 1.0
    assert summary["turbo_64g"]["host_share"] == {"template_sage": 0.1, "pack_fast": 0.2}


# ---- the published files' layouts ----------------------------------------------------------

def h3_shapes(blocks=50, refiner=2):
    shapes = {}
    for prefix in [f"blocks.{i}" for i in range(blocks)] + [f"token_refiner.blocks.{i}" for i in range(refiner)]:
        shapes.update({f"{prefix}.attn.qkv_proj.weight": (21504, 5376), f"{prefix}.attn.out_proj.weight": (5376, 7168),
                       f"{prefix}.mlp.fc1.weight": (28672, 5376), f"{prefix}.mlp.fc2.weight": (5376, 14336),
                       f"{prefix}.norm1.weight": (5376,)})
    shapes["blocks.0.adaln_proj.linear.weight"] = (96768, 8)
    return shapes


def test_the_turbo_lora_has_the_published_files_size():
    targets = e2e_models.turbo_lora_targets(h3_shapes())
    assert len(targets) == 52 * 4 and {rank for *_, rank in targets} == {128, 384}
    data = sum(2 * rank * (n_out + n_in) for _, n_out, n_in, rank in targets)
    published = 1_956_193_000  # minimax_h3_fl2v_turbo_8step_v1.0_comfyui_bf16.safetensors
    assert 0 < published - data < 100_000  # its header: 416 tensors' names, shapes and offsets


@pytest.mark.parametrize("name, expected", [
    ("model.layers.49.self_attn.q_proj.weight", (whole_job.e2e_models.NVFP4_AWQ, False)),
    ("model.layers.0.self_attn.o_proj.weight", (whole_job.e2e_models.NVFP4_AWQ, True)),
    ("model.layers.7.mlp.gate_proj.weight", (whole_job.e2e_models.NVFP4_AWQ, False)),
    ("model.layers.7.mlp.down_proj.weight", (whole_job.e2e_models.NVFP4_AWQ, True)),
    ("model.embed_tokens.weight", ({"format": "int8_tensorwise"}, False)),
    ("model.layers.0.input_layernorm.weight", None),
    ("visual.blocks.0.attn.qkv.weight", None),
    ("visual.merger.linear_fc1.weight", None),
])
def test_the_encoder_layout(name, expected):
    assert e2e_models.qwen3vl_nvfp4_awq(name, (64, 64)) == expected


def test_an_awq_layers_entries_and_the_vae_decoders_markers():
    entries = e2e_models.layer_entries("nvfp4_awq", "model.layers.0.mlp.down_proj.weight", (128, 256), "cpu")
    assert [(n.rsplit(".", 1)[1], s, d) for n, s, d in entries] == [
        ("weight", (128, 128), torch.uint8), ("weight_scale", (128, 16), torch.float8_e4m3fn),
        ("weight_scale_2", (), torch.float32), ("pre_quant_scale", (256,), torch.bfloat16),
        ("comfy_quant", (len(json.dumps(e2e_models.NVFP4_AWQ)),), torch.uint8)]
    assert e2e_models.layer_entries("nvfp4_awq", "visual.blocks.0.attn.qkv.weight", (96, 32), "cpu",
                                    torch.bfloat16) == [("visual.blocks.0.attn.qkv.weight", (96, 32), torch.bfloat16)]
    vae = e2e_models.layer_entries("int8_convrot_decoder", "decoder.transformer_blocks.3.ff.w2.weight", (64, 256),
                                   "cpu", torch.float16)
    assert [n.rsplit(".", 1)[1] for n, _, _ in vae] == ["weight", "weight_scale", "comfy_quant"]
    for name in ("decoder.x_embedder.weight", "decoder.proj_out.weight", "encoder.conv_in.weight"):
        assert e2e_models.video_vae_int8_convrot(name, (64, 256)) is None


def test_qwen_norms_are_drawn_as_ones():
    norms = ("layernorm", "q_norm", "k_norm")
    for name in ("model.layers.3.input_layernorm.weight", "model.layers.3.self_attn.k_norm.weight"):
        assert e2e_models.init_kind(name, (128,), norms) == "ones"
        assert e2e_models.init_kind(name, (128,)) == "vector"  # the DiTs' draws are as they were
    assert e2e_models.init_kind("model.layers.3.mlp.up_proj.weight", (256, 128), norms) == "matrix"


# ---- the tiny run ----------------------------------------------------------------------------

@pytest.mark.integration
def test_tiny_whole_job_times_every_stage_and_saves_the_video(tmp_path):
    host = next(h for h in HOSTS if h.version == "0.33.0")
    if (reason := host.missing()) and not in_ci():
        pytest.skip(reason)
    host.check()
    out = tmp_path / "job.json"
    run = subprocess.run([str(host.python), str(TESTS / "bench" / "whole_job.py"), "--tiny", "--comfyui",
                          str(host.comfyui), "--configs", "template,pack_fast", "--work", str(tmp_path / "w"),
                          "--out", str(out)], capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    data = json.loads(out.read_text())
    by = {r["config"]: r for r in data["results"]}
    assert [by[c]["status"] for c in ("template", "pack_fast")] == ["ok", "ok"], \
        {c: r.get("error") for c, r in by.items()}
    assert set(data["files"]) >= {"dit", "video_vae", "audio_vae", "lora"} and "text_encoder" not in data["files"]
    for rec in by.values():
        stages = rec["stages"]
        assert all(stages[s] > 0 for s in ("queue", "encoder", "model_load", "sampling", "vae_decode", "save")), stages
        assert abs(rec["stage_sum_s"] - rec["wall_s"]) <= 0.1 * rec["wall_s"]
        assert rec["sampling"]["steps"] == 2 and rec["sampling"]["calls_per_step"] == [1, 1]
        assert rec["video"]["frames"] == 22 and rec["video"]["audio_streams"] == 1 and rec["video"]["bytes"] > 0
        assert rec["latent_shape"] == [1, 24, 7, 4, 4]  # 64x64, 22 frames: 7 latent frames of 4x4
        assert rec["host_rss_peak_gib"] > 0 and rec["ram"]["enforced"] is False
        assert rec["ram_budgets"]["32g"] == {"unreclaimable_fits": True, "rss_fits": True}
        assert any("total RAM 65536 MB" in line for line in rec["log_lines"])  # ComfyUI saw the emulated 64 GiB
    pack = by["pack_fast"]
    assert pack["reports"]["140:127"].startswith("quantized 8/20 linear layers")  # MixedCheckpointLoader ran
    assert pack["reports"]["140:141"].startswith("attention: backend sage")
    assert pack["left_out"] in ([], ["MixedCheckpointLoader.int8"])
    # the same INT8 ConvRot layers through the pack's loader, the LoRA on both: close, not the same run
    video = pack["latent"]["vs_template"]["video"]
    assert video["cosine"] > 0.999 and video["finite"] and "vs_template" not in by["template"].get("latent", {})
    # QuantizedCLIPLoader on the encoder file's layer kinds, checked once after the first job: it loads them, or
    # the refusal names the INT8 token embedding no Linear takes (the pack configurations then use CLIPLoader)
    check = data["encoder_check"]
    assert check["loads"] is True or (check["loads"] is False and "token_embedding" in check["error"]), check
    assert "encoder_check_before_the_job" not in pack and "encoder_loader" not in pack  # --tiny has no encoder
    ratio = data["summary"]["turbo_64g"]["speedup"]["pack_fast_vs_template"]
    assert ratio["whole"] == pytest.approx(by["template"]["wall_s"] / pack["wall_s"])
    assert "pack_fast vs template: whole job" in run.stdout
    assert not list((tmp_path / "w").rglob("*.safetensors")) and not list((tmp_path / "w").rglob("*.mp4"))


# ---- the memory limit (on a model of /sys/fs/cgroup: a write the kernel refuses is a folder in the way) -----

def cgroup_tree(tmp_path, own: str, self_cgroup: str, controllers: dict):
    """A /sys/fs/cgroup of folders and files, a /proc whose PID 1 is no systemd; `controllers`: {cgroup:
    subtree_control text, or None where writing it fails}."""
    root, proc = tmp_path / "cgroup", tmp_path / "proc"
    (root / own.lstrip("/")).mkdir(parents=True)
    for cgroup, text in controllers.items():
        target = root / cgroup.lstrip("/") / "cgroup.subtree_control"
        target.mkdir() if text is None else target.write_text(text)
    (proc / "self").mkdir(parents=True)
    (proc / "self" / "cgroup").write_text(self_cgroup)
    (proc / "1").mkdir()
    (proc / "1" / "comm").write_text("init\n")
    return root, proc


def test_a_v2_limit_is_a_sibling_where_our_own_cgroup_holds_processes(tmp_path):
    root, proc = cgroup_tree(tmp_path, "/job/run", "0::/job/run\n", {"/job/run": None, "/job": "cpu memory\n"})
    (root / "cgroup.controllers").write_text("cpu memory\n")
    limit, why = whole_job.MemoryLimit.make(32 * 2 ** 30, "bigdit-job-1", root, proc)
    assert why == "" and limit.path == root / "job" / "bigdit-job-1" and limit.launcher == ()
    assert (limit.path / "memory.max").read_text() == str(32 * 2 ** 30)
    assert (limit.path / "memory.swap.max").read_text() == "0"
    (limit.path / "memory.peak").write_text(str(3 * 2 ** 30))
    (limit.path / "memory.events").write_text("low 0\noom 1\noom_kill 1\n")
    assert limit.stats() == {"cgroup_peak_gib": 3.0, "oom_kills": 1}
    for name in ("memory.max", "memory.swap.max", "memory.peak", "memory.events"):  # the kernel's, not files
        (limit.path / name).unlink()
    limit.remove()
    assert not limit.path.exists()


def test_a_parents_controllers_are_never_changed(tmp_path):
    root, proc = cgroup_tree(tmp_path, "/job/run", "0::/job/run\n", {"/job/run": None, "/job": "cpu\n"})
    (root / "cgroup.controllers").write_text("cpu memory\n")
    limit, why = whole_job.MemoryLimit.make(2 ** 30, "x", root, proc)
    assert limit is None and (root / "job" / "cgroup.subtree_control").read_text() == "cpu\n"
    assert "its children have no memory controller" in why and why.endswith("no systemd to run a scope")


def test_a_v1_limit_is_a_child_in_the_memory_hierarchy(tmp_path):
    root, proc = cgroup_tree(tmp_path, "/memory/job/run", "4:memory:/job/run\n0::/\n", {})
    limit, why = whole_job.MemoryLimit.make(64 * 2 ** 30, "b", root, proc)
    assert why == "" and limit.version == 1 and limit.path == root / "memory" / "job" / "run" / "b"
    assert (limit.path / "memory.limit_in_bytes").read_text() == str(64 * 2 ** 30)
