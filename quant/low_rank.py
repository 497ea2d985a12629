"""A LoRA's part on a quantized layer as a low-rank product on the layer's input: scale * up(mid(down(x))).

QuantLinear's output branches hand such a part to a method that `fuses_low_rank` (quant/linear.py); the method
computes it from the input (`hidden`) or from its own quantized rows, with a form of `down` made for them once and
kept with the part (`derived`: the INT8 path's rotated, row-quantized copy, quant/int8_lora.py).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.nn.functional as F


def like(t: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    """`t` on `ref`'s device in its dtype (itself where it is already)."""
    return t if t.device == ref.device and t.dtype == ref.dtype else t.to(ref.device, ref.dtype)


@dataclass(eq=False)
class LowRank:
    """One LoRA on a layer, `scale * up @ mid @ down` added to its weight, computed on the input instead; `source`:
    the host's (up, down, mid), of which down [R, K], mid [R, R] and up [N, R] are the device copies."""
    source: tuple
    down: torch.Tensor
    mid: torch.Tensor | None
    up: torch.Tensor
    scale: float
    derived: dict = field(default_factory=dict, repr=False)  # forms of `down` made by methods, by their key

    @property
    def rank(self) -> int:
        return self.down.shape[0]

    def tensors(self) -> list[torch.Tensor]:
        """The device tensors the part holds: its copies, then the forms derived from `down`."""
        return [t for t in (self.down, self.mid, self.up) if t is not None] + [
            t for value in self.derived.values() for t in value]

    def hidden(self, x: torch.Tensor) -> torch.Tensor:
        hidden = F.linear(x, like(self.down, x))
        return hidden if self.mid is None else F.linear(hidden, like(self.mid, x))

    def add_to(self, x: torch.Tensor, out: torch.Tensor) -> None:
        out.addmm_(self.hidden(x), like(self.up, x).t(), alpha=self.scale)

    def derive(self, key: tuple, make: Callable[[torch.Tensor], tuple[torch.Tensor, ...]]) -> tuple[torch.Tensor, ...]:
        """`make(down)`, made once for `key` (the down matrix is never changed in place: another LoRA or
        strength gives a new part, which keeps these where its down matrix is the same)."""
        value = self.derived.get(key)
        if value is None:
            value = self.derived[key] = make(self.down)
        return value
