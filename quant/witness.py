"""Run-time witness: how many of the layers a report calls quantized really executed.

Each quantized layer counts its calls in `runs`: QuantLinear in its forward,
a kitchen-weight layer (ComfyUI's own Linear with a QuantizedTensor weight)
through a forward pre-hook. Hosts may call a kitchen-weight layer without the
module call (upstream's fused `linear_input_act` hands the weight to an INT8
kernel directly); `count_through_parent` covers those: the parent's forward
counts each witnessed child installed in it. Counting is skipped while
torch.compile traces (a Python side effect there would guard and recompile on
every change), so layers compiled into a graph are not counted.
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import torch
from torch import nn

PARENT_HOOK = "_bigdit_counts_children"  # marks a parent whose hook is installed (one per module)


def count_run(module: nn.Module) -> None:
    if not torch.compiler.is_compiling():
        module.runs += 1


def _count_pre_hook(module: nn.Module, _args) -> None:
    count_run(module)


def _count_children_pre_hook(parent: nn.Module, _args) -> None:
    if torch.compiler.is_compiling():
        return
    for child in parent._modules.values():
        if getattr(child, "counted_by_parent", False):
            child.runs += 1


def count_calls(module: nn.Module) -> nn.Module:
    """Make `module` (a shallow copy this pack owns) count its calls.

    It gets its own pre-hook dict: a shallow copy shares the original's, and
    the hook must not count the original.
    """
    module._forward_pre_hooks = OrderedDict(module._forward_pre_hooks)
    module.runs = 0
    module.register_forward_pre_hook(_count_pre_hook)
    return module


def count_through_parent(module: nn.Module, parent: nn.Module) -> None:
    """Also count `module` whenever `parent` runs with `module` installed in it.

    For layers the host may call without the module call. The parent is a
    module of the shared tree; its one hook only counts children marked
    `counted_by_parent`, so other clones' modules are never counted.
    """
    module.counted_by_parent = True
    if not getattr(parent, PARENT_HOOK, False):
        parent.register_forward_pre_hook(_count_children_pre_hook)
        setattr(parent, PARENT_HOOK, True)


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
