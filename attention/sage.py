"""sage: SageAttention. SageAttention 2 (2.x) through its per-architecture
kernels, SageAttention 1 (sageattention 1.0.6, Triton) where that is what is
installed.

Every kernel quantizes q and k to INT8 (per thread or warp block), subtracts
the key mean first (`smooth_k`, on a new tensor in 2.x) and computes P.V in
FP8 or FP16 with FP32 accumulation; about 0.03 relative L2 from exact
attention on video DiT inputs (README). 2.x's own `sageattn` picks one kernel
per GPU; the pack calls the entry points itself, so that each declares what
it takes and the report names the one that ran:

| kernel       | 2.x entry point                                   | GPUs           | P.V            |
|--------------|---------------------------------------------------|----------------|----------------|
| sage2_sm90   | sageattn_qk_int8_pv_fp8_cuda_sm90 (fp32+fp32)     | 9.0            | FP8, wgmma     |
| sage2_fp8    | sageattn_qk_int8_pv_fp8_cuda (fp32+fp16)          | 8.9, 12.0, 12.1| FP8 mma        |
| sage2_fp16   | sageattn_qk_int8_pv_fp16_cuda (fp32)              | 8.0, 8.6, 8.7  | FP16 mma       |
| sage2_triton | sageattn_qk_int8_pv_fp16_triton                   | 8.0 to 10.x    | FP16, Triton   |
| sage1        | 1.0.6's sageattn                                  | 8.0 and newer  | FP16, Triton   |

The CUDA kernels exist only for the architectures the package was built for
(its `SM80/89/90_ENABLED`); a GPU whose kernel is missing runs the next one
that takes the call, and the log says so once. Common to all: fp16 or bf16,
head dim at most 128 (the kernels pad to 64 or 128; 1.0.6 takes 64, 96, 128),
no mask (2.x's CUDA entry points take `**kwargs` and would ignore one), the
last dimension contiguous.
"""
from __future__ import annotations

from .base import HALF_DTYPES, Backend, Constraints, Impl, capability, load
from .registry import register_backend

PACKAGE = "sageattention"
# relative L2 from exact attention each kernel is held to where `auto` weighs it (measured 0.031 on the H200)
MAX_ERROR = 0.05


def _layout(layout: str) -> str:
    return "HND" if layout == "BHSD" else "NHD"


def _contiguous_last(*ts):
    # the CUDA kernels read the head dim as contiguous; ComfyUI's views of a projection already are
    return tuple(t if t.stride(-1) == 1 else t.contiguous() for t in ts)


def installed_major() -> int | None:
    """1 or 2 by what the installed sageattention offers (its 2.x entry points), None when missing."""
    mod, _ = load(PACKAGE, None, PACKAGE)
    if mod is None:
        return None
    return 2 if hasattr(mod, "sageattn_qk_int8_pv_fp16_triton") else 1


class _Sage2(Impl):
    """One SageAttention 2 entry point; `built` names the compiled extension it needs (None: Triton)."""

    entry = ""
    built: str | None = None
    arch = ""
    options: dict = {}
    max_error = MAX_ERROR

    def unavailable(self):
        fn, why = load(PACKAGE, self.entry, PACKAGE)
        if why and installed_major() == 1:
            return "sageattention 1.x is installed, this kernel is SageAttention 2's"
        if why:
            return why
        if self.built is not None:
            enabled, _ = load(f"{PACKAGE}.core", self.built, PACKAGE)
            if not enabled:
                return f"this sageattention build has no {self.arch} kernel (built without that architecture)"
        return None

    def _run(self, q, k, v, layout, mask, scale):
        fn = load(PACKAGE, self.entry, PACKAGE)[0]
        q, k, v = _contiguous_last(q, k, v)
        return fn(q, k, v, tensor_layout=_layout(layout), is_causal=False, sm_scale=scale, **self.options)


_TAKES = dict(dtypes=HALF_DTYPES, max_head_dim=128, masks=False)


class Sage2Sm90(_Sage2):
    label = "sage2_sm90"
    entry, built, arch = "sageattn_qk_int8_pv_fp8_cuda_sm90", "SM90_ENABLED", "sm90"
    options = {"pv_accum_dtype": "fp32+fp32"}
    constraints = Constraints(capabilities=frozenset({(9, 0)}), **_TAKES)


class Sage2Fp8(_Sage2):
    label = "sage2_fp8"
    entry, built, arch = "sageattn_qk_int8_pv_fp8_cuda", "SM89_ENABLED", "sm89/sm120"
    options = {"pv_accum_dtype": "fp32+fp16"}
    constraints = Constraints(capabilities=frozenset({(8, 9), (12, 0), (12, 1)}), **_TAKES)

    def _run(self, q, k, v, layout, mask, scale):
        fn = load(PACKAGE, self.entry, PACKAGE)[0]
        q, k, v = _contiguous_last(q, k, v)
        # as 2.x's sageattn: per-warp q/k scales on 12.x, where the per-thread Triton quantizer does not run
        gran = "per_warp" if (capability(q.device) or (0, 0)) >= (12, 0) else "per_thread"
        return fn(q, k, v, tensor_layout=_layout(layout), is_causal=False, sm_scale=scale, qk_quant_gran=gran,
                  **self.options)


class Sage2Fp16(_Sage2):
    label = "sage2_fp16"
    entry, built, arch = "sageattn_qk_int8_pv_fp16_cuda", "SM80_ENABLED", "sm80"
    options = {"pv_accum_dtype": "fp32"}
    constraints = Constraints(capabilities=frozenset({(8, 0), (8, 6), (8, 7)}), **_TAKES)


class Sage2Triton(_Sage2):
    label = "sage2_triton"
    entry = "sageattn_qk_int8_pv_fp16_triton"
    constraints = Constraints(min_capability=(8, 0), max_capability=(10, 3), **_TAKES)


class Sage1(Impl):
    """sageattention 1.0.6 (INT8 QK, Triton). Its `smooth_k=True` subtracts the key mean from the
    caller's k in place, so the smoothing is done here on a new tensor and the kernel is told not to;
    it accepts an `attn_mask` keyword and ignores it, so masked calls are declined."""

    label = "sage1"
    constraints = Constraints(min_capability=(8, 0), head_dims=frozenset({64, 96, 128}), masks=False)
    max_error = MAX_ERROR

    def unavailable(self):
        fn, why = load(PACKAGE, "sageattn", PACKAGE)
        if why:
            return why
        return None if installed_major() == 1 else "sageattention 2.x is installed (its kernels run as sage2_*)"

    def _run(self, q, k, v, layout, mask, scale):
        sageattn = load(PACKAGE, "sageattn", PACKAGE)[0]
        seq_dim = 2 if layout == "BHSD" else 1
        k = k - k.mean(dim=seq_dim, keepdim=True)
        return sageattn(q, k, v, tensor_layout=_layout(layout), is_causal=False, sm_scale=scale, smooth_k=False)


KERNELS = (Sage2Sm90, Sage2Fp8, Sage2Fp16, Sage2Triton, Sage1)


@register_backend("sage", aliases=("sageattention", "sage_attn", "sage2", "sageattention2"))
def sage(**_) -> Backend:
    return Backend("sage", [cls() for cls in KERNELS], note_substitutes=True)
