"""The pack end to end in a real ComfyUI: sampler step time, load time, peak VRAM and accuracy per configuration.

For each model, length and configuration it starts a fresh headless ComfyUI
(the host's main.py through tests/bench/vram_cap.py: a 24 GiB card emulated for
the capped configurations, none for the reference), queues one graph over HTTP

    loader [-> pack nodes] -> BigditStepTimer -> KSampler (euler, cfg 1) -> SaveLatent, BigditRunReport
    BigditRandomConditioning (seeded [1, 512, text_dim], no text encoder) -> positive and negative
    EmptyHunyuanLatentVideo (the length) -> KSampler

and stops the server, so every configuration starts clean. Measured (the test
nodes in tests/fixtures/bigdit_testnodes/bench.py record inside the server):
- step_s: median wall time of a sampler step after the first (the first, with
  its warm-up, is first_step_s), each model call between two CUDA synchronizes;
- load_s: from the prompt's start to the first model call (reading, quantizing
  and ComfyUI's loading to the GPU), split into loader_s (until the loader's
  output reaches the timer node) and to_gpu_s (inside the sampler, before the
  first call);
- peak_gib: torch.cuda.max_memory_allocated over the prompt (loading and
  sampling); peak_sampling_gib: sampling alone; device_used_peak_sampling_gib:
  the device's used memory (NVML, polled) during sampling, which also counts
  what the allocator does not (upstream's dynamic-VRAM weight pages, the context);
- ready_s: load_s plus the first step's excess over step_s (upstream's dynamic VRAM reads the
  weights during the first step: its load_s alone leaves that out);
- host_rss_peak_gib: the server's peak resident set (loading included); host_rss_sampling_gib:
  the largest resident set after a model call; host_rss_gib,
  host_rss_anon_gib, host_rss_file_gib: after sampling, all, anonymous, mapped file pages;
  weights_bytes (and weights_gib): the sampled model's weights as ComfyUI counts them (model_size), and
  host_rss_peak_over_weights, host_rss_sampling_over_weights: the two resident sets over them
  (issue 19's targets: at most 1.25 and 1.1);
- rel_l2 and cosine of the saved latent against comfy_resident's at the same
  model and length, and vs_resident = its step_s / this step_s;
- breakdown: the device time of one model call of the second step by kind (GEMM, attention, copies,
  other) and its largest kernels, from torch.profiler (the test node says which call);
- pack_reports: the text the pack's nodes returned (what they chose), and
  log_lines: ComfyUI's and the pack's loading, offload and attention lines.

The JSON (tests/bench/results/comfy-e2e-<gpu>-comfyui-<host version>-<date>.json unless --out/--out-dir)
is rewritten after every configuration, so a run killed at its time limit keeps
what finished; a failing configuration records its error and the run goes on.
Each server's log goes to the .log file beside it. The JSON ends with issue 12's

    "summary": {"dense_speedup", "sol_speedup", "vs_comfy_best", "peak_gib_capped", "lora_cost"}

on the run's first model (wan14b in a real run) at its longest length:
dense_speedup = comfy_resident step / the pack's best dense configuration's
step (every capped pack configuration but Sol), sol_speedup the same with
pack_auto_sol, vs_comfy_best = ComfyUI's fastest capped configuration's step /
the pack's best dense step, peak_gib_capped = the highest peak_gib of the pack's
capped configurations at any length; configurations with a LoRA or a card
of their own stay out of these. lora_cost (issue 13) = pack_auto_lora's step /
pack_auto's - 1: a random rank-32 LoRA on every block linear (e2e_models.make_lora,
written beside the model), not in the default set (--configs ...,pack_auto,pack_auto_lora;
pack_auto_12g and pack_auto_lora_12g on a 12 GiB card, where ComfyUI loads the model
partially; issue 19: pack_auto_8g on an 8 GiB card, and comfy_fp8_marker_12g / comfy_fp8_marker_8g,
ComfyUI's own FP8 file on the same cards). Issue 32's --configs lora2g (LORA_2G_CONFIGS): a random H3 turbo LoRA
(e2e_models.make_turbo_lora, 1.82 GiB bf16; on other models a LoRA of that size on every block linear) on
LoadH3Quantized auto (the bf16 file), and on the INT8 marker file through MixedCheckpointLoader and through
UNETLoader, each on the card and resident, beside the same configuration without it (summary_detail.lora).
"summary_detail" names the configurations behind each number, and under "missing" the run each number left None
lacks (the run's last lines print them).

The quantize-once cache (issue 32, item 3; not in the default set): pack_auto_cached runs LoadH3Quantized auto
twice in one server, each load its own prompt, with the cache in a folder of its own (every other configuration runs
with the cache off), then UNETLoader on the cache file the first wrote (a file of the same size, read from the same
page cache). Its record is the first load's (the miss), with "hit" and "unet_same_file" the measurements of the
other two prompts, "server_rss_start_gib" the server's resident set before the first, and "cache_targets":
hit_load_over_unet and hit_ready_over_unet (load_s and ready_s, the hit's over UNETLoader's: target at most 1.1),
hit_rss_sampling_over_weights (the hit's host_rss_sampling_over_weights: target at most 1.1), the same less the
resident set the server started with, the hit's latent against the miss's, and each load's report line.

Issue 21's formats table (tests/doc_tables.py formats_table) is one run of FORMAT_CONFIGS, not in the
default set (--configs formats): comfy_resident (bf16) and LoadH3Quantized with each format named, on the
emulated card: pack_fp8 (float8_e4m3fn), pack_int8 (int8_convrot), pack_w4a8 (asym_w4a8_int8), pack_w4a4
(convrot_w4a4); and pack_mixed_nvfp4, MixedCheckpointLoader on an NVFP4 marker file of the same weights.

Issue 19's full MiniMax-H3 (model h3full: 33B parameters, 66 GB in bf16, more than the GPU machine's disk)
runs from its marker files only (--configs full, FULL_CONFIGS): for each of int8_convrot and fp8, ComfyUI's
UNETLoader resident (comfy_int8_marker_resident, comfy_fp8_marker_resident: the reference of that file's
configurations), UNETLoader on the emulated card, and the pack's MixedCheckpointLoader on it (pack_mixed_int8,
pack_mixed_fp8); --configs full4 (FULL_4BIT_CONFIGS) the same for its W4A8 and W4A4 files (issue 21: the full
H3 in 4 bits on 24 GiB). Each configuration compares with the resident configuration of its own file where one
ran (RESIDENT), else with comfy_resident; "reference" in its record names which.

Models are random-weight, full size, generated on the GPU of the machine that
runs this (tests/bench/e2e_models.py), one file at a time, deleted after their
configurations unless --keep-model. Configurations that load a ComfyUI marker
file (comfy_int8_marker, comfy_fp8_marker: the same weights quantized into
int8_convrot / fp8 `comfy_quant` layers, through UNETLoader) run after the bf16
ones, each format's file generated when the previous one is deleted.

Hosts: the same configurations on ComfyUI 0.3.75 and upstream 0.33.0 (--comfyui).
What a configuration needs of the host is read from its source (HOST_FEATURES):
on upstream, dynamic VRAM (comfy-aimdo) is the default, so comfy_resident and
comfy_capped run with it and comfy_capped_static (comfy_resident_static) pass
--disable-dynamic-vram; the marker configurations need comfy-kitchen formats in
ComfyUI's quant_ops. The default set leaves out what the host lacks; one named
anyway is recorded as skipped. Under the emulated card, tests/bench/vram_cap.py
also raises --vram-headroom so that dynamic VRAM keeps the rest of the real card
free (its weight pages bypass PyTorch's allocator and its cap).

    python tests/bench/comfy_e2e.py --comfyui COMFYUI_DIR [--configs a,b] [--lengths long,short] [--steps 3]
    python tests/bench/comfy_e2e.py --tiny --out OUT.json     # the same path on CPU with a tiny Wan

On the GPU machine, tests/bench/device/run_e2e.sh unpacks what that machine
lacks and runs this; tests/bench/device/README.md gives the device call.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

BENCH_DIR = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH_DIR.parent))

import e2e_models  # noqa: E402
from _pack import RESULTS, slug  # noqa: E402
from comfy_harness import (QUANT_CACHE_OFF, ComfyServer, PromptError, cache_dir, combo_options,  # noqa: E402
                            comfyui_version, link_packs)

GIB = 1024 ** 3
REFERENCE = "comfy_resident"
# a marker file configuration's name part -> its e2e_models.FORMATS file format
MARKER_FILES = {"int8": "int8_convrot", "fp8": "fp8", "w4a8": "w4a8", "w4a4": "w4a4", "nvfp4": "nvfp4"}


@dataclass(frozen=True)
class Config:
    """One configuration: a loader, nodes applied to its model in order, whether it runs on the emulated card.

    family "comfy" or "pack"; `sol`: the pack's sparse attention, `lora`: a LoRA on the model (both kept out
    of the dense comparisons); `cap_gib`: this configuration's emulated card instead of the run's --cap-gib;
    `model_format`: the model file it loads (e2e_models.FORMATS: bf16, or a ComfyUI marker file);
    `comfy_args`: ComfyUI flags of its server; `needs`: the host feature it needs (HOST_FEATURES), else it is
    skipped (and left out of the default set); `cache`: the quantize-once cache is on, and the configuration loads
    twice and then runs UNETLoader on the cache file (the module's docstring).
    """
    name: str
    family: str
    capped: bool
    loader: tuple
    chain: tuple = ()
    sol: bool = False
    lora: bool = False
    cap_gib: float | None = None
    model_format: str = "bf16"
    comfy_args: tuple = ()
    needs: str | None = None
    cache: bool = False


def _unet(weight_dtype="default"):
    return ("UNETLoader", {"weight_dtype": weight_dtype})


def _pack_loader(quantization, offload="auto"):
    return ("LoadH3Quantized", {"quantization": quantization, "offload": offload, "group_size": "256",
                                "ignored_layers": ""})


def _mixed_loader(int8="auto"):
    return ("MixedCheckpointLoader", {"nvfp4": "auto", "int8": int8})


def _lora(file=e2e_models.LORA_FILE):
    return ("LoraLoaderModelOnly", {"lora_name": file, "strength_model": 1.0})


def _lora_2g():
    return _lora(e2e_models.LORA_2G_FILE)


def _attention(backend, sol_tau=1.0):
    return ("SetAttentionBackend", {"backend": backend, "dense_backend": "auto", "sol_tau": sol_tau,
                                    "dense_steps": 0, "dense_layers": ""})


def _compile():
    """ComfyUI's own TorchCompileModel (inputs model and backend on 0.3.75 and 0.33.0), before the sampler."""
    return ("TorchCompileModel", {"backend": "inductor"})


def make_configs(fp8_attention_backend: str) -> dict[str, Config]:
    configs = [
        Config(REFERENCE, "comfy", False, _unet()),
        Config("comfy_capped", "comfy", True, _unet()),
        Config("comfy_fp8_fast", "comfy", True, _unet("fp8_e4m3fn_fast")),
        Config("pack_auto", "pack", True, _pack_loader("auto")),
        Config("pack_auto_flash", "pack", True, _pack_loader("auto"), (_attention("flash"),)),
        Config("pack_auto_fp8attn", "pack", True, _pack_loader("auto"), (_attention(fp8_attention_backend),)),
        Config("pack_auto_sol", "pack", True, _pack_loader("auto"), (_attention("sol", 1.0),), sol=True),
        Config("pack_int8", "pack", True, _pack_loader("int8_convrot")),
        # upstream ComfyUI: dynamic VRAM (comfy-aimdo) is its default on NVIDIA, so comfy_resident and comfy_capped
        # run with it there; these run without it, and ComfyUI's own marker files through UNETLoader
        Config("comfy_capped_static", "comfy", True, _unet(), comfy_args=("--disable-dynamic-vram",),
               needs="dynamic_vram"),
        # not in the default set
        Config("comfy_resident_static", "comfy", False, _unet(), comfy_args=("--disable-dynamic-vram",),
               needs="dynamic_vram"),
        Config("pack_auto_attn_auto", "pack", True, _pack_loader("auto"), (_attention("auto"),)),
        # SageAttention (issue 22): the pack's sage backend, and the host's own switches with the same package
        # installed (SageAttention 2 where tests/bench/device/run_e2e.sh built it)
        Config("pack_auto_sage", "pack", True, _pack_loader("auto"), (_attention("sage"),)),
        Config("pack_auto_sol_sage", "pack", True, _pack_loader("auto"),
               (("SetAttentionBackend", {**_attention("sol", 1.0)[1], "dense_backend": "sage"}),), sol=True),
        Config("comfy_fp8_fast_sage", "comfy", True, _unet("fp8_e4m3fn_fast"), comfy_args=("--use-sage-attention",)),
        Config("comfy_fp8_fast_ck", "comfy", True, _unet("fp8_e4m3fn_fast"), comfy_args=("--use-ck-attention",),
               needs="ck_attention"),
        Config("pack_bf16_offload", "pack", True, _pack_loader("none")),
        # offload against dynamic VRAM on a model over the card: the pack's own streaming where ComfyUI's
        # dynamic VRAM is off; and the pack's quantized model with no cap, the reference of its capped runs
        Config("pack_auto_static", "pack", True, _pack_loader("auto"), comfy_args=("--disable-dynamic-vram",),
               needs="dynamic_vram"),
        Config("pack_bf16_offload_static", "pack", True, _pack_loader("none"),
               comfy_args=("--disable-dynamic-vram",), needs="dynamic_vram"),
        Config("pack_auto_resident", "pack", False, _pack_loader("auto")),
        # the compiled step (issue 12's non-GEMM lever), each against its uncompiled twin
        Config("pack_auto_compiled", "pack", True, _pack_loader("auto"), (_compile(),)),
        Config("comfy_fp8_fast_compiled", "comfy", True, _unet("fp8_e4m3fn_fast"), (_compile(),)),
        Config("pack_auto_sage_compiled", "pack", True, _pack_loader("auto"), (_attention("sage"), _compile())),
        # a LoRA's cost (issue 13): against pack_auto on the same card; on 12 GiB part of the model stays in
        # RAM, so ComfyUI loads it partially and the pack folds the LoRA into the offloaded layers
        Config("pack_auto_lora", "pack", True, _pack_loader("auto"), (_lora(),), lora=True),
        Config("pack_auto_12g", "pack", True, _pack_loader("auto"), cap_gib=12.0),
        # issue 19: cards smaller than the quantized layers, against ComfyUI's own FP8 file on the same card
        Config("pack_auto_8g", "pack", True, _pack_loader("auto"), cap_gib=8.0),
        Config("comfy_fp8_marker_12g", "comfy", True, _unet(), model_format="fp8", needs="kitchen_markers",
               cap_gib=12.0),
        Config("comfy_fp8_marker_8g", "comfy", True, _unet(), model_format="fp8", needs="kitchen_markers",
               cap_gib=8.0),
        # ... and against the host's own FP8 option on 0.3.75, which has no marker files of kitchen formats
        Config("comfy_fp8_fast_12g", "comfy", True, _unet("fp8_e4m3fn_fast"), cap_gib=12.0),
        Config("comfy_fp8_fast_8g", "comfy", True, _unet("fp8_e4m3fn_fast"), cap_gib=8.0),
        Config("pack_auto_lora_12g", "pack", True, _pack_loader("auto"), (_lora(),), lora=True, cap_gib=12.0),
        # issue 21's formats table: each online format named, on pack_int8's card (the full H3 in 4 bits on 24 GiB)
        Config("pack_fp8", "pack", True, _pack_loader("float8_e4m3fn")),
        Config("pack_w4a8", "pack", True, _pack_loader("asym_w4a8_int8")),
        Config("pack_w4a4", "pack", True, _pack_loader("convrot_w4a4")),
        # the quantize-once cache: a miss, a hit, and UNETLoader on the cache file; its marker file needs the host's
        # kitchen formats
        Config("pack_auto_cached", "pack", True, _pack_loader("auto"), needs="kitchen_markers", cache=True),
        # issue 32: the H3 turbo LoRA (1.82 GiB) against the same configuration without it, the pack
        # on bf16 (auto) and on the INT8 marker file, ComfyUI's own on that file; on the card and resident
        Config("pack_auto_lora2g", "pack", True, _pack_loader("auto"), (_lora_2g(),), lora=True),
        Config("pack_auto_resident_lora2g", "pack", False, _pack_loader("auto"), (_lora_2g(),), lora=True),
        Config("pack_mixed_int8_resident", "pack", False, _mixed_loader(), model_format="int8_convrot"),
        *(Config(f"{name}_lora2g", family, capped, loader, (_lora_2g(),), lora=True, model_format="int8_convrot",
                 needs=needs)
          for name, family, capped, loader, needs in (
              ("pack_mixed_int8", "pack", True, _mixed_loader(), None),
              ("pack_mixed_int8_resident", "pack", False, _mixed_loader(), None),
              ("comfy_int8_marker", "comfy", True, _unet(), "kitchen_markers"),
              ("comfy_int8_marker_resident", "comfy", False, _unet(), "kitchen_markers"))),
    ]
    # each marker file through UNETLoader on the card and resident (that file's reference), and through the
    # pack's MixedCheckpointLoader on the card (issues 19 and 21: the full H3 from its marker files)
    for short, fmt in MARKER_FILES.items():
        configs += [Config(f"comfy_{short}_marker", "comfy", True, _unet(), model_format=fmt, needs="kitchen_markers"),
                    Config(f"comfy_{short}_marker_resident", "comfy", False, _unet(), model_format=fmt,
                           needs="kitchen_markers"),
                    Config(f"pack_mixed_{short}", "pack", True, _mixed_loader(), model_format=fmt)]
    # the INT8 file users have (Comfy-Org's *_int8_convrot layout) on the same card: UNETLoader against the pack's
    # MixedCheckpointLoader (int8 auto: INT8 as stored unless a kept measurement says FP8 pays; keep: always INT8;
    # both on the pack's Triton kernels, nothing timed unless BIGDIT_INT8_TUNE=1),
    # each with and without its side's SageAttention 2 path
    configs += [
        Config("pack_mixed_int8_keep", "pack", True, _mixed_loader("keep"), model_format="int8_convrot"),
        Config("comfy_int8_marker_sage", "comfy", True, _unet(), model_format="int8_convrot", needs="kitchen_markers",
               comfy_args=("--use-sage-attention",)),
        Config("pack_mixed_int8_sage", "pack", True, _mixed_loader(), (_attention("sage"),),
               model_format="int8_convrot"),
        Config("comfy_int8_marker_12g", "comfy", True, _unet(), model_format="int8_convrot", needs="kitchen_markers",
               cap_gib=12.0),
        Config("pack_mixed_int8_12g", "pack", True, _mixed_loader(), model_format="int8_convrot", cap_gib=12.0),
    ]
    return {c.name: c for c in configs}


# the INT8 file's comparison: its resident reference first, then each side on the 24 GiB card, then with Sage
INT8_FILE_CONFIGS = ("comfy_int8_marker_resident", "comfy_int8_marker", "pack_mixed_int8", "comfy_int8_marker_sage",
                     "pack_mixed_int8_sage", "pack_mixed_int8_keep", "comfy_int8_marker_12g", "pack_mixed_int8_12g")

# the rows of issue 21's formats table (tests/doc_tables.py formats_table): bf16, fp8, int8 ConvRot, W4A8, W4A4,
# and NVFP4, which the pack loads from a file (it does not quantize to it)
FORMAT_CONFIGS = (REFERENCE, "pack_fp8", "pack_auto", "pack_int8", "pack_w4a8", "pack_w4a4", "pack_mixed_nvfp4")

def _marker_configs(*shorts):
    return tuple(f"{kind}_{short}{suffix}" for short in shorts for kind, suffix in
                 (("comfy", "_marker_resident"), ("comfy", "_marker"), ("pack_mixed", "")))


FULL_CONFIGS = _marker_configs("int8", "fp8")
FULL_4BIT_CONFIGS = _marker_configs("w4a8", "w4a4")
# a model file's format -> the configuration that runs it resident through UNETLoader: its configurations' reference
RESIDENT = {"bf16": REFERENCE, **{fmt: f"comfy_{short}_marker_resident" for short, fmt in MARKER_FILES.items()}}
# issue 32's LoRA cost: each configuration and its twin with the turbo-sized LoRA (1.82 GiB)
LORA_2G_CONFIGS = tuple(name for base in ("pack_auto", "pack_auto_resident", "pack_mixed_int8",
                                          "pack_mixed_int8_resident", "comfy_int8_marker", "comfy_int8_marker_resident")
                        for name in (base, f"{base}_lora2g"))
PRESETS = {"formats": FORMAT_CONFIGS, "full": FULL_CONFIGS, "full4": FULL_4BIT_CONFIGS, "int8file": INT8_FILE_CONFIGS,
           "lora2g": LORA_2G_CONFIGS}
# a LoRA configuration's name less this is the same configuration without the LoRA
LORA_SUFFIX = re.compile(r"_lora(?:2g)?(?=_|$)")

DEFAULT_CONFIGS = (REFERENCE, "comfy_capped", "comfy_fp8_fast", "pack_auto", "pack_auto_flash", "pack_auto_fp8attn",
                   "pack_auto_sol", "pack_int8", "comfy_capped_static", "comfy_int8_marker", "comfy_fp8_marker")

# feature -> (file of the host, text whose presence shows it): read from the source, the host is not imported here
HOST_FEATURES = {
    "dynamic_vram": ("comfy/cli_args.py", "--disable-dynamic-vram"),  # comfy-aimdo, on by default on NVIDIA
    "kitchen_markers": ("comfy/quant_ops.py", '"int8_tensorwise"'),  # comfy_quant markers of comfy-kitchen formats
    "ck_attention": ("comfy/cli_args.py", "--use-ck-attention"),  # comfy-kitchen INT8 attention as the host's own
}


def host_features(comfyui) -> dict[str, bool]:
    found = {}
    for feature, (rel, text) in HOST_FEATURES.items():
        try:
            found[feature] = text in (Path(comfyui) / rel).read_text()
        except OSError:
            found[feature] = False
    return found


def sampling_graph(config: Config, spec: e2e_models.ModelSpec, unet_name: str, length: e2e_models.Length,
                   steps: int, seed: int, prefix: str) -> dict:
    loader_class, loader_inputs = config.loader
    graph = {"unet": {"class_type": loader_class, "inputs": {"unet_name": unet_name, **loader_inputs}}}
    model = "unet"
    for index, (class_type, inputs) in enumerate(config.chain):
        node = f"m{index}"
        graph[node] = {"class_type": class_type, "inputs": {**inputs, "model": [model, 0]}}
        model = node
    graph.update({
        "timer": {"class_type": "BigditStepTimer", "inputs": {"model": [model, 0]}},
        "cond": {"class_type": "BigditRandomConditioning",
                 "inputs": {"seed": seed, "length": spec.text_len, "dim": spec.text_dim}},
        "latent": {"class_type": spec.latent_node, "inputs": spec.latent_inputs(length)},
        "sampler": {"class_type": "KSampler", "inputs": {
            "model": ["timer", 0], "seed": seed, "steps": steps, "cfg": 1.0, "sampler_name": "euler",
            "scheduler": "simple", "denoise": 1.0, "positive": ["cond", 0], "negative": ["cond", 0],
            "latent_image": ["latent", 0]}},
    })
    video = ["sampler", 0]
    if spec.family == "h3":  # a video+audio latent: upstream's Separate AV Latent, the video part measured
        graph["split"] = {"class_type": "LTXVSeparateAVLatent", "inputs": {"av_latent": ["sampler", 0]}}
        video = ["split", 0]
    graph["save"] = {"class_type": "SaveLatent", "inputs": {"samples": video, "filename_prefix": prefix}}
    graph["report"] = {"class_type": "BigditRunReport", "inputs": {"samples": video}}
    return graph


def unoffered_choice(graph: dict, object_info: dict) -> str | None:
    """Why this server cannot run `graph` (a node type it lacks, a choice it does not offer), or None."""
    for node in graph.values():
        info = object_info.get(node["class_type"])
        if info is None:
            return f"node {node['class_type']} is not installed"
        declared = {**info["input"].get("required", {}), **info["input"].get("optional", {})}
        for name, value in node["inputs"].items():
            spec = declared.get(name)
            choices = combo_options(spec)
            if name == "unet_name" or not isinstance(value, str) or choices is None:
                continue
            if value not in choices:
                return f"{node['class_type']}.{name} does not offer {value!r} (choices: {', '.join(choices)})"
    return None


class BenchServer(ComfyServer):
    """ComfyServer's HTTP side, started through vram_cap.py, on the GPU unless `cpu`, without the frontend package.

    `ram_gib`: the host RAM ComfyUI sees (vram_cap.py --ram-gib); `cache_none`: --cache-none (else ComfyUI's
    default cache); `launcher`: a command the server runs under (systemd-run ...); `preexec_fn`, `env`: the
    server process's (a memory cgroup to join, more environment; the pack's quantize-once cache is off
    unless `env` turns it on)."""

    def __init__(self, base_dir, comfyui, log_path, cap_gib=None, cpu=False, extra_args=(), startup_timeout=300.0,
                 ram_gib=None, cache_none=True, launcher=(), preexec_fn=None, env=None):
        self.base_dir = Path(base_dir)
        self.comfyui = Path(comfyui)
        self.models_dir = self.base_dir / "models"
        self.output_dir = self.base_dir / "output"
        self.log_path = Path(log_path)
        link_packs(self.base_dir)
        web_root = self.base_dir / "web_root"  # an empty frontend: the API needs none
        web_root.mkdir(exist_ok=True)
        port = _free_port()
        self.url = f"http://127.0.0.1:{port}"
        cmd = [*launcher, sys.executable, str(BENCH_DIR / "vram_cap.py"),
               *(["--gib", str(cap_gib)] if cap_gib else []), *(["--ram-gib", str(ram_gib)] if ram_gib else []),
               "main.py", "--listen", "127.0.0.1", "--port", str(port), "--disable-auto-launch",
               "--base-directory", str(self.base_dir), "--database-url", "sqlite:///:memory:",
               "--disable-api-nodes", *(["--cache-none"] if cache_none else []), "--front-end-root", str(web_root),
               *(["--cpu"] if cpu else []), *extra_args]
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log = open(self.log_path, "ab")
        self._proc = subprocess.Popen(cmd, cwd=self.comfyui, stdout=self._log, stderr=subprocess.STDOUT,
                                      env={**os.environ, "PYTHONUNBUFFERED": "1", **QUANT_CACHE_OFF, **(env or {})},
                                      preexec_fn=preexec_fn)
        self._wait_ready(startup_timeout)


def resident(server) -> int | None:
    """The server's resident set now (Linux), in bytes."""
    try:
        with open(f"/proc/{server._proc.pid}/status") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))
    except (OSError, StopIteration):
        return None


CACHE_LINK = "quant_cache_entry.safetensors"  # UNETLoader's name for a cached configuration's cache file


def ratio(a, b) -> float | None:
    return a / b if a is not None and b else None


def cache_line(entry: dict) -> str | None:
    """The quantize-once cache's line of the loader's full report in a prompt's history entry."""
    text = "\n".join(entry["outputs"].get("unet", {}).get("report", []))
    return next((line for line in text.splitlines() if line.startswith("quantize-once cache")), None)


def _free_port() -> int:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ---- one run -------------------------------------------------------------------

LOG_LINE = re.compile(r"loaded (completely|partially)|model weight dtype|manual cast|Requested to load|lowvram|"
                      r"offload|bigdit|Set Attention Backend|LoadH3Quantized|attention|OutOfMemory|vram_cap|"
                      r"Total VRAM|pinned|Device:", re.I)


def log_lines(text: str, work: Path | None = None, limit=80) -> list[str]:
    """The lines worth keeping, with the machine's work folder written as <work>."""
    lines = [line[:500] for line in text.splitlines() if LOG_LINE.search(line)][:limit]
    return [line.replace(str(work), "<work>") for line in lines] if work else lines


ESTIMATE_RATIO = re.compile(r"(copied per forward|allocator peak) [^;]*?\(([0-9.]+)x the estimate\)")


def placement_check(lines: list[str]) -> dict | None:
    """Issue 19's item 4 on the pack's own streaming: the last run line's measured stream per forward and
    allocator peak over the estimates of the plan redrawn on the host's placement (offload/session.py)."""
    for line in reversed(lines):
        found = {("stream_ratio" if what.startswith("copied") else "peak_ratio"): float(ratio)
                 for what, ratio in ESTIMATE_RATIO.findall(line)}
        if found:
            return found
    return None


def execution_start(entry: dict) -> float | None:
    for kind, data in entry["status"]["messages"]:
        if kind == "execution_start":
            return data["timestamp"] / 1000
    return None


def steady_steps(steps: list, profiled_step: int | None) -> list:
    """The steps after the first (which loads, compiles, measures), less the profiled one where another is left.

    Runs before `profiled_step` was recorded profiled the second step whenever they hold a `breakdown`, and
    its time included the profiler's stop and event reading (0.4-1.9 s on the H200)."""
    steady = [s for i, s in enumerate(steps) if i >= 1 and i != profiled_step]
    return steady or steps[1:] or steps


def profiled_step(result: dict) -> int | None:
    """The index of a record's profiled step (see steady_steps)."""
    return result.get("profiled_step", 1 if result.get("breakdown") else None)


def measurements(report: dict, entry: dict) -> dict:
    steps = report["step_seconds"]
    steady = steady_steps(steps, profiled_step(report))
    start = execution_start(entry)
    out = {
        "step_s": statistics.median(steady) if steady else None,
        "first_step_s": steps[0] if steps else None,
        "step_seconds": steps,
        "profiled_step": profiled_step(report),
        "calls_per_step": report["calls_per_step"],
        "load_s": report["first_call"] - start if start and report["first_call"] else None,
        # what the load costs before sampling runs at speed: upstream's dynamic VRAM defers reading the
        # weights into the first step, so its first step's excess over a steady one is part of its load
        "ready_s": (report["first_call"] - start + steps[0] - statistics.median(steady)
                    if start and report["first_call"] and len(steps) > 1 else None),
        "loader_s": report["timer_node"] - start if start and report["timer_node"] else None,
        "to_gpu_s": report["first_call"] - report["sample_start"] if report["first_call"] else None,
        "sampling_s": report["sample_end"] - report["sample_start"],
        "latent_shape": report["latent_shape"],
        "comfy_saw_vram_gib": report["comfy_total_vram"] / GIB,
        "cap_applied": report["emulated_vram"] is not None,
    }
    peaks = [p for p in (report["peak_before_sampling"], report["peak_sampling"]) if p is not None]
    if peaks:
        out.update(peak_gib=max(peaks) / GIB, peak_sampling_gib=report["peak_sampling"] / GIB,
                   reserved_peak_sampling_gib=report["reserved_peak_sampling"] / GIB)
    for key in ("host_rss_peak", "host_rss_sampling", "host_rss", "host_rss_anon", "host_rss_file"):
        if report.get(key) is not None:
            out[f"{key}_gib"] = report[key] / GIB
    # issue 19's host memory targets: peak (loading) <= 1.25 x the weights, sampling <= 1.1 x
    if report.get("model_bytes"):
        out["weights_bytes"] = report["model_bytes"]
        out["weights_gib"] = report["model_bytes"] / GIB
        for key in ("host_rss_peak", "host_rss_sampling"):
            if report.get(key) is not None:
                out[f"{key}_over_weights"] = report[key] / report["model_bytes"]
    # the device as NVML saw it during sampling: also weight pages outside the allocator (dynamic VRAM)
    if report.get("device_used_peak_sampling"):
        out["device_used_peak_sampling_gib"] = report["device_used_peak_sampling"] / GIB
    if report.get("device_used_error"):
        out["device_used_error"] = report["device_used_error"]
    if report.get("breakdown"):  # one profiled model call of the second step, device ms by kind
        out["breakdown"] = report["breakdown"]
    for key in ("gpu", "capability", "allocator", "mem_get_info", "device_total_memory", "torch", "device"):
        if key in report:
            out.setdefault("server", {})[key] = report[key]
    return out


def compare(latent, reference) -> dict:
    a, b = latent.double().flatten(), reference.double().flatten()
    return {"rel_l2": float((a - b).norm() / b.norm()),
            "cosine": float(a @ b / (a.norm() * b.norm())),
            "finite": bool(latent.isfinite().all())}


# ---- the run -------------------------------------------------------------------

class Bench:
    def __init__(self, opts):
        self.opts = opts
        self.configs = make_configs(opts.fp8_attention_backend)
        self.work = Path(opts.work).resolve()
        self.base = self.work / "base"
        self.object_info = None
        self.latents = {}  # (model, length, config) -> tensor
        self.started = time.monotonic()
        self.out = Path(opts.out) if opts.out else (Path(opts.out_dir) if opts.out_dir else RESULTS) / (
            f"comfy-e2e-{'tiny-' if opts.tiny else ''}{gpu_slug()}-comfyui-{comfyui_version(Path(opts.comfyui))}-"
            f"{datetime.date.today().isoformat()}.json")
        self.log_path = self.out.with_suffix(".log")
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self.log_path.write_text("")
        self.payload = {
            "bench": "comfy-e2e",
            "environment": {"gpu": gpu_name(), "comfyui": comfyui_version(Path(opts.comfyui)),
                            "python": sys.version.split()[0], "comfy_kitchen": package_version("comfy-kitchen"),
                            "comfy_aimdo": package_version("comfy-aimdo"), "host_features": opts.host_features},
            "settings": {"models": opts.models, "lengths": opts.lengths, "configs": opts.configs,
                         "steps": opts.steps, "seed": opts.seed, "cap_gib": opts.cap_gib, "cpu": opts.cpu,
                         "configs_at": opts.configs_at, "fp8_attention_backend": opts.fp8_attention_backend,
                         "comfy_args": opts.comfy_args, "budget_s": opts.budget_s},
            "models": {},
            "results": [],
        }

    # -- output --
    def write(self):
        self.payload["summary_detail"], self.payload["summary"] = summarize(self.payload["results"],
                                                                            self.payload["models"])
        tmp = self.out.with_name(self.out.name + ".tmp")
        tmp.write_text(json.dumps(self.payload, indent=2, default=str))
        tmp.replace(self.out)

    def append_log(self, title, text):
        with open(self.log_path, "a") as f:
            f.write(f"\n===== {title} =====\n")
            for line in text.splitlines():
                f.write(line[:2000] + ("... [cut]" if len(line) > 2000 else "") + "\n")

    # -- models --
    def prepare_model(self, spec, fmt="bf16") -> dict:
        folder = self.base / "models" / "diffusion_models"
        folder.mkdir(parents=True, exist_ok=True)
        path = folder / spec.file_name(fmt)
        stamp = path.with_name(path.name + ".json")
        wanted = {"spec": spec.name, "kwargs": spec.kwargs, "seed": self.opts.seed, "format": fmt}
        if path.exists() and stamp.exists() and json.loads(stamp.read_text()).get("wanted") == wanted:
            info = {**json.loads(stamp.read_text())["info"], "reused": True}
        else:
            for old in folder.glob("bench_*.safetensors*"):  # one model file on disk at a time
                old.unlink()
            info = e2e_models.generate(spec, path, self.opts.comfyui, seed=self.opts.seed, cpu=self.opts.cpu,
                                       fmt=fmt)
            stamp.write_text(json.dumps({"wanted": wanted, "info": info}))
        info["file"] = path.name
        how = "reused" if info.get("reused") else f"generated in {info['seconds']:.1f} s on {info['device']}"
        print(f"model {spec.name} ({fmt}): {info['params'] / 1e9:.2f} B params, {info['bytes'] / 1e9:.2f} GB, "
              f"{how}", flush=True)
        # the LoRA files this file's configurations chain, written for its layers (the same for bf16 and INT8 files)
        loras = {inputs["lora_name"] for names in (self.opts.configs, *self.opts.configs_at.values())
                 for name in names if self.configs[name].model_format == fmt
                 for kind, inputs in self.configs[name].chain if kind == "LoraLoaderModelOnly"}
        for file in sorted(loras):
            target = self.base / "models" / "loras" / file
            if file == e2e_models.LORA_2G_FILE and spec.family == "h3":
                made = e2e_models.make_turbo_lora(path, target, self.opts.comfyui, seed=self.opts.seed,
                                                  cpu=self.opts.cpu)
            else:
                made = e2e_models.make_lora(path, target, seed=self.opts.seed, **e2e_models.LORAS[file])
            info["lora" if file == e2e_models.LORA_FILE else f"lora:{file}"] = made
            print(f"lora {file}: rank {made['rank']} on {made['layers']} layers, {made['bytes'] / 1e6:.0f} MB",
                  flush=True)
        return info

    # -- one configuration --
    def run_one(self, spec, length, config, skip=None) -> dict:
        opts = self.opts
        cap_gib = (config.cap_gib or opts.cap_gib) if config.capped else None
        rec = {"config": config.name, "family": config.family, "model": spec.name, "length": length.name,
               "size": length.label, "tokens": spec.tokens(length), "capped": config.capped, "cap_gib": cap_gib,
               "sol": config.sol, "lora": config.lora, "own_cap": config.cap_gib is not None,
               "model_format": config.model_format, "comfy_args": list(config.comfy_args), "status": None}
        prefix = f"e2e/{spec.name}_{length.name}_{config.name}"
        graph = sampling_graph(config, spec, spec.file_name(config.model_format), length, opts.steps, opts.seed,
                               prefix)
        if skip:
            return {**rec, "status": "skipped", "error": skip}
        if config.needs and not opts.host_features.get(config.needs):
            return {**rec, "status": "skipped", "error": f"this ComfyUI lacks {config.needs} "
                                                         f"({' '.join(HOST_FEATURES[config.needs])})"}
        why = self.object_info and unoffered_choice(graph, self.object_info)
        if why:
            return {**rec, "status": "skipped", "error": why}
        # the slowest run so far at this model and length, else at any
        done = [r for r in self.payload["results"] if r.get("wall_s")]
        same = [r["wall_s"] for r in done if r["model"] == spec.name and r["length"] == length.name]
        estimate = max(same or [r["wall_s"] for r in done] or [0])
        if opts.budget_s and time.monotonic() - self.started + estimate > opts.budget_s:
            return {**rec, "status": "skipped", "error": f"time budget ({opts.budget_s:.0f} s) would be exceeded"}
        t0 = time.monotonic()
        server = None
        run_log = self.work / "logs" / f"{spec.name}_{length.name}_{config.name}.log"
        run_log.unlink(missing_ok=True)
        cache = self.work / "quant_cache" / config.name
        shutil.rmtree(cache, ignore_errors=True)
        try:
            server = BenchServer(self.base, opts.comfyui, run_log, cap_gib, cpu=opts.cpu,
                                 extra_args=(*opts.comfy_args.split(), *config.comfy_args),
                                 env={"BIGDIT_QUANT_CACHE": str(cache), "BIGDIT_QUANT_CACHE_GIB": "1000"}
                                 if config.cache else None)
            rec["server_start_s"] = time.monotonic() - t0
            if self.object_info is None:
                self.object_info = server.object_info()
                why = unoffered_choice(graph, self.object_info)
                if why:
                    return {**rec, "status": "skipped", "error": why}
            start_rss = resident(server)
            entry = server.run(graph, timeout=opts.prompt_timeout)
            rec.update(measurements(json.loads(entry["outputs"]["report"]["text"][0]), entry))
            for key, value in rec.get("server", {}).items():  # what the servers ran on, once
                self.payload["environment"].setdefault(key, value)
            rec["pack_reports"] = {node: "\n".join(out["text"])[:6000] for node, out in entry["outputs"].items()
                                   if node not in ("report", "save") and out.get("text")}
            self.latents[(spec.name, length.name, config.name)] = server.latent(entry, "save")
            if config.cache:
                rec.update(self.cache_runs(server, spec, length, config, prefix, cache, start_rss, entry,
                                           self.latents[(spec.name, length.name, config.name)]))
            rec["status"] = "ok"
        except PromptError as e:
            rec.update(status="error", error=e.message[:3000], traceback=e.traceback[-3000:])
        except Exception as e:  # the server died or hung: record it, go on with the next one
            rec.update(status="error", error=f"{type(e).__name__}: {e}"[-3000:])
        finally:
            if server is not None:
                server.stop()
            shutil.rmtree(cache, ignore_errors=True)
            (self.base / "models" / "diffusion_models" / CACHE_LINK).unlink(missing_ok=True)
            rec["wall_s"] = time.monotonic() - t0
            text = run_log.read_text(errors="replace") if run_log.exists() else ""
            rec["log_lines"] = log_lines(text, self.work)
            check = placement_check(rec["log_lines"])
            if check:
                rec["placement_check"] = check
            self.append_log(f"{spec.name} {length.name} ({length.label}, {spec.tokens(length)} tokens) {config.name}",
                            text)
        return rec

    def cache_runs(self, server, spec, length, config, prefix, cache, start_rss, first, miss_latent) -> dict:
        """A cached configuration's second load (the hit) and UNETLoader on the cache file, in the same server."""
        opts, out = self.opts, {}
        second = sampling_graph(config, spec, spec.file_name(config.model_format), length, opts.steps, opts.seed,
                                prefix + "_hit")
        entry = server.run(second, timeout=opts.prompt_timeout)
        hit = measurements(json.loads(entry["outputs"]["report"]["text"][0]), entry)
        hit_latent = server.latent(entry, "save")
        reports = [line and line.replace(str(self.work), "<work>") for line in (cache_line(first), cache_line(entry))]
        (written,) = cache.glob("*.safetensors")
        link = self.base / "models" / "diffusion_models" / CACHE_LINK
        link.unlink(missing_ok=True)
        link.symlink_to(written)
        third = sampling_graph(Config("unet_same_file", "comfy", config.capped, _unet()), spec, CACHE_LINK, length,
                               opts.steps, opts.seed, prefix + "_unet")
        entry = server.run(third, timeout=opts.prompt_timeout)
        unet = measurements(json.loads(entry["outputs"]["report"]["text"][0]), entry)
        weights = hit.get("weights_bytes")
        out["hit"], out["unet_same_file"] = hit, unet
        out["server_rss_start_gib"] = start_rss / GIB if start_rss else None
        out["cache_file_gib"] = written.stat().st_size / GIB
        out["cache_targets"] = {
            "hit_load_over_unet": ratio(hit.get("load_s"), unet.get("load_s")),
            "hit_ready_over_unet": ratio(hit.get("ready_s"), unet.get("ready_s")),
            "hit_rss_sampling_over_weights": hit.get("host_rss_sampling_over_weights"),
            "hit_rss_sampling_less_start_over_weights": ratio(
                hit.get("host_rss_sampling_gib", 0) * GIB - start_rss if start_rss else None, weights),
            "hit_vs_miss": compare(hit_latent, miss_latent),
            "reports": reports,
        }
        return out

    def record(self, rec):
        self.payload["results"].append(rec)
        self.add_comparison(rec)
        self.write()
        print(f"[{time.monotonic() - self.started:4.0f} s] {result_line(rec)}", flush=True)

    def over_budget_with_generation(self) -> str | None:
        """Why a new model file would not fit the time budget (its generation as long as the slowest so far, and
        one configuration as long as the slowest), or None."""
        if not self.opts.budget_s:
            return None
        made = [m.get("seconds") or 0 for m in self.payload["models"].values() if not m.get("reused")]
        runs = [r["wall_s"] for r in self.payload["results"] if r.get("wall_s")]
        if time.monotonic() - self.started + max(made or [0]) + max(runs or [0]) > self.opts.budget_s:
            return f"time budget ({self.opts.budget_s:.0f} s) would be exceeded with another model file"
        return None

    def add_comparison(self, rec):
        if rec["status"] != "ok":
            return
        def resident(name):
            return next((r for r in self.payload["results"] if r["config"] == name and r["status"] == "ok"
                         and r["model"] == rec["model"] and r["length"] == rec["length"]), None)

        name = RESIDENT.get(rec["model_format"], REFERENCE)
        if resident(name) is None:
            name = REFERENCE
        ref_rec = resident(name)
        rec["reference"] = name if ref_rec else None
        latent = self.latents.get((rec["model"], rec["length"], rec["config"]))
        reference = self.latents.get((rec["model"], rec["length"], name))
        if reference is not None and latent is not None:
            rec.update(compare(latent, reference))
        if ref_rec and rec.get("step_s") and ref_rec.get("step_s"):
            rec["vs_resident"] = ref_rec["step_s"] / rec["step_s"]

    def run(self):
        for model_name in self.opts.models:
            spec = e2e_models.MODELS[model_name]
            plan = {length: self.opts.configs_at.get(length, self.opts.configs) for length in self.opts.lengths}
            # one model file at a time: each file format's configurations at every length, bf16 (the reference) first
            formats = dict.fromkeys(["bf16"] + [self.configs[n].model_format for names in plan.values()
                                                for n in names])
            for fmt in formats:
                runs = [(length, n) for length, names in plan.items() for n in names
                        if self.configs[n].model_format == fmt]
                unmet = [(length, n) for length, n in runs if self.configs[n].needs
                         and not self.opts.host_features.get(self.configs[n].needs)]
                for length_name, name in unmet:  # recorded as skipped, with no model file made for them
                    self.record(self.run_one(spec, spec.length(length_name), self.configs[name]))
                runs = [r for r in runs if r not in unmet]
                if not runs:
                    continue
                key = model_name if fmt == "bf16" else f"{model_name}:{fmt}"
                why = self.over_budget_with_generation()
                if why:
                    for length_name, name in runs:
                        self.record(self.run_one(spec, spec.length(length_name), self.configs[name], skip=why))
                    continue
                try:
                    self.payload["models"][key] = self.prepare_model(spec, fmt)
                except Exception as e:
                    self.payload["models"][key] = {"error": f"{type(e).__name__}: {e}"[-3000:]}
                    print(f"model {key}: FAILED {e}", flush=True)
                    self.write()
                    continue
                self.write()
                for length_name, name in runs:
                    self.record(self.run_one(spec, spec.length(length_name), self.configs[name]))
            if not self.opts.keep_model:
                for old in (self.base / "models" / "diffusion_models").glob("bench_*.safetensors*"):
                    old.unlink()
        self.write()
        print(f"wrote {self.out}\nsummary: {json.dumps(self.payload['summary'])}", flush=True)
        detail = self.payload["summary_detail"]
        for line in detail.get("missing", []):
            print(f"summary at {detail['model']} {detail['length']} (LoRA and own-card runs left out): {line}",
                  flush=True)


def result_line(rec) -> str:
    head = f"{rec['model']} {rec['length']:>5} {rec['config']:<20}"
    if rec["status"] != "ok":
        return f"{head} {rec['status'].upper()}: {(rec.get('error') or '').splitlines()[0][:300]}"
    parts = [f"{rec['step_s']:.3f} s/step"]
    parts.append(f"x{rec['vs_resident']:.2f} vs resident" if "vs_resident" in rec else "no reference")
    if rec.get("peak_gib") is not None:
        parts.append(f"peak {rec['peak_gib']:.1f} GiB")
    if rec.get("device_used_peak_sampling_gib") is not None:
        parts.append(f"device {rec['device_used_peak_sampling_gib']:.1f} GiB")
    if "cosine" in rec:
        parts.append(f"cos {rec['cosine']:.5f} rel {rec['rel_l2']:.4f}")
    if rec.get("load_s") is not None:
        parts.append(f"load {rec['load_s']:.1f} s")
    return f"{head} " + ", ".join(parts)


MIN_COSINE = 0.999


def summarize(results, models) -> tuple[dict, dict]:
    """(detail, summary): issue 12's summary on the first model at its longest length (see the module doc),
    and issue 13's LoRA cost there: lora_cost = pack_auto_lora's step / pack_auto's - 1 (detail "lora": every
    LoRA configuration against the same configuration without it). Configurations with a LoRA or their own
    card size are kept out of issue 12's numbers; detail "missing" says which run each number that stays None
    lacks."""
    summary = {"dense_speedup": None, "sol_speedup": None, "vs_comfy_best": None, "peak_gib_capped": None,
               "lora_cost": None}
    ok = [r for r in results if r["status"] == "ok" and r.get("step_s")]
    if not ok:
        return {}, summary
    model = next(iter(models))
    at_model = [r for r in ok if r["model"] == model]
    if not at_model:
        return {}, summary
    tokens = max(r["tokens"] for r in at_model)
    at_all = [r for r in at_model if r["tokens"] == tokens]
    at = [r for r in at_all if not r.get("lora") and not r.get("own_cap")]
    ref = next((r for r in at if r["config"] == REFERENCE), None)
    pack_dense = [r for r in at if r["family"] == "pack" and r["capped"] and not r["sol"]]
    # issue 12's target is a speed-up at latent cosine >= MIN_COSINE: faster but less accurate
    # configurations (FP8 attention) are reported beside it, not counted as the best
    accurate = [r for r in pack_dense if (r.get("cosine") or 0.0) >= MIN_COSINE]
    best = min(accurate, key=lambda r: r["step_s"], default=None)
    fastest = min(pack_dense, key=lambda r: r["step_s"], default=None)
    sol = min((r for r in at if r["family"] == "pack" and r["sol"]), key=lambda r: r["step_s"], default=None)
    comfy = min((r for r in at if r["family"] == "comfy" and r["capped"]), key=lambda r: r["step_s"], default=None)
    peaks = [r["peak_gib"] for r in at_model if r["family"] == "pack" and r["capped"] and r.get("peak_gib")
             and not r.get("own_cap")]
    if ref and best:
        summary["dense_speedup"] = ref["step_s"] / best["step_s"]
    if ref and sol:
        summary["sol_speedup"] = ref["step_s"] / sol["step_s"]
    if comfy and best:
        summary["vs_comfy_best"] = comfy["step_s"] / best["step_s"]
    if peaks:
        summary["peak_gib_capped"] = max(peaks)

    def who(r):
        return None if r is None else {k: r.get(k) for k in ("config", "step_s", "cosine", "rel_l2", "peak_gib")}

    by_name = {r["config"]: r for r in at_all}
    lora = []
    for r in at_all:
        base = by_name.get(LORA_SUFFIX.sub("", r["config"], count=1)) if r.get("lora") else None
        if base:
            lora.append({"config": r["config"], "base": base["config"], "cap_gib": r.get("cap_gib"),
                         "step_s": r["step_s"], "base_step_s": base["step_s"], "peak_gib": r.get("peak_gib"),
                         "base_peak_gib": base.get("peak_gib"), "cost": r["step_s"] / base["step_s"] - 1})
    summary["lora_cost"] = next((x["cost"] for x in lora if x["config"] == "pack_auto_lora"), None)

    length = at_all[0]["length"]
    # what each None lacks, among the runs issue 12 counts (no LoRA, no card of its own)
    missing = []
    if ref is None:
        missing.append(f"no {REFERENCE} run: dense_speedup and sol_speedup need it")
    if not pack_dense:
        missing.append("no capped pack dense run: dense_speedup and vs_comfy_best need one")
    elif best is None:
        missing.append(f"no capped pack dense run with a latent cosine of at least {MIN_COSINE} against its "
                       "reference: dense_speedup and vs_comfy_best need one")
    if sol is None:
        missing.append("no pack Sol run: sol_speedup needs one")
    if comfy is None:
        missing.append("no capped ComfyUI run: vs_comfy_best needs one")
    if not peaks:
        missing.append("no capped pack run with a peak at any length: peak_gib_capped needs one")
    detail = {"model": model, "length": length, "tokens": tokens, "reference": who(ref), "missing": missing,
              "min_cosine": MIN_COSINE,
              "best_pack_dense": who(best), "fastest_pack_dense": who(fastest),
              "fastest_pack_dense_speedup": ref["step_s"] / fastest["step_s"] if ref and fastest else None,
              "pack_sol": who(sol), "best_comfy_capped": who(comfy), "lora": lora}
    return detail, summary


# ---- environment without touching CUDA (the servers own the GPU) -------------

def gpu_name() -> str:
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                             text=True, timeout=30)
        name = out.stdout.strip().splitlines()[0].strip() if out.returncode == 0 and out.stdout.strip() else ""
    except (OSError, subprocess.TimeoutExpired):
        name = ""
    return name or "cpu"


def gpu_slug() -> str:
    return slug(gpu_name())


def package_version(package):
    import importlib.metadata
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--comfyui", default=os.environ.get("BIGDIT_COMFYUI") or str(cache_dir() / "comfyui-0.3.75"),
                        help="the host's ComfyUI folder (default: $BIGDIT_COMFYUI or the test cache's 0.3.75)")
    parser.add_argument("--tiny", action="store_true",
                        help="tiny Wan on CPU: --models tiny_wan --cpu --lengths long --steps 2 (unless given)")
    parser.add_argument("--models", default=None, help=f"comma list of {', '.join(e2e_models.MODELS)} (wan14b)")
    parser.add_argument("--lengths", default=None,
                        help="comma list of the model's lengths (long, short) or WIDTHxHEIGHTxFRAMES (long,short)")
    parser.add_argument("--configs", default=None, help=f"comma list (default {','.join(DEFAULT_CONFIGS)}; also "
                        f"{','.join(c for c in make_configs('x') if c not in DEFAULT_CONFIGS)}; presets: "
                        f"{'; '.join(f'{k}: {chr(44).join(v)}' for k, v in PRESETS.items())})")
    parser.add_argument("--configs-at", action="append", default=[], metavar="LENGTH=CONFIGS",
                        help="the configurations at one length instead of --configs, e.g. short=comfy_resident,"
                             "pack_auto (repeatable)")
    parser.add_argument("--steps", type=int, default=None, help="sampler steps (3; 2 with --tiny)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--cap-gib", type=float, default=24.0, help="the emulated card of the capped configurations")
    parser.add_argument("--fp8-attention-backend", default="fa3_fp8",
                        help="SetAttentionBackend choice of pack_auto_fp8attn (skipped if the pack lacks it)")
    parser.add_argument("--cpu", action="store_true", help="run ComfyUI with --cpu")
    parser.add_argument("--comfy-args", default="", help="more ComfyUI flags, space separated")
    parser.add_argument("--work", default=None, help="server base directory and model files (default: a temp dir)")
    parser.add_argument("--out", default=None, help="the JSON path (the .log goes beside it)")
    parser.add_argument("--out-dir", default=None, help="folder for the default file name (default tests/bench/results)")
    parser.add_argument("--keep-model", action="store_true", help="keep the model file (and reuse a matching one)")
    parser.add_argument("--budget-s", type=float, default=None,
                        help="start no configuration that would end past this many seconds (by the slowest so far)")
    parser.add_argument("--prompt-timeout", type=float, default=540.0)
    opts = parser.parse_args(argv)
    if opts.tiny:
        opts.cpu = True
        opts.models = opts.models or "tiny_wan"
        opts.lengths = opts.lengths or "long"
        opts.steps = opts.steps or 2
    opts.models = (opts.models or "wan14b").split(",")
    opts.lengths = (opts.lengths or "long,short").split(",")
    known = make_configs(opts.fp8_attention_backend)

    def config_list(text):
        names = [n for item in text.split(",") for n in PRESETS.get(item, (item,))]
        unknown = [n for n in names if n not in known]
        if unknown:
            parser.error(f"unknown configuration: {', '.join(unknown)} (known: {', '.join(known)})")
        # the references run first: every other configuration compares with one
        return sorted(dict.fromkeys(names), key=lambda n: n not in RESIDENT.values())

    if not (Path(opts.comfyui) / "main.py").exists():
        parser.error(f"--comfyui {opts.comfyui} holds no main.py")
    opts.host_features = host_features(opts.comfyui)
    # the default set: what this host can run; a named configuration it cannot is recorded as skipped
    opts.configs = config_list(opts.configs or ",".join(
        n for n in DEFAULT_CONFIGS if not known[n].needs or opts.host_features[known[n].needs]))
    at = {}
    for item in opts.configs_at:
        length, sep, names = item.partition("=")
        if not sep or length not in opts.lengths:
            parser.error(f"--configs-at {item!r}: expected LENGTH=CONFIGS with LENGTH one of {opts.lengths}")
        at[length] = config_list(names)
    opts.configs_at = at
    unknown = [m for m in opts.models if m not in e2e_models.MODELS]
    if unknown:
        parser.error(f"unknown model: {', '.join(unknown)} (known: {', '.join(e2e_models.MODELS)})")
    opts.steps = opts.steps or 3
    opts.work = opts.work or tempfile.mkdtemp(prefix="bigdit-comfy-e2e-")
    return opts


def run_and_write(bench, keep_models: bool) -> None:
    """`bench.run()`, its JSON written whatever happens (a time limit's TERM stops the server through the finally
    blocks), and its models folder deleted unless `keep_models`."""
    def stop(signum, _frame):
        raise SystemExit(f"signal {signum}")

    signal.signal(signal.SIGTERM, stop)
    try:
        bench.run()
    finally:
        bench.write()
        if not keep_models:
            shutil.rmtree(bench.base / "models", ignore_errors=True)


def main(argv=None):
    opts = parse_args(argv)
    bench = Bench(opts)
    print(f"comfy-e2e: {bench.payload['environment']}, configs {','.join(opts.configs)}, lengths "
          f"{','.join(opts.lengths)}, {opts.steps} steps, work {opts.work}", flush=True)
    run_and_write(bench, opts.keep_model)


if __name__ == "__main__":
    main()
