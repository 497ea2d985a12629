"""Backend names and the registry that builds them.

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
- sage: sageattention 1.0.6.
- kitchen_int8: comfy-kitchen's INT8 attention.
- sol: comfy-kitchen's Sol sparse attention.
- auto: the fastest exact dense kernel for the GPU by a measured table (auto.py).
"""
from __future__ import annotations

from .auto import Auto
from .base import Backend
from .fa3_fp8 import FA3Fp8
from .kernels import FA2, FA4, FA3Fwd, FA3Interface, KitchenInt8, Sage, Sdpa
from .sol import MIN_TOKENS, Sol

BACKENDS = ("auto", "sdpa", "sage", "kitchen_int8", "flash", "fa3_fp8", "sol")
DENSE_BACKENDS = ("auto", "sdpa", "sage", "kitchen_int8", "flash", "fa3_fp8")
ALIASES = {
    "pytorch": "sdpa",
    "sageattention": "sage",
    "sage_attn": "sage",
    "fa": "flash",
    "flash_attn": "flash",
    "flash_fp8": "fa3_fp8",
    "int8": "kitchen_int8",
    "sol_attn": "sol",
}


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


def create(name: str, *, sol_tau: float = 1.0, sol_min_tokens: int = MIN_TOKENS) -> Backend:
    """A backend by (any accepted spelling of) its name."""
    name = parse(name)
    if name == "auto":
        return Auto()
    impls = {
        "sdpa": [Sdpa()],
        "sage": [Sage()],
        "kitchen_int8": [KitchenInt8()],
        "flash": [FA3Fwd(), FA3Interface(), FA2(), FA4()],
        "fa3_fp8": [FA3Fp8()],
        "sol": [Sol(tau=sol_tau, min_tokens=sol_min_tokens)],
    }[name]
    return Backend(name, impls)
