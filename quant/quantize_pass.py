"""The quantization pass: each module of a model described as a `Layer`, decided (quant/decision.py), then
quantized one at a time.

The pass never mutates the model: it returns replacement modules, so a caller
can install them on a clone (ComfyUI object patches) or in place, and a
failure half-way leaves the model exactly as it was.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Callable, Iterator, Mapping, Protocol

import torch
from torch import nn

from ..dtypes import FLOAT_DTYPES, dtype_name
from ..pack_logging import pack_logger
from ..units import format_gib
from .kitchen_api import is_quantized_tensor, layout_name, layout_params, storage_dtype, tensor_bytes
from .keep import keep_patterns
from .registry import conversion_format, dtype_format, format_spec, get_method, kitchen_format
from .linear import QuantLinear, quantized_layer, requantized_layer
from .decision import QuantConfig, decide
from .descriptor import read_marker
from .layer import CONVERT, KEEP, LOAD, Layer
from .linear_method import LinearMethod
from .kitchen_api import require_kitchen
from .report import QuantReport

log = pack_logger(__name__)


class QuantizationError(RuntimeError):
    """A layer could not be quantized; names the layer. The model is unchanged."""


def parameter_bytes(module: nn.Module) -> int:
    """True bytes of a layer's own parameters (a QuantizedTensor by its packed data)."""
    return sum(tensor_bytes(p) for p in module.parameters(recurse=False))


WeightScale = Callable[[nn.Module], "torch.Tensor | None"]


def _stored_format(module: nn.Module) -> tuple[str | None, str | None]:
    """(the registered format, or a name for an unregistered one; the report's name of it) of a layer someone
    quantized before this pass: a QuantLinear, a comfy-kitchen QuantizedTensor weight, or a weight in a
    non-float dtype (a format that declares that `storage_dtypes` owns it); (None, None) for a float layer."""
    if isinstance(module, QuantLinear):
        return module.method.name, None
    weight = module.weight
    if is_quantized_tensor(weight):
        spec = kitchen_format(layout_name(weight))
        if spec is None:
            return layout_name(weight), None
        return spec.name, spec.weight_format(layout_params(weight), storage_dtype(weight))
    if weight.dtype in FLOAT_DTYPES:
        return None, None
    owner = dtype_format(weight.dtype)
    return (dtype_name(weight.dtype), None) if owner is None else (owner.name, dtype_name(weight.dtype))


def host_stored_weight(module: nn.Module, device: torch.device, weight_scale: WeightScale | None = None
                       ) -> torch.Tensor:
    """The full-precision [out, in] weight of a host's own quantized layer (a comfy-kitchen QuantizedTensor
    weight, or a weight in a plain FP8 dtype times `weight_scale(module)`, the host's per-tensor scale),
    computed on `device`: how requantized_layer dequantizes a layer that is no QuantLinear."""
    weight = module.weight.detach()
    if is_quantized_tensor(weight):
        return weight.dequantize().to(device=device, dtype=torch.float32)
    weight = weight.to(device=device, dtype=torch.float32)
    scale = None if weight_scale is None else weight_scale(module)
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


def _not_adoptable(module: nn.Module) -> str | None:
    """Why a layer quantized before this pass cannot run as the pack's layer of its format holding its own tensors
    (LOAD), or None: only a comfy-kitchen weight names its tensors as a file stores them."""
    if isinstance(module, QuantLinear):
        return "the pack's layer already"
    weight = module.weight
    if not is_quantized_tensor(weight):
        return f"stored as a plain {dtype_name(weight.dtype)} weight"
    if not hasattr(weight, "state_dict"):
        return "ComfyUI's own QuantizedTensor (no comfy-kitchen)"
    spec = kitchen_format(layout_name(weight))
    if spec is None or not spec.marker:
        return f"comfy-kitchen layout {layout_name(weight)} has no marker format"
    if layout_params(weight).get("transposed", False):
        return "its weight is held transposed"
    return None


def _stored_options(module: nn.Module, fmt: str) -> dict:
    """The method options of a comfy-kitchen weight of format `fmt`: its layout params read as the marker it
    would be saved with."""
    spec = format_spec(fmt)
    values, _ = read_marker(spec.marker_params, spec.kitchen_marker(layout_params(module.weight)))
    return spec.marker_options(values, module.in_features)


def module_layers(model: nn.Module, config: QuantConfig, loading: bool = False) -> list[tuple[Layer, nn.Module]]:
    """A `Layer` for every weight-bearing module of the tree as it will run, with the module, decided.
    `loading`: a layer quantized before becomes the pack's layer of its format holding its own tensors (LOAD)
    where it can (see `_not_adoptable`), as a loader builds a file's stored layer."""
    dominant = _dominant_dtype(model, config.overrides)
    found = []
    for name, module in iter_weight_modules(model, config.overrides):
        linear = isinstance(module, QuantLinear) or _linear_like(module)
        stored, label = _stored_format(module) if linear or name not in config.keep else (None, None)
        unadoptable = _not_adoptable(module) if loading and stored is not None and name not in config.keep else None
        if name in config.keep or unadoptable or (stored is None and not linear):
            shape = tuple(module.weight.shape)
            layer = Layer(name, shape[-1], shape[0], module.weight.dtype, linear=linear,
                          stored=stored if unadoptable else None, stored_label=label if unadoptable else None)
            reason = config.keep.get(name) or unadoptable or f"not Linear-like ({type(module).__name__})"
            found.append((layer.decided(KEEP, None, reason), module))
            continue
        compute = module.compute_dtype if isinstance(module, QuantLinear) else None
        if stored is not None and compute is None:  # re-quantized, it computes in the model's dtype
            compute = dominant or torch.bfloat16
        options = _stored_options(module, stored) if loading and stored is not None else {}
        layer = Layer(name, module.in_features, module.out_features, module.weight.dtype, compute, stored,
                      options=options, stored_label=label)
        found.append((decide(config, layer, dominant, loading=loading), module))
    return found


def quantize_linear(module: nn.Module, method: LinearMethod, device: torch.device,
                    compute_dtype: torch.dtype | None = None, layer_type: type[QuantLinear] | None = None,
                    weight_scale: WeightScale | None = None) -> QuantLinear:
    """Quantize one layer on `device` into a QuantLinear that lives where the weight lived.

    A full-precision Linear computes in its weight's dtype; a layer quantized before (`compute_dtype` given)
    is converted by requantized_layer (a host's own layer dequantized by host_stored_weight) and computes in
    `compute_dtype`. `module` itself is never modified.
    """
    home = module.weight.device
    if compute_dtype is not None:
        return requantized_layer(module, method, device, home, layer_type=layer_type, compute_dtype=compute_dtype,
                                 dequantize=lambda m, d: host_stored_weight(m, d, weight_scale))
    bias = None if module.bias is None else module.bias.detach()
    return quantized_layer(method, module.weight.detach(), module.in_features, module.out_features, bias,
                           module.weight.dtype, device, home, layer_type=layer_type)


def stored_layer(module: nn.Module, layer: Layer, layer_type: type[QuantLinear] | None = None) -> QuantLinear:
    """A comfy-kitchen layer as the pack's layer of its own format (LOAD), holding the very tensors it holds: the
    weight's data and scales as a file names them, and its bias. Nothing is copied."""
    tensors = dict(module.weight.state_dict("weight"))
    bias = None if module.bias is None else module.bias.detach()
    return (layer_type or QuantLinear)(layer.method, layer.in_features, layer.out_features, tensors, bias,
                                       layer.compute_dtype)


def quantize_layers(model: nn.Module, config: QuantConfig,
                    progress: Callable[[int, int], None] | None = None,
                    title: str = "quantization", layer_type: type[QuantLinear] | None = None,
                    weight_scale: WeightScale | None = None,
                    loading: bool = False) -> tuple[dict[str, nn.Module], QuantReport]:
    """Quantize every layer the decision quantizes or converts, one at a time, and build those it loads as stored
    (`loading`, see module_layers); returns (replacements, report).

    Only one layer's weight is on the compute device at a time. Raises
    QuantizationError naming the layer if any layer fails; nothing is installed.
    `layer_type`: the QuantLinear subclass to build (a host's); `weight_scale`: see host_stored_weight.
    """
    found = module_layers(model, config, loading)
    device = config.device()
    todo = sum(layer.action != KEEP for layer, _ in found)
    replacements: dict[str, nn.Module] = {}
    report = QuantReport(title=title)
    done = 0
    for layer, module in found:
        layer.bytes_before = layer.bytes_after = parameter_bytes(module)
        report.records.append(layer)
        if layer.action == KEEP:
            continue
        try:
            if layer.action == LOAD:
                new = stored_layer(module, layer, layer_type)
            else:
                new = quantize_linear(module, layer.method, device, layer.compute_dtype if layer.stored else None,
                                      layer_type, weight_scale)
        except Exception as exc:
            raise QuantizationError(f"quantizing layer {layer.name!r} with {layer.method.describe()} failed: "
                                    f"{exc}") from exc
        replacements[layer.name] = new
        layer.bytes_after = parameter_bytes(new)
        done += 1
        if progress is not None:
            progress(done, todo)
    report.notes.extend(conversion_notes([layer for layer, _ in found], config))
    log.info("%s: %s, %s -> %s", title, report.summary_line(),
             format_gib(report.bytes_before(), ".3f"), format_gib(report.bytes_after(), ".3f"))
    return replacements, report


def conversion_notes(layers: list[Layer], config: QuantConfig) -> list[str]:
    """What the pass did with the layers that came in a stored format, in the format's own words."""
    notes = []
    for fmt in sorted({layer.stored for layer in layers if layer.stored is not None}):
        spec = format_spec(fmt)
        if spec is not None:
            mine = [layer for layer in layers if layer.stored == fmt and layer.linear]
            notes.extend(spec.conversion_note([layer for layer in mine if layer.action == CONVERT],
                                              sum(layer.action != CONVERT for layer in mine),
                                              config.conversions.get(fmt)))
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


def stored_conversions(options: tuple[tuple[str, str], ...]) -> dict[str, str]:
    """{format: mode} of a loader's conversion inputs; ValueError naming the input for a mode its format lacks."""
    conversions = {}
    for option, mode in options:
        spec = conversion_format(option)
        if mode not in spec.conversion_modes:
            raise ValueError(f"{option} must be one of {', '.join(spec.conversion_modes)}, got {mode!r}")
        conversions[spec.name] = mode
    return conversions


def online_method(name: str, group_size: int, device, **options):
    """The registered method for a quantizing node's choice (get_method names the valid ones for any other),
    or a clear error if its comfy-kitchen lacks what it needs."""
    method = get_method(name, group_size=group_size, device=device, **options)
    lacking = method.missing() if isinstance(method, LinearMethod) else None
    if lacking is not None:
        raise ValueError(f"quantization {name!r} needs {lacking}")
    return method



@dataclass(frozen=True)
class QuantizeOptions:
    """What QuantizeModelINT8 asks for: the online format, its group size and row split, the layers it keeps
    (patterns, beside the architecture's), and its conversions of layers quantized before (by input name)."""
    quantization: str
    group_size: int = 256
    ignored_layers: str = ""
    row_split: str = "auto"
    conversions: tuple[tuple[str, str], ...] = ()


class ModelHost(Protocol):
    """What quantizing a live model needs of its host."""
    #: The QuantLinear subclass the host's model runs.
    layer_type: type[QuantLinear]

    def progress(self) -> Callable[[int, int], None]:
        """Reports (done, total) layers on the host's progress bar."""

    def weight_scale(self, module: nn.Module) -> "torch.Tensor | None":
        """The host's own per-tensor scale of a weight it stores in a plain FP8 dtype, if any."""


def quantize_model(root: nn.Module, overrides: dict[str, nn.Module], options: QuantizeOptions,
                   device: torch.device, host: ModelHost, keep: dict[str, str] | None = None,
                   title: str = "quantization") -> tuple[dict[str, nn.Module], QuantReport]:
    """QuantizeModelINT8's pass over the module tree as it will run (`root` with `overrides`): the
    architecture's keep patterns from the module names, then the user's, `keep` (layers the host must leave
    as they are, with reasons), then quantize_layers. Returns (replacements, report); the model is unchanged."""
    require_kitchen(title)
    names = (name for name, _ in walk_modules(root, overrides))
    config = QuantConfig(
        method=online_method(options.quantization, options.group_size, device, row_split=options.row_split),
        ignored=keep_patterns(names, options.ignored_layers), compute_device=device,
        conversions=stored_conversions(options.conversions), overrides=overrides, keep=dict(keep or {}))
    return quantize_layers(root, config, progress=host.progress(), title=title, layer_type=host.layer_type,
                           weight_scale=host.weight_scale)


def adopt_stored(root: nn.Module, overrides: dict[str, nn.Module], host: ModelHost,
                 title: str = "stored layers") -> tuple[dict[str, nn.Module], QuantReport]:
    """The layers of a live model that a file stored quantized (ComfyUI's comfy-kitchen layers), as the host's
    QuantLinear of their own format holding their own tensors (LOAD), so that the pack's kernels run them; every
    other layer stays as it is, nothing is quantized. Returns (replacements, report); the model is unchanged."""
    require_kitchen(title)
    return quantize_layers(root, QuantConfig(method=None, overrides=overrides), title=title,
                           layer_type=host.layer_type, loading=True)
