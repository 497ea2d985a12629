"""Run-time witness: how many of the layers a report calls quantized really executed.

Each QuantLinear counts its calls in `runs`, in its forward. Counting is
skipped while torch.compile traces (a Python side effect there would guard and
recompile on every change), so layers compiled into a graph are not counted.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn


def count_run(module: nn.Module) -> None:
    if not torch.compiler.is_compiling():
        module.runs += 1


@dataclass
class RunCount:
    ran: int
    claimed: int
    missing: list[str]  # names of the layers that did not run

    def render(self) -> str:
        return f"ran {self.ran}/{self.claimed} quantized layers"


class RunWitness:
    """The layers one report claims as quantized, and how many ran since the last `begin`."""

    def __init__(self, layers: dict[str, nn.Module]):
        self.layers = layers
        self._start = self._counts()

    def _counts(self) -> dict[str, int]:
        return {name: getattr(module, "runs", 0) for name, module in self.layers.items()}

    def begin(self) -> None:
        self._start = self._counts()

    def take(self) -> RunCount:
        """What ran since `begin` (or since creation); the next take counts from here."""
        now = self._counts()
        missing = [name for name in self.layers if now[name] <= self._start[name]]
        self._start = now
        return RunCount(len(self.layers) - len(missing), len(self.layers), missing)
