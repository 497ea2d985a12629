"""What the INT8 kernels' first launches cost, and what compiling them side by side would: on a CPU too.

A first run of the pack compiles its Triton kernels at their first launches, one after another, in the first
sampler step (the whole-job benchmark's `kernel_first_launches`: 9.6 s on an H100 for H3's turbo job). This
compiles, for a CUDA target (Hopper by default: no GPU needed), the kernels one H3 pruned layer shape launches
(the activation pass, the TMA GEMM, and the GEMM with a LoRA's up projection in its epilogue) at its four shapes,
with the configs the pack ships for that target (else its rule), into an empty Triton cache: first one after
another, then all at once on a thread pool of one worker per CPU (Triton's compiler passes and ptxas run
outside Python's lock); kernels two shapes share (the same K and config) count once, into another empty cache. It prints and writes the seconds of each, their ratio, and how much the process's resident memory grew
during each (sampled every 5 ms: what a pool of compiles costs the host's RAM).

    python tests/bench/triton_compile.py [--arch 90] [--out FILE]
"""
import argparse
import datetime
import os
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from _pack import RESULTS, gpu_slug, write_json

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from bigdit.quant import int8_lora, int8_triton
from bigdit.quant.kernel_select import rows_bucket

SHAPES = {"qkv_proj": (5376, 21504, False), "out_proj": (7168, 5376, False), "fc1": (5376, 28672, False),
          "fc2": (14336, 5376, True)}  # name: (K, N, SwiGLU before it)
ROWS = 15_000  # about the rows of the H3 template's 864x480 job
GROUP = 256
SHARED_MEMORY = {90: 232448, 89: 101376, 86: 101376, 80: 166912, 120: 101376}  # opt-in bytes per block


def config(kernel: str, shape: dict, arch: int) -> dict:
    family = f"sm{arch}"
    shipped = int8_triton.SHIPPED[1].get(family, {}).get(kernel, {}).get(int8_triton.shape_text(kernel, shape))
    if int8_triton.SHIPPED[0] == int8_triton.KERNEL_VERSION and int8_triton.fits(kernel, shipped, shape):
        return dict(shipped)
    if kernel == "activation":
        return int8_triton.activation_rule(shape)
    return int8_triton.gemm_rule(shape, kernel == "gemm_tma", SHARED_MEMORY.get(arch, 101376))


def sources(arch: int) -> list[tuple[str, ASTSource, dict]]:
    """(label, source, options) of each kernel a first step compiles at H3 pruned's shapes."""
    out = []
    common = {"out_ptr": "*bf16", "a_scale_ptr": "*fp32", "w_scale_ptr": "*fp32", "bias_ptr": "*fp32", "M": "i32",
              "N": "i32", "stride_out": "i32"}
    for name, (k, n, swiglu) in SHAPES.items():
        act_shape = {"M_BUCKET": rows_bucket(ROWS), "K": k, "G": GROUP, "SWIGLU": swiglu, "ROTATE": True}
        meta, run = int8_triton._split(config("activation", act_shape, arch))
        meta.update(int8_triton.row_tiles(meta["WIDTH"], k, GROUP))
        out.append((f"{name} activation", ASTSource(
            fn=int8_triton._rotate_quantize_kernel,
            signature={"x_ptr": "*bf16", "h_ptr": "*fp32", "q_ptr": "*i8", "scale_ptr": "*fp32", "M": "i32",
                       "stride_x": "i32", "stride_q": "i32", "K": "constexpr", "G": "constexpr",
                       "HG": "constexpr", "SWIGLU": "constexpr", "ROTATE": "constexpr", "ROWS": "constexpr",
                       "WIDTH": "constexpr", "W1": "constexpr", "W2": "constexpr"},
            constexprs={"K": k, "G": GROUP, "HG": int8_triton.KRON, "SWIGLU": swiglu, "ROTATE": True, **meta}), run))
        shape = {"M_BUCKET": rows_bucket(ROWS), "N": n, "K": k}
        meta, run = int8_triton._split(config("gemm_tma", shape, arch))
        descs = {"a_desc": f"tensordesc<i8[{meta['BLOCK_M']}, {meta['BLOCK_K']}]>",
                 "w_desc": f"tensordesc<i8[{meta['BLOCK_N']}, {meta['BLOCK_K']}]>"}
        flags = {"K": k, "PER_CHANNEL": True, "HAS_BIAS": False, **meta}
        out.append((f"{name} gemm", ASTSource(
            fn=int8_triton._gemm_tma_kernel,
            signature={**descs, **common, **{key: "constexpr" for key in flags}}, constexprs=flags), run))
        lora = {**flags, "BLOCK_R": int8_lora.BLOCK_R}
        out.append((f"{name} gemm + LoRA", ASTSource(
            fn=int8_lora._gemm_low_rank_tma_kernel,
            signature={**descs, **common, "h_ptr": "*bf16", "u_ptr": "*bf16", "alpha": "fp32",
                       "N_PER_BLOCK": "i32", "R_PER_BLOCK": "i32", "stride_h": "i32", "stride_u": "i32",
                       **{key: "constexpr" for key in lora}},
            constexprs=lora), run))
    return out


def compile_all(jobs, target, workers: int) -> tuple[float, float]:
    """(seconds, MiB the resident memory grew at its peak) to compile every job into a new, empty Triton cache, on
    `workers` threads (1: one after another)."""
    import psutil
    folder = os.environ["TRITON_CACHE_DIR"] = tempfile.mkdtemp(prefix="bigdit-triton-compile-")
    process, done = psutil.Process(), threading.Event()
    base = peak = process.memory_info().rss

    def sample():
        nonlocal peak
        while not done.wait(0.005):
            peak = max(peak, process.memory_info().rss)
    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    start = time.perf_counter()
    with ThreadPoolExecutor(workers) as pool:
        list(pool.map(lambda job: triton.compile(job[1], target=target, options=job[2]), jobs))
    seconds = time.perf_counter() - start
    done.set()
    sampler.join()
    assert len(os.listdir(folder)) >= len(jobs), "the kernels did not land in the new cache: not compiled here"
    return seconds, (peak - base) / 2 ** 20


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--arch", type=int, default=90, help="the CUDA target's compute capability, e.g. 90")
    parser.add_argument("--out", type=str, default=None)
    args = parser.parse_args()
    target = GPUTarget("cuda", args.arch, 32)
    unique: dict = {}  # the layers that share a kernel (the same K and config) compile it once
    for label, src, options in sources(args.arch):
        key = (src.hash(), tuple(sorted(options.items())))
        unique[key] = (f"{unique[key][0]}, {label}" if key in unique else label, src, options)
    jobs = list(unique.values())
    workers = os.cpu_count() or 1
    sequential, sequential_mib = compile_all(jobs, target, 1)
    parallel, parallel_mib = compile_all(jobs, target, workers)
    print(f"{len(jobs)} kernels for sm{args.arch}: {sequential:.2f} s one after another (+{sequential_mib:.0f} MiB "
          f"resident), {parallel:.2f} s on {workers} threads (+{parallel_mib:.0f} MiB; {sequential / parallel:.2f}x)")
    write_json(Path(args.out) if args.out else RESULTS / f"triton-compile-sm{args.arch}-{gpu_slug()}-{datetime.date.today()}.json", {
        "bench": "tests/bench/triton_compile.py", "triton": triton.__version__, "target": f"sm{args.arch}",
        "cpus": workers, "kernels": [label for label, _, _ in jobs], "rows": ROWS,
        "seconds": {"one after another": round(sequential, 3), f"{workers} threads": round(parallel, 3)},
        "ratio": round(sequential / parallel, 3),
        "resident_growth_mib": {"one after another": round(sequential_mib), f"{workers} threads": round(parallel_mib)}})


if __name__ == "__main__":
    main()
