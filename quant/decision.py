"""The one per-layer decision: what a Linear becomes, from what is known of it (as vLLM's get_quant_method).

The quantization pass (from a model's modules), loading (from a file's header, then
from the tensor ComfyUI hands over) and a file's quantized layers (block formats off
their native GPUs) all describe the layer as a `Layer` and call `decide`.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from ..dtypes import FLOAT_DTYPES, dtype_name
from .linear_method import LinearMethod, default_device
from .patterns import first_match
from .registry import format_spec
from .selector import Selector


@dataclass
class QuantConfig:
    """What to quantize and how.

    `method` is the default (a LinearMethod, or a Selector such as auto, which
    picks one per layer shape; None: nothing is quantized online); `rules` maps
    fnmatch patterns on module names to a method (or None to keep the layer),
    first match wins; `ignored` patterns keep layers as they are. fp32 weights in
    a lower-precision model are kept unless `include_fp32`.
    """
    method: LinearMethod | Selector | None
    rules: list[tuple[str, LinearMethod | None]] = field(default_factory=list)
    ignored: tuple[str, ...] = ()
    include_fp32: bool = False
    compute_device: torch.device | None = None
    keep: dict[str, str] = field(default_factory=dict)  # module name -> reason to keep it as is
    # FP8 layers (fp8_format) are dequantized and quantized with `method`, instead of kept as they are.
    requantize_fp8: bool = False
    # Layers of a `requantizable` block format off its native GPUs are re-quantized to the fastest native format.
    requantize_blocks: bool = False
    # Modules that stand in for the tree's at run time (ComfyUI object patches).
    overrides: dict[str, nn.Module] = field(default_factory=dict)
    # Loading: the most bytes the Linear layers' weights may take, reached by moving the largest quantized
    # layers to `fit_targets` (quant/fit.py); 0: no limit.
    fit_bytes: int = 0
    fit_targets: tuple[LinearMethod, ...] = ()

    def device(self) -> torch.device:
        if self.compute_device is not None:
            return self.compute_device
        return default_device()


@dataclass(frozen=True)
class Layer:
    """What a decision reads of one Linear."""
    name: str
    in_features: int
    out_features: int
    dtype: torch.dtype                        # the stored weight's
    compute_dtype: torch.dtype | None = None  # its QuantLinear's (what a selector measures in); default `dtype`
    stored: str | None = None                 # the format it is quantized in already
    fp8: bool = False                         # `stored` is an FP8 one (fp8_format)


@dataclass(frozen=True)
class Decision:
    method: LinearMethod | None   # None: the layer stays as it is (or as the file stores it)
    reason: str
    path: str | None = None       # a stored block format: how it runs on this device, for the report
    brief: str | None = None      # the same in a layer's record


def decide(config: QuantConfig, layer: Layer, dominant: torch.dtype | None) -> Decision:
    """The one decision for a Linear: kept on purpose (`config.keep`), a stored format (block formats off
    their GPUs, FP8 under requantize_fp8), already quantized, or the float rules (`_choose`). `dominant` is
    the model's most common float dtype (fp32 in a model of another dtype is kept on purpose)."""
    if layer.name in config.keep:
        return Decision(None, config.keep[layer.name])
    if layer.stored is not None:
        return _stored(config, layer, dominant)
    if layer.dtype not in FLOAT_DTYPES:
        return Decision(None, f"already quantized ({dtype_name(layer.dtype)})")
    return Decision(*_choose(config, layer, layer.dtype, dominant))


def _stored(config: QuantConfig, layer: Layer, dominant: torch.dtype | None) -> Decision:
    spec = format_spec(layer.stored)
    if spec is not None and spec.dequantized_elsewhere:
        return _block_format(config, spec, layer)
    if layer.fp8 and config.requantize_fp8:
        method, reason = _choose(config, layer, torch.float8_e4m3fn, dominant)
        return Decision(method, reason if method is None else f"re-quantized from {layer.stored}: {reason}")
    return Decision(None, "already quantized")


def _block_format(config: QuantConfig, spec, layer: Layer) -> Decision:
    """Formats native only on some GPUs (NVFP4, MXFP8: sm100+) run dequantized per call elsewhere, unless
    a `requantizable` one is re-quantized now to this device's fastest native format."""
    from .auto import fastest_native_methods  # auto builds on this module's callers
    device = config.device()
    if spec.native(device):
        return Decision(None, "already quantized", "native comfy-kitchen GEMM", "native GEMM")
    if spec.requantizable and config.requantize_blocks:
        targets = fastest_native_methods(device, layer.in_features, layer.out_features)
        if targets:
            label = f"re-quantized at load to {targets[0].describe()}"
            return Decision(targets[0], label, label, label)
    return Decision(None, "already quantized", "dequantized before each matmul", "dequantized per call")


def _choose(config: QuantConfig, layer: Layer, dtype: torch.dtype, dominant: torch.dtype | None
            ) -> tuple[LinearMethod | None, str]:
    """The method for a full-precision (or FP8, re-quantized) Linear, or None and why it stays as it is.

    In order: ignored patterns, fp32 kept on purpose (in a model of another
    dtype), the default method or the selector's choice (auto, in the compute
    dtype), the first matching rule, then the method's own shape check.
    """
    pattern = first_match(layer.name, config.ignored)
    if pattern is not None:
        return None, f"ignored (matches {pattern!r})"
    if dtype == torch.float32 and dominant not in (None, torch.float32) and not config.include_fp32:
        return None, "stored in fp32 on purpose"
    method, reason = config.method, None
    if isinstance(method, Selector):  # auto chooses per shape
        method, reason = method.select(layer.in_features, layer.out_features, layer.compute_dtype or dtype)
        if method is None:
            return None, reason
    for rule_pattern, rule_method in config.rules:
        if first_match(layer.name, (rule_pattern,)):
            method, reason = rule_method, None
            break
    if method is None:
        return None, "kept by rule"
    why_not = method.skip_reason(layer.in_features, layer.out_features)
    if why_not is not None:
        return None, why_not
    return method, reason or method.describe()
