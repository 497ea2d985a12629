"""Charts of the benchmark results, for docs/benchmarks.md: one PNG beside each JSON in tests/bench/results/.

    python tests/bench/plot.py [RESULTS_DIR]

- formats-*.json (+ mxfp4-*.json of the same GPU and date): speed-up over bf16 of each
  weight format on MiniMax-H3's linear layers, per layer, at each measured token count.
- attention-*.json: speed-up of each attention backend over cuDNN SDPA, with its PSNR.
- offload-*.json: allocated VRAM through one forward per configuration, with the cap.
- comfy-e2e-*.json: sampler step speed-up over everything resident per configuration in a real ComfyUI, per
  length, with each one's peak VRAM and latent cosine to the reference.

Needs matplotlib (not a test dependency: `pip install matplotlib`).
"""
import json
import re
import sys
from pathlib import Path

import matplotlib
from _pack import slug

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
GIB = 1024 ** 3
FORMAT_COLUMNS = {"int8_convrot": "INT8 ConvRot", "float8_e4m3fn": "FP8 e4m3", "auto": "auto", "mxfp4": "MXFP4"}


def gpu_name(data) -> str:
    env = data.get("env") or data.get("environment") or {}
    return env.get("gpu", "unknown GPU")


def companion(path: Path, bench: str) -> Path | None:
    """The `bench` result of the same GPU and date as `path` (formats-X.json -> mxfp4-X.json)."""
    other = path.with_name(bench + path.name[path.name.index("-"):])
    return other if other.exists() else None


def bar_groups(ax, groups: list[str], series: dict[str, list[float]]):
    width = 0.8 / len(series)
    for i, (label, values) in enumerate(series.items()):
        xs = [g + (i - (len(series) - 1) / 2) * width for g in range(len(groups))]
        bars = ax.bar(xs, values, width, label=label)
        ax.bar_label(bars, labels=[f"{v:.2f}" if v == v else "" for v in values], fontsize=7, padding=1)
    ax.set_xticks(range(len(groups)), groups)
    ax.axhline(1.0, color="black", linewidth=0.8)


def plot_formats(path: Path) -> Path:
    data = json.loads(path.read_text())
    rows = data["rows"]
    mxfp4_path = companion(path, "mxfp4")
    mxfp4 = {}
    if mxfp4_path:
        mxfp4 = {(r["shape"], r["rows"]): r["mxfp4_ratio"] for r in json.loads(mxfp4_path.read_text())["rows"]}
    token_counts = sorted({r["rows"] for r in rows})
    fig, axes = plt.subplots(1, len(token_counts), figsize=(6 * len(token_counts), 4.2), sharey=True, squeeze=False)
    for ax, tokens in zip(axes[0], token_counts):
        at = [r for r in rows if r["rows"] == tokens]
        series = {label: [r.get(f"{key}_ratio", float("nan")) for r in at]
                  for key, label in FORMAT_COLUMNS.items() if key != "mxfp4"}
        if mxfp4:
            series["MXFP4"] = [mxfp4.get((r["shape"], tokens), float("nan")) for r in at]
        bar_groups(ax, [r["shape"] for r in at], series)
        ax.set_title(f"{tokens:,} tokens")
    axes[0][0].set_ylabel("speed-up over bf16 (higher is faster)")
    top = max(r.get(f"{key}_ratio", 0) for r in rows for key in FORMAT_COLUMNS)
    axes[0][0].set_ylim(0, top * 1.3)  # room for the legend above the bars
    axes[0][0].legend(loc="upper center", ncol=len(FORMAT_COLUMNS), fontsize=8)
    fig.suptitle(f"MiniMax-H3 linear layers, weight formats vs bf16 on {gpu_name(data)}")
    return save(fig, path)


def plot_attention(path: Path) -> Path:
    data = json.loads(path.read_text())
    results = [r for r in data["results"] if r["inputs"] == "structured"] or data["results"]
    reference = data.get("reference", "sdpa_cudnn")
    token_counts = sorted({r["tokens"] for r in results})
    fig, axes = plt.subplots(len(token_counts), 1, figsize=(10, 3.4 * len(token_counts)), squeeze=False)
    for ax, tokens in zip(axes[:, 0], token_counts):
        at = [r for r in results if r["tokens"] == tokens]
        labels = [r["backend"] if r["kernel"] in (r["backend"], "sol") else f"{r['backend']}\n({r['kernel']})"
                  for r in at]
        speedups = [r[f"speedup_vs_{reference}"] for r in at]
        bars = ax.bar(range(len(at)), speedups, color=["tab:orange" if r["kernel"] == "sol" else "tab:blue" for r in at])
        ax.bar_label(bars, labels=[f"{x:.2f}x" + ("" if r["psnr_db"] is None else f"\n{r['psnr_db']:.0f} dB")
                                   for x, r in zip(speedups, at)], fontsize=7, padding=1)
        ax.set_xticks(range(len(at)), labels, fontsize=7)
        ax.axhline(1.0, color="black", linewidth=0.8)
        ax.set_title(f"{tokens:,} tokens")
        ax.margins(y=0.18)
    for ax in axes[:, 0]:
        ax.set_ylabel(f"speed-up over {reference}")
    shape = data.get("shape", {})
    fig.suptitle(f"Attention, {shape.get('heads')} heads x {shape.get('head_dim')}, {shape.get('dtype')}, on "
                 f"{gpu_name(data)} (dB: PSNR vs {reference}; orange: Sol, sparse)", fontsize=10)
    return save(fig, path)


def plot_offload(path: Path) -> Path | None:
    data = json.loads(path.read_text())
    traced = [c for c in data["configs"] if c.get("vram_samples")]
    if not traced:
        return None  # a CPU run: no VRAM to trace
    fig, ax = plt.subplots(figsize=(10, 4.5))
    for config in traced:
        ms, allocated = zip(*config["vram_samples"])
        ax.plot(ms, [b / GIB for b in allocated], linewidth=1, label=config["config"])
    if data.get("cap_bytes"):
        ax.axhline(data["cap_bytes"] / GIB, color="red", linewidth=1, label=f"cap {data['cap_bytes'] / GIB:.0f} GiB")
    ax.set_xlabel("time in one forward (ms)")
    ax.set_ylabel("allocated VRAM (GiB)")
    ax.set_title(f"MiniMax-H3-shaped stack, one forward at {max(data['lengths']):,} tokens, "
                 f"on {gpu_name(data)}")
    ax.legend(loc="center right", fontsize=8)
    return save(fig, path)


E2E_COLORS = {"comfy": "tab:gray", "pack": "tab:blue", "sol": "tab:orange"}


def plot_comfy_e2e(path: Path) -> Path | None:
    data = json.loads(path.read_text())
    ok = [r for r in data["results"] if r["status"] == "ok" and r.get("vs_resident")]
    if not ok:
        return None
    model = ok[0]["model"]
    ok = [r for r in ok if r["model"] == model]
    lengths = sorted({(r["tokens"], r["length"], r["size"]) for r in ok}, reverse=True)
    fig, axes = plt.subplots(len(lengths), 1, figsize=(10, 3.6 * len(lengths)), squeeze=False)
    for ax, (tokens, _, size) in zip(axes[:, 0], lengths):
        at = [r for r in ok if r["tokens"] == tokens]
        speedups = [r["vs_resident"] for r in at]
        bars = ax.bar(range(len(at)), speedups,
                      color=[E2E_COLORS["sol" if r["sol"] else r["family"]] for r in at])
        labels = []
        for x, r in zip(speedups, at):
            label = f"{x:.2f}x"
            if r.get("peak_gib") is not None:
                label += f"\n{r['peak_gib']:.1f} GiB"
            if r.get("cosine") is not None and r["config"] != "comfy_resident":
                label += f"\ncos {r['cosine']:.5f}"
            labels.append(label)
        ax.bar_label(bars, labels=labels, fontsize=7, padding=1)
        ax.set_xticks(range(len(at)), [r["config"] for r in at], fontsize=7, rotation=15)
        ax.axhline(1.0, color="black", linewidth=0.8)
        ax.set_title(f"{size}: {tokens:,} tokens", fontsize=9)
        ax.set_ylabel("step speed-up over resident")
        ax.margins(y=0.3)
    cap = data.get("settings", {}).get("cap_gib")
    fig.suptitle(f"{model} in ComfyUI {data['environment'].get('comfyui')} on {gpu_name(data)}: sampler step vs "
                 f"everything resident (euler, {data['settings']['steps']} steps)\ngray: ComfyUI's own, blue: the "
                 f"pack, orange: Sol; all but comfy_resident on an emulated {cap:g} GiB card", fontsize=9)
    return save(fig, path)


def save(fig, path: Path) -> Path:
    fig.tight_layout()
    out = path.with_suffix(".png")
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def main_bench(path: Path) -> str | None:
    """The benchmark a results file is the main run of: "<bench>-<gpu>-<date>.json", for comfy-e2e also
    "comfy-e2e-<gpu>-comfyui-<host version>-<date>.json". Variant runs ("formats-compiled-quant-<gpu>-<date>.json")
    carry extra words and get no chart of their own."""
    data = json.loads(path.read_text())
    gpu = (data.get("env") or data.get("environment") or {}).get("gpu") or "cpu"
    for bench in PLOTTERS:
        if re.fullmatch(rf"{re.escape(bench)}-{re.escape(slug(gpu))}(-comfyui-[0-9.]+)?-\d{{4}}-\d{{2}}-\d{{2}}",
                        path.stem):
            return bench
    return None


PLOTTERS = {"formats": plot_formats, "attention": plot_attention, "offload": plot_offload,
            "comfy-e2e": plot_comfy_e2e}


def main(results: Path = RESULTS) -> list[Path]:
    written = []
    for path in sorted(results.glob("*.json")):
        plotter = PLOTTERS.get(main_bench(path))
        out = plotter(path) if plotter else None
        if out:
            print(f"wrote {out}")
            written.append(out)
    return written


if __name__ == "__main__":
    main(Path(sys.argv[1]) if len(sys.argv) > 1 else RESULTS)
