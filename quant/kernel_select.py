"""Kernel choice per shape among several valid kernels: pinned, stored, or a declared default; timed only on request.

Where a format has more than one correct kernel (the pack's Triton INT8 kernels,
comfy-kitchen's fused GEMM, the same split into row chunks...), which one is
fastest depends on the GPU and the shape. The choice for a (device, shape) is, in
order: the kernel an env var pins; a measurement kept in the tuning store
(quant/tuning.py) for this GPU, shape and kernel version; where the user asked
for tuning (BIGDIT_INT8_TUNE=1), a measurement made now, at the first call, and
kept there; else the caller's default, with nothing timed. While torch.compile
traces a call the same order holds, nothing measured and nothing written, so a
compiled model runs the kernel an eager one would.
"""
from __future__ import annotations

import os
from typing import Callable

import torch

from ..hardware import time_ms
from ..pack_logging import pack_logger
from ..units import next_pow2
from . import tuning

log = pack_logger(__name__)


rows_bucket = next_pow2  # a batch change re-measures once


def _time_ms(fn: Callable[[], object], iters: int) -> float:
    """Per-call time on the GPU of `iters` back-to-back calls, after two warm-up calls (kernel selection,
    workspace allocation)."""
    fn()
    fn()
    return time_ms(fn, "cuda", iters)


class KernelChooser:
    """Chooses among named candidates; `force_env` names an env var that pins one; `version` keys its stored
    measurements (a digest of the candidates' kernels: another version measures again)."""

    def __init__(self, name: str, force_env: str, known: tuple[str, ...], version: str, iters: int = 5):
        self.name = name
        self.force_env = force_env
        self.known = known
        self.version = version
        self.iters = iters
        self.choices: dict[tuple, str] = {}

    def forced(self) -> str | None:
        value = os.environ.get(self.force_env, "").strip().lower()
        return value or None

    def choose(self, device: torch.device, shape: tuple, candidates: dict[str, Callable[[], object]],
               measured: tuple[str, ...] | None = None, default: str | None = None) -> str:
        """The candidate to run at `shape` on `device`: pinned, stored, measured on request, else `default`
        (where it is a candidate; else the first).

        Only the names in `measured` (default: all) are stored or timed; the others run only when pinned. A
        pinned name this call cannot use (a row split of a short input) means the first candidate."""
        forced = self.forced()
        if forced is not None and forced != "auto":
            if forced not in self.known:
                raise ValueError(f"{self.force_env}={forced!r} is not one of {list(self.known)} or 'auto'")
            return forced if forced in candidates else next(iter(candidates))
        key = (str(device), shape)
        cached = self.choices.get(key)
        if cached is not None:
            return cached
        names = [n for n in candidates if measured is None or n in measured]
        choice = default if default in names else names[0]
        if len(names) > 1 and device.type == "cuda":
            gpu, text = tuning.device_key(device), "|".join(map(str, shape))
            stored = tuning.current().get(gpu, f"{self.name}.kernel", self.version, text)
            if isinstance(stored, dict) and stored.get("choice") in names:
                choice = stored["choice"]
            elif (tuning.search_asked() and not torch.compiler.is_compiling()
                  and not torch.cuda.is_current_stream_capturing()):
                timings = self._measure({n: candidates[n] for n in names})
                choice = min(timings, key=timings.get)
                tuning.current().put(gpu, f"{self.name}.kernel", self.version, text,
                                     {"choice": choice, "ms": {n: round(t, 4) for n, t in timings.items()}})
                log.info("%s at %s: %s (%s); kept in the tuning store", self.name, text, choice,
                         ", ".join(f"{n} {t:.3f} ms" for n, t in timings.items()))
        if not torch.compiler.is_compiling():  # a write while tracing is a guard: the next call recompiles
            self.choices[key] = choice
        return choice

    def _measure(self, candidates: dict[str, Callable[[], object]]) -> dict[str, float]:
        """Each candidate's per-call milliseconds, timed now."""
        # Two interleaved rounds, best of each: clock drift hits every candidate alike.
        timings = {n: float("inf") for n in candidates}
        for _ in range(2):
            for n, fn in candidates.items():
                timings[n] = min(timings[n], _time_ms(fn, self.iters))
        return timings
