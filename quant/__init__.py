"""Quantization core: methods behind one interface, one per-layer record and decision, and the quantization pass.

Nothing here imports ComfyUI; `host/` adapts it.
"""
from . import registry  # first: the formats register in its order
from .decision import QuantConfig
from .layer import Layer
from .quantize_pass import apply_replacements, module_layers, quantize_layers
from .linear import QuantLinear
from .registry import available_methods, get_method
from .report import QuantReport

__all__ = [
    "Layer", "QuantConfig", "QuantLinear", "QuantReport",
    "available_methods", "apply_replacements", "get_method", "module_layers", "quantize_layers",
]
