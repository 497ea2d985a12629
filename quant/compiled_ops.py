"""The external kernels QuantLinear's methods call, as opaque torch ops for torch.compile.

ComfyUI's TorchCompileModel compiles the whole diffusion model. Dynamo cannot
trace comfy-kitchen's backend dispatch (its registry logs at every call, and
a logger call breaks the graph), so each such kernel is a
`torch.library.custom_op` here, with a fake implementation giving its output's
shape and dtype: the compiled graph calls it as one node, and the dispatch
runs inside it at run time, as in eager mode. Each INT8 linear counts its calls
in the run witness (quant/witness.py) from inside, so that a compiled model's
report says which kernel ran too. A W4A8 layer on the INT8 kernels is one op too:
the decode of its codes, then the INT8 linear.

Eager calls (not compiling) go straight to the kernel, as before this module
existed: the same code, the same numbers, without the custom op's dispatch
overhead (tens of microseconds a call, paid once per layer per step).
"""
from __future__ import annotations

import torch

from . import int8_triton, w4a8_triton, witness


def _kitchen(x, weight, weight_scale, bias, out_dtype, convrot, convrot_groupsize, input_act):
    import comfy_kitchen as ck
    return ck.int8_linear(x, weight, weight_scale, bias, out_dtype, convrot=convrot,
                          convrot_groupsize=convrot_groupsize, input_act=input_act)


def _kitchen_int8_linear(x, weight, weight_scale, bias, out_dtype, convrot, convrot_groupsize, input_act):
    witness.count_kernel(int8_triton.TALLY, "kitchen")
    return _kitchen(x, weight, weight_scale, bias, out_dtype, convrot, convrot_groupsize, input_act)


def _kitchen_split_int8_linear(x, weight, weight_scale, bias, out_dtype, convrot, convrot_groupsize, input_act,
                               rows_per_call):
    witness.count_kernel(int8_triton.TALLY, "kitchen_split")
    return torch.cat([_kitchen(x[i:i + rows_per_call], weight, weight_scale, bias, out_dtype, convrot,
                               convrot_groupsize, input_act) for i in range(0, x.shape[0], rows_per_call)])


def _triton_int8_linear(x, weight, weight_scale, bias, out_dtype, convrot, convrot_groupsize, input_act):
    return int8_triton.linear_or_kitchen(x, weight, weight_scale, bias, out_dtype, convrot, convrot_groupsize,
                                         input_act, kitchen=_kitchen_int8_linear)


def _opaque_int8_linear(name: str, kernel):
    """`kernel` (an INT8 linear of int8_linear's arguments) called eagerly, and while torch.compile traces as the
    opaque op bigdit::<name>, whose fake gives the output's shape and dtype."""
    def run(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, bias: torch.Tensor | None,
            out_dtype: torch.dtype, convrot: bool, convrot_groupsize: int, input_act: str | None) -> torch.Tensor:
        return kernel(x, weight, weight_scale, bias, out_dtype, convrot, convrot_groupsize, input_act)

    op = torch.library.custom_op(f"bigdit::{name}", run, mutates_args=())

    @op.register_fake
    def _(x, weight, weight_scale, bias, out_dtype, convrot, convrot_groupsize, input_act):
        return x.new_empty((*x.shape[:-1], weight.shape[0]), dtype=out_dtype)

    def call(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, bias: torch.Tensor | None,
             out_dtype: torch.dtype, *, convrot: bool, convrot_groupsize: int, input_act: str | None) -> torch.Tensor:
        return (op if torch.compiler.is_compiling() else kernel)(x, weight, weight_scale, bias, out_dtype, convrot,
                                                                    convrot_groupsize, input_act)
    return call


@torch.library.custom_op("bigdit::int8_linear_split", mutates_args=())
def _split_op(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, bias: torch.Tensor | None,
              out_dtype: torch.dtype, convrot: bool, convrot_groupsize: int, input_act: str | None,
              rows_per_call: int) -> torch.Tensor:
    return _kitchen_split_int8_linear(x, weight, weight_scale, bias, out_dtype, convrot, convrot_groupsize,
                                      input_act, rows_per_call)


@_split_op.register_fake
def _(x, weight, weight_scale, bias, out_dtype, convrot, convrot_groupsize, input_act, rows_per_call):
    return x.new_empty((x.shape[0], weight.shape[0]), dtype=out_dtype)


def w4a8_decoder(device: torch.device):
    """comfy-kitchen's decode of W4A8's 4-bit codes onto the int8 grid (round(clamp(level * s_rel, +-127)), as its
    W4A8 linear decodes them) for tensors on `device`: its Triton kernel on CUDA, its eager one elsewhere (Triton's
    interpreter has no libdevice rint); None where this comfy-kitchen has it not."""
    try:
        if device.type == "cuda":
            from comfy_kitchen.backends.triton.w4a8_int8 import _dequant_int4_grouped_to_int8
        else:
            from comfy_kitchen.backends.eager.w4a8_int8 import _dequant_int4_grouped_to_int8
    except ImportError:
        return None
    return _dequant_int4_grouped_to_int8


W4A8_TALLY = "w4a8"  # W4A8 layers whose codes were decoded for the INT8 kernels ("ran w4a8: decoded to int8 x200")


def w4a8_decodes(qdata: torch.Tensor, s_rel: torch.Tensor, group_size: int) -> bool:
    """Whether `w4a8_decoded` takes a W4A8 layer's tensors: the pack's decode does, else comfy-kitchen's exists."""
    return w4a8_triton.decodes(qdata, s_rel, group_size) or w4a8_decoder(qdata.device) is not None


def w4a8_decoded(qdata: torch.Tensor, s_rel: torch.Tensor, codebook: torch.Tensor | None,
                 group_size: int) -> torch.Tensor:
    """The int8 weight of a W4A8 layer's codes (`w4a8_decodes`, which the caller checked): the pack's decode kernel
    (quant/w4a8_triton.py), else comfy-kitchen's; counted in the run witness."""
    witness.count_kernel(W4A8_TALLY, "decoded to int8")
    if w4a8_triton.decodes(qdata, s_rel, group_size):
        return w4a8_triton.decode(qdata, s_rel, codebook, group_size)
    return w4a8_decoder(qdata.device)(qdata, s_rel, codebook, group_size)


def _triton_w4a8_linear(x, qdata, s_rel, s_channel, codebook, bias, out_dtype, group_size, convrot_groupsize,
                        input_act):
    """A W4A8 layer's output: its codes decoded onto the int8 grid, then the int8 linear with the row scales
    s_channel, as comfy-kitchen's W4A8 computes it; on int8_triton's kernels where they take the call, else kitchen's
    int8_linear."""
    weight = w4a8_decoded(qdata, s_rel, codebook, group_size)
    if not int8_triton.available(x, weight, s_channel, bias, out_dtype, True, convrot_groupsize, input_act):
        return _kitchen_int8_linear(x, weight, s_channel, bias, out_dtype, True, convrot_groupsize, input_act)
    return int8_triton.linear_or_kitchen(x, weight, s_channel, bias, out_dtype, True, convrot_groupsize, input_act,
                                         kitchen=_kitchen_int8_linear)


@torch.library.custom_op("bigdit::w4a8_linear_triton", mutates_args=())
def _w4a8_op(x: torch.Tensor, qdata: torch.Tensor, s_rel: torch.Tensor, s_channel: torch.Tensor,
             codebook: torch.Tensor | None, bias: torch.Tensor | None, out_dtype: torch.dtype, group_size: int,
             convrot_groupsize: int, input_act: str | None) -> torch.Tensor:
    return _triton_w4a8_linear(x, qdata, s_rel, s_channel, codebook, bias, out_dtype, group_size, convrot_groupsize,
                               input_act)


@_w4a8_op.register_fake
def _(x, qdata, s_rel, s_channel, codebook, bias, out_dtype, group_size, convrot_groupsize, input_act):
    return x.new_empty((x.shape[0], qdata.shape[0]), dtype=out_dtype)


def w4a8_linear_triton(x: torch.Tensor, qdata: torch.Tensor, s_rel: torch.Tensor, s_channel: torch.Tensor,
                       codebook: torch.Tensor | None, bias: torch.Tensor | None, out_dtype: torch.dtype, *,
                       group_size: int, convrot_groupsize: int, input_act: str | None) -> torch.Tensor:
    """_triton_w4a8_linear on a 2-D `x`, as one op while torch.compile traces."""
    return (_w4a8_op if torch.compiler.is_compiling() else _triton_w4a8_linear)(
        x, qdata, s_rel, s_channel, codebook, bias, out_dtype, group_size, convrot_groupsize, input_act)


#: comfy_kitchen.int8_linear (its backend dispatch included)
int8_linear = _opaque_int8_linear("int8_linear", _kitchen_int8_linear)
#: int8_triton's INT8 linear (kitchen's where those kernels failed)
int8_linear_triton = _opaque_int8_linear("int8_linear_triton", _triton_int8_linear)


def int8_linear_split(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, bias: torch.Tensor | None,
                      out_dtype: torch.dtype, *, convrot: bool, convrot_groupsize: int, input_act: str | None,
                      rows_per_call: int) -> torch.Tensor:
    """comfy_kitchen.int8_linear on a 2-D `x` in calls of `rows_per_call` rows, as one op."""
    return (_split_op if torch.compiler.is_compiling() else _kitchen_split_int8_linear)(
        x, weight, weight_scale, bias, out_dtype, convrot, convrot_groupsize, input_act, rows_per_call)
