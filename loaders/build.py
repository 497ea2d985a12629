"""Builds a model's Linear layers one at a time while the model is being loaded.

Every layer is decided before the model exists: the checkpoint's quantized
layers by the CheckpointContents (markers, Quanto entries), and, when an online
QuantConfig is given, each plain weight by `decide_online`, from the header's
names, dtypes and shapes. A model loader then calls `LayerBuilder.build(name, ...)`
for every Linear as its weights arrive, which carries out those decisions: the layer is
built from the checkpoint's tensors, or its plain weight is quantized right
there, or None tells the loader to keep the plain layer. Only one layer's
full-precision weight is on the compute device at a time, and a plain weight
the file maps lazily is read once.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, replace
from typing import Callable

import torch

from ..dtypes import torch_dtype
from ..hardware import cuda_capability
from ..quant.decision import Layer, QuantConfig, decide
from ..quant.fit import FitLayer, fit_layers
from ..quant.linear import QuantLinear, quantized_layer
from ..quant.descriptor import PRE_QUANT_SCALE
from ..quant.linear_method import LinearMethod
from ..quant.quantize_pass import parameter_bytes
from ..quant.registry import available_methods, get_method
from ..quant.report import LayerRecord, QuantReport
from ..quant.selector import Selector
from ..units import format_gib
from .checkpoint import CheckpointContents, TensorSource
from .errors import CheckpointError
from .host_memory import trim_heap
from .staging import PinnedStaging

NVFP4_MODES = ("auto", "requantize")


@dataclass(frozen=True)
class OnlineLayer:
    """What loading does with one plain weight of the file, decided from its header entry."""
    dtype: torch.dtype
    shape: tuple[int, ...]                  # [out, in]
    method: LinearMethod | None             # None: kept as stored
    reason: str


def decide_online(contents: CheckpointContents, config: QuantConfig) -> dict[str, OnlineLayer]:
    """The decision for every plain matrix `<name>.weight` of the file, by module name, before any model exists."""
    dominant = contents.proxy_dtype()
    layers = {}
    for key, file_key in contents.plain_keys.items():
        info = contents.header.tensors[file_key]
        if not key.endswith(".weight") or len(info.shape) != 2:
            continue
        name, dtype, (out_features, in_features) = key[:-len(".weight")], torch_dtype(info.dtype), info.shape
        decision = decide(config, Layer(name, in_features, out_features, dtype), dominant)
        layers[name] = OnlineLayer(dtype, info.shape, decision.method, decision.reason)
    return layers


class LayerBuilder:
    def __init__(self, contents: CheckpointContents, source: TensorSource, device: torch.device, *,
                 online: QuantConfig | None = None, nvfp4: str = "auto", title: str = "load",
                 progress: Callable[[], None] | None = None):
        if nvfp4 not in NVFP4_MODES:
            raise ValueError(f"nvfp4 must be one of {NVFP4_MODES}, got {nvfp4!r}")
        self.contents, self.source, self.device = contents, source, torch.device(device)
        self.online, self.nvfp4, self.progress = online, nvfp4, progress
        self.report = QuantReport(title=title)
        self.report.notes.extend(contents.describe())
        self.consumed: set[str] = set()
        self._dominant = contents.proxy_dtype()
        self._methods: dict[tuple, LinearMethod] = {}
        self._paths: dict[str, dict[str, int]] = {}
        self._online_counts: dict[str, int] = {}
        # the decisions' config: loading's device, and NVFP4's mode
        self.config = replace(online or QuantConfig(method=None), compute_device=self.device,
                              requantize_blocks=nvfp4 == "requantize")
        self.online_plan = {} if online is None else decide_online(contents, self.config)
        self._fitted: set[str] = set()
        if online is not None and online.fit_bytes:
            self._fit(online)
        largest = max((layer.dtype.itemsize * layer.shape[0] * layer.shape[1]
                       for layer in self.online_plan.values() if layer.method is not None), default=0)
        self.staging = PinnedStaging(self.device, largest)
        self._quantize_seconds = 0.0

    def _fit(self, online: QuantConfig) -> None:
        """Move the largest quantized layers to a fit format until the Linear weights take at most
        `online.fit_bytes` (quant/fit.py); the report says what moved."""
        layers = {name: FitLayer(layer.shape[1], layer.shape[0], layer.dtype.itemsize * layer.shape[0] *
                                 layer.shape[1], layer.method) for name, layer in self.online_plan.items()}
        fit = fit_layers(layers, online.fit_bytes, list(online.fit_targets))
        for name, method in fit.moved.items():
            self.online_plan[name] = replace(self.online_plan[name], method=method,
                                             reason=f"moved to fit: {method.describe()}")
        self._fitted = set(fit.moved)
        self.report.notes.append(fit.note())

    # -- before building -------------------------------------------------------
    def resolve_methods(self) -> None:
        """Every format the checkpoint uses must have a method here; checked before any model exists."""
        missing = [name for name, layer in self.contents.layers.items()
                   if layer.format not in available_methods()]  # a file's format names its method
        if missing:
            formats = sorted({self.contents.layers[n].format for n in missing})
            raise CheckpointError(self.contents.path, f"format(s) {', '.join(formats)} not available in this build", missing)
        lacking: dict[str, list[str]] = {}
        for name, layer in self.contents.layers.items():
            reason = self._method(layer.format, layer.options).missing()
            if reason is not None:
                lacking.setdefault(f"{layer.format} layers need {reason}", []).append(name)
        for problem, layers in lacking.items():
            raise CheckpointError(self.contents.path, problem, layers)

    def _method(self, fmt: str, options: dict) -> LinearMethod:
        key = (fmt, tuple(sorted(options.items())))
        if key not in self._methods:
            self._methods[key] = get_method(fmt, **options)
        return self._methods[key]

    # -- per layer ---------------------------------------------------------------
    def build(self, name: str, weight: torch.Tensor | None, in_features: int, out_features: int,
              bias: torch.Tensor | None, compute_dtype: torch.dtype, home: torch.device | None) -> QuantLinear | None:
        """The module for Linear `name`, or None to keep the plain layer (its record is kept either way)."""
        home = torch.device("cpu") if home is None else torch.device(home)
        plain_bytes = (in_features + (bias is not None)) * out_features * compute_dtype.itemsize
        file_bias = bias
        if bias is not None:
            bias = bias.to(device=home, dtype=compute_dtype, copy=self.source.mark is None)
        if name in self.contents.layers:
            built = self._from_checkpoint(name, in_features, out_features, bias, compute_dtype, home, plain_bytes)
            self.source.file_map.release(*(self.source(key) for key in self.contents.layers[name].tensors.values()))
        elif self.online is not None and weight is not None:
            built = self._online(name, weight, in_features, out_features, bias, compute_dtype, home, plain_bytes)
        else:
            why = "not quantized in the checkpoint" if weight is not None else "no weight in the checkpoint"
            self.report.records.append(LayerRecord(name, None, why, plain_bytes, plain_bytes))
            built = None
        if built is not None:  # consumed: its pages of the file go back (a plain layer's go once loaded)
            self.source.file_map.release(weight, file_bias)
        if self.progress is not None:
            self.progress()
        return built

    def _from_checkpoint(self, name, in_features, out_features, bias, compute_dtype, home, plain_bytes):
        layer = self.contents.layers[name]
        why_not = layer.mismatch(in_features, out_features)
        if why_not is not None:
            raise CheckpointError(self.contents.path, f"shape mismatch: {why_not}", [name])
        method = self._method(layer.format, layer.options)
        tensors = self.contents.layer_tensors(self.source, name)
        decision = decide(self.config, Layer(name, in_features, out_features, compute_dtype, stored=layer.format),
                          self._dominant)
        reason, target = f"{layer.format} from the checkpoint", decision.method
        if decision.path is not None:  # a block format: how it runs here
            paths = self._paths.setdefault(layer.format, {})
            paths[decision.path] = paths.get(decision.path, 0) + 1
            reason = f"{layer.format} {'in' if target else 'from'} the checkpoint, {decision.brief}"
        if target is None:  # kept as stored: copied out of the map, unless the host pages them from the file
            tensors = {k: v.to(device=home, copy=self.source.mark is None) for k, v in tensors.items()}
            built = QuantLinear(method, in_features, out_features, tensors, bias, compute_dtype)
        else:
            on_device = {k: v.to(self.device) for k, v in tensors.items()}
            stand_in = QuantLinear(method, in_features, out_features, on_device, None, compute_dtype)
            with torch.no_grad():
                weight = method.dequantize(stand_in)
                pre_scale = on_device.get(PRE_QUANT_SCALE)
                if pre_scale is not None:   # folded into the weight: the new layer has no input scale
                    weight = weight * pre_scale.to(weight.dtype)
            built = quantized_layer(target, weight, in_features, out_features, bias, compute_dtype, self.device, home)
        self.consumed.add(name)
        self.report.records.append(LayerRecord(name, built.method.name, reason, plain_bytes,
                                               parameter_bytes(built)))
        return built

    def _online(self, name, weight, in_features, out_features, bias, compute_dtype, home, plain_bytes):
        planned = self.online_plan.get(name)
        if planned is not None and name in self._fitted and planned.shape == (out_features, in_features):
            method, reason = planned.method, planned.reason  # moved to fit: auto's choice in any dtype was 8-bit
        elif (planned is not None and planned.dtype == weight.dtype and planned.shape == (out_features, in_features)
                and (planned.dtype == compute_dtype or not isinstance(self.online.method, Selector))):
            method, reason = planned.method, planned.reason
        else:  # ComfyUI renamed, split or converted this key (diffusers files, HunyuanVideo): the header could not
            # say; or it computes in another dtype than the file's, the one auto must measure in
            decision = decide(self.config, Layer(name, in_features, out_features, weight.dtype, compute_dtype),
                              self._dominant)
            method, reason = decision.method, decision.reason
        if method is None:
            self.report.records.append(LayerRecord(name, None, reason, plain_bytes, plain_bytes))
            return None
        start = time.perf_counter()
        weight = self.staging.to_device(weight)
        built = quantized_layer(method, weight, in_features, out_features, bias, compute_dtype, self.device, home,
                                self.staging.to_host if home.type == "cpu" else None)
        if self.device.type == "cpu":
            trim_heap()  # the layer's temporaries left holes between the quantized tensors that stay
        self._quantize_seconds += time.perf_counter() - start
        self.report.records.append(LayerRecord(name, method.name, reason, plain_bytes, parameter_bytes(built)))
        self._online_counts[reason] = self._online_counts.get(reason, 0) + 1
        return built

    def _timing_note(self) -> str:
        line = f"quantizing while loading took {self._quantize_seconds:.1f} s on {self.device}"
        staging = self.staging
        if staging.staged_bytes:
            line += (f": {staging.seconds:.1f} s reading {format_gib(staging.staged_bytes)} of weights into pinned "
                     f"memory, {staging.host_seconds:.1f} s quantizing and moving {format_gib(staging.host_bytes)} "
                     "back to RAM")
        return line

    # -- after building ----------------------------------------------------------
    def finish(self) -> QuantReport:
        """The report, once every Linear was built; raises if a quantized layer found no Linear."""
        self.contents.require_consumed(self.consumed)
        if self._online_counts:
            self.report.notes.append("quantized while loading: " + ", ".join(
                f"{label} x{n}" for label, n in self._online_counts.items()))
            self.report.notes.append(self._timing_note())
        self.staging.close()
        for fmt, paths in self._paths.items():
            where = f"{self.device.type}" + (f" sm{''.join(map(str, cuda_capability(self.device)))}"
                                            if self.device.type == "cuda" else "")
            self.report.headline_notes.append(f"{fmt} layers on {where}: " + ", ".join(
                f"{label} x{n}" for label, n in paths.items()))
        return self.report
