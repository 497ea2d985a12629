"""The interface every quantization method implements.

Modelled on sglang's/vLLM's LinearMethod: a method decides whether it can take
a layer, turns a full-precision weight into its stored tensors once
(`quantize_weight`, run on the compute device one layer at a time), and runs
the layer's forward from those tensors (`apply`).

The output dtype rule, the same for every method: `apply` returns the input's
dtype (float16, bfloat16 or float32), as torch.nn.Linear does and as
ComfyUI's cast layers do (they cast the weight to the input's dtype); only an
input in any other dtype gets the layer's compute dtype (`output_dtype`).
So layers of different formats side by side (an attention's q, k and v)
always agree. Where a kernel cannot write that dtype, the method converts.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING

import torch

from ..dtypes import FLOAT_DTYPES

if TYPE_CHECKING:
    from .linear import QuantLinear


def output_dtype(x: torch.Tensor, compute_dtype: torch.dtype) -> torch.dtype:
    """The dtype `apply` returns for input `x` (see the module docstring)."""
    return x.dtype if x.dtype in FLOAT_DTYPES else compute_dtype


def default_device() -> torch.device:
    """Where layers compute when no host chose a device: the GPU if there is one."""
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


class LinearMethod(ABC):
    #: Short format name, used in reports and checkpoint markers.
    name: str = ""

    def skip_reason(self, in_features: int, out_features: int) -> str | None:
        """Why this method cannot take a layer of this shape, or None."""
        return None

    @abstractmethod
    def quantize_weight(self, weight: torch.Tensor) -> dict[str, torch.Tensor]:
        """Stored tensors for a full-precision [out, in] weight. Must not modify `weight`."""

    @abstractmethod
    def apply(self, layer: "QuantLinear", x: torch.Tensor, input_act: str | None = None) -> torch.Tensor:
        """The layer's output for `x` (and the optional fused input activation), in `output_dtype(x, ...)`."""

    def dequantize(self, layer: "QuantLinear", device: torch.device | None = None) -> torch.Tensor:
        """The full-precision weight this layer represents (for LoRA, tests and fallbacks), computed on
        `device` (default: the weight's), wherever ComfyUI left each of the layer's tensors."""
        raise NotImplementedError(f"{self.name} cannot dequantize")

    def describe(self) -> str:
        return self.name

    def missing(self) -> str | None:
        """What this environment lacks to run the method (an older comfy-kitchen's layouts), or None."""
        return None
