"""Attention kernels side by side at MiniMax-H3's shape (run on a GPU).

56 heads x head dim 128, bf16, BHSD (H3 calls attention with skip_reshape), at
8190, 32760 (H3 at 1344x768x107) and 65520 tokens, on random inputs and on
locality-structured ones (tests/bench/attention_inputs.py says how they are
built; Sol's accuracy depends on such structure). Each backend runs the way
the node runs it (same kernels, same layout handling): SDPA (torch's choice),
SDPA with cuDNN first, flash (whichever FlashAttention resolves), sage
(SageAttention 2's kernel for the GPU where 2.x is installed), kitchen_int8,
fa3_fp8, auto (with its own timings and probe errors in `auto_choice`), and
Sol at tau 0.5/1/2. Per row: median time by CUDA
events after warm-up, speed-up over cuDNN SDPA, and PSNR and cosine of the
output against cuDNN SDPA's. Writes JSON and prints a table.

    python tests/bench/attention.py [--lengths 32760 8190 65520] [--out FILE] [--budget 80]
"""
import argparse
import datetime
import math
import time
from pathlib import Path

import torch

from _pack import cuda_time_ms, default_out, environment, write_json
from attention_inputs import GRIDS, cosine, psnr, random_qkv, structured_qkv

from bigdit.attention import Unsupported, kernels, registry
from bigdit.attention.base import Backend

HEADS, HEAD_DIM = 56, 128
DEVICE = "cuda"
REFERENCE = "sdpa_cudnn"


def backends():
    """(row name, backend) in table order; the reference first."""
    rows = [(REFERENCE, Backend(REFERENCE, [kernels.SdpaCudnn()]))]
    rows += [(name, registry.create(name)) for name in ("sdpa", "flash", "sage", "kitchen_int8", "fa3_fp8", "auto")]
    # the bench measures Sol at every length; the node keeps it dense below 12288 tokens
    rows += [(f"sol tau={tau:g}", registry.create("sol", sol_tau=tau, sol_min_tokens=0)) for tau in (0.5, 1.0, 2.0)]
    return rows


def package_versions():
    from importlib import metadata
    out = {}
    for dist in ("sageattention", "fa3-fwd", "flash-attn", "flash-attn-4", "comfy-kitchen", "triton"):
        try:
            out[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            out[dist] = None
    return out


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[32760, 8190, 65520], choices=sorted(GRIDS))
    parser.add_argument("--inputs", nargs="+", default=["structured", "random"], choices=["structured", "random"])
    parser.add_argument("--out", default=None, help="JSON path (default tests/bench/results/attention-<gpu>-<date>.json)")
    parser.add_argument("--budget", type=float, default=80.0, help="seconds; later rows are skipped past it")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA GPU")

    started = time.monotonic()
    results = []
    for length in args.lengths:
        iters = 5 if length <= 32760 else 3
        for kind in args.inputs:
            if kind == "structured":
                q, k, v = structured_qkv(1, HEADS, GRIDS[length], HEAD_DIM, device=DEVICE, seed=length)
            else:
                q, k, v = random_qkv(1, HEADS, length, HEAD_DIM, device=DEVICE, seed=length)
            ref = None
            for name, backend in backends():
                row = {"tokens": length, "inputs": kind, "backend": name}
                results.append(row)
                if time.monotonic() - started > args.budget:
                    row["skipped"] = f"time budget of {args.budget:g} s spent"
                    continue
                try:
                    call = backend.kernel_call(q, k, v, layout="BHSD")
                except Unsupported as e:
                    row["skipped"] = str(e)
                    continue
                row["kernel"] = call.label
                if name == "auto":  # its measurement of this shape: every kernel's time, approximate ones' error
                    row["auto_choice"] = backend.take_choices()
                try:
                    row["ms"] = cuda_time_ms(call.run, warmup=1, iters=iters)
                    out = call.run()
                except Exception as e:  # noqa: BLE001 - one kernel failing must not lose the others' rows
                    row["error"] = f"{type(e).__name__}: {(str(e).splitlines() or [''])[0]}"
                    continue
                if ref is None:  # the reference row runs first
                    ref = out
                p = psnr(out, ref)
                row["psnr_db"] = None if math.isinf(p) else round(p, 2)
                row["cosine"] = round(cosine(out, ref), 6)
                del out
            ref_ms = next((r.get("ms") for r in results
                           if r["tokens"] == length and r["inputs"] == kind and r["backend"] == REFERENCE), None)
            for r in results:
                if r["tokens"] == length and r["inputs"] == kind and "ms" in r and ref_ms:
                    r["speedup_vs_sdpa_cudnn"] = round(ref_ms / r["ms"], 3)
            del q, k, v, ref
            torch.cuda.empty_cache()

    print_table(results)
    write_json(Path(args.out) if args.out else default_out("attention"), {
        "bench": "attention",
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "environment": {**environment(), "packages": package_versions()},
        "shape": {"batch": 1, "heads": HEADS, "head_dim": HEAD_DIM, "dtype": "bfloat16", "layout": "BHSD"},
        "reference": REFERENCE,
        "seconds": round(time.monotonic() - started, 1),
        "results": results,
    })


def print_table(results):
    header = f"{'tokens':>6} {'inputs':<10} {'backend':<13} {'kernel':<18} {'ms':>8} {'x cudnn':>8} {'PSNR dB':>8} {'cos':>9}"
    print(header)
    print("-" * len(header))
    for r in results:
        if "ms" not in r:
            why = r.get("skipped") or r.get("error")
            print(f"{r['tokens']:>6} {r['inputs']:<10} {r['backend']:<13} -- {why}")
            continue
        p = "inf" if r["psnr_db"] is None else f"{r['psnr_db']:.1f}"
        print(f"{r['tokens']:>6} {r['inputs']:<10} {r['backend']:<13} {r['kernel']:<18} {r['ms']:>8.2f} "
              f"{r.get('speedup_vs_sdpa_cudnn', float('nan')):>8.2f} {p:>8} {r['cosine']:>9.6f}")


if __name__ == "__main__":
    main()
