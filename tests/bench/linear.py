"""INT8 ConvRot vs bf16 on MiniMax-H3's Linear shapes (run on a GPU).

For each shape and row count: bf16 F.linear, every INT8 kernel candidate
(comfy-kitchen fused, the same split into row chunks, dequantize + bf16
GEMM), the candidate `auto`
picks, and raw torch._int_mm as a ceiling (no rotation, no activation
quantization). Prints ratios to bf16 and cosine similarity to fp32; writes JSON.

    python tests/bench/linear.py [--rows 4096 32700] [--out FILE]
"""
import argparse
import os
from pathlib import Path

import torch
import torch.nn.functional as F

from _pack import cuda_time_ms, default_out, environment, write_json
from probes import chooser

from bigdit.quant import QuantConfig, quantize_layers
from bigdit.quant.int8_convrot import Int8ConvRotMethod
from bigdit.quant.kernel_select import rows_bucket

H3_SHAPES = {  # name: (K, N)
    "qkv_proj": (5376, 21504),
    "out_proj": (7168, 5376),
    "fc1": (5376, 28672),
    "fc2": (14336, 5376),
}
CANDIDATES = ("kitchen", "kitchen_split", "dequant")


def cosine(a, b):
    return F.cosine_similarity(a.float().flatten(), b.float().flatten(), dim=0).item()


def bench_shape(name, k, n, rows, group_size):
    torch.manual_seed(0)
    linear = torch.nn.Linear(k, n, bias=False, device="cuda", dtype=torch.bfloat16)
    torch.nn.init.normal_(linear.weight, std=k ** -0.5)
    x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
    ref = F.linear(x.float(), linear.weight.float())
    bf16_ms = cuda_time_ms(lambda: F.linear(x, linear.weight))
    row = {"shape": name, "K": k, "N": n, "rows": rows, "bf16_ms": bf16_ms,
           "bf16_cos": cosine(F.linear(x, linear.weight), ref)}

    replacements, _ = quantize_layers(torch.nn.Sequential(linear),
                                      QuantConfig(method=Int8ConvRotMethod(group_size)))
    qlayer = replacements["0"]
    for cand in CANDIDATES:
        if cand == "kitchen_split" and rows <= 8192:
            continue
        os.environ["BIGDIT_INT8_KERNEL"] = cand
        out = qlayer(x)
        row[f"{cand}_ms"] = cuda_time_ms(lambda: qlayer(x))
        row[f"{cand}_ratio"] = bf16_ms / row[f"{cand}_ms"]
        row[f"{cand}_cos"] = cosine(out, ref)
    os.environ["BIGDIT_INT8_KERNEL"] = "auto"
    out = qlayer(x)
    shape_key = (str(x.device), rows_bucket(rows), k, n, torch.bfloat16, None)  # then the candidate names
    row["auto_choice"] = next(c for (device, shape), c in chooser().choices.items()
                              if (device, *shape[:-1]) == shape_key)
    row["auto_ms"] = cuda_time_ms(lambda: qlayer(x))
    row["auto_ratio"] = bf16_ms / row["auto_ms"]
    row["auto_cos"] = cosine(out, ref)

    qx = torch.randint(-127, 127, (rows, k), device="cuda", dtype=torch.int8)
    qw_t = qlayer.weight.t()
    row["raw_int_mm_ms"] = cuda_time_ms(lambda: torch._int_mm(qx, qw_t))
    row["raw_int_mm_ratio"] = bf16_ms / row["raw_int_mm_ms"]
    del qlayer, replacements, linear, x, ref
    torch.cuda.empty_cache()
    return row


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, nargs="+", default=[4096, 32700])
    ap.add_argument("--group-size", type=int, default=256)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    rows_out = []
    header = f"{'shape':9} {'rows':>6} {'bf16 ms':>8} " + " ".join(f"{c:>13}" for c in CANDIDATES) + \
        f" {'auto':>20} {'raw_int_mm':>10} {'cos(auto)':>9}"
    print(header)
    for rows in args.rows:
        for name, (k, n) in H3_SHAPES.items():
            r = bench_shape(name, k, n, rows, args.group_size)
            rows_out.append(r)
            cells = " ".join(f"{r[c + '_ratio']:>12.2f}x" if c + "_ratio" in r else f"{'-':>13}" for c in CANDIDATES)
            print(f"{name:9} {rows:>6} {r['bf16_ms']:>8.3f} {cells} {r['auto_ratio']:>8.2f}x ({r['auto_choice']:>9})"
                  f" {r['raw_int_mm_ratio']:>9.2f}x {r['auto_cos']:>9.5f}")
    geo = 1.0
    big = [r for r in rows_out if r["rows"] == max(args.rows)]
    for r in big:
        geo *= r["auto_ratio"]
    geo = geo ** (1 / len(big))
    print(f"auto geomean at {max(args.rows)} rows: {geo:.3f}x")
    write_json(Path(args.out) if args.out else default_out("linear"), {
        "bench": "linear", "env": environment(), "group_size": args.group_size,
        "auto_geomean_at_max_rows": geo, "rows": rows_out,
        "chooser_timings_ms": {str(k): v for k, v in chooser().timings.items()},
    })


if __name__ == "__main__":
    main()
