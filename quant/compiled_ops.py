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

