"""The external kernels QuantLinear's methods call, as opaque torch ops for torch.compile.

ComfyUI's TorchCompileModel compiles the whole diffusion model. Dynamo cannot
trace comfy-kitchen's backend dispatch (its registry logs at every call, and
a logger call breaks the graph), so each such kernel is a
`torch.library.custom_op` here, with a fake implementation giving its output's
shape and dtype: the compiled graph calls it as one node, and the dispatch
runs inside it at run time, as in eager mode.

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


def _triton_int8_linear(x, weight, weight_scale, bias, out_dtype, convrot, convrot_groupsize, input_act):
    from . import int8_triton
    return int8_triton.linear_or_kitchen(x, weight, weight_scale, bias, out_dtype, convrot, convrot_groupsize,
                                         input_act, kitchen=_kitchen_int8_linear)


@torch.library.custom_op("bigdit::int8_linear_triton", mutates_args=())
def _int8_linear_triton_op(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                           bias: torch.Tensor | None, out_dtype: torch.dtype, convrot: bool, convrot_groupsize: int,
                           input_act: str | None) -> torch.Tensor:
    return _triton_int8_linear(x, weight, weight_scale, bias, out_dtype, convrot, convrot_groupsize, input_act)


@_int8_linear_triton_op.register_fake
def _(x, weight, weight_scale, bias, out_dtype, convrot, convrot_groupsize, input_act):
    return x.new_empty((*x.shape[:-1], weight.shape[0]), dtype=out_dtype)


def int8_linear_triton(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, bias: torch.Tensor | None,
                       out_dtype: torch.dtype, *, convrot: bool, convrot_groupsize: int,
                       input_act: str | None) -> torch.Tensor:
    """int8_triton's INT8 linear (kitchen's once those kernels failed); one graph node under torch.compile."""
    call = _int8_linear_triton_op if torch.compiler.is_compiling() else _triton_int8_linear
    return call(x, weight, weight_scale, bias, out_dtype, convrot, convrot_groupsize, input_act)


def _triton_quantize_rows(x, swiglu, inv_fp8_max, fp8_max, min_scale):
    from . import fp8_rows
    return fp8_rows.quantize_rows(x, swiglu, inv_fp8_max, fp8_max, min_scale)


@torch.library.custom_op("bigdit::fp8_quantize_rows", mutates_args=())
def _fp8_quantize_rows_op(x: torch.Tensor, swiglu: bool, inv_fp8_max: float, fp8_max: float,
                          min_scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    return _triton_quantize_rows(x, swiglu, inv_fp8_max, fp8_max, min_scale)


@_fp8_quantize_rows_op.register_fake
def _(x, swiglu, inv_fp8_max, fp8_max, min_scale):
    rows, width = x.shape[0], x.shape[1] // (2 if swiglu else 1)
    return (x.new_empty((rows, width), dtype=torch.float8_e4m3fn),
            x.new_empty((rows, 1), dtype=torch.float32))


def fp8_quantize_rows(x: torch.Tensor, swiglu: bool, inv_fp8_max: float, fp8_max: float,
                      min_scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """fp8_rows.quantize_rows (the one-pass Triton activation quantizer); one graph node under torch.compile."""
    call = _fp8_quantize_rows_op if torch.compiler.is_compiling() else _triton_quantize_rows
    return call(x, swiglu, inv_fp8_max, fp8_max, min_scale)


