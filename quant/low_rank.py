"""A LoRA's part on a quantized layer as a low-rank product on the layer's input: scale * up(mid(down(x))).

QuantLinear's output branches hand such a part to a method that `fuses_low_rank` (quant/linear.py); the method
computes it from the input (`hidden`) or from its own quantized rows, with a form of `down` made for them once and
kept with the part (`derived`: the INT8 path's rotated, row-quantized copy, quant/int8_lora.py).

A LoRA on a fused projection made of separate ones' LoRAs side by side (q, k and v's on a fused qkv: down their
downs stacked, up block-diagonal) has zeros in up's off-diagonal blocks; the part finds them when made (`blocks`),
and the products skip them: exactly the same sums, a third of the up projection's work on a qkv.
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
    blocks: int | None = field(default=None, repr=False)  # up's diagonal blocks, found when made (None given)

    def __post_init__(self):
        """`blocks`: n where up [N, R] is block-diagonal in n equal blocks (each N/n outputs reads only its R/n
        ranks), the largest such n up to MAX_BLOCKS; 1 otherwise or with a mid matrix (one read of up, at the
        part's making, never while a call is traced)."""
        if self.blocks is None:
            self.blocks = 1 if self.mid is not None else _diagonal_blocks(self.up)

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
        hidden, up, n = self.hidden(x), like(self.up, x), self.blocks
        rows, ranks = up.shape[0] // n, up.shape[1] // n
        for b in range(n):
            out[..., b * rows:(b + 1) * rows].addmm_(hidden[..., b * ranks:(b + 1) * ranks],
                                                     up[b * rows:(b + 1) * rows, b * ranks:(b + 1) * ranks].t(),
                                                     alpha=self.scale)

    def derive(self, key: tuple, make: Callable[[torch.Tensor], tuple[torch.Tensor, ...]]) -> tuple[torch.Tensor, ...]:
        """`make(down)`, made once for `key` (the down matrix is never changed in place: another LoRA or
        strength gives a new part, which keeps these where its down matrix is the same)."""
        value = self.derived.get(key)
        if value is None:
            value = self.derived[key] = make(self.down)
        return value


MAX_BLOCKS = 8


def _diagonal_blocks(up: torch.Tensor) -> int:
    """The largest n <= MAX_BLOCKS dividing both of up's sides whose off-diagonal blocks are all zero, else 1."""
    n_out, rank = up.shape
    if up[0, -1] != 0 or up[-1, 0] != 0:  # off-diagonal for every n: a dense up ends here
        return 1
    for n in range(MAX_BLOCKS, 1, -1):
        if n_out % n or rank % n:
            continue
        blocks = up.reshape(n, n_out // n, n, rank // n).abs().amax(dim=(1, 3))
        if not blocks.masked_fill(torch.eye(n, dtype=torch.bool, device=up.device), 0).any():
            return n
    return 1
