"""An experiment for the per-layer bench (int8_linear.py): W4A8's INT8 GEMM with the 4-bit codes decoded in the
kernel's main loop, against the pack's path (the codes decoded into an int8 weight for the call, then the INT8 GEMM).

Each K step loads the tile's packed bytes [BLOCK_N, BLOCK_K/2] and its fp8 group scales [BLOCK_N, BLOCK_K/G], decodes
them as the pack's decode kernel does (quant/w4a8_triton.py, bit-equal to kitchen's), and multiplies the tile with the
activations' int8 tile on tensor cores. What it saves: the decoded weight's write and read (N x K bytes each, per
call). What it costs: the decode once per row tile of the output instead of once per call, and the GEMM's operand
pipeline. On an H100 it ran at 0.04-0.06x the INT8 method at H3's four shapes, 15,000 and 32,700 rows
(`int8-linear-exp-*-h100-2026-12-07.json`): kept out of the pack.
"""
import torch
import triton
import triton.language as tl

from bigdit.quant import int8_triton
from bigdit.quant.int8_triton import _epilogue, _tile
from bigdit.quant.w4a8_triton import decoded_nibbles, e4m3


@triton.jit
def _decoded(w_ptrs, s_ptrs, cb_ptr, mask_kh, mask_g, HAS_CB: tl.constexpr, BLOCK_N: tl.constexpr,
             BLOCK_K: tl.constexpr, G: tl.constexpr):
    """[BLOCK_N, BLOCK_K] int8: the weight tile decoded from its packed codes (low nibble the even column)."""
    byte = tl.load(w_ptrs, mask=mask_kh, other=0).to(tl.int32) & 0xFF
    s = e4m3(tl.load(s_ptrs, mask=mask_g, other=0).to(tl.int32) & 0xFF)  # [BLOCK_N, BLOCK_K / G]
    s = tl.reshape(tl.broadcast_to(s[:, :, None], (BLOCK_N, BLOCK_K // G, G // 2)), (BLOCK_N, BLOCK_K // 2))
    q_low, q_high = decoded_nibbles(byte, s, cb_ptr, HAS_CB)
    return tl.reshape(tl.join(q_low, q_high), (BLOCK_N, BLOCK_K))


@triton.jit
def _gemm_w4_kernel(a_ptr, w_ptr, s_ptr, cb_ptr, out_ptr, a_scale_ptr, w_scale_ptr, bias_ptr, M, N, stride_a,
                    stride_w, stride_s, stride_out, K: tl.constexpr, G: tl.constexpr, HAS_CB: tl.constexpr,
                    PER_CHANNEL: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                    BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr):
    pid_m, pid_n = _tile(tl.program_id(0), M, N, BLOCK_M, BLOCK_N, GROUP_M)
    rows = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)) % M
    cols = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N)) % N
    ks = tl.arange(0, BLOCK_K)
    khs = tl.arange(0, BLOCK_K // 2)
    gs = tl.arange(0, BLOCK_K // G)
    a_ptrs = a_ptr + rows.to(tl.int64)[:, None] * stride_a + ks[None, :]
    w_ptrs = w_ptr + cols.to(tl.int64)[:, None] * stride_w + khs[None, :]
    s_ptrs = s_ptr + cols.to(tl.int64)[:, None] * stride_s + gs[None, :]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.int32)
    for k0 in range(0, K, BLOCK_K):
        a = tl.load(a_ptrs, mask=ks[None, :] < K - k0, other=0)
        w = _decoded(w_ptrs, s_ptrs, cb_ptr, khs[None, :] < (K - k0) // 2, gs[None, :] < (K - k0) // G, HAS_CB,
                     BLOCK_N, BLOCK_K, G)
        acc = tl.dot(a, w.T, acc, out_dtype=tl.int32)
        a_ptrs += BLOCK_K
        w_ptrs += BLOCK_K // 2
        s_ptrs += BLOCK_K // G
    _epilogue(acc, pid_m, pid_n, out_ptr, a_scale_ptr, w_scale_ptr, bias_ptr, M, N, stride_out, PER_CHANNEL,
              HAS_BIAS, BLOCK_M, BLOCK_N)


def gemm_w4(a: torch.Tensor, a_scale: torch.Tensor, qdata: torch.Tensor, s_rel: torch.Tensor,
            codebook: torch.Tensor | None, s_channel: torch.Tensor, bias: torch.Tensor | None, group_size: int,
            out_dtype: torch.dtype, config: dict) -> torch.Tensor:
    """(a [M, K] int8 . decoded(qdata [N, K/2], s_rel [N, K/G] fp8)^T) * a_scale [M, 1] * s_channel [N] + bias."""
    m, k = a.shape
    n = qdata.shape[0]
    assert config["BLOCK_K"] % group_size == 0 and group_size % 2 == 0 and k % config["BLOCK_K"] == 0
    out = torch.empty(m, n, device=a.device, dtype=out_dtype)
    s_bytes = s_rel.view(torch.uint8)
    w_scale = s_channel.reshape(-1).float()
    cb = codebook.float().contiguous() if codebook is not None else w_scale
    meta, run = int8_triton._split(config)
    grid = (triton.cdiv(m, meta["BLOCK_M"]) * triton.cdiv(n, meta["BLOCK_N"]),)
    _gemm_w4_kernel[grid](a, qdata, s_bytes, cb, out, a_scale, w_scale, bias if bias is not None else w_scale, m, n,
                          a.stride(0), qdata.stride(0), s_bytes.stride(0), out.stride(0), K=k, G=group_size,
                          HAS_CB=codebook is not None, PER_CHANNEL=w_scale.numel() > 1, HAS_BIAS=bias is not None,
                          **meta, **run)
    return out


CONFIGS = [  # BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, warps, stages: the INT8 GEMM's tiles, and taller ones (the
    # decode is paid once per row tile)
    (128, 128, 128, 8, 8, 3), (128, 256, 128, 8, 8, 3), (256, 128, 128, 8, 8, 3), (256, 128, 64, 8, 8, 4),
    (128, 128, 64, 8, 4, 4),
]


def configs() -> list[dict]:
    return [{"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "GROUP_M": gm, "num_warps": w, "num_stages": s}
            for bm, bn, bk, gm, w, s in CONFIGS]


def linear(x: torch.Tensor, layer, input_act: str | None, config: dict) -> torch.Tensor:
    """A W4A8 QuantLinear's output (no LoRA): the pack's activation kernel, then the fused-decode GEMM."""
    t = layer.tensors_for(x)
    method = layer.method
    q, scale = int8_triton.quantize_rows(x.reshape(-1, x.shape[-1]), True, method.convrot_groupsize, input_act)
    return gemm_w4(q, scale, t["weight"], t["weight_s_rel"], t.get("weight_codebook"), t["weight_s_channel"],
                   t.get("bias"), method.group_size, torch.bfloat16, config)
