"""FP8 attention on Hopper: FA3's FP8 kernel with eager and with fused quantization (run on an H200).

Shapes as the models call attention at 32,760 tokens, head dim 128: Wan 2.1
14B (40 heads, (B, S, H*D) from ComfyUI, so BSHD; fp16, as ComfyUI 0.3.75
computes a bf16 Wan file, and bf16) and MiniMax-H3 (56 heads, BHSD, bf16),
on locality-structured and on random inputs (attention_inputs.py). Rows:

- sdpa_cudnn: SDPA with cuDNN first, the speed reference;
- fa3: fa3-fwd in bf16 (its build has no fp16 kernel);
- fa3_fp8 eager, no smoothing: per-(batch, head) scales by torch, k as is;
- fa3_fp8 eager: the same with k smoothed (fp8_qkv's torch reference);
- fa3_fp8: the backend, the fused Triton quantization (included in its time);
- quantize eager / quantize fused: the quantization alone.

Per row: median ms by CUDA events, speed-up over sdpa_cudnn, relative L2
error and cosine against SDPA in fp32 on the same inputs. About a minute.

    python tests/bench/attention_fp8.py [--out FILE] [--budget 100]
"""
import argparse
import datetime
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from _pack import cuda_time_ms, default_out, environment, write_json
from attention import package_versions
from attention_inputs import GRIDS, cosine, random_qkv, relative_error, structured_qkv

from bigdit.attention import Unsupported, fp8_qkv, kernels, registry
from bigdit.attention.base import Backend, convert, load
from bigdit.attention.kernels import _first

TOKENS, HEAD_DIM = 32760, 128
DEVICE = "cuda"
# (model, heads, layout, dtypes)
CONFIGS = [("wan14b", 40, "BSHD", (torch.float16, torch.bfloat16)), ("h3", 56, "BHSD", (torch.bfloat16,))]
REFERENCE = "sdpa_cudnn"


def fa3_fp8_eager(smooth_k):
    """FA3's FP8 kernel on q, k, v quantized by the torch reference (several full-tensor passes)."""
    fn, why = load("fa3_fwd_interface", "flash_attn_func", "fa3-fwd")

    def run(q, k, v, layout):
        if why:
            raise Unsupported(why)
        x = fp8_qkv.reference_quantize(q, k, v, layout, fp8_qkv.reference_stats(q, k, v, layout, smooth_k=smooth_k))
        out = _first(fn(x.q, x.k, x.v, causal=False, q_descale=x.descale[0], k_descale=x.descale[1],
                        v_descale=x.descale[2]))
        return convert(out.to(q.dtype), "BSHD", layout)
    return run


def kernel_of(backend):
    def run(q, k, v, layout):
        return backend.kernel_call(q, k, v, layout=layout).run
    return run


def rows():
    """(row name, fn(q, k, v, layout) -> a zero-argument call, or raises Unsupported)."""
    def call(fn):
        return lambda q, k, v, layout: (lambda: fn(q, k, v, layout))

    def quantize_eager(q, k, v, layout):
        return fp8_qkv.reference_quantize(q, k, v, layout, fp8_qkv.reference_stats(q, k, v, layout))

    def quantize_fused(q, k, v, layout):
        if fp8_qkv.TRITON_MISSING:
            raise Unsupported(fp8_qkv.TRITON_MISSING)
        return fp8_qkv.quantize_qkv(q, k, v, layout)

    return [
        (REFERENCE, kernel_of(Backend(REFERENCE, [kernels.SdpaCudnn()]))),
        ("fa3", kernel_of(Backend("fa3", [kernels.FA3Fwd()]))),
        ("fa3_fp8 eager, no smoothing", call(fa3_fp8_eager(smooth_k=False))),
        ("fa3_fp8 eager", call(fa3_fp8_eager(smooth_k=True))),
        ("fa3_fp8", kernel_of(registry.create("fa3_fp8"))),
        ("quantize eager", call(quantize_eager)),
        ("quantize fused", call(quantize_fused)),
    ]


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--inputs", nargs="+", default=["structured", "random"], choices=["structured", "random"])
    parser.add_argument("--out", default=None,
                        help="JSON path (default tests/bench/results/attention_fp8-<gpu>-<date>.json)")
    parser.add_argument("--budget", type=float, default=100.0, help="seconds; later rows are skipped past it")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA GPU")

    started = time.monotonic()
    results = []
    for model, heads, layout, dtypes in CONFIGS:
        for dtype in dtypes:
            for kind in args.inputs:
                if kind == "structured":
                    q, k, v = structured_qkv(1, heads, GRIDS[TOKENS], HEAD_DIM, dtype=dtype, device=DEVICE, seed=heads)
                else:
                    q, k, v = random_qkv(1, heads, TOKENS, HEAD_DIM, dtype=dtype, device=DEVICE, seed=heads)
                with sdpa_kernel([SDPBackend.EFFICIENT_ATTENTION]):  # fp32 without a T x T matrix
                    exact = F.scaled_dot_product_attention(q.float(), k.float(), v.float())  # BHSD
                if layout == "BSHD":  # as ComfyUI hands Wan's attention over: (B, S, H, D) memory
                    q, k, v = (t.transpose(1, 2).contiguous() for t in (q, k, v))
                group = {"model": model, "heads": heads, "layout": layout, "dtype": str(dtype).split(".")[1],
                         "inputs": kind}
                for name, make in rows():
                    row = {**group, "row": name}
                    results.append(row)
                    if time.monotonic() - started > args.budget:
                        row["skipped"] = f"time budget of {args.budget:g} s spent"
                        continue
                    try:
                        fn = make(q, k, v, layout)
                        row["ms"] = cuda_time_ms(fn, warmup=2, iters=5)
                        out = fn()
                    except Unsupported as e:
                        row["skipped"] = str(e)
                        continue
                    except Exception as e:  # noqa: BLE001 - one row failing must not lose the others
                        row["error"] = f"{type(e).__name__}: {(str(e).splitlines() or [''])[0]}"
                        continue
                    if isinstance(out, torch.Tensor):
                        out = convert(out, layout, "BHSD")
                        row["rel_error_vs_fp32"] = round(relative_error(out, exact), 5)
                        row["cosine_vs_fp32"] = round(cosine(out, exact), 6)
                    del out
                ref_ms = next(r.get("ms") for r in results if r.items() >= group.items() and r["row"] == REFERENCE)
                for r in results:
                    if r.items() >= group.items() and "ms" in r and ref_ms:
                        r["speedup_vs_sdpa_cudnn"] = round(ref_ms / r["ms"], 3)
                del q, k, v, exact
                torch.cuda.empty_cache()

    print_rows(results)
    write_json(Path(args.out) if args.out else default_out("attention_fp8"), {
        "bench": "attention_fp8",
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "environment": {**environment(), "packages": package_versions()},
        "shape": {"batch": 1, "tokens": TOKENS, "head_dim": HEAD_DIM},
        "reference": REFERENCE,
        "error_reference": "SDPA in fp32 on the same inputs",
        "seconds": round(time.monotonic() - started, 1),
        "results": results,
    })


def print_rows(results):
    header = f"{'model':<7} {'dtype':<9} {'inputs':<10} {'row':<28} {'ms':>8} {'x cudnn':>8} {'rel err':>8} {'cos':>9}"
    print(header)
    print("-" * len(header))
    for r in results:
        lead = f"{r['model']:<7} {r['dtype']:<9} {r['inputs']:<10} {r['row']:<28}"
        if "ms" not in r:
            print(f"{lead} -- {r.get('skipped') or r.get('error')}")
            continue
        err = f"{r['rel_error_vs_fp32']:.4f}" if "rel_error_vs_fp32" in r else "-"
        cos = f"{r['cosine_vs_fp32']:.6f}" if "cosine_vs_fp32" in r else "-"
        print(f"{lead} {r['ms']:>8.2f} {r.get('speedup_vs_sdpa_cudnn', float('nan')):>8.2f} {err:>8} {cos:>9}")


if __name__ == "__main__":
    main()
