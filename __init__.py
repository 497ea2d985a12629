"""ComfyUI entry point of the BigDiT pack.

ComfyUI imports this folder as a package. Only `host/` and `nodes/` touch
ComfyUI; the core packages (`quant/`, `attention/`, `loaders/`, `offload/`)
import without it, and so does this file (tools and test runners import it
outside ComfyUI).
"""
import importlib.util

if importlib.util.find_spec("comfy") is not None:
    from .nodes import NODE_CLASS_MAPPINGS, NODE_DISPLAY_NAME_MAPPINGS
else:
    NODE_CLASS_MAPPINGS, NODE_DISPLAY_NAME_MAPPINGS = {}, {}

WEB_DIRECTORY = "./web"

__all__ = ["NODE_CLASS_MAPPINGS", "NODE_DISPLAY_NAME_MAPPINGS", "WEB_DIRECTORY"]
