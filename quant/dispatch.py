"""Per-layer dispatch: which method each Linear gets, and the layer-by-layer pass.

The pass never mutates the model: it returns replacement modules, so a caller
can install them on a clone (ComfyUI object patches) or in place, and a
failure half-way leaves the model exactly as it was.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Callable, Iterator

import torch
from torch import nn

from ..dtypes import FLOAT_DTYPES, dtype_name
from ..pack_logging import pack_logger
from ..units import format_gib
from . import fp8, int8_convrot
from .kitchen_api import is_quantized_tensor, layout_name, layout_params, storage_dtype, tensor_bytes
from .linear import QuantLinear, quantized_layer
from .linear_method import LinearMethod, default_device
from .patterns import first_match
from .report import LayerRecord, QuantReport
from .selector import Selector

log = pack_logger(__name__)


class QuantizationError(RuntimeError):
    """A layer could not be quantized; names the layer. The model is unchanged."""


@dataclass
class QuantConfig:
    """What to quantize and how.

    `method` is the default (a LinearMethod, or a Selector such as auto, which
    picks one per layer shape); `rules` maps fnmatch patterns on module names to a
    method (or None to keep the layer), first match wins; `ignored` patterns
    keep layers as they are. fp32 weights in a lower-precision model are kept
    unless `include_fp32`.
    """
    method: LinearMethod | Selector
    rules: list[tuple[str, LinearMethod | None]] = field(default_factory=list)
    ignored: tuple[str, ...] = ()
    include_fp32: bool = False
    compute_device: torch.device | None = None
    keep: dict[str, str] = field(default_factory=dict)  # module name -> reason to keep it as is
    # FP8 layers (fp8_format) are dequantized and quantized with `method`, instead of kept as they are.
    requantize_fp8: bool = False
    # Modules that stand in for the tree's at run time (ComfyUI object patches).
    overrides: dict[str, nn.Module] = field(default_factory=dict)

    def device(self) -> torch.device:
        if self.compute_device is not None:
            return self.compute_device
        return default_device()


@dataclass
class LayerPlan:
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
    if layout_name(weight).startswith("TensorCoreFP8"):
        return dtype_name(storage_dtype(weight))
    if layout_name(weight) == int8_convrot.LAYOUT:
        return int8_convrot.format_of_params(layout_params(weight))
    return layout_name(weight)


FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)


def fp8_format(module: nn.Module) -> str | None:
    """The format of a layer quantized to FP8 before (the pack's FP8 layers, a ComfyUI Linear with an fp8
    weight dtype, scaled or not, or with upstream's FP8 QuantizedTensor weight), else None."""
    if isinstance(module, QuantLinear):
        return module.method.name if module.method.name == fp8.NAME else None
    weight = getattr(module, "weight", None)
    if not isinstance(weight, torch.Tensor):
        return None
    if is_quantized_tensor(weight):
        return _format_of(weight) if layout_name(weight).startswith("TensorCoreFP8") else None
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


def walk_modules(model: nn.Module, overrides: dict[str, nn.Module] | None = None
                 ) -> Iterator[tuple[str, nn.Module]]:
    """(name, module) like `named_modules`, where an override stands in for the module at its name,
    children included: the tree as it will run, not as it is now."""
    overrides = overrides or {}
    seen: set[int] = set()

    def visit(name: str, module: nn.Module):
        module = overrides.get(name, module)
        if module is None or id(module) in seen:
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


def choose_method(config: QuantConfig, name: str, dtype: torch.dtype, in_features: int, out_features: int,
                  dominant: torch.dtype | None, compute_dtype: torch.dtype | None = None
                  ) -> tuple[LinearMethod | None, str]:
    """The method for a full-precision Linear, or None and why it stays as it is.

    `dtype` is the weight's as stored; `compute_dtype` the one its QuantLinear
    would compute in (what a selector measures in), the stored one by default.
    In order: ignored patterns, fp32 kept on purpose (in a model of another
    dtype), the default method or the selector's choice (auto), the first
    matching rule, then the method's own shape check.
    """
    pattern = first_match(name, config.ignored)
    if pattern is not None:
        return None, f"ignored (matches {pattern!r})"
    if dtype == torch.float32 and dominant not in (None, torch.float32) and not config.include_fp32:
        return None, "stored in fp32 on purpose"
    method, reason = config.method, None
    if isinstance(method, Selector):  # auto chooses per shape
        method, reason = method.select(in_features, out_features, compute_dtype or dtype)
        if method is None:
            return None, reason
    for rule_pattern, rule_method in config.rules:
        if first_match(name, (rule_pattern,)):
            method, reason = rule_method, None
            break
    if method is None:
        return None, "kept by rule"
    why_not = method.skip_reason(in_features, out_features)
    if why_not is not None:
        return None, why_not
    return method, reason or method.describe()


def decide(config: QuantConfig, name: str, dtype: torch.dtype, in_features: int, out_features: int,
           dominant: torch.dtype, compute_dtype: torch.dtype | None = None) -> tuple[LinearMethod | None, str]:
    """The one decision for a Linear from its name, weight dtype and shape (and the dtype it will compute in,
    the stored one by default): kept on purpose (`config.keep`), already quantized, or `choose_method`'s.
    plan_layers (a model's modules) and loading (a file's header, then the tensor ComfyUI hands over) call it."""
    if name in config.keep:
        return None, config.keep[name]
    if dtype not in FLOAT_DTYPES:
        return None, f"already quantized ({dtype_name(dtype)})"
    return choose_method(config, name, dtype, in_features, out_features, dominant, compute_dtype)


def plan_layers(model: nn.Module, config: QuantConfig) -> list[LayerPlan]:
    """Decide, for every weight-bearing module, a method or a reason to keep it."""
    dominant = _dominant_dtype(model, config.overrides)
    plans = []
    for name, module in iter_weight_modules(model, config.overrides):
        if name in config.keep:  # before the module checks: a kept module of any kind is recorded as kept
            plans.append(LayerPlan(name, module, None, config.keep[name], linear=_linear_like(module)))
            continue
        fmt = fp8_format(module)
        if fmt is not None:  # before the Linear check: upstream's mixed-precision Linear is no nn.Linear
            plans.append(_fp8_plan(config, name, module, fmt, dominant) if config.requantize_fp8 else
                         LayerPlan(name, module, None, "already quantized", existing_format=fmt, fp8=True))
            continue
        if isinstance(module, QuantLinear):
            plans.append(LayerPlan(name, module, None, "already quantized", existing_format=module.method.name))
            continue
        if not _linear_like(module):
            plans.append(LayerPlan(name, module, None, f"not Linear-like ({type(module).__name__})", linear=False))
            continue
        weight = module.weight
        if _is_quantized_weight(weight):
            plans.append(LayerPlan(name, module, None, "already quantized", existing_format=_format_of(weight)))
            continue
        method, reason = decide(config, name, weight.dtype, module.in_features, module.out_features, dominant)
        plans.append(LayerPlan(name, module, method, reason))
    return plans


def _fp8_plan(config: QuantConfig, name: str, module: nn.Module, fmt: str,
              dominant: torch.dtype | None) -> LayerPlan:
    """An FP8 layer (of format `fmt`) under requantize_fp8: `method` where the float rules would choose it,
    else kept as it is."""
    dtype = module.compute_dtype if isinstance(module, QuantLinear) else dominant or torch.bfloat16
    method, reason = choose_method(config, name, torch.float8_e4m3fn, module.in_features, module.out_features,
                                   dominant, dtype)
    if method is None:
        return LayerPlan(name, module, None, reason, existing_format=fmt, fp8=True)
    return LayerPlan(name, module, method, f"re-quantized from {fmt}: {reason}", existing_format=fmt, fp8=True,
                     compute_dtype=dtype)


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
    plans = plan_layers(model, config)
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


def _fp8_notes(plans: list[LayerPlan], config: QuantConfig) -> list[str]:
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
