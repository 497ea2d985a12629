"""Run-time witness: how many of the layers a report calls quantized really executed, on which kernels, and what
the first-call checks of auto's choices found among them (quant/real_error.py).

Each QuantLinear counts its calls in `runs`, in its forward. Counting is
skipped while torch.compile traces (a Python side effect there would guard and
recompile on every change), so layers compiled into a graph are not counted.

Kernels that a method chooses among at run time (INT8: the pack's Triton kernels, comfy-kitchen's, its row
split) count their calls in one process-wide tally, from inside the opaque ops that torch.compile keeps whole
(quant/compiled_ops.py): those counts hold under torch.compile too (not under CUDA graphs, which replay without
Python). A kernel that failed records why and whether it is tried again. The first launch of a kernel at a shape
in a process is timed on the host (`launch`): that is where Triton compiles a kernel its on-disk cache lacks,
so a report can say what a first step paid for it.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from time import perf_counter

import torch
from torch import nn


def count_run(module: nn.Module) -> None:
    if not torch.compiler.is_compiling():
        module.runs += 1


@dataclass
class Failure:
    why: str       # the last failure's exception
    retried: bool  # tried again at the next call (a transient failure), else off for the process
    count: int = 0


class KernelTally:
    """Calls per (kernels, kernel), e.g. ("int8", "triton"); failures per the same key."""

    def __init__(self):
        self.calls: Counter = Counter()
        self.failures: dict[tuple[str, str], Failure] = {}
        self.first_launches: Counter = Counter()  # per kinds: kernels' first launches at a shape
        self.first_launch_s: Counter = Counter()  # per kinds: host seconds those launches took

    def snapshot(self) -> tuple[Counter, dict[tuple[str, str], int], Counter, Counter]:
        return (Counter(self.calls), {key: failure.count for key, failure in self.failures.items()},
                Counter(self.first_launches), Counter(self.first_launch_s))


TALLY = KernelTally()


def count_kernel(kernels: str, kernel: str) -> None:
    """One call of `kernel` among `kernels` ran."""
    TALLY.calls[kernels, kernel] += 1


def launch(kernels: str, first: bool, run, *args) -> None:
    """`run(*args)`, timed on the host where `first` (a kernel's first launch at a shape in this process, where
    Triton compiles it or loads it from its cache) and counted per `kernels`; a plain call otherwise (the hot path)."""
    if not first:
        run(*args)
        return
    start = perf_counter()
    try:
        run(*args)
    finally:
        TALLY.first_launches[kernels] += 1
        TALLY.first_launch_s[kernels] += perf_counter() - start


def kernel_failed(kernels: str, kernel: str, why: str, retried: bool) -> None:
    """`kernel` failed (`why`); another computed the call. `retried`: it is tried again at the next call."""
    failure = TALLY.failures.setdefault((kernels, kernel), Failure(why, retried))
    failure.why, failure.retried = why, retried
    failure.count += 1


@dataclass
class RunCount:
    ran: int
    claimed: int
    missing: list[str]  # names of the layers that did not run
    checked: list = field(default_factory=list)  # real_error.RealError outcomes new since the last take
    kernels: dict[tuple[str, str], int] = field(default_factory=dict)  # calls per (kernels, kernel) in the run
    failures: dict[tuple[str, str], tuple[Failure, int]] = field(default_factory=dict)  # with failures in the run
    first_launches: dict[str, tuple[int, float]] = field(default_factory=dict)  # kinds -> (shapes, seconds)

    def render(self) -> str:
        line = f"ran {self.ran}/{self.claimed} quantized layers"
        if self.checked:
            from .real_error import summary  # it builds on QuantLinear, which counts its runs here
            line += "; " + summary(self.checked)
        return line

    def render_kernels(self) -> str | None:
        """The kernels that ran, per kind and count ("ran int8: triton x400 calls"), and any that failed; None
        where no counted kernel ran."""
        parts = []
        for kernels in sorted({kinds for kinds, _ in (*self.kernels, *self.failures)}):
            ran = [f"{kernel} x{n}" for (kinds, kernel), n in sorted(self.kernels.items(), key=lambda kv: -kv[1])
                   if kinds == kernels and n]
            if ran:
                first = self.first_launches.get(kernels)
                launched = (f" (first launches at {first[0]} shapes: {first[1]:.1f} s, compiling what Triton's "
                            f"cache lacked)" if first else "")
                parts.append(f"ran {kernels}: {', '.join(ran)} calls{launched}")
            for (kinds, kernel), (failure, n) in sorted(self.failures.items()):
                if kinds == kernels:
                    then = "tried again at each call" if failure.retried else "off for the rest of this process"
                    times = f" x{n}" if n else ""
                    parts.append(f"{kernels} {kernel} failed{times} ({failure.why}; {then})")
        return "; ".join(parts) or None


class RunWitness:
    """The layers one report claims as quantized, and how many ran since the last `begin`."""

    def __init__(self, layers: dict[str, nn.Module]):
        self.layers = layers
        self._start = self._counts()
        self._checked: set[str] = set()  # layers whose check outcome a take() gave already
        self._kernels = TALLY.snapshot()

    def _counts(self) -> dict[str, int]:
        return {name: getattr(module, "runs", 0) for name, module in self.layers.items()}

    def begin(self) -> None:
        self._start = self._counts()
        self._kernels = TALLY.snapshot()

    def take(self) -> RunCount:
        """What ran since `begin` (or since creation); the next take counts from here."""
        now = self._counts()
        missing = [name for name in self.layers if now[name] <= self._start[name]]
        self._start = now
        checked = []
        for name, module in self.layers.items():
            outcome = getattr(module, "real_error", None)
            if outcome is not None and name not in self._checked:
                self._checked.add(name)
                checked.append(outcome)
        calls, failed, launches, launch_s = now_kernels = TALLY.snapshot()
        before_calls, before_failed, before_launches, before_launch_s = self._kernels
        self._kernels = now_kernels
        first = {kinds: (n - before_launches[kinds], launch_s[kinds] - before_launch_s[kinds])
                 for kinds, n in launches.items() if n > before_launches[kinds]}
        kernels = {key: n - before_calls[key] for key, n in calls.items() if n > before_calls[key]}
        # failures in this run, and a kernel that is off for good in any run where its kind ran
        failures = {key: (TALLY.failures[key], n - before_failed.get(key, 0)) for key, n in failed.items()
                    if n > before_failed.get(key, 0)
                    or (not TALLY.failures[key].retried and any(kinds == key[0] for kinds, _ in kernels))}
        return RunCount(len(self.layers) - len(missing), len(self.layers), missing, checked, kernels, failures, first)
