"""The whole MiniMax-H3 text-to-video job in a real upstream ComfyUI 0.33.0, per configuration (issue 32, part 1).

The pack's other speed figures are one sampler step on random weights. This runs what a user runs: Comfy-Org's
MiniMax-H3 t2v template, from POST /prompt to the saved video file, as upstream's own front end queues it
(tests/bench/job_prompts/, made by make_job_prompts.py from the template and from the pack's version of it,
example_workflows/bigdit-minimax-h3-t2v), at its defaults: 864x480 (the Resolution Selector's 0.4 MP at 16:9),
5 s (124 frames), its prompt and seed. Settings: `turbo` (its turbo_mode on: 8 steps with the 8-step turbo LoRA)
and `default` (20 steps, no LoRA).

The files are full-size random weights under the template's names, in the published files' layouts
(e2e_models): the pruned DiT as its INT8 ConvRot marker file, the Qwen3-VL-32B encoder as NVFP4 with AWQ scales
and INT8 token embeddings (15,687,142,551 bytes, as published), the video VAE with its INT8 ConvRot decoder, the
fp32 audio VAE and the 8-step turbo LoRA (rank 128, 384 on the fused qkv: 1.82 GiB, as published). Each is
generated once, on the GPU, straight to disk.

Configurations (CONFIGS: the prompt and a small table of node changes), each on a fresh server started through
vram_cap.py on an emulated 24 GiB card and an emulated host RAM (--ram-gib, default 64: ComfyUI's RAM decisions
see that size; with --ram-cgroup the server also runs in a memory cgroup of that size where this machine lets
us make one, and the JSON says which was done), with ComfyUI's default cache:
- template: the template as shipped;
- template_sage: the same, the server started with --use-sage-attention;
- pack: the pack's version (LoadH3Quantized, QuantizedCLIPLoader, SetAttentionBackend auto), as shipped;
- pack_fast: the pack's fastest: MixedCheckpointLoader on the INT8 file (its `int8` input, where /object_info
  lists it), QuantizedCLIPLoader, SetAttentionBackend sage.
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
VAELoaders, VAEDecode, VAEDecodeAudio), save (CreateVideo, SaveVideo), graph (the template's small nodes:
resolution, math, switches, scheduler, noise) and capture (the benchmark's own nodes after sampling). The final
latent is captured without changing what runs: LTXVSeparateAVLatent and SaveLatent on the sampler's output, and
BigditRunReport; its cosine against `template`'s (and `template_sage`'s) at the same setting is `latent`.
Memory: the device's used memory (NVML, polled every 20 ms) and the server's process tree (psutil: RSS, and
anonymous + shared pages, which a machine could not reclaim), peaks over the job and per stage, set against
hosts of 64 and 32 GiB (`ram_budgets`); the cgroup's peak and OOM kills where there is one. The video file is
opened with PyAV (frames, streams) and deleted.

The JSON (tests/bench/results/whole-job-<gpu>-comfyui-<version>-<date>.json, or --out/--out-dir) is rewritten
after every configuration; `summary` holds, per setting, each pack configuration against template_sage and
template (the whole job and each stage: reference seconds / pack seconds) and each configuration's share of the
job in host code (encoder and VAE decode), printed at the end. --budget-s starts no configuration that would end
past it, by the longest one so far at that setting (before the first: PRIOR_S), counting from $E2E_STARTED
(epoch seconds) where it is set.

    python tests/bench/whole_job.py --comfyui COMFYUI_0.33.0 [--settings turbo] [--configs ...] [--budget-s 520]
    python tests/bench/whole_job.py --tiny --comfyui COMFYUI_0.33.0 --configs template,pack_fast --out OUT.json

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
import datetime
import json
import os
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
from _pack import RESULTS  # noqa: E402
from comfy_e2e import (BenchServer, compare, gpu_name, gpu_slug, log_lines, package_version, run_and_write,  # noqa: E402
                       unoffered_choice)
from comfy_harness import PromptError, _validation_message, comfyui_version  # noqa: E402

GIB = 1024 ** 3
PROMPTS = BENCH_DIR / "job_prompts"
SETTINGS = ("turbo", "default")


@dataclass(frozen=True)
class Config:
    """A configuration: job_prompts/<prompt>_<setting>.json with `nodes` changed, on a server with `comfy_args`.
    `nodes`: {class_type: {input: value}} sets inputs of every node of that class; {class_type: (new class_type,
    {input: value})} replaces the node, keeping its links and the inputs the new class has too. An input the
    server's /object_info does not list for the class is left out, and the record says so."""
    name: str
    prompt: str
    nodes: dict = field(default_factory=dict)
    comfy_args: tuple = ()


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
# the most important comparison first: a call's budget drops the last ones
ORDER = ("template_sage", "pack_fast", "template", "pack")
REFERENCES = ("template_sage", "template")
PACK_CONFIGS = ("pack_fast", "pack")
# the longest a configuration is assumed to take (server start to stop) before one has run, by setting
PRIOR_S = {"turbo": 150.0, "default": 220.0, "tiny": 60.0}

STAGES = ("queue", "encoder", "model_load", "sampling", "vae_decode", "save", "graph", "capture")
STAGE_OF = {
    **dict.fromkeys(("CLIPLoader", "QuantizedCLIPLoader", "MiniMaxH3ImageToVideo", "BigditRandomConditioning",
                     "EmptyMiniMaxH3LatentAV"), "encoder"),
    **dict.fromkeys(("UNETLoader", "LoadH3Quantized", "MixedCheckpointLoader", "LoraLoaderModelOnly",
                     "SetAttentionBackend", "BigditStepTimer"), "model_load"),
    "SamplerCustomAdvanced": "sampling",  # until its first model call: model_load
    **dict.fromkeys(("VAELoader", "BigditTinyVAELoader", "VAEDecode", "VAEDecodeAudio"), "vae_decode"),
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


def job_graph(config: Config, setting: str, object_info: dict, encoder: str, tiny_text_dim: int | None):
    """(graph, inputs left out) of one configuration and setting."""
    graph = copy.deepcopy(load_prompt(config.prompt, setting))
    changes = dict(config.nodes)
    if encoder == "CLIPLoader":
        changes["QuantizedCLIPLoader"] = ("CLIPLoader", {"device": "default"})
    left_out = apply_nodes(graph, changes, object_info)
    instrument(graph, f"{config.name}_{setting}")
    if tiny_text_dim:
        tinier(graph, tiny_text_dim)
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


class Monitor(threading.Thread):
    """Polls the device's used memory (NVML, every `interval` s) and the server's process tree (every 5th poll)."""

    def __init__(self, pid: int, interval: float = 0.02):
        super().__init__(daemon=True)
        self.pid, self.interval = pid, interval
        self.samples: list[tuple[float, int | None, int | None, int | None]] = []
        self.stop_event = threading.Event()
        self.nvml_error = None

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

    def run(self):
        used = self._nvml()
        count, rss, anon = 0, None, None
        while not self.stop_event.is_set():
            if count % 5 == 0:
                try:
                    procs = _tree(self.pid)
                    rss = sum(p.memory_info().rss for p in procs)
                    anon = unreclaimable(p.pid for p in procs)
                except Exception:  # the server is gone
                    rss = anon = None
            self.samples.append((time.time(), used() if used else None, rss, anon))
            count += 1
            self.stop_event.wait(self.interval)

    def stop(self):
        self.stop_event.set()
        self.join()


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


def peaks_by_stage(segs, samples, column: int) -> dict:
    """The largest sample of `column` (1: device, 2: RSS, 3: unreclaimable) in each stage, GiB."""
    starts = [s[0] for s in segs]
    peaks = {}
    for sample in samples:
        value, index = sample[column], bisect.bisect_right(starts, sample[0]) - 1
        if value is None or index < 0 or sample[0] > segs[index][1]:
            continue
        stage = segs[index][2]
        peaks[stage] = max(peaks.get(stage, 0), value / GIB)
    return peaks


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
        self.latents = {}  # (setting, ram_gib, config) -> (video, audio)
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
            "files": {}, "results": [], "summary": {},
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
        for rec in self.payload["results"]:
            key = (rec["setting"], rec["ram_gib"])
            mine = self.latents.get((*key, rec["config"]))
            for ref in REFERENCES:
                theirs = self.latents.get((*key, ref))
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
        wanted = {"tiny": opts.tiny, "files": {role: str(p) for role, p in paths.items()}}
        if stamp.exists() and all(p.exists() for p in paths.values()) and \
                json.loads(stamp.read_text()).get("wanted") == wanted:
            info = {**json.loads(stamp.read_text())["info"], "reused": True}
        else:
            stamp.unlink(missing_ok=True)
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
                                                      e2e_models.TURBO_LORA_RANK)
                else:
                    made = e2e_models.generate_component(comps[role], path, opts.comfyui, cpu=opts.cpu)
                made.update(file=path.name, published_gib=None if opts.tiny else PUBLISHED_GIB[role],
                            gib=path.stat().st_size / GIB)
                info[role] = made
                print(f"[{self.elapsed():4.0f} s] {role} {path.name}: {made['gib']:.2f} GiB"
                      + (f" (published {made['published_gib']:.2f})" if made["published_gib"] else "")
                      + f", written in {made['seconds']:.1f} s on {made['device']}", flush=True)
            stamp.write_text(json.dumps({"wanted": wanted, "info": info}))
        if self.needs_encoder_check():
            e2e_models.generate_component(e2e_models.COMPONENTS["encoder_probe"], self.base / "models" /
                                          "text_encoders" / "bigdit_encoder_probe.safetensors", opts.comfyui,
                                          cpu=opts.cpu)
        info["disk_free_gib_after"] = disk_free_gib(self.work)
        self.payload["files"] = info
        self.paths = paths
        return info

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

    # -- one configuration --
    def run_one(self, config: Config, setting: str, ram_gib: float) -> dict:
        opts = self.opts
        rec = {"config": config.name, "setting": setting, "ram_gib": ram_gib, "cap_gib": opts.cap_gib,
               "prompt": config.prompt, "nodes": {k: list(v) if isinstance(v, tuple) else v
                                                  for k, v in config.nodes.items()},
               "comfy_args": list(config.comfy_args), "status": None}
        done = [r["duration_s"] for r in self.payload["results"] if r.get("duration_s")]
        same = [r["duration_s"] for r in self.payload["results"] if r.get("duration_s") and r["setting"] == setting]
        estimate = max(same or done or [PRIOR_S["tiny" if opts.tiny else setting]])
        if opts.budget_s and self.elapsed() + estimate > opts.budget_s:
            return {**rec, "status": "skipped", "error": f"time budget ({opts.budget_s:.0f} s) would be exceeded "
                                                         f"(this one estimated at {estimate:.0f} s)"}
        limit, why = (MemoryLimit.make(int(ram_gib * GIB), f"bigdit-job-{os.getpid()}-{len(done)}")
                      if opts.ram_cgroup else (None, "not asked (--ram-cgroup)"))
        rec["ram"] = {"comfyui_sees_gib": ram_gib, "enforced": limit is not None, "how": limit.how if limit else why}
        rec["disk_free_gib"] = disk_free_gib(self.work)
        if not opts.warm:
            t_evict = time.monotonic()
            evict_page_cache(self.paths.values())
            rec["page_cache_evict_s"] = time.monotonic() - t_evict
        t0 = time.monotonic()
        run_log = self.work / "logs" / f"{setting}_{ram_gib:g}g_{config.name}.log"
        run_log.unlink(missing_ok=True)
        server = None
        try:
            server = BenchServer(self.base, opts.comfyui, run_log, None if opts.cpu else opts.cap_gib, cpu=opts.cpu,
                                 extra_args=config.comfy_args, ram_gib=ram_gib, cache_none=False,
                                 launcher=limit.launcher if limit else (),
                                 preexec_fn=limit.preexec_fn if limit else None, env={"BIGDIT_BENCH_PROFILE": "0"})
            rec["server_start_s"] = time.monotonic() - t0
            object_info = server.object_info()
            encoder = "QuantizedCLIPLoader"
            if config.prompt == "pack":
                if self.needs_encoder_check():
                    self.check_encoder(server)
                    rec["encoder_check_before_the_job"] = True
                if not opts.tiny:  # --tiny has no encoder to load
                    encoder = rec["encoder_loader"] = self.pack_encoder()
            graph, rec["left_out"] = job_graph(config, setting, object_info, encoder,
                                               e2e_models.TINY_H3.text_dim if opts.tiny else None)
            why = unoffered_choice(graph, object_info)
            if why:
                rec.update(status="skipped", error=why)
                return rec
            rec.update(self.run_job(server, graph, (setting, ram_gib, config.name)))
            rec["status"] = "ok"
            if self.needs_encoder_check():
                self.check_encoder(server)
        except PromptError as e:
            rec.update(status="error", error=self.here(e.message[:3000]), failed_node=e.node_type,
                       traceback=self.here(e.traceback[-3000:]))
        except Exception as e:  # the server died (an OOM kill?) or hung: record it, go on with the next one
            rec.update(status="error", error=self.here(f"{type(e).__name__}: {e}"[-3000:]))
        finally:
            if limit is not None:
                rec["ram"].update(limit.stats())
            if server is not None:
                rec["host_rss_hwm_gib"] = server_hwm(server.pid)
                server.stop()
            if limit is not None:
                limit.remove()
            rec["duration_s"] = time.monotonic() - t0
            text = run_log.read_text(errors="replace") if run_log.exists() else ""
            rec["log_lines"] = log_lines(text, self.work)
            self.log(f"{setting} {ram_gib:g} GiB {config.name}", text)
        return rec

    def run_job(self, server, graph: dict, key) -> dict:
        """POST the prompt, follow it to the end; the record's measurements."""
        events = EventStream(server.url, uuid.uuid4().hex)
        events.start()
        if not events.connected.wait(30) or events.error:
            raise RuntimeError(f"no websocket to follow the job: {events.error or 'no connection in 30 s'}")
        monitor = Monitor(server.pid)
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
        out = {"wall_s": wall, "stages": stages, "stage_sum_s": sum(stages.values()),
               "host_share": sum(stages[s] for s in HOST_STAGES) / wall,
               "nodes": [{"node": n, "class_type": graph.get(n, {}).get("class_type"), "stage": st, "seconds": e - s}
                         for s, e, st, n in segs if n is not None],
               "sampling": sampling_detail(report), "video": probe_video(video),
               "latent_shape": report.get("latent_shape"),
               "reports": {n: "\n".join(o["text"])[:4000] for n, o in entry["outputs"].items()
                           if o.get("text") and not n.startswith("bench_")}}
        video.unlink()
        samples = monitor.samples
        device = [s[1] for s in samples if s[1] is not None]
        out.update(device_used_peak_gib=max(device) / GIB if device else None,
                   device_used_peak_by_stage_gib=peaks_by_stage(segs, samples, 1),
                   host_rss_peak_gib=max((s[2] for s in samples if s[2]), default=0) / GIB,
                   host_rss_peak_by_stage_gib=peaks_by_stage(segs, samples, 2),
                   host_unreclaimable_peak_gib=max((s[3] for s in samples if s[3]), default=0) / GIB,
                   samples=len(samples))
        # a machine of each size holds the job if what it cannot reclaim fits; the file pages it can drop and reread
        out["ram_budgets"] = {f"{gib}g": {"unreclaimable_fits": out["host_unreclaimable_peak_gib"] <= gib,
                                          "rss_fits": out["host_rss_peak_gib"] <= gib} for gib in RAM_BUDGETS_GIB}
        if monitor.nvml_error:
            out["device_used_error"] = monitor.nvml_error
        return out

    def record(self, rec):
        self.payload["results"].append(rec)
        self.write()
        print(f"[{self.elapsed():4.0f} s] {result_line(rec)}", flush=True)

    def run(self):
        self.make_files()
        self.write()
        for ram_gib in self.opts.ram_gib:
            for setting in self.opts.settings:
                for name in self.opts.configs:
                    self.record(self.run_one(CONFIGS[name], setting, ram_gib))
        self.write()
        print(f"wrote {self.out}", flush=True)
        for line in summary_lines(self.payload["summary"]):
            print(line, flush=True)


def server_hwm(pid: int) -> float | None:
    """The server process's peak resident set (VmHWM), GiB, read before it stops."""
    try:
        with open(f"/proc/{pid}/status") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:")) / GIB
    except (OSError, StopIteration):
        return None


def result_line(rec) -> str:
    head = f"{rec['setting']:>7} {rec['ram_gib']:g}G {rec['config']:<14}"
    if rec["status"] != "ok":
        return f"{head} {rec['status'].upper()}: {(rec.get('error') or '').splitlines()[0][:300]}"
    stages = ", ".join(f"{s} {rec['stages'][s]:.1f}" for s in STAGES if rec["stages"][s] >= 0.05)
    parts = [f"{rec['wall_s']:.1f} s ({stages})", f"host code {100 * rec['host_share']:.0f}%"]
    if rec["sampling"].get("step_s"):
        parts.append(f"{rec['sampling']['step_s']:.2f} s/step")
    if rec.get("device_used_peak_gib") is not None:
        parts.append(f"device {rec['device_used_peak_gib']:.1f} GiB")
    parts.append(f"RSS {rec['host_rss_peak_gib']:.1f} GiB (unreclaimable {rec['host_unreclaimable_peak_gib']:.1f})")
    for ref, streams in rec.get("latent", {}).items():
        parts.append(f"cos {streams['video']['cosine']:.4f} {ref}")
    if rec.get("encoder_loader") == "CLIPLoader":
        parts.append("encoder by CLIPLoader")
    return f"{head} " + ", ".join(parts)


def summarize(results) -> dict:
    """Per setting and RAM size: each pack configuration against each reference (reference seconds / pack
    seconds, whole job and per stage), and every configuration's share of host code."""
    summary = {}
    ok = [r for r in results if r["status"] == "ok"]
    for setting, ram_gib in dict.fromkeys((r["setting"], r["ram_gib"]) for r in ok):
        at = {r["config"]: r for r in ok if r["setting"] == setting and r["ram_gib"] == ram_gib}
        ratios = {}
        for pack in (p for p in PACK_CONFIGS if p in at):
            for ref in (r for r in REFERENCES if r in at):
                a, b = at[ref], at[pack]
                ratios[f"{pack}_vs_{ref}"] = {
                    "whole": a["wall_s"] / b["wall_s"],
                    "stages": {s: a["stages"][s] / b["stages"][s] for s in STAGES
                               if a["stages"][s] > 0.05 and b["stages"][s] > 0.05}}
        summary[f"{setting}_{ram_gib:g}g"] = {
            "speedup": ratios, "host_share": {name: r["host_share"] for name, r in at.items()},
            "wall_s": {name: r["wall_s"] for name, r in at.items()}}
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
    parser.add_argument("--warm", action="store_true", help="keep the files in the page cache between configurations")
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
