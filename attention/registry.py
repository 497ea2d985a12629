"""Backend names and the registry that builds them: each backend module registers a factory
(`@register_backend`), so a new backend is one new module and its line in the import below.

Names are read case-insensitively, with "-" and "_" alike, and with aliases.
Each backend lists its kernels in preference order:

- sdpa: torch SDPA, the reference.
- flash: the best importable FlashAttention: FA3 (fa3-fwd, then flash-attn's
  hopper build), FA2 (flash-attn), FA4 (flash-attn-4); a call none of them
  takes (fp16 on fa3-fwd's bf16 build, say) goes to the dense backend, since
  SDPA's own flash kernel is slower than the cuDNN kernel SDPA picks by itself
  (README, end-to-end table).
  Statistics name the one that ran ("flash:fa3_fwd").
- fa3_fp8: FA3's FP8 kernel on q, k, v quantized per (batch, head) by one
  fused Triton pass (fa3_fp8.py, fp8_qkv.py); Hopper with fa3-fwd.
- sage: SageAttention 2's kernel for the GPU's architecture, else its Triton
  kernel, or sageattention 1.0.6 (sage.py).
- kitchen_int8: comfy-kitchen's INT8 attention.
- sol: comfy-kitchen's Sol sparse attention.
- auto: the fastest dense kernel for the GPU and shape, measured at first use
  (approximate ones only within their declared error) (auto.py).
"""
from __future__ import annotations

import math
from typing import Callable

from .base import Backend, BackendParam

# name -> (factory(**settings) -> Backend, dense); filled by @register_backend
_BACKENDS: dict[str, tuple[Callable[..., Backend], bool]] = {}
_SELECTORS: dict[str, Callable[..., Backend]] = {}
_PARAMS: dict[str, tuple[BackendParam, ...]] = {}
ALIASES: dict[str, str] = {}


def register_backend(name: str, *, dense: bool = True, aliases: tuple[str, ...] = (), selector: bool = False,
                     params: tuple[BackendParam, ...] = ()):
    """Register a backend factory under `name`: `dense` backends compute exact-shape dense attention (they
    can be a dense_backend); a `selector` (auto) picks among the others and is listed first; `params` are the
    settings the factory takes by name, which SetAttentionBackend offers as inputs."""
    def register(factory: Callable[..., Backend]) -> Callable[..., Backend]:
        if name in _BACKENDS or name in _SELECTORS:
            raise ValueError(f"attention backend {name!r} is registered twice")
        if selector:
            _SELECTORS[name] = factory
        else:
            _BACKENDS[name] = (factory, dense)
        _PARAMS[name] = params
        ALIASES.update({alias: name for alias in aliases})
        return factory
    return register


# Each module registers its backends as it is imported; this order is the nodes' option order.
from . import auto, kernels, sage, fa3_fp8, sol  # noqa: E402,F401

BACKENDS = (*_SELECTORS, *_BACKENDS)
DENSE_BACKENDS = (*_SELECTORS, *(name for name, (_, dense) in _BACKENDS.items() if dense))


def parse(name: str, *, dense: bool = False) -> str:
    """Canonical backend name; ValueError listing the valid names otherwise.
    `dense=True` accepts only backends that compute exact-shape dense
    attention (not sol)."""
    valid = DENSE_BACKENDS if dense else BACKENDS
    key = str(name).strip().lower().replace("-", "_")
    canonical = key if key in BACKENDS else ALIASES.get(key)
    if canonical not in valid:
        aliases = ", ".join(f"{a} -> {c}" for a, c in ALIASES.items() if c in valid)
        kind = "dense attention backend" if dense else "attention backend"
        raise ValueError(f"unknown {kind} {name!r}; valid: {', '.join(valid)} (aliases: {aliases})")
    return canonical


def dense_kernels() -> list:
    """Every kernel of every dense backend, once each (by label), in the order of the backends."""
    kernels = {}
    for name in DENSE_BACKENDS:
        if name in _BACKENDS:
            for impl in _BACKENDS[name][0]().kernels:
                kernels.setdefault(impl.label, impl)
    return list(kernels.values())


def backend_params() -> tuple[BackendParam, ...]:
    """Every backend's declared settings, in the backends' order (SetAttentionBackend's inputs)."""
    return tuple(param for params in _PARAMS.values() for param in params)


def is_dense(name: str) -> bool:
    name = parse(name)
    return name in _SELECTORS or _BACKENDS[name][1]


def create(name: str, **settings) -> Backend:
    """A backend by (any accepted spelling of) its name, with `settings` (each backend takes its declared ones
    and ignores the others; ValueError for a declared one that is no finite number). Their ranges are the
    node's (BackendParam.problem): a kernel takes any finite value."""
    name = parse(name)
    for param in _PARAMS[name]:
        value = settings.get(param.name, param.default)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise ValueError(f"{param.name} must be a finite number, got {value!r}")  # NaN passes every comparison
    factory = _SELECTORS[name] if name in _SELECTORS else _BACKENDS[name][0]
    return factory(**settings)
