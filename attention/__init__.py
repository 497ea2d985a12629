"""Pluggable attention: a registry of backends (SDPA, FlashAttention, Sage,
comfy-kitchen INT8, Sol sparse) with one call signature,

    backend(q, k, v, *, layout="BHSD", mask=None, scale=None) -> out

fallbacks and a dense schedule. Core: it never imports ComfyUI (host/attention.py
installs the router through ComfyUI's attention hook).
"""
from .base import Backend, BackendParam, Constraints, Unsupported
from .registry import BACKENDS, DENSE_BACKENDS, backend_params, create, parse
from .router import AttentionStats, Router, summary

__all__ = [
    "BACKENDS", "DENSE_BACKENDS", "AttentionStats", "Backend", "BackendParam", "Constraints",
    "Router", "Unsupported", "backend_params", "create", "parse", "summary",
]
