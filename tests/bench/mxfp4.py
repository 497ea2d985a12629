"""MXFP4 vs bf16 on MiniMax-H3's Linear shapes (run on a GPU).

MXFP4 layers run on the path this GPU has (`bigdit.quant.mxfp4.execution_path`,
recorded in the JSON). Where that is the emulated path (every NVIDIA GPU
before sm100, the H200 included) each call dequantizes the weight to bf16 and
runs a bf16 GEMM: the table shows what that costs against plain bf16, and how
much of it is the dequantize. Where a native path exists, its output is also
checked against the W4A4 emulation (the same quantized operands, dequantized).

    python tests/bench/mxfp4.py [--rows 4096 32700] [--out FILE]
"""
import argparse
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from _pack import cuda_time_ms, default_out, environment, write_json

from bigdit.quant.quantize_pass import quantize_linear
from bigdit.quant.mxfp4 import Mxfp4Method, dequantize_mxfp4, execution_path, quantize_mxfp4

SHAPES = {  # name: (K, N)
    "qkv_proj": (5376, 21504),
    "out_proj": (7168, 5376),
    "fc1": (5376, 28672),
    "fc2": (14336, 5376),
}
GIB = 1024 ** 3


def cosine(a, b):
    return F.cosine_similarity(a.float().flatten(), b.float().flatten(), dim=0).item()


def rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def bench(name, k, n, rows, method):
    torch.manual_seed(0)
    linear = torch.nn.Linear(k, n, bias=False, device="cuda", dtype=torch.bfloat16)
    torch.nn.init.normal_(linear.weight, std=k ** -0.5)
    x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
    ref = F.linear(x.float(), linear.weight.float())
    bf16_ms = cuda_time_ms(lambda: F.linear(x, linear.weight))
    row = {"shape": name, "K": k, "N": n, "rows": rows, "bf16_ms": bf16_ms,
           "bf16_cos": cosine(F.linear(x, linear.weight), ref)}

    torch.cuda.synchronize()
    start = time.perf_counter()
    layer = quantize_linear(linear, method, torch.device("cuda"))
    torch.cuda.synchronize()
    row["quantize_s"] = time.perf_counter() - start
    row["weight_gib_bf16"] = k * n * 2 / GIB
    row["weight_gib_mxfp4"] = (layer.weight.numel() + layer.weight_scale.numel()) / GIB

    out = layer(x)
    row["mxfp4_ms"] = cuda_time_ms(lambda: layer(x))
    row["mxfp4_ratio"] = bf16_ms / row["mxfp4_ms"]
    row["mxfp4_cos"] = cosine(out, ref)
    row["mxfp4_rel"] = rel(out, ref)
    if method.path.name != "aiter":
        row["dequantize_ms"] = cuda_time_ms(lambda: dequantize_mxfp4(layer.weight, layer.weight_scale, torch.bfloat16))
    if method.path.name == "native":
        # Same quantized operands through the emulation: only accumulation and output rounding may differ.
        packed_x, scales_x = quantize_mxfp4(x)
        w = dequantize_mxfp4(layer.weight, layer.weight_scale)
        row["native_vs_w4a4_emulation_rel"] = rel(out, dequantize_mxfp4(packed_x, scales_x) @ w.T)
    del layer, linear, x, ref, out
    torch.cuda.empty_cache()
    return row


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, nargs="+", default=[4096, 32700])
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    path = execution_path("cuda")
    method = Mxfp4Method(device="cuda")
    print(f"MXFP4 on {torch.cuda.get_device_name()}: {method.describe()}")
    results = []
    print(f"{'shape':9} {'rows':>6} {'bf16 ms':>8} {'mxfp4 ms':>9} {'ratio':>7} {'dequant ms':>10} {'cos':>8} {'rel':>7}")
    for rows in args.rows:
        for name, (k, n) in SHAPES.items():
            r = bench(name, k, n, rows, method)
            results.append(r)
            print(f"{name:9} {rows:>6} {r['bf16_ms']:>8.3f} {r['mxfp4_ms']:>9.3f} {r['mxfp4_ratio']:>6.2f}x "
                  f"{r.get('dequantize_ms', float('nan')):>10.3f} {r['mxfp4_cos']:>8.5f} {r['mxfp4_rel']:>7.4f}", flush=True)
    write_json(Path(args.out) if args.out else default_out("mxfp4"), {
        "bench": "mxfp4", "env": environment(),
        "path": {"name": path.name, "detail": path.detail, "reason": path.reason},
        "native_path": path.name != "emulated", "describe": method.describe(), "rows": results,
    })


if __name__ == "__main__":
    main()
