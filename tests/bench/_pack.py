"""Shared bits of the GPU benchmarks: import the pack as `bigdit`, name the GPU, write JSON."""
import datetime
import importlib.metadata
import json
import re
import sys
import types
from pathlib import Path

import torch

PACK_ROOT = Path(__file__).resolve().parents[2]
RESULTS = PACK_ROOT / "tests" / "bench" / "results"

if str(PACK_ROOT / "tests") not in sys.path:  # the tests' shared helpers (probes.py)
    sys.path.append(str(PACK_ROOT / "tests"))

if "bigdit" not in sys.modules:
    _pkg = types.ModuleType("bigdit")
    _pkg.__path__ = [str(PACK_ROOT)]
    sys.modules["bigdit"] = _pkg

from bigdit.hardware import time_ms  # noqa: E402 - the pack's own timer, once the pack is importable


def slug(gpu_name: str) -> str:
    """A GPU's name as results files spell it: "NVIDIA H200" -> "nvidia-h200"."""
    return re.sub(r"[^a-z0-9]+", "-", gpu_name.lower()).strip("-")


def gpu_slug() -> str:
    return slug(torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu")


def default_out(bench: str) -> Path:
    return RESULTS / f"{bench}-{gpu_slug()}-{datetime.date.today().isoformat()}.json"


def environment() -> dict:
    env = {"torch": torch.__version__, "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None}
    if torch.cuda.is_available():
        env["capability"] = list(torch.cuda.get_device_capability())
    try:
        env["comfy_kitchen"] = importlib.metadata.version("comfy-kitchen")
    except importlib.metadata.PackageNotFoundError:
        env["comfy_kitchen"] = None
    return env


def write_json(path: Path | str, payload: dict) -> None:
    path = Path(path)  # --out comes as text
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(payload, indent=2, default=str))
    print(f"wrote {path}")


def cuda_time_ms(fn, warmup: int = 2, iters: int = 10, repeats: int = 3) -> float:
    """Time per call of `fn` in ms: `iters` calls back to back between two CUDA events
    (as in a model, the CPU runs ahead of the GPU), median over `repeats`."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    per_call = sorted(time_ms(fn, "cuda", iters) for _ in range(repeats))
    return per_call[len(per_call) // 2]
