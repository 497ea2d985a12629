"""bf16 vs INT8 ConvRot, FP8, ConvRot W4A4, W4A8, NVFP4 and auto on MiniMax-H3's Linear shapes (run on a GPU).

Each quantized layer runs the whole way a model runs it: activation
quantization included, kernels as the pack picks them. `fc2+swiglu` is fc2
as H3 calls it (ComfyUI's `linear_input_act(fc2, x, "swiglu")`): the bf16
side runs swiglu then the GEMM, the quantized side folds swiglu into its
activation quantization. Prints ratios to bf16 and cosine to fp32; writes JSON (with each
format's weight bytes).

    python tests/bench/formats.py [--rows 4096 32700] [--formats ...] [--out FILE]
"""
import argparse
from pathlib import Path

import torch
import torch.nn.functional as F

from _pack import cuda_time_ms, default_out, environment, write_json

from bigdit.quant import get_method
from bigdit.quant.quantize_pass import quantize_linear

SHAPES = {  # name: (K, N, input_act)
    "qkv_proj": (5376, 21504, None),
    "out_proj": (7168, 5376, None),
    "fc1": (5376, 28672, None),
    "fc2": (14336, 5376, None),
    "fc2+swiglu": (14336, 5376, "swiglu"),
}
FORMATS = ("int8_convrot", "float8_e4m3fn", "convrot_w4a4", "asym_w4a8_int8", "nvfp4", "auto")


def cosine(a, b):
    return F.cosine_similarity(a.float().flatten(), b.float().flatten(), dim=0).item()


def swiglu(x):
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


def bench(name, k, n, act, rows, selector, formats=FORMATS):
    torch.manual_seed(0)
    linear = torch.nn.Linear(k, n, bias=False, device="cuda", dtype=torch.bfloat16)
    torch.nn.init.normal_(linear.weight, std=k ** -0.5)
    width = 2 * k if act else k
    x = torch.randn(rows, width, device="cuda", dtype=torch.bfloat16)
    ref = F.linear(swiglu(x.float()) if act else x.float(), linear.weight.float())
    bf16 = (lambda: F.linear(swiglu(x), linear.weight)) if act else (lambda: F.linear(x, linear.weight))
    row = {"shape": name, "K": k, "N": n, "rows": rows, "bf16_ms": cuda_time_ms(bf16), "bf16_cos": cosine(bf16(), ref)}
    for fmt in formats:
        if fmt == "auto":
            method, why = selector.select(k, n, torch.bfloat16)
            row["auto_pick"] = why
            if method is None:
                row.update(auto_ms=row["bf16_ms"], auto_ratio=1.0, auto_cos=row["bf16_cos"])
                continue
        else:
            method = get_method(fmt)
        layer = quantize_linear(linear, method, torch.device("cuda"))
        run = lambda: layer(x, input_act=act)  # noqa: E731
        out = run()
        row[f"{fmt}_ms"] = cuda_time_ms(run)
        row[f"{fmt}_ratio"] = row["bf16_ms"] / row[f"{fmt}_ms"]
        row[f"{fmt}_cos"] = cosine(out, ref)
        row[f"{fmt}_weight_bytes"] = sum(t.numel() * t.element_size() for t in layer.stored_tensors().values())
        del layer, out
    del linear, x, ref
    torch.cuda.empty_cache()
    return row


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, nargs="+", default=[4096, 32700])
    ap.add_argument("--formats", nargs="+", default=list(FORMATS), choices=FORMATS)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    selector = get_method("auto", device="cuda")
    results = []
    print(f"{'shape':11} {'rows':>6} {'bf16 ms':>8} " + " ".join(f"{f:>22}" for f in args.formats))
    for rows in args.rows:
        for name, (k, n, act) in SHAPES.items():
            r = bench(name, k, n, act, rows, selector, args.formats)
            results.append(r)
            cells = " ".join(f"{r[f + '_ratio']:>7.2f}x cos {r[f + '_cos']:.5f}" for f in args.formats)
            print(f"{name:11} {rows:>6} {r['bf16_ms']:>8.3f} {cells}   [{r.get('auto_pick', '')}]", flush=True)
    write_json(Path(args.out) if args.out else default_out("formats"), {
        "bench": "formats", "env": environment(), "rows": results})


if __name__ == "__main__":
    main()
