"""The external kernels QuantLinear's methods call, as opaque torch ops for torch.compile.

ComfyUI's TorchCompileModel compiles the whole diffusion model. Dynamo cannot
trace comfy-kitchen's backend dispatch (its registry logs at every call, and
a logger call breaks the graph), so each such kernel is a
`torch.library.custom_op` here, with a fake implementation giving its output's
shape and dtype: the compiled graph calls it as one node, and the dispatch
runs inside it at run time, as in eager mode.

FP8's GEMM is one too (`bigdit::fp8_gemm`: torch._scaled_mm where FP8 is native,
the same arithmetic in fp32 elsewhere), while its activation quantization is
traced as plain torch ops under compile, so that inductor fuses it into the
op producing the activation (a norm, a modulation) instead of running the
Triton quantizer as a separate pass.

Eager calls (not compiling) go straight to the kernel, as before this module
existed: the same code, the same numbers, without the custom op's dispatch
overhead (tens of microseconds a call, paid once per layer per step).
"""
from __future__ import annotations

import torch


def _kitchen_int8_linear(x, weight, weight_scale, bias, out_dtype, convrot, convrot_groupsize, input_act):
    import comfy_kitchen as ck
    return ck.int8_linear(x, weight, weight_scale, bias, out_dtype, convrot=convrot,
                          convrot_groupsize=convrot_groupsize, input_act=input_act)


@torch.library.custom_op("bigdit::int8_linear", mutates_args=())
def _int8_linear_op(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, bias: torch.Tensor | None,
                    out_dtype: torch.dtype, convrot: bool, convrot_groupsize: int,
                    input_act: str | None) -> torch.Tensor:
    return _kitchen_int8_linear(x, weight, weight_scale, bias, out_dtype, convrot, convrot_groupsize, input_act)


@_int8_linear_op.register_fake
def _(x, weight, weight_scale, bias, out_dtype, convrot, convrot_groupsize, input_act):
    return x.new_empty((*x.shape[:-1], weight.shape[0]), dtype=out_dtype)


def int8_linear(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, bias: torch.Tensor | None,
                out_dtype: torch.dtype, *, convrot: bool, convrot_groupsize: int,
                input_act: str | None) -> torch.Tensor:
    """comfy_kitchen.int8_linear (its backend dispatch included); one graph node under torch.compile."""
    call = _int8_linear_op if torch.compiler.is_compiling() else _kitchen_int8_linear
    return call(x, weight, weight_scale, bias, out_dtype, convrot, convrot_groupsize, input_act)


def _fp8_gemm(xq, x_scale, weight, w_scale, bias, out_dtype, compute_dtype, native):
    from . import fp8
    return fp8.scaled_gemm(xq, x_scale, weight, w_scale, bias, out_dtype, compute_dtype, native)


@torch.library.custom_op("bigdit::fp8_gemm", mutates_args=())
def _fp8_gemm_op(xq: torch.Tensor, x_scale: torch.Tensor, weight: torch.Tensor, w_scale: torch.Tensor,
                 bias: torch.Tensor | None, out_dtype: torch.dtype, compute_dtype: torch.dtype,
                 native: bool) -> torch.Tensor:
    return _fp8_gemm(xq, x_scale, weight, w_scale, bias, out_dtype, compute_dtype, native)


@_fp8_gemm_op.register_fake
def _(xq, x_scale, weight, w_scale, bias, out_dtype, compute_dtype, native):
    return xq.new_empty((xq.shape[0], weight.shape[0]), dtype=out_dtype)


def fp8_gemm(xq: torch.Tensor, x_scale: torch.Tensor, weight: torch.Tensor, w_scale: torch.Tensor,
             bias: torch.Tensor | None, out_dtype: torch.dtype, compute_dtype: torch.dtype,
             native: bool) -> torch.Tensor:
    """fp8.scaled_gemm (FP8 rows times FP8 weights, scaled); one graph node under torch.compile."""
    call = _fp8_gemm_op if torch.compiler.is_compiling() else _fp8_gemm
    return call(xq, x_scale, weight, w_scale, bias, out_dtype, compute_dtype, native)
