"""comfy-kitchen, which every quantized layer of the pack runs on.

Where it is missing the server still starts; a node that would build quantized
layers fails when it loads, with one message naming the package and the nodes
affected, instead of a bare ModuleNotFoundError in the sampler later.
"""
from __future__ import annotations

from ..quant.registry import kitchen_missing

NEEDS_KITCHEN = ("QuantizeModelINT8", "MixedCheckpointLoader (quantized files)",
                 "LoadH3Quantized (a quantization other than none, or a quantized file)",
                 "QuantizedCLIPLoader (quantized files)")


class KitchenMissing(RuntimeError):
    pass


def require_kitchen(node: str) -> None:
    why = kitchen_missing()
    if why is not None:
        raise KitchenMissing(
            f"{node} needs the package comfy-kitchen, which cannot be imported ({why}). Every quantized layer of "
            f"this pack runs on it, so without it these nodes refuse to build quantized models: "
            f"{', '.join(NEEDS_KITCHEN)}. Install it into ComfyUI's Python environment (pip install comfy-kitchen; "
            f"the pack's requirements.txt names the version).")
