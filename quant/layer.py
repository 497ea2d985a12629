"""The one per-layer record: a Linear from what is known of it, through its decision, to the built layer.

Every path from a Linear to a QuantLinear carries a `Layer`: loading makes one from
a file's header (or from the tensor ComfyUI hands over, where the header has no
such key), the quantization pass from a live module. `decision.decide` fills in the
choice once (`action`, `method`, `reason`), and the builder fills in the bytes. The
report lists these same records.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from .linear_method import LinearMethod

# What the builder does with a layer.
KEEP = "keep"           # stays as it is: a plain layer, or one someone else quantized before this pass
QUANTIZE = "quantize"   # a full-precision weight quantized by `method`
LOAD = "load"           # a stored format built as stored (its own `method`)
CONVERT = "convert"     # a stored format dequantized and quantized again by `method`


@dataclass
class Layer:
    name: str
    in_features: int
    out_features: int
    dtype: torch.dtype                        # the stored weight's: a float dtype, or a quantized storage dtype
    compute_dtype: torch.dtype | None = None  # its QuantLinear's (what a selector measures in); default `dtype`
    stored: str | None = None                 # the registered format it is quantized in already
    options: dict = field(default_factory=dict)  # that format's method options (a marker's)
    stored_label: str | None = None           # how reports name the stored format, where not `stored`
    linear: bool = True                       # False: a weight-bearing module that is not Linear-like
    # the decision
    action: str = ""
    method: LinearMethod | None = None        # what the built layer runs (LOAD: the stored format's own)
    reason: str = ""
    path: str | None = None                   # a stored format: how it runs on this device, for the report
    brief: str | None = None                  # a stored format: its fate in a few words, for a loader's reason
    # the outcome
    bytes_before: int = 0
    bytes_after: int = 0

    def decided(self, action: str, method: LinearMethod | None, reason: str, path: str | None = None) -> "Layer":
        self.action, self.method, self.reason, self.path = action, method, reason, path
        return self

    def conversion(self, target: LinearMethod | None, reason: str, path: str | None = None,
                   brief: str | None = None) -> "Layer":
        """A stored layer as its format decides it (QuantFormat.stored_decision): re-quantized to `target`
        (CONVERT), or, None, run as stored (KEEP; a load builds it as stored, LOAD: decision.decide)."""
        self.brief = brief
        return self.decided(KEEP if target is None else CONVERT, target, reason, path)

    @property
    def shape(self) -> tuple[int, int]:
        return self.out_features, self.in_features

    @property
    def plain_bytes(self) -> int:
        """What its weight takes as stored, where it is a plain matrix."""
        return self.dtype.itemsize * self.in_features * self.out_features

    @property
    def earlier(self) -> bool:
        """Quantized before this pass and left so (not counted as this pass's)."""
        return self.action == KEEP and self.stored is not None

    @property
    def format(self) -> str | None:
        """The format the report names: what it runs, or for an earlier layer the format it came in."""
        if self.method is not None:
            return self.method.name
        return (self.stored_label or self.stored) if self.earlier else None
