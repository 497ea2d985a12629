"""The README's tables of end-to-end results, from the benchmark JSON in tests/bench/results/.

    python tests/doc_tables.py                    prints the headline table
    python tests/doc_tables.py --job              prints the whole-job table (whole_job.py's runs in JOB_RUNS)
    python tests/doc_tables.py --formats FILE [FILE ...]
                                                  prints issue 21's formats table of a comfy_e2e.py run of
                                                  its FORMAT_CONFIGS (--model, --length: which of its runs),
                                                  the formats it left out from the other runs

tests/test_docs.py checks that README.md holds exactly the whole-job table, the headline table and FORMATS_RUNS'
formats tables.
"""
import json
import statistics
import sys
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "bench" / "results"
sys.path.insert(0, str(RESULTS.parent))
from comfy_e2e import REFERENCE, profiled_step, steady_steps  # noqa: E402

# (model and host, JSON file, [(config, what the row says)]); each row is the file's "long" run of that config
HEADLINE = [
    ("Wan 2.1 14B, 32,760 tokens, ComfyUI 0.3.75",
     "comfy-e2e-wan14b-formats-nvidia-h200-comfyui-0.3.75-2026-12-02.json", [
         ("comfy_resident", "ComfyUI UNETLoader bf16 (reference)"),
         ("comfy_fp8_fast", "ComfyUI UNETLoader `fp8_e4m3fn_fast`"),
         ("comfy_fp8_fast_sage", "ComfyUI `fp8_e4m3fn_fast` + its `--use-sage-attention` (SageAttention 2)"),
         ("pack_auto", "LoadH3Quantized `auto` (FP8)"),
         ("pack_auto_sage", "LoadH3Quantized `auto` + SetAttentionBackend `sage` (SageAttention 2)"),
         ("pack_auto_8g", "LoadH3Quantized `auto`, streaming"),
     ]),
    ("Wan 2.1 14B, 32,760 tokens, ComfyUI 0.33.0, dynamic VRAM",
     "comfy-e2e-wan14b-nvidia-h200-comfyui-0.33.0-2026-12-02.json", [
         ("comfy_resident", "ComfyUI UNETLoader bf16 (reference)"),
         ("comfy_fp8_marker_12g", "ComfyUI UNETLoader, its own FP8 file"),
         ("pack_auto_12g", "LoadH3Quantized `auto` (FP8)"),
         ("comfy_fp8_fast_ck", "ComfyUI `fp8_e4m3fn_fast` + its `--use-ck-attention`"),
         ("comfy_fp8_fast_sage", "ComfyUI `fp8_e4m3fn_fast` + its `--use-sage-attention` (SageAttention 2)"),
         ("pack_auto_sage", "LoadH3Quantized `auto` + SetAttentionBackend `sage` (SageAttention 2)"),
     ]),
    ("Wan 2.1 14B, 32,760 tokens, ComfyUI 0.3.75, compiled (its first step compiles: 128 s)",
     "comfy-e2e-wan14b-compiled1-nvidia-h200-comfyui-0.3.75-2026-12-02.json", [
         ("comfy_resident", "ComfyUI UNETLoader bf16 (reference)"),
         ("comfy_fp8_fast_sage", "ComfyUI `fp8_e4m3fn_fast` + its `--use-sage-attention` (SageAttention 2)"),
         ("pack_auto_sage_compiled", "LoadH3Quantized `auto` + `sage` + ComfyUI's TorchCompileModel"),
     ]),
    ("Wan 2.1 14B, 32,760 tokens, ComfyUI 0.3.75, sparse", "comfy-e2e-nvidia-h200-2026-12-01.json", [
        ("comfy_resident", "ComfyUI UNETLoader bf16 (reference)"),
        ("pack_auto_sol", "LoadH3Quantized `auto` + SetAttentionBackend `sol`"),
    ]),
    ("MiniMax-H3 pruned, 32,690 tokens, ComfyUI 0.33.0, dynamic VRAM",
     "comfy-e2e-h3pruned-filebacked-nvidia-h200-comfyui-0.33.0-2026-12-02.json", [
         ("comfy_resident", "ComfyUI UNETLoader bf16 (reference)"),
         ("comfy_fp8_marker_12g", "ComfyUI UNETLoader, its own FP8 file"),
         ("pack_auto_12g", "LoadH3Quantized `auto` (FP8)"),
         ("comfy_fp8_fast_sage", "ComfyUI `fp8_e4m3fn_fast` + its `--use-sage-attention` (SageAttention 2)"),
         ("pack_auto_sage", "LoadH3Quantized `auto` + SetAttentionBackend `sage` (SageAttention 2)"),
     ]),
]


def load(name: str) -> dict:
    """A results payload by its name in tests/bench/results/, or by a path."""
    path = RESULTS / name if (RESULTS / name).exists() else Path(name)
    return json.loads(path.read_text())


def _memory(result):
    # NVML's used memory where the bench read it (upstream keeps dynamic-VRAM weights outside
    # PyTorch's allocator), else PyTorch's peak (None on CPU)
    return result.get("device_used_peak_sampling_gib") or result.get("peak_gib")


def step_s(result) -> float:
    """A record's steady step without its profiled step (comfy_e2e.steady_steps): s/step in these tables."""
    return statistics.median(steady_steps(result["step_seconds"], profiled_step(result)))


def vs_reference(result, results: dict) -> float | None:
    """The record's reference's step_s over its own (the reference: the record's, else comfy_resident)."""
    reference = results.get(result.get("reference") or REFERENCE)
    return None if reference is None else step_s(reference) / step_s(result)


def _row(result, label, results):
    memory = _memory(result)
    card = f"{result['cap_gib']:g} GiB" if result["capped"] else "no cap"
    return (f"| {label} | {card} | {step_s(result):.3f} | {vs_reference(result, results):.2f}x | {memory:.1f} | "
            f"{result['cosine']:.4f} |")


def headline() -> str:
    lines = ["| configuration | card | s/step | vs reference | GPU GiB | latent cosine |",
             "|---|---|---|---|---|---|"]
    for title, name, rows in HEADLINE:
        results = {r["config"]: r for r in load(name)["results"] if r["length"] == "long" and r["status"] == "ok"}
        lines.append(f"| **{title}** (`{name}`) | | | | | |")
        lines.extend(_row(results[config], label, results) for config, label in rows)
    return "\n".join(lines)


# The whole MiniMax-H3 job (tests/bench/whole_job.py), the README's first table: per setting, the runs that hold
# its configurations (the reference, template_sage, first); each row group's runs came from one GPU machine, an H100
# unless the label names another.
R7 = "-nvidia-h100-80gb-hbm3-comfyui-0.33.0-2026-12-07.json"
JOB_RUNS = (  # (what the rows are, setting, RAM GiB, files, the configurations shown: all where None)
    ("turbo, 64 GiB", "turbo", 64, ("whole-job-turbo-64g-081a891" + R7,), None),
    ("turbo, 64 GiB, again", "turbo", 64, ("whole-job-turbo-64g-lora-int8-hidden-98d992d" + R7,),
     ("template_sage", "pack_fast")),
    ("turbo, 32 GiB", "turbo", 32, ("whole-job-turbo-32g-6dd69a6" + R7,), None),
    ("turbo, 32 GiB, file's layers kept", "turbo", 32, ("whole-job-turbo-32g-0270751" + R7,), None),
    ("default, 64 GiB", "default", 64, ("whole-job-default-64g-6dd69a6" + R7,), None),
    ("default, 32 GiB", "default", 32, ("whole-job-default-32g-98d992d" + R7,), None),
    ("turbo, 32 GiB, H200", "turbo", 32, ("whole-job-turbo-32g-4e985fb-nvidia-h200-comfyui-0.33.0-2026-12-07.json",),
     None),
)
# whole_job.py --lora-change: the second job's prompt, the LoRA's strength changed; --lora-second: a second LoRA
JOB_NAMES = {3: "job 3, LoRA at 0.75", 4: "job 4, a second LoRA"}
JOB_LABELS = {"template_sage": "template + `--use-sage-attention`", "template": "template",
              "pack": "`pack` (the shipped example)", "pack_fast": "`pack_fast`",
              "pack_fast_no_read_ahead": "`pack_fast`, no read-ahead"}


def job_table() -> str:
    lines = ["| setting, RAM, job | configuration | job s | vs template + Sage | encoder | model_load | sampling "
             "(first step) | s/step | VAE decode | save | RSS GiB (unreclaimable) | latent cosine |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for label, setting, ram_gib, names, configs in JOB_RUNS:
        records = [r for name in names for r in load(name)["results"] if r.get("status") == "ok"
                   and (configs is None or r["config"] in configs)]
        for job in (1, 2, 3, 4):
            ran = [r for r in records if r["job"] == job and r["setting"] == setting and r["ram_gib"] == ram_gib]
            if len(ran) < 2:  # a job the reference ran alone (the call's budget ended) compares nothing
                continue
            reference = next(r for r in ran if r["config"] == "template_sage")
            for r in ran:
                stages, sampling = r["stages"], r["sampling"]
                cosine = ((r.get("latent") or {}).get("vs_template_sage") or {}).get("video", {}).get("cosine")
                lines.append(
                    f"| {label}, {JOB_NAMES.get(job, f'job {job}')} | {JOB_LABELS[r['config']]} | {r['wall_s']:.1f} | "
                    f"{reference['wall_s'] / r['wall_s']:.2f}x | {stages.get('encoder', 0):.1f} | "
                    f"{stages.get('model_load', 0):.1f} | {stages.get('sampling', 0):.1f} "
                    f"({sampling['step_seconds'][0]:.1f}) | {sampling['step_s']:.2f} | "
                    f"{stages.get('vae_decode', 0):.1f} | {stages.get('save', 0):.1f} | "
                    f"{r['host_rss_peak_gib']:.1f} ({r['host_unreclaimable_peak_gib']:.1f}) | "
                    f"{'—' if cosine is None else f'{cosine:.4f}'} |")
    return "\n".join(lines)


# issue 21's formats tables, in the README from these runs: (comfy_e2e.py configuration, row label); the label
# names the LoadH3Quantized choice. Each table is one run, plus runs that add the formats it left out (each such
# row against its own run's reference)
FORMATS_RUNS = (("comfy-e2e-wan14b-formats-nvidia-h200-comfyui-0.3.75-2026-12-02.json",
                  "comfy-e2e-wan14b-nvfp4-nvidia-h200-comfyui-0.3.75-2026-12-02.json"),
                ("comfy-e2e-h3pruned-formats-nvidia-h200-comfyui-0.33.0-2026-12-02.json",
                 "comfy-e2e-h3pruned-cards-short-nvidia-h200-comfyui-0.33.0-2026-12-02.json"))
FORMATS = [
    ("comfy_resident", "bf16 (reference, ComfyUI UNETLoader)"),
    ("pack_fp8", "FP8 (`float8_e4m3fn`)"),
    ("pack_auto", "`auto` (FP8 per layer where it is faster)"),
    ("pack_int8", "INT8 ConvRot (`int8_convrot`)"),
    ("pack_w4a8", "W4A8 (`asym_w4a8_int8`)"),
    ("pack_w4a4", "W4A4 (`convrot_w4a4`)"),
    ("pack_mixed_nvfp4", "NVFP4 file (`nvfp4`, MixedCheckpointLoader)"),
]


def _number(value, spec):
    return "—" if value is None else format(value, spec)


def formats_table(payload: dict, model: str | None = None, length: str = "long", more: tuple = ()) -> str:
    """The formats table of one comfy_e2e.py results payload, at `model` (default: the run's first) and
    `length`; a format it left out comes from the first payload of `more` that ran it, against that payload's
    own reference. A format no run has has no row; the reference's row, or a row whose configuration failed
    or was skipped, says so instead of numbers."""
    model = model or payload["settings"]["models"][0]
    runs = [{r["config"]: r for r in p["results"] if r["model"] == model and r["length"] == length}
            for p in (payload, *more)]
    lines = ["| format | weight GiB | latent cosine | rel L2 | s/step | vs resident | peak VRAM GiB |",
             "|---|---|---|---|---|---|---|"]
    for config, label in FORMATS:
        results = next((run for run in runs if config in run), runs[0])
        r = results.get(config)
        if r is None and config != FORMATS[0][0]:
            continue
        if r is None or r["status"] != "ok":
            lines.append(f"| {label} | {'not run' if r is None else r['status']} | — | — | — | — | — |")
            continue
        vs = _number(vs_reference(r, results), ".2f")
        lines.append(f"| {label} | {_number(r.get('weights_gib'), '.2f')} | {_number(r.get('cosine'), '.5f')} | "
                     f"{_number(r.get('rel_l2'), '.4f')} | {step_s(r):.3f} | {vs}{'x' if vs != '—' else ''} | "
                     f"{_number(_memory(r), '.1f')} |")
    return "\n".join(lines)


if __name__ == "__main__":
    import argparse
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--formats", metavar="FILE", nargs="+",
                        help="comfy_e2e.py results JSONs (names in tests/bench/results/ or paths): print the first's "
                             "formats table, with the formats it left out from the others")
    parser.add_argument("--job", action="store_true", help="print the whole-job table")
    parser.add_argument("--model", default=None)
    parser.add_argument("--length", default="long")
    args = parser.parse_args()
    if args.job:
        print(job_table())
    elif args.formats:
        first, *more = (load(name) for name in args.formats)
        print(formats_table(first, args.model, args.length, tuple(more)))
    else:
        print(headline())
