"""Sol sparse attention through comfy-kitchen's `sol_attn`.

`sol_attn` takes (B, T, H, 128) with q, k and v of one shape. Each 64-token
query block attends the key blocks whose mean score clears `tau` standard
deviations of its proxy row exactly and sees every other block as one pooled
term, so higher tau is sparser (cheaper, less exact); as tau goes to minus
infinity every block is exact and the result is dense attention. On CUDA it
needs comfy-kitchen's compiled kernel (sm80+); on CPU comfy-kitchen's eager
reference computes the same routing densely (O(T^2) memory).
"""
from __future__ import annotations

import os
from importlib.metadata import version as _version

import torch

from . import compiled_ops
from .base import FLOAT_DTYPES, Backend, BackendParam, Constraints, Impl, KernelCall, Unsupported, convert, dims, load
from .kernels import kitchen
from .options import CallOptions
from .registry import register_backend

BLOCK = 64
# Below about 12k tokens dense attention is usually faster than Sol
# (comfy-kitchen's docs; ComfyUI's sparse node defaults min_tokens to 12288),
# and short sequences (text refiners) lose most from pooling.
MIN_TOKENS = 12288


def sol_min_tokens_from_env() -> int:
    """Sol's minimum sequence length; below it the dense backend is faster. BIGDIT_SOL_MIN_TOKENS overrides."""
    value = os.environ.get("BIGDIT_SOL_MIN_TOKENS", "").strip()
    return int(value) if value else MIN_TOKENS
# comfy-kitchen's eager reference refuses a score tensor above 4 GiB.
EAGER_MAX_SCORE_BYTES = 4 * 2**30


@torch.compiler.assume_constant_result  # kitchen's registry lookups cannot be traced; run once per trace
def _compiled_kernel(device: torch.device) -> bool:
    return kitchen().sol_attn_is_available(device)


def h3_sinks(options: CallOptions, tokens: int) -> tuple[tuple[int, int], tuple[int, int]]:
    """MiniMax-H3 conditioning rows as (sink_blocks, sink_q) block ranges.

    Upstream ComfyUI's H3 publishes its packed layout ([text | conditioning |
    audio | video] segments; `options.packed`). Everything before the video is
    attended exactly by every query (sink_blocks) and the target-audio query
    rows run dense (sink_q), as upstream's sparse node does by default. Other
    models, or another sequence than the layout's: none.
    """
    none = ((0, 0), (0, 0))
    layout = options.packed
    if layout is None or layout.length != tokens:
        return none
    video = next(((a, b) for a, b, kind in layout.segments if kind == "video"), None)
    if video is None or video[0] <= 0:
        return none
    blocks = (0, -(-video[0] // BLOCK))
    audio = next(((a, b) for a, b, kind in layout.segments if kind == "audio"), None)
    return blocks, (blocks if audio is None else (audio[0] // BLOCK, blocks[1]))


def key_bias_sinks(mask: torch.Tensor, tokens: int, sinks: tuple[int, int]):
    """Map an SDPA mask onto Sol: (key_bias or None, sink_blocks).

    Sol applies a per-key bias on its exact branch only, so the mask must be
    key-only ((B|1, 1, 1, T)) and the blocks holding its masked keys must be
    sink blocks (attended exactly by every query). They join the sink range
    when it stays one contiguous range; otherwise the call is declined.
    """
    if mask.dim() != 4 or mask.shape[1] != 1 or mask.shape[2] != 1 or mask.shape[3] != tokens:
        raise Unsupported("mask varies over heads or queries (Sol takes key-only masks)")
    masked = (~mask if mask.dtype == torch.bool else mask != 0).reshape(-1, tokens).any(0)
    idx = masked.nonzero()
    if idx.numel() == 0:
        return None, sinks  # nothing masked
    lo, hi = int(idx[0]) // BLOCK, int(idx[-1]) // BLOCK + 1
    s0, s1 = sinks
    if s1 > s0:
        if lo > s1 or hi < s0:
            raise Unsupported("masked keys and conditioning sinks are not one contiguous block range")
        lo, hi = min(lo, s0), max(hi, s1)
    return mask, (lo, hi)


class Sol(Impl):
    label = "sol"
    constraints = Constraints(devices=frozenset({"cuda", "cpu"}), dtypes=FLOAT_DTYPES,
                              head_dims=frozenset({128}), cross=False)

    def __init__(self, tau: float = 1.0, min_tokens: int = MIN_TOKENS):
        self.tau = float(tau)
        self.min_tokens = int(min_tokens)

    def unavailable(self):
        return load("comfy_kitchen", None, "comfy-kitchen")[1]

    def kernel_call(self, q, k, v, *, layout, mask, scale, options):
        self.constraints.check(q, k, v, layout, mask)
        if k.shape != q.shape or v.shape != q.shape:
            raise Unsupported("q, k and v differ in shape")
        ck = kitchen()
        if not hasattr(ck, "sol_attn"):
            raise Unsupported(f"comfy-kitchen {_version('comfy-kitchen')} has no sol_attn "
                              "(a newer comfy-kitchen has it, 0.2.40 does)")
        b, h, t, _ = dims(q, layout)
        if q.device.type == "cuda" and not _compiled_kernel(q.device):
            raise Unsupported("comfy-kitchen has no compiled sol_attn kernel for this GPU (needs sm80+)")
        if q.device.type == "cpu" and b * h * t * t * 4 > EAGER_MAX_SCORE_BYTES:
            raise Unsupported("too long for comfy-kitchen's O(T^2) eager reference on CPU")
        if t < self.min_tokens:
            raise Unsupported(f"fewer than {self.min_tokens} tokens, where dense is faster")
        sink_blocks, sink_q = h3_sinks(options, t)
        key_bias = None
        if mask is not None:
            key_bias, sink_blocks = key_bias_sinks(mask, t, sink_blocks)

        def run():
            qs, ks, vs = (convert(x, layout, "BSHD") for x in (q, k, v))
            if q.device.type == "cuda" and q.dtype == torch.float32:
                # the kernel takes bf16/fp16 and quantizes to int8 anyway; bf16 keeps fp32's range
                qs, ks, vs = (x.to(torch.bfloat16) for x in (qs, ks, vs))
            out = compiled_ops.sol_attention(qs, ks, vs, tau=self.tau, scale=scale, sink_blocks=sink_blocks,
                                             sink_q=sink_q, key_bias=key_bias).to(q.dtype)
            return convert(out, "BSHD", layout)

        return KernelCall(self.label, run)


TAU = BackendParam("sol_tau", default=1.0, low=0.0, high=4.0, step=0.05,
                   tooltip="Sol routing threshold in standard deviations of the block scores: higher attends "
                           "fewer key blocks exactly, faster and less exact.")


@register_backend("sol", dense=False, aliases=("sol_attn",), params=(TAU,))
def sol(sol_tau: float = TAU.default, sol_min_tokens: int | None = None, **_) -> Backend:
    """Sol at `sol_tau`, declining calls below `sol_min_tokens` (default: BIGDIT_SOL_MIN_TOKENS, else MIN_TOKENS)."""
    min_tokens = sol_min_tokens_from_env() if sol_min_tokens is None else sol_min_tokens
    return Backend("sol", [Sol(tau=sol_tau, min_tokens=min_tokens)], settings=f"tau {float(sol_tau):g}")
