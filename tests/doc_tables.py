"""The README's headline table of end-to-end results, from the benchmark JSON in tests/bench/results/.

    python tests/doc_tables.py          prints the Markdown table

tests/test_docs.py checks that README.md holds exactly this table.
"""
import json
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "bench" / "results"

# (model and host, JSON file, [(config, what the row says)]); each row is the file's "long" run of that config
HEADLINE = [
    ("Wan 2.1 14B, 32,760 tokens, ComfyUI 0.3.75", "comfy-e2e-nvidia-h200-2026-12-01.json", [
        ("comfy_resident", "ComfyUI UNETLoader bf16 (reference)"),
        ("comfy_fp8_fast", "ComfyUI UNETLoader `fp8_e4m3fn_fast`"),
        ("pack_auto", "LoadH3Quantized `auto` (FP8)"),
        ("pack_auto_sol", "LoadH3Quantized `auto` + SetAttentionBackend `sol`"),
    ]),
    ("Wan 2.1 14B, 32,760 tokens, ComfyUI 0.33.0", "comfy-e2e-nvidia-h200-comfyui-0.33.0-2026-12-01.json", [
        ("comfy_resident", "ComfyUI UNETLoader bf16 (reference)"),
        ("comfy_fp8_marker", "ComfyUI UNETLoader, its own FP8 file"),
        ("pack_auto", "LoadH3Quantized `auto` (FP8)"),
    ]),
    ("MiniMax-H3 pruned, 32,690 tokens, ComfyUI 0.33.0, dynamic VRAM",
     "comfy-e2e-h3pruned-dynamic-nvidia-h200-comfyui-0.33.0-2026-12-02.json", [
         ("comfy_resident", "ComfyUI UNETLoader bf16 (reference)"),
         ("comfy_fp8_marker_12g", "ComfyUI UNETLoader, its own FP8 file"),
         ("pack_auto_12g", "LoadH3Quantized `auto` (FP8)"),
         ("comfy_fp8_marker_8g", "ComfyUI UNETLoader, its own FP8 file"),
         ("pack_auto_8g", "LoadH3Quantized `auto` (FP8)"),
         ("pack_auto_sage", "LoadH3Quantized `auto` + SetAttentionBackend `sage` (SageAttention 2)"),
     ]),
]


def _row(result, label):
    # NVML's used memory where the bench read it (upstream keeps dynamic-VRAM weights outside
    # PyTorch's allocator), else PyTorch's peak
    memory = result.get("device_used_peak_sampling_gib") or result["peak_gib"]
    card = f"{result['cap_gib']:g} GiB" if result["capped"] else "no cap"
    return (f"| {label} | {card} | {result['step_s']:.3f} | {result['vs_resident']:.2f}x | {memory:.1f} | "
            f"{result['cosine']:.4f} |")


def headline() -> str:
    lines = ["| configuration | card | s/step | vs reference | GPU GiB | latent cosine |",
             "|---|---|---|---|---|---|"]
    for title, name, rows in HEADLINE:
        results = {r["config"]: r for r in json.loads((RESULTS / name).read_text())["results"]
                   if r["length"] == "long" and r["status"] == "ok"}
        lines.append(f"| **{title}** (`{name}`) | | | | | |")
        lines.extend(_row(results[config], label) for config, label in rows)
    return "\n".join(lines)


if __name__ == "__main__":
    print(headline())
