"""What a marker file's strict inspection costs on the CPU: the block scales' checks.

A loader inspects a marker file before loading it (loaders/checkpoint.py: every scale checked for NaN, negative and
too-large values). An NVFP4 text encoder holds block scales of an eighth of its weights' bytes (Comfy-Org's Qwen3-VL
32B file: about 2 GB, 31 billion weights over 16). Where every check decoded them to float32, QuantizedCLIPLoader,
which inspects the file before handing it to ComfyUI's loader, took 7.6 s on an H100 machine where ComfyUI's
CLIPLoader took 3.9 (whole-job-turbo-restarted-…-2026-12-07.json, without the read-ahead). This writes an NVFP4
marker file of random layers (no weights a model uses: only the layout), then times `inspect_checkpoint` on it (the
pages in the page cache: the CPU's work, not the disk's) beside what decoding every block scale and checking it
costs (the checks' earlier way), and writes both.

    python tests/bench/inspect_scales.py [--layers 12] [--rows 8192] [--columns 16384] [--out FILE]
"""
import argparse
import datetime
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

from _pack import RESULTS, write_json
from checkpoint_files import marker_tensor

from bigdit.loaders import inspect_checkpoint
from bigdit.loaders.layers import _decoded, non_finite
from bigdit.loaders.safetensors_header import HeaderReader, read_header


def write_file(path: Path, layers: int, rows: int, columns: int) -> int:
    """An NVFP4 marker file of `layers` layers [rows, columns]; its block scales' bytes."""
    torch.manual_seed(0)
    sd = {}
    for i in range(layers):
        name = f"model.layers.{i}.mlp.up_proj"
        sd[f"{name}.weight"] = torch.randint(0, 256, (rows, columns // 2), dtype=torch.uint8)
        sd[f"{name}.weight_scale"] = torch.randint(0x08, 0x7E, (rows, columns // 16), dtype=torch.uint8).view(
            torch.float8_e4m3fn)
        sd[f"{name}.weight_scale_2"] = torch.tensor(1e-3)
        sd[f"{name}.comfy_quant"] = marker_tensor({"format": "nvfp4"})
    save_file(sd, str(path))
    return layers * rows * columns // 16


def decoded_checks(path: Path) -> None:
    """Every block scale read, checked for NaN and decoded for its extremes (the checks' earlier way)."""
    header = read_header(path)
    with HeaderReader(header) as read:
        for key in header.tensors:
            if key.endswith(".weight_scale"):
                tensor = read(key)
                assert not non_finite(tensor, "F8_E4M3")
                values = _decoded(tensor, "F8_E4M3")
                float(values.min()), float(values.max())


def best_of(fn, repeats: int = 3) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--rows", type=int, default=8192)
    parser.add_argument("--columns", type=int, default=16384)
    parser.add_argument("--out", type=Path,
                        default=RESULTS / f"inspect-scales-cpu-{datetime.date.today().isoformat()}.json")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "nvfp4.safetensors"
        scale_bytes = write_file(path, args.layers, args.rows, args.columns)
        inspect_checkpoint(path)  # its pages into the page cache, as for every timed call
        inspected = best_of(lambda: inspect_checkpoint(path))
        decoded = best_of(lambda: decoded_checks(path))
    result = {"bench": "inspect_scales", "torch": torch.__version__, "threads": torch.get_num_threads(),
              "layers": args.layers, "rows": args.rows, "columns": args.columns, "block_scale_bytes": scale_bytes,
              "inspect_s": inspected, "decoded_checks_s": decoded, "decoded_over_inspect": decoded / inspected}
    print(f"{scale_bytes / 1e6:.0f} MB of block scales, {torch.get_num_threads()} threads: inspect_checkpoint "
          f"{inspected:.3f} s; decoding every scale for its checks {decoded:.3f} s ({decoded / inspected:.1f}x)")
    write_json(args.out, result)


if __name__ == "__main__":
    main()
