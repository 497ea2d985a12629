"""fa3_fp8: FlashAttention 3's FP8 forward (the `fa3-fwd` wheel, Hopper) on
q, k and v quantized to FP8 E4M3 by fp8_qkv's Triton pass.

It is the fastest dense kernel on Hopper (README, end-to-end table), but
not exact: FP8 E4M3 keeps 3 mantissa bits, about 2.6% RMS error per element whatever the
scale, so the output differs from exact attention by about 0.03 (relative L2,
locality-structured inputs) to 0.055 (unstructured random inputs);
`auto` runs it only on shapes where a probe of the call stays within its
declared error (auto.py). fp16 and bf16 inputs both work (the FP8
kernel returns bf16, cast back to the input's dtype), although fa3-fwd 0.0.3
has no fp16 kernel of its own.
"""
from __future__ import annotations

from . import fp8_qkv
from .base import HALF_DTYPES, Backend, Constraints, Impl, convert, load
from .kernels import _first
from .registry import register_backend

# head dims the fa3-fwd 0.0.3 wheel compiles FP8 kernels for
FP8_HEAD_DIMS = frozenset({64, 96, 128, 192, 256})


class FA3Fp8(Impl):
    label = "fa3_fp8"
    module, attr, package = "fa3_fwd_interface", "flash_attn_func", "fa3-fwd"
    # descales are per (batch, key/value head): grouped-query calls would share q's scale per group
    constraints = Constraints(min_capability=(9, 0), max_capability=(9, 0), dtypes=HALF_DTYPES,
                              head_dims=FP8_HEAD_DIMS, masks=False)
    max_error = 0.05  # `auto` weighs it only where a probe of the call stays within this (see above)

    def unavailable(self):
        why = load(self.module, self.attr, self.package)[1] or fp8_qkv.TRITON_MISSING
        if why:
            return why
        config, _ = load("fa3_fwd_config", "CONFIG", self.package)
        if config and config.get("build_flags", {}).get("FLASHATTENTION_DISABLE_FP8"):
            return "this fa3-fwd build has no FP8 kernels"
        return None

    def _run(self, q, k, v, layout, mask, scale):
        fn = load(self.module, self.attr, self.package)[0]
        x = fp8_qkv.quantize_qkv(q, k, v, layout)
        out = _first(fn(x.q, x.k, x.v, softmax_scale=scale, causal=False,
                        q_descale=x.descale[0], k_descale=x.descale[1], v_descale=x.descale[2]))
        return convert(out.to(q.dtype), "BSHD", layout)


@register_backend("fa3_fp8", aliases=("flash_fp8",))
def fa3_fp8(**_) -> Backend:
    return Backend("fa3_fp8", [FA3Fp8()])
