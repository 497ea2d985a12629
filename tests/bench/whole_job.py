"""The whole MiniMax-H3 text-to-video job in a real upstream ComfyUI 0.33.0, per configuration (issues 32, 37, 40).

The pack's other speed figures are one sampler step on random weights. This runs what a user runs: Comfy-Org's
MiniMax-H3 t2v template, from POST /prompt to the saved video file, as upstream's own front end queues it
(tests/bench/job_prompts/, made by make_job_prompts.py from the template and from the pack's version of it,
example_workflows/bigdit-minimax-h3-t2v), at its defaults: 864x480 (the Resolution Selector's 0.4 MP at 16:9),
5 s (124 frames), its prompt and seed. Settings: `turbo` (its turbo_mode on: 8 steps with the 8-step turbo LoRA)
and `default` (20 steps, no LoRA).

The files are full-size random weights under the template's names, in the published files' layouts
(e2e_models): the pruned DiT as its INT8 ConvRot marker file, the Qwen3-VL-32B encoder as NVFP4 with AWQ scales
and INT8 token embeddings (15,687,142,551 bytes, as published), the video VAE with its INT8 ConvRot decoder, the
fp32 audio VAE and the 8-step turbo LoRA (rank 128, 384 on the fused qkv: 1.82 GiB, as published; its qkv as q, k
and v's rank-128 LoRAs side by side, up block-diagonal, or with --lora-qkv dense one dense rank-384 LoRA: the
published size fits both). Each is generated once, on the GPU, straight to disk.

Configurations (CONFIGS: the prompt and a small table of node changes), each on a fresh server started through
vram_cap.py on an emulated 24 GiB card and an emulated host RAM (--ram-gib, default 64: ComfyUI's RAM decisions
see that size; with --ram-cgroup the server also runs in a memory cgroup of that size where this machine lets
us make one, and the JSON says which was done), with ComfyUI's default cache. Each server runs two jobs, as a
user repeats one: the first, then a second with another prompt and seed (SECOND_JOB, the same for every
configuration, so that each job's latent compares with the reference's same job); each job is its own record
(`job`: 1 or 2). With --lora-change a third job follows the second: the same prompt and seed with the LoRA's strength
changed (LORA_CHANGE; where the graph has no LoRA, skipped), whose model_load stage is what a strength change costs
(`job`: 3). With --lora-second a job follows those: the second's with a second LoRA (another random turbo LoRA,
SECOND_LORA_FILE, seed 1) chained after the template's at strength LORA_SECOND (skipped the same way), whose
model_load stage is what adding a LoRA to a loaded model costs (`job`: 4). Between them nothing is done
(--between-jobs keep: ComfyUI keeps the loaders' outputs while their inputs are the same, so the second job loads
nothing unless its RAM cache let them go), or with --between-jobs free ComfyUI's "Free model and node cache"
(POST /free), so that the second job loads everything again. The pack's configurations run with the quantize-once
cache on, as users have it, in a fresh folder of their server's own on the work disk (the first load pays its
write, a later one in the same server reads it); each job's `loads` says, per loader, whether it ran, the first
line of a pack loader's report, the cache's word for the load (hit, miss, off, skipped) and the tuned-kernel store's
lines where the pack has one:
- template: the template as shipped;
- template_sage: the same, the server started with --use-sage-attention;
- pack: the pack's version (LoadH3Quantized, QuantizedCLIPLoader, SetAttentionBackend auto), as shipped;
- pack_fast: the pack's fastest: MixedCheckpointLoader on the INT8 file (its `int8` input, where /object_info
  lists it), QuantizedCLIPLoader, SetAttentionBackend sage.
- pack_fast_no_read_ahead: pack_fast with the pack's read-ahead of the prompt's files (on by default) off
  (BIGDIT_READ_AHEAD=0);
- pack_fast_no_lora: pack_fast with the LoRA at strength 0 (no LoRA): set against pack_fast's step in the same run,
  the LoRA branch's share of a step (`summary`'s `lora_step_share`); its latent is not the template's;
- pack_fast_compile_in_place: pack_fast with each Triton kernel compiled at its first launch, one after another
  (BIGDIT_TRITON_COMPILE_AHEAD=0), against pack_fast's compiles on a thread pool while kitchen computes.
Whether QuantizedCLIPLoader loads the encoder file's two unusual layer kinds (an INT8 token embedding, NVFP4 with
`full_precision_matrix_mult`) is checked once, on a small CLIP-L with them, in the first server after its job
(`encoder_check`); where it does not, the pack's configurations load the encoder with upstream's CLIPLoader and
their records say so (`encoder_loader`; --pack-encoder chooses instead).

Measured per run (`stages`, seconds; they partition the wall clock from POST /prompt to execution_success, by
which the video file is written): the time of each node from ComfyUI's websocket (`executing` messages, each
node's time ending where the next begins; timestamps taken on arrival, same clock as the server's), summed by
STAGE_OF: queue (POST to the first node), encoder (CLIPLoader / QuantizedCLIPLoader, MiniMaxH3ImageToVideo),
model_load (the DiT loader, the LoRA loader, SetAttentionBackend, and SamplerCustomAdvanced until its first
model call, from the test node BigditStepTimer), sampling (the sampler from its first model call; under dynamic
VRAM the first step also pages the weights in: `first_step_excess_s` says how much), vae_decode (both
VAELoaders, SetVAEKernels, VAEDecode, VAEDecodeAudio), save (CreateVideo, SaveVideo), graph (the template's small nodes:
resolution, math, switches, scheduler, noise) and capture (the benchmark's own nodes after sampling). The final
latent is captured without changing what runs: LTXVSeparateAVLatent and SaveLatent on the sampler's output, and
BigditRunReport; its cosine against `template`'s (and `template_sage`'s) at the same setting is `latent`.
Memory: the device's used memory (NVML, polled every 20 ms) and the server's process tree (psutil: RSS, and
anonymous + shared pages, which a machine could not reclaim), peaks over the job and per stage, set against
hosts of 64 and 32 GiB (`ram_budgets`); the cgroup's peak and OOM kills where there is one. The video file is
opened with PyAV (frames, streams) and deleted. The bytes the server's processes had the disk read and write, per
stage (/proc/<pid>/io, every 20 ms: `disk_read_by_stage`, `disk_written_by_stage`). How much of each model file
the page cache held at each stage's start and end (mincore, every 0.5 s: `page_cache_by_stage_gib`), and as
VAEDecode starts (`page_cache_at_decode_gib`; the vae_decode stage starts at the VAELoaders, which ComfyUI runs
first); which tensors of each file (grouped by name, digits as "*") the pages newly cached in each stage belong
to (`file_reads_by_stage_gib`: what a stage read of the DiT's file, and whether a LoRA's); each node's disk reads
(`nodes`' `disk_read_gib`) and, in a memory cgroup, the file pages it read again after the kernel had dropped them
(`file_refaulted_gib`). The CPU seconds each stage used (every 0.1 s: `cpu_by_stage_s`): the server's, its
busiest threads (the main thread, the pack's named ones, each unnamed Python thread by its id: ComfyUI's prompt
worker among them), and the machine's busy and iowait seconds over all its cores (what else competed).

`profile` (issue 40): each stage's time beside its floor, the largest of its reads at the disk's bandwidth, its
FLOPs at the GPU's peak and its weight traffic at the card's memory bandwidth, and the job's floors; the call
measures the disk (a cold read of the largest file) and the card (copy and host-to-device bandwidths) once, after
writing the files (`machine`). tests/bench/job_profile.py counts and explains them, and prints them from a JSON.

The JSON (tests/bench/results/whole-job-<gpu>-comfyui-<version>-<date>.json, or --out/--out-dir) is rewritten
after every configuration; `summary` holds, per setting, RAM size and job (`turbo_64g_job1`), each pack
configuration against template_sage and template (the whole job and each stage: reference seconds / pack seconds),
each configuration's share of the job in host code (encoder and VAE decode), printed at the end, and where both ran
the LoRA branch's share of pack_fast's step. The order
(ORDER) puts what matters most first, so that a budget drops the rest: template_sage, pack_fast, pack, template.
Triton's kernel cache (`triton_cache`): --triton-cache cold (the default) gives each server an empty one, so that
each first job compiles the Triton kernels it runs, as on a first run; run shares one across the run's servers, as
after a restart. The pack's tuning store (attention auto's kept decisions) follows the same rule. The pack's run
report gives the seconds its kernels' first launches took (compilation included): `kernel_first_launches`.
--budget-s counts from $E2E_STARTED (epoch seconds) where it is set and keeps STOP_S free at its end: it starts
no server whose first job would end past it, and no second job that would, each by the longest one so far at
that setting (before the first: PRIOR_S); what it leaves out is recorded as skipped, with the reason.

    python tests/bench/whole_job.py --comfyui COMFYUI_0.33.0 [--settings turbo] [--configs ...] [--budget-s 520]
    python tests/bench/whole_job.py --tiny --comfyui COMFYUI_0.33.0 --configs template,pack --out OUT.json

--tiny runs the same job on CPU with tiny models: the tiny H3 of e2e_models (upstream's MiniMaxH3Model) as the
INT8 ConvRot DiT, upstream's H3 VAEs at a tiny size (BigditTinyVAELoader), a tiny turbo LoRA, test conditioning
in place of the encoder (BigditRandomConditioning; upstream builds the H3 encoder with a fixed 32B config), and
64x64, 22 frames, 2 steps. On the GPU machine tests/bench/device/run_e2e.sh --job runs this
(tests/bench/device/README.md).
"""
from __future__ import annotations

import argparse
import asyncio
import bisect
import copy
import dataclasses
import datetime
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import uuid
from dataclasses import dataclass, field
from pathlib import Path

BENCH_DIR = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH_DIR.parent))

import e2e_models  # noqa: E402
from page_cache import cached_size, newly_cached, resident_pages, tensor_pages  # noqa: E402
import job_profile  # noqa: E402
from _pack import RESULTS  # noqa: E402
from comfy_e2e import (BenchServer, compare, gpu_name, gpu_slug, log_lines, package_version, run_and_write,  # noqa: E402
                       unoffered_choice)
from comfy_harness import PromptError, _validation_message, comfyui_version  # noqa: E402

GIB = 1024 ** 3
PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096
try:  # the page reads by tensor (Monitor.reads) need it; the rest of the benchmark does not
    import numpy  # noqa: F401
    HAVE_NUMPY = True
except ImportError:
    HAVE_NUMPY = False
PROMPTS = BENCH_DIR / "job_prompts"
SETTINGS = ("turbo", "default")


@dataclass(frozen=True)
class Config:
    """A configuration: job_prompts/<prompt>_<setting>.json with `nodes` changed, on a server with `comfy_args`.
    `nodes`: {class_type: {input: value}} sets inputs of every node of that class; {class_type: (new class_type,
    {input: value})} replaces the node, keeping its links and the inputs the new class has too. An input the
    server's /object_info does not list for the class is left out, and the record says so. `env`: set in the
    server's environment."""
    name: str
    prompt: str
    nodes: dict = field(default_factory=dict)
    comfy_args: tuple = ()
    env: tuple = ()  # (name, value) pairs


CONFIGS = {c.name: c for c in (
    Config("template", "template"),
    Config("template_sage", "template", comfy_args=("--use-sage-attention",)),
    Config("pack", "pack"),
    Config("pack_fast", "pack", nodes={
        "LoadH3Quantized": ("MixedCheckpointLoader", {"nvfp4": "auto", "int8": "auto"}),
        "QuantizedCLIPLoader": {"nvfp4": "auto"},
        "SetAttentionBackend": {"backend": "sage"},
    }),
)}
# pack_fast without the pack's read-ahead of the prompt's files (host/read_ahead.py, on by default): what it gains
CONFIGS["pack_fast_no_read_ahead"] = dataclasses.replace(CONFIGS["pack_fast"], name="pack_fast_no_read_ahead",
                                                         env=(("BIGDIT_READ_AHEAD", "0"),))
# pack_fast without the turbo LoRA (LoraLoaderModelOnly at strength 0 returns the model unpatched): its steps
# against pack_fast's give the LoRA branch's share of a step within one run (summary `lora_step_share`); its latent
# is not the template's
CONFIGS["pack_fast_no_lora"] = dataclasses.replace(
    CONFIGS["pack_fast"], name="pack_fast_no_lora",
    nodes={**CONFIGS["pack_fast"].nodes, "LoraLoaderModelOnly": {"strength_model": 0.0}})
# pack_fast with each Triton kernel compiled at its first launch (quant/compile_ahead.py off): what compiling ahead
# gains in a first job with Triton's cache cold
CONFIGS["pack_fast_compile_in_place"] = dataclasses.replace(
    CONFIGS["pack_fast"], name="pack_fast_compile_in_place", env=(("BIGDIT_TRITON_COMPILE_AHEAD", "0"),))
# the most important comparison first: a call's budget drops the last ones
ORDER = ("template_sage", "pack_fast", "pack", "template")
REFERENCES = ("template_sage", "template")
PACK_CONFIGS = ("pack_fast", "pack", "pack_fast_no_read_ahead", "pack_fast_no_lora", "pack_fast_compile_in_place")
# what a server is assumed to take before one has run at that setting: from its start (the page-cache drop
# included) to the end of its first job, and its second job with the server's stop
PRIOR_S = {"turbo": {"job1": 160.0, "job2": 70.0}, "default": {"job1": 170.0, "job2": 90.0},
           "tiny": {"job1": 60.0, "job2": 30.0}}
STOP_S = 15.0  # a server's stop and the JSON's last write, kept free at the end of the budget
# what a user does next in the same server: another prompt and seed (both sides of a comparison run the same)
SECOND_JOB = {"prompt": "A red fox trots across a snowy meadow at dawn, its breath steaming in the cold air; the "
                        "camera follows it low to the ground as it stops, listens, and pounces into the snow. Soft "
                        "crunching footsteps and distant birdsong.",
              "seed": 424242424242, "tiny_conditioning_seed": 1}
BETWEEN_JOBS = ("keep", "free")
LORA_CHANGE = 0.75  # the third job's LoRA strength (--lora-change): the template's is 1.0
LORA_SECOND = 0.5  # the fourth job's second LoRA's strength (--lora-second)
SECOND_LORA_FILE = "bench_second_lora.safetensors"  # in models/loras, made beside the template's files
SECOND_LORA_NODE = "bench_lora2"

#: seconds between two samples of the server's memory, I/O and the device (a stage's bytes are counted from the samples
#: at or before its start and end, so a stage can be given what was read up to one interval before it started)
SAMPLE_S = 0.02
CACHE_EVERY = 25  # the model files' page-cache residency every 25th sample (0.5 s): mincore over ~40 GiB of maps
CPU_EVERY = 5  # the server's CPU time by thread, and the machine's, every 5th sample (0.1 s)
TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
CPU_TOP = 8  # the thread groups a stage's CPU profile names, busiest first


STAGES = ("queue", "encoder", "model_load", "sampling", "vae_decode", "save", "graph", "capture")
STAGE_OF = {
    **dict.fromkeys(("CLIPLoader", "QuantizedCLIPLoader", "MiniMaxH3ImageToVideo", "BigditRandomConditioning",
                     "EmptyMiniMaxH3LatentAV"), "encoder"),
    **dict.fromkeys(("UNETLoader", "LoadH3Quantized", "MixedCheckpointLoader", "LoraLoaderModelOnly",
                     "SetAttentionBackend", "BigditStepTimer"), "model_load"),
    "SamplerCustomAdvanced": "sampling",  # until its first model call: model_load
    **dict.fromkeys(("VAELoader", "BigditTinyVAELoader", "SetVAEKernels", "VAEDecode", "VAEDecodeAudio"), "vae_decode"),
    **dict.fromkeys(("CreateVideo", "SaveVideo"), "save"),
    **dict.fromkeys(("LTXVSeparateAVLatent", "SaveLatent", "BigditRunReport"), "capture"),
}
RAM_BUDGETS_GIB = (64, 32)  # the host RAM sizes each record's peaks are set against
HOST_STAGES = ("encoder", "vae_decode")  # host code: upstream's encoder and VAEs run in every configuration

# what the template's notes give for each file (GiB), to set the generated sizes against
PUBLISHED_GIB = {"dit": 19.53, "text_encoder": 14.61, "video_vae": 2.62, "audio_vae": 577.2 / 1024, "lora": 1.82}
# the template's files other than the DiT and the LoRA -> their e2e_models.COMPONENTS
COMPONENTS = {"text_encoder": "qwen3vl_32b_nvfp4_awq", "video_vae": "video_vae_int8_convrot",
              "audio_vae": "audio_vae_fp32"}
TINY_COMPONENTS = {"video_vae": "tiny_video_vae", "audio_vae": "tiny_audio_vae"}
TINY = {"width": 64, "height": 64, "length": 22, "steps": 2, "text_length": 16, "lora_rank": 4}


def load_prompt(name: str, setting: str) -> dict:
    return json.loads((PROMPTS / f"{name}_{setting}.json").read_text())


def nodes_of(graph: dict, class_type: str) -> list[str]:
    return [key for key, node in graph.items() if node["class_type"] == class_type]


def template_files(graph: dict) -> dict[str, tuple[str, str]]:
    """{role: (models folder, file name)} of the template's files, as its loaders name them."""
    def loader_of(consumer):
        (node,) = nodes_of(graph, consumer)
        return graph[graph[node]["inputs"]["vae"][0]]["inputs"]["vae_name"]
    (unet,), (clip,), (lora,) = (nodes_of(graph, c) for c in ("UNETLoader", "CLIPLoader", "LoraLoaderModelOnly"))
    return {"dit": ("diffusion_models", graph[unet]["inputs"]["unet_name"]),
            "text_encoder": ("text_encoders", graph[clip]["inputs"]["clip_name"]),
            "video_vae": ("vae", loader_of("VAEDecode")), "audio_vae": ("vae", loader_of("VAEDecodeAudio")),
            "lora": ("loras", graph[lora]["inputs"]["lora_name"])}


# ---- the graph -----------------------------------------------------------------

def declared_inputs(object_info: dict, class_type: str) -> set:
    spec = object_info[class_type]["input"]
    return {*spec.get("required", {}), *spec.get("optional", {})}


def apply_nodes(graph: dict, changes: dict, object_info: dict) -> list[str]:
    """Config.nodes applied to `graph` in place; returns what was left out, as "Class.input"."""
    left_out = []
    for node in graph.values():
        change = changes.get(node["class_type"])
        if change is None:
            continue
        if isinstance(change, tuple):
            new_class, values = change
            known = declared_inputs(object_info, new_class)
            node["inputs"] = {k: v for k, v in node["inputs"].items() if k in known}
            node["class_type"] = new_class
        else:
            values, known = change, declared_inputs(object_info, node["class_type"])
        node["inputs"].update({k: v for k, v in values.items() if k in known})
        left_out += [f"{node['class_type']}.{k}" for k in values if k not in known]
    return sorted(set(left_out))


def instrument(graph: dict, label: str) -> None:
    """The benchmark's nodes: BigditStepTimer on the sampled model, and after sampling the video and audio
    latents saved and the run report; the video saved under bench/<label>."""
    (sampler,) = nodes_of(graph, "SamplerCustomAdvanced")
    guider = graph[graph[sampler]["inputs"]["guider"][0]]
    graph["bench_timer"] = {"class_type": "BigditStepTimer", "inputs": {"model": guider["inputs"]["model"]}}
    guider["inputs"]["model"] = ["bench_timer", 0]
    graph["bench_split"] = {"class_type": "LTXVSeparateAVLatent", "inputs": {"av_latent": [sampler, 0]}}
    for index, stream in enumerate(("video", "audio")):
        graph[f"bench_{stream}"] = {"class_type": "SaveLatent", "inputs": {
            "samples": ["bench_split", index], "filename_prefix": f"bench/{label}_{stream}"}}
    graph["bench_report"] = {"class_type": "BigditRunReport", "inputs": {"samples": ["bench_split", 0]}}
    for key in nodes_of(graph, "SaveVideo"):
        graph[key]["inputs"]["filename_prefix"] = f"bench/{label}"


def tinier(graph: dict, text_dim: int) -> None:
    """--tiny: the encoder replaced by test conditioning and upstream's empty AV latent (TINY's size), the
    VAEs loaded at their tiny size, TINY's steps. The files keep the template's names."""
    for key in nodes_of(graph, "MiniMaxH3ImageToVideo"):
        graph[key] = {"class_type": "BigditRandomConditioning",
                      "inputs": {"seed": 0, "length": TINY["text_length"], "dim": text_dim}}
        graph["bench_latent"] = {"class_type": "EmptyMiniMaxH3LatentAV",
                                 "inputs": {k: TINY[k] for k in ("width", "height", "length")}}
        for node in graph.values():
            for name, value in node["inputs"].items():
                if value == [key, 1]:
                    node["inputs"][name] = ["bench_latent", 0]
    for key in nodes_of(graph, "CLIPLoader") + nodes_of(graph, "QuantizedCLIPLoader"):
        del graph[key]
    for key in nodes_of(graph, "VAELoader"):
        graph[key]["class_type"] = "BigditTinyVAELoader"
    (scheduler,) = nodes_of(graph, "BasicScheduler")
    switch = graph[graph[scheduler]["inputs"]["steps"][0]]
    for branch in ("on_false", "on_true"):
        graph[switch["inputs"][branch][0]]["inputs"]["value"] = TINY["steps"]


def second_job(graph: dict) -> None:
    """The second job: SECOND_JOB's prompt and seed (with --tiny, the test conditioning's seed)."""
    for key in nodes_of(graph, "MiniMaxH3ImageToVideo"):
        graph[key]["inputs"]["prompt"] = SECOND_JOB["prompt"]
    for key in nodes_of(graph, "BigditRandomConditioning"):
        graph[key]["inputs"]["seed"] = SECOND_JOB["tiny_conditioning_seed"]
    for key in nodes_of(graph, "RandomNoise"):
        graph[key]["inputs"]["noise_seed"] = SECOND_JOB["seed"]


def add_second_lora(graph: dict, first: str) -> None:
    """A second LoraLoaderModelOnly (SECOND_LORA_NODE) on the model `first` gives, and what took `first`'s model
    takes the second's."""
    for key, node in graph.items():
        for name, value in node["inputs"].items():
            if value == [first, 0]:
                node["inputs"][name] = [SECOND_LORA_NODE, 0]
    graph[SECOND_LORA_NODE] = {"class_type": "LoraLoaderModelOnly", "inputs": {
        "model": [first, 0], "lora_name": SECOND_LORA_FILE, "strength_model": LORA_SECOND}}


def job_graph(config: Config, setting: str, object_info: dict, encoder: str, tiny_text_dim: int | None, job: int = 1):
    """(graph, inputs left out) of one configuration and setting, its first, second, third (a LoRA's strength
    changed) or fourth job (a second LoRA)."""
    graph = copy.deepcopy(load_prompt(config.prompt, setting))
    changes = dict(config.nodes)
    if encoder == "CLIPLoader":
        changes["QuantizedCLIPLoader"] = ("CLIPLoader", {"device": "default"})
    left_out = apply_nodes(graph, changes, object_info)
    instrument(graph, f"{config.name}_{setting}_job{job}")
    if tiny_text_dim:
        tinier(graph, tiny_text_dim)
    if job >= 2:
        second_job(graph)
    if job == 3:
        for key in nodes_of(graph, "LoraLoaderModelOnly"):
            graph[key]["inputs"]["strength_model"] = LORA_CHANGE
    if job == 4 and (loras := nodes_of(graph, "LoraLoaderModelOnly")):
        add_second_lora(graph, loras[0])  # the template's one
    return graph, left_out


# ---- the server's side: events, memory, limits -------------------------------------

class EventStream(threading.Thread):
    """ComfyUI's websocket messages for one client id, each with its arrival time (time.time())."""

    def __init__(self, url: str, client_id: str):
        super().__init__(daemon=True)
        self.client_id = client_id
        self.url = url.replace("http://", "ws://") + f"/ws?clientId={client_id}"
        self.events: list[tuple[float, str, dict]] = []
        self.connected, self.finished = threading.Event(), threading.Event()
        self.error = None

    def run(self):
        try:
            asyncio.run(self._listen())
        except Exception as e:  # the server went away: the waiter sees it
            self.error = f"{type(e).__name__}: {e}"
        finally:
            self.connected.set()
            self.finished.set()

    async def _listen(self):
        import aiohttp
        async with aiohttp.ClientSession() as session, session.ws_connect(self.url, max_msg_size=0) as ws:
            self.connected.set()
            async for message in ws:
                if message.type == aiohttp.WSMsgType.TEXT:
                    data = json.loads(message.data)
                    self.events.append((time.time(), data["type"], data.get("data") or {}))
                    if data["type"] in ("execution_success", "execution_error", "execution_interrupted"):
                        return
                elif message.type in (aiohttp.WSMsgType.CLOSED, aiohttp.WSMsgType.ERROR):
                    return


def _tree(pid: int):
    import psutil
    root = psutil.Process(pid)
    return [root, *root.children(recursive=True)]


def unreclaimable(pids) -> int:
    """Anonymous and shared resident bytes of the processes (what no page-cache reclaim frees)."""
    total = 0
    for pid in pids:
        try:
            with open(f"/proc/{pid}/status") as f:
                total += sum(int(line.split()[1]) * 1024 for line in f if line.startswith(("RssAnon:", "RssShmem:")))
        except OSError:
            pass
    return total


def cgroup_memory(memory_stat: Path | None) -> tuple:
    """(anonymous, page-cache, refaulted page-cache bytes) of a cgroup v2's memory.stat; the last is cumulative:
    file pages read again after the kernel evicted them (workingset_refault_file), the cost of reading a file
    ahead beyond the room the job leaves. Nones where there is no such file."""
    try:
        fields = dict(line.split() for line in memory_stat.read_text().splitlines()) if memory_stat else {}
        return int(fields["anon"]), int(fields["file"]), int(fields["workingset_refault_file"]) * PAGE
    except (OSError, KeyError, ValueError):
        return None, None, None


def io_bytes(pids) -> tuple[int, int]:
    """(read, written) bytes the processes have had the storage layer fetch and send (/proc/<pid>/io: what came
    from the disk, not the page cache)."""
    read = written = 0
    for pid in pids:
        try:
            with open(f"/proc/{pid}/io") as f:
                fields = dict(line.split(":", 1) for line in f if ":" in line)
            read += int(fields["read_bytes"])
            written += int(fields["write_bytes"])
        except (OSError, KeyError, ValueError):
            pass
    return read, written


def _stat_fields(text: str) -> tuple[str, list[str]]:
    """(name, fields after it) of a /proc/<pid>/stat line: the name is in parentheses and may hold spaces."""
    return text[text.index("(") + 1:text.rindex(")")], text[text.rindex(")") + 2:].split()


def cpu_seconds(pids, proc: Path = Path("/proc")) -> dict:
    """CPU seconds (user + system) the processes have used: "process", their own counts (threads that ended
    included), and by live thread: "thread:main" a process's main thread; threads named as the process is (Python's
    and others that name none: ComfyUI runs prompts on such a thread) each as "thread:<name>/<tid>"; the others
    grouped by their name without its trailing digits ("pt_autograd_0", "pt_autograd_1" -> "pt_autograd"; the
    pack names its own, threads.py); "machine_busy" and "machine_iowait" from /proc/stat, all of the machine's
    cores: another process, or the kernel reclaiming memory, competing with the server shows there."""
    out = {"process": 0.0}
    for pid in pids:
        try:
            own, fields = _stat_fields((proc / str(pid) / "stat").read_text())
            out["process"] += (int(fields[11]) + int(fields[12])) / TICK
            tasks = os.listdir(proc / str(pid) / "task")
        except (OSError, ValueError, IndexError):
            continue
        for tid in tasks:
            try:
                name, fields = _stat_fields((proc / str(pid) / "task" / tid / "stat").read_text())
                used = (int(fields[11]) + int(fields[12])) / TICK
            except (OSError, ValueError, IndexError):
                continue  # the thread ended
            if tid == str(pid):
                group = "main"
            elif name == own:  # unnamed (a Python thread: ComfyUI's prompt worker among them): each on its own
                group = f"{name}/{tid}"
            else:
                group = name.rstrip("0123456789_-:.") or name
            out["thread:" + group] = out.get("thread:" + group, 0.0) + used
    try:
        ticks = [int(v) for v in (proc / "stat").read_text().splitlines()[0].split()[1:9]]
        user, nice, system, _idle, iowait, irq, softirq, steal = ticks
        out["machine_busy"] = (user + nice + system + irq + softirq + steal) / TICK
        out["machine_iowait"] = iowait / TICK
    except (OSError, ValueError, IndexError):
        pass
    return out


def cpu_by_stage(segs, cpu, top: int = CPU_TOP) -> dict:
    """Each stage's CPU seconds from Monitor.cpu's cumulative counts: what each grew by over each segment, summed by
    stage, a count at a segment's bounds read on the line between the samples around it (samples every 0.1 s;
    outside them, the nearest): "process", "machine_busy", "machine_iowait" and the `top` busiest thread groups of
    at least 0.05 s. A group whose threads ended in a segment is counted as 0 there (the process's count keeps their
    time)."""
    if not cpu:
        return {}
    times = [t for t, _ in cpu]

    def at(t):
        i = bisect.bisect_right(times, t) - 1
        if i < 0 or i == len(cpu) - 1:
            return cpu[max(i, 0)][1]
        (t0, c0), (t1, c1) = cpu[i], cpu[i + 1]
        w = (t - t0) / (t1 - t0) if t1 > t0 else 0.0
        return {k: c0.get(k, 0.0) + w * (c1.get(k, 0.0) - c0.get(k, 0.0)) for k in c0.keys() | c1.keys()}
    summed: dict = {}
    for start, end, stage, _ in segs:
        first, last = at(start), at(end)
        into = summed.setdefault(stage, {})
        for key, value in last.items():
            into[key] = into.get(key, 0.0) + max(0.0, value - first.get(key, 0.0))
    out = {}
    for stage, counts in summed.items():
        threads = sorted(((v, k) for k, v in counts.items() if k.startswith("thread:") and v >= 0.05), reverse=True)
        out[stage] = {k: round(v, 2) for k, v in counts.items() if not k.startswith("thread:")}
        out[stage]["threads"] = {k[len("thread:"):]: round(v, 2) for v, k in threads[:top]}
    return out


class Monitor(threading.Thread):
    """Polls the device's used memory and the bytes the server's processes had the disk read and write (every
    `interval` s), and their memory (every 5th poll; the process tree is listed then too): samples (time, device
    used, RSS, unreclaimable, bytes read from the disk, bytes written, the cgroup's anon, file, refaulted file
    bytes), reads, writes and refaults cumulative; one more sample when stopped. `files` (role: path): each file's
    bytes in the page cache every `cache_every`th poll and when stopped, in `cached` as (time, {role: bytes}), and
    where numpy is there, the pages cached since the last poll by the file's tensor groups (page_cache.newly_cached),
    in `reads` as (time, role, {group: bytes}); the CPU time of the tree and the machine (cpu_seconds) every
    `cpu_every`th poll and when stopped, in `cpu` as (time, counts)."""

    def __init__(self, pid: int, interval: float = SAMPLE_S, memory_stat: Path | None = None,
                 files: dict | None = None, cache_every: int = CACHE_EVERY, cpu_every: int = CPU_EVERY):
        super().__init__(daemon=True)
        self.pid, self.interval, self.memory_stat = pid, interval, memory_stat
        self.files, self.cache_every, self.cpu_every = files or {}, cache_every, cpu_every
        self.cpu: list[tuple] = []
        self.cached: list[tuple] = []
        self.reads: list[tuple] = []
        self._pages: dict = {}  # role: the file's resident pages at the last poll
        self._layouts: dict = {}  # role: its tensor_pages, None for a file that is no safetensors
        self.samples: list[tuple] = []
        self.stop_event = threading.Event()
        self.nvml_error = None
        self.used = None
        self.pids: list[int] = []

    def _nvml(self):
        try:
            import pynvml
            pynvml.nvmlInit()
            visible = os.environ.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0]
            handle = pynvml.nvmlDeviceGetHandleByIndex(int(visible) if visible.isdigit() else 0)
            return lambda: pynvml.nvmlDeviceGetMemoryInfo(handle).used
        except Exception as e:  # no NVML (a CPU machine): the device peaks stay unknown
            self.nvml_error = f"{type(e).__name__}: {e}"[:300]
            return None

    def _memory(self) -> tuple:
        """(RSS, unreclaimable) of the process tree, listed again, and the memory cgroup's (anon, file, refaulted
        file bytes) where it has one (cgroup_memory)."""
        cgroup = cgroup_memory(self.memory_stat)
        try:
            procs = _tree(self.pid)
            self.pids = [p.pid for p in procs]
            return sum(p.memory_info().rss for p in procs), unreclaimable(self.pids), *cgroup
        except Exception:  # the server is gone
            self.pids = []
            return None, None, *cgroup

    def _sample(self, memory: tuple) -> tuple:
        io = io_bytes(self.pids) if self.pids else (None, None)
        return (time.time(), self.used() if self.used else None, *memory[:2], *io, *memory[2:])

    def run(self):
        self.used = self._nvml()
        count, memory = 0, (None,) * 5
        while not self.stop_event.is_set():
            if count % 5 == 0:
                memory = self._memory()
            self.samples.append(self._sample(memory))
            if self.files and count % self.cache_every == 0:
                self._cache()
            if count % self.cpu_every == 0 and self.pids:
                self.cpu.append((time.time(), cpu_seconds(self.pids)))
            count += 1
            self.stop_event.wait(self.interval)

    def _cache(self):
        t, cached = time.time(), {}
        for role, path in self.files.items():
            if role not in self._layouts:  # read before the first residency, which then holds the header's pages
                self._layouts[role] = tensor_pages(path) if HAVE_NUMPY else None
            pages = resident_pages(path)
            cached[role] = cached_size(path, pages)
            last, self._pages[role] = self._pages.get(role), pages
            if last is not None and pages is not None and self._layouts[role] is not None:
                new = newly_cached(last, pages, self._layouts[role])
                if new:
                    self.reads.append((t, role, new))
        self.cached.append((t, cached))

    def stop(self):
        self.stop_event.set()
        self.join()
        self.samples.append(self._sample(self._memory()))
        if self.pids:
            self.cpu.append((time.time(), cpu_seconds(self.pids)))
        if self.files:
            self._cache()


class MemoryLimit:
    """A memory limit of `cap` bytes for one server (`make` gives one, or the reason there is none): a cgroup v2
    child of this process's cgroup, else a sibling of it (v2 forbids controllers under a cgroup holding
    processes), else a child in v1's memory hierarchy, else a systemd scope where systemd runs. The server
    starts with `launcher` before its command and `preexec_fn` run in it; `stats` are read before it stops."""

    def __init__(self, how: str, cap: int, path: Path | None = None, version: int = 2, unit: str | None = None):
        self.how, self.path, self.version, self.unit = how, path, version, unit
        self.launcher = ("systemd-run", "--scope", "--quiet", f"--unit={unit}", f"-pMemoryMax={cap}",
                         "-pMemorySwapMax=0", "--") if unit else ()
        self.preexec_fn = self._join if path else None
        self.memory_stat = path / "memory.stat" if path and version == 2 else None  # Monitor samples it

    @classmethod
    def make(cls, cap: int, name: str, root=Path("/sys/fs/cgroup"), proc=Path("/proc")
             ) -> tuple["MemoryLimit | None", str]:
        why = []
        lines = (proc / "self" / "cgroup").read_text().splitlines()
        if (root / "cgroup.controllers").exists():
            own = root / next(line.split("::", 1)[1] for line in lines if line.startswith("0::")).lstrip("/")
            # our own cgroup may take the controller for its children; a parent's is used only as it is
            for parent in dict.fromkeys((own, own.parent if own != root else own)):
                try:
                    if "memory" not in (parent / "cgroup.subtree_control").read_text().split():
                        if parent != own:
                            raise OSError("its children have no memory controller")
                        (parent / "cgroup.subtree_control").write_text("+memory")
                    return cls._child(parent / name, 2, cap), ""
                except OSError as e:
                    why.append(f"cgroup v2 under {parent}: {e}")
        elif (root / "memory").is_dir():
            own = next((line.split(":", 2)[2] for line in lines if ":memory:" in line), "/")
            try:
                return cls._child(root / "memory" / own.lstrip("/") / name, 1, cap), ""
            except OSError as e:
                why.append(f"cgroup v1 memory under {own}: {e}")
        else:
            why.append("no cgroup memory controller at /sys/fs/cgroup")
        if shutil.which("systemd-run") and (proc / "1" / "comm").read_text().strip() == "systemd":
            return cls(f"systemd scope {name}.scope MemoryMax {cap}", cap, unit=name), ""
        return None, "; ".join(why + ["no systemd to run a scope"])

    @classmethod
    def _child(cls, path: Path, version: int, cap: int) -> "MemoryLimit":
        limit = "memory.max" if version == 2 else "memory.limit_in_bytes"
        path.mkdir(exist_ok=True)
        try:
            (path / limit).write_text(str(cap))
        except OSError:
            path.rmdir()
            raise
        try:  # no swapping past the cap, where the kernel accounts swap
            if version == 2:
                (path / "memory.swap.max").write_text("0")
            else:
                (path / "memory.memsw.limit_in_bytes").write_text(str(cap))
        except OSError:
            pass
        return cls(f"cgroup v{version} {path} {limit} {cap}", cap, path, version)

    def _join(self):
        with open(self.path / "cgroup.procs", "w") as f:
            f.write(str(os.getpid()))

    def stats(self) -> dict:
        if self.unit:
            show = subprocess.run(["systemctl", "show", "-p", "MemoryPeak", "--value", f"{self.unit}.scope"],
                                  capture_output=True, text=True).stdout.strip()
            return {"cgroup_peak_gib": int(show) / GIB if show.isdigit() else None}

        def read(name):
            try:
                return (self.path / name).read_text()
            except OSError:
                return ""
        peak = read("memory.peak" if self.version == 2 else "memory.max_usage_in_bytes").strip()
        events = read("memory.events" if self.version == 2 else "memory.oom_control")
        kills = [int(line.split()[1]) for line in events.splitlines() if line.startswith("oom_kill ")]
        return {"cgroup_peak_gib": int(peak) / GIB if peak.isdigit() else None,
                "oom_kills": kills[0] if kills else None}

    def remove(self):
        for _ in range(50 if self.path else 0):  # the cgroup sees the server's exit a moment after its wait()
            try:
                self.path.rmdir()
                return
            except OSError:
                time.sleep(0.1)


def evict_page_cache(paths) -> None:
    """Drop the files' clean pages from the page cache (no privileges needed), so that each configuration
    reads them from the disk as a user's first run does."""
    os.sync()
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def first_launches(log_text: str) -> dict:
    """The pack's kernels' first launches in a job, from its run reports' log lines ("first launches at 7 shapes:
    6.0 s"): shapes and seconds, summed over the job's models (zeros where none)."""
    found = re.findall(r"first launches at (\d+) shapes: ([\d.]+) s", log_text)
    return {"shapes": sum(int(n) for n, _ in found), "seconds": round(sum(float(t) for _, t in found), 1)}


def triton_entries(folder: Path) -> int:
    """The entries of a Triton cache folder: a subfolder per compiled kernel variant (and per launcher it builds)."""
    return sum(1 for entry in folder.iterdir() if entry.is_dir()) if folder.is_dir() else 0


def disk_free_gib(path) -> float:
    return shutil.disk_usage(path).free / GIB


def probe_video(path: Path) -> dict:
    info = {"file": path.name, "bytes": path.stat().st_size}
    try:
        import av
        with av.open(str(path)) as container:
            video = container.streams.video[0]
            info.update(frames=video.frames, width=video.codec_context.width, height=video.codec_context.height,
                        video_codec=video.codec_context.name, audio_streams=len(container.streams.audio),
                        duration_s=container.duration / 1e6 if container.duration else None)
    except Exception as e:
        info["probe_error"] = f"{type(e).__name__}: {e}"[:300]
    return info


# ---- timing ------------------------------------------------------------------

def segments(events, graph: dict, t_post: float, t_end: float, first_call: float | None):
    """[(start, end, stage, node)] partitioning [t_post, t_end]: the queue, then each node's time from its
    `executing` message to the next one's (the sampler split at its first model call)."""
    starts = [(t, data["node"]) for t, kind, data in events if kind == "executing" and data.get("node")]
    out = [(t_post, starts[0][0] if starts else t_end, "queue", None)]
    for i, (t, node) in enumerate(starts):
        end = starts[i + 1][0] if i + 1 < len(starts) else t_end
        stage = STAGE_OF.get(graph.get(node, {}).get("class_type"), "graph")
        if stage == "sampling" and first_call is not None and t < first_call < end:
            out.append((t, first_call, "model_load", node))
            t = first_call
        out.append((t, end, stage, node))
    return out


def stage_seconds(segs) -> dict:
    seconds = dict.fromkeys(STAGES, 0.0)
    for start, end, stage, _ in segs:
        seconds[stage] += end - start
    return seconds


def bytes_by_segment(segs, samples, column: int) -> list:
    """What a cumulative column (4: bytes read from the disk, 5: written, 8: file pages refaulted) grew by in each
    segment: its last sample at or before the segment's end less its last at or before its start (samples every
    20 ms)."""
    known = [(s[0], s[column]) for s in samples if s[column] is not None]
    times = [t for t, _ in known]

    def at(t):
        index = bisect.bisect_right(times, t) - 1
        return known[index][1] if index >= 0 else (known[0][1] if known else 0)
    return [max(0, at(end) - at(start)) for start, end, _, _ in segs]


def bytes_by_stage(segs, samples, column: int) -> dict:
    """bytes_by_segment summed by stage."""
    out = dict.fromkeys(STAGES, 0)
    for (_, _, stage, _), grown in zip(segs, bytes_by_segment(segs, samples, column)):
        out[stage] += grown
    return out


def peaks_by_stage(segs, samples, column: int) -> dict:
    """The largest sample of `column` (1: device, 2: RSS, 3: unreclaimable, 6: the cgroup's anon, 7: its page
    cache) in each stage, GiB."""
    starts = [s[0] for s in segs]
    peaks = {}
    for sample in samples:
        value, index = sample[column], bisect.bisect_right(starts, sample[0]) - 1
        if value is None or index < 0 or sample[0] > segs[index][1]:
            continue
        stage = segs[index][2]
        peaks[stage] = max(peaks.get(stage, 0), value / GIB)
    return peaks


def cached_at(cached, t) -> dict:
    """The last residency sample at or before `t` (the first one where none is earlier)."""
    times = [time for time, _ in cached]
    return cached[max(0, bisect.bisect_right(times, t) - 1)][1]


def cached_by_stage(segs, cached) -> dict:
    """Each stage's {role: [GiB in the page cache at its first segment's start, at its last one's end]}; None where
    unknown."""
    if not cached:
        return {}
    spans = {}
    for start, end, stage, _ in segs:
        spans[stage] = (spans.get(stage, (start,))[0], end)
    out = {}
    for stage, (start, end) in spans.items():
        first, last = cached_at(cached, start), cached_at(cached, end)
        out[stage] = {role: [None if first[role] is None else first[role] / GIB,
                             None if last[role] is None else last[role] / GIB] for role in first}
    return out


def reads_by_stage(segs, reads, top: int = 8, least: int = 16 * 2 ** 20) -> dict:
    """Each stage's {role: {group: GiB}}: the pages of each file newly cached during it (Monitor.reads, each poll's
    reads counted in the segment holding the poll), by tensor group, the `top` largest of at least `least` bytes."""
    starts = [seg[0] for seg in segs]
    summed: dict = {}
    for t, role, groups in reads:
        i = bisect.bisect_right(starts, t) - 1
        if i < 0 or t > segs[i][1]:
            continue  # before the job, or after it
        into = summed.setdefault(segs[i][2], {}).setdefault(role, {})
        for group, n in groups.items():
            into[group] = into.get(group, 0) + n
    out = {}
    for stage, roles in summed.items():
        for role, groups in roles.items():
            kept = sorted(((n, g) for g, n in groups.items() if n >= least), reverse=True)[:top]
            if kept:
                out.setdefault(stage, {})[role] = {g: round(n / GIB, 3) for n, g in kept}
    return out


def cached_at_decode(segs, graph: dict, cached) -> dict | None:
    """{role: GiB in the page cache} as the first VAEDecode starts (the vae_decode stage starts earlier: ComfyUI
    runs the VAELoaders first); None without a VAEDecode or samples."""
    starts = [start for start, _, _, node in segs if graph.get(node, {}).get("class_type") == "VAEDecode"]
    if not starts or not cached:
        return None
    return {role: None if n is None else n / GIB for role, n in cached_at(cached, starts[0]).items()}


def sampling_detail(report: dict) -> dict:
    steps = report.get("step_seconds") or []
    steady = statistics.median(steps[1:]) if len(steps) > 1 else None
    return {"steps": len(steps), "step_seconds": steps, "step_s": steady,
            "first_step_excess_s": steps[0] - steady if steady is not None else None,
            "calls_per_step": report.get("calls_per_step")}


# ---- the run -------------------------------------------------------------------

class Job:
    def __init__(self, opts):
        self.opts = opts
        self.work = Path(opts.work).resolve()
        self.base = self.work / "base"
        self.base.mkdir(parents=True, exist_ok=True)
        # the budget counts from the device script's start where it says when (unpacking, building SageAttention)
        self.started = float(os.environ.get("E2E_STARTED") or time.time())
        self.latents = {}  # (setting, ram_gib, config, job) -> (video, audio)
        self.memory_stat = None  # the current server's cgroup memory.stat (MemoryLimit), sampled by Monitor
        self.phases = {}  # setting -> {"job1": [seconds...], "job2": [...]}: estimate's measurements
        self.encoder_check = None
        version = comfyui_version(Path(opts.comfyui))
        self.out = Path(opts.out) if opts.out else (Path(opts.out_dir) if opts.out_dir else RESULTS) / (
            f"whole-job-{'tiny-' if opts.tiny else ''}{gpu_slug()}-comfyui-{version}-"
            f"{datetime.date.today().isoformat()}.json")
        self.log_path = self.out.with_suffix(".log")
        self.out.parent.mkdir(parents=True, exist_ok=True)
        self.log_path.write_text("")
        self.payload = {
            "bench": "whole-job",
            "environment": {"gpu": gpu_name(), "comfyui": version, "python": sys.version.split()[0],
                            **{name.replace("-", "_"): package_version(name) for name in
                               ("torch", "comfy-kitchen", "comfy-aimdo", "sageattention", "av")}},
            "settings": {k: v for k, v in vars(opts).items() if k not in ("work", "comfyui", "out", "out_dir")},
            "second_job": {k: v for k, v in SECOND_JOB.items() if k != "tiny_conditioning_seed"},
            "files": {}, "machine": {}, "results": [], "summary": {},
        }

    # -- output --
    def write(self):
        self.compare_latents()
        self.payload["summary"] = summarize(self.payload["results"])
        tmp = self.out.with_name(self.out.name + ".tmp")
        tmp.write_text(json.dumps(self.payload, indent=2, default=str))
        tmp.replace(self.out)

    def log(self, title, text):
        with open(self.log_path, "a") as f:
            f.write(f"\n===== {title} =====\n" + "".join(line[:2000] + "\n" for line in text.splitlines()))

    def compare_latents(self):
        """Each record's latent against each reference's same job (the same prompt and seed)."""
        for rec in self.payload["results"]:
            key = (rec["setting"], rec["ram_gib"])
            mine = self.latents.get((*key, rec["config"], rec["job"]))
            for ref in REFERENCES:
                theirs = self.latents.get((*key, ref, rec["job"]))
                if mine is not None and theirs is not None and ref != rec["config"]:
                    rec.setdefault("latent", {})[f"vs_{ref}"] = {
                        stream: compare(a, b) for stream, a, b in zip(("video", "audio"), mine, theirs)}

    # -- files --
    def make_files(self) -> dict:
        opts = self.opts
        files = template_files(load_prompt("template", "turbo"))
        if opts.tiny:
            del files["text_encoder"]  # replaced by test conditioning
        paths = {role: self.base / "models" / folder / name for role, (folder, name) in files.items()}
        stamp = self.base / "models" / "bench_files.json"
        wanted = {"tiny": opts.tiny, "files": {role: str(p) for role, p in paths.items()}, "lora_qkv": opts.lora_qkv}
        if stamp.exists() and all(p.exists() for p in paths.values()) and \
                json.loads(stamp.read_text()).get("wanted") == wanted:
            info = {**json.loads(stamp.read_text())["info"], "reused": True}
        else:
            stamp.unlink(missing_ok=True)
            (paths["lora"].parent / SECOND_LORA_FILE).unlink(missing_ok=True)  # drawn as the first LoRA is
            spec = e2e_models.TINY_H3 if opts.tiny else e2e_models.H3_PRUNED_RELEASED
            comps = {role: e2e_models.COMPONENTS[name] for role, name in (TINY_COMPONENTS if opts.tiny
                                                                          else COMPONENTS).items()}
            info = {"disk_free_gib_before": disk_free_gib(self.work)}
            for role, path in paths.items():
                if role == "dit":
                    made = e2e_models.generate(spec, path, opts.comfyui, cpu=opts.cpu, fmt="int8_convrot")
                elif role == "lora":
                    made = e2e_models.make_turbo_lora(paths["dit"], path, opts.comfyui, cpu=opts.cpu,
                                                      rank=TINY["lora_rank"] if opts.tiny else
                                                      e2e_models.TURBO_LORA_RANK, qkv=opts.lora_qkv)
                else:
                    made = e2e_models.generate_component(comps[role], path, opts.comfyui, cpu=opts.cpu)
                made.update(file=path.name, published_gib=None if opts.tiny else PUBLISHED_GIB[role],
                            gib=path.stat().st_size / GIB)
                info[role] = made
                print(f"[{self.elapsed():4.0f} s] {role} {path.name}: {made['gib']:.2f} GiB"
                      + (f" (published {made['published_gib']:.2f})" if made["published_gib"] else "")
                      + f", written in {made['seconds']:.1f} s on {made['device']}", flush=True)
            stamp.write_text(json.dumps({"wanted": wanted, "info": info}))
        if opts.lora_second:  # beside the stamped files: asking for it later keeps them
            paths["second_lora"] = paths["lora"].parent / SECOND_LORA_FILE
            made = {"reused": True}
            if not paths["second_lora"].exists():
                made = e2e_models.make_turbo_lora(paths["dit"], paths["second_lora"], opts.comfyui, cpu=opts.cpu,
                                                  rank=TINY["lora_rank"] if opts.tiny else e2e_models.TURBO_LORA_RANK,
                                                  seed=1, qkv=opts.lora_qkv)
            info["second_lora"] = {**made, "file": SECOND_LORA_FILE, "gib": paths["second_lora"].stat().st_size / GIB}
        if self.needs_encoder_check():
            e2e_models.generate_component(e2e_models.COMPONENTS["encoder_probe"], self.base / "models" /
                                          "text_encoders" / "bigdit_encoder_probe.safetensors", opts.comfyui,
                                          cpu=opts.cpu)
        info["disk_free_gib_after"] = disk_free_gib(self.work)
        self.payload["files"] = info
        self.paths = paths
        self.measure_machine()
        return info

    def measure_machine(self) -> None:
        """What the profile's floors divide by: the disk's bandwidth, from a cold read of the largest file (at most
        4 GiB of it), and the card's copy and host-to-device bandwidths and peaks (job_profile)."""
        largest = max(self.paths.values(), key=lambda path: path.stat().st_size)
        disk = job_profile.measure_disk(largest)
        device = ({"error": "a CPU run (--cpu): no device measured"} if self.opts.cpu else
                  job_profile.measure_device())
        self.payload["machine"] = {"disk": disk, "device": device}
        print(f"[{self.elapsed():4.0f} s] disk: {disk['bytes'] / GIB:.2f} GiB of {disk['file']} in "
              f"{disk['seconds']:.2f} s, {disk['gib_s'] or 0:.2f} GiB/s (by readers: " + ", ".join(
                  f"{k.split('_')[0]} {v or 0:.2f}" for k, v in disk.items() if k[0].isdigit() and k.endswith("_gib_s"))
              + f"; cold: {disk['cold']}); device: "
              + (f"{device['gpu']}, copy {device['hbm_gib_s']:.0f} GiB/s, host-to-device {device['h2d_gib_s']:.1f} "
                 f"GiB/s, peak {device['peak_tflops']} TFLOP/s" if "gpu" in device else device["error"]), flush=True)

    def here(self, text: str) -> str:
        """`text` with this machine's work folder written as <work>."""
        return text.replace(str(self.work), "<work>")

    def elapsed(self) -> float:
        return time.time() - self.started

    # -- the pack's encoder loader --
    def needs_encoder_check(self) -> bool:
        return (self.encoder_check is None and self.opts.pack_encoder == "auto"
                and any(CONFIGS[name].prompt == "pack" for name in self.opts.configs))

    def check_encoder(self, server) -> None:
        """Whether QuantizedCLIPLoader loads the encoder file's layer kinds, from e2e_models' encoder_probe (a
        CLIP-L with them: a 2-second load), once per run, in the first server after its job (before it where that
        is a pack configuration's, and its record says so)."""
        name = "bigdit_encoder_probe.safetensors"
        path = self.base / "models" / "text_encoders" / name
        graph = {"clip": {"class_type": "QuantizedCLIPLoader", "inputs": {
                     "clip_name": name, "type": "stable_diffusion", "rename_prefixes": "", "nvfp4": "auto"}},
                 "report": {"class_type": "PreviewAny", "inputs": {"source": ["clip", 1]}}}
        t0 = time.monotonic()
        try:
            server.run(graph, timeout=120)
            self.encoder_check = {"loads": True}
        except PromptError as e:  # a refusal of the probe's own layers says no; any other failure says nothing
            named = any(layer in e.message for layer in e2e_models.ENCODER_PROBE_LAYERS)
            self.encoder_check = {"loads": False if named else None, "error": self.here(e.message[:1000])}
        self.encoder_check["seconds"] = time.monotonic() - t0
        self.payload["encoder_check"] = self.encoder_check
        path.unlink(missing_ok=True)

    def pack_encoder(self) -> str:
        if self.opts.pack_encoder != "auto":
            return self.opts.pack_encoder
        return "CLIPLoader" if self.encoder_check["loads"] is False else "QuantizedCLIPLoader"

    # -- one configuration: a fresh server, its first job, then its second --
    def estimate(self, setting: str, phase: str) -> float:
        """The longest `phase` so far at `setting`, else at any setting, else PRIOR_S's: "job1" from a server's
        start (its page-cache drop included) to the end of its first job, "job2" the second job."""
        same = self.phases.get(setting, {}).get(phase, [])
        done = [v for per in self.phases.values() for v in per.get(phase, [])]
        return max(same or done or [PRIOR_S["tiny" if self.opts.tiny else setting][phase]])

    def over_budget(self, estimate: float) -> str | None:
        budget = self.opts.budget_s
        if budget and self.elapsed() + estimate + STOP_S > budget:
            return f"time budget ({budget:.0f} s) would be exceeded (this one estimated at {estimate:.0f} s)"
        return None

    def run_server(self, config: Config, setting: str, ram_gib: float) -> list[dict]:
        """The two records of one configuration's server, its first job and its second, each recorded (written into
        the JSON) as soon as it ends; what is known only when the server stops is added to both then."""
        opts = self.opts
        base = {"config": config.name, "setting": setting, "ram_gib": ram_gib, "cap_gib": opts.cap_gib,
                "prompt": config.prompt, "nodes": {k: list(v) if isinstance(v, tuple) else v
                                                   for k, v in config.nodes.items()},
                "comfy_args": list(config.comfy_args), "env": dict(config.env)}
        jobs = (1, 2) + ((3,) if opts.lora_change else ()) + ((4,) if opts.lora_second else ())
        recs = [{**base, "job": job, "status": None} for job in jobs]
        why = self.over_budget(self.estimate(setting, "job1"))
        if why:
            for rec in recs:
                rec.update(status="skipped", error=why)
                self.record(rec)
            return recs
        tag = f"{setting}_{ram_gib:g}g_{config.name}"
        limit, why = (MemoryLimit.make(int(ram_gib * GIB), f"bigdit-job-{os.getpid()}-{len(self.payload['results'])}")
                      if opts.ram_cgroup else (None, "not asked (--ram-cgroup)"))
        ram = {"comfyui_sees_gib": ram_gib, "enforced": limit is not None, "how": limit.how if limit else why}
        self.memory_stat = limit.memory_stat if limit is not None else None
        env = {"BIGDIT_BENCH_PROFILE": "0", **dict(config.env)}
        triton_dir = self.kept_folder("triton_cache", tag)
        triton_dir.mkdir(parents=True, exist_ok=True)
        env["TRITON_CACHE_DIR"] = str(triton_dir)
        triton_before = triton_entries(triton_dir)
        cache = None
        if config.prompt == "pack":  # the quantize-once cache as users have it, in a folder of this server's own
            # the pack's tuning store (kept kernel choices: attention auto's) lies beside the cache's folder
            cache = self.kept_folder("quant_cache", tag) / tag
            shutil.rmtree(cache, ignore_errors=True)
            env.update(BIGDIT_QUANT_CACHE=str(cache), BIGDIT_QUANT_CACHE_GIB="1000")
        for rec in recs:
            rec.update(ram=ram, quant_cache="on, a fresh folder for this server" if cache else "off")
        recs[0]["disk_free_gib"] = disk_free_gib(self.work)
        t0 = time.monotonic()
        if not opts.warm:
            evict_page_cache(self.paths.values())
            recs[0]["page_cache_evict_s"] = time.monotonic() - t0
        run_log = self.work / "logs" / f"{tag}.log"
        run_log.unlink(missing_ok=True)
        server, current = None, recs[0]
        try:
            server = BenchServer(self.base, opts.comfyui, run_log, None if opts.cpu else opts.cap_gib, cpu=opts.cpu,
                                 extra_args=config.comfy_args, ram_gib=ram_gib, cache_none=False,
                                 launcher=limit.launcher if limit else (),
                                 preexec_fn=limit.preexec_fn if limit else None, env=env)
            recs[0]["server_start_s"] = time.monotonic() - t0
            object_info = server.object_info()
            encoder = "QuantizedCLIPLoader"
            if config.prompt == "pack":
                if self.needs_encoder_check():
                    self.check_encoder(server)
                    recs[0]["encoder_check_before_the_job"] = True
                if not opts.tiny:  # --tiny has no encoder to load
                    encoder = self.pack_encoder()
                    for rec in recs:
                        rec["encoder_loader"] = encoder
            for index, rec in enumerate(recs):
                current, job = rec, rec["job"]
                if job >= 2:
                    why = "the job before did not finish" if recs[index - 1]["status"] != "ok" else \
                        self.over_budget(self.estimate(setting, "job2"))
                    if why:
                        for skipped in recs[index:]:
                            skipped.update(status="skipped", error=why)
                        break
                t_job = time.monotonic()
                graph, rec["left_out"] = job_graph(config, setting, object_info, encoder,
                                                   e2e_models.TINY_H3.text_dim if opts.tiny else None, job)
                if job >= 3 and not nodes_of(graph, "LoraLoaderModelOnly"):
                    for skipped in recs[index:]:
                        skipped.update(status="skipped", error="no LoRA in this graph")
                    break
                if job >= 2:
                    rec["between_jobs"] = self.between_jobs(server)
                if job == 3:
                    rec["lora_strength"] = LORA_CHANGE
                if job == 4:
                    rec["second_lora"] = {"lora_name": SECOND_LORA_FILE, "strength_model": LORA_SECOND}
                why = unoffered_choice(graph, object_info)
                if why:
                    for skipped in recs[index:]:
                        skipped.update(status="skipped", error=why)
                    break
                try:
                    rec.update(self.run_job(server, graph, (setting, ram_gib, config.name, job)))
                    rec["status"] = "ok"
                except PromptError as e:
                    rec.update(status="error", error=self.here(e.message[:3000]), failed_node=e.node_type,
                               traceback=self.here(e.traceback[-3000:]))
                phase = time.monotonic() - (t0 if job == 1 else t_job)
                self.phases.setdefault(setting, {}).setdefault(f"job{min(job, 2)}", []).append(phase)
                self.record(rec)
            current = None
            if self.needs_encoder_check():
                self.check_encoder(server)
        except Exception as e:  # the server died (an OOM kill?), hung or refused: record it, go on with the next one
            error = self.here((e.message if isinstance(e, PromptError) else f"{type(e).__name__}: {e}")[-3000:])
            if current is not None:
                current.update(status="error", error=error)
            else:  # after both jobs (the encoder check): the jobs' records stand
                for rec in recs:
                    rec["server_error_after_the_jobs"] = error
        finally:
            stats = limit.stats() if limit is not None else {}
            hwm = server_hwm(server.pid) if server is not None else None
            if server is not None:
                server.stop()
            if limit is not None:
                limit.remove()
            duration = time.monotonic() - t0
            text = run_log.read_text(errors="replace") if run_log.exists() else ""
            cached = cache_files(cache) if cache else None
            triton = {"mode": opts.triton_cache, "entries_at_start": triton_before,
                      "entries_added": triton_entries(triton_dir) - triton_before}
            for rec in recs:
                rec["ram"] = {**rec["ram"], **stats}
                rec.update(host_rss_hwm_gib=hwm, server_duration_s=duration, triton_cache=triton)
                if cached is not None:
                    rec["quant_cache_files"] = cached
                if rec["status"] is None:
                    rec.update(status="skipped", error="the server stopped before this job")
            if cache:
                shutil.rmtree(cache, ignore_errors=True)
            recs[0]["log_lines"] = log_lines(text, self.work)
            self.log(f"{setting} {ram_gib:g} GiB {config.name}", text)
            for rec in recs:
                if not any(rec is done for done in self.payload["results"]):
                    self.record(rec)
            self.write()
        return recs

    def kept_folder(self, kind: str, tag: str) -> Path:
        """The folder of what a server keeps across restarts (Triton's cache, the tuning store's): with
        --triton-cache cold an empty one of the server `tag`'s own, with run one for the whole run."""
        if self.opts.triton_cache == "run":
            return self.work / kind / "run"
        folder = self.work / kind / tag
        shutil.rmtree(folder, ignore_errors=True)
        return folder

    def between_jobs(self, server) -> str:
        """--between-jobs free: ComfyUI's "Free model and node cache" (POST /free), so that the second job loads
        everything again (through the quantize-once cache where the loader has it); keep: nothing, as a user
        queues the next prompt."""
        if self.opts.between_jobs == "free":
            server._request("/free", {"unload_models": True, "free_memory": True})
            # the prompt worker applies it when it wakes or after the prompt it takes next: a prompt of nothing
            # first, so that the second job comes after it
            server.run({"value": {"class_type": "PrimitiveInt", "inputs": {"value": int(time.time())}},
                        "show": {"class_type": "PreviewAny", "inputs": {"source": ["value", 0]}}}, timeout=120)
        return self.opts.between_jobs

    def run_job(self, server, graph: dict, key) -> dict:
        """POST the prompt, follow it to the end; the record's measurements."""
        events = EventStream(server.url, uuid.uuid4().hex)
        events.start()
        if not events.connected.wait(30) or events.error:
            raise RuntimeError(f"no websocket to follow the job: {events.error or 'no connection in 30 s'}")
        log_start = len(server.log_text())
        monitor = Monitor(server.pid, memory_stat=self.memory_stat, files=self.paths)
        monitor.start()
        t_post = time.time()
        try:
            queued = server._request("/prompt", {"prompt": graph, "client_id": events.client_id})
        except urllib.error.HTTPError as e:
            monitor.stop()
            body = json.loads(e.read() or b"{}")
            raise PromptError(_validation_message(body), body.get("node_errors")) from None
        deadline = time.monotonic() + self.opts.prompt_timeout
        while not events.finished.wait(0.2):
            if not server.alive() or time.monotonic() > deadline:
                break
        monitor.stop()
        end = next(((t, kind) for t, kind, _ in reversed(events.events) if kind.startswith("execution_")
                    and kind not in ("execution_start", "execution_cached")), None)
        if end is None:
            raise RuntimeError(("ComfyUI died during the job" if not server.alive() else
                                f"no end of the job after {self.opts.prompt_timeout:.0f} s") +
                               (f" ({events.error})" if events.error else "") + f":\n{server.log_text()[-3000:]}")
        entry = None
        for _ in range(100):  # the history is written a moment after the last message
            entry = server._request(f"/history/{queued['prompt_id']}").get(queued["prompt_id"])
            if entry and entry["status"]["status_str"] in ("success", "error"):
                break
            time.sleep(0.05)
        if entry is None:
            raise RuntimeError(f"{end[1]}, and no history entry for the prompt")
        if end[1] != "execution_success":
            raise server._execution_error(entry)
        report = json.loads(entry["outputs"]["bench_report"]["text"][0])
        segs = segments(events.events, graph, t_post, end[0], report.get("first_call"))
        stages = stage_seconds(segs)
        wall = end[0] - t_post
        self.latents[key] = (server.latent(entry, "bench_video"), server.latent(entry, "bench_audio"))
        (save_video,) = nodes_of(graph, "SaveVideo")
        (video,) = server.output_files(entry, save_video, "images")
        executed = {data.get("node") for _, kind, data in events.events if kind == "executing"}
        job_log = server.log_text()[log_start:]
        out = {"wall_s": wall, "stages": stages, "stage_sum_s": sum(stages.values()),
               "host_share": sum(stages[s] for s in HOST_STAGES) / wall,
               "nodes": [{"node": n, "class_type": graph.get(n, {}).get("class_type"), "stage": st, "seconds": e - s}
                         for s, e, st, n in segs if n is not None],
               "sampling": sampling_detail(report), "video": probe_video(video),
               "latent_shape": report.get("latent_shape"), "model_input": report.get("model_input"),
               "loads": self.here_all(loads(graph, executed, entry["outputs"], job_log)),
               "reports": {n: "\n".join(o["text"])[:4000] for n, o in entry["outputs"].items()
                           if o.get("text") and not n.startswith("bench_")},
               "kernel_first_launches": first_launches(job_log)}
        video.unlink()
        samples = monitor.samples
        device = [s[1] for s in samples if s[1] is not None]
        node_segs = [seg for seg in segs if seg[3] is not None]  # out["nodes"]' order
        for entry, read in zip(out["nodes"], bytes_by_segment(node_segs, samples, 4)):
            entry["disk_read_gib"] = read / GIB
        out.update(device_used_peak_gib=max(device) / GIB if device else None,
                   device_used_peak_by_stage_gib=peaks_by_stage(segs, samples, 1),
                   host_rss_peak_gib=max((s[2] for s in samples if s[2]), default=0) / GIB,
                   host_rss_peak_by_stage_gib=peaks_by_stage(segs, samples, 2),
                   host_unreclaimable_peak_gib=max((s[3] for s in samples if s[3]), default=0) / GIB,
                   disk_read_by_stage=bytes_by_stage(segs, samples, 4),
                   disk_written_by_stage=bytes_by_stage(segs, samples, 5), samples=len(samples),
                   page_cache_by_stage_gib=cached_by_stage(segs, monitor.cached),
                   page_cache_at_decode_gib=cached_at_decode(segs, graph, monitor.cached),
                   file_reads_by_stage_gib=reads_by_stage(segs, monitor.reads),
                   cpu_by_stage_s=cpu_by_stage(segs, monitor.cpu))
        if any(s[8] is not None for s in samples):  # the server's memory cgroup (v2): what its page cache did
            # each node's file pages read again after the kernel dropped them: a file its loader reads twice
            for entry, grown in zip(out["nodes"], bytes_by_segment(node_segs, samples, 8)):
                entry["file_refaulted_gib"] = grown / GIB
            out["cgroup_by_stage"] = {"anon_peak_gib": peaks_by_stage(segs, samples, 6),
                                      "file_peak_gib": peaks_by_stage(segs, samples, 7),
                                      "file_refaulted_bytes": bytes_by_stage(segs, samples, 8)}
        # a machine of each size holds the job if what it cannot reclaim fits; the file pages it can drop and reread
        out["ram_budgets"] = {f"{gib}g": {"unreclaimable_fits": out["host_unreclaimable_peak_gib"] <= gib,
                                          "rss_fits": out["host_rss_peak_gib"] <= gib} for gib in RAM_BUDGETS_GIB}
        if monitor.nvml_error:
            out["device_used_error"] = monitor.nvml_error
        out["profile"] = self.profile(out, graph, executed, self.latents[key][1], key[-1])
        return out

    def here_all(self, value):
        """`value` (JSON-like) with this machine's work folder written as <work> in its strings."""
        return json.loads(self.here(json.dumps(value)))

    def profile(self, out: dict, graph: dict, executed: set, audio_latent, job: int) -> dict:
        """job_profile's floors of each stage of one job (see job_profile's docstring)."""
        opts = self.opts
        dit = job_profile.dit_config((e2e_models.TINY_H3 if opts.tiny else e2e_models.H3_PRUNED_RELEASED).kwargs)
        video_vae, audio_vae = job_profile.VIDEO_VAE, job_profile.AUDIO_VAE
        if opts.tiny:
            video_vae = {**video_vae, **e2e_models.TINY_VAE["video_decoder"]}
            audio_vae = {**audio_vae, **{k: e2e_models.TINY_VAE["audio"][k] for k in ("latent_dim", "decoder_dim")}}
        model_input = out.get("model_input") or {}
        calls = sum(out["sampling"].get("calls_per_step") or [])
        flops, counted = dict.fromkeys(STAGES), dict.fromkeys(STAGES)
        moved = dict.fromkeys(STAGES, 0.0)
        if model_input.get("rows") and calls:
            call = job_profile.dit_call_flops(dit, model_input["rows"])
            flops["sampling"] = {k: calls * v for k, v in call.items()}
            moved["sampling"] = calls * job_profile.dit_weight_bytes(dit)
            counted["sampling"] = {"calls": calls, "rows": model_input["rows"], "flops_per_call": job_profile.total(call)}
        text_tokens = (model_input.get("context") or [0, 0])[1]
        if not opts.tiny and text_tokens and self.ran(graph, executed, "MiniMaxH3ImageToVideo"):
            flops["encoder"] = job_profile.qwen_flops(job_profile.QWEN3VL_32B, text_tokens)
            moved["encoder"] = job_profile.qwen_weight_bytes(job_profile.QWEN3VL_32B)
            counted["encoder"] = {"tokens": text_tokens}
        if out.get("latent_shape"):
            video = job_profile.video_decode_flops(out["latent_shape"], video_vae)
            audio = job_profile.audio_decode_flops(list(audio_latent.shape), audio_vae)
            flops["vae_decode"] = {"linear": video["linear"] + audio["linear"], "attention": video["attention"]}
            moved["vae_decode"] = video["passes"] * job_profile.video_decoder_weight_bytes(video_vae)
            counted["vae_decode"] = {"video_latent": out["latent_shape"], "video_passes": video["passes"],
                                     "audio_latent": list(audio_latent.shape), "audio_flops": audio["linear"]}
        machine = self.payload["machine"]
        stages = {stage: job_profile.stage_profile(out["stages"][stage], out["disk_read_by_stage"][stage],
                                                   flops[stage], moved[stage], machine, counted[stage])
                  for stage in STAGES}
        loaded = {item["file"] for item in out["loads"] if item["ran"]}
        must_read = sum(path.stat().st_size for path in self.paths.values() if path.name in loaded) if job == 1 else 0
        to_device = (job_profile.dit_weight_bytes(dit) + job_profile.video_decoder_weight_bytes(video_vae)
                     + (moved["encoder"] or 0.0)) if job == 1 and not opts.cpu else 0.0
        return job_profile.job_profile(stages, must_read, to_device, machine)

    @staticmethod
    def ran(graph: dict, executed: set, class_type: str) -> bool:
        return any(node in executed for node in nodes_of(graph, class_type))

    def record(self, rec):
        self.payload["results"].append(rec)
        self.write()
        print(f"[{self.elapsed():4.0f} s] {result_line(rec)}", flush=True)
        for line in job_profile.profile_lines(rec):
            print(line, flush=True)
        for line in reads_lines(rec):
            print(line, flush=True)

    def run(self):
        self.make_files()
        self.write()
        for ram_gib in self.opts.ram_gib:
            for setting in self.opts.settings:
                for name in self.opts.configs:
                    self.run_server(CONFIGS[name], setting, ram_gib)
        self.write()
        print(f"wrote {self.out}", flush=True)
        for line in summary_lines(self.payload["summary"]):
            print(line, flush=True)


# the loaders of the job's files: class -> the input naming the file
LOADERS = {"UNETLoader": "unet_name", "LoadH3Quantized": "unet_name", "MixedCheckpointLoader": "unet_name",
           "CLIPLoader": "clip_name", "QuantizedCLIPLoader": "clip_name", "LoraLoaderModelOnly": "lora_name",
           "VAELoader": "vae_name", "BigditTinyVAELoader": "vae_name"}
CACHE_LINE = re.compile(r"quantize-once cache: (\w+)")
TUNING_LINE = re.compile(r"\btun(ed|ing)\b", re.I)


def tuning_status(lines: list[str]) -> str | None:
    """The tuned-kernel store's part in a load, as its lines say: "miss" where one says a search ran or a choice
    was missing, "hit" where one says hit, "seen" where lines name it otherwise; None without a line."""
    if not lines:
        return None
    text = " ".join(lines).lower()
    if re.search(r"\bmiss|search|autotun", text):
        return "miss"
    return "hit" if re.search(r"\bhit\b", text) else "seen"


def loads(graph: dict, executed: set, outputs: dict, log_text: str) -> list[dict]:
    """Each loader of the graph in one job: its file, whether it ran (ComfyUI keeps a loader's output for the next
    prompt while its inputs are the same), the first line of a pack loader's report, the quantize-once cache's
    word for the load (hit, miss, off, skipped) with its line, and the tuned-kernel store's lines (the report's
    and the job's log) and what they say."""
    log = [line.strip()[:300] for line in log_text.splitlines() if TUNING_LINE.search(line)]
    items = []
    for node, spec in graph.items():
        if spec["class_type"] not in LOADERS:
            continue
        output = outputs.get(node) or {}
        full, short = "\n".join(output.get("report", [])), "\n".join(output.get("text", []))
        item = {"node": node, "class_type": spec["class_type"], "file": spec["inputs"].get(LOADERS[spec["class_type"]]),
                "ran": node in executed}
        if short:
            item["report"] = short.splitlines()[0][:300]
        found = CACHE_LINE.search(full)
        if found:
            item["cache"] = found.group(1)
            item["cache_line"] = full[found.start():].splitlines()[0][:400]
        tuning = [line.strip()[:300] for line in full.splitlines() if TUNING_LINE.search(line)]
        if tuning:
            item["tuning"] = tuning[:10]
        items.append(item)
    for item in items:  # the log's lines are the job's, not a loader's: on the diffusion model's loader
        if log and item["class_type"] in ("UNETLoader", "LoadH3Quantized", "MixedCheckpointLoader"):
            item["tuning_log"] = log[:10]
        item["tuning_status"] = tuning_status(item.get("tuning", []) + item.get("tuning_log", []))
    return items


def cache_files(folder: Path) -> dict:
    """The quantize-once cache folder's files when its server stopped: how many, and their bytes."""
    files = [p for p in folder.rglob("*") if p.is_file()] if folder.exists() else []
    return {"files": len(files), "bytes": sum(p.stat().st_size for p in files),
            "names": sorted(p.name for p in files)[:10]}


def server_hwm(pid: int) -> float | None:
    """The server process's peak resident set (VmHWM), GiB, read before it stops."""
    try:
        with open(f"/proc/{pid}/status") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:")) / GIB
    except (OSError, StopIteration):
        return None


def reads_lines(rec, stages=("model_load", "sampling"), top: int = 3) -> list[str]:
    """A line per stage of `stages` that read model files: the largest tensor groups it read of each."""
    lines = []
    for stage in stages:
        roles = (rec.get("file_reads_by_stage_gib") or {}).get(stage)
        if roles:
            lines.append(f"    read in {stage}: " + "; ".join(
                f"{role} " + ", ".join(f"{group} {gib:.2f}" for group, gib in list(groups.items())[:top])
                for role, groups in roles.items()) + " GiB")
    return lines


def result_line(rec) -> str:
    head = f"{rec['setting']:>7} {rec['ram_gib']:g}G {rec['config']:<14} job {rec['job']}"
    if rec["status"] != "ok":
        return f"{head} {rec['status'].upper()}: {(rec.get('error') or '').splitlines()[0][:300]}"
    stages = ", ".join(f"{s} {rec['stages'][s]:.1f}" for s in STAGES if rec["stages"][s] >= 0.05)
    parts = [f"{rec['wall_s']:.1f} s ({stages})", f"host code {100 * rec['host_share']:.0f}%"]
    if rec["sampling"].get("step_s"):
        parts.append(f"{rec['sampling']['step_s']:.2f} s/step")
    if rec.get("device_used_peak_gib") is not None:
        parts.append(f"device {rec['device_used_peak_gib']:.1f} GiB")
    parts.append(f"RSS {rec['host_rss_peak_gib']:.1f} GiB (unreclaimable {rec['host_unreclaimable_peak_gib']:.1f})")
    parts.append(f"disk read {sum(rec['disk_read_by_stage'].values()) / GIB:.1f} GiB")
    decode = rec.get("page_cache_at_decode_gib") or {}
    if decode.get("video_vae") is not None:
        decoder_read = sum(n.get("disk_read_gib", 0) for n in rec["nodes"] if n["class_type"] == "VAEDecode")
        parts.append(f"video VAE cached at VAEDecode {decode['video_vae']:.2f} GiB, VAEDecode read {decoder_read:.2f}")
    for ref, streams in rec.get("latent", {}).items():
        parts.append(f"cos {streams['video']['cosine']:.4f} {ref}")
    if rec.get("encoder_loader") == "CLIPLoader":
        parts.append("encoder by CLIPLoader")
    for item in rec.get("loads", []):  # the diffusion model's loader: did it run, and the caches' word
        if item["class_type"] in ("UNETLoader", "LoadH3Quantized", "MixedCheckpointLoader"):
            parts.append(f"{item['class_type']} " + (("cache " + item["cache"]) if item.get("cache") else
                                                      "ran" if item["ran"] else "kept by ComfyUI")
                         + (f", tuned kernels {item['tuning_status']}" if item.get("tuning_status") else ""))
    return f"{head} " + ", ".join(parts)


def summarize(results) -> dict:
    """Per setting, RAM size and job (`turbo_64g_job1`): each pack configuration against each reference (reference
    seconds / pack seconds, whole job and per stage), and every configuration's share of host code."""
    summary = {}
    ok = [r for r in results if r["status"] == "ok"]
    for setting, ram_gib, job in dict.fromkeys((r["setting"], r["ram_gib"], r["job"]) for r in ok):
        at = {r["config"]: r for r in ok if (r["setting"], r["ram_gib"], r["job"]) == (setting, ram_gib, job)}
        ratios = {}
        for pack in (p for p in PACK_CONFIGS if p in at):
            for ref in (r for r in REFERENCES if r in at):
                a, b = at[ref], at[pack]
                ratios[f"{pack}_vs_{ref}"] = {
                    "whole": a["wall_s"] / b["wall_s"],
                    "stages": {s: a["stages"][s] / b["stages"][s] for s in STAGES
                               if a["stages"][s] > 0.05 and b["stages"][s] > 0.05}}
        summary[f"{setting}_{ram_gib:g}g_job{job}"] = {
            "speedup": ratios, "host_share": {name: r["host_share"] for name, r in at.items()},
            "wall_s": {name: r["wall_s"] for name, r in at.items()}}
        steps = [(at.get(name) or {}).get("sampling", {}).get("step_s") for name in ("pack_fast", "pack_fast_no_lora")]
        if all(steps):  # the LoRA branch's share of pack_fast's step, both measured in this run
            summary[f"{setting}_{ram_gib:g}g_job{job}"]["lora_step_share"] = (steps[0] - steps[1]) / steps[0]
    return summary


def summary_lines(summary) -> list[str]:
    lines = []
    for key, part in summary.items():
        for name, ratio in part["speedup"].items():
            pack, ref = name.split("_vs_")
            stages = ", ".join(f"{s} {v:.2f}x" for s, v in ratio["stages"].items())
            lines.append(f"{key} {pack} vs {ref}: whole job {ratio['whole']:.2f}x ({part['wall_s'][ref]:.1f} s -> "
                         f"{part['wall_s'][pack]:.1f} s); {stages}; host code {100 * part['host_share'][pack]:.0f}% "
                         f"of {pack}, {100 * part['host_share'][ref]:.0f}% of {ref}")
    return lines


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--comfyui", required=True, help="upstream ComfyUI 0.33.0's folder")
    parser.add_argument("--tiny", action="store_true", help="tiny models on CPU (see the module doc)")
    parser.add_argument("--configs", default=",".join(ORDER), help=f"comma list of {', '.join(CONFIGS)}")
    parser.add_argument("--settings", default="turbo", help=f"comma list of {', '.join(SETTINGS)}")
    parser.add_argument("--cap-gib", type=float, default=24.0, help="the emulated card")
    parser.add_argument("--ram-gib", default="64", help="host RAM sizes, comma list: every configuration at the "
                        "first, then at the next...")
    parser.add_argument("--ram-cgroup", action="store_true",
                        help="also enforce the RAM size with a memory cgroup where this machine allows it")
    parser.add_argument("--pack-encoder", default="auto", choices=("auto", "QuantizedCLIPLoader", "CLIPLoader"),
                        help="the pack configurations' encoder loader (auto: QuantizedCLIPLoader where it loads "
                             "the encoder file's layer kinds)")
    parser.add_argument("--triton-cache", default="cold", choices=("cold", "run"),
                        help="Triton's kernel cache and the pack's tuning store: cold, empty ones per server (each "
                             "compiles and measures what it runs, as on a first run); run, one of each for the whole "
                             "run (a later server finds what an earlier one compiled and measured, as after a "
                             "restart)")
    parser.add_argument("--warm", action="store_true", help="keep the files in the page cache between configurations")
    parser.add_argument("--between-jobs", default="keep", choices=BETWEEN_JOBS,
                        help="before each server's second job: keep (nothing, as a user queues the next prompt) or "
                             "free (ComfyUI's 'Free model and node cache': the second job loads everything again)")
    parser.add_argument("--lora-second", action="store_true",
                        help=f"a fourth job: the second's with a second LoRA at strength {LORA_SECOND}")
    parser.add_argument("--lora-change", action="store_true",
                        help=f"a third job: the second's with the LoRA at strength {LORA_CHANGE}")
    parser.add_argument("--lora-qkv", default="side_by_side", choices=e2e_models.QKV_LAYOUTS,
                        help="the random turbo LoRA's fused qkv: q, k and v's LoRAs side by side (up block-diagonal, "
                             "as a LoRA made of the separate projections' is), or one dense rank-384 LoRA")
    parser.add_argument("--cpu", action="store_true", help="run ComfyUI with --cpu")
    parser.add_argument("--work", default=None, help="server folder and files (default: a temp dir)")
    parser.add_argument("--out", default=None, help="the JSON path (the .log goes beside it)")
    parser.add_argument("--out-dir", default=None,
                        help="folder for the default file name (default tests/bench/results)")
    parser.add_argument("--keep-files", action="store_true", help="keep the generated files (and reuse matching ones)")
    parser.add_argument("--budget-s", type=float, default=None,
                        help="start no configuration that would end past this many seconds")
    parser.add_argument("--prompt-timeout", type=float, default=560.0)
    opts = parser.parse_args(argv)
    opts.cpu = opts.cpu or opts.tiny
    opts.ram_cgroup = opts.ram_cgroup and not opts.tiny  # a CPU check never limits this machine's processes
    opts.configs = opts.configs.split(",")
    opts.settings = opts.settings.split(",")
    opts.ram_gib = [float(v) for v in opts.ram_gib.split(",")]
    unknown = [c for c in opts.configs if c not in CONFIGS] + [s for s in opts.settings if s not in SETTINGS]
    if unknown:
        parser.error(f"unknown: {', '.join(unknown)}")
    if not (Path(opts.comfyui) / "main.py").exists():
        parser.error(f"--comfyui {opts.comfyui} holds no main.py")
    opts.work = opts.work or tempfile.mkdtemp(prefix="bigdit-whole-job-")
    return opts


def main(argv=None):
    opts = parse_args(argv)
    job = Job(opts)
    print(f"whole-job: {job.payload['environment']}, configs {','.join(opts.configs)}, settings "
          f"{','.join(opts.settings)}, RAM {opts.ram_gib} GiB, work {opts.work}", flush=True)
    run_and_write(job, opts.keep_files)


if __name__ == "__main__":
    main()
