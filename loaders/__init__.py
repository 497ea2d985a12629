"""Checkpoint inspection and layer-by-layer building; pure torch, no ComfyUI, never a pickle."""
from .build import LayerBuilder
from .checkpoint import CheckpointContents, TensorSource, inspect_checkpoint
from .errors import CheckpointError

__all__ = ["CheckpointError", "CheckpointContents", "LayerBuilder", "TensorSource", "inspect_checkpoint"]
