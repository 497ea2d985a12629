"""The INT8 ConvRot paths per layer at MiniMax-H3 pruned's shapes (run on a GPU): is the pack's Triton INT8
linear at least 1.5x bf16?

For each of H3's four Linear shapes at 32,700 rows, on random bf16 weights quantized by comfy-kitchen
(ConvRot, group 256; fc2 takes SwiGLU of fc1's 28672-wide output, as the model runs it):
bf16 F.linear (for fc2 also SwiGLU + F.linear, the model's bf16 path); comfy-kitchen's int8_linear; the
pack's Triton path (quant/int8_triton.py: rotation, activation quantization and dequantization included);
Int8ConvRotMethod as the pack runs it (its choice, named: the Triton kernels unless the tuning store says
otherwise); raw torch._int_mm (cuBLASLt, no
rotation nor quantization: a ceiling); the pack's FP8 method; W4A8 (`asym_w4a8_int8`, group 16) as the pack runs
it (its decode, then the INT8 kernels), as comfy-kitchen's own linear runs it, the pack's and kitchen's decodes alone, and
with --experiments the codes decoded in the GEMM's main loop (tests/bench/w4a8_fused.py, the fastest of its configs,
named); the INT8 GEMM alone (activations quantized beforehand), the pack's and, with --experiments, as a persistent
kernel (tests/bench/int8_gemm_persistent.py, the fastest of its configs, named); the method and the kernel timed
again in the other order, and with --trace profiled (their kernels, allocator and synchronizing calls). The two
experiments lost on an H100 (int8-linear-exp-*-h100-2026-12-07.json) and search several configs each: off by
default. Each: ms (CUDA events,
warmed up, median of three runs of ten calls), ratio to bf16 F.linear, TOPS or TFLOP/s and the share of the GPU's dense
peak, relative error against an fp32 reference, and for Triton its error over kitchen's. The configs the
kernels ran are recorded per shape, with where each came from (BIGDIT_INT8_TUNE=1 searches them). One line per
layer says whether the target (>= 1.5x bf16) is met, one whether W4A8 runs at least W4A8_TARGET of the INT8 method.

    python tests/bench/int8_linear.py [--rows 32700] [--experiments] [--trace] [--out FILE]
"""
import argparse
from pathlib import Path

import torch
import torch.nn.functional as F

from _pack import cuda_time_ms, default_out, environment, write_json
from probes import chooser
import int8_gemm_persistent
import w4a8_fused

from bigdit.quant import compiled_ops, int8_triton, w4a8_triton
from bigdit.quant.fp8 import Fp8Method
from bigdit.quant.int8_convrot import Int8ConvRotMethod
from bigdit.quant.kitchen_layout import KitchenLayoutMethod
from bigdit.quant.kitchen_api import apply_input_act
from bigdit.quant.kernel_select import rows_bucket
from bigdit.quant.quantize_pass import quantize_linear
from bigdit.quant.w4a8_int8 import W4A8Int8Method

SHAPES = {  # name: (K, N, input activation)
    "qkv_proj": (5376, 21504, None),
    "out_proj": (7168, 5376, None),
    "fc1": (5376, 28672, None),
    "fc2": (14336, 5376, "swiglu"),
}
GROUP = 256
TARGET = 1.5
W4A8_TARGET = 0.9  # W4A8 on the INT8 kernels against the INT8 method, per layer
# dense tensor-core peaks (TFLOP/s, TOPS), from the vendors' datasheets
PEAKS = {"H200": {"bf16": 989, "int8": 1979, "fp8": 1979}, "H100": {"bf16": 989, "int8": 1979, "fp8": 1979}}
KINDS = {"bf16": "bf16", "bf16_model": "bf16", "kitchen": "int8", "triton": "int8", "method": "int8",
         "int_mm": "int8", "fp8": "fp8", "w4a8": "int8", "w4a8_kitchen": "int8", "w4a8_fused": "int8",
         "gemm": "int8", "gemm_persistent": "int8"}


def peaks() -> dict | None:
    name = torch.cuda.get_device_name()
    return next((p for key, p in PEAKS.items() if key in name), None)


def rel(out, ref):
    return ((out.float() - ref).norm() / ref.norm()).item()


def tuned_configs(k, n, swiglu):
    """The configs the Triton kernels ran this shape with, each with where it came from (the tuning store, a
    search, the shipped table, the rule): the activation kernel's and the GEMM's (shapes start with the row
    bucket, then K, G, SWIGLU, ROTATE / N, K)."""
    tma = int8_triton._tma(torch.device("cuda"))
    gemm = "gemm_tma" if tma else "gemm"
    chosen = int8_triton._CHOSEN.items()
    act = [f"{config} ({source})" for (kernel, _, shape), (config, source) in chosen
           if kernel == "activation" and shape[1:4] == (k, GROUP, swiglu)]
    mm = [f"{config} ({source})" for (kernel, _, shape), (config, source) in chosen
          if kernel == gemm and shape[1:3] == (n, k)]
    return {"activation": act, "gemm": mm, "gemm_kernel": "tma" if tma else "pointer"}


def fastest_fused(x, layer, act):
    """The fused-decode kernel's fastest config at this shape (each timed once, warmed up), None where none runs."""
    timings = []
    for config in w4a8_fused.configs():
        try:
            w4a8_fused.linear(x, layer, act, config)
            timings.append((cuda_time_ms(lambda: w4a8_fused.linear(x, layer, act, config)), config))
        except Exception as exc:  # shared memory or registers this GPU lacks
            print(f"  w4a8_fused {config}: {type(exc).__name__}: {str(exc)[:200]}")
    return min(timings, key=lambda t: t[0])[1] if timings else None


def fastest_persistent(q, scale, weight, w_scale):
    """The persistent GEMM's fastest config at this shape, None where none runs (a Triton without its options)."""
    programs = torch.cuda.get_device_properties(q.device).multi_processor_count
    timings = []
    for config in int8_gemm_persistent.configs():
        def run():
            return int8_gemm_persistent.gemm(q, scale, weight, w_scale, None, torch.bfloat16, config, programs)
        try:
            run()
            timings.append((cuda_time_ms(run), config))
        except Exception as exc:
            print(f"  gemm_persistent {config}: {type(exc).__name__}: {str(exc)[:200]}")
    if not timings:
        return None
    config = min(timings, key=lambda t: t[0])[1]
    return config, lambda: int8_gemm_persistent.gemm(q, scale, weight, w_scale, None, torch.bfloat16, config,
                                                      programs)


def profile_calls(fn, calls: int = 10, top: int = 8) -> list[dict]:
    """torch.profiler over `calls` calls of `fn` (warmed up): the `top` events by device time, then any allocator or
    synchronizing runtime call, each with its count and total device and host microseconds."""
    from torch.profiler import ProfilerActivity, profile
    cuda = torch.cuda.is_available()
    fn()
    if cuda:
        torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])) as prof:
        for _ in range(calls):
            fn()
        if cuda:
            torch.cuda.synchronize()
    events = prof.key_averages()

    def cell(e):
        device = getattr(e, "device_time_total", None)
        return {"name": e.key[:120], "count": e.count, "device_us": round(device if device is not None else
                                                                           e.cuda_time_total, 1),
                "host_us": round(e.cpu_time_total, 1)}
    by_device = sorted(events, key=lambda e: -cell(e)["device_us"])[:top]
    runtime = [e for e in events if any(w in e.key for w in ("Malloc", "Free", "Synchronize", "cudaMemcpy"))]
    return [cell(e) for e in by_device] + [cell(e) for e in runtime if e not in by_device]


def bench_shape(name, k, n, act, rows, experiments=False, trace=False):
    torch.manual_seed(0)
    linear = torch.nn.Linear(k, n, bias=False, device="cuda", dtype=torch.bfloat16)
    torch.nn.init.normal_(linear.weight, std=k ** -0.5)
    x = torch.randn(rows, 2 * k if act else k, device="cuda", dtype=torch.bfloat16)
    xin = apply_input_act(x, act)  # the bf16 activation F.linear takes
    ref = F.linear(apply_input_act(x.float(), act), linear.weight.float())
    int8 = quantize_linear(linear, Int8ConvRotMethod(GROUP), torch.device("cuda"))
    fp8 = quantize_linear(linear, Fp8Method(), torch.device("cuda"))
    w4a8 = quantize_linear(linear, W4A8Int8Method(16, GROUP), torch.device("cuda"))
    weight, w_scale = int8.weight, int8.weight_scale

    def kitchen():
        import comfy_kitchen as ck
        return ck.int8_linear(x, weight, w_scale, None, torch.bfloat16, convrot=True, convrot_groupsize=GROUP,
                              input_act=act)

    qx = torch.randint(-127, 128, (rows, k), device="cuda", dtype=torch.int8)
    runs = {
        "bf16": lambda: F.linear(xin, linear.weight),
        "kitchen": kitchen,
        "triton": lambda: int8_triton.int8_linear(x, weight, w_scale, None, torch.bfloat16, True, GROUP, act),
        "method": lambda: int8(x, input_act=act),
        "int_mm": lambda: torch._int_mm(qx, weight.t()),
        "fp8": lambda: fp8(x, input_act=act),
        "w4a8": lambda: w4a8(x, input_act=act),
        "w4a8_kitchen": lambda: KitchenLayoutMethod.apply(w4a8.method, w4a8, x, act),
    }
    if act:
        runs["bf16_model"] = lambda: F.linear(apply_input_act(x, act), linear.weight)
    row = {"shape": name, "K": k, "N": n, "rows": rows, "input_act": act}
    flops = 2 * rows * k * n
    peak = peaks()

    def measure(cand, fn):
        out = fn()  # the first call compiles (with BIGDIT_INT8_TUNE=1: searches configs, measures the choice)
        ms = cuda_time_ms(fn)
        cell = {"ms": ms, "tflops": flops / ms / 1e9}
        if peak is not None:
            cell["peak_fraction"] = cell["tflops"] / peak[KINDS[cand]]
        if cand != "int_mm":  # random int8 operands: nothing to compare
            cell["rel_err"] = rel(out, ref)
        row[cand] = cell

    for cand, fn in runs.items():
        measure(cand, fn)
    # the experiments last: a kernel of theirs that fails on this GPU leaves the pack's paths measured
    q, q_scale = int8_triton.quantize_rows(x.reshape(-1, x.shape[-1]), True, GROUP, act)
    runs["gemm"] = lambda: int8_triton.gemm(q, q_scale, weight, w_scale, None, torch.bfloat16,
                                            tma=int8_triton._tma(x.device))
    measure("gemm", runs["gemm"])
    persistent = fastest_persistent(q, q_scale, weight, w_scale) if experiments else None
    if persistent is not None:
        runs["gemm_persistent"] = persistent[1]
        measure("gemm_persistent", runs["gemm_persistent"])
    fused_config = fastest_fused(x, w4a8, act) if experiments else None
    if fused_config is not None:
        runs["w4a8_fused"] = lambda: w4a8_fused.linear(x, w4a8, act, fused_config)
        measure("w4a8_fused", runs["w4a8_fused"])
    for cand in runs:
        row[cand]["ratio_to_bf16"] = row["bf16"]["ms"] / row[cand]["ms"]
    # the method was slower than its kernel at fc2 at 32,700 rows in three runs, running the same kernels: timed
    # again in the other order, and with --trace each one's kernels and allocator calls, to tell what differs
    row["retimed_ms"] = {cand: cuda_time_ms(runs[cand]) for cand in ("method", "triton")}
    if trace:
        row["trace"] = {cand: profile_calls(runs[cand]) for cand in ("triton", "method")}
    t = w4a8.tensors_for(x)
    codes = (t["weight"], t["weight_s_rel"], t.get("weight_codebook"), 16)
    kitchen_decode = compiled_ops.w4a8_decoder(x.device)
    row["w4a8_decode"] = {"ms": cuda_time_ms(lambda: w4a8_triton.decode(*codes))}  # the pack's
    row["w4a8_decode_kitchen"] = {"ms": cuda_time_ms(lambda: kitchen_decode(*codes))}
    row["w4a8_fused_config"] = fused_config
    row["gemm_persistent_config"] = persistent[0] if persistent is not None else None
    row["triton_err_over_kitchen"] = row["triton"]["rel_err"] / row["kitchen"]["rel_err"]
    key = (str(x.device), rows_bucket(rows), x.shape[-1], n, torch.bfloat16, act)
    row["method_choice"] = next(c for (device, shape), c in chooser().choices.items() if (device, *shape[:-1]) == key)
    row["tuned"] = tuned_configs(k, n, act == "swiglu")
    del int8, fp8, w4a8, linear, x, xin, ref, qx, q, q_scale, runs
    torch.cuda.empty_cache()
    return row


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=32700)
    ap.add_argument("--out", default=None)
    ap.add_argument("--experiments", action="store_true", help="the persistent GEMM and the fused W4A8 decode too")
    ap.add_argument("--trace", action="store_true", help="torch.profiler over the Triton kernel's and the method's "
                    "calls at each shape: their kernels and allocator calls, in the JSON and printed")
    args = ap.parse_args()
    chooser()  # starts recording the method's measurements
    gpu = torch.cuda.get_device_name()
    peak = peaks()
    print(f"{gpu}: " + (f"dense peaks bf16 {peak['bf16']} TFLOP/s, int8/fp8 {peak['int8']} TOPS" if peak
                        else "dense peak unknown for this GPU (peak fractions left out)"))
    cands = ("bf16", "kitchen", "triton", "method", "int_mm", "fp8", "w4a8", "w4a8_kitchen", "w4a8_fused", "gemm",
             "gemm_persistent")
    print(f"{'layer':9} " + " ".join(f"{c:>22}" for c in cands) + "   (ms, x bf16 F.linear, % of peak)")
    results = []
    for name, (k, n, act) in SHAPES.items():
        r = bench_shape(name, k, n, act, args.rows, args.experiments, args.trace)
        results.append(r)
        cells = " ".join("(none)".rjust(22) if c not in r else f"{r[c]['ms']:7.3f} {r[c]['ratio_to_bf16']:5.2f}x "
                         f"{100 * r[c].get('peak_fraction', float('nan')):4.0f}%" for c in cands)
        print(f"{name:9} {cells}", flush=True)
    print()
    met_all = True
    for r in results:
        t = r["triton"]
        met = t["ratio_to_bf16"] >= TARGET
        met_all &= met
        model = (f"; {r['bf16_model']['ms'] / t['ms']:.2f}x bf16 SwiGLU + F.linear as the model runs it"
                 if "bf16_model" in r else "")
        print(f"{r['shape']:9} triton {t['ms']:.3f} ms = {t['ratio_to_bf16']:.2f}x bf16 F.linear{model}: target "
              f">= {TARGET}x {'met' if met else 'MISSED'}; error {t['rel_err']:.2e} = "
              f"{r['triton_err_over_kitchen']:.3f}x kitchen's; the method chose {r['method_choice']} "
              f"({r['method']['ratio_to_bf16']:.2f}x)")
    print(f"target met on {'all' if met_all else 'not all'} layers")
    for r in results:
        again = r["retimed_ms"]
        print(f"{r['shape']:9} timed again, the method first: method {again['method']:.3f} ms, kernel "
              f"{again['triton']:.3f} ms (first: {r['method']['ms']:.3f}, {r['triton']['ms']:.3f})")
        for cand, events in r.get("trace", {}).items():
            print(f"{'':9} {cand} over 10 calls: " + "; ".join(
                f"{e['name'][:60]} x{e['count']} {e['device_us']:.0f} us device, {e['host_us']:.0f} us host"
                for e in events))
    for r in results:
        if "gemm_persistent" in r:
            g, p = r["gemm"], r["gemm_persistent"]
            print(f"{r['shape']:9} INT8 GEMM alone {g['ms']:.3f} ms ({100 * g.get('peak_fraction', float('nan')):.0f}% "
                  f"of peak); persistent {p['ms']:.3f} ms ({100 * p.get('peak_fraction', float('nan')):.0f}%, "
                  f"{g['ms'] / p['ms']:.2f}x; {r['gemm_persistent_config']}); FP8 method "
                  f"{100 * r['fp8'].get('peak_fraction', float('nan')):.0f}%")
    for r in results:
        share = r["method"]["ms"] / r["w4a8"]["ms"]
        over_kitchen = r["w4a8_kitchen"]["ms"] / r["w4a8"]["ms"]
        print(f"{r['shape']:9} w4a8 {r['w4a8']['ms']:.3f} ms = {share:.2f}x the INT8 method's speed (target >= "
              f"{W4A8_TARGET}x {'met' if share >= W4A8_TARGET else 'MISSED'}), {over_kitchen:.2f}x "
              f"comfy-kitchen's W4A8 linear; error {r['w4a8']['rel_err']:.2e} against kitchen's "
              f"{r['w4a8_kitchen']['rel_err']:.2e}; decode alone {r['w4a8_decode']['ms']:.3f} ms, kitchen's "
              f"{r['w4a8_decode_kitchen']['ms']:.3f}")
        if "w4a8_fused" in r:
            fused = r["w4a8_fused"]
            print(f"{'':9} codes decoded in the GEMM's main loop: {fused['ms']:.3f} ms = "
                  f"{r['method']['ms'] / fused['ms']:.2f}x the INT8 method's speed, {r['w4a8']['ms'] / fused['ms']:.2f}x "
                  f"the pack's W4A8 ({r['w4a8_fused_config']}); error {fused['rel_err']:.2e}")
    write_json(Path(args.out) if args.out else default_out("int8_linear"), {
        "bench": "int8_linear", "env": environment(), "group_size": GROUP, "target": TARGET,
        "w4a8_target": W4A8_TARGET, "peaks": peak,
        "rows": results, "method_timings_ms": {str(k): v for k, v in chooser().timings.items()}})


if __name__ == "__main__":
    main()
