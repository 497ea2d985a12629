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

comfy-kitchen's Sol takes per-call arguments no other kernel has (tau, sink
ranges, a key bias), so it has its own op, `bigdit::sol_attention`, on
(B, T, H, D) tensors.

Eager calls (not compiling) never go through the ops.
"""
from __future__ import annotations

import functools
import inspect

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


@functools.lru_cache(maxsize=None)
def _accepted_params(fn) -> frozenset:
    return frozenset(inspect.signature(fn).parameters)


def _kitchen_sol(q, k, v, tau, scale, sink_blocks, sink_q, key_bias):
    import comfy_kitchen as ck
    kwargs = {"tau": tau, "scale": scale, "sink_blocks": sink_blocks, "sink_q": sink_q, "key_bias": key_bias}
    # pass only what this comfy-kitchen's sol_attn accepts
    accepted = _accepted_params(ck.sol_attn)
    return ck.sol_attn(q, k, v, **{name: value for name, value in kwargs.items() if name in accepted})


@torch.library.custom_op("bigdit::sol_attention", mutates_args=())
def _sol_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, tau: float, scale: float | None,
            sink_blocks: list[int], sink_q: list[int], key_bias: torch.Tensor | None) -> torch.Tensor:
    return _kitchen_sol(q, k, v, tau, scale, sink_blocks, sink_q, key_bias).contiguous()


@_sol_op.register_fake
def _(q, k, v, tau, scale, sink_blocks, sink_q, key_bias):
    return q.new_empty(q.shape)


def sol_attention(q, k, v, *, tau: float, scale: float | None, sink_blocks: list[int], sink_q: list[int],
                  key_bias: torch.Tensor | None) -> torch.Tensor:
    """comfy_kitchen.sol_attn on (B, T, H, 128); one graph node under torch.compile."""
    call = _sol_op if torch.compiler.is_compiling() else _kitchen_sol
    return call(q, k, v, tau, scale, list(sink_blocks), list(sink_q), key_bias)
