"""The quantization pass: each module of a model decided (quant/decision.py), then quantized one at a time.

The pass never mutates the model: it returns replacement modules, so a caller
can install them on a clone (ComfyUI object patches) or in place, and a
failure half-way leaves the model exactly as it was.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Callable, Iterator, Mapping

import torch
from torch import nn

from ..dtypes import FLOAT_DTYPES, dtype_name
from ..pack_logging import pack_logger
from ..units import format_gib
from .kitchen_api import is_quantized_tensor, layout_name, layout_params, storage_dtype, tensor_bytes
from .registry import format_spec, kitchen_format
from .linear import QuantLinear, quantized_layer
from .decision import Layer, QuantConfig, decide
from .linear_method import LinearMethod
from .report import LayerRecord, QuantReport

log = pack_logger(__name__)


class QuantizationError(RuntimeError):
    """A layer could not be quantized; names the layer. The model is unchanged."""


@dataclass
class ModuleDecision:
    """The decision for one weight-bearing module of a model, with the module."""
    name: str
    module: nn.Module
    method: LinearMethod | None
    reason: str
    linear: bool = True
    existing_format: str | None = None  # the format of a layer quantized before this pass
    fp8: bool = False  # existing_format is an FP8 one (fp8_format), kept or re-quantized
    compute_dtype: torch.dtype | None = None  # of the new layer, where the old weight's dtype is not it (FP8)


def parameter_bytes(module: nn.Module) -> int:
    """True bytes of a layer's own parameters (a QuantizedTensor by its packed data)."""
    return sum(tensor_bytes(p) for p in module.parameters(recurse=False))


def _is_quantized_weight(weight: torch.Tensor) -> bool:
    # Upstream ComfyUI loads quantized checkpoints as QuantizedTensor weights;
    # any non-float storage is already someone's quantized format.
    return is_quantized_tensor(weight) or weight.dtype not in FLOAT_DTYPES


def _format_of(weight: torch.Tensor) -> str:
    """The format name of a weight someone else quantized."""
    if not is_quantized_tensor(weight):
        return dtype_name(weight.dtype)
    spec = kitchen_format(layout_name(weight))
    named = None if spec is None else spec.weight_format(layout_params(weight), storage_dtype(weight))
    return named or layout_name(weight)


FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)


def fp8_format(module: nn.Module) -> str | None:
    """The format of a layer quantized to FP8 before (the pack's FP8 layers, a ComfyUI Linear with an fp8
    weight dtype, scaled or not, or with upstream's FP8 QuantizedTensor weight), else None."""
    if isinstance(module, QuantLinear):
        spec = format_spec(module.method.name)
        return module.method.name if spec is not None and spec.fp8_layers else None
    weight = getattr(module, "weight", None)
    if not isinstance(weight, torch.Tensor):
        return None
    if is_quantized_tensor(weight):
        spec = kitchen_format(layout_name(weight))
        return _format_of(weight) if spec is not None and spec.fp8_layers else None
    return _format_of(weight) if weight.dtype in FP8_DTYPES else None


def dequantized_weight(module: nn.Module, device: torch.device) -> torch.Tensor:
    """The full-precision [out, in] weight of an FP8 layer (see fp8_format), computed on `device`."""
    if isinstance(module, QuantLinear):
        return module.method.dequantize(module, device)
    weight = module.weight.detach()
    if is_quantized_tensor(weight):
        return weight.dequantize().to(device=device, dtype=torch.float32)
    weight = weight.to(device=device, dtype=torch.float32)
    scale = getattr(module, "scale_weight", None)  # ComfyUI 0.3.75's scaled_fp8 layers
    return weight if scale is None else weight * scale.detach().to(device=device, dtype=torch.float32)


def _dominant_dtype(model: nn.Module, overrides: dict[str, nn.Module]) -> torch.dtype | None:
    counts: Counter = Counter()
    for _, module in walk_modules(model, overrides):
        if isinstance(module, QuantLinear):
            counts[module.compute_dtype] += module.in_features * module.out_features
        elif _linear_like(module) and module.weight.dtype in FLOAT_DTYPES:
            counts[module.weight.dtype] += module.weight.numel()
    return counts.most_common(1)[0][0] if counts else None


def walk_modules(model: nn.Module, overrides: Mapping[str, nn.Module] | None = None,
                 remove_duplicate: bool = True) -> Iterator[tuple[str, nn.Module]]:
    """(name, module) like `named_modules`, parents first, where an override stands in for the module at its
    name, children included: the tree as it will run, not as it is now. The one walker of object patches."""
    overrides = overrides or {}
    seen: set[int] = set()

    def visit(name: str, module: nn.Module):
        module = overrides.get(name, module)
        if module is None or (remove_duplicate and id(module) in seen):
            return
        seen.add(id(module))
        yield name, module
        for child_name, child in module._modules.items():
            yield from visit(f"{name}.{child_name}" if name else child_name, child)

    yield from visit("", model)


def iter_weight_modules(model: nn.Module, overrides: dict[str, nn.Module] | None = None
                        ) -> Iterator[tuple[str, nn.Module]]:
    for name, module in walk_modules(model, overrides):
        if isinstance(module, (nn.Linear, QuantLinear)):
            yield name, module
        elif isinstance(getattr(module, "weight", None), torch.Tensor) and module.weight.dim() >= 2:
            yield name, module


def _linear_like(module: nn.Module) -> bool:
    """An nn.Linear, or a layer that computes as one without subclassing it (ComfyUI's mixed-precision Linear,
    which UNETLoader builds for every layer of a file with comfy_quant markers)."""
    if isinstance(module, nn.Linear):
        return True
    weight, ins, outs = (getattr(module, a, None) for a in ("weight", "in_features", "out_features"))
    return (isinstance(ins, int) and isinstance(outs, int) and isinstance(weight, torch.Tensor)
            and tuple(weight.shape) == (outs, ins))


def decide_modules(model: nn.Module, config: QuantConfig) -> list[ModuleDecision]:
    """Decide, for every weight-bearing module, a method or a reason to keep it."""
    dominant = _dominant_dtype(model, config.overrides)
    decisions = []
    for name, module in iter_weight_modules(model, config.overrides):
        if name in config.keep:  # before the module checks: a kept module of any kind is recorded as kept
            decisions.append(ModuleDecision(name, module, None, config.keep[name], linear=_linear_like(module)))
            continue
        fmt = fp8_format(module)
        if fmt is None and not isinstance(module, QuantLinear) and not _linear_like(module):
            decisions.append(ModuleDecision(name, module, None, f"not Linear-like ({type(module).__name__})",
                                            linear=False))
            continue
        layer = _layer(name, module, fmt, dominant)
        decision = decide(config, layer, dominant)
        redone = layer.fp8 and decision.method is not None
        decisions.append(ModuleDecision(name, module, decision.method, decision.reason, True, layer.stored,
                                        layer.fp8, layer.compute_dtype if redone else None))
    return decisions


def _layer(name: str, module: nn.Module, fp8: str | None, dominant: torch.dtype | None) -> Layer:
    """What `decide` reads of a module: an FP8 layer (before the Linear check: upstream's mixed-precision
    Linear is no nn.Linear), a QuantLinear, a Linear with someone's quantized weight, or a float Linear."""
    ins, outs, weight = module.in_features, module.out_features, module.weight
    if fp8 is not None:
        compute = module.compute_dtype if isinstance(module, QuantLinear) else dominant or torch.bfloat16
        return Layer(name, ins, outs, weight.dtype, compute, stored=fp8, fp8=True)
    if isinstance(module, QuantLinear):
        return Layer(name, ins, outs, module.compute_dtype, stored=module.method.name)
    if _is_quantized_weight(weight):
        return Layer(name, ins, outs, weight.dtype, stored=_format_of(weight))
    return Layer(name, ins, outs, weight.dtype)


def quantize_linear(module: nn.Module, method: LinearMethod, device: torch.device,
                    compute_dtype: torch.dtype | None = None) -> QuantLinear:
    """Quantize one layer on `device` into a QuantLinear that lives where the weight lived.

    A full-precision Linear computes in its weight's dtype; an FP8 layer (fp8_format) is dequantized
    first and computes in `compute_dtype`. `module` itself is never modified.
    """
    home = module.weight.device
    bias = None if module.bias is None else module.bias.detach()
    if compute_dtype is None:
        weight, compute_dtype = module.weight.detach(), module.weight.dtype
    else:
        weight = dequantized_weight(module, device)
        bias = None if bias is None else bias.to(compute_dtype)
    return quantized_layer(method, weight, module.in_features, module.out_features, bias, compute_dtype, device, home)


def quantize_layers(model: nn.Module, config: QuantConfig,
                    progress: Callable[[int, int], None] | None = None,
                    title: str = "quantization") -> tuple[dict[str, nn.Module], QuantReport]:
    """Quantize every planned layer, one at a time; returns (replacements, report).

    Only one layer's weight is on the compute device at a time. Raises
    QuantizationError naming the layer if any layer fails; nothing is installed.
    """
    plans = decide_modules(model, config)
    device = config.device()
    todo = [p for p in plans if p.method is not None]
    replacements: dict[str, nn.Module] = {}
    report = QuantReport(title=title)
    done = 0
    for plan in plans:
        before = parameter_bytes(plan.module)
        if plan.method is None:
            report.records.append(LayerRecord(plan.name, plan.existing_format, plan.reason, before, before,
                                              plan.linear, earlier=plan.existing_format is not None))
            continue
        try:
            new = quantize_linear(plan.module, plan.method, device, plan.compute_dtype)
        except Exception as exc:
            raise QuantizationError(f"quantizing layer {plan.name!r} with {plan.method.describe()} failed: {exc}") from exc
        replacements[plan.name] = new
        report.records.append(LayerRecord(plan.name, plan.method.name, plan.reason, before, parameter_bytes(new)))
        done += 1
        if progress is not None:
            progress(done, len(todo))
    report.notes.extend(_fp8_notes(plans, config))
    log.info("%s: %s, %s -> %s", title, report.summary_line(),
             format_gib(report.bytes_before(), ".3f"), format_gib(report.bytes_after(), ".3f"))
    return replacements, report


def _fp8_notes(plans: list[ModuleDecision], config: QuantConfig) -> list[str]:
    """What the pass did with the FP8 layers it found, in plain words."""
    fp8 = [p for p in plans if p.fp8]
    redone = [p for p in fp8 if p.method is not None]
    kept = len(fp8) - len(redone)
    notes = []
    if redone:
        formats = ", ".join(sorted({p.method.name for p in redone}))
        notes.append(f"re-quantized {len(redone)} fp8 layers to {formats}")
    if kept:
        notes.append(f"kept {kept} fp8 layers as they were" + ("" if config.requantize_fp8 else
                                                                " (requantize_fp8 is off)"))
    return notes


def apply_replacements(model: nn.Module, replacements: dict[str, nn.Module]) -> dict[str, nn.Module]:
    """Install replacement modules in place; returns the modules they replaced."""
    previous = {}
    for name, new in replacements.items():
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        previous[name] = getattr(parent, child)
        setattr(parent, child, new)
    return previous
