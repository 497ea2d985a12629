"""The attention kernels, as one opaque torch op for torch.compile.

Under ComfyUI's TorchCompileModel dynamo traces the router into the model's
graph. The optional kernels are Python around extensions it cannot trace
(lazy imports, pybind calls, context managers, `torch.cuda.set_device` in
SageAttention), each a graph break per attention call. While tracing, a
kernel's `_run` is therefore called through `bigdit::attention`, a
`torch.library.custom_op` with a fake implementation giving the output's
shape: one node in the graph, the kernel's own code at run time. Kernels are
named by label; `Backend` registers the kernels it holds. The output is made
contiguous, as the fake declares it (a BSHD view of a BHSD output would
otherwise differ in strides from what the compiled graph assumes).

Eager calls (not compiling) never go through the op.
"""
from __future__ import annotations

import torch

# label -> the kernel (an attention.base.Impl) the op runs
KERNELS: dict[str, object] = {}


def register(impls) -> None:
    for impl in impls:
        KERNELS[impl.label] = impl


@torch.library.custom_op("bigdit::attention", mutates_args=())
def _attention_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kernel: str, layout: str,
                  mask: torch.Tensor | None, scale: float | None) -> torch.Tensor:
    return KERNELS[kernel]._run(q, k, v, layout, mask, scale).contiguous()


@_attention_op.register_fake
def _(q, k, v, kernel, layout, mask, scale):
    return q.new_empty((*q.shape[:-1], v.shape[-1]))


def attention(kernel: str, q, k, v, layout: str, mask, scale) -> torch.Tensor:
    """The kernel labelled `kernel` on (q, k, v) as one graph node."""
    return _attention_op(q, k, v, kernel, layout, mask, scale)
