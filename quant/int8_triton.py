"""INT8 linear layers (ConvRot or plain) in Triton: the pack's own kernels for Int8ConvRotMethod on CUDA.

comfy-kitchen's `int8_linear`, which ComfyUI runs for these layers too, reached about 38% of an H200's
dense INT8 rate at MiniMax-H3's shapes (0.75-1.21x bf16 F.linear). Two kernels take its place:

- `_rotate_quantize_kernel`, the activations in one kernel (torch has no fused form): the input
  activation (SwiGLU), ConvRot's group-wise Hadamard rotation and per-row INT8 quantization. A row's
  scale spans all its groups: a row up to 16384 wide is held whole and read once; a wider one is read
  twice (rotate for the absmax, rotate again to quantize). The rotation runs on fp16 tensor cores, a
  group of 256 as H16 (x) H16 (two 16-wide products instead of one 256-wide one).
- the GEMM: int8 x int8 -> int32 on tensor cores, the row scale times the weight's channel (or tensor)
  scale and the bias applied in the epilogue, which writes the output dtype. From Hopper on operands
  come by TMA (`_gemm_tma_kernel`), before through pointer loads (`_gemm_kernel`), both K-major as
  Hopper's INT8 wgmma needs, in grouped tile order.
Each is autotuned per (row bucket, shape) the first time a shape runs.

`int8_linear` has comfy_kitchen.int8_linear's contract for weights stored by TensorWiseINT8Layout
(int8 [N, K], already rotated; scale fp32 [N, 1] or per tensor). Its arithmetic, which the tests hold
the kernels to: the input activation rounded to x's dtype, as kitchen's unfused `apply_input_act`
computes it; the rotation to fp32's precision (see `_rotated`); per row scale = max(absmax / 127, 1e-30)
as kitchen's; q = round-half-even(clamp(v * (1 / scale), -128, 127)), the reciprocal correctly rounded
once per row; out = acc * (row scale * weight scale) + bias in fp32, rounded once to the output dtype.
Kitchen's eager reference rounds the rotated row to x's dtype and divides in it, and adds the bias in the
output dtype; these kernels keep fp32, so they are no less accurate.

`available` / `unavailable_reason` say where the kernels take a call (a CUDA tensor, or a CPU one under
Triton's interpreter); elsewhere the caller runs kitchen. `linear_or_kitchen` is the call the method
makes: a kernel that fails at run time (a Triton that cannot compile for this GPU) is said once, then
kitchen computes for the rest of the process.
"""
from __future__ import annotations

import torch

from ..hardware import cuda_capability
from ..pack_logging import pack_logger
from .kernel_select import rows_bucket

log = pack_logger(__name__)

try:
    import triton
    import triton.language as tl
    from triton.tools.tensor_descriptor import TensorDescriptor
except Exception:  # missing or broken Triton (or one without tensor descriptors): kitchen runs instead
    triton = None

GROUP_SIZES = (16, 64, 256)
INPUT_ACTS = (None, "swiglu")
X_DTYPES = (torch.bfloat16, torch.float16)
OUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
KRON = 16  # a group of 256 rotates as H16 (x) H16: two 16-wide steps instead of one 256-wide product
_failure: str | None = None  # why the kernels failed at run time, once they did


def _interpreter_on() -> bool:
    knobs = getattr(triton, "knobs", None)
    return knobs is not None and bool(knobs.runtime.interpret)


# Triton's interpreter (TRITON_INTERPRET=1: CPU tensors) is chosen once, when the kernels below are defined
_INTERPRETED = _interpreter_on()


def unavailable_reason(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                       bias: torch.Tensor | None, out_dtype: torch.dtype | None, convrot: bool, group_size: int,
                       input_act: str | None) -> str | None:
    """Why the Triton kernels cannot take this call (the caller then runs kitchen), or None."""
    if triton is None:
        return "Triton (with tensor descriptors) cannot be imported"
    if _failure is not None:
        return f"the Triton kernels failed earlier in this process ({_failure})"
    if not (x.is_cuda or (x.device.type == "cpu" and _INTERPRETED)):
        return f"the input is on {x.device.type} (the kernels run on CUDA)"
    if x.dtype not in X_DTYPES:
        return f"input dtype {x.dtype} (bfloat16 or float16 only)"
    if (out_dtype or torch.bfloat16) not in OUT_DTYPES:
        return f"output dtype {out_dtype}"
    if input_act not in INPUT_ACTS:
        return f"input activation {input_act!r} (none or swiglu only)"
    if x.dim() < 1 or x.stride(-1) != 1:
        return "the input's last dimension is not contiguous"
    k = x.shape[-1] // (2 if input_act == "swiglu" else 1)
    if weight.dtype != torch.int8 or weight.dim() != 2 or weight.shape[1] != k or weight.device != x.device:
        return f"weight {tuple(weight.shape)} {weight.dtype} on {weight.device} for {k} inputs on {x.device}"
    n = weight.shape[0]
    # TMA and 16-byte rows: K and N multiples of 16, the weight's rows contiguous (its address is checked per
    # call, in `linear_or_kitchen`: torch.compile traces this function, and a traced address is no address)
    if k % 16 or n % 16 or weight.stride(1) != 1 or weight.stride(0) % 16:
        return f"shape {n}x{k} or the weight's layout is not 16-byte aligned"
    if convrot and (group_size not in GROUP_SIZES or k % group_size):
        return f"rotation group {group_size} (one of {GROUP_SIZES}, dividing {k})"
    if weight_scale.numel() not in (1, n) or weight_scale.device != x.device:
        return f"weight scale of {weight_scale.numel()} values on {weight_scale.device} for {n} channels"
    if bias is not None and (bias.numel() != n or bias.device != x.device):
        return f"bias of {bias.numel()} values on {bias.device} for {n} channels"
    return None


def available(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, bias: torch.Tensor | None,
              out_dtype: torch.dtype | None, convrot: bool, group_size: int, input_act: str | None) -> bool:
    return unavailable_reason(x, weight, weight_scale, bias, out_dtype, convrot, group_size, input_act) is None


def linear_or_kitchen(x, weight, weight_scale, bias, out_dtype, convrot, convrot_groupsize, input_act, kitchen):
    """`int8_linear`; `kitchen` (the same arguments) for a weight off 16-byte alignment and once the kernels have
    failed, the first failure logged."""
    global _failure
    if _failure is None and weight.data_ptr() % 16 == 0:  # TMA's alignment (a view into a file may lack it)
        try:
            return int8_linear(x, weight, weight_scale, bias, out_dtype, convrot, convrot_groupsize, input_act)
        except Exception as exc:  # a Triton that imports but cannot compile or launch for this GPU
            _failure = f"{type(exc).__name__}: {exc}"
            log.warning("INT8: the Triton kernels failed (%s); comfy-kitchen's int8_linear runs instead "
                        "(slower) for the rest of this process", _failure)
    return kitchen(x, weight, weight_scale, bias, out_dtype, convrot, convrot_groupsize, input_act)


def int8_linear(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, bias: torch.Tensor | None,
                out_dtype: torch.dtype | None, convrot: bool, convrot_groupsize: int,
                input_act: str | None) -> torch.Tensor:
    """comfy_kitchen.int8_linear's result, computed by the Triton kernels (see the module docstring)."""
    out_dtype = out_dtype or torch.bfloat16
    x2d = x.reshape(-1, x.shape[-1])
    q, scale = quantize_rows(x2d, convrot, convrot_groupsize, input_act)
    out = gemm(q, scale, weight, weight_scale, bias, out_dtype, tma=_tma(x.device))
    return out.reshape(*x.shape[:-1], weight.shape[0])


def _tma(device: torch.device) -> bool:
    capability = cuda_capability(device)
    return capability is not None and capability >= (9, 0)


def hadamard(group_size: int, device: torch.device) -> torch.Tensor:
    """The fp32 matrix the kernel multiplies each group by: kitchen's ConvRot matrix, or for a group of 256 its
    16-wide factor (kitchen builds H256 as H16 (x) H16, both Kronecker powers of one symmetric 4x4)."""
    from .kitchen_api import hadamard as kitchen_hadamard
    return kitchen_hadamard(KRON if group_size == KRON * KRON else group_size, device)


def quantize_rows(x: torch.Tensor, convrot: bool, group_size: int,
                  input_act: str | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(int8 [M, K], fp32 [M, 1]) for a 2-D activation [M, K] ([M, 2K] with SwiGLU): activation, rotation,
    per-row quantization in one kernel."""
    swiglu = input_act == "swiglu"
    rows, k = x.shape[0], x.shape[1] // (2 if swiglu else 1)
    q = torch.empty(rows, k, device=x.device, dtype=torch.int8)
    scale = torch.empty(rows, 1, device=x.device, dtype=torch.float32)
    if rows == 0:
        return q, scale
    group = group_size if convrot else 16  # unrotated rows step in 16-wide groups (the matrix is loaded, not used)
    h = hadamard(group, x.device)
    args = dict(x_ptr=x, h_ptr=h, q_ptr=q, scale_ptr=scale, M=rows, K=k, M_BUCKET=rows_bucket(rows),
                stride_x=x.stride(0), stride_q=q.stride(0), G=group, HG=KRON if group == KRON * KRON else group,
                SWIGLU=swiglu, ROTATE=convrot)
    _launch(_rotate_quantize_kernel, lambda meta: (triton.cdiv(rows, meta["ROWS"]),), args, x.device)
    return q, scale


def gemm(a: torch.Tensor, a_scale: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
         bias: torch.Tensor | None, out_dtype: torch.dtype, tma: bool) -> torch.Tensor:
    """(a [M, K] int8 . weight [N, K]^T int8) * a_scale [M, 1] * weight_scale ([N] or one) + bias, in out_dtype."""
    m, k = a.shape
    n = weight.shape[0]
    out = torch.empty(m, n, device=a.device, dtype=out_dtype)
    if m == 0:
        return out
    w_scale = weight_scale.reshape(-1).float()
    common = dict(out_ptr=out, a_scale_ptr=a_scale, w_scale_ptr=w_scale,
                  bias_ptr=bias if bias is not None else w_scale, M=m, N=n, K=k, M_BUCKET=rows_bucket(m),
                  stride_out=out.stride(0), PER_CHANNEL=w_scale.numel() > 1, HAS_BIAS=bias is not None)
    tiles = lambda meta: (triton.cdiv(m, meta["BLOCK_M"]) * triton.cdiv(n, meta["BLOCK_N"]),)  # noqa: E731
    if tma:  # block shapes are set per config (`_set_block_shapes`)
        args = dict(a_desc=TensorDescriptor(a, [m, k], [a.stride(0), 1], [16, 16]),
                    w_desc=TensorDescriptor(weight, [n, k], [weight.stride(0), 1], [16, 16]), **common)
        _launch(_gemm_tma_kernel, tiles, args, a.device)
    else:
        args = dict(a_ptr=a, w_ptr=weight, stride_a=a.stride(0), stride_w=weight.stride(0), **common)
        _launch(_gemm_kernel, tiles, args, a.device)
    return out


def _launch(kernel, grid, args: dict, device: torch.device) -> None:
    """An autotuned kernel's launch; under Triton's interpreter (CPU), where nothing can be timed, with the
    first config its pruning keeps."""
    if device.type == "cuda":
        kernel[grid](**args)
        return
    config = kernel.early_config_prune(kernel.configs, {}, **args)[0]
    meta = {**args, **config.all_kwargs()}
    if config.pre_hook is not None:
        config.pre_hook(meta)
    kernel.fn[grid](**args, **config.kwargs)


def _set_block_shapes(nargs: dict) -> None:
    nargs["a_desc"].block_shape = [nargs["BLOCK_M"], nargs["BLOCK_K"]]
    nargs["w_desc"].block_shape = [nargs["BLOCK_N"], nargs["BLOCK_K"]]


def _prune_activation(configs, named_args, **kwargs):
    args = {**named_args, **kwargs}
    k, g, rotate = args["K"], args["G"], args["ROTATE"]
    kept = [c for c in configs if g <= c.kwargs["WIDTH"] <= triton.next_power_of_2(k)
            # a full-matrix product needs 16 rows of groups (tl.dot's smallest tile)
            and (not rotate or g == KRON * KRON or c.kwargs["ROWS"] * c.kwargs["WIDTH"] // g >= 16)]
    return kept or [triton.Config({"ROWS": 16, "WIDTH": g}, num_warps=4)]


def _prune_gemm(configs, named_args, **kwargs):
    k = {**named_args, **kwargs}["K"]
    return [c for c in configs if c.kwargs["BLOCK_K"] <= max(16, triton.next_power_of_2(k))] or configs[-1:]


if triton is not None:
    # 1.5 * 2^23: a sum with it keeps no fraction bits in fp32, so v + _RNE - _RNE rounds v half to even
    _RNE = tl.constexpr(12582912.0)

    def _activation_configs():
        # (rows per program, columns per step, warps). A step as wide as the row (a power of two up to 16384)
        # reads it once; narrower steps read it twice, few rows at a time, so the second read hits L2. On the
        # H200 whole rows won: 0.32 ms for 32,700 rows of 5376 or 7168, 1.07 ms for fc2's SwiGLU of 2 x 14336.
        # Few configs: each is compiled and timed at a shape's first call (a load's auto measurement included).
        shapes = [(8, 256, 4), (2, 1024, 4), (1, 8192, 4), (1, 8192, 8), (1, 16384, 16)]
        return [triton.Config({"ROWS": r, "WIDTH": w}, num_warps=nw) for r, w, nw in shapes]

    def _gemm_configs(tma: bool):
        # (BLOCK_M, BLOCK_N, BLOCK_K, stages, warps, GROUP_M); 128-byte K steps fill the 128-byte swizzle of
        # int8 tiles. On the H200 128x256x128, 8 warps, 4 stages, GROUP_M 16 won at H3's four shapes.
        if tma:
            shapes = [(128, 256, 128, 4, 8, 16), (128, 256, 128, 4, 8, 8), (256, 128, 128, 4, 8, 16),
                      (128, 128, 128, 4, 4, 8), (64, 256, 128, 4, 4, 8)]
        else:
            shapes = [(128, 128, 128, 3, 8, 8), (256, 128, 128, 3, 8, 8), (128, 256, 128, 3, 8, 8),
                      (128, 128, 64, 4, 4, 8), (64, 64, 64, 4, 4, 8)]
        return [triton.Config({"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "GROUP_M": gm}, num_stages=s,
                              num_warps=w, pre_hook=_set_block_shapes if tma else None)
                for bm, bn, bk, s, w, gm in shapes]

    @triton.jit
    def _activation(x_ptr, offs, mask, k, SWIGLU: tl.constexpr):
        """The input activation of a tile, as fp32 holding values of x's dtype (rounded as torch rounds them
        unfused: kitchen's silu(gate).mul_(up) on [gate | up] halves)."""
        dtype: tl.constexpr = x_ptr.dtype.element_ty
        if SWIGLU:
            gate = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
            up = tl.load(x_ptr + offs + k, mask=mask, other=0.0).to(tl.float32)
            silu = (gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32)
            v = (silu * up).to(dtype).to(tl.float32)
        else:
            v = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        return v

    @triton.jit
    def _rotated(x_ptr, h, offs, mask, k, ROWS: tl.constexpr, WIDTH: tl.constexpr, G: tl.constexpr,
                 HG: tl.constexpr, SWIGLU: tl.constexpr, ROTATE: tl.constexpr):
        """[ROWS, WIDTH] of activations, each group of G columns times the group's Hadamard matrix, fp32.

        The products run on fp16 tensor cores: each group is scaled by the power of two that brings its largest
        value into [1, 2), where fp16 holds every bf16 and fp16 value exactly (values under 2^-14 of the
        group's largest lose bits below 2^-24 of it); the matrix's entries, +-2^-k, are exact too."""
        v = _activation(x_ptr, offs, mask, k, SWIGLU)
        if ROTATE:
            p: tl.constexpr = ROWS * WIDTH // G  # groups in the tile, one per row of the products below
            v = tl.reshape(v, (p, G))
            top = tl.max(tl.abs(v), axis=1)
            exp = tl.minimum(tl.maximum(((top.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127, -100), 100)
            down = ((127 - exp) << 23).to(tl.float32, bitcast=True)[:, None]  # 2^-exp
            up = ((127 + exp) << 23).to(tl.float32, bitcast=True)[:, None]
            h16 = h.to(tl.float16)
            if HG == G:
                r = tl.dot((v * down).to(tl.float16), h16)
            else:
                # x @ (H16 (x) H16): each group as [16 a, 16 b]; times H16 over b, then H16 (symmetric) over a
                u = tl.dot(tl.reshape((v * down).to(tl.float16), (p * HG, HG)), h16)
                # u's values are fp32 sums: as two fp16 parts they keep 22 significant bits
                hi = u.to(tl.float16)
                lo = (u - hi.to(tl.float32)).to(tl.float16)
                hb = tl.broadcast_to(h16[None, :, :], (p, HG, HG))
                r = tl.reshape(tl.dot(hb, tl.reshape(hi, (p, HG, HG)), tl.dot(hb, tl.reshape(lo, (p, HG, HG)))),
                               (p, G))
            v = tl.reshape(r * up, (ROWS, WIDTH))
        return v

    @triton.jit
    def _store_quantized(q_ptr, offs, r, inv_scale, mask):
        # clamp first: it also keeps the product and the rounding add from fusing into one FMA
        q = tl.clamp(r * inv_scale[:, None], -128.0, 127.0)
        q = (q + _RNE) - _RNE
        tl.store(q_ptr + offs, q.to(tl.int8), mask=mask)

    @triton.autotune(configs=_activation_configs(), key=["M_BUCKET", "K", "G", "SWIGLU", "ROTATE"],
                     prune_configs_by={"early_config_prune": _prune_activation})
    @triton.jit
    def _rotate_quantize_kernel(x_ptr, h_ptr, q_ptr, scale_ptr, M, M_BUCKET, stride_x, stride_q, K: tl.constexpr,
                                G: tl.constexpr, HG: tl.constexpr, SWIGLU: tl.constexpr, ROTATE: tl.constexpr,
                                ROWS: tl.constexpr, WIDTH: tl.constexpr):
        """ROWS rows of x per program: int8 rows into q, scales into scale. With WIDTH >= K each row is read
        once, whole; otherwise twice, WIDTH columns (whole groups) a step: for the absmax, then to quantize."""
        hk = tl.arange(0, HG)
        h = tl.load(h_ptr + hk[:, None] * HG + hk[None, :])
        rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
        row_ok = rows < M
        cols = tl.arange(0, WIDTH)
        x_offs = rows.to(tl.int64)[:, None] * stride_x + cols[None, :]
        q_offs = rows.to(tl.int64)[:, None] * stride_q + cols[None, :]
        if WIDTH >= K:
            mask = row_ok[:, None] & (cols[None, :] < K)
            r = _rotated(x_ptr, h, x_offs, mask, K, ROWS, WIDTH, G, HG, SWIGLU, ROTATE)
            amax = tl.max(tl.abs(r), axis=1)
        else:
            amax = tl.zeros([ROWS], dtype=tl.float32)
            for k0 in range(0, K, WIDTH):
                mask = row_ok[:, None] & (cols[None, :] < K - k0)
                r = _rotated(x_ptr, h, x_offs + k0, mask, K, ROWS, WIDTH, G, HG, SWIGLU, ROTATE)
                amax = tl.maximum(amax, tl.max(tl.abs(r), axis=1))
        scale = tl.maximum(tl.math.div_rn(amax, 127.0), 1e-30)  # kitchen's (absmax / 127).clamp(min=1e-30)
        inv_scale = tl.math.div_rn(1.0, scale)  # once per row, correctly rounded; then a product per element
        if WIDTH >= K:
            _store_quantized(q_ptr, q_offs, r, inv_scale, mask)
        else:
            for k0 in range(0, K, WIDTH):
                mask = row_ok[:, None] & (cols[None, :] < K - k0)
                r = _rotated(x_ptr, h, x_offs + k0, mask, K, ROWS, WIDTH, G, HG, SWIGLU, ROTATE)
                _store_quantized(q_ptr, q_offs + k0, r, inv_scale, mask)
        tl.store(scale_ptr + rows, scale, mask=row_ok)

    @triton.jit
    def _tile(tile, M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
        """Grouped order: GROUP_M row tiles sweep the columns together, so their weight tiles are reused from L2."""
        tiles_m = tl.cdiv(M, BLOCK_M)
        tiles_n = tl.cdiv(N, BLOCK_N)
        per_group = GROUP_M * tiles_n
        first_m = (tile // per_group) * GROUP_M
        group_m = min(tiles_m - first_m, GROUP_M)
        return first_m + (tile % per_group) % group_m, (tile % per_group) // group_m

    @triton.jit
    def _epilogue(acc, pid_m, pid_n, out_ptr, a_scale_ptr, w_scale_ptr, bias_ptr, M, N, stride_out,
                  PER_CHANNEL: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
        """acc * (row scale * weight scale) + bias, as kitchen's epilogue multiplies, into the output dtype."""
        rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        a_scale = tl.load(a_scale_ptr + rows, mask=rows < M, other=0.0)
        if PER_CHANNEL:
            scales = a_scale[:, None] * tl.load(w_scale_ptr + cols, mask=cols < N, other=0.0)[None, :]
        else:
            scales = a_scale[:, None] * tl.load(w_scale_ptr)
        c = acc.to(tl.float32) * scales
        if HAS_BIAS:
            c += tl.load(bias_ptr + cols, mask=cols < N, other=0.0).to(tl.float32)[None, :]
        out = out_ptr + rows.to(tl.int64)[:, None] * stride_out + cols[None, :]
        tl.store(out, c.to(out_ptr.dtype.element_ty), mask=(rows < M)[:, None] & (cols < N)[None, :])

    @triton.autotune(configs=_gemm_configs(tma=False), key=["M_BUCKET", "N", "K"],
                     prune_configs_by={"early_config_prune": _prune_gemm})
    @triton.jit
    def _gemm_kernel(a_ptr, w_ptr, out_ptr, a_scale_ptr, w_scale_ptr, bias_ptr, M, N, M_BUCKET,
                     stride_a, stride_w, stride_out, K: tl.constexpr, PER_CHANNEL: tl.constexpr, HAS_BIAS: tl.constexpr,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr):
        """One output tile per program, operands through pointer loads (pipelined by num_stages)."""
        pid_m, pid_n = _tile(tl.program_id(0), M, N, BLOCK_M, BLOCK_N, GROUP_M)
        # rows and columns past the edge read the first ones again; the epilogue stores none of them
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
        _epilogue(acc, pid_m, pid_n, out_ptr, a_scale_ptr, w_scale_ptr, bias_ptr, M, N, stride_out,
                  PER_CHANNEL, HAS_BIAS, BLOCK_M, BLOCK_N)

    @triton.autotune(configs=_gemm_configs(tma=True), key=["M_BUCKET", "N", "K"],
                     prune_configs_by={"early_config_prune": _prune_gemm})
    @triton.jit
    def _gemm_tma_kernel(a_desc, w_desc, out_ptr, a_scale_ptr, w_scale_ptr, bias_ptr, M, N, M_BUCKET, stride_out,
                         K: tl.constexpr, PER_CHANNEL: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr,
                         BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr):
        """One output tile per program, operands by TMA (zero past the edges) into wgmma."""
        pid_m, pid_n = _tile(tl.program_id(0), M, N, BLOCK_M, BLOCK_N, GROUP_M)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.int32)
        for k0 in range(0, K, BLOCK_K):
            a = a_desc.load([pid_m * BLOCK_M, k0])
            w = w_desc.load([pid_n * BLOCK_N, k0])
            acc = tl.dot(a, w.T, acc, out_dtype=tl.int32)
        _epilogue(acc, pid_m, pid_n, out_ptr, a_scale_ptr, w_scale_ptr, bias_ptr, M, N, stride_out,
                  PER_CHANNEL, HAS_BIAS, BLOCK_M, BLOCK_N)
