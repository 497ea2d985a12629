"""torch.compile on a tiny stack of DiT-like blocks (run on a GPU): compile time, and the step with and without it.

Each block is LayerNorm -> Linear (dim -> hidden) -> GELU -> Linear (hidden -> dim), residual, its Linears
quantized by the pack (or left in bf16). Per format: the eager step, the first compiled call (compilation
included), the compiled step, graph breaks, and the compiled output's relative L2 from eager. The quantized
layers' kernels (FP8's one-pass Triton quantizer and GEMM, kitchen's INT8 GEMM) are opaque ops under compile;
inductor fuses what lies between them.

    python tests/bench/compile_step.py [--formats bf16 float8_e4m3fn int8_convrot] [--tokens 8192] [--out FILE]
"""
import argparse
import time
from pathlib import Path

import torch
from torch import nn

from _pack import cuda_time_ms, default_out, environment, write_json


class Block(nn.Module):
    def __init__(self, dim, hidden):
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.fc1 = nn.Linear(dim, hidden)
        self.fc2 = nn.Linear(hidden, dim)

    def forward(self, x):
        return x + self.fc2(torch.nn.functional.gelu(self.fc1(self.norm(x)), approximate="tanh"))


def make_stack(fmt, blocks, dim, hidden):
    from bigdit.quant import QuantConfig, apply_replacements, quantize_layers
    from bigdit.quant.registry import get_method
    torch.manual_seed(0)
    model = nn.Sequential(*(Block(dim, hidden) for _ in range(blocks))).to("cuda", torch.bfloat16).eval()
    if fmt != "bf16":
        replacements, _ = quantize_layers(model, QuantConfig(method=get_method(fmt)))
        apply_replacements(model, replacements)
    return model


def rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def bench(fmt, args):
    from torch._dynamo.utils import counters
    model = make_stack(fmt, args.blocks, args.dim, args.hidden)
    x = torch.randn(1, args.tokens, args.dim, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        eager = model(x)
        eager_ms = cuda_time_ms(lambda: model(x))
        torch._dynamo.reset()
        counters.clear()
        compiled = torch.compile(model, backend="inductor", mode=args.mode)
        torch.cuda.synchronize()
        start = time.perf_counter()
        out = compiled(x)
        torch.cuda.synchronize()
        compile_s = time.perf_counter() - start
        compiled_ms = cuda_time_ms(lambda: compiled(x))
    row = {"format": fmt, "eager_ms": eager_ms, "compiled_ms": compiled_ms, "speedup": eager_ms / compiled_ms,
           "first_call_s": compile_s, "graph_breaks": sum(counters["graph_break"].values()),
           "graphs": counters["stats"]["unique_graphs"], "rel_l2_vs_eager": rel(out, eager)}
    print(f"{fmt:>16}: eager {eager_ms:7.3f} ms, compiled {compiled_ms:7.3f} ms ({row['speedup']:.2f}x), "
          f"first call {compile_s:6.1f} s, breaks {row['graph_breaks']}, rel L2 {row['rel_l2_vs_eager']:.2e}")
    return row


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--formats", nargs="+", default=["bf16", "float8_e4m3fn", "int8_convrot"],
                    help="bf16 (plain Linear) or any online format of the pack")
    ap.add_argument("--blocks", type=int, default=4)
    ap.add_argument("--dim", type=int, default=3072)
    ap.add_argument("--hidden", type=int, default=8192)
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--mode", default=None, help="torch.compile mode (default: inductor's default)")
    ap.add_argument("--out", default=None, help="JSON path (default: tests/bench/results/compile_step-<gpu>-<date>.json)")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("compile_step.py measures on a CUDA GPU; none is available")
    rows = [bench(fmt, args) for fmt in args.formats]
    config = {k: getattr(args, k) for k in ("blocks", "dim", "hidden", "tokens", "mode")}
    write_json(default_out("compile_step") if args.out is None else Path(args.out),
               {"environment": environment(), "config": config, "results": rows})


if __name__ == "__main__":
    main()
