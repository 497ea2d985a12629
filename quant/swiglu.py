"""SwiGLU in one pass (Triton), where a layer needs its activated input in memory: a quantized layer with a LoRA
branch, whose branch multiplies the activated input (elsewhere the quantizers fold SwiGLU in and nothing is written).

comfy-kitchen's eager `silu(gate).mul_(up)` reads the [gate | up] input and writes its result in three passes
(silu out, mul's two reads and a write); this kernel reads each half once and writes once. It rounds as the eager
path does: silu rounded to the input's dtype, then the product rounded again; only silu's exp may differ from
torch's by an ulp before that rounding (as in fp8_rows and int8_triton, which fold the same activation).
"""
from __future__ import annotations

import torch

from ..pack_logging import pack_logger
from . import compile_ahead
from .kitchen_api import apply_input_act

try:
    import triton
    import triton.language as tl
except Exception:  # missing or broken Triton: kitchen's eager activation
    triton = None

log = pack_logger(__name__)
BLOCK = 1024
_failed: str | None = None
_launched: set[tuple] = set()  # (device, width, strides) launched before: compiled (quant/compile_ahead.py)


if triton is not None:
    @triton.jit
    def _swiglu_kernel(x_ptr, out_ptr, width, stride_x, stride_out, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = cols < width
        src = x_ptr + row * stride_x
        gate = tl.load(src + cols, mask=mask, other=0.0).to(tl.float32)
        up = tl.load(src + width + cols, mask=mask, other=0.0).to(tl.float32)
        silu = (gate / (1.0 + tl.exp(-gate))).to(x_ptr.dtype.element_ty).to(tl.float32)
        tl.store(out_ptr + row * stride_out + cols, (silu * up).to(out_ptr.dtype.element_ty), mask=mask)


def swiglu(x: torch.Tensor, ahead: bool = False) -> torch.Tensor | None:
    """silu(gate) * up of a 2-D [rows, 2 * width] CUDA input's halves, [rows, width] in its dtype; with `ahead`,
    None (nothing launched) while the kernel compiles ahead."""
    rows, width = x.shape[0], x.shape[1] // 2
    out = torch.empty(rows, width, device=x.device, dtype=x.dtype)
    if rows:
        grid, args = (rows, triton.cdiv(width, BLOCK)), (x, out, width, x.stride(0), out.stride(0))
        key = (str(x.device), x.dtype, width, x.stride(0), out.stride(0))
        if ahead and key not in _launched and not compile_ahead.ready(
                lambda: _swiglu_kernel.warmup(*args, BLOCK=BLOCK, grid=grid), x.device):
            return None
        _swiglu_kernel[grid](*args, BLOCK=BLOCK)
        _launched.add(key)
    return out


def activated(x: torch.Tensor, input_act: str | None) -> torch.Tensor:
    """`x` with its input activation applied, as kitchen's apply_input_act gives it: SwiGLU on CUDA in one pass
    (eager calls; a trace keeps kitchen's, which the compiler fuses itself; kitchen's while the kernel compiles
    ahead), everything else by kitchen."""
    global _failed
    if (input_act == "swiglu" and triton is not None and _failed is None and x.is_cuda and x.stride(-1) == 1
            and x.shape[-1] % 2 == 0 and not torch.compiler.is_compiling()):
        try:
            out = swiglu(x.reshape(-1, x.shape[-1]), ahead=True)
            if out is not None:
                return out.reshape(*x.shape[:-1], x.shape[-1] // 2)
        except Exception as exc:  # a Triton that imports but cannot compile for this GPU
            _failed = f"{type(exc).__name__}: {exc}"
            log.warning("SwiGLU: the one-pass Triton kernel failed (%s); comfy-kitchen's eager SwiGLU computes it "
                        "from now on (slower)", _failed)
    return apply_input_act(x, input_act)
