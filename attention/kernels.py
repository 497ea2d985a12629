"""The dense attention kernels. Optional packages are imported on first use;
a missing one makes its kernel decline calls with a reason, never crash."""
from __future__ import annotations

import dataclasses
import inspect

import torch
import torch.nn.functional as F

from .base import FLOAT_DTYPES, HALF_DTYPES, Backend, Constraints, Impl, Unsupported, convert, load
from .registry import register_backend

try:
    from torch.nn.attention import SDPBackend, sdpa_kernel
    _SDPA_PRIORITY = "set_priority" in inspect.signature(sdpa_kernel).parameters
except ImportError:  # torch < 2.3
    SDPBackend = sdpa_kernel = None
    _SDPA_PRIORITY = False


def _first(result):
    # some FlashAttention builds return (out, softmax_lse)
    return result[0] if isinstance(result, tuple) else result


def _sdpa(q, k, v, layout, mask, scale):
    qh, kh, vh = (convert(t, layout, "BHSD") for t in (q, k, v))
    # scale passed only when given, so the call is the one ComfyUI makes
    extra = {} if scale is None else {"scale": scale}
    if kh.shape[1] != qh.shape[1]:
        extra["enable_gqa"] = True
    out = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask, dropout_p=0.0, is_causal=False, **extra)
    return convert(out, "BHSD", layout)


class Sdpa(Impl):
    """torch's scaled_dot_product_attention with torch's own kernel choice:
    the reference every other kernel is compared with and falls back to."""

    label = "sdpa"
    constraints = Constraints(devices=None, dtypes=None, grouped_kv=True)
    traceable = True

    def _run(self, q, k, v, layout, mask, scale):
        return _sdpa(q, k, v, layout, mask, scale)


class SdpaFlash(Impl):
    """SDPA restricted to its FlashAttention kernel: `flash` when no
    FlashAttention package is installed."""

    label = "sdpa_flash"
    constraints = Constraints(min_capability=(8, 0), dtypes=HALF_DTYPES, max_head_dim=256, masks=False)

    def unavailable(self):
        return None if sdpa_kernel is not None else "torch has no sdpa_kernel"

    def _run(self, q, k, v, layout, mask, scale):
        with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
            return _sdpa(q, k, v, layout, mask, scale)


class SdpaCudnn(Impl):
    """SDPA with cuDNN's kernel first (torch falls through to its others when
    cuDNN cannot take a shape). Measured faster than torch's default choice
    on Hopper, so `auto` can pick it."""

    label = "sdpa_cudnn"
    constraints = Constraints(grouped_kv=True)

    def unavailable(self):
        return None if _SDPA_PRIORITY else "this torch cannot set the SDPA kernel priority"

    def _run(self, q, k, v, layout, mask, scale):
        order = [SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION,
                 SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]
        with sdpa_kernel(order, set_priority=True):
            return _sdpa(q, k, v, layout, mask, scale)


class _FlashAttn(Impl):
    """A FlashAttention package's `flash_attn_func` on (B, S, H, D)."""

    module = attr = package = ""

    def unavailable(self):
        return load(self.module, self.attr, self.package)[1]

    def _run(self, q, k, v, layout, mask, scale):
        fn = load(self.module, self.attr, self.package)[0]
        qs, ks, vs = (convert(t, layout, "BSHD") for t in (q, k, v))
        out = _first(fn(qs, ks, vs, softmax_scale=scale, causal=False))
        return convert(out, "BSHD", layout)


class FA3Fwd(_FlashAttn):
    """FlashAttention 3 from the forward-only `fa3-fwd` wheel (Hopper)."""

    label = "fa3_fwd"
    module, attr, package = "fa3_fwd_interface", "flash_attn_func", "fa3-fwd"
    _base = Constraints(min_capability=(9, 0), max_capability=(9, 0), dtypes=HALF_DTYPES,
                        max_head_dim=256, masks=False)

    @property
    def constraints(self):
        # the wheel's build config says which dtypes it compiled (0.0.3: bf16 only)
        config, _ = load("fa3_fwd_config", "CONFIG", "fa3-fwd")
        if config and config.get("build_flags", {}).get("FLASHATTENTION_DISABLE_FP16"):
            return dataclasses.replace(self._base, dtypes=frozenset({torch.bfloat16}))
        return self._base


class FA3Interface(_FlashAttn):
    """FlashAttention 3 built from flash-attn's hopper/ directory."""

    label = "fa3"
    module, attr, package = "flash_attn_interface", "flash_attn_func", "flash_attn_interface (FA3)"
    constraints = Constraints(min_capability=(9, 0), max_capability=(9, 0), dtypes=HALF_DTYPES,
                              max_head_dim=256, masks=False)


class FA2(_FlashAttn):
    label = "fa2"
    module, attr, package = "flash_attn", "flash_attn_func", "flash-attn"
    constraints = Constraints(min_capability=(8, 0), dtypes=HALF_DTYPES, max_head_dim=256, masks=False)

    def _run(self, q, k, v, layout, mask, scale):
        fn = load(self.module, self.attr, self.package)[0]
        qs, ks, vs = (convert(t, layout, "BSHD") for t in (q, k, v))
        out = fn(qs, ks, vs, dropout_p=0.0, softmax_scale=scale, causal=False)
        return convert(out, "BSHD", layout)


class FA4(_FlashAttn):
    """FlashAttention 4 (CuTe DSL, Hopper and Blackwell)."""

    label = "fa4"
    module, attr, package = "flash_attn.cute", "flash_attn_func", "flash-attn-4"
    constraints = Constraints(min_capability=(9, 0), max_capability=(10, 3), dtypes=HALF_DTYPES,
                              head_dims=frozenset({64, 96, 128}), masks=False)


def kitchen():
    """comfy_kitchen, or Unsupported saying why not."""
    ck, why = load("comfy_kitchen", None, "comfy-kitchen")
    if why:
        raise Unsupported(why)
    return ck


class KitchenInt8(Impl):
    """comfy-kitchen's INT8 attention on (B, H, S, D); CUDA only."""

    label = "kitchen_int8"
    constraints = Constraints(max_head_dim=256)
    max_error = 0.05  # INT8 q, k, v and probabilities: `auto` weighs it only where a probe stays within this

    def unavailable(self):
        return load("comfy_kitchen", None, "comfy-kitchen")[1]

    def kernel_call(self, q, k, v, *, layout, mask, scale, options):
        self.constraints.check(q, k, v, layout, mask)
        ck = kitchen()
        if not ck.int8_attention_is_available(q.device):
            raise Unsupported("comfy-kitchen has no INT8 attention kernel for this GPU (CUDA extension, sm75+)")
        if mask is not None and mask.dtype != torch.bool and mask.dtype not in FLOAT_DTYPES:
            raise Unsupported(f"mask dtype {mask.dtype}")
        return super().kernel_call(q, k, v, layout=layout, mask=mask, scale=scale, options=options)

    def _run(self, q, k, v, layout, mask, scale):
        ck = kitchen()
        qh, kh, vh = (convert(t, layout, "BHSD") for t in (q, k, v))
        return convert(ck.int8_attention(qh, kh, vh, scale=scale, attn_mask=mask), "BHSD", layout)


@register_backend("sdpa", aliases=("pytorch",))
def sdpa(**_) -> Backend:
    return Backend("sdpa", [Sdpa()])


@register_backend("kitchen_int8", aliases=("int8",))
def kitchen_int8(**_) -> Backend:
    return Backend("kitchen_int8", [KitchenInt8()])


@register_backend("flash", aliases=("fa", "flash_attn"))
def flash(**_) -> Backend:
    return Backend("flash", [FA3Fwd(), FA3Interface(), FA2(), FA4()])
