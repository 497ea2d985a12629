"""q, k and v to FP8 E4M3 for FlashAttention 3's FP8 kernel, with per-(batch, head) scales.

FA3 takes FP8 q/k/v in (B, S, H, D) with fp32 descales shaped (B, H) (one
per key/value head), so one scale per (batch, head) is all its API can use:
no per-block q scale, no per-channel v scale. Finer scales would matter less
than for integers anyway: FP8's error is relative to each value (3 mantissa
bits), so a scale only decides which values fall into the subnormals.

k is smoothed first: its mean over the sequence, per (batch, head, channel),
is subtracted. Each query's scores then all shift by the same q.mean(k), which
softmax ignores, so the attention is unchanged, while the keys' shared offset
no longer spends FP8 range and precision.

    amax   = max |x| over (sequence, head dim), k after smoothing
    scale  = max(amax * fp32(1/448), MIN_SCALE)      (FA3's descale)
    x_fp8  = fp8(clamp(x * (1 / scale), -448, 448))

Two Triton kernels, reading q, k and v in the layout they come in: partial
statistics per chunk of tokens (|q| and |v| maxima; k's per-channel sum,
maximum and minimum), then, after a few tiny torch reductions of those
partials, one pass that writes the three FP8 tensors in (B, S, H, D). k's
maximum after smoothing comes from its per-channel extremes:
max_s |k_s - m| = max(k_max - m, m - k_min), exact in fp32 because rounding
is monotonic. The torch functions here are the reference of the same
arithmetic; given the same statistics the kernel matches them bit for bit
(the mean itself differs by summation order).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .base import convert, dims

try:
    import triton
    import triton.language as tl
    TRITON_MISSING = None
except Exception as e:  # missing or broken Triton: the backend declines with this reason
    triton = None
    TRITON_MISSING = ("triton is not installed" if isinstance(e, ModuleNotFoundError)
                      else f"triton failed to import ({type(e).__name__}: {e})")

FP8 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8).max  # 448
INV_FP8_MAX = torch.tensor(1 / FP8_MAX, dtype=torch.float32).item()
MIN_SCALE = 1e-12  # an all-zero head would otherwise divide by zero

CHUNK = 1024  # tokens per program of the statistics kernel
BLOCK_S = 32  # tokens per tile


@dataclass(frozen=True)
class Stats:
    """Per (batch, head): amax (3, B, H) for q, k (after smoothing), v; k_mean (B, H, D)."""

    amax: torch.Tensor
    k_mean: torch.Tensor | None


@dataclass(frozen=True)
class Quantized:
    """FP8 q, k, v in (B, S, H, D) and their fp32 descales (3, B, H): q, k, v."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    descale: torch.Tensor


def scales(amax: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(descale, 1 / descale) from amax; shared by the kernel path and the reference.

    A product with fp32(1/448), not a division by 448: torch's CUDA division by
    a scalar is itself such a product, its CPU division is exact, and the two
    differ in the last bit, which moved FP8 codes between a GPU run and its
    CPU reference."""
    descale = (amax.float() * INV_FP8_MAX).clamp(min=MIN_SCALE)
    return descale, torch.reciprocal(descale)


# ---- Triton ----------------------------------------------------------------

if triton is not None:
    @triton.jit
    def _tile(ptr, base, rows, n_rows, stride_s, stride_d, cols, D):
        mask = (rows < n_rows)[:, None] & (cols < D)[None, :]
        offs = base + rows[:, None].to(tl.int64) * stride_s + cols[None, :] * stride_d
        return tl.load(ptr + offs, mask=mask, other=0.0).to(tl.float32), mask

    @triton.jit
    def _stats_kernel(q_ptr, k_ptr, v_ptr, amax_ptr, ksum_ptr, kmax_ptr, kmin_ptr,
                      H, Sq, Skv, D,
                      qsb, qsh, qss, qsd, ksb, ksh, kss, ksd, vsb, vsh, vss, vsd,
                      CHUNK: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr):
        bh = tl.program_id(0)
        chunk = tl.program_id(1)
        n_chunks = tl.num_programs(1)
        b = (bh // H).to(tl.int64)
        h = (bh % H).to(tl.int64)
        cols = tl.arange(0, BLOCK_D)
        q_amax = tl.zeros([BLOCK_D], dtype=tl.float32)
        v_amax = tl.zeros([BLOCK_D], dtype=tl.float32)
        k_sum = tl.zeros([BLOCK_D], dtype=tl.float32)
        k_max = tl.full([BLOCK_D], float("-inf"), dtype=tl.float32)
        k_min = tl.full([BLOCK_D], float("inf"), dtype=tl.float32)
        for s0 in range(0, CHUNK, BLOCK_S):
            rows = chunk * CHUNK + s0 + tl.arange(0, BLOCK_S)
            x, _ = _tile(q_ptr, b * qsb + h * qsh, rows, Sq, qss, qsd, cols, D)
            q_amax = tl.maximum(q_amax, tl.max(tl.abs(x), axis=0))
            x, _ = _tile(v_ptr, b * vsb + h * vsh, rows, Skv, vss, vsd, cols, D)
            v_amax = tl.maximum(v_amax, tl.max(tl.abs(x), axis=0))
            x, mask = _tile(k_ptr, b * ksb + h * ksh, rows, Skv, kss, ksd, cols, D)
            k_sum += tl.sum(x, axis=0)
            k_max = tl.maximum(k_max, tl.max(tl.where(mask, x, float("-inf")), axis=0))
            k_min = tl.minimum(k_min, tl.min(tl.where(mask, x, float("inf")), axis=0))
        part = bh * n_chunks + chunk
        n_part = tl.num_programs(0) * n_chunks
        tl.store(amax_ptr + part, tl.max(q_amax, axis=0))
        tl.store(amax_ptr + n_part + part, tl.max(v_amax, axis=0))
        col_ok = cols < D
        tl.store(ksum_ptr + part * D + cols, k_sum, mask=col_ok)
        tl.store(kmax_ptr + part * D + cols, k_max, mask=col_ok)
        tl.store(kmin_ptr + part * D + cols, k_min, mask=col_ok)

    @triton.jit
    def _store_bshd(ptr, b, h, rows, n_rows, H, D, cols, mask, y):
        offs = ((b * n_rows + rows[:, None].to(tl.int64)) * H + h) * D + cols[None, :]
        tl.store(ptr + offs, y.to(ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _quantize_kernel(q_ptr, k_ptr, v_ptr, q8_ptr, k8_ptr, v8_ptr, inv_ptr, mean_ptr,
                         H, Sq, Skv, D,
                         qsb, qsh, qss, qsd, ksb, ksh, kss, ksd, vsb, vsh, vss, vsd,
                         fp8_max: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr):
        bh = tl.program_id(0)
        n_bh = tl.num_programs(0)
        b = (bh // H).to(tl.int64)
        h = (bh % H).to(tl.int64)
        rows = tl.program_id(1) * BLOCK_S + tl.arange(0, BLOCK_S)
        cols = tl.arange(0, BLOCK_D)
        # x * (1 / scale), not x / scale: Triton's division is approximate, a product is exact
        inv = tl.load(inv_ptr + bh)
        x, mask = _tile(q_ptr, b * qsb + h * qsh, rows, Sq, qss, qsd, cols, D)
        y = tl.minimum(tl.maximum(x * inv, -fp8_max), fp8_max)
        _store_bshd(q8_ptr, b, h, rows, Sq, H, D, cols, mask, y)
        inv = tl.load(inv_ptr + n_bh + bh)
        mean = tl.load(mean_ptr + bh * D + cols, mask=cols < D, other=0.0)
        x, mask = _tile(k_ptr, b * ksb + h * ksh, rows, Skv, kss, ksd, cols, D)
        y = tl.minimum(tl.maximum((x - mean[None, :]) * inv, -fp8_max), fp8_max)
        _store_bshd(k8_ptr, b, h, rows, Skv, H, D, cols, mask, y)
        inv = tl.load(inv_ptr + 2 * n_bh + bh)
        x, mask = _tile(v_ptr, b * vsb + h * vsh, rows, Skv, vss, vsd, cols, D)
        y = tl.minimum(tl.maximum(x * inv, -fp8_max), fp8_max)
        _store_bshd(v8_ptr, b, h, rows, Skv, H, D, cols, mask, y)


def _bhsd_strides(q, k, v, layout):
    return [s for t in (q, k, v) for s in convert(t, layout, "BHSD").stride()]


def stats(q, k, v, layout: str) -> Stats:
    """Stats by the Triton statistics kernel (k smoothed), finished by tiny torch reductions."""
    b, h, sq, d = dims(q, layout)
    skv = dims(k, layout)[2]
    n_chunks = triton.cdiv(max(sq, skv), CHUNK)
    f32 = dict(device=q.device, dtype=torch.float32)
    part_amax = torch.empty(2, b * h, n_chunks, **f32)  # q, v
    ksum, kmax, kmin = (torch.empty(b * h, n_chunks, d, **f32) for _ in range(3))
    _stats_kernel[(b * h, n_chunks)](q, k, v, part_amax, ksum, kmax, kmin, h, sq, skv, d,
                                     *_bhsd_strides(q, k, v, layout), CHUNK=CHUNK, BLOCK_S=BLOCK_S,
                                     BLOCK_D=triton.next_power_of_2(d), num_warps=4)
    mean = ksum.sum(dim=1) / skv
    k_amax = torch.maximum(kmax.amax(dim=1) - mean, mean - kmin.amin(dim=1)).amax(dim=1)
    q_amax, v_amax = part_amax.amax(dim=2)
    return Stats(torch.stack([q_amax, k_amax, v_amax]).view(3, b, h), mean.view(b, h, d))


def quantize(q, k, v, layout: str, st: Stats, out_dtype: torch.dtype = FP8) -> Quantized:
    """The quantization pass by the Triton kernel, given `st` (smoothed k). `out_dtype`
    float32 returns the clamped values before the cast."""
    b, h, sq, d = dims(q, layout)
    skv = dims(k, layout)[2]
    descale, inv = scales(st.amax)
    q8 = torch.empty(b, sq, h, d, device=q.device, dtype=out_dtype)
    k8, v8 = (torch.empty(b, skv, h, d, device=q.device, dtype=out_dtype) for _ in range(2))
    grid = (b * h, triton.cdiv(max(sq, skv), BLOCK_S))
    _quantize_kernel[grid](q, k, v, q8, k8, v8, inv.contiguous(), st.k_mean.contiguous(), h, sq, skv, d,
                           *_bhsd_strides(q, k, v, layout), fp8_max=FP8_MAX, BLOCK_S=BLOCK_S,
                           BLOCK_D=triton.next_power_of_2(d), num_warps=4)
    return Quantized(q8, k8, v8, descale)


def quantize_qkv(q, k, v, layout: str) -> Quantized:
    """FP8 q, k (smoothed), v in (B, S, H, D) with their descales, by the Triton kernels."""
    return quantize(q, k, v, layout, stats(q, k, v, layout))
