"""W4A8's 4-bit codes decoded onto the int8 grid (quant/w4a8_int8.py's layers on the INT8 kernels), in one Triton
kernel that streams the codes in and the int8 weight out.

It computes what comfy-kitchen's decode computes (round-half-even(clamp(level * s_rel, +-127)), level = codebook[code],
or code - 8 without one; the low nibble is the even column), bit for bit (tests/int8_triton_interpreted.py
`w4a8_decode`). Kitchen's Triton decode stores each nibble's byte at a stride of two and took 2.16 ms for qkv's
21504 x 5376 weight on an H100, where moving its 173 MB takes about 0.05 ms (`int8-linear-exp-15000-h100-2026-12-07.json`);
this one stores each byte's two decoded codes as one 16-bit word, little-endian (the low nibble's byte first, the
even column): a tile's stores are contiguous and its codes need no interleaving in registers. (On an H100 at H3
pruned's shapes it took 0.105-0.338 ms, `int8-linear-*-nvidia-h100-2026-12-07-6dd69a6.json`; interleaved in
registers, 0.11-0.39 ms, `int8-linear-*-nvidia-h100-2026-12-07.json`.) fp8 group scales are decoded in integer
arithmetic (exact, and on GPUs without fp8 conversions too).
"""
from __future__ import annotations

import torch

from .int8_triton import runs_on, triton

BLOCK_N, BLOCK_KH, NUM_WARPS = 32, 256, 4  # a tile: 32 rows x 512 columns (256 packed bytes a row)


def decodes(qdata: torch.Tensor, s_rel: torch.Tensor, group_size: int) -> bool:
    """Whether `decode` takes these tensors: 4-bit codes [N, K/2] (not kitchen's 6-bit planes), scales [N, K/G] in
    fp8 e4m3fn or fp32, an even group, on a device the kernel runs on (CUDA, or Triton's interpreter on CPU)."""
    return (triton is not None and runs_on(qdata.device) and qdata.dtype == torch.int8 and qdata.dim() == 2
            and s_rel.dim() == 2 and group_size % 2 == 0 and s_rel.shape[0] == qdata.shape[0]
            and s_rel.shape[1] * group_size == 2 * qdata.shape[1]
            and s_rel.dtype in (torch.float8_e4m3fn, torch.float32))


def decode(qdata: torch.Tensor, s_rel: torch.Tensor, codebook: torch.Tensor | None, group_size: int) -> torch.Tensor:
    """int8 [N, K]: the codes of qdata [N, K/2] decoded with their group scales s_rel [N, K/G] (see `decodes`)."""
    n, k = qdata.shape[0], 2 * qdata.shape[1]
    out = torch.empty(n, k, device=qdata.device, dtype=torch.int8)
    fp8 = s_rel.dtype == torch.float8_e4m3fn
    qdata = qdata.contiguous()  # rows at their stride, bytes next to each other (a file's tensors are)
    scales = (s_rel.view(torch.uint8) if fp8 else s_rel).contiguous()
    cb = codebook.float().contiguous() if codebook is not None else out  # unread without a codebook
    words = out.view(torch.int16)  # a byte's two codes, the low nibble's in the word's low byte (little-endian)
    grid = (triton.cdiv(n, BLOCK_N), triton.cdiv(k // 2, BLOCK_KH))
    _decode_kernel[grid](qdata, scales, cb, words, n, k // 2, qdata.stride(0), scales.stride(0), words.stride(0),
                         G=group_size, HAS_CB=codebook is not None, FP8=fp8, BLOCK_N=BLOCK_N, BLOCK_KH=BLOCK_KH,
                         num_warps=NUM_WARPS)
    return out


if triton is not None:
    import triton.language as tl

    from .int8_triton import _RNE

    @triton.jit
    def e4m3(bits):
        """fp8 e4m3fn bytes (int32 holding 0..255) as fp32, exactly: (8 + m) * 2^(e - 10), subnormals m * 2^-9."""
        e = (bits >> 3) & 0xF
        m = bits & 7
        mant = tl.where(e == 0, m, m + 8).to(tl.float32)
        power = ((tl.maximum(e, 1) - 10 + 127) << 23).to(tl.float32, bitcast=True)
        value = mant * power
        return tl.where((bits & 0x80) != 0, -value, value)

    @triton.jit
    def decoded_nibbles(byte, s, cb_ptr, HAS_CB: tl.constexpr):
        """(low, high) int8: the two codes of each packed byte (int32 0..255) decoded with its scale `s` (fp32)."""
        low = byte & 0xF
        high = byte >> 4
        if HAS_CB:
            v_low = tl.load(cb_ptr + low)
            v_high = tl.load(cb_ptr + high)
        else:
            v_low = (low - 8).to(tl.float32)
            v_high = (high - 8).to(tl.float32)
        # clamp before the rounding add: it keeps the product and the add from fusing into one FMA
        q_low = (tl.clamp(v_low * s, -127.0, 127.0) + _RNE) - _RNE
        q_high = (tl.clamp(v_high * s, -127.0, 127.0) + _RNE) - _RNE
        return q_low.to(tl.int8), q_high.to(tl.int8)

    @triton.jit
    def _decode_kernel(w_ptr, s_ptr, cb_ptr, out_ptr, N, KH, stride_w, stride_s, stride_out, G: tl.constexpr,
                       HAS_CB: tl.constexpr, FP8: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_KH: tl.constexpr):
        rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        bytes_ = tl.program_id(1) * BLOCK_KH + tl.arange(0, BLOCK_KH)
        mask = (rows[:, None] < N) & (bytes_[None, :] < KH)
        rows64 = rows.to(tl.int64)[:, None]
        byte = tl.load(w_ptr + rows64 * stride_w + bytes_[None, :], mask=mask, other=0).to(tl.int32) & 0xFF
        s_ptrs = s_ptr + rows64 * stride_s + ((2 * bytes_) // G)[None, :]  # a byte's two codes share a group
        if FP8:
            s = e4m3(tl.load(s_ptrs, mask=mask, other=0).to(tl.int32) & 0xFF)
        else:
            s = tl.load(s_ptrs, mask=mask, other=0.0)
        q_low, q_high = decoded_nibbles(byte, s, cb_ptr, HAS_CB)
        word = (q_high.to(tl.int16) << 8) | (q_low.to(tl.int16) & 0xFF)  # the low nibble the even column
        tl.store(out_ptr + rows64 * stride_out + bytes_[None, :], word, mask=mask)
