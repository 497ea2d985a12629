"""Quantization core: methods behind one interface, one per-layer decision, and the quantization pass.

Nothing here imports ComfyUI; `nodes/` adapts it.
"""
from . import registry  # first: the formats register in its order
from .decision import QuantConfig
from .quantize_pass import apply_replacements, decide_modules, quantize_layers
from .linear import QuantLinear
from .registry import available_methods, get_method
from .report import QuantReport

__all__ = [
    "QuantConfig", "QuantLinear", "QuantReport",
    "available_methods", "apply_replacements", "decide_modules", "get_method", "quantize_layers",
]
