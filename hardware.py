"""What the core asks of a device: a CUDA device's compute capability, one definition for quant/, attention/
and loaders/."""
from __future__ import annotations

import functools
import time

import torch


@functools.lru_cache(maxsize=None)
def _capability(device_type: str, index: int | None) -> tuple[int, int] | None:
    if device_type != "cuda" or not torch.cuda.is_available():
        return None
    # torch.compile folds get_device_properties into a constant; get_device_capability would enter the graph
    props = torch.cuda.get_device_properties(index)
    return props.major, props.minor


def cuda_capability(device) -> tuple[int, int] | None:
    """Compute capability of a CUDA device (also while torch.compile traces), None for anything else."""
    device = torch.device(device)
    index = device.index if device.index is not None else (
        torch.cuda.current_device() if device.type == "cuda" and torch.cuda.is_available() else None)
    return _capability(device.type, index)


def gpu_family(device) -> str | None:
    """A CUDA device's compute capability as reports and shipped tables name it ("sm90"); None elsewhere."""
    capability = cuda_capability(device)
    return None if capability is None else f"sm{capability[0]}{capability[1]}"


def device_text(device: torch.device) -> str:
    """"cuda sm90", "cpu": a device as the reports name it."""
    family = gpu_family(device) if device.type == "cuda" else None
    return device.type + (f" {family}" if family is not None else "")


def cuda_at_least(device, minimum: tuple[int, int]) -> bool:
    """Whether `device` is a CUDA device of compute capability `minimum` or later."""
    capability = cuda_capability(device)
    return capability is not None and capability >= minimum


def time_ms(fn, device, calls: int) -> float:
    """Milliseconds per call of `calls` back-to-back calls of `fn` on `device` (CUDA events on a GPU, where the
    CPU runs ahead as in a model; the wall clock elsewhere)."""
    if torch.device(device).type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(calls):
            fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / calls
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - start) * 1e3 / calls
