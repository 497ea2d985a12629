"""Layerwise offload on a full-size MiniMax-H3-shaped stack under a 24 GiB cap (run on the GPU machine).

The stack: 50 blocks with H3's block linears (qkv_proj 5376->21504 no bias,
out_proj 7168->5376, fc1 5376->28672 + SwiGLU, fc2 14336->5376), RMSNorm and
SDPA attention at 56 heads x 128. Weights are random, generated on the GPU one
block at a time from fixed seeds (never all of them in fp32 on the host).

Configurations, each timed at every --tokens length:
  bf16_resident    all blocks on the GPU, no memory cap: the reference
  bf16_layerwise   the memory plan under torch.cuda.set_per_process_memory_fraction(cap);
                   streamed blocks in pinned host memory, copied one block ahead
  int8_<placement> INT8 ConvRot (quantize_layers on the GPU, block by block); resident if the
                   plan fits, else streamed, under the same cap

Per config and length: step time (median of CUDA-event timings) and its ratio
to the reference, peak VRAM (max_memory_allocated), the plan's estimate and
its error against that peak, host RSS, pinned bytes, the streamer's counters,
and the output against the reference (bf16 layerwise must match it exactly).
Writes JSON (VRAM samples of one forward per config included) and, where
matplotlib is installed, a VRAM-over-time PNG.

    python tests/bench/offload.py --out OUT.json --png OUT.png
    python tests/bench/offload.py --smoke      # tiny dims, runs on CPU too
"""
import argparse
import contextlib
import statistics
import sys
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import psutil
import torch
import torch.nn.functional as F
from torch import nn

from _pack import PACK_ROOT, default_out, environment, write_json

sys.path.insert(0, str(PACK_ROOT / "tests"))  # for offload_helpers, shared with the offload tests
from offload_helpers import all_resident, move_blocks_to_host, pinned_bytes  # noqa: E402

from bigdit.offload.plan import (CUDA_WORKSPACE_BYTES, GIB, RunShape, activation_bytes, find_blocks,
                                         module_bytes, plan_for_model)
from bigdit.offload.streaming import HostPins, LayerwiseStreamer
from bigdit.quant import QuantConfig, apply_replacements, quantize_layers
from bigdit.quant.int8_convrot import Int8ConvRotMethod


@dataclass(frozen=True)
class Dims:
    hidden: int = 5376
    heads: int = 56
    head_dim: int = 128
    ffn: int = 14336
    blocks: int = 50

    @property
    def inner(self) -> int:
        return self.heads * self.head_dim


H3 = Dims()
SMOKE = Dims(hidden=256, heads=2, head_dim=128, ffn=512, blocks=6)


class H3Block(nn.Module):
    """H3's block linears around a pre-norm attention + SwiGLU MLP (no modulation)."""

    def __init__(self, dims: Dims, device=None, dtype=None):
        super().__init__()
        kw = {"device": device, "dtype": dtype}
        self.dims = dims
        self.norm1 = nn.RMSNorm(dims.hidden, eps=1e-6, **kw)
        self.qkv_proj = nn.Linear(dims.hidden, 3 * dims.inner, bias=False, **kw)
        self.out_proj = nn.Linear(dims.inner, dims.hidden, **kw)
        self.norm2 = nn.RMSNorm(dims.hidden, eps=1e-6, **kw)
        self.fc1 = nn.Linear(dims.hidden, 2 * dims.ffn, **kw)
        self.fc2 = nn.Linear(dims.ffn, dims.hidden, **kw)

    def forward(self, x):
        b, t, _ = x.shape
        d = self.dims
        qkv = self.qkv_proj(self.norm1(x))
        q, k, v = qkv.view(b, t, 3, d.heads, d.head_dim).permute(2, 0, 3, 1, 4).unbind(0)
        o = F.scaled_dot_product_attention(q, k, v)
        del qkv, q, k, v
        x = x + self.out_proj(o.transpose(1, 2).reshape(b, t, d.inner))
        del o
        gate, up = self.fc1(self.norm2(x)).chunk(2, dim=-1)
        a = F.silu(gate) * up
        del gate, up
        return x + self.fc2(a)


class Stack(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList()

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return x


@torch.no_grad()
def make_block(dims: Dims, seed: int, device: torch.device, dtype=torch.bfloat16) -> H3Block:
    """Random weights drawn on `device` from `seed`: the same block on every run."""
    block = H3Block(dims, device="meta", dtype=dtype).to_empty(device=device)
    gen = torch.Generator(device=device).manual_seed(seed)
    for name, p in block.named_parameters():
        if name.startswith("norm"):
            p.fill_(1.0)
        elif p.dim() == 2:
            p.normal_(0.0, p.shape[1] ** -0.5, generator=gen)
        else:
            p.normal_(0.0, 0.02, generator=gen)
    return block


def make_stack(dims: Dims, device: torch.device, int8: bool) -> Stack:
    stack = Stack()
    for i in range(dims.blocks):
        block = make_block(dims, 1000 + i, device)
        if int8:
            config = QuantConfig(method=Int8ConvRotMethod(256), compute_device=device)
            replacements, _ = quantize_layers(block, config, title=f"block {i}")
            apply_replacements(block, replacements)
        stack.blocks.append(block)
    return stack


def make_input(dims: Dims, tokens: int, device: torch.device) -> torch.Tensor:
    gen = torch.Generator(device=device).manual_seed(tokens)
    return torch.randn(1, tokens, dims.hidden, device=device, dtype=torch.bfloat16, generator=gen)


def run_shape(dims: Dims, tokens: int) -> RunShape:
    return RunShape(tokens=tokens, hidden=dims.hidden, heads=dims.heads, head_dim=dims.head_dim, ffn=dims.ffn,
                    gated=True, dtype=torch.bfloat16)


# ---- measuring ----------------------------------------------------------------

def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def rss() -> int:
    return psutil.Process().memory_info().rss


def set_cap(device, cap_bytes):
    """Cap the caching allocator (None: lift the cap); cached blocks are released first."""
    if device.type != "cuda":
        return
    torch.cuda.empty_cache()
    total = torch.cuda.get_device_properties(device).total_memory
    index = device.index if device.index is not None else torch.cuda.current_device()
    torch.cuda.set_per_process_memory_fraction(1.0 if cap_bytes is None else cap_bytes / total, index)


@torch.no_grad()
def time_forward(stack, x, iters) -> tuple[float, torch.Tensor]:
    """Median ms of `iters` forwards after one warm-up (kernel choice, allocator), and the output."""
    device = x.device
    stack(x)
    sync(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    times, out = [], None
    for _ in range(iters):
        out = None  # the previous output is no part of the next forward's memory
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            out = stack(x)
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            out = stack(x)
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times), out


@torch.no_grad()
def vram_trace(stack, x, period_s=0.002) -> list[tuple[float, int]]:
    """(ms, bytes allocated) through one forward. Each block's end waits for the compute stream (not the
    copy stream), so host time follows the GPU and prefetches still overlap."""
    device = x.device
    if device.type != "cuda":
        return []
    samples, stop = [], threading.Event()
    t0 = time.perf_counter()

    def sample():
        while not stop.is_set():
            samples.append(((time.perf_counter() - t0) * 1e3, torch.cuda.memory_allocated(device)))
            time.sleep(period_s)

    handles = [b.register_forward_hook(lambda *a: torch.cuda.current_stream(device).synchronize())
               for b in stack.blocks]
    sync(device)
    thread = threading.Thread(target=sample, daemon=True)
    thread.start()
    try:
        stack(x)
        sync(device)
    finally:
        stop.set()
        thread.join()
        for h in handles:
            h.remove()
    return samples


def pcie_gbps(device) -> dict:
    """Host-to-device bandwidth of a 1 GiB copy, pinned and pageable: what bounds streaming."""
    if device.type != "cuda":
        return {}
    out = {}
    dst = torch.empty(GIB, dtype=torch.uint8, device=device)
    for kind, pinned in (("pinned", True), ("pageable", False)):
        src = torch.ones(GIB, dtype=torch.uint8, pin_memory=pinned)
        dst.copy_(src, non_blocking=True)
        sync(device)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src, non_blocking=True)
        end.record()
        end.synchronize()
        out[f"h2d_{kind}_gbps"] = GIB / start.elapsed_time(end) / 1e6
        del src
    del dst
    torch.cuda.empty_cache()
    if hasattr(torch._C, "_host_emptyCache"):  # the pinned source stays cached (and in RSS) otherwise
        torch._C._host_emptyCache()
    return out


# ---- one configuration ------------------------------------------------------------

def place(stack, plan, device) -> dict:
    """Move the plan's streamed blocks to host memory, pinned in place."""
    pins = HostPins()
    t0 = time.perf_counter()
    moved = move_blocks_to_host(stack.blocks, plan.streamed, pins if device.type == "cuda" else None)
    sync(device)
    return {"pins": pins, "host_weight_bytes": moved, "pinned_bytes": pinned_bytes(pins),
            "place_seconds": time.perf_counter() - t0}


def run_config(name, stack, plan, dims, lengths, device, iters, reference, cap_bytes) -> dict:
    placement = place(stack, plan, device) if plan is not None and plan.streamed else None
    set_cap(device, cap_bytes)
    result = {"config": name, "cap_bytes": cap_bytes, "weight_bytes": module_bytes(stack), "runs": [],
              "rss_bytes": rss()}
    if plan is not None:
        result["plan"] = {"summary": plan.summary_line(), "text": plan.render(), "streamed": list(plan.streamed),
                          "budget_bytes": plan.budget_bytes}
    if placement is not None:
        result.update({k: v for k, v in placement.items() if k != "pins"})
    streamer = (LayerwiseStreamer(stack.blocks, device, plan.streamed, pins=placement["pins"])
                if placement is not None else contextlib.nullcontext())
    try:
        with streamer:
            for tokens in lengths:
                x = make_input(dims, tokens, device)
                ms, out = time_forward(stack, x, iters)
                run = {"tokens": tokens, "ms": ms, "rss_bytes": rss()}
                if device.type == "cuda":
                    run["peak_bytes"] = torch.cuda.max_memory_allocated(device)
                    run["peak_reserved_bytes"] = torch.cuda.max_memory_reserved(device)
                if plan is not None:
                    estimate = (plan.estimated_peak - plan.activation_bytes
                                + activation_bytes(run_shape(dims, tokens)))
                    run["estimate_bytes"] = estimate
                    if "peak_bytes" in run:
                        run["estimate_error"] = estimate / run["peak_bytes"] - 1
                out = out.cpu()
                if tokens in reference:
                    ref = reference[tokens]
                    run["ms_ratio"] = ms / ref["ms"]
                    run["exact"] = bool(torch.equal(out, ref["out"]))
                    run["max_abs_diff"] = (out.float() - ref["out"].float()).abs().max().item()
                    # float64: a float32 sum over ~1e8 elements drifts past 1.0
                    run["cosine"] = F.cosine_similarity(out.double().flatten(), ref["out"].double().flatten(),
                                                        dim=0).item()
                else:
                    reference[tokens] = {"ms": ms, "out": out}
                result["runs"].append(run)
                print(f"  {name:16} {tokens:>6} tokens: {ms:9.1f} ms"
                      + (f"  x{run['ms_ratio']:.3f}" if "ms_ratio" in run else "")
                      + (f"  peak {run['peak_bytes'] / GIB:6.2f} GiB" if "peak_bytes" in run else "")
                      + (f"  est {run['estimate_bytes'] / GIB:6.2f} GiB" if "estimate_bytes" in run else "")
                      + (f"  exact {run['exact']}" if "exact" in run else ""), flush=True)
                del x
            result["vram_samples"] = vram_trace(stack, make_input(dims, max(lengths), device))
        if placement is not None:
            result["stream_stats"] = asdict(streamer.stats)
            result["stream_stats"]["late"] = streamer.stats.late
    finally:
        if placement is not None:
            placement["pins"].release()
        set_cap(device, None)
    return result


def plan_stack(stack, dims, lengths, cap_bytes, reserve_bytes, device):
    workspace = CUDA_WORKSPACE_BYTES if device.type == "cuda" else 0
    return plan_for_model(stack, find_blocks(stack), run_shape(dims, max(lengths)), cap_bytes, reserve_bytes,
                          workspace_bytes=workspace)


# ---- report -------------------------------------------------------------------------

def targets(results, cap_bytes, baseline_rss) -> dict:
    layerwise = next((r for r in results if r["config"] == "bf16_layerwise"), None)
    if layerwise is None or not layerwise["runs"]:
        return {}
    longest = max(layerwise["runs"], key=lambda r: r["tokens"])
    out = {"tokens": longest["tokens"], "ms_ratio": longest.get("ms_ratio"), "ms_ratio_target": 1.10,
           "rss_over_all_weights": longest["rss_bytes"] / layerwise["weight_bytes"], "rss_target": 1.1}
    if layerwise.get("host_weight_bytes"):
        out["rss_over_host_weights"] = longest["rss_bytes"] / layerwise["host_weight_bytes"]
        out["rss_above_baseline_over_host_weights"] = ((longest["rss_bytes"] - baseline_rss)
                                                       / layerwise["host_weight_bytes"])
    if "peak_bytes" in longest:
        out.update({"peak_gib": longest["peak_bytes"] / GIB, "peak_target_gib": 22.0,
                    "cap_gib": cap_bytes / GIB, "estimate_error": longest.get("estimate_error")})
    return out


def plot(results, path: Path, cap_bytes):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: VRAM samples are in the JSON only")
        return
    fig, ax = plt.subplots(figsize=(10, 5))
    for r in results:
        if r.get("vram_samples"):
            t, b = zip(*r["vram_samples"])
            ax.plot(t, [v / GIB for v in b], label=r["config"], linewidth=1)
            longest = max(r["runs"], key=lambda run: run["tokens"]) if r["runs"] else {}
            if "estimate_bytes" in longest:
                ax.axhline(longest["estimate_bytes"] / GIB, linestyle=":", linewidth=0.8,
                           color=ax.lines[-1].get_color())
    if cap_bytes:
        ax.axhline(cap_bytes / GIB, color="red", linewidth=1, label=f"cap {cap_bytes / GIB:.0f} GiB")
    ax.set_xlabel("time in one forward (ms)")
    ax.set_ylabel("allocated VRAM (GiB)")
    ax.set_title("H3-shaped stack, one forward at the longest length (dotted: plan estimate)")
    ax.legend(loc="upper right")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    print(f"wrote {path}")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, nargs="+", default=None, help="lengths (default 32760 8190)")
    ap.add_argument("--cap-gib", type=float, default=24.0, help="memory cap for the offloaded configs")
    ap.add_argument("--reserve-gib", type=float, default=2.0, help="the plan's reserve under the cap")
    ap.add_argument("--iters", type=int, default=2, help="timed forwards per length (after one warm-up)")
    ap.add_argument("--configs", nargs="+", default=["bf16_resident", "bf16_layerwise", "int8"])
    ap.add_argument("--smoke", action="store_true", help="tiny dims (runs on CPU): checks the code paths")
    ap.add_argument("--out", default=None)
    ap.add_argument("--png", default=None)
    args = ap.parse_args()

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dims = SMOKE if args.smoke else H3
    lengths = sorted(args.tokens or ([256, 64] if args.smoke else [32760, 8190]), reverse=True)
    cap_bytes, reserve_bytes = int(args.cap_gib * GIB), int(args.reserve_gib * GIB)
    if args.smoke:  # a cap the tiny stack does not fit in, so blocks stream
        block = module_bytes(make_block(dims, 0, torch.device("cpu")))
        cap_bytes = int(dims.blocks * block * 0.6 + activation_bytes(run_shape(dims, max(lengths))))
        reserve_bytes = 0
    out_path = Path(args.out) if args.out else default_out("offload")
    print(f"{dims} on {device}; lengths {lengths}; cap {cap_bytes / GIB:.3f} GiB, reserve {reserve_bytes / GIB} GiB")

    pcie = pcie_gbps(device)  # also starts CUDA, so the baseline includes its host memory
    payload = {"bench": "offload", "env": environment(), "dims": asdict(dims), "lengths": lengths,
               "cap_bytes": cap_bytes, "reserve_bytes": reserve_bytes, "baseline_rss_bytes": rss(),
               "pcie": pcie, "configs": []}
    print(f"PCIe: {payload['pcie']}")
    reference: dict = {}
    results = payload["configs"]

    t0 = time.perf_counter()
    stack = make_stack(dims, device, int8=False)
    sync(device)
    print(f"bf16 stack: {module_bytes(stack) / GIB:.2f} GiB in {time.perf_counter() - t0:.1f} s")
    if "bf16_resident" in args.configs or "bf16_layerwise" in args.configs:
        results.append(run_config("bf16_resident", stack, None, dims, lengths, device, args.iters, reference, None))
    if "bf16_layerwise" in args.configs:
        plan = plan_stack(stack, dims, lengths, cap_bytes, reserve_bytes, device)
        print(plan.render())
        results.append(run_config("bf16_layerwise", stack, plan, dims, lengths, device, args.iters, reference,
                                  cap_bytes))
    del stack
    set_cap(device, None)

    if "int8" in args.configs:
        t0 = time.perf_counter()
        stack = make_stack(dims, device, int8=True)
        sync(device)
        print(f"int8 stack: {module_bytes(stack) / GIB:.2f} GiB, quantized in {time.perf_counter() - t0:.1f} s")
        plan = plan_stack(stack, dims, lengths, cap_bytes, reserve_bytes, device)
        print(plan.render())
        name = "int8_resident" if all_resident(plan) else "int8_layerwise"
        results.append(run_config(name, stack, plan, dims, lengths, device, args.iters, reference, cap_bytes))
        del stack

    payload["targets"] = targets(results, cap_bytes, payload["baseline_rss_bytes"])
    print(f"targets: {payload['targets']}")
    write_json(out_path, payload)
    plot(results, Path(args.png) if args.png else out_path.with_suffix(".png"), cap_bytes)


if __name__ == "__main__":
    main()
