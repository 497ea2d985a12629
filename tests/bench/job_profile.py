"""Each stage of the whole MiniMax-H3 job beside its floor (issue 40, item 1), for tests/bench/whole_job.py.

A stage's floor is the largest of what it must at least spend on each resource, each a lower bound of the stage as
it ran:
- read: the bytes the server's processes read from the disk during the stage (/proc/<pid>/io read_bytes, sampled
  every 20 ms by whole_job's monitor) at the disk's measured bandwidth (`measure_disk`: a cold read of the largest
  file at the start of the call, by one reader and by four, the faster);
- compute: the stage's FLOPs at the GPU's dense tensor-core peak of its fastest precision (`PEAKS`: 8-bit on Hopper
  and Ada, INT8 on Ampere; from the vendors' data sheets, none on a CPU). The FLOPs are counted from upstream
  ComfyUI 0.33.0's own model classes (comfy/ldm/minimax/, comfy/text_encoders/): `dit_call_flops` per model call
  from the packed rows the call saw, `qwen_flops` for the encoder's language layers on the prompt's tokens,
  `video_decode_flops` over the video VAE's temporal chunks and spatial tiles as upstream plans them, and
  `audio_decode_flops` for the audio VAE's BigVGAN. 2 FLOPs per multiply-add; attention is QK^T and PV,
  4 * rows^2 * width, dense, as torch.utils.flop_counter counts it; norms, softmax, rotary and other elementwise
  work are not counted, nor the DiT's token refiner (once per sampling, on the prompt only: under 0.1% of a step);
- memory: the weights the stage's kernels must read from the card's memory at least once per pass (each model
  call, each VAE tile), at the card's measured copy bandwidth (`measure_device`), in the weights' stored width
  (the DiT's and the VAE decoder's block linears 8-bit, the encoder's language layers 4-bit).
The job's `floor_s` is the sum of its stages' floors (the stages one after another, as the host runs them);
`floor_overlapped_s` is what no implementation can beat: the files the job loads cold read once at the disk's
bandwidth, all its FLOPs at the peak, the weights moved to the card once at the measured host-to-device
bandwidth, whichever is largest.

    python tests/bench/job_profile.py RESULTS.json [--config NAME]   # prints each record's profile
"""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

GIB = 1024 ** 3

# MiniMaxH3Model's constructor defaults (comfy/ldm/minimax/model.py); a spec's kwargs override them
DIT_DEFAULTS = dict(hidden_size=5376, num_layers=50, token_refiner_num_layers=2, num_attention_heads=56,
                    attention_head_dim=128, ffn_hidden_size=14336, latents_dim=24, audio_latents_dim=32,
                    patch_size=(1, 2, 2), text_dim=5120, timestep_input_dim=256, time_embed_hidden_size=5376,
                    time_embed_dim=2688, adaln_curve_grid=None)
# Qwen3VL_32BConfig (comfy/text_encoders/llama.py): the 50 language layers H3 conditions on
QWEN3VL_32B = dict(hidden_size=5120, intermediate_size=25600, num_hidden_layers=50, num_attention_heads=64,
                   num_key_value_heads=8, head_dim=128)
# MiniMaxH3VideoVAE's decode plan and ViT3DDecoder's defaults (comfy/ldm/minimax/vae.py)
VIDEO_VAE = dict(clip_length=17, token_drop=3, tile_size=256, tile_overlap_min=64, ratio=16, ratio_t=4,
                 z_channels=24, out_channels=3, num_layers=36, heads=32, dim_head=64, registers=4)
# MiniMaxH3AudioVAE's and its BigVGAN's defaults (comfy/ldm/minimax/audio_vae.py)
AUDIO_VAE = dict(latent_channels=32, latent_dim=2048, decoder_dim=1024, upsample_rates=(5, 5, 2, 2, 2, 2, 2),
                 upsample_kernel_sizes=(9, 9, 4, 4, 4, 4, 4), resblock_kernel_sizes=(3, 7, 11),
                 resblock_dilations=((1, 3, 5), (1, 3, 5), (1, 3, 5)), filter_size=12)

# dense tensor-core peaks, TFLOP/s: bf16, and the fastest precision the GPU has (the floor's); HBM for reference
PEAKS = {  # name fragment (first match wins) -> (bf16, fastest, fastest's name)
    "H100 PCIe": (756.0, 1513.0, "fp8/int8"),
    "H100 NVL": (835.0, 1671.0, "fp8/int8"),
    "H100": (989.4, 1978.9, "fp8/int8"),  # SXM
    "H200 NVL": (835.0, 1671.0, "fp8/int8"),
    "H200": (989.4, 1978.9, "fp8/int8"),
    "GH200": (989.4, 1978.9, "fp8/int8"),
    "L40S": (362.1, 733.0, "fp8/int8"),
    "RTX 4090": (165.2, 660.6, "fp8 (fp16 accumulate)"),
    "A100": (312.0, 624.0, "int8"),
}
# the video VAE decoder's linears are INT8 in the template's file; the DiT's 8-bit in every configuration
DIT_WEIGHT_BYTES = 1.0
VAE_WEIGHT_BYTES = 1.0
ENCODER_WEIGHT_BYTES = 0.5  # NVFP4


# ---- FLOPs, from upstream's classes -----------------------------------------------------------------------------

def dit_config(kwargs: dict) -> dict:
    return {**DIT_DEFAULTS, **kwargs}


def dit_call_flops(config: dict, rows: dict, timesteps: int = 2) -> dict:
    """{"linear", "attention"} FLOPs of one MiniMaxH3Model call on packed `rows` ({kind: rows} as PackedLayout's
    segments: text, audio, video, cond...), the context already refined to the hidden width (as sampling passes
    it). `timesteps`: the distinct timesteps of the call (the AdaLN projections run once per each)."""
    c = config
    d, inner, ffn = c["hidden_size"], c["num_attention_heads"] * c["attention_head_dim"], c["ffn_hidden_size"]
    s = sum(rows.values())
    video = sum(n for kind, n in rows.items() if kind in ("video", "cond", "ref_img"))
    audio = sum(n for kind, n in rows.items() if kind in ("audio", "cond_audio", "ref_audio"))
    video_dim = c["latents_dim"] * math.prod(c["patch_size"])
    block = d * 3 * inner + inner * d + d * 2 * ffn + ffn * d  # qkv, out, fc1 (SwiGLU's two halves), fc2
    linear = 2 * c["num_layers"] * s * block
    linear += 2 * (video * video_dim * d + audio * c["audio_latents_dim"] * d)  # patch projections, all rows
    linear += 2 * (rows.get("video", 0) * d * video_dim + rows.get("audio", 0) * d * c["audio_latents_dim"])  # heads
    t_dim = c["time_embed_dim"]
    linear += 2 * timesteps * t_dim * d * (6 * 3 * c["num_layers"] + 2)  # AdaLN projections: blocks, final layer
    if c["adaln_curve_grid"] is None:  # the full time embedder (curve-form files replace it by a table)
        linear += 2 * timesteps * c["time_embed_hidden_size"] * (c["timestep_input_dim"] + t_dim)
    return {"linear": linear, "attention": 4 * c["num_layers"] * s * s * inner}


def dit_weight_bytes(config: dict, width: float = DIT_WEIGHT_BYTES) -> float:
    """The block linears' bytes (what every call reads at least once), at `width` bytes a weight."""
    c = config
    d, inner, ffn = c["hidden_size"], c["num_attention_heads"] * c["attention_head_dim"], c["ffn_hidden_size"]
    return c["num_layers"] * (d * 3 * inner + inner * d + d * 2 * ffn + ffn * d) * width


def qwen_flops(config: dict, tokens: int) -> dict:
    """{"linear", "attention"} FLOPs of the language layers on `tokens` (the vision tower does not run for text)."""
    c = config
    d, q = c["hidden_size"], c["num_attention_heads"] * c["head_dim"]
    kv = c["num_key_value_heads"] * c["head_dim"]
    layer = d * q + 2 * d * kv + q * d + 3 * d * c["intermediate_size"]  # q, k, v, o; gate, up, down
    return {"linear": 2 * c["num_hidden_layers"] * tokens * layer,
            "attention": 4 * c["num_hidden_layers"] * tokens * tokens * q}


def qwen_weight_bytes(config: dict, width: float = ENCODER_WEIGHT_BYTES) -> float:
    c = config
    d, q = c["hidden_size"], c["num_attention_heads"] * c["head_dim"]
    kv = c["num_key_value_heads"] * c["head_dim"]
    return c["num_hidden_layers"] * (d * q + 2 * d * kv + q * d + 3 * d * c["intermediate_size"]) * width


def split_tiles(size: int, tile: int, overlap_min: int, ratio: int) -> list[tuple[int, int]]:
    """(start, length) in pixels of MiniMaxH3VideoVAE.split_tiles."""
    if tile >= size:
        return [(0, size)]
    n = math.ceil(size / tile)
    while True:
        overlaps = [overlap_min] * (n - 1)
        remaining = tile * n - sum(overlaps) - size
        if remaining >= 0:
            break
        n += 1
    for i in range(remaining // ratio):
        overlaps[i % (n - 1)] += ratio
    starts = [0]
    for overlap in overlaps:
        starts.append(starts[-1] + tile - overlap)
    return [(start, tile) for start in starts]


def video_decode_passes(latent_shape, vae: dict = VIDEO_VAE) -> list[int]:
    """The latent positions (frames x rows x columns) of each decoder pass of MiniMaxH3VideoVAE.decode on a
    [B, C, T, H, W] latent: its temporal chunks (17-frame clips, with their overlap) times its 256-pixel tiles."""
    _, _, t, h, w = latent_shape
    r = vae["ratio"]
    chunk = math.ceil(vae["clip_length"] / vae["ratio_t"])
    overlap = (-vae["token_drop"]) % chunk
    if t == 1:
        lengths = [1]
    else:
        total = t + vae["token_drop"]
        pad = (-total) % chunk
        chunks = (total + pad) // chunk - int(vae["token_drop"] > 0)
        if chunks < 1:
            pad, chunks = pad + chunk, chunks + 1
        padded = t + pad
        lengths = [max(0, min(i * chunk + chunk + overlap, padded) - min(i * chunk, padded)) for i in range(chunks)]

    def extents(latent):
        return [min(latent, (start + size) // r) - start // r
                for start, size in split_tiles(latent * r, vae["tile_size"], vae["tile_overlap_min"], r)]
    return [frames * rows * cols for frames in lengths for rows in extents(h) for cols in extents(w)]


def video_decode_flops(latent_shape, vae: dict = VIDEO_VAE) -> dict:
    """{"linear", "attention", "passes"} of the video VAE's decode: per pass the post-quant 1x1 convolution, the
    patch embedding, the ViT blocks over the positions and the register tokens, the output projection."""
    dim = vae["heads"] * vae["dim_head"]
    z, out = vae["z_channels"], vae["out_channels"] * vae["ratio_t"] * vae["ratio"] ** 2
    block = dim * 3 * dim + dim * dim + dim * 8 * dim + 4 * dim * dim  # to_qkv, to_out, w1 (gated, 2 x 4), w2
    linear = attention = 0
    passes = video_decode_passes(latent_shape, vae)
    for positions in passes:
        tokens = positions + vae["registers"] + 1
        linear += 2 * (positions * z * z + positions * z * dim + vae["num_layers"] * tokens * block + tokens * dim * out)
        attention += 4 * vae["num_layers"] * tokens * tokens * dim
    batch = latent_shape[0]
    return {"linear": batch * linear, "attention": batch * attention, "passes": len(passes)}


def video_decoder_weight_bytes(vae: dict = VIDEO_VAE, width: float = VAE_WEIGHT_BYTES) -> float:
    dim = vae["heads"] * vae["dim_head"]
    return vae["num_layers"] * (dim * 3 * dim + dim * dim + dim * 8 * dim + 4 * dim * dim) * width


def audio_decode_flops(latent_shape, vae: dict = AUDIO_VAE) -> dict:
    """{"linear"} FLOPs (convolutions) of MiniMaxH3AudioVAE.decode on a [B, C, stereo, T] latent: the input
    projection, BigVGAN's convolutions, transposed convolutions and its anti-aliasing filters (per channel)."""
    b, _, stereo, length = latent_shape
    batch, k = b * stereo, vae["filter_size"]

    def activation(channels, n):  # Activation1d: x2 up (transposed, on the 5-padded input), x2 down
        return 2 * channels * k * (n + 2 * (k // 2 - 1)) + 2 * channels * k * n
    flops = 2 * vae["latent_channels"] * vae["latent_dim"] * length
    flops += 2 * vae["latent_dim"] * vae["decoder_dim"] * 7 * length  # conv_pre
    channels, n = vae["decoder_dim"], length
    for i, (rate, kernel) in enumerate(zip(vae["upsample_rates"], vae["upsample_kernel_sizes"])):
        out = vae["decoder_dim"] // 2 ** (i + 1)
        flops += 2 * channels * out * kernel * n  # transposed: each input position meets the whole kernel
        channels, n = out, n * rate
        for kernel_size, dilations in zip(vae["resblock_kernel_sizes"], vae["resblock_dilations"]):
            flops += len(dilations) * 2 * (activation(channels, n) + 2 * channels * channels * kernel_size * n)
    flops += activation(channels, n) + 2 * channels * 7 * n  # activation_post, conv_post
    return {"linear": batch * flops, "attention": 0}


def total(flops: dict) -> float:
    return flops["linear"] + flops["attention"]


# ---- the machine ---------------------------------------------------------------------------------------------

def own_read_bytes() -> int | None:
    try:
        with open("/proc/self/io") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("read_bytes:"))
    except (OSError, StopIteration):
        return None


def _read(fd: int, start: int, size: int, chunk: int) -> int:
    buffer, done = bytearray(chunk), 0
    while done < size:
        n = os.preadv(fd, [memoryview(buffer)[:min(chunk, size - done)]], start + done)
        if n <= 0:
            break
        done += n
    return done


def measure_disk(path, limit: int = 4 * GIB, chunk: int = 16 * 1024 ** 2, readers: tuple = (1, 4, 8, 16)) -> dict:
    """The disk's read bandwidth, cold: every dirty page written out (sync) and `path`'s pages dropped from the page
    cache (POSIX_FADV_DONTNEED), then its first `limit` bytes read in 16 MiB reads, in as many equal parts as
    `readers` has counts, part i by readers[i] threads at once (a disk may serve several readers faster than one:
    the read-ahead's stripes); `gib_s` is the fastest. `cold` says whether the disk delivered what was read (the
    kernel's count of this process's bytes read from storage); the pages are dropped again after."""
    path = Path(path)
    size = min(path.stat().st_size, limit)
    part = size // len(readers)
    os.sync()
    fd = os.open(path, os.O_RDONLY)
    speeds, done = {}, 0
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        os.posix_fadvise(fd, 0, size, os.POSIX_FADV_SEQUENTIAL)
        before = own_read_bytes()
        t0 = time.perf_counter()
        for i, count in enumerate(readers):
            start = i * part
            length = size - start if i == len(readers) - 1 else part
            piece = -(-length // count)
            t1 = time.perf_counter()
            with ThreadPoolExecutor(count) as pool:
                read = sum(pool.map(lambda j: _read(fd, start + j * piece, max(0, min(piece, length - j * piece)),
                                                    chunk), range(count)))
            t2 = time.perf_counter()
            done += read
            speeds[f"{count}_readers_gib_s"] = read / GIB / (t2 - t1) if t2 > t1 else None
        after = own_read_bytes()
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)
    from_disk = after - before if before is not None and after is not None else None
    return {"file": path.name, "bytes": done, "seconds": time.perf_counter() - t0,
            "gib_s": max((v for v in speeds.values() if v), default=None),
            "one_reader_gib_s": speeds.get("1_readers_gib_s"), **speeds,
            "bytes_from_disk": from_disk, "cold": from_disk is not None and from_disk >= 0.9 * done,
            "how": "sync, posix_fadvise DONTNEED, then 16 MiB reads: equal parts by " +
                   ", ".join(str(n) for n in readers) + " threads"}


_DEVICE_CODE = r"""
import json, time, torch
if not torch.cuda.is_available():
    print(json.dumps({"error": "no CUDA device"})); raise SystemExit
n = 1 << 30
src, dst = torch.empty(n, dtype=torch.uint8, device="cuda"), torch.empty(n, dtype=torch.uint8, device="cuda")
host = torch.empty(n, dtype=torch.uint8, pin_memory=True)
def timed(fn, repeat):
    fn(); torch.cuda.synchronize(); t0 = time.perf_counter()
    for _ in range(repeat): fn()
    torch.cuda.synchronize(); return (time.perf_counter() - t0) / repeat
copy = timed(lambda: dst.copy_(src), 20)
h2d = timed(lambda: dst.copy_(host, non_blocking=True), 5)
print(json.dumps({"gpu": torch.cuda.get_device_name(), "hbm_gib_s": 2 * n / copy / 2**30, "h2d_gib_s": n / h2d / 2**30,
                  "how": "1 GiB device-to-device copy (read + write), 1 GiB pinned host-to-device copy"}))
"""


def measure_device(python: str = sys.executable) -> dict:
    """The card's copy bandwidth and the pinned host-to-device bandwidth, in a process of its own (it holds the
    device only while it runs), and the dense peaks of PEAKS for its name."""
    try:
        run = subprocess.run([python, "-c", _DEVICE_CODE], capture_output=True, text=True, timeout=120)
        found = json.loads(run.stdout.strip().splitlines()[-1]) if run.returncode == 0 and run.stdout.strip() else \
            {"error": (run.stderr or run.stdout)[-500:]}
    except (OSError, subprocess.TimeoutExpired, ValueError) as e:
        found = {"error": f"{type(e).__name__}: {e}"[:500]}
    if "gpu" in found:
        found.update(peaks(found["gpu"]))
    return found


def peaks(gpu: str) -> dict:
    for fragment, (bf16, fastest, precision) in PEAKS.items():
        if fragment in gpu:
            return {"peak_tflops": fastest, "peak_precision": precision, "peak_bf16_tflops": bf16,
                    "peak_source": f"data sheet, dense ({fragment})"}
    return {"peak_tflops": None, "peak_source": f"no peak known for {gpu!r}"}


# ---- a record's profile ----------------------------------------------------------------------------------------

def stage_profile(seconds: float, bytes_read: int, flops: dict | None, weight_bytes_moved: float, machine: dict,
                  counted: dict | None = None) -> dict:
    """One stage: its time, and beside it each resource's lower bound and the largest (`floor_s`, `floor_kind`);
    `counted`: what its FLOPs were counted from (rows, calls, tokens, VAE passes)."""
    disk = (machine.get("disk") or {}).get("gib_s")
    device = machine.get("device") or {}
    peak, hbm = device.get("peak_tflops"), device.get("hbm_gib_s")
    work = total(flops) if flops else 0
    bounds = {"read": bytes_read / GIB / disk if disk and bytes_read else 0.0,
              "compute": work / (peak * 1e12) if peak and work else 0.0,
              "memory": weight_bytes_moved / GIB / hbm if hbm and weight_bytes_moved else 0.0}
    kind = max(bounds, key=bounds.get)
    out = {"seconds": seconds, "floor_s": bounds[kind], "floor_kind": kind if bounds[kind] > 0 else None,
           "bytes_read": bytes_read, "read_s": bounds["read"], "flops": work, "compute_s": bounds["compute"],
           "weight_bytes_moved": weight_bytes_moved, "memory_s": bounds["memory"]}
    if flops:
        out["flops_by_kind"] = {k: v for k, v in flops.items() if k in ("linear", "attention")}
    if counted:
        out["counted"] = counted
    if not peak and work:
        out["compute_s"] = None  # no peak to set the FLOPs against (a CPU, an unknown GPU)
    return out


def job_profile(stages: dict, must_read_bytes: int, to_device_bytes: float, machine: dict) -> dict:
    """{stage: stage_profile} with the job's floors (see the module's docstring)."""
    disk = (machine.get("disk") or {}).get("gib_s")
    h2d = (machine.get("device") or {}).get("h2d_gib_s")
    seconds = sum(s["seconds"] for s in stages.values())
    floor = sum(s["floor_s"] for s in stages.values())
    bounds = {"read": must_read_bytes / GIB / disk if disk else 0.0,
              "compute": sum(s["compute_s"] or 0.0 for s in stages.values()),
              "host_to_device": to_device_bytes / GIB / h2d if h2d else 0.0,
              "memory": sum(s["memory_s"] for s in stages.values())}
    kind = max(bounds, key=bounds.get)
    return {"stages": stages, "seconds": seconds, "floor_s": floor,
            "over_floor": seconds / floor if floor else None,
            "must_read_bytes": must_read_bytes, "to_device_bytes": to_device_bytes,
            "floor_overlapped_s": bounds[kind], "floor_overlapped_kind": kind, "bounds_overlapped_s": bounds}


def flop_text(flops: float) -> str:
    return f"{flops / 1e12:8.1f} TFLOP" if flops >= 1e11 else f"{flops / 1e9:8.2f} GFLOP"


def profile_lines(rec: dict) -> list[str]:
    profile = rec.get("profile")
    if not profile:
        return []
    over = f" ({profile['over_floor']:.1f}x)" if profile["over_floor"] else ""
    lines = [f"  profile {rec['setting']} {rec['ram_gib']:g}G {rec['config']} job {rec['job']}: "
             f"{profile['seconds']:.1f} s, floor {profile['floor_s']:.1f} s{over} stage by stage, "
             f"{profile['floor_overlapped_s']:.1f} s overlapped ({profile['floor_overlapped_kind']})"]
    for name, stage in profile["stages"].items():
        if stage["seconds"] < 0.05 and not stage["floor_s"]:
            continue
        compute = "no peak" if stage["compute_s"] is None else f"{stage['compute_s']:.2f} s"
        lines.append(f"    {name:<11}{stage['seconds']:7.1f} s  floor {stage['floor_s']:6.2f} s "
                     f"{stage['floor_kind'] or '-':<8} read {stage['bytes_read'] / GIB:6.2f} GiB "
                     f"({stage['read_s']:.2f} s), {flop_text(stage['flops'])} ({compute}), "
                     f"weights moved {stage['weight_bytes_moved'] / GIB:7.1f} GiB ({stage['memory_s']:.2f} s)")
    return lines


def main(argv=None):
    import argparse
    parser = argparse.ArgumentParser(description="print the stage profiles of a whole-job JSON")
    parser.add_argument("json")
    parser.add_argument("--config", default=None)
    opts = parser.parse_args(argv)
    data = json.loads(Path(opts.json).read_text())
    machine = data.get("machine", {})
    disk, device = machine.get("disk") or {}, machine.get("device") or {}
    print(f"disk {disk.get('gib_s') or 0:.2f} GiB/s ({disk.get('bytes', 0) / GIB:.1f} GiB of {disk.get('file')}, "
          f"cold {disk.get('cold')}); {device.get('gpu', device.get('error'))}: peak {device.get('peak_tflops')} "
          f"TFLOP/s, copy {device.get('hbm_gib_s') or 0:.0f} GiB/s, host-to-device {device.get('h2d_gib_s') or 0:.1f} GiB/s")
    for rec in data["results"]:
        if opts.config in (None, rec["config"]):
            for line in profile_lines(rec):
                print(line)


if __name__ == "__main__":
    main()
