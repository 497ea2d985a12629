"""A LoRA's branch beside the pack's INT8 layers at MiniMax-H3 pruned's shapes (run on a GPU, with upstream ComfyUI
importable: --comfyui or BIGDIT_COMFYUI): what the branch (host/lora_branch.py) adds to each layer's call.

For each of H3's four Linear shapes at 32,700 rows (INT8 ConvRot, group 256, as the official file; fc2 takes SwiGLU
of fc1's 28672-wide output, as the model runs it), with the turbo LoRA's ranks (128; 384 on the fused qkv): the layer
as the pack runs it (Int8ConvRotMethod, its measured kernel), the same layer with the branch through its
output_branches (its hidden from the INT8 path's quantized rows, its up projection in the Triton GEMM's epilogue,
quant/int8_lora.py; `branch_vs_bypass_rel`: its part's error against `h`'s), the same without that fusion (the
branch's addmm after the GEMM: `unfused`), and for comparison the same product as upstream's bypass
`h` computes it (two F.linear, a scale, then the sum with the layer's output). Each: ms (CUDA events, warmed up, median of three runs of ten calls); the
branch's cost in ms and in % of the layer; the sum over one block (its four layers). With --step-s (the s/step
measured at that length, e.g. from whole_job.py) and --blocks, the branch's share of a step; the target is at most 3%.
One more qkv row, `side by side`: the same rank 384 made of q, k and v's rank-128 LoRAs (up block-diagonal, the
form a fused projection's LoRA takes when made of separate projections' LoRAs), whose off-diagonal blocks the
epilogue does not read; the block's sum with it instead of the dense qkv row is `block_cost_ms_qkv_side_by_side`.
With --block-r, the branch again with each of those ranks per epilogue step (quant/int8_lora.py's BLOCK_R, the
kernels compiled again for each): `branch_by_block_r` {ranks: ms}, and the block's sum at each. With --lora-configs
("BLOCK_N=128,num_stages=3;num_stages=3"), the fused GEMM again with each set of changes to its shipped config (a
tile whose epilogue overlaps another tile's main loop on the same SM, say): `branch_by_config` {changes: ms}. A
variant that did not run as asked (its kernel failed, or gave way to a smaller config) records why instead.

    python tests/bench/lora_branch.py --comfyui /path/to/comfyui-0.33.0 [--rows 32700] [--step-s S --blocks N] \
        [--profile] [--block-r 16,64] [--lora-configs "BLOCK_N=128,num_stages=3;num_stages=3"]
    # --profile: each variant's CUDA kernels, the longest first
"""
import argparse
import os
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

from _pack import cuda_time_ms, default_out, environment, write_json

SHAPES = {  # name: (K, N, input activation, LoRA rank)
    "qkv_proj": (5376, 21504, None, 384),
    "out_proj": (7168, 5376, None, 128),
    "fc1": (5376, 28672, None, 128),
    "fc2": (14336, 5376, "swiglu", 128),
}
GROUP = 256
TARGET_STEP_SHARE = 0.03


def kernel_breakdown(fn, top: int = 8) -> list[dict]:
    """The CUDA kernels of one call of `fn` (torch.profiler), the longest first: [{"kernel", "ms"}]."""
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    def device_us(e):  # torch's name for it changed from cuda_time_total
        return getattr(e, "device_time_total", None) or getattr(e, "cuda_time_total", 0)
    events = sorted((e for e in prof.key_averages() if device_us(e) > 0), key=lambda e: -device_us(e))
    return [{"kernel": e.key[:90], "ms": device_us(e) / 1000} for e in events[:top]]


def bench_shape(name, k, n, act, rank, rows, profiled=False, up_blocks=1, block_rs=(), configs=()):
    from bigdit.host.layers import ComfyQuantLinear
    from bigdit.quant import int8_lora, int8_triton, witness
    from bigdit.host.lora_branch import LoraBranch
    from bigdit.quant.low_rank import LowRank
    from bigdit.quant.int8_convrot import Int8ConvRotMethod
    from bigdit.quant.kitchen_api import apply_input_act
    from bigdit.quant.linear import quantized_layer

    device = torch.device("cuda")
    torch.manual_seed(0)
    weight = torch.randn(n, k, device=device, dtype=torch.bfloat16) * k ** -0.5
    layer = quantized_layer(Int8ConvRotMethod(GROUP), weight, k, n, None, torch.bfloat16, device, device,
                            layer_type=ComfyQuantLinear)
    del weight
    x = torch.randn(rows, 2 * k if act else k, device=device, dtype=torch.bfloat16)
    down = torch.randn(rank, k, device=device, dtype=torch.bfloat16) * k ** -0.5
    up = torch.randn(n, rank, device=device, dtype=torch.bfloat16) * 0.01
    if up_blocks > 1:
        up *= torch.block_diag(*[torch.ones(n // up_blocks, rank // up_blocks, device=device,
                                            dtype=torch.bfloat16)] * up_blocks)
    scale = 0.7
    branch = LoraBranch([LowRank((None, None, None), down, None, up, scale)], {})

    def plain():
        layer.lora_branch = None
        return layer(x, input_act=act)

    def with_branch():
        layer.lora_branch = branch
        return layer(x, input_act=act)

    def unfused():  # the branch's addmm after the GEMM, as where the method cannot fuse it
        layer.lora_branch, layer.method.fuses_low_rank = branch, False
        try:
            return layer(x, input_act=act)
        finally:
            del layer.method.fuses_low_rank

    def bypass_h():  # upstream's bypass: g(f(x) + h(x)), h = up(down(x)) * scale
        layer.lora_branch = None
        xa = apply_input_act(x, act) if act else x
        return layer(x, input_act=act) + F.linear(F.linear(xa, down), up) * scale

    row = {"shape": name, "K": k, "N": n, "rows": rows, "input_act": act, "rank": rank,
           "up_blocks": branch.parts[0].blocks}
    assert row["up_blocks"] == up_blocks, row
    with torch.no_grad():
        outs = {}
        for cand, fn in (("layer", plain), ("branch", with_branch), ("unfused", unfused), ("bypass_h", bypass_h)):
            outs[cand] = fn().float()  # the first call measures the method's kernels
            row[cand] = {"ms": cuda_time_ms(fn)}
            if profiled:
                row[cand]["kernels"] = kernel_breakdown(fn)
        delta = outs["bypass_h"] - outs["layer"]
        row["branch_vs_bypass_rel"] = ((outs["branch"] - outs["bypass_h"]).norm() / delta.norm()).item()
        row["fused_vs_unfused_rel"] = ((outs["branch"] - outs["unfused"]).norm() / delta.norm()).item()
        failed, launched = int8_lora._failed, []
        own_launch = witness.launch

        def recording(kernels, first, run, config, *rest):  # the configs the kernels launch with
            launched.append(dict(config))
            return own_launch(kernels, first, run, config, *rest)

        def fused_ms(what, config=None):
            """The branch's ms as patched; raises where the fused kernel did not run, ran another config than
            `config` (one that does not fit gives way to the next, as the shipped path does), or moved the output."""
            fused, launched[:] = witness.TALLY.calls[int8_triton.TALLY, "triton+lora"], []
            changed = (with_branch().float() - outs["branch"]).norm() / delta.norm()
            # a kernel that failed leaves the call to the addmm, which is not what is timed
            assert witness.TALLY.calls[int8_triton.TALLY, "triton+lora"] == fused + 1, \
                f"{what}: the fused kernel did not run ({int8_lora._failed or 'a transient failure'})"
            assert config is None or any(config.items() <= c.items() for c in launched), \
                f"{what}: launched {launched} instead"
            assert changed < 0.01, f"{what}: {changed:.1e} of the part from the shipped one"
            return cuda_time_ms(with_branch)

        def patched(what, module, name, value, config=None):
            own = getattr(module, name)
            setattr(module, name, value)
            witness.launch = recording
            try:
                return fused_ms(what, config)
            except Exception as exc:  # one variant failing (shared memory, say) loses its row only
                return f"{type(exc).__name__}: {exc}"[:300]
            finally:
                setattr(module, name, own)
                witness.launch, int8_lora._failed = own_launch, failed  # as before, for the rows after

        row["branch_by_block_r"] = {int8_lora.BLOCK_R: row["branch"]["ms"]}
        for block_r in block_rs:
            row["branch_by_block_r"][block_r] = patched(f"BLOCK_R {block_r}", int8_lora, "BLOCK_R", block_r)
        row["branch_by_config"] = {"shipped": row["branch"]["ms"]}
        shipped_config = int8_triton.config_for
        for text, overrides in configs:
            def config_for(kernel, shape, device, launch=None, overrides=overrides):
                config = shipped_config(kernel, shape, device, launch)
                ours = shape.get("N") == n and shape.get("K") == k  # the fused GEMM's, not the hidden's
                return {**config, **overrides} if ours else config
            row["branch_by_config"][text] = patched(text, int8_triton, "config_for", config_for, overrides)
    for cand in ("branch", "unfused", "bypass_h"):
        row[cand]["cost_ms"] = row[cand]["ms"] - row["layer"]["ms"]
        row[cand]["cost_fraction"] = row[cand]["cost_ms"] / row["layer"]["ms"]
    del layer, x, outs
    torch.cuda.empty_cache()
    return row


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--comfyui", default=os.environ.get("BIGDIT_COMFYUI"),
                    help="upstream ComfyUI's folder (host/lora_branch.py imports comfy)")
    ap.add_argument("--rows", type=int, default=32700)
    ap.add_argument("--step-s", type=float, default=None, help="s/step measured at these rows")
    ap.add_argument("--blocks", type=int, default=None, help="blocks per step's forward(s)")
    ap.add_argument("--profile", action="store_true", help="also each variant's CUDA kernels, one call profiled")
    ap.add_argument("--block-r", default="", help="comma list: the branch again with these ranks per epilogue step")
    ap.add_argument("--lora-configs", default="",
                    help="';'-separated changes to the fused GEMM's config, each 'KEY=VALUE,...': the branch again")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    block_rs = [int(v) for v in args.block_r.split(",") if v]
    configs = [(text, {key: int(value) for key, value in (item.split("=") for item in text.split(","))})
               for text in args.lora_configs.split(";") if text]
    if not args.comfyui:
        raise SystemExit("give upstream ComfyUI's folder: --comfyui PATH or BIGDIT_COMFYUI")
    # each kernel compiled at its first launch: on the compile pool, the first calls (whose outputs are compared)
    # and the timed ones would run kitchen's GEMM while the Triton kernels compile
    os.environ.setdefault("BIGDIT_TRITON_COMPILE_AHEAD", "0")
    sys.path.insert(0, args.comfyui)
    import comfy.model_patcher  # noqa: F401 - ComfyUI's modules the branch's module imports

    print(f"{torch.cuda.get_device_name()}, {args.rows} rows: ms per call (branch cost: ms, % of the layer)")
    results = [bench_shape(name, *shape, args.rows, args.profile, block_rs=block_rs, configs=configs)
               for name, shape in SHAPES.items()]
    side = bench_shape("qkv_proj side by side", *SHAPES["qkv_proj"], args.rows, args.profile, up_blocks=3,
                       block_rs=block_rs, configs=configs)
    for r in results + [side]:
        print(f"{r['shape']:9} rank {r['rank']:3}: layer {r['layer']['ms']:7.3f}  with the branch "
              f"{r['branch']['ms']:7.3f} (+{r['branch']['cost_ms']:.3f}, {100 * r['branch']['cost_fraction']:.1f}%)"
              f"  unfused {r['unfused']['ms']:7.3f} (+{r['unfused']['cost_ms']:.3f})"
              f"  as bypass h {r['bypass_h']['ms']:7.3f} (+{r['bypass_h']['cost_ms']:.3f})"
              f"  branch vs h: {r['branch_vs_bypass_rel']:.1e}, vs unfused {r['fused_vs_unfused_rel']:.1e}",
              flush=True)
        for key, what in (("branch_by_block_r", "ranks per epilogue step"), ("branch_by_config", "GEMM config")):
            if len(r[key]) > 1:
                print(f"    the branch by {what}: " + ", ".join(
                    f"{v}: {ms:.3f} (+{ms - r['layer']['ms']:.3f})" if isinstance(ms, float) else f"{v}: {ms}"
                    for v, ms in r[key].items()))
        for cand in ("layer", "branch", "unfused") if args.profile else ():
            print(f"    {cand:6} " + "; ".join(f"{k['kernel'][:48]} {k['ms']:.3f}" for k in r[cand]["kernels"]))
    block = {c: sum(r[c]["cost_ms"] for r in results) for c in ("branch", "unfused", "bypass_h")}
    summary = {"block_cost_ms": block, "block_layers_ms": sum(r["layer"]["ms"] for r in results),
               "block_cost_ms_qkv_side_by_side": block["branch"] - results[0]["branch"]["cost_ms"]
               + side["branch"]["cost_ms"]}
    for key, what in (("branch_by_block_r", "ranks per epilogue step"), ("branch_by_config", "GEMM config")):
        if len(results[0][key]) > 1:  # the block's branch at each variant that ran at all four shapes
            summary[f"block_cost_ms_{key[len('branch_'):]}"] = sums = {
                v: sum(r[key][v] - r["layer"]["ms"] for r in results)
                for v in results[0][key] if all(isinstance(r[key][v], float) for r in results)}
            print(f"one block's branch by {what}: " + ", ".join(f"{v}: {ms:.2f} ms" for v, ms in sums.items()))
    print(f"one block: the four layers {summary['block_layers_ms']:.2f} ms; the branch adds {block['branch']:.2f} ms "
          f"(unfused {block['unfused']:.2f} ms, as bypass h {block['bypass_h']:.2f} ms); with qkv's LoRA side by side "
          f"{summary['block_cost_ms_qkv_side_by_side']:.2f} ms")
    if args.step_s and args.blocks:
        share = block["branch"] * args.blocks / 1000 / args.step_s
        summary["step_share"] = share
        print(f"per step ({args.blocks} blocks, {args.step_s} s/step): the branch {100 * share:.2f}% "
              f"(target <= {100 * TARGET_STEP_SHARE:.0f}%: {'met' if share <= TARGET_STEP_SHARE else 'MISSED'})")
    write_json(Path(args.out) if args.out else default_out("lora_branch"), {
        "bench": "lora_branch", "env": environment(), "group_size": GROUP, "rows": results + [side],
        "summary": summary})


if __name__ == "__main__":
    main()
