"""The MiniMax-H3 video VAE's decode at the template's size, on a GPU under upstream ComfyUI 0.33.0's dynamic VRAM:
the host's decode against SetVAEKernels' (host/vae.py) part by part, and where each one's time goes.

The files are the template's, full size with random weights (tests/bench/e2e_models.py): the video VAE with its
INT8 ConvRot decoder (36 blocks of 32 heads of 64) and the fp32 audio VAE, written into --work if not there. One
process (upstream's folder as its working directory, dynamic VRAM on as upstream's main.py turns it on) decodes
the template's latents, 864x480 and 124 frames ([1, 24, 37, 30, 54]: 7 temporal chunks of 15 tiles) and its audio
([1, 32, 2, 207]):
- `host`: ComfyUI's decode (VAE.decode), after a first decode that pages the weights in;
- SetVAEKernels with each part on or left to the host (`attention/linears/weights/tiles`), each decoded twice
  (the first measures the kernels of each shape), the second timed; PSNR of its frames against the host's;
- the audio VAE's decode, twice, the second timed;
- with --profile, one temporal chunk ([1, 24, 7, 30, 54]) of the host's decode and of the configurations named
  there, under torch.profiler: the chunk's wall time, the GPU's busy time (the union of its kernels' intervals),
  the decoder passes, and the kernels by kind (GEMM, attention, copies, the rest) and the longest ones.
Timings: wall seconds between synchronizations. Writes JSON (--out, by default
tests/bench/results/vae-decode-<gpu>-<date>.json).

    python tests/bench/vae_decode.py --comfyui /path/to/comfyui-0.33.0 --work /disk/folder [--profile]
"""
import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

from _pack import PACK_ROOT, default_out, write_json

sys.path.insert(0, str(PACK_ROOT / "tests"))
from comfy_harness import DECODE_PROBE_HELPERS, DYNAMIC_VRAM_PRELUDE  # noqa: E402

import e2e_models  # noqa: E402

VIDEO_LATENT = [1, 24, 37, 30, 54]  # the template's 864x480, 124 frames
PROFILE_LATENT = [1, 24, 7, 30, 54]  # one temporal chunk of it
AUDIO_LATENT = [1, 32, 2, 207]
# attention / linears / weights / tiles, as SetVAEKernels' inputs
CONFIGS = ("auto/pack/resident/batched", "auto/pack/resident/host", "host/host/host/batched", "host/pack/resident/host")
PROFILED = ("auto/pack/resident/batched", "auto/pack/resident/host")

PROBE = DYNAMIC_VRAM_PRELUDE + DECODE_PROBE_HELPERS + r"""
import json, time
video_path, audio_path, args = sys.argv[2], sys.argv[3], json.loads(sys.argv[4])
import comfy.sd, comfy.utils
from bigdit.host.vae import set_vae_kernels
import logging
lines = []
class Keep(logging.Handler):
    def emit(self, record):
        lines.append(record.getMessage())
logging.getLogger("bigdit.host.vae").addHandler(Keep())
logging.getLogger("bigdit.host.vae").setLevel(logging.INFO)


def load(path):
    sd, metadata = comfy.utils.load_torch_file(path, return_metadata=True)
    return comfy.sd.VAE(sd=sd, metadata=metadata)


def kind(name):
    low = name.lower()
    if "memcpy" in low or "memset" in low:
        return "copy"
    if any(k in low for k in ("flash", "fmha", "attention", "attn", "cudnn")):
        return "attention"
    if any(k in low for k in ("gemm", "matmul", "_mm", "cutlass", "sm90_xmma", "int8_linear", "scaled_mm")):
        return "gemm"
    return "other"


def profiled(vae, decode, z):
    from torch.profiler import ProfilerActivity, profile, record_function
    model = vae.first_stage_model
    own = model._decode_pixels
    def pixels(tile):
        with record_function("decoder_pass"):
            return own(tile)
    model._decode_pixels = pixels
    try:
        decode(z)  # once unprofiled: the shapes of a chunk measured
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            start = time.perf_counter()
            decode(z)
            torch.cuda.synchronize()
            wall = time.perf_counter() - start
    finally:
        del model._decode_pixels
    spans, kernels, passes = [], {}, 0
    for e in prof.events():
        if e.name == "decoder_pass" and e.device_type.name == "CPU":
            passes += 1
        if e.device_type.name != "CUDA" or e.name == "decoder_pass":  # the pass's own GPU range is no kernel
            continue
        spans.append((e.time_range.start, e.time_range.end))
        entry = kernels.setdefault(e.name[:100], [0, 0.0])
        entry[0] += 1
        entry[1] += e.time_range.elapsed_us() / 1e6
    busy, end = 0.0, -1
    for a, b in sorted(spans):  # the union of the kernels' intervals (us)
        if b > end:
            busy += b - max(a, end)
            end = b
    by_kind = {}
    for name, (n, s) in kernels.items():
        k = by_kind.setdefault(kind(name), {"s": 0.0, "kernels": 0})
        k["s"] += s
        k["kernels"] += n
    top = sorted(kernels.items(), key=lambda kv: -kv[1][1])[:15]
    return {"wall_s": wall, "gpu_busy_s": busy / 1e6, "decoder_passes": passes, "kernels": sum(n for n, _ in kernels.values()),
            "by_kind": by_kind, "top": [{"kernel": name, "n": n, "s": s} for name, (n, s) in top]}


torch.set_grad_enabled(False)  # as under ComfyUI's executor (inference mode): its VAE parameters need grad
res = {"video_latent": args["video"], "runs": {}}
video = load(video_path)
z = torch.randn(args["video"], generator=torch.Generator().manual_seed(0))
timed(video.decode, z)  # pages the weights in
host, res["host_s"] = timed(video.decode, z)
res["frames"] = list(host.shape)
for config in args["configs"]:
    attention, linears, weights, tiles = config.split("/")
    ours_vae, text, _ = set_vae_kernels(video, attention, linears, weights, tiles=tiles)
    timed(ours_vae.decode, z)
    ours, seconds = timed(ours_vae.decode, z)
    res["runs"][config] = {"s": seconds, "vs_host": res["host_s"] / seconds, "psnr_db": psnr(ours, host),
                           "text": text, "line": lines[-1] if lines else None}
    print(f"{config}: {seconds:.2f} s ({res['host_s'] / seconds:.2f}x the host's {res['host_s']:.2f} s), "
          f"{res['runs'][config]['psnr_db']:.1f} dB; {lines[-1] if lines else ''}", file=sys.stderr, flush=True)
    del ours
if args["profile"]:
    zp = torch.randn(args["profile_latent"], generator=torch.Generator().manual_seed(1))
    res["profile"] = {"latent": args["profile_latent"], "host": profiled(video, video.decode, zp)}
    for config in args["profiled"]:
        attention, linears, weights, tiles = config.split("/")
        ours_vae = set_vae_kernels(video, attention, linears, weights, tiles=tiles)[0]
        res["profile"][config] = profiled(video, ours_vae.decode, zp)
del video, host
mm.soft_empty_cache()
audio = load(audio_path)
za = torch.randn(args["audio"], generator=torch.Generator().manual_seed(0))
timed(audio.decode, za)
res["audio_s"] = timed(audio.decode, za)[1]
print(json.dumps(res))
"""


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--comfyui", default=os.environ.get("BIGDIT_COMFYUI"), help="upstream ComfyUI 0.33.0's folder")
    ap.add_argument("--work", required=True, help="a folder on disk for the two VAE files")
    ap.add_argument("--configs", default=",".join(CONFIGS), help="attention/linears/weights/tiles, comma-separated")
    ap.add_argument("--profile", action="store_true", help="also profile one temporal chunk of each")
    ap.add_argument("--profiled", default=",".join(PROFILED))
    ap.add_argument("--out", default=None)
    ap.add_argument("--out-dir", default=None, help="write the JSON there, under its default name")
    args = ap.parse_args()
    if not args.comfyui:
        raise SystemExit("give upstream ComfyUI's folder: --comfyui PATH or BIGDIT_COMFYUI")
    work = Path(args.work)
    files = {}
    for kind, component in (("video", "video_vae_int8_convrot"), ("audio", "audio_vae_fp32")):
        files[kind] = work / f"{component}.safetensors"
        if not files[kind].exists():
            made = e2e_models.generate_component(e2e_models.COMPONENTS[component], files[kind], args.comfyui)
            print(f"wrote {files[kind].name}: {made['bytes'] / 2**30:.2f} GiB in {made['seconds']:.1f} s", flush=True)
    job = {"video": VIDEO_LATENT, "audio": AUDIO_LATENT, "configs": args.configs.split(","),
           "profile": args.profile, "profile_latent": PROFILE_LATENT, "profiled": args.profiled.split(",")}
    result = subprocess.run([sys.executable, "-c", PROBE, str(PACK_ROOT), str(files["video"]), str(files["audio"]),
                             json.dumps(job)], cwd=args.comfyui, stdout=subprocess.PIPE, text=True)
    if result.returncode:
        raise SystemExit(f"the decode process failed ({result.returncode}); its output:\n{result.stdout[-3000:]}")
    res = json.loads(result.stdout.strip().splitlines()[-1])
    import torch
    payload = {"bench": "vae_decode", "env": {"torch": torch.__version__, "gpu": torch.cuda.get_device_name()},
               **res}
    out = Path(args.out) if args.out else default_out("vae-decode")
    write_json(Path(args.out_dir) / out.name if args.out_dir and not args.out else out, payload)
    print(f"host {res['host_s']:.2f} s; audio VAE {res['audio_s']:.2f} s")
    for config, run in res["runs"].items():
        print(f"{config:28} {run['s']:6.2f} s  {run['vs_host']:.2f}x  {run['psnr_db']:.1f} dB")
    for name, prof in res.get("profile", {}).items():
        if name == "latent":
            continue
        kinds = ", ".join(f"{k} {v['s']:.2f} s/{v['kernels']}" for k, v in sorted(prof["by_kind"].items()))
        print(f"profile {name}: wall {prof['wall_s']:.2f} s, GPU busy {prof['gpu_busy_s']:.2f} s, "
              f"{prof['decoder_passes']} passes, {prof['kernels']} kernels: {kinds}")
        for k in prof["top"][:8]:
            print(f"    {k['s']:7.3f} s  x{k['n']:<6} {k['kernel'][:90]}")


if __name__ == "__main__":
    main()
