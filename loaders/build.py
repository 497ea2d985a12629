"""Builds a model's Linear layers one at a time while the model is being loaded.

Each layer is one `Layer` record, decided once by quant/decision.py: every plain
matrix of the file from its header entry before the model exists (names, dtypes,
shapes; the fit's moves to 4-bit included), a stored layer (markers, scaled_fp8,
Quanto) when its Linear is built and its true shape is known, and a key the header
does not hold under the model's name from the tensor that arrives. A model loader
calls `LayerBuilder.build(name, ...)` for every Linear as its weights arrive, which
carries out the decision: a stored layer built as stored or converted, a plain
weight quantized right there, or None to keep the plain layer. Only one layer's
full-precision weight is on the compute device at a time, and a plain weight the
file maps lazily is read once.
"""
from __future__ import annotations

import time
from dataclasses import replace
from typing import Callable

import torch

from ..dtypes import torch_dtype
from ..hardware import device_text
from ..quant.decision import QuantConfig, decide, decide_all
from ..quant.layer import CONVERT, KEEP, LOAD, QUANTIZE, Layer
from ..quant.linear import QuantLinear, dequantized_weight, quantized_layer, requantized_layer
from ..quant.linear_method import LinearMethod
from ..quant.quantize_pass import parameter_bytes
from ..quant.real_error import watch_auto_choice, watch_conversion
from ..quant.registry import available_methods, get_method
from ..quant.report import QuantReport
from ..units import format_gib
from .checkpoint import CheckpointContents, TensorSource
from .errors import CheckpointError
from .host_memory import trim_heap
from .staging import PinnedStaging


def header_layers(contents: CheckpointContents) -> dict[str, Layer]:
    """A `Layer` for every plain matrix `<name>.weight` of the file, by module name, from its header entry."""
    layers = {}
    for key, file_key in contents.plain_keys.items():
        info = contents.header.tensors[file_key]
        if key.endswith(".weight") and len(info.shape) == 2:
            name, (out_features, in_features) = key[:-len(".weight")], info.shape
            layers[name] = Layer(name, in_features, out_features, torch_dtype(info.dtype))
    return layers


class LayerBuilder:
    """Carries out each layer's decision while ComfyUI builds the model (see the module's docstring).

    `online`: the quantization of plain layers (LoadH3Quantized's), None to load them as stored;
    `conversions`: what becomes of the file's stored formats (QuantConfig.conversions); `layer_type`: the
    QuantLinear subclass to build (the host's)."""

    def __init__(self, contents: CheckpointContents, source: TensorSource, device: torch.device, *,
                 online: QuantConfig | None = None, conversions: dict[str, str] | None = None,
                 title: str = "load", progress: Callable[[], None] | None = None,
                 layer_type: type[QuantLinear] = QuantLinear):
        self.contents, self.source, self.device = contents, source, torch.device(device)
        self.progress, self.layer_type = progress, layer_type
        self.report = QuantReport(title=title)
        self.report.notes.extend(contents.describe())
        self.consumed: set[str] = set()
        self._dominant = contents.proxy_dtype()
        self._methods: dict[tuple, LinearMethod] = {}
        self._paths: dict[str, dict[str, int]] = {}
        self._online_counts: dict[str, int] = {}
        self.config = replace(online or QuantConfig(method=None), compute_device=self.device,
                              conversions={**(online.conversions if online else {}), **(conversions or {})})
        # plain matrices are decided here, from the header (the fit moves some to 4-bit); a stored layer when its
        # Linear is built, where its true shape is known (block formats pad theirs in the file)
        self.layers = header_layers(contents)
        fit_note = decide_all(self.config, list(self.layers.values()), self._dominant, loading=True)
        if fit_note is not None:
            self.report.notes.append(fit_note)
        largest = max((layer.plain_bytes for layer in self.layers.values() if layer.action == QUANTIZE), default=0)
        self.staging = PinnedStaging(self.device, largest)
        self._quantize_seconds = 0.0

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
    def _layer(self, name: str, weight: torch.Tensor | None, in_features: int, out_features: int,
               compute_dtype: torch.dtype) -> Layer:
        """The layer's record, decided: a stored layer's now, a plain one's from the header; a key the header
        does not hold as this layer (ComfyUI renamed or split it on the way: diffusers files, HunyuanVideo) is
        decided from the tensor that arrives."""
        stored = self.contents.layers.get(name)
        if stored is not None:
            why_not = stored.mismatch(in_features, out_features)
            if why_not is not None:
                raise CheckpointError(self.contents.path, f"shape mismatch: {why_not}", [name])
            dtype = torch_dtype(self.contents.header.tensors[stored.tensors["weight"]].dtype)
            layer = Layer(name, in_features, out_features, dtype, compute_dtype, stored.format, stored.options)
            return decide(self.config, layer, self._dominant, loading=True)
        layer = self.layers.get(name)
        if layer is not None and weight is not None and layer.shape == (out_features, in_features):
            layer.compute_dtype = compute_dtype
            return layer
        if weight is None:
            return Layer(name, in_features, out_features, compute_dtype, compute_dtype).decided(
                KEEP, None, "no weight in the checkpoint")
        layer = Layer(name, in_features, out_features, weight.dtype, compute_dtype)
        return decide(self.config, layer, self._dominant, loading=True)

    def build(self, name: str, weight: torch.Tensor | None, in_features: int, out_features: int,
              bias: torch.Tensor | None, compute_dtype: torch.dtype, home: torch.device | None) -> QuantLinear | None:
        """The module for Linear `name`, or None to keep the plain layer (its record is kept either way)."""
        home = torch.device("cpu") if home is None else torch.device(home)
        layer = self._layer(name, weight, in_features, out_features, compute_dtype)
        layer.bytes_before = layer.bytes_after = (in_features + (bias is not None)) * out_features * compute_dtype.itemsize
        file_bias = bias
        if bias is not None:
            bias = bias.to(device=home, dtype=compute_dtype, copy=self.source.mark is None)
        built = None
        if layer.action in (LOAD, CONVERT):
            built = self._from_checkpoint(layer, bias, home)
            self.source.file_map.release(*(self.source(key) for key in self.contents.layers[name].tensors.values()))
        elif layer.action == QUANTIZE:
            built = self._quantize(layer, weight, bias, home)
        self.report.records.append(layer)
        if built is not None:  # consumed: its pages of the file go back (a plain layer's go once loaded)
            layer.bytes_after = parameter_bytes(built)
            self.source.file_map.release(weight, file_bias)
        if self.progress is not None:
            self.progress()
        return built

    def build_embedding(self, name: str, num_embeddings: int, embedding_dim: int,
                        compute_dtype: torch.dtype) -> torch.Tensor | None:
        """The full-precision table of an Embedding the file stores quantized (Comfy-Org's encoders keep their
        token embedding in INT8), dequantized by its format on the compute device; None where the file stores
        it plain. A lookup table is no Linear: it is loaded as a plain weight, its record says so."""
        stored = self.contents.layers.get(name)
        if stored is None:
            return None
        why_not = stored.mismatch(embedding_dim, num_embeddings)
        if why_not is not None:
            raise CheckpointError(self.contents.path, f"shape mismatch: {why_not} (an Embedding)", [name])
        tensors = self.contents.layer_tensors(self.source, name)
        weight = dequantized_weight(self._method(stored.format, stored.options), tensors, embedding_dim,
                                    num_embeddings, compute_dtype, self.device).to("cpu")
        stored_bytes = sum(t.numel() * t.element_size() for t in tensors.values())
        layer = Layer(name, embedding_dim, num_embeddings, compute_dtype, linear=False)  # full precision from here
        layer.decided(KEEP, None, f"{stored.format} embedding, dequantized at load")
        layer.bytes_before, layer.bytes_after = stored_bytes, weight.numel() * weight.element_size()
        self.report.records.append(layer)
        self.consumed.add(name)
        self.source.file_map.release(*(self.source(key) for key in stored.tensors.values()))
        return weight

    def _from_checkpoint(self, layer: Layer, bias, home) -> QuantLinear:
        stored = self.contents.layers[layer.name]
        method = self._method(stored.format, stored.options)
        tensors = self.contents.layer_tensors(self.source, layer.name)
        if layer.path is not None:  # how a stored format runs here, for the report's headline
            paths = self._paths.setdefault(stored.format, {})
            paths[layer.path] = paths.get(layer.path, 0) + 1
        if layer.action == LOAD:  # copied out of the map, unless the host pages them from the file
            tensors = {k: v.to(device=home, copy=self.source.mark is None) for k, v in tensors.items()}
            built = self.layer_type(method, layer.in_features, layer.out_features, tensors, bias, layer.compute_dtype)
        else:  # the file's tensors as a layer, for the one dequantize-then-quantize routine
            as_stored = QuantLinear(method, layer.in_features, layer.out_features, tensors, bias, layer.compute_dtype)
            watch = None
            if self.config.conversions.get(stored.format) == "auto":  # checked at its first real call
                def watch(new, weight):
                    watch_conversion(new, layer.name, method, tensors, bias, weight)
            built = requantized_layer(as_stored, layer.method, self.device, home, layer_type=self.layer_type,
                                      watch=watch)
        self.consumed.add(layer.name)
        return built

    def _quantize(self, layer: Layer, weight: torch.Tensor, bias, home) -> QuantLinear:
        start = time.perf_counter()
        staged = self.staging.to_device(weight)
        built = quantized_layer(layer.method, staged, layer.in_features, layer.out_features, bias,
                                layer.compute_dtype, self.device, home,
                                self.staging.to_host if home.type == "cpu" else None, layer_type=self.layer_type)
        # auto's choice is checked at the layer's first real call; its fallbacks read the weight again from the map
        watch_auto_choice(built, layer.name, self.config.method, staged,
                          weight if self.source.file_map.holds(weight) else None, bias)
        if self.device.type == "cpu":
            trim_heap()  # the layer's temporaries left holes between the quantized tensors that stay
        self._quantize_seconds += time.perf_counter() - start
        self._online_counts[layer.reason] = self._online_counts.get(layer.reason, 0) + 1
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
            self.report.headline_notes.append(f"{fmt} layers on {device_text(self.device)}: " + ", ".join(
                f"{label} x{n}" for label, n in paths.items()))
        return self.report
