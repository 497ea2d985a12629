"""attention/fp8_qkv.py's quantization in plain torch (any device): the reference its Triton kernels are tested
against, and the dequantization the accuracy tests read FP8 tensors back with."""
import torch

from bigdit.attention.fp8_qkv import FP8, FP8_MAX, Quantized, Stats, convert, scales


def reference_stats(q, k, v, layout: str, *, smooth_k: bool = True, k_mean: torch.Tensor | None = None) -> Stats:
    """Stats in fp32 torch; `k_mean` given: smooth by that mean instead of computing it."""
    q32, k32, v32 = (convert(t, layout, "BHSD").float() for t in (q, k, v))
    if smooth_k and k_mean is None:
        k_mean = k32.mean(dim=2)
    ks = k32 - k_mean[:, :, None] if smooth_k else k32
    amax = torch.stack([t.abs().amax(dim=(2, 3)) for t in (q32, ks, v32)])
    return Stats(amax, k_mean if smooth_k else None)


def reference_quantize(q, k, v, layout: str, stats: Stats, out_dtype: torch.dtype = FP8) -> Quantized:
    """The quantization in torch. `out_dtype` float32 returns the clamped values before the cast."""
    descale, inv = scales(stats.amax)

    def one(t, i, mean=None):
        x = convert(t, layout, "BHSD").float()
        if mean is not None:
            x = x - mean[:, :, None]
        y = (x * inv[i][:, :, None, None]).clamp(-FP8_MAX, FP8_MAX)
        return y.transpose(1, 2).contiguous().to(out_dtype)

    return Quantized(one(q, 0), one(k, 1, stats.k_mean), one(v, 2), descale)


def dequantize(t: torch.Tensor, descale: torch.Tensor) -> torch.Tensor:
    """fp32 (B, S, H, D) from an FP8 (B, S, H, D) tensor and its (B, H) descale."""
    return t.float() * descale[:, None, :, None]
