"""Pluggable attention: a registry of backends (SDPA, FlashAttention, Sage,
comfy-kitchen INT8, Sol sparse) with one call signature,

    backend(q, k, v, *, layout="BHSD", mask=None, scale=None) -> out

fallbacks, a dense schedule for Sol, and ComfyUI's attention hook. Core: it
never imports ComfyUI.
"""
from .base import Backend, Constraints, Unsupported
from .override import AttentionOverride, install, is_ours
from .registry import BACKENDS, DENSE_BACKENDS, create, parse
from .router import AttentionStats, Router, summary

__all__ = [
    "BACKENDS", "DENSE_BACKENDS", "AttentionOverride", "AttentionStats", "Backend", "Constraints",
    "Router", "Unsupported", "create", "install", "is_ours", "parse", "summary",
]
