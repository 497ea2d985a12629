"""Quantization core: methods behind one interface, and a per-layer dispatcher.

Nothing here imports ComfyUI; `nodes/` adapts it.
"""
from . import registry  # first: the formats register in its order
from .dispatch import QuantConfig, plan_layers, quantize_layers, apply_replacements
from .linear import QuantLinear
from .registry import available_methods, get_method
from .report import QuantReport

__all__ = [
    "QuantConfig", "QuantLinear", "QuantReport",
    "available_methods", "apply_replacements", "get_method", "plan_layers", "quantize_layers",
]
