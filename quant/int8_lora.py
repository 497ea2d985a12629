"""The pack's INT8 linear with a LoRA's part in its GEMM's epilogue: out = W_q x + alpha * down(x) @ up^T.

A LoRA beside a quantized layer (a QuantLinear output branch that offers its part, quant.low_rank.LowRank)
otherwise adds its product with a separate addmm, which reads and writes the layer's whole output once more: at
32,700 rows of H3's qkv (21504 wide) 2.8 GB, the larger part of the branch's cost. Here each output tile, once the
INT8 product is scaled, accumulates h's rows times up's columns on the tensor cores in fp32 (R in steps of
BLOCK_R, masked at its end) before the bias and the one store: the addmm's product (fp32 accumulation of bf16
operands, one alpha), summed into the tile before its rounding to the output dtype instead of after. Where up is
block-diagonal (LowRank.blocks) and a tile's columns lie in one block, the tile reads only that block's
ranks.

The hidden h = down(x) [M, R] comes from the rows the INT8 path quantized for its own GEMM: their INT8 GEMM with
the down matrix rotated as the weights are and quantized per row (`down_rows`, made once per part). It reads the
input at a byte an element instead of two, and a SwiGLU input, which the activation kernel folds into its
quantizer, is never written out for the branch; h carries the INT8 path's rounding of the input, as the layer's
own product does.

The INT8 products are int8_triton's: its activation kernel, its tiles and their order, and its configs for the
shape (the tuning store, the shipped table, the rule; int8_triton.config_for); a config whose pipeline leaves no
room for the epilogue's operands runs with a stage fewer, then with the smallest tiles. Any other failure turns
the fused path off for the process with one warning: the layer then runs its GEMM and the branch's addmm.
"""
from __future__ import annotations

import torch

from ..pack_logging import pack_logger
from . import int8_triton, swiglu, witness
from .kernel_select import rows_bucket
from .kitchen_api import hadamard
from .low_rank import LowRank

log = pack_logger(__name__)
BLOCK_R = 32  # ranks a step: 24 KiB of operands beside a 128x256 tile
_failed: str | None = None

if int8_triton.triton is not None:
    import triton
    import triton.language as tl
    from triton.runtime.errors import OutOfResources
    from triton.tools.tensor_descriptor import TensorDescriptor

    from .int8_triton import _tile

    @triton.jit
    def _low_rank_epilogue(acc, pid_m, pid_n, out_ptr, a_scale_ptr, w_scale_ptr, bias_ptr, h_ptr, u_ptr, alpha,
                           M, N, N_PER_BLOCK, R_PER_BLOCK, stride_out, stride_h, stride_u,
                           PER_CHANNEL: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr,
                           BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr):
        """acc * (row scale * weight scale) + alpha * h @ up^T + bias, into the output dtype; up's ranks read for
        the tile: those of its columns' diagonal block (all R where N_PER_BLOCK is N)."""
        rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        a_scale = tl.load(a_scale_ptr + rows, mask=rows < M, other=0.0)
        if PER_CHANNEL:
            scales = a_scale[:, None] * tl.load(w_scale_ptr + cols, mask=cols < N, other=0.0)[None, :]
        else:
            scales = a_scale[:, None] * tl.load(w_scale_ptr)
        c = acc.to(tl.float32) * scales
        if alpha != 0.0:
            # the products accumulate into the tile itself (a second fp32 tile would not fit the registers
            # beside it), the tile divided by alpha first and multiplied back after
            c = c * (1.0 / alpha)
            ranks = tl.arange(0, BLOCK_R)
            r_first = (pid_n * BLOCK_N // N_PER_BLOCK) * R_PER_BLOCK
            r_end = r_first + R_PER_BLOCK
            for r0 in range(r_first, r_end, BLOCK_R):
                r_ok = (r0 + ranks) < r_end
                h = tl.load(h_ptr + rows.to(tl.int64)[:, None] * stride_h + (r0 + ranks)[None, :],
                            mask=(rows < M)[:, None] & r_ok[None, :], other=0.0)
                u = tl.load(u_ptr + cols.to(tl.int64)[:, None] * stride_u + (r0 + ranks)[None, :],
                            mask=(cols < N)[:, None] & r_ok[None, :], other=0.0)
                c = tl.dot(h, u.T, c)
            c = c * alpha
        if HAS_BIAS:
            c += tl.load(bias_ptr + cols, mask=cols < N, other=0.0).to(tl.float32)[None, :]
        out = out_ptr + rows.to(tl.int64)[:, None] * stride_out + cols[None, :]
        tl.store(out, c.to(out_ptr.dtype.element_ty), mask=(rows < M)[:, None] & (cols < N)[None, :])

    @triton.jit
    def _gemm_low_rank_kernel(a_ptr, w_ptr, out_ptr, a_scale_ptr, w_scale_ptr, bias_ptr, h_ptr, u_ptr, alpha,
                              M, N, N_PER_BLOCK, R_PER_BLOCK, stride_a, stride_w, stride_out, stride_h, stride_u,
                              K: tl.constexpr,
                              PER_CHANNEL: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr,
                              BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
                              BLOCK_R: tl.constexpr):
        """int8_triton's pointer-load GEMM, with the low-rank epilogue."""
        pid_m, pid_n = _tile(tl.program_id(0), M, N, BLOCK_M, BLOCK_N, GROUP_M)
        rows = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)) % M
        cols = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N)) % N
        ks = tl.arange(0, BLOCK_K)
        a_ptrs = a_ptr + rows.to(tl.int64)[:, None] * stride_a + ks[None, :]
        w_ptrs = w_ptr + cols.to(tl.int64)[:, None] * stride_w + ks[None, :]
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.int32)
        for k0 in range(0, K, BLOCK_K):
            a = tl.load(a_ptrs, mask=ks[None, :] < K - k0, other=0)
            w = tl.load(w_ptrs, mask=ks[None, :] < K - k0, other=0)
            acc = tl.dot(a, w.T, acc, out_dtype=tl.int32)
            a_ptrs += BLOCK_K
            w_ptrs += BLOCK_K
        _low_rank_epilogue(acc, pid_m, pid_n, out_ptr, a_scale_ptr, w_scale_ptr, bias_ptr, h_ptr, u_ptr, alpha,
                           M, N, N_PER_BLOCK, R_PER_BLOCK, stride_out, stride_h, stride_u, PER_CHANNEL, HAS_BIAS,
                           BLOCK_M, BLOCK_N, BLOCK_R)

    @triton.jit
    def _gemm_low_rank_tma_kernel(a_desc, w_desc, out_ptr, a_scale_ptr, w_scale_ptr, bias_ptr, h_ptr, u_ptr,
                                  alpha, M, N, N_PER_BLOCK, R_PER_BLOCK, stride_out, stride_h, stride_u,
                                  K: tl.constexpr,
                                  PER_CHANNEL: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr,
                                  BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
                                  BLOCK_R: tl.constexpr):
        """int8_triton's TMA GEMM, with the low-rank epilogue."""
        pid_m, pid_n = _tile(tl.program_id(0), M, N, BLOCK_M, BLOCK_N, GROUP_M)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.int32)
        for k0 in range(0, K, BLOCK_K):
            a = a_desc.load([pid_m * BLOCK_M, k0])
            w = w_desc.load([pid_n * BLOCK_N, k0])
            acc = tl.dot(a, w.T, acc, out_dtype=tl.int32)
        _low_rank_epilogue(acc, pid_m, pid_n, out_ptr, a_scale_ptr, w_scale_ptr, bias_ptr, h_ptr, u_ptr, alpha,
                           M, N, N_PER_BLOCK, R_PER_BLOCK, stride_out, stride_h, stride_u, PER_CHANNEL, HAS_BIAS,
                           BLOCK_M, BLOCK_N, BLOCK_R)


def gemm_low_rank(a: torch.Tensor, a_scale: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                  bias: torch.Tensor | None, h: torch.Tensor, up: torch.Tensor, alpha: float,
                  out_dtype: torch.dtype, tma: bool, blocks: int = 1) -> torch.Tensor:
    """int8_triton.gemm's product plus alpha * h [M, R] @ up [N, R]^T, in out_dtype; `blocks`: up's diagonal blocks
    (LowRank.blocks), whose off-diagonal ranks are not read."""
    out, launch = _low_rank_launch(a, a_scale, weight, weight_scale, bias, h, up, alpha, out_dtype, tma, blocks)
    if launch is not None:
        launch.run()
    return out


class LowRankLaunch(int8_triton.Launch):
    """The GEMM's config for the shape; where its pipeline leaves no room for the epilogue's operands, a stage
    fewer, then the smallest tiles."""

    def run(self) -> None:
        config = int8_triton.config_for(self.kernel, self.shape, self.device)
        tried = [config, {**config, "num_stages": max(2, config["num_stages"] - 1)}, int8_triton.gemm_small(self.shape)]
        for attempt in dict.fromkeys(tuple(sorted(c.items())) for c in tried):
            try:
                witness.launch(int8_triton.TALLY, self.key not in int8_triton._LAUNCHED, self.launch, dict(attempt))
                int8_triton._LAUNCHED.add(self.key)
                return
            except OutOfResources as exc:
                last = exc
        raise last


def _low_rank_launch(a: torch.Tensor, a_scale: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                     bias: torch.Tensor | None, h: torch.Tensor, up: torch.Tensor, alpha: float,
                     out_dtype: torch.dtype, tma: bool, blocks: int) -> tuple[torch.Tensor, LowRankLaunch | None]:
    """gemm_low_rank's output, allocated, and its launch (None for no rows)."""
    m, k = a.shape
    n, r = weight.shape[0], h.shape[1]
    out = torch.empty(m, n, device=a.device, dtype=out_dtype)
    if m == 0:
        return out, None
    w_scale = weight_scale.reshape(-1).float()
    common = dict(out_ptr=out, a_scale_ptr=a_scale, w_scale_ptr=w_scale,
                  bias_ptr=bias if bias is not None else w_scale, h_ptr=h, u_ptr=up, alpha=float(alpha),
                  M=m, N=n, stride_out=out.stride(0), stride_h=h.stride(0), stride_u=up.stride(0), K=k,
                  PER_CHANNEL=w_scale.numel() > 1, HAS_BIAS=bias is not None, BLOCK_R=BLOCK_R)

    def launch(config: dict, warmup: bool = False):
        meta, run = int8_triton._split(config)
        tiles = (triton.cdiv(m, meta["BLOCK_M"]) * triton.cdiv(n, meta["BLOCK_N"]),)
        # no tile across two blocks: the most blocks, `blocks` or a divisor of it (blocks merged), whose width the
        # tiles divide; 1 (every rank) where none
        merged = next(d for d in range(blocks, 0, -1)
                      if blocks % d == 0 and (d == 1 or (n // d) % meta["BLOCK_N"] == 0))
        block = dict(N_PER_BLOCK=n // merged, R_PER_BLOCK=r // merged)
        if tma:
            kernel, operands = _gemm_low_rank_tma_kernel, dict(
                a_desc=TensorDescriptor(a, [m, k], [a.stride(0), 1], [meta["BLOCK_M"], meta["BLOCK_K"]]),
                w_desc=TensorDescriptor(weight, [n, k], [weight.stride(0), 1], [meta["BLOCK_N"], meta["BLOCK_K"]]))
        else:
            kernel, operands = _gemm_low_rank_kernel, dict(a_ptr=a, w_ptr=weight, stride_a=a.stride(0),
                                                           stride_w=weight.stride(0))
        if warmup:
            return kernel.warmup(**operands, **common, **block, **meta, **run, grid=tiles)
        kernel[tiles](**operands, **common, **block, **meta, **run)

    shape = {"M_BUCKET": rows_bucket(m), "N": n, "K": k}
    return out, LowRankLaunch("gemm_tma" if tma else "gemm", shape, a.device, launch, variant="+lora")


def fusable(x: torch.Tensor, part: LowRank) -> bool:
    """Whether this call can take the fused path: eager, on CUDA, Triton working, the part's matrices on the
    activations' device and its up matrix in their dtype with unit column stride."""
    return (_failed is None and int8_triton.triton is not None and x.is_cuda and not torch.compiler.is_compiling()
            and part.up.device == part.down.device == x.device and part.up.dtype == x.dtype
            and x.dtype in (torch.bfloat16, torch.float16) and part.up.stride(-1) == 1)


def down_rows(down: torch.Tensor, convrot: bool, group_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A LoRA's down matrix [R, K] as the INT8 path's weights are: rotated as ConvRot rotates a weight (each
    group of K times the group's Hadamard matrix, which is its own transpose and inverse), then quantized per
    row to int8: (int8 [R, K], fp32 [R] scales). Its product with the path's quantized rows is down(x)."""
    d = down.float()
    if convrot:
        d = (d.reshape(d.shape[0], -1, group_size) @ hadamard(group_size, d.device)).reshape(d.shape)
    scale = d.abs().amax(dim=1).clamp(min=torch.finfo(torch.float32).tiny) / 127.0
    return torch.round(d / scale[:, None]).clamp(-127, 127).to(torch.int8), scale


def linear_low_rank(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, bias: torch.Tensor | None,
                    out_dtype: torch.dtype, convrot: bool, group_size: int, input_act: str | None,
                    part: LowRank) -> torch.Tensor | None:
    """int8_triton.int8_linear's result plus the LoRA part's, in the GEMM's epilogue; None where it failed (the
    caller then runs the GEMM and the addmm), `int8_triton.Compiling` while its kernels compile ahead; counted in
    the run witness as int8_triton's calls are. The part's hidden h = down(x) is the INT8 GEMM of the call's own
    quantized rows with `down_rows` (the input read at a byte an element, a SwiGLU input never written out); a
    part with a mid matrix takes h = part.hidden(x) in the activations' dtype."""
    global _failed
    x2d = x.reshape(-1, x.shape[-1])
    try:
        tma = int8_triton._tma(x.device)
        if part.mid is None:
            q, scale, rows = int8_triton._rows_launch(x2d, convrot, group_size, input_act)
            down_q, down_scale = part.derive(("int8_rows", convrot, group_size),
                                             lambda down: down_rows(down, convrot, group_size))
            h, hidden = int8_triton._gemm_launch(q, scale, down_q, down_scale, None, x2d.dtype, tma)
        else:
            x2d = swiglu.activated(x2d, input_act)
            q, scale, rows = int8_triton._rows_launch(x2d, convrot, group_size, None)
            h, hidden = part.hidden(x2d), None
        out, product = _low_rank_launch(q, scale, weight, weight_scale, bias, h, part.up, part.scale, out_dtype,
                                        tma=tma, blocks=part.blocks)
        int8_triton.run_when_compiled(rows, hidden, product)
    except int8_triton.Compiling:
        raise
    except Exception as exc:  # a Triton that cannot compile this kernel for this GPU, or no memory left
        why, again = f"{type(exc).__name__}: {exc}", int8_triton.transient(exc)
        if not again:
            _failed = why
        witness.kernel_failed(int8_triton.TALLY, "triton+lora", why, retried=again)
        log.warning("INT8: the GEMM with the LoRA in its epilogue failed (%s); the GEMM and the LoRA's addmm "
                    "compute %s", why, "this call" if again else "this process's calls")
        return None
    witness.count_kernel(int8_triton.TALLY, "triton+lora")
    return out.reshape(*x.shape[:-1], weight.shape[0])
