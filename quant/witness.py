"""Run-time witness: how many of the layers a report calls quantized really executed, and what the first-call
checks of auto's choices found among them (quant/real_error.py).

Each QuantLinear counts its calls in `runs`, in its forward. Counting is
skipped while torch.compile traces (a Python side effect there would guard and
recompile on every change), so layers compiled into a graph are not counted.
"""
from __future__ import annotations

from dataclasses import dataclass, field

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
    checked: list = field(default_factory=list)  # real_error.RealError outcomes new since the last take

    def render(self) -> str:
        line = f"ran {self.ran}/{self.claimed} quantized layers"
        if self.checked:
            from .real_error import summary  # it builds on QuantLinear, which counts its runs here
            line += "; " + summary(self.checked)
        return line


class RunWitness:
    """The layers one report claims as quantized, and how many ran since the last `begin`."""

    def __init__(self, layers: dict[str, nn.Module]):
        self.layers = layers
        self._start = self._counts()
        self._checked: set[str] = set()  # layers whose check outcome a take() gave already

    def _counts(self) -> dict[str, int]:
        return {name: getattr(module, "runs", 0) for name, module in self.layers.items()}

    def begin(self) -> None:
        self._start = self._counts()

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
        return RunCount(len(self.layers) - len(missing), len(self.layers), missing, checked)
