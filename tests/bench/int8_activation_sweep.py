"""The INT8 activation kernel (quant/int8_triton.py `_rotate_quantize_kernel`: input activation, ConvRot rotation,
per-row quantization) timed over a grid of configs at MiniMax-H3 pruned's four input widths (run on a GPU).

For each shape (int8_linear.py's SHAPES: K, with fc2's SwiGLU) at --rows rows: every config of CONFIGS, and the
row held whole in power-of-two pieces (WIDTH = K; with --short these and today's config only), that fits the shape
(`int8_triton.fits`), ms per call (CUDA events, median of three runs of ten calls) and the share of the GPU's memory
bandwidth its bytes (x read once, int8 rows and scales written) would take at the device-to-device
copy rate measured in the same run, and whether its rows and scales equal those of the config the pack runs today
(store, shipped table or rule; marked): one that differs is left out of the ranking. The fastest is named with its
ratio to today's. A config that does not compile or run is listed with its error. Today's config is also timed
with parts of the work left out (`without`: the rotation; at fc2 SwiGLU, its input's first half read instead), to
show what limits a pass that is far from its bytes' floor.

    python tests/bench/int8_activation_sweep.py [--rows 32700] [--short] [--out FILE]
"""
import argparse
import itertools

import torch

from _pack import cuda_time_ms, default_out, environment, write_json
from int8_linear import GROUP, SHAPES

from bigdit.quant import int8_triton

CONFIGS = [{"ROWS": rows, "WIDTH": width, "num_warps": warps, "num_stages": 3}
           for rows, width, warps in itertools.product((1, 2, 4), (2048, 4096, 8192, 16384), (4, 8, 16))
           if rows * width <= 16384 or (rows, width) == (2, 16384)]


def copy_rate_gib_s(device) -> float:
    """Device-to-device copy of 1 GiB: bytes read plus written per second."""
    a = torch.empty(2 ** 30, dtype=torch.uint8, device=device)
    b = torch.empty_like(a)
    ms = cuda_time_ms(lambda: b.copy_(a), iters=5)
    return 2 * a.numel() / 2 ** 30 / (ms / 1e3)


def sweep_shape(name, k, act, rows, rate, short=False, device="cuda"):
    x = torch.randn(rows, 2 * k if act == "swiglu" else k, device=device, dtype=torch.bfloat16)
    q, scale, launch = int8_triton._rows_launch(x, True, GROUP, act)
    current, source = int8_triton.choose_config("activation", launch.shape, launch.device)
    moved = x.numel() * x.element_size() + q.numel() + scale.numel() * 4
    floor_ms = moved / 2 ** 30 / rate * 1e3
    results, reference = [], None
    whole = [{"ROWS": 1, "WIDTH": k, "num_warps": warps, "num_stages": 3} for warps in (4, 8, 16)]  # in pieces
    for config in [current] + [c for c in ([] if short else CONFIGS) + whole if c != current]:
        if not int8_triton.fits("activation", config, launch.shape):
            continue
        try:
            q.zero_()
            launch.launch(config)
            if config == current:  # today's rows and scales: every other config must give the same
                reference = q.clone(), scale.clone()
            # None: today's config did not run, so there is nothing to hold this one to
            same = None if reference is None else torch.equal(q, reference[0]) and torch.equal(scale, reference[1])
            ms = cuda_time_ms(lambda: launch.launch(config))
            results.append({"config": config, "ms": round(ms, 4), "of_bandwidth": round(floor_ms / ms, 3),
                            "same_as_today": same})
        except Exception as exc:  # a config this GPU cannot run (registers, shared memory)
            results.append({"config": config, "error": f"{type(exc).__name__}: {str(exc)[:160]}"})
    timed = [r for r in results if "ms" in r and r["same_as_today"] is not False]
    for r in results:
        if "ms" in r and r["same_as_today"] is False:
            print(f"    {r['config']}: rows or scales differ from today's config's; left out")
    if not timed:
        print(f"{name:9s} K={k}: no config ran")
        return {"shape": name, "K": k, "act": act, "rows": rows, "current": current, "results": results}
    best = min(timed, key=lambda r: r["ms"])
    now = timed[0] if timed[0]["config"] == current else None
    print(f"{name:9s} K={k} {act or '':6s} floor {floor_ms:.3f} ms ({moved / 2 ** 30:.2f} GiB moved)")
    for r in sorted(timed, key=lambda r: r["ms"])[:8]:
        mark = " <- runs today (" + source + ")" if r["config"] == current else ""
        print(f"    {r['ms']:.3f} ms {r['of_bandwidth']:5.0%} of bandwidth  {r['config']}{mark}")
    if now is not None:
        print(f"    today {now['ms']:.3f} ms; fastest {best['ms']:.3f} ms ({now['ms'] / best['ms']:.2f}x)")
    parts = without_parts(x, act, current, device)
    if parts:
        print("    today's config " + ", ".join(f"{what} {ms:.3f} ms" for what, ms in parts.items()))
    return {"shape": name, "K": k, "act": act, "rows": rows, "current": current, "current_source": source,
            "floor_ms": floor_ms, "fastest": best, "results": results, "without": parts}


def without_parts(x, act, config, device) -> dict:
    """ms of today's config with a part of the work left out (its outputs are not the layer's): without the
    rotation, and with SwiGLU's input without SwiGLU (the first half of the row read), so that what each costs
    beside the bytes shows."""
    variants = {"without the rotation": (x, False, act)}
    if act == "swiglu":
        half = x[:, :x.shape[1] // 2]
        variants["without SwiGLU (half the row read)"] = (half, True, None)
        variants["without either"] = (half, False, None)
    out = {}
    for what, (rows, convrot, input_act) in variants.items():
        _, _, launch = int8_triton._rows_launch(rows, convrot, GROUP, input_act)
        if not int8_triton.fits("activation", config, launch.shape):
            continue
        try:
            out[what] = round(cuda_time_ms(lambda: launch.launch(config)), 4)
        except Exception as exc:  # as in the sweep: a variant this GPU cannot run is said, not fatal
            out[what] = f"{type(exc).__name__}: {str(exc)[:160]}"
    return out


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=32700)
    parser.add_argument("--out", default=None)
    parser.add_argument("--short", action="store_true", help="today's config and the row in pieces only")
    opts = parser.parse_args()
    torch.manual_seed(0)
    rate = copy_rate_gib_s("cuda")
    print(f"{torch.cuda.get_device_name()}: device copy {rate:.0f} GiB/s; {len(CONFIGS)} configs")
    shapes = [sweep_shape(name, k, act, opts.rows, rate, opts.short) for name, (k, _, act) in SHAPES.items()]
    write_json(opts.out or default_out(f"int8-activation-sweep-{opts.rows}"),
               {"bench": "int8_activation_sweep", "environment": environment(), "copy_gib_s": rate,
                "shapes": shapes})


if __name__ == "__main__":
    main()
