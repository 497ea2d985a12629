"""Memory plan: which transformer blocks stay on the GPU, which stream, and the peak to expect.

Pure torch, no ComfyUI. Inputs are a model after quantization, its list of
blocks, the run's shape and the memory available; the output is a
`MemoryPlan` whose first rendered line reads like
`resident 34/50 blocks, streaming 16; estimated peak 21.3 GiB of 24.0 GiB`.

Estimate (all in bytes):

    weights   true bytes of every parameter and buffer: a QuantLinear's int8
              weight plus fp32 scales, a comfy-kitchen QuantizedTensor's packed
              data plus its scales (its shape/dtype describe the dequantized
              weight, so numel * element_size would over-count it)
    rest      model weights outside the blocks; always resident
    staging   streamed blocks are copied in one block ahead, so two of them
              can be on the GPU at once: 2 x the largest streamed block
              (1 x when only one block streams)
    activations, for R = batch x tokens rows of element size b, one block of
              residual width D, attention width I = heads x head_dim, heads H,
              and first MLP projection width W (2 x ffn for SwiGLU, H3's fc1):
                attention phase  R*b*(D + 3I + 3I + I) + H*R*4
                                 residual, fused qkv output, q/k/v made
                                 contiguous for the kernel, attention output;
                                 fp32 softmax statistics per head and row
                MLP phase        R*b*(2D + 2W)
                                 the block's input (the loop that called
                                 the block still holds it), the residual
                                 after attention, fc1 output, the
                                 activation's two temporaries (act(gate) and
                                 the product for SwiGLU, or GELU's output:
                                 W together)
              peak = max(attention, MLP) + R*b*D for the model's input, held
              by its caller. An INT8 layer's scratch (its input as int8,
              R x in_features bytes) falls in a phase below this peak.
    workspace fixed allowance for cuBLAS/cuDNN workspaces and kernel scratch
    estimated peak = rest + resident blocks + staging + activations + workspace
    budget    free memory - reserve

Placement: the fewest streamed blocks that fit the budget (so as many resident
as fit), spread evenly with block 0 kept resident, so each streamed block's
copy can hide behind the compute of the blocks before it. A host that places
the weights itself (ComfyUI's partial load: the largest layers first, across
every block) gets the plan redrawn on its placement (`MemoryPlan.placed`): the
parts it left in host memory stream, and the peak counts what it loaded.
"""
from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, replace
from typing import Mapping, Sequence

import torch
from torch import nn

from ..quant.kitchen_api import tensor_bytes
from ..quant.quantize_pass import walk_modules
from ..units import GIB, MIB, format_gib

# cuBLAS keeps a workspace per handle and stream, cuDNN attention a little more.
CUDA_WORKSPACE_BYTES = 64 * MIB
# Attributes that hold a DiT's block list, in execution order (Flux runs double then single blocks).
BLOCK_LIST_NAMES = ("blocks", "double_blocks", "single_blocks", "transformer_blocks", "joint_blocks", "layers")


def size_text(n_bytes: float) -> str:
    return format_gib(n_bytes) if n_bytes >= GIB / 10 else f"{n_bytes / MIB:.2f} MiB"


# ---- weights ---------------------------------------------------------------

def module_bytes(module: nn.Module, overrides: Mapping[str, nn.Module] | None = None) -> int:
    """True bytes of a module's parameters and buffers.

    `overrides` maps dotted paths (relative to `module`, as ComfyUI object
    patches name them) to modules that stand in for the tree's at run time.
    """
    return sum(tensor_bytes(t) for _, m in walk_modules(module, overrides, remove_duplicate=False)
               for t in (*m._parameters.values(), *m._buffers.values()) if t is not None)


def find_blocks(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """(path, block) for every block of the model's block lists, in execution order."""
    found = []
    for name in BLOCK_LIST_NAMES:
        blocks = getattr(model, name, None)
        if isinstance(blocks, nn.ModuleList):
            found.extend((f"{name}.{i}", block) for i, block in enumerate(blocks))
    return found


def sub_overrides(overrides: Mapping[str, nn.Module], prefix: str) -> dict[str, nn.Module]:
    """The overrides below `prefix` (ending in '.'), with paths relative to it."""
    return {k[len(prefix):]: v for k, v in overrides.items() if k.startswith(prefix)}


# ---- activations -------------------------------------------------------------

@dataclass(frozen=True)
class RunShape:
    tokens: int                 # sequence length through the blocks, per sample
    hidden: int                 # residual width D
    heads: int
    head_dim: int
    ffn: int                    # MLP hidden width (after the SwiGLU gate)
    gated: bool = True          # SwiGLU: the first projection is 2 x ffn wide
    dtype: torch.dtype = torch.bfloat16
    batch: int = 1

    @property
    def inner(self) -> int:
        return self.heads * self.head_dim

    @property
    def mlp_width(self) -> int:
        return self.ffn * (2 if self.gated else 1)

    def describe(self) -> str:
        return f"{self.tokens:,} tokens x batch {self.batch} ({str(self.dtype).removeprefix('torch.')})"


def activation_bytes(shape: RunShape) -> int:
    """Peak activation bytes of one block's forward (see the module docstring)."""
    rows = shape.batch * shape.tokens
    b = torch.empty((), dtype=shape.dtype).element_size()
    d, inner, width = shape.hidden, shape.inner, shape.mlp_width
    attention = rows * b * (d + 7 * inner) + shape.heads * rows * 4
    mlp = rows * b * (2 * d + 2 * width)
    return max(attention, mlp) + rows * b * d


def _linear_dims(block: nn.Module) -> list[tuple[int, int]]:
    dims = []
    for module in block.modules():
        k, n = getattr(module, "in_features", None), getattr(module, "out_features", None)
        if isinstance(k, int) and isinstance(n, int):
            dims.append((k, n))
    return dims


def infer_shape(block: nn.Module, tokens: int, dtype: torch.dtype, batch: int = 1,
                heads: int | None = None, head_dim: int = 128) -> RunShape:
    """A RunShape from a block's Linear shapes, for models that do not declare theirs.

    Residual width: the most common input width. MLP: the widest projection of
    the residual is the first one (projections of other inputs, such as a
    per-sample modulation from the time embedding, do not scale with tokens);
    it is gated when the widest input that maps back to the residual is half
    of it. Attention width: the widest other input that maps back to the
    residual (H3's out_proj), else the residual width.
    """
    dims = _linear_dims(block)
    if not dims:
        raise ValueError("block has no Linear-like layers to infer its shape from")
    hidden = Counter(k for k, _ in dims).most_common(1)[0][0]
    width = max(n for k, n in dims if k == hidden)
    back = [k for k, n in dims if n == hidden]
    fc2_in = max(back, default=width)
    gated = fc2_in * 2 == width
    ffn = fc2_in if gated else width
    inner = max((k for k in back if k not in (width, ffn)), default=hidden)
    if heads is None:
        heads = max(1, inner // head_dim)
    return RunShape(tokens=tokens, hidden=hidden, heads=heads, head_dim=max(1, inner // heads),
                    ffn=ffn, gated=gated, dtype=dtype, batch=batch)


def latent_tokens(latent_shape: Sequence[int], patch_size=None) -> int:
    """Tokens a [B, C, *spatial] latent becomes after patchifying (`patch_size` int: last two dims)."""
    spatial = list(latent_shape[2:])
    if patch_size is None:
        patch = [1] * len(spatial)
    elif isinstance(patch_size, int):
        patch = [1] * (len(spatial) - 2) + [patch_size] * min(2, len(spatial))
    else:
        patch = [1] * (len(spatial) - len(patch_size)) + list(patch_size)[-len(spatial):]
    return math.prod(-(-s // p) for s, p in zip(spatial, patch))


# ---- the plan ----------------------------------------------------------------

def spread(n_blocks: int, n_streamed: int) -> tuple[int, ...]:
    """Indices of `n_streamed` of `n_blocks` blocks, evenly spaced: the last of each of
    n_streamed equal runs, so block 0 stays resident unless every block streams."""
    if n_streamed <= 0:
        return ()
    return tuple(-(-(j + 1) * n_blocks // n_streamed) - 1 for j in range(n_streamed))


@dataclass(frozen=True)
class MemoryPlan:
    block_bytes: tuple[int, ...]
    rest_bytes: int
    activation_bytes: int
    workspace_bytes: int
    capacity_bytes: int                 # memory available to this model before the reserve
    reserve_bytes: int
    streamed: tuple[int, ...] = ()
    shape: RunShape | None = None
    # Set by `placed`: the bytes of each block the host left in host memory (they stream), None: the blocks
    # of `streamed` stream whole; and the bytes outside the blocks it left there (cast per layer, not staged).
    away_bytes: tuple[int, ...] | None = None
    rest_away_bytes: int = 0

    def placed(self, block_bytes: Sequence[int], away_bytes: Sequence[int], rest_bytes: int,
               rest_away_bytes: int) -> "MemoryPlan":
        """This plan redrawn on the host's own placement (ComfyUI's partial load), from the live model's bytes:
        each block's, the part of each it left in host memory (that part streams, one block ahead), and the
        same outside the blocks (cast per layer by the host, so not staged)."""
        sizes, away = tuple(map(int, block_bytes)), tuple(map(int, away_bytes))
        if not len(sizes) == len(away) == self.n_blocks or any(not 0 <= a <= b for a, b in zip(away, sizes)) \
                or not 0 <= rest_away_bytes <= rest_bytes:
            raise ValueError(f"a placement needs 0 <= away <= bytes for each of the plan's {self.n_blocks} blocks "
                             f"and the rest: {sizes}, {away}, {rest_bytes}, {rest_away_bytes}")
        return replace(self, block_bytes=sizes, rest_bytes=int(rest_bytes), streamed=tuple(
            i for i, b in enumerate(away) if b), away_bytes=away, rest_away_bytes=int(rest_away_bytes))

    def _streamed_sizes(self) -> list[int]:
        sizes = self.block_bytes if self.away_bytes is None else self.away_bytes
        return [sizes[i] for i in self.streamed]

    @property
    def budget_bytes(self) -> int:
        return max(0, self.capacity_bytes - self.reserve_bytes)

    @property
    def n_blocks(self) -> int:
        return len(self.block_bytes)

    @property
    def resident(self) -> tuple[int, ...]:
        streamed = set(self.streamed)
        return tuple(i for i in range(self.n_blocks) if i not in streamed)

    @property
    def resident_bytes(self) -> int:
        """The blocks' bytes kept on the device."""
        return sum(self.block_bytes) - self.streamed_bytes

    @property
    def streamed_bytes(self) -> int:
        """The bytes copied in per forward."""
        return sum(self._streamed_sizes())

    @property
    def staging_bytes(self) -> int:
        return sum(sorted(self._streamed_sizes(), reverse=True)[:2])

    @property
    def estimated_peak(self) -> int:
        return (self.rest_bytes - self.rest_away_bytes + self.resident_bytes + self.staging_bytes
                + self.activation_bytes + self.workspace_bytes)

    @property
    def fits(self) -> bool:
        return self.estimated_peak <= self.budget_bytes

    @property
    def fits_resident(self) -> bool:
        """Every block fits on the device (what mode "none" needs; a plan that fits by streaming does not)."""
        return self.fits and not self.streamed

    def summary_line(self) -> str:
        unit, name = (GIB, "GiB") if self.budget_bytes >= GIB else (MIB, "MiB")
        # without a run's shape the activations are unknown: the peak is the weights' part of it
        peak = "estimated peak" if self.shape is not None else "peak before activations"
        if self.away_bytes is None:
            blocks = f"resident {len(self.resident)}/{self.n_blocks} blocks, streaming {len(self.streamed)}"
        else:
            blocks = (f"as placed by the host: {size_text(self.resident_bytes)} of the blocks on the device, "
                      f"{size_text(self.streamed_bytes)} of {len(self.streamed)}/{self.n_blocks} blocks streamed "
                      f"per forward")
        return f"{blocks}; {peak} {self.estimated_peak / unit:.1f} {name} of {self.budget_bytes / unit:.1f} {name}"

    def render(self) -> str:
        blocks = sum(self.block_bytes)
        each = f" ({size_text(max(self.block_bytes))} the largest)" if self.block_bytes else ""
        lines = [self.summary_line()]
        if not self.fits:
            lines.append(f"does not fit: needs {size_text(self.estimated_peak)} "
                         f"but the budget is {size_text(self.budget_bytes)}")
        lines += [
            f"weights: {size_text(blocks + self.rest_bytes)} = {self.n_blocks} blocks {size_text(blocks)}{each} "
            f"+ rest {size_text(self.rest_bytes)}",
            f"on the GPU: resident blocks {size_text(self.resident_bytes)}, rest {size_text(self.rest_bytes)}, "
            f"staging {size_text(self.staging_bytes)} ({min(2, len(self.streamed))} streamed blocks), "
            + (f"activations {size_text(self.activation_bytes)}, " if self.shape is not None else "")
            + f"workspace {size_text(self.workspace_bytes)}",
            f"budget: {size_text(self.budget_bytes)} = {size_text(self.capacity_bytes)} available "
            f"- {size_text(self.reserve_bytes)} reserve",
        ]
        if self.shape is not None:
            lines.append(f"run: {self.shape.describe()}")
        if self.streamed:
            lines.append(f"streamed from host memory: {size_text(self.streamed_bytes)}, "
                         f"blocks {block_ranges(self.streamed)}")
        return "\n".join(lines)


def block_ranges(indices: Sequence[int]) -> str:
    parts, start, prev = [], None, None
    for i in indices:
        if start is None:
            start = prev = i
        elif i == prev + 1:
            prev = i
        else:
            parts.append(f"{start}" if start == prev else f"{start}-{prev}")
            start = prev = i
    if start is not None:
        parts.append(f"{start}" if start == prev else f"{start}-{prev}")
    return ", ".join(parts)


def plan_placement(block_bytes: Sequence[int], rest_bytes: int, activation: int, capacity_bytes: int,
                   reserve_bytes: int, workspace_bytes: int = CUDA_WORKSPACE_BYTES,
                   shape: RunShape | None = None) -> MemoryPlan:
    """The plan with the fewest streamed blocks that fits; if none fits, every block streams
    (and `fits` is False)."""
    base = dict(block_bytes=tuple(block_bytes), rest_bytes=rest_bytes, activation_bytes=activation,
                workspace_bytes=workspace_bytes, capacity_bytes=capacity_bytes, reserve_bytes=reserve_bytes,
                shape=shape)
    plan = MemoryPlan(**base)
    for count in range(len(block_bytes) + 1):
        plan = MemoryPlan(**base, streamed=spread(len(block_bytes), count))
        if plan.fits:
            break
    return plan


def plan_for_model(model: nn.Module, blocks: Sequence[tuple[str, nn.Module]], shape: RunShape | None,
                   capacity_bytes: int, reserve_bytes: int, overrides: Mapping[str, nn.Module] | None = None,
                   workspace_bytes: int = CUDA_WORKSPACE_BYTES) -> MemoryPlan:
    """Plan a model whose blocks are `blocks` ((path relative to model, module) pairs).

    `shape` None plans weights only (activations unknown yet).
    """
    overrides = overrides or {}
    sizes = [module_bytes(overrides.get(path, block), sub_overrides(overrides, path + "."))
             for path, block in blocks]
    rest = module_bytes(model, overrides) - sum(sizes)
    activation = activation_bytes(shape) if shape is not None else 0
    return plan_placement(sizes, rest, activation, capacity_bytes, reserve_bytes, workspace_bytes, shape)


def max_resident_tokens(plan: MemoryPlan, shape: RunShape) -> int:
    """The longest sequence (same batch) at which every block still fits resident; 0 if none."""
    per_token = activation_bytes(replace(shape, tokens=1))
    room = plan.budget_bytes - (sum(plan.block_bytes) + plan.rest_bytes + plan.workspace_bytes)
    return max(0, room // per_token)
