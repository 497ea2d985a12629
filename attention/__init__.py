"""Pluggable attention: a registry of backends (SDPA, FlashAttention, Sage,
comfy-kitchen INT8, Sol sparse) with one call signature,

    backend(q, k, v, *, layout="BHSD", mask=None, scale=None, options=CallOptions()) -> out

fallbacks and a dense schedule. Core: it never imports ComfyUI nor reads its options
(host/attention.py installs the router through ComfyUI's attention hook and fills each
call's `CallOptions` from transformer_options).
"""
from .base import Backend, BackendParam, Constraints, Unsupported
from .options import CallOptions, PackedLayout
from .registry import BACKENDS, DENSE_BACKENDS, backend_params, create, parse
from .router import AttentionStats, Router, summary

__all__ = [
    "BACKENDS", "DENSE_BACKENDS", "AttentionStats", "Backend", "BackendParam", "CallOptions", "Constraints",
    "PackedLayout", "Router", "Unsupported", "backend_params", "create", "parse", "summary",
]
