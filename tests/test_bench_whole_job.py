"""The whole-job benchmark (tests/bench/whole_job.py): its prompts, graphs, file layouts, timing and stage profile
(tests/bench/job_profile.py: its FLOP counts against torch's count of upstream 0.33.0's own classes, its floors'
arithmetic) on CPU, and one --tiny run end to end on upstream ComfyUI 0.33.0 (integration: a template and a pack
configuration, each with its first and second job)."""
import copy
import dataclasses
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import safetensors.torch
import torch

TESTS = Path(__file__).resolve().parent
sys.path.insert(0, str(TESTS / "bench"))
import e2e_models  # noqa: E402
import job_profile  # noqa: E402
import page_cache  # noqa: E402
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


@pytest.mark.parametrize("name,switch", [("pack_fast_no_read_ahead", "BIGDIT_READ_AHEAD"),
                                         ("pack_fast_compile_in_place", "BIGDIT_TRITON_COMPILE_AHEAD")])
def test_a_switch_config_is_pack_fast_with_the_switch_off(name, switch):
    """The same graph and server arguments; only the server's environment turns the pack's feature off."""
    fast, off = whole_job.CONFIGS["pack_fast"], whole_job.CONFIGS[name]
    assert (off.prompt, off.nodes, off.comfy_args) == (fast.prompt, fast.nodes, fast.comfy_args)
    assert fast.env == () and dict(off.env) == {switch: "0"}
    assert name in whole_job.PACK_CONFIGS  # compared with the references in the summary


def test_pack_fast_no_lora_sets_the_loras_strength_to_zero_and_nothing_else():
    fast, bare = whole_job.CONFIGS["pack_fast"], whole_job.CONFIGS["pack_fast_no_lora"]
    info = {**object_info(), "LoraLoaderModelOnly": {"input": {"required": {  # the host's node, as it serves it
        "model": ["MODEL"], "lora_name": [[]], "strength_model": ["FLOAT", {"default": 1.0}]}}}}
    graph, left_out = whole_job.job_graph(bare, "turbo", info, "QuantizedCLIPLoader", None)
    reference, _ = whole_job.job_graph(dataclasses.replace(fast, name=bare.name), "turbo", info, "QuantizedCLIPLoader",
                                       None)  # the same name: the saved files' prefixes hold it
    assert graph["140:134"]["inputs"]["strength_model"] == 0.0 and left_out == []
    graph["140:134"]["inputs"]["strength_model"] = reference["140:134"]["inputs"]["strength_model"]
    assert graph == reference


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
    assert graph["92"]["inputs"]["filename_prefix"] == "bench/template_default_job1"
    # nothing else changed
    changed = {k for k in shipped if shipped[k] != graph[k]}
    assert changed == {"140:126", "92"}


def turbo_job(config: str, job: int) -> dict:
    """The graph of `config`'s job `job` at the turbo setting, full size."""
    return whole_job.job_graph(whole_job.CONFIGS[config], "turbo", object_info(), "QuantizedCLIPLoader", None,
                               job=job)[0]


def test_the_second_job_changes_the_prompt_and_the_seed_only():
    for config in ("template", "pack_fast"):
        first, second = turbo_job(config, 1), turbo_job(config, 2)
        changed = {k for k in first if first[k] != second[k]}
        assert changed == {"140:131", "140:129", "92", "bench_video", "bench_audio"}, config
        assert second["140:131"]["inputs"]["prompt"] == whole_job.SECOND_JOB["prompt"] != \
            first["140:131"]["inputs"]["prompt"]
        assert second["140:129"]["inputs"]["noise_seed"] == whole_job.SECOND_JOB["seed"]
        assert second["92"]["inputs"]["filename_prefix"] == f"bench/{config}_turbo_job2"
    # the same loaders: ComfyUI may keep their outputs for the second job
    assert all(first[k] == second[k] for k in first if first[k]["class_type"] in whole_job.LOADERS)
    tiny, _ = whole_job.job_graph(whole_job.CONFIGS["pack"], "turbo", object_info(), "QuantizedCLIPLoader", 320, job=2)
    assert tiny["140:131"]["inputs"]["seed"] == whole_job.SECOND_JOB["tiny_conditioning_seed"]


def test_the_third_job_is_the_second_with_the_loras_strength_changed():
    for config in ("template", "pack_fast"):
        second, third = turbo_job(config, 2), turbo_job(config, 3)
        changed = {k for k in second if second[k] != third[k]}
        assert changed == {"140:134", "92", "bench_video", "bench_audio"}, (config, changed)
        assert third["140:134"]["inputs"]["strength_model"] == whole_job.LORA_CHANGE != \
            second["140:134"]["inputs"]["strength_model"]


def test_the_fourth_job_is_the_second_with_a_second_lora_after_the_first():
    for config in ("template", "pack_fast"):
        second, fourth = turbo_job(config, 2), turbo_job(config, 4)
        new = whole_job.SECOND_LORA_NODE
        assert fourth[new] == {"class_type": "LoraLoaderModelOnly", "inputs": {
            "model": ["140:134", 0], "lora_name": whole_job.SECOND_LORA_FILE, "strength_model": whole_job.LORA_SECOND}}
        assert fourth["140:134"] == second["140:134"]  # the first LoRA as in the second job
        # what took the first LoRA's model (the Lightning switch) takes the second's; nothing else changed
        takers = {k for k, node in second.items() if ["140:134", 0] in node["inputs"].values()}
        assert takers and all(["140:134", 0] not in fourth[k]["inputs"].values() and
                              [new, 0] in fourth[k]["inputs"].values() for k in takers)
        changed = {k for k in second if second[k] != fourth[k]}
        assert changed == takers | {"92", "bench_video", "bench_audio"}, (config, changed)


def test_loads_say_what_ran_and_what_each_cache_said():
    graph, _ = whole_job.job_graph(whole_job.CONFIGS["pack"], "turbo", object_info(), "QuantizedCLIPLoader", None)
    outputs = {"140:127": {"text": ["quantized 200/208 linear layers: fp8 x200\nmore"], "report": [
        "quantized 200/208 ...\nquantize-once cache: hit, loaded <work>/x.safetensors as stored\n"
        "kernel tuning: 12 shapes from the tuned store"]}}
    items = {i["node"]: i for i in whole_job.loads(graph, {"140:127", "140:128"}, outputs,
                                                  "INT8 kernels: tuning searched 3 shapes (not in the store)\n")}
    dit = items["140:127"]
    assert dit["class_type"] == "LoadH3Quantized" and dit["ran"] and dit["file"] == \
        "minimax_h3_fl2va_pruned_int8_convrot.safetensors"
    assert dit["report"] == "quantized 200/208 linear layers: fp8 x200" and dit["cache"] == "hit"
    assert dit["cache_line"].startswith("quantize-once cache: hit, loaded")
    assert dit["tuning"] == ["kernel tuning: 12 shapes from the tuned store"]
    assert dit["tuning_log"] == ["INT8 kernels: tuning searched 3 shapes (not in the store)"]
    assert dit["tuning_status"] == "miss"  # the log says a search ran
    assert items["140:128"]["ran"] and "cache" not in items["140:128"]
    lora = items["140:134"]
    assert lora["ran"] is False and "report" not in lora and lora["tuning_status"] is None  # kept by ComfyUI
    assert whole_job.tuning_status(["tuned kernels: hit for 40 shapes"]) == "hit"
    assert whole_job.tuning_status(["tuning store at <work>/tuning"]) == "seen"


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


def test_summary_divides_the_reference_by_the_pack_job_by_job():
    def rec(config, wall, sampling, job=1):
        stages = dict.fromkeys(whole_job.STAGES, 1.0)
        stages["sampling"] = sampling
        return {"config": config, "setting": "turbo", "ram_gib": 64.0, "job": job, "status": "ok", "wall_s": wall,
                "stages": stages, "host_share": 2.0 / wall}
    summary = whole_job.summarize([rec("template_sage", 20.0, 13.0), rec("template_sage", 12.0, 9.0, 2),
                                   rec("pack_fast", 10.0, 3.0), rec("pack_fast", 6.0, 3.0, 2)])
    ratio = summary["turbo_64g_job1"]["speedup"]["pack_fast_vs_template_sage"]
    assert ratio["whole"] == 2.0 and ratio["stages"]["sampling"] == 13.0 / 3.0 and ratio["stages"]["encoder"] == 1.0
    assert summary["turbo_64g_job1"]["host_share"] == {"template_sage": 0.1, "pack_fast": 0.2}
    assert summary["turbo_64g_job2"]["speedup"]["pack_fast_vs_template_sage"]["whole"] == 2.0
    assert summary["turbo_64g_job2"]["speedup"]["pack_fast_vs_template_sage"]["stages"]["sampling"] == 3.0
    assert "lora_step_share" not in summary["turbo_64g_job1"]  # no run without the LoRA to set it against


def test_summary_gives_the_lora_branchs_share_of_a_step_within_one_run():
    def rec(config, step_s):
        return {"config": config, "setting": "turbo", "ram_gib": 64.0, "job": 2, "status": "ok", "wall_s": 10.0,
                "stages": dict.fromkeys(whole_job.STAGES, 1.0), "host_share": 0.1, "sampling": {"step_s": step_s}}
    summary = whole_job.summarize([rec("template_sage", 1.5), rec("pack_fast", 1.36), rec("pack_fast_no_lora", 1.30)])
    assert summary["turbo_64g_job2"]["lora_step_share"] == (1.36 - 1.30) / 1.36


class _Opts:
    def __init__(self, budget_s, tiny=False):
        self.budget_s, self.tiny = budget_s, tiny


def test_the_budget_cuts_whole_servers_and_second_jobs_by_the_longest_so_far():
    job = whole_job.Job.__new__(whole_job.Job)
    job.opts, job.phases, job.started = _Opts(550.0), {}, 0.0
    job.elapsed = lambda: 230.0  # the setup: bundles, SageAttention, the files
    assert job.estimate("turbo", "job1") == whole_job.PRIOR_S["turbo"]["job1"]
    assert job.over_budget(job.estimate("turbo", "job1")) is None  # 230 + 160 + 15 <= 550
    job.phases = {"turbo": {"job1": [95.0, 150.0], "job2": [40.0]}, "default": {"job1": [400.0]}}
    assert job.estimate("turbo", "job1") == 150.0 and job.estimate("turbo", "job2") == 40.0
    assert job.estimate("default", "job2") == 40.0  # none at this setting yet: the longest at any
    job.elapsed = lambda: 500.0
    assert job.over_budget(job.estimate("turbo", "job2")) == \
        "time budget (550 s) would be exceeded (this one estimated at 40 s)"
    job.elapsed = lambda: 490.0
    assert job.over_budget(40.0) is None  # 490 + 40 + STOP_S == 545
    assert whole_job.Job.over_budget(type("J", (), {"opts": _Opts(None), "elapsed": lambda self: 1e9})(), 1e9) is None


def test_a_jobs_line_gives_its_stages_memory_and_disk_reads():
    rec = {"setting": "turbo", "ram_gib": 64, "config": "pack_fast", "job": 1, "status": "ok", "wall_s": 57.3,
           "stages": {**dict.fromkeys(whole_job.STAGES, 0.0), "encoder": 11.9, "sampling": 29.0},
           "host_share": 0.34, "sampling": {"step_s": 1.41}, "device_used_peak_gib": 24.0, "host_rss_peak_gib": 43.6,
           "host_unreclaimable_peak_gib": 37.4, "disk_read_by_stage": {"encoder": 3 * GIB, "sampling": GIB // 2},
           "latent": {}, "loads": [{"class_type": "MixedCheckpointLoader", "ran": True}]}
    assert whole_job.result_line(rec) == (
        "  turbo 64G pack_fast      job 1 57.3 s (encoder 11.9, sampling 29.0), host code 34%, 1.41 s/step, "
        "device 24.0 GiB, RSS 43.6 GiB (unreclaimable 37.4), disk read 3.5 GiB, MixedCheckpointLoader ran")
    decoded = {**rec, "page_cache_at_decode_gib": {"video_vae": 2.6},
               "nodes": [{"class_type": "VAELoader", "disk_read_gib": 2.5}, {"class_type": "VAEDecode",
                                                                              "disk_read_gib": 0.25}]}
    assert "disk read 3.5 GiB, video VAE cached at VAEDecode 2.60 GiB, VAEDecode read 0.25, Mixed" in \
        whole_job.result_line(decoded)
    assert whole_job.result_line({**rec, "status": "error", "error": "boom\nmore"}).endswith("job 1 ERROR: boom")


def test_first_launches_sum_the_run_reports_lines():
    text = ("[BigDiT] A, last run: ran 200/200 quantized layers; ran int8: triton+lora x1600 calls (first launches at "
            "7 shapes: 6.0 s, compiling what Triton's cache lacked)\n[BigDiT] B, last run: ran int8: triton x9 calls "
            "(first launches at 2 shapes: 1.25 s, compiling what Triton's cache lacked)\n")
    assert whole_job.first_launches(text) == {"shapes": 9, "seconds": 7.2}
    assert whole_job.first_launches("[BigDiT] A, last run: ran int8: triton x9 calls") == {"shapes": 0, "seconds": 0}


def test_bytes_by_stage_is_what_the_cumulative_count_grew_by():
    segs = [(10.0, 11.0, "queue", None), (11.0, 15.0, "encoder", "a"), (15.0, 16.0, "model_load", "b"),
            (16.0, 20.0, "sampling", "c"), (20.0, 21.0, "model_load", "d")]
    samples = [(9.9, None, 1, 1, 100, 0), (12.0, None, 1, 1, 600, 10), (14.9, None, 1, 1, 1100, 10),
               (15.5, None, None, None, None, None), (16.0, None, 1, 1, 1300, 50), (19.0, None, 1, 1, 1350, 50),
               (21.0, None, 1, 1, 1360, 50)]
    read = whole_job.bytes_by_stage(segs, samples, 4)
    assert read["queue"] == 0 and read["encoder"] == 1000 and read["model_load"] == 200 + 10
    assert read["sampling"] == 50 and sum(read.values()) == 1360 - 100
    assert whole_job.bytes_by_stage(segs, samples, 5)["model_load"] == 40
    assert whole_job.bytes_by_segment(segs, samples, 4) == [0, 1000, 200, 50, 10]  # each node's own


def test_cgroup_memory_reads_anon_file_and_refaulted_bytes(tmp_path):
    stat = tmp_path / "memory.stat"
    stat.write_text("anon 1000\nfile 2000\nfile_mapped 50\nworkingset_refault_anon 7\nworkingset_refault_file 3\n")
    assert whole_job.cgroup_memory(stat) == (1000, 2000, 3 * whole_job.PAGE)
    assert whole_job.cgroup_memory(None) == (None, None, None)
    assert whole_job.cgroup_memory(tmp_path / "gone") == (None, None, None)
    stat.write_text("anon 1000\nfile 2000\n")  # a kernel without the counter
    assert whole_job.cgroup_memory(stat) == (None, None, None)


def test_monitor_samples_keep_their_columns_with_and_without_a_cgroup(tmp_path):
    stat = tmp_path / "memory.stat"
    stat.write_text("anon 10\nfile 20\nworkingset_refault_file 2\n")
    for memory_stat, tail in ((stat, (10, 20, 2 * whole_job.PAGE)), (None, (None, None, None))):
        monitor = whole_job.Monitor(os.getpid(), interval=0.01, memory_stat=memory_stat)
        monitor.start()
        time.sleep(0.05)
        monitor.stop()
        sample = monitor.samples[-1]
        assert len(sample) == 9 and sample[2] > 0 and sample[3] >= 0 and sample[6:] == tail
        # column 4 stays the disk's reads, which bytes_by_stage and the profile read
        assert sample[4] is not None and sample[4] <= whole_job.io_bytes(monitor.pids)[0]


def _proc(tmp_path, threads, machine="cpu  100 0 50 900 30 5 5 0 0 0\n"):
    """A /proc with process 7 ({tid: (name, user ticks, system ticks)}) and the machine's first /proc/stat line."""
    rest = "0 0 0 0 0 0 0 0 0 0"  # fields 4-13 of a stat line, before utime
    (tmp_path / "stat").write_text(machine)
    total = [sum(t[1] for t in threads.values()), sum(t[2] for t in threads.values())]
    (tmp_path / "7" / "task").mkdir(parents=True)
    (tmp_path / "7" / "stat").write_text(f"7 (python3 main) S {rest} {total[0] + 40} {total[1]} 0 0 20\n")
    for tid, (name, user, system) in threads.items():
        (tmp_path / "7" / "task" / str(tid)).mkdir()
        (tmp_path / "7" / "task" / str(tid) / "stat").write_text(f"{tid} ({name}) R {rest} {user} {system} 0 0 20\n")
    return tmp_path


def test_cpu_seconds_groups_threads_by_name_and_keeps_the_process_and_machine_counts(tmp_path):
    tick = whole_job.TICK
    proc = _proc(tmp_path, {7: ("python3 main", 3 * tick, tick), 8: ("pt_autograd_0", tick, 0),
                            9: ("pt_autograd_1", 2 * tick, 0), 10: ("x264", tick // 2, 0),
                            11: ("bigdit-ahead", tick, 0), 12: ("python3 main", tick, 0)})
    counts = whole_job.cpu_seconds([7, 99], proc=proc)  # 99: a process that ended
    assert counts["thread:main"] == 4 and counts["thread:pt_autograd"] == 3  # the main thread: its tid is the pid
    assert counts["thread:python3 main/12"] == 1 and counts["thread:bigdit-ahead"] == 1  # unnamed: each alone
    assert counts["thread:x"] == 0.5  # trailing digits go: "x264" is its group "x"
    assert counts["process"] == (8 * tick + tick // 2 + 40 + tick) / tick  # ended threads' 40 ticks kept
    assert counts["machine_busy"] == 160 / tick and counts["machine_iowait"] == 30 / tick
    real = whole_job.cpu_seconds([os.getpid()])
    assert real["process"] > 0 and real["machine_busy"] > 0 and "thread:main" in real
    assert sum(v for k, v in real.items() if k.startswith("thread:")) <= real["process"] + 0.05


def test_cpu_by_stage_is_what_each_count_grew_by_read_between_samples_with_the_busiest_threads():
    segs = [(10.0, 11.0, "vae_decode", "a"), (11.0, 12.0, "save", "b"), (12.0, 15.0, "save", "c"),
            (15.0, 16.0, "vae_decode", "d")]
    cpu = [(10.0, {"process": 1.0, "machine_busy": 10.0, "thread:main": 1.0, "thread:gone": 0.5}),
           (11.0, {"process": 2.0, "machine_busy": 12.0, "thread:main": 1.5, "thread:gone": 1.0}),
           (13.0, {"process": 6.0, "machine_busy": 30.0, "thread:main": 1.7, "thread:x": 2.0}),
           (15.0, {"process": 9.0, "machine_busy": 40.0, "thread:main": 2.0, "thread:x": 4.0, "thread:idle": 1.0}),
           (16.0, {"process": 9.5, "machine_busy": 41.0, "thread:main": 2.5, "thread:x": 4.0, "thread:idle": 1.0})]
    out = whole_job.cpu_by_stage(segs, cpu, top=3)
    assert out["save"] == {"process": 7.0, "machine_busy": 28.0, "threads": {"x": 4.0, "idle": 1.0, "main": 0.5}}
    assert whole_job.cpu_by_stage(segs, cpu, top=1)["save"]["threads"] == {"x": 4.0}
    assert out["vae_decode"]["process"] == 1.5 and out["vae_decode"]["machine_busy"] == 3.0
    assert out["vae_decode"]["threads"] == {"main": 1.0, "gone": 0.5}  # the ended group is 0 after its end
    # a bound between two samples reads the line between them: 12 s is halfway from 11 s to 13 s
    assert whole_job.cpu_by_stage(segs[1:2], cpu)["save"]["process"] == 2.0
    assert whole_job.cpu_by_stage([(9.0, 10.0, "queue", None)], cpu)["queue"]["process"] == 0  # before: the first
    assert whole_job.cpu_by_stage(segs, []) == {}


def test_monitor_samples_the_trees_cpu_time():
    monitor = whole_job.Monitor(os.getpid(), interval=0.01, cpu_every=2)
    monitor.start()
    while not monitor.cpu:  # its first poll lists the process tree (psutil's import)
        time.sleep(0.01)
    end = time.time() + 0.2
    while time.time() < end:  # keep a core busy for the monitor to count
        sum(range(1000))
    monitor.stop()
    assert len(monitor.cpu) >= 3 and monitor.cpu[-1][1]["process"] > monitor.cpu[0][1]["process"]


# ---- the profile: FLOPs from upstream's classes, floors ------------------------------------------------------------

# the FLOPs torch counts on upstream 0.33.0's own classes (a tiny configuration of each), run in the host's venv
COUNT_FLOPS = r"""
import importlib.util, json, sys
comfyui, tiny_vae_path, spec = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
sys.path.insert(0, comfyui)
from comfy.cli_args import args
args.cpu = True
import torch
from torch.utils.flop_counter import FlopCounterMode
import comfy.ops
ops = comfy.ops.disable_weight_init
torch.manual_seed(0)
torch.set_num_threads(1)  # small tensors: one thread, no spinning on a busy machine

def cpu_sdpa(query, key, value, *rest, out_shape=None, **kwargs):  # torch counts the GPU kernels' only
    b, h, s, d = query
    return 4 * b * h * s * key[-2] * d

def count(fn):
    mapping = {torch.ops.aten._scaled_dot_product_flash_attention_for_cpu: cpu_sdpa}
    with torch.inference_mode(), FlopCounterMode(display=False, custom_mapping=mapping) as mode:
        fn()
    return mode.get_total_flops()

def init(module):
    for t in [*module.parameters(), *module.buffers()]:
        if t.is_floating_point():
            t.data.normal_(0, 0.02)
    return module.requires_grad_(False)

out = {}
from comfy.ldm.minimax.model import MiniMaxH3Model
dit = init(MiniMaxH3Model(**spec["dit"], dtype=torch.float32, device="cpu", operations=ops))
video, audio = torch.randn(spec["video_latent"]), torch.randn(spec["audio_latent"])
context = torch.randn(1, spec["text"], spec["dit"]["hidden_size"])  # refined, as sampling passes it
out["dit"] = count(lambda: dit.forward([video, audio], torch.tensor([500.0]), context))
from comfy.text_encoders.llama import Llama2_, Qwen3VL_32BConfig
lm = init(Llama2_(Qwen3VL_32BConfig(**spec["qwen"]), device="cpu", dtype=torch.float32, ops=ops))
out["qwen"] = count(lambda: lm(torch.randint(0, spec["qwen"]["vocab_size"], (1, spec["text"]))))
loader = importlib.util.spec_from_file_location("tiny_vae", tiny_vae_path)
tiny = importlib.util.module_from_spec(loader)
loader.loader.exec_module(tiny)
import comfy.ldm.minimax.audio_vae as audio_vae
import comfy.ldm.minimax.vae as video_vae
with tiny.tiny_classes(spec["tiny_vae"]):
    vae = init(video_vae.MiniMaxH3VideoVAE(operations=ops))
    avae = init(audio_vae.MiniMaxH3AudioVAE())
out["video"] = count(lambda: vae.decode(torch.randn(spec["video_decode"])))
out["audio"] = count(lambda: avae.decode(torch.randn(spec["audio_decode"])))
# upstream's own plan of the full job's decode: the positions of each decoder pass (the decoder itself stubbed)
passes = []
def plan(z):
    passes.append(z.shape[2] * z.shape[3] * z.shape[4])
    b, _, t, h, w = z.shape
    return torch.zeros(b, 3, t * 4, h * 16, w * 16, dtype=torch.uint8)  # its size only: blending is not checked
vae._decode_pixels = plan
with torch.inference_mode():
    vae.decode(torch.zeros(spec["job_latent"]))
out["job_passes"] = passes
print(json.dumps(out))
"""
GIB = 2 ** 30
QWEN_TINY = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=1000)
JOB_LATENT = [1, 24, 37, 30, 54]  # 864x480, 124 frames


def upstream_host():
    host = next(h for h in HOSTS if h.version == "0.33.0")
    if (reason := host.missing()) and not in_ci():
        pytest.skip(reason)
    host.ensure()
    host.check()
    return host


def test_the_flop_counts_match_torchs_count_of_upstreams_own_classes():
    host = upstream_host()
    spec = {"dit": e2e_models.TINY_H3.kwargs, "video_latent": [1, 24, 7, 4, 4], "audio_latent": [1, 32, 2, 37],
            "text": 16, "qwen": QWEN_TINY, "tiny_vae": e2e_models.TINY_VAE,
            "video_decode": [1, 24, 12, 20, 2],  # two temporal chunks, two tiles down the 320 pixels
            "audio_decode": [1, 32, 2, 2], "job_latent": JOB_LATENT}
    run = subprocess.run([str(host.python), "-c", COUNT_FLOPS, str(host.comfyui),
                          str(TESTS / "fixtures" / "bigdit_testnodes" / "tiny_vae.py"), json.dumps(spec)],
                         capture_output=True, text=True, timeout=600, cwd=host.comfyui)
    assert run.returncode == 0, run.stderr[-3000:]
    counted = json.loads(run.stdout.strip().splitlines()[-1])
    dit = job_profile.dit_config(e2e_models.TINY_H3.kwargs)
    assert job_profile.total(job_profile.dit_call_flops(dit, {"text": 16, "audio": 2 * 37, "video": 7 * 2 * 2})) == \
        counted["dit"]
    # the language layers exactly; torch also counts the rotary table's product (2 x 64 x tokens: 0.02% here)
    qwen = job_profile.total(job_profile.qwen_flops({**QWEN_TINY, "head_dim": 128}, 16))
    assert counted["qwen"] - qwen == 2 * 64 * 16
    video_vae = {**job_profile.VIDEO_VAE, **e2e_models.TINY_VAE["video_decoder"]}
    video = job_profile.video_decode_flops(spec["video_decode"], video_vae)
    assert job_profile.total(video) == counted["video"] and video["passes"] == 4
    audio_vae = {**job_profile.AUDIO_VAE, **{k: e2e_models.TINY_VAE["audio"][k] for k in ("latent_dim", "decoder_dim")}}
    assert job_profile.total(job_profile.audio_decode_flops(spec["audio_decode"], audio_vae)) == counted["audio"]
    # the full job's decode: 7 clips of 7 latent frames, 3 x 5 tiles of 16 x 16, as upstream plans it
    assert job_profile.video_decode_passes(JOB_LATENT) == counted["job_passes"] == [7 * 16 * 16] * 105


def test_the_full_jobs_step_at_its_token_count():
    """H3 pruned at 864x480, 124 frames (37 latent frames of 15 x 27 patches, 207 stereo audio frames) and a
    256-token prompt: 15,655 rows a call."""
    rows = {"text": 256, "audio": 2 * 207, "video": 37 * 15 * 27}
    flops = job_profile.dit_call_flops(job_profile.dit_config(e2e_models.H3_PRUNED_RELEASED.kwargs), rows)
    s = sum(rows.values())
    assert s == 15_655
    assert flops["attention"] == 4 * 50 * s * s * 56 * 128
    blocks = 2 * 50 * s * 5376 * (3 * 7168 + 7168 + 2 * 14336 + 14336)
    assert 0 < flops["linear"] - blocks < 1e-3 * blocks  # patch projections, heads, AdaLN
    assert 9.5e14 < job_profile.total(flops) < 9.8e14  # about 0.49 s at a 1,979 TFLOP/s 8-bit peak
    assert job_profile.dit_weight_bytes(job_profile.dit_config(e2e_models.H3_PRUNED_RELEASED.kwargs)) == \
        50 * 5376 * 71680  # 19.27 GB of 8-bit block linears, read at least once a call


def test_a_stages_floor_is_its_largest_bound():
    machine = {"disk": {"gib_s": 2.0}, "device": {"peak_tflops": 1000.0, "hbm_gib_s": 100.0, "h2d_gib_s": 20.0}}
    stage = job_profile.stage_profile(10.0, 4 * GIB, {"linear": 3e15, "attention": 1e15}, 50 * GIB, machine)
    assert (stage["read_s"], stage["compute_s"], stage["memory_s"]) == (2.0, 4.0, 0.5)
    assert stage["floor_s"] == 4.0 and stage["floor_kind"] == "compute" and stage["flops"] == 4e15
    read = job_profile.stage_profile(3.0, 5 * GIB, None, 0.0, machine)
    assert read["floor_s"] == 2.5 and read["floor_kind"] == "read" and read["compute_s"] == 0.0
    idle = job_profile.stage_profile(0.2, 0, None, 0.0, machine)
    assert idle["floor_s"] == 0.0 and idle["floor_kind"] is None
    cpu = job_profile.stage_profile(1.0, 0, {"linear": 1e9, "attention": 0}, 0.0, {"disk": {"gib_s": 1.0}, "device": {}})
    assert cpu["compute_s"] is None and cpu["floor_s"] == 0.0  # no peak to set the FLOPs against
    job = job_profile.job_profile({"encoder": read, "sampling": stage, "save": idle}, 40 * GIB, 20 * GIB, machine)
    assert job["seconds"] == 13.2 and job["floor_s"] == 6.5 and job["over_floor"] == pytest.approx(13.2 / 6.5)
    # overlapped: the files read once (20 s) beat the compute (4 s), the card's memory and the moves to it (1 s)
    assert job["floor_overlapped_s"] == 20.0 and job["floor_overlapped_kind"] == "read"
    assert job["bounds_overlapped_s"] == {"read": 20.0, "compute": 4.0, "host_to_device": 1.0, "memory": 0.5}
    lines = job_profile.profile_lines({"setting": "turbo", "ram_gib": 64.0, "config": "pack", "job": 1,
                                       "profile": job})
    assert lines[0].startswith("  profile turbo 64G pack job 1: 13.2 s, floor 6.5 s (2.0x)")
    assert any(line.split()[0] == "sampling" and "compute" in line for line in lines[1:])


def test_the_disk_is_read_once_cold_and_its_pages_dropped_again(tmp_path):
    path = tmp_path / "f.bin"
    path.write_bytes(os.urandom(3 * 1024 ** 2 + 5))
    found = job_profile.measure_disk(path, limit=2 * 1024 ** 2 + 3, chunk=1024 ** 2)
    assert found["bytes"] == 2 * 1024 ** 2 + 3 and found["file"] == "f.bin" and found["gib_s"] > 0
    speeds = {n: found[f"{n}_readers_gib_s"] for n in (1, 4, 8, 16)}  # each part's readers, the fastest kept
    assert found["gib_s"] == max(speeds.values()) and found["one_reader_gib_s"] == speeds[1]
    if found["bytes_from_disk"] is not None and found["cold"]:  # a disk, not a tmpfs: it really read the bytes
        assert found["bytes_from_disk"] >= 0.9 * found["bytes"]
    assert job_profile.peaks("NVIDIA H100 80GB HBM3")["peak_tflops"] == 1978.9
    assert job_profile.peaks("NVIDIA H100 PCIe")["peak_tflops"] == 1513.0
    assert job_profile.peaks("NVIDIA H200")["peak_bf16_tflops"] == 989.4
    assert job_profile.peaks("cpu")["peak_tflops"] is None


# ---- the published files' layouts ----------------------------------------------------------

def h3_shapes(blocks=50, refiner=2):
    shapes = {}
    for prefix in [f"blocks.{i}" for i in range(blocks)] + [f"token_refiner.blocks.{i}" for i in range(refiner)]:
        shapes.update({f"{prefix}.attn.qkv_proj.weight": (21504, 5376), f"{prefix}.attn.out_proj.weight": (5376, 7168),
                       f"{prefix}.mlp.fc1.weight": (28672, 5376), f"{prefix}.mlp.fc2.weight": (5376, 14336),
                       f"{prefix}.norm1.weight": (5376,)})
    shapes["blocks.0.adaln_proj.linear.weight"] = (96768, 8)
    return shapes


@pytest.mark.parametrize("qkv", e2e_models.QKV_LAYOUTS)
def test_the_random_turbo_loras_qkv_is_drawn_side_by_side_or_dense(tmp_path, qkv):
    model = tmp_path / "dit.safetensors"
    safetensors.torch.save_file({"blocks.0.attn.qkv_proj.weight": torch.zeros(3 * 32, 16),
                                 "blocks.0.mlp.fc1.weight": torch.zeros(64, 16),
                                 "blocks.0.norm.weight": torch.zeros(16)}, str(model))
    job = {"model": str(model), "path": str(tmp_path / "lora.safetensors"), "rank": 4, "seed": 0, "qkv": qkv}
    assert e2e_models._write_lora(job, "cpu")["qkv"] == qkv
    lora = safetensors.torch.load_file(job["path"])
    assert lora["diffusion_model.blocks.0.attn.qkv_proj.lora_up.weight"].shape == (96, 12)
    assert lora["diffusion_model.blocks.0.attn.qkv_proj.lora_down.weight"].shape == (12, 16)
    for name, blocks in (("attn.qkv_proj", 3 if qkv == "side_by_side" else 1), ("mlp.fc1", 1)):
        up = lora[f"diffusion_model.blocks.0.{name}.lora_up.weight"].float()
        mask = torch.block_diag(*[torch.ones(up.shape[0] // blocks, up.shape[1] // blocks)] * blocks).bool()
        assert up[mask].ne(0).all() and not up[~mask].any(), name  # off the diagonal blocks: zero
        # each output's delta about 2% of a unit-variance weight's: up's rows' norms 0.02, whichever the layout
        assert 0.01 < up.norm(dim=1).mean().item() < 0.03, name
    with pytest.raises(ValueError, match="qkv layout"):
        e2e_models.make_turbo_lora(model, tmp_path / "x.safetensors", tmp_path, qkv="fused")


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
def test_tiny_whole_job_times_every_stage_and_profiles_both_jobs(tmp_path):
    host = upstream_host()
    out = tmp_path / "job.json"
    # the servers inherit BIGDIT_READ_AHEAD=0: the read-ahead's background reads belong to no stage, and the floors
    # checked below are of the stages' own reads (with it on, a stage's read floor is not a floor: see the docs)
    run = subprocess.run([str(host.python), str(TESTS / "bench" / "whole_job.py"), "--tiny", "--comfyui",
                          str(host.comfyui), "--configs", "template,pack", "--between-jobs", "free", "--lora-change",
                          "--lora-second",
                          "--work", str(tmp_path / "w"), "--out", str(out)], capture_output=True, text=True, timeout=600,
                         env={**os.environ, "BIGDIT_READ_AHEAD": "0"})
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    data = json.loads(out.read_text())
    by = {(r["config"], r["job"]): r for r in data["results"]}
    assert sorted(by) == [(config, job) for config in ("pack", "template") for job in (1, 2, 3, 4)]
    assert by[("pack", 3)]["lora_strength"] == by[("template", 3)]["lora_strength"] == whole_job.LORA_CHANGE
    assert by[("pack", 4)]["second_lora"] == {"lora_name": whole_job.SECOND_LORA_FILE,
                                              "strength_model": whole_job.LORA_SECOND}
    assert all(r["status"] == "ok" for r in by.values()), {k: r.get("error") for k, r in by.items()}
    assert set(data["files"]) >= {"dit", "video_vae", "audio_vae", "lora"} and "text_encoder" not in data["files"]
    disk = data["machine"]["disk"]
    assert disk["gib_s"] > 0 and disk["bytes"] > 0 and "error" in data["machine"]["device"]  # no device on CPU
    file_bytes = round(sum(info["gib"] for role, info in data["files"].items() if isinstance(info, dict)
                           and role != "second_lora") * 2 ** 30)  # what the first job reads: the fourth's LoRA not
    assert data["files"]["second_lora"]["file"] == whole_job.SECOND_LORA_FILE
    assert data["files"]["lora"]["qkv"] == data["settings"]["lora_qkv"] == "side_by_side"
    dit = job_profile.dit_config(e2e_models.TINY_H3.kwargs)
    video_vae = {**job_profile.VIDEO_VAE, **e2e_models.TINY_VAE["video_decoder"]}
    audio_vae = {**job_profile.AUDIO_VAE, **{k: e2e_models.TINY_VAE["audio"][k] for k in ("latent_dim", "decoder_dim")}}
    for (config, job), rec in by.items():
        stages = rec["stages"]
        assert all(stages[s] > 0 for s in ("queue", "encoder", "model_load", "sampling", "vae_decode", "save")), stages
        assert abs(rec["stage_sum_s"] - rec["wall_s"]) <= 0.1 * rec["wall_s"]
        # the server's CPU seconds over the job (all on a CPU here), at most the machine's
        cpu = rec["cpu_by_stage_s"].values()
        process, busy = sum(c["process"] for c in cpu), sum(c["machine_busy"] for c in cpu)
        assert 0 < process <= busy + 0.5 and any(c["threads"] for c in cpu), rec["cpu_by_stage_s"]
        # each node's reads: with the queue's, the job's (the nodes and the queue partition the job's time)
        assert sum(n["disk_read_gib"] for n in rec["nodes"]) * 2 ** 30 + rec["disk_read_by_stage"]["queue"] == \
            pytest.approx(sum(rec["disk_read_by_stage"].values()))
        assert rec["sampling"]["steps"] == 2 and rec["sampling"]["calls_per_step"] == [1, 1]
        assert rec["video"]["frames"] == 22 and rec["video"]["audio_streams"] == 1 and rec["video"]["bytes"] > 0
        assert rec["latent_shape"] == [1, 24, 7, 4, 4]  # 64x64, 22 frames: 7 latent frames of 4x4
        # the call's packed rows: the test conditioning's 16 tokens, 37 stereo audio frames, 7 x 2 x 2 patches
        assert rec["model_input"] == {"context": [1, 16, 256], "rows": {"text": 16, "audio": 74, "video": 28}}
        assert rec["host_rss_peak_gib"] > 0 and rec["ram"]["enforced"] is False
        assert rec["ram_budgets"]["32g"] == {"unreclaimable_fits": True, "rss_fits": True}
        assert rec["between_jobs" if job >= 2 else "job"] == ("free" if job >= 2 else 1)
        # every loader ran in both jobs (the second after ComfyUI's cache was freed)
        assert all(item["ran"] for item in rec["loads"]) and len(rec["loads"]) == 4 + (job == 4)  # two LoRAs
        profile = rec["profile"]
        assert list(profile["stages"]) == list(whole_job.STAGES)
        for name, stage in profile["stages"].items():
            assert stage["seconds"] == stages[name] and stage["bytes_read"] == rec["disk_read_by_stage"][name]
            assert stage["floor_s"] == max(stage["read_s"], stage["memory_s"]) >= 0  # no compute bound on a CPU
            if stage["floor_kind"] == "read":  # a lower bound: no stage reads faster than the disk, but its bytes
                # may include what was read up to two samples' time around it (a 20 ms stage with its imports)
                assert 0 < stage["floor_s"] <= stage["seconds"] + 2 * whole_job.SAMPLE_S, (config, job, name, stage)
        # the FLOPs of the tiny configuration's own counts (checked against torch's count above); no peak on a CPU
        step = job_profile.total(job_profile.dit_call_flops(dit, rec["model_input"]["rows"]))
        assert profile["stages"]["sampling"]["flops"] == 2 * step and profile["stages"]["sampling"]["compute_s"] is None
        assert profile["stages"]["sampling"]["counted"] == {"calls": 2, "rows": rec["model_input"]["rows"],
                                                            "flops_per_call": step}
        assert profile["stages"]["vae_decode"]["counted"]["video_passes"] == 1  # 7 latent frames, one 64-pixel tile
        decode = job_profile.total(job_profile.video_decode_flops(rec["latent_shape"], video_vae)) + \
            job_profile.total(job_profile.audio_decode_flops([1, 32, 2, 37], audio_vae))
        assert profile["stages"]["vae_decode"]["flops"] == decode > 0
        assert profile["stages"]["sampling"]["weight_bytes_moved"] == 2 * job_profile.dit_weight_bytes(dit)
        assert profile["stages"]["encoder"]["flops"] == 0  # test conditioning, no encoder model
        assert profile["floor_s"] == pytest.approx(sum(s["floor_s"] for s in profile["stages"].values()))
        # a cold first job must read the four files; the second may find them in the page cache
        assert profile["must_read_bytes"] == (pytest.approx(file_bytes) if job == 1 else 0)
        if job == 1 and disk["cold"]:  # the files came from a disk (not a tmpfs): the job read them
            assert profile["floor_s"] > 0 and profile["floor_overlapped_s"] == pytest.approx(
                file_bytes / 2 ** 30 / disk["gib_s"]) and profile["floor_overlapped_kind"] == "read"
        assert profile["floor_s"] <= profile["seconds"]
        # each job against the reference's same job: the same prompt and seed
        if config == "pack":
            assert rec["latent"]["vs_template"]["video"]["cosine"] > 0.999 and rec["latent"]["vs_template"]["video"][
                "finite"]
    template, pack = by[("template", 1)], by[("pack", 1)]
    assert "vs_template" not in template.get("latent", {})
    # the pack's loader: the quantize-once cache in a fresh folder of the server's own; the INT8 file's plain layers
    # stay as stored, so nothing is quantized at load and each job's load, the second after ComfyUI's cache was
    # freed, is a miss that writes nothing
    load = {r["job"]: next(i for i in r["loads"] if i["class_type"] == "LoadH3Quantized") for r in
            (pack, by[("pack", 2)])}
    for job in (1, 2):
        assert load[job]["cache"] == "miss" and "not written: nothing was quantized or converted" in \
            load[job]["cache_line"], load[job]
        assert load[job]["report"].startswith("quantized ")
    assert pack["quant_cache"].startswith("on") and pack["quant_cache_files"]["files"] == 0
    assert template["quant_cache"] == "off"
    # each server an empty Triton cache of its own (--triton-cache cold): nothing there at its start
    assert all(r["triton_cache"]["mode"] == "cold" and r["triton_cache"]["entries_at_start"] == 0
               and r["triton_cache"]["entries_added"] >= 0 for r in by.values())
    assert next(i for i in template["loads"] if i["class_type"] == "UNETLoader").get("cache") is None
    assert pack["reports"]["140:141"].startswith("attention: backend")
    # QuantizedCLIPLoader on the encoder file's layer kinds, checked once after the first job: it loads them, or
    # the refusal names the INT8 token embedding no Linear takes (the pack configurations then use CLIPLoader)
    check = data["encoder_check"]
    assert check["loads"] is True or (check["loads"] is False and "token_embedding" in check["error"]), check
    assert "encoder_loader" not in pack  # --tiny has no encoder
    ratio = data["summary"]["turbo_64g_job2"]["speedup"]["pack_vs_template"]
    assert ratio["whole"] == pytest.approx(by[("template", 2)]["wall_s"] / by[("pack", 2)]["wall_s"])
    assert "pack vs template: whole job" in run.stdout and "  profile turbo 64G pack job 2:" in run.stdout
    assert not list((tmp_path / "w").rglob("*.safetensors")) and not list((tmp_path / "w").rglob("*.mp4"))
    printed = subprocess.run([sys.executable, str(TESTS / "bench" / "job_profile.py"), str(out), "--config", "pack"],
                             capture_output=True, text=True, timeout=60)
    assert printed.returncode == 0 and printed.stdout.count("  profile ") == 4, printed.stderr  # the pack's jobs



def test_a_second_job_samples_the_first_jobs_model_as_a_users_does(tmp_path):
    """With ComfyUI's cache kept between the jobs, the second job reuses every node of the model's chain, the
    benchmark's step timer too (cached, it hands the sampler the same clone of the model): the model is not loaded
    again, as in a user's second job, and the second sampling still has a record of its own."""
    host = upstream_host()
    out = tmp_path / "job.json"
    run = subprocess.run([str(host.python), str(TESTS / "bench" / "whole_job.py"), "--tiny", "--comfyui",
                          str(host.comfyui), "--configs", "pack", "--work", str(tmp_path / "w"), "--out", str(out)],
                         capture_output=True, text=True, timeout=600, env={**os.environ, "BIGDIT_READ_AHEAD": "0"})
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    by = {r["job"]: r for r in json.loads(out.read_text())["results"]}
    assert sorted(by) == [1, 2] and all(r["status"] == "ok" for r in by.values())
    assert by[2]["between_jobs"] == "keep"
    assert all(r["sampling"]["steps"] == 2 and r["sampling"]["calls_per_step"] == [1, 1] for r in by.values())
    assert by[2]["sampling"]["step_seconds"] != by[1]["sampling"]["step_seconds"]  # the second job's own record
    log = out.with_suffix(".log").read_text()
    assert len(re.findall(r"Requested to load MiniMaxH3$", log, re.M)) == 1, log[-4000:]  # the first job's only


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


def test_cached_by_stage_reads_each_stages_first_start_and_last_end():
    gib = whole_job.GIB
    cached = [(0.0, {"vae": 0}), (1.0, {"vae": 2 * gib}), (2.0, {"vae": gib}), (3.0, {"vae": None})]
    segs = [(0.5, 1.5, "sampling", "a"), (1.5, 2.5, "vae_decode", "b"), (2.6, 3.5, "vae_decode", "c")]
    assert whole_job.cached_by_stage(segs, cached) == {"sampling": {"vae": [0.0, 2.0]},
                                                       "vae_decode": {"vae": [2.0, None]}}
    assert whole_job.cached_by_stage(segs, []) == {}
    early = [(5.0, {"vae": gib})]  # no sample before a stage: the first one stands for it
    assert whole_job.cached_by_stage(segs[:1], early) == {"sampling": {"vae": [1.0, 1.0]}}


def test_the_decodes_residency_is_taken_as_vaedecode_starts_not_at_the_vae_loader():
    gib = whole_job.GIB
    cached = [(0.0, {"vae": 0}), (1.0, {"vae": gib}), (5.0, {"vae": 3 * gib})]
    segs = [(0.5, 1.5, "vae_decode", "loader"), (1.5, 6.0, "sampling", "s"), (6.0, 8.0, "vae_decode", "decode")]
    graph = {"loader": {"class_type": "VAELoader"}, "s": {"class_type": "SamplerCustomAdvanced"},
             "decode": {"class_type": "VAEDecode"}}
    assert whole_job.cached_by_stage(segs, cached)["vae_decode"]["vae"][0] == 0.0  # the stage's start: the loader's
    assert whole_job.cached_at_decode(segs, graph, cached) == {"vae": 3.0}
    assert whole_job.cached_at_decode(segs[:2], graph, cached) is None  # no VAEDecode
    assert whole_job.cached_at_decode(segs, graph, []) is None


def test_monitor_samples_the_files_page_cache(tmp_path):
    path = tmp_path / "dit.safetensors"
    path.write_bytes(b"x" * 8192)
    monitor = whole_job.Monitor(os.getpid(), interval=0.01, files={"dit": path}, cache_every=2)
    monitor.start()
    time.sleep(0.05)
    monitor.stop()
    assert len(monitor.cached) >= 2 and monitor.cached[-1][1] == {"dit": 8192}


def _two_block_file(path: Path) -> dict:
    """A safetensors file of two blocks' weights and a head, each several pages; returns its header's offsets."""
    from safetensors.torch import save_file
    tensors = {f"blocks.{i}.attn.weight": torch.full((64, 1024), float(i)) for i in range(2)}
    tensors["head.weight"] = torch.ones(16, 1024)
    save_file(tensors, str(path))
    with open(path, "rb") as f:
        length = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(length))
    return {name: 8 + length + entry["data_offsets"][0] for name, entry in header.items() if name != "__metadata__"}


def test_tensor_pages_groups_a_safetensors_files_pages_by_tensor_name(tmp_path):
    path = tmp_path / "dit.safetensors"
    offsets = _two_block_file(path)
    starts, groups = page_cache.tensor_pages(path)
    assert starts[0] == 0 and starts == sorted(set(starts))
    by_group = {}
    for start, group in zip(starts, groups):
        by_group.setdefault(group, []).append(start)
    assert set(by_group) == {"blocks.*.attn.weight", "head.weight"}  # the header's page: the first block's too
    assert sorted(by_group["blocks.*.attn.weight"]) == sorted(
        offsets[f"blocks.{i}.attn.weight"] // whole_job.PAGE for i in range(2))
    (tmp_path / "not.safetensors").write_bytes(b"\xff" * 16)
    assert page_cache.tensor_pages(tmp_path / "not.safetensors") is None


def test_newly_cached_counts_the_pages_read_since_by_their_tensors_group():
    page = whole_job.PAGE
    layout = ([0, 1, 5, 9], ["header", "blocks.*.w", "blocks.*.w", "head"])
    before = bytes([1, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0])
    after = bytes([1, 1, 1, 0, 0, 1, 0, 0, 1, 1, 0])  # pages 1, 2 and 5, 8 of the blocks; 9 of the head
    assert page_cache.newly_cached(before, after, layout) == {"blocks.*.w": 4 * page, "head": page}
    assert page_cache.newly_cached(after, before, layout) == {}  # dropped pages are no reads


def test_reads_by_stage_sums_each_stages_reads_by_group_largest_first():
    mib = 2 ** 20
    segs = [(0.0, 1.0, "model_load", "s"), (1.0, 3.0, "sampling", "s"), (3.0, 4.0, "model_load", "t")]
    reads = [(-1.0, "dit", {"blocks.*.w": 900 * mib}),  # before the job
             (0.5, "dit", {"blocks.*.w": 100 * mib, "head": 4 * mib}), (0.9, "lora", {"up": 64 * mib}),
             (2.0, "dit", {"blocks.*.w": 512 * mib}), (3.5, "dit", {"blocks.*.w": 28 * mib}),
             (9.0, "dit", {"head": 900 * mib})]  # after it
    assert whole_job.reads_by_stage(segs, reads) == {
        "model_load": {"dit": {"blocks.*.w": round(128 / 1024, 3)}, "lora": {"up": 0.062}},  # head's 4 MiB left out
        "sampling": {"dit": {"blocks.*.w": 0.5}}}
    assert whole_job.reads_by_stage(segs, []) == {}
    rec = {"file_reads_by_stage_gib": whole_job.reads_by_stage(segs, reads)}
    assert whole_job.reads_lines(rec) == ["    read in model_load: dit blocks.*.w 0.12; lora up 0.06 GiB",
                                          "    read in sampling: dit blocks.*.w 0.50 GiB"]
    assert whole_job.reads_lines({}) == []


@pytest.mark.skipif(not hasattr(os, "posix_fadvise"), reason="the system has no posix_fadvise (not Linux)")
def test_monitor_names_the_tensors_whose_pages_a_job_read(tmp_path):
    path = tmp_path / "dit.safetensors"
    offsets = _two_block_file(path)
    with open(path, "rb") as f:
        os.fsync(f.fileno())  # the kernel drops only clean pages
        os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
    if page_cache.cached_bytes(path) > whole_job.PAGE:
        pytest.skip("this file system keeps the file's pages cached (tmpfs)")
    monitor = whole_job.Monitor(os.getpid(), interval=0.01, files={"dit": path}, cache_every=1)
    monitor.start()
    time.sleep(0.05)
    with open(path, "rb") as f:  # the second block's weight, as a loader reads it
        f.seek(offsets["blocks.1.attn.weight"])
        f.read(64 * 1024 * 4)
    time.sleep(0.05)
    monitor.stop()
    read = {}
    for _, role, groups in monitor.reads:
        assert role == "dit"
        for group, n in groups.items():
            read[group] = read.get(group, 0) + n
    block = 64 * 1024 * 4
    # the second block's pages, once each, and none of the first block's (the kernel reads ahead, never behind)
    assert block - 2 * whole_job.PAGE <= read.get("blocks.*.attn.weight", 0) <= block + whole_job.PAGE, read
