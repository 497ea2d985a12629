"""The one decision: what each Linear becomes (as vLLM's get_quant_method), made once per layer.

`decide(config, layer, dominant)` settles one `Layer` (quant/layer.py): kept on
purpose, a stored format (loaded as stored, or converted: the format's own
`stored_decision`, asked with the mode the config gives that format), already
quantized, or the float rules (ignored patterns, fp32 on purpose, auto, rules,
shape). `decide_all` decides every layer of a model, then, where the config gives
a byte budget, moves the largest quantized layers to the fit formats (quant/fit.py):
that move is part of the decision, and nothing after it changes a layer's method.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from ..dtypes import FLOAT_DTYPES, dtype_name
from .layer import CONVERT, KEEP, LOAD, QUANTIZE, Layer
from .linear_method import LinearMethod, default_device
from .patterns import first_match
from .registry import format_spec, get_method
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
    # stored format name -> one of its `conversion_modes`: what becomes of layers stored in it (absent: as stored)
    conversions: dict[str, str] = field(default_factory=dict)
    # Modules that stand in for the tree's at run time (ComfyUI object patches).
    overrides: dict[str, nn.Module] = field(default_factory=dict)
    # The most bytes the Linear layers' weights may take, reached by moving the largest quantized layers to
    # `fit_targets` (quant/fit.py); 0: no limit.
    fit_bytes: int = 0
    fit_targets: tuple[LinearMethod, ...] = ()

    def device(self) -> torch.device:
        if self.compute_device is not None:
            return self.compute_device
        return default_device()


class StoredContext:
    """What a stored format's `stored_decision` may ask of the config: the device, the choice the config makes
    for the layer as a full-precision one, this device's native formats for its shape, and whether a kept
    measurement says converting to the fastest of them pays."""

    def __init__(self, config: QuantConfig, dominant: torch.dtype | None):
        self.config, self.dominant = config, dominant
        self.device = config.device()

    def float_choice(self, layer: Layer, dtype: torch.dtype) -> tuple[LinearMethod | None, str]:
        return _choose(self.config, layer, dtype, self.dominant)

    def fastest_native(self, layer: Layer) -> list[LinearMethod]:
        from .auto import fastest_native_methods  # auto builds on this module's callers
        return fastest_native_methods(self.device, layer.in_features, layer.out_features)

    def faster_native(self, layer: Layer, stored: LinearMethod) -> tuple[LinearMethod | None, str, str]:
        """auto's conversion of a stored layer: (the target or None, why, the numbers); nothing timed unless
        asked (quant/auto.py `faster_than_stored`)."""
        from .auto import faster_than_stored
        return faster_than_stored(self.device, layer, stored)


def stored_method(layer: Layer) -> LinearMethod:
    """The method that runs a layer as its format stores it."""
    return get_method(layer.stored, **layer.options)


def decide(config: QuantConfig, layer: Layer, dominant: torch.dtype | None, loading: bool = False) -> Layer:
    """Settle `layer` (see the module's docstring). `dominant` is the model's most common float dtype (fp32 in a
    model of another dtype is kept on purpose). `loading`: a stored layer becomes a QuantLinear of its format
    (LOAD) rather than staying the module it is (KEEP)."""
    if layer.name in config.keep:
        return layer.decided(KEEP, None, config.keep[layer.name])
    if layer.stored is not None:
        return _stored(config, layer, dominant, loading)
    if layer.dtype not in FLOAT_DTYPES:
        return layer.decided(KEEP, None, f"already quantized ({dtype_name(layer.dtype)})")
    if config.method is None and not config.rules:
        return layer.decided(KEEP, None, "not quantized in the checkpoint" if loading else "no quantization asked")
    method, reason = _choose(config, layer, layer.dtype, dominant)
    return layer.decided(KEEP if method is None else QUANTIZE, method, reason)


def decide_all(config: QuantConfig, layers: list[Layer], dominant: torch.dtype | None,
               loading: bool = False) -> str | None:
    """Decide every layer, then fit them into `config.fit_bytes`; returns the fit's note for the report."""
    for layer in layers:
        decide(config, layer, dominant, loading)
    if not config.fit_bytes:
        return None
    from .fit import fit_layers
    fit = fit_layers(layers, config.fit_bytes, list(config.fit_targets))
    for layer in layers:
        target = fit.moved.get(layer.name)
        if target is not None:
            layer.decided(QUANTIZE, target, f"moved to fit: {target.describe()}")
    return fit.note()


def _stored(config: QuantConfig, layer: Layer, dominant: torch.dtype | None, loading: bool) -> Layer:
    spec = format_spec(layer.stored)
    if spec is None:
        return layer.decided(KEEP, None, "already quantized")
    mode = config.conversions.get(layer.stored)
    layer = spec.stored_decision(layer, mode, StoredContext(config, dominant))  # CONVERT or KEEP
    if not loading:
        return layer
    reason = f"{layer.stored} {'in' if layer.action == CONVERT else 'from'} the checkpoint"
    if layer.brief is not None:
        reason += f", {layer.brief}"
    if layer.action == CONVERT:
        return layer.decided(CONVERT, layer.method, reason, layer.path)
    return layer.decided(LOAD, stored_method(layer), reason, layer.path)


def _choose(config: QuantConfig, layer: Layer, dtype: torch.dtype, dominant: torch.dtype | None
            ) -> tuple[LinearMethod | None, str]:
    """The method for a full-precision (or stored, re-quantized) Linear, or None and why it stays as it is.

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
