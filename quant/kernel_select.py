"""Measured kernel choice: the fastest of several valid kernels per shape.

Where a format has more than one correct kernel (comfy-kitchen's fused GEMM,
the same split into row chunks, a dequantize-then-GEMM path...), which one is
fastest depends on the GPU and the shape. Rather than ship one GPU's
thresholds, the first call of each (device, shape bucket) times every
candidate on the real inputs and caches the winner for the process.
"""
from __future__ import annotations

import os
from typing import Callable

import torch

from ..hardware import time_ms
from ..pack_logging import pack_logger

log = pack_logger(__name__)


def rows_bucket(rows: int) -> int:
    """Row counts are bucketed to the next power of two so a batch change re-measures once."""
    return 1 << max(0, (rows - 1).bit_length())


def _time_ms(fn: Callable[[], object], iters: int) -> float:
    """Per-call time on the GPU of `iters` back-to-back calls, after two warm-up calls (kernel selection,
    workspace allocation)."""
    fn()
    fn()
    return time_ms(fn, "cuda", iters)


class KernelChooser:
    """Chooses among named candidates; `force_env` names an env var that pins one."""

    def __init__(self, name: str, force_env: str, known: tuple[str, ...], iters: int = 5):
        self.name = name
        self.force_env = force_env
        self.known = known
        self.iters = iters
        self.choices: dict[tuple, str] = {}

    def forced(self) -> str | None:
        value = os.environ.get(self.force_env, "").strip().lower()
        return value or None

    def choose(self, key: tuple, candidates: dict[str, Callable[[], object]], device: torch.device,
               measured: tuple[str, ...] | None = None) -> str:
        """The winning candidate's name for this key; the first candidate is the default.

        Only the names in `measured` (default: all) compete; the others run only when forced.
        """
        forced = self.forced()
        if forced is not None and forced != "auto":
            if forced not in self.known:
                raise ValueError(f"{self.force_env}={forced!r} is not one of {list(self.known)} or 'auto'")
            # A forced kernel this call cannot use (say, a row split of a short input) means the default.
            return forced if forced in candidates else next(iter(candidates))
        candidates = {n: fn for n, fn in candidates.items() if measured is None or n in measured}
        names = list(candidates)
        if len(names) == 1 or device.type != "cuda":
            if not torch.compiler.is_compiling():  # a write while tracing is a guard: the next call recompiles
                self.choices[key] = names[0]
            return names[0]
        cached = self.choices.get(key)
        if cached is not None:
            return cached
        if torch.compiler.is_compiling() or torch.cuda.is_current_stream_capturing():
            return names[0]
        timings = self._measure(candidates)
        best = min(timings, key=timings.get)
        self.choices[key] = best
        log.debug("%s %s: %s (%s)", self.name, key, best,
                  ", ".join(f"{n} {t:.3f} ms" for n, t in timings.items()))
        return best

    def _measure(self, candidates: dict[str, Callable[[], object]]) -> dict[str, float]:
        """Each candidate's per-call milliseconds, timed now."""
        # Two interleaved rounds, best of each: clock drift hits every candidate alike.
        timings = {n: float("inf") for n in candidates}
        for _ in range(2):
            for n, fn in candidates.items():
                timings[n] = min(timings[n], _time_ms(fn, self.iters))
        return timings
