"""Per-layer dispatch: which method each Linear gets, and the layer-by-layer pass.

The pass never mutates the model: it returns replacement modules, so a caller
can install them on a clone (ComfyUI object patches) or in place, and a
failure half-way leaves the model exactly as it was.
"""
from __future__ import annotations

import copy
import logging
from collections import Counter
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Iterator

import torch
from torch import nn

from .kitchen_api import is_quantized_tensor, layout_name, tensor_bytes
from .linear import QuantLinear
from .method import LinearMethod
from .patterns import first_match
from .report import LayerRecord, QuantReport

if TYPE_CHECKING:
    from .auto import AutoSelector

log = logging.getLogger(__name__)

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


class QuantizationError(RuntimeError):
    """A layer could not be quantized; names the layer. The model is unchanged."""


@dataclass
class QuantConfig:
    """What to quantize and how.

    `method` is the default (a LinearMethod, or a selector with
    `select(in, out) -> (method or None, reason)` such as auto); `rules` maps fnmatch patterns on module names to a
    method (or None to keep the layer), first match wins; `ignored` patterns
    keep layers as they are. fp32 weights in a lower-precision model are kept
    unless `include_fp32`.
    """
    method: "LinearMethod | AutoSelector"
    rules: list[tuple[str, LinearMethod | None]] = field(default_factory=list)
    ignored: tuple[str, ...] = ()
    include_fp32: bool = False
    compute_device: torch.device | None = None
    keep: dict[str, str] = field(default_factory=dict)  # module name -> reason to keep it as is
    # Modules that stand in for the tree's at run time (ComfyUI object patches).
    overrides: dict[str, nn.Module] = field(default_factory=dict)
    # "module": replace layers with QuantLinear. "kitchen": where the method has a
    # comfy-kitchen layout, keep the layer's own class and give it a
    # QuantizedTensor weight (what upstream ComfyUI runs natively).
    representation: str = "module"

    def device(self) -> torch.device:
        if self.compute_device is not None:
            return self.compute_device
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")


@dataclass
class LayerPlan:
    name: str
    module: nn.Module
    method: LinearMethod | None
    reason: str
    linear: bool = True
    existing_format: str | None = None  # a layer someone else already quantized


def _weight_bytes(module: nn.Module) -> int:
    return sum(tensor_bytes(p) for p in module.parameters(recurse=False))


def _is_quantized_weight(weight: torch.Tensor) -> bool:
    # Upstream ComfyUI loads quantized checkpoints as QuantizedTensor weights;
    # any non-float storage is already someone's quantized format.
    return is_quantized_tensor(weight) or weight.dtype not in FLOAT_DTYPES


def _dominant_dtype(model: nn.Module) -> torch.dtype | None:
    counts: Counter = Counter()
    for module in model.modules():
        if isinstance(module, QuantLinear):
            counts[module.compute_dtype] += module.in_features * module.out_features
        elif isinstance(module, nn.Linear) and module.weight is not None and module.weight.dtype in FLOAT_DTYPES:
            counts[module.weight.dtype] += module.weight.numel()
    return counts.most_common(1)[0][0] if counts else None


def iter_weight_modules(model: nn.Module) -> Iterator[tuple[str, nn.Module]]:
    for name, module in model.named_modules():
        if isinstance(module, (nn.Linear, QuantLinear)):
            yield name, module
        elif isinstance(getattr(module, "weight", None), torch.Tensor) and module.weight.dim() >= 2:
            yield name, module


def choose_method(config: QuantConfig, name: str, dtype: torch.dtype, in_features: int, out_features: int,
                  dominant: torch.dtype | None) -> tuple[LinearMethod | None, str]:
    """The method for a full-precision Linear, or None and why it stays as it is.

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
    if hasattr(method, "select"):  # a selector (auto) chooses per shape
        method, reason = method.select(in_features, out_features)
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


def plan_layers(model: nn.Module, config: QuantConfig) -> list[LayerPlan]:
    """Decide, for every weight-bearing module, a method or a reason to keep it."""
    dominant = _dominant_dtype(model)
    plans = []
    for name, module in iter_weight_modules(model):
        module = config.overrides.get(name, module)
        if name in config.keep:
            plans.append(LayerPlan(name, module, None, config.keep[name], linear=isinstance(module, nn.Linear)))
            continue
        if isinstance(module, QuantLinear):
            plans.append(LayerPlan(name, module, module.method, "already quantized"))
            continue
        if not isinstance(module, nn.Linear):
            plans.append(LayerPlan(name, module, None, f"not Linear-like ({type(module).__name__})", linear=False))
            continue
        weight = module.weight
        if _is_quantized_weight(weight):
            fmt = layout_name(weight) if is_quantized_tensor(weight) else str(weight.dtype).replace("torch.", "")
            plans.append(LayerPlan(name, module, None, "already quantized", existing_format=fmt))
            continue
        method, reason = choose_method(config, name, weight.dtype, module.in_features, module.out_features, dominant)
        plans.append(LayerPlan(name, module, method, reason))
    return plans


def quantize_linear(module: nn.Linear, method: LinearMethod, device: torch.device,
                    representation: str = "module") -> nn.Module:
    """Quantize one layer on `device`; the result lives where the weight lived.

    Returns a QuantLinear, or with representation "kitchen" (where the method
    has a comfy-kitchen layout) a shallow copy of `module` whose weight is a
    QuantizedTensor. `module` itself is never modified.
    """
    weight = module.weight.detach()
    home = weight.device
    with torch.no_grad():
        tensors = method.quantize_weight(weight.to(device))
    tensors = {k: v.to(home) for k, v in tensors.items()}
    if representation == "kitchen":
        kitchen = method.kitchen_weight(tensors, weight.dtype)
        if kitchen is not None:
            clone = copy.copy(module)
            clone._parameters = dict(module._parameters)
            clone.weight = nn.Parameter(kitchen, requires_grad=False)
            return clone
    bias = None if module.bias is None else module.bias.detach()
    return QuantLinear(method, module.in_features, module.out_features, tensors, bias, compute_dtype=weight.dtype)


def quantize_layers(model: nn.Module, config: QuantConfig,
                    progress: Callable[[int, int], None] | None = None,
                    title: str = "quantization") -> tuple[dict[str, nn.Module], QuantReport]:
    """Quantize every planned layer, one at a time; returns (replacements, report).

    Only one layer's weight is on the compute device at a time. Raises
    QuantizationError naming the layer if any layer fails; nothing is installed.
    """
    plans = plan_layers(model, config)
    device = config.device()
    todo = [p for p in plans if p.method is not None and not isinstance(p.module, QuantLinear)]
    replacements: dict[str, nn.Module] = {}
    report = QuantReport(title=title)
    done = 0
    for plan in plans:
        before = _weight_bytes(plan.module)
        if plan.method is None or isinstance(plan.module, QuantLinear):
            fmt = plan.method.name if plan.method is not None else plan.existing_format
            report.records.append(LayerRecord(plan.name, fmt, plan.reason, before, before, plan.linear))
            continue
        try:
            new = quantize_linear(plan.module, plan.method, device, config.representation)
        except Exception as exc:
            raise QuantizationError(f"quantizing layer {plan.name!r} with {plan.method.describe()} failed: {exc}") from exc
        replacements[plan.name] = new
        report.records.append(LayerRecord(plan.name, plan.method.name, plan.reason, before, _weight_bytes(new)))
        done += 1
        if progress is not None:
            progress(done, len(todo))
    log.info("%s: %s, %.3f -> %.3f GiB", title, report.summary_line(),
             report.bytes_before() / 1024 ** 3, report.bytes_after() / 1024 ** 3)
    return replacements, report


def apply_replacements(model: nn.Module, replacements: dict[str, nn.Module]) -> dict[str, nn.Module]:
    """Install replacement modules in place; returns the modules they replaced."""
    previous = {}
    for name, new in replacements.items():
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        previous[name] = getattr(parent, child)
        setattr(parent, child, new)
    return previous
