"""An experiment for the per-layer bench (int8_linear.py): the INT8 GEMM as a persistent kernel on Hopper (one program
per SM walking the output tiles in grouped order, operands by TMA), with Triton's loop flattening and automatic warp
specialization where this Triton offers them, against the pack's one-tile-per-program TMA GEMM
(quant/int8_triton.py `_gemm_tma_kernel`). Kept out of the pack until a measurement says where it pays.

Its epilogue is the pack's (`_epilogue`: row scale x channel scale, bias, one rounding to the output dtype), so its
output is bit-equal to the pack's GEMM at every config (the interpreter check `persistent_gemm`).
"""
import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from bigdit.quant import int8_triton
from bigdit.quant.int8_triton import _epilogue, _tile


@triton.jit
def _gemm_persistent_kernel(a_desc, w_desc, out_ptr, a_scale_ptr, w_scale_ptr, bias_ptr, M, N, stride_out,
                            K: tl.constexpr, PER_CHANNEL: tl.constexpr, HAS_BIAS: tl.constexpr,
                            BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                            GROUP_M: tl.constexpr, NUM_SMS: tl.constexpr, FLATTEN: tl.constexpr,
                            WARP_SPECIALIZE: tl.constexpr):
    tiles = tl.cdiv(M, BLOCK_M) * tl.cdiv(N, BLOCK_N)
    for tile in tl.range(tl.program_id(0), tiles, NUM_SMS, flatten=FLATTEN, warp_specialize=WARP_SPECIALIZE):
        pid_m, pid_n = _tile(tile, M, N, BLOCK_M, BLOCK_N, GROUP_M)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.int32)
        for k0 in range(0, K, BLOCK_K):
            a = a_desc.load([pid_m * BLOCK_M, k0])
            w = w_desc.load([pid_n * BLOCK_N, k0])
            acc = tl.dot(a, w.T, acc, out_dtype=tl.int32)
        _epilogue(acc, pid_m, pid_n, out_ptr, a_scale_ptr, w_scale_ptr, bias_ptr, M, N, stride_out, PER_CHANNEL,
                  HAS_BIAS, BLOCK_M, BLOCK_N)


def gemm(a: torch.Tensor, a_scale: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
         bias: torch.Tensor | None, out_dtype: torch.dtype, config: dict, programs: int) -> torch.Tensor:
    """int8_triton.gemm's result, from `programs` persistent programs (the GPU's SM count)."""
    m, k = a.shape
    n = weight.shape[0]
    out = torch.empty(m, n, device=a.device, dtype=out_dtype)
    w_scale = weight_scale.reshape(-1).float()
    meta, run = int8_triton._split(config)
    tiles = triton.cdiv(m, meta["BLOCK_M"]) * triton.cdiv(n, meta["BLOCK_N"])
    _gemm_persistent_kernel[(min(programs, tiles),)](
        TensorDescriptor(a, [m, k], [a.stride(0), 1], [meta["BLOCK_M"], meta["BLOCK_K"]]),
        TensorDescriptor(weight, [n, k], [weight.stride(0), 1], [meta["BLOCK_N"], meta["BLOCK_K"]]),
        out, a_scale, w_scale, bias if bias is not None else w_scale, m, n, out.stride(0), K=k,
        PER_CHANNEL=w_scale.numel() > 1, HAS_BIAS=bias is not None, NUM_SMS=programs, **meta, **run)
    return out


CONFIGS = [  # BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, warps, stages, flatten, warp_specialize
    (128, 256, 128, 16, 8, 3, False, False), (128, 256, 128, 16, 8, 4, True, False),
    (128, 256, 128, 16, 8, 3, False, True), (128, 128, 128, 8, 8, 4, False, True),
    (128, 128, 128, 8, 4, 4, True, False), (256, 128, 128, 16, 8, 3, False, True),
]


def configs() -> list[dict]:
    return [{"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "GROUP_M": gm, "num_warps": w, "num_stages": s,
             "FLATTEN": flatten, "WARP_SPECIALIZE": ws} for bm, bn, bk, gm, w, s, flatten, ws in CONFIGS]
