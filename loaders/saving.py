"""A model's modules -> the tensors of a ComfyUI per-layer marker checkpoint: the inverse of markers.py.

Each quantized layer is written in the layout upstream ComfyUI loads natively
and markers.py reads back: its stored tensors under their roles
(`<layer>.weight`, `.weight_scale`, `.weight_scale_2`, `.input_scale`), its
bias, and its marker in both forms, as a uint8 `<layer>.comfy_quant` JSON
tensor and in the header's `_quantization_metadata` (what ComfyUI 0.3.75
reads; upstream reads both). A quantized layer is either a QuantLinear or a
layer whose weight is a comfy-kitchen QuantizedTensor (upstream's own layers).
Every other tensor is written as the module holds it, under the name its
state_dict gives it. Nothing is copied here: the contents list the model's own
tensors, and the writer reads them one at a time.
"""
from __future__ import annotations

import json
import re
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable

import torch
from torch import nn

from ..dtypes import TORCH_TO_SAFETENSORS
from ..quant.kitchen_api import is_quantized_tensor, layout_name, layout_params, storage_dtype
from ..quant.linear import QuantLinear
from ..quant.registry import format_spec, kitchen_format, marker_formats
from .errors import with_layers
from .markers import MARKER_SUFFIX, METADATA_KEY
from .safetensors_writer import dtype_code

PACK_ROOT = Path(__file__).resolve().parent.parent

class SaveError(ValueError):
    """A model that cannot be saved as asked; names up to five layers."""

    def __init__(self, problem: str, layers: Iterable[str] = ()):
        self.layers = tuple(layers)
        super().__init__(with_layers(problem, self.layers))


@dataclass
class SavedLayer:
    name: str
    marker: dict
    tensors: dict[str, torch.Tensor]   # role -> the layer's own tensor

    def label(self) -> str:
        if self.marker.get("convrot"):
            return f"{self.marker['format']} (convrot, group {self.marker['convrot_groupsize']})"
        return self.marker["format"]


def marker_tensor(marker: dict) -> torch.Tensor:
    return torch.tensor(list(json.dumps(marker).encode("utf-8")), dtype=torch.uint8)


def _from_quant_linear(name: str, module: QuantLinear) -> SavedLayer:
    method = module.method
    spec = format_spec(method.name)
    if spec is not None and spec.unsaveable:
        raise _Unsupported(spec.unsaveable)
    marker = None if spec is None else spec.saved_marker(method)
    if marker is None:
        raise _Unsupported(f"format {method.name!r} has no marker format")
    try:
        tensors = module.stored_tensors()
    except RuntimeError as exc:
        raise _Unsupported(str(exc)) from None
    return SavedLayer(name, marker, tensors)


def _from_kitchen_weight(name: str, module: nn.Module) -> SavedLayer:
    weight = module.weight
    layout = layout_name(weight)
    spec = kitchen_format(layout)
    if spec is not None and TORCH_TO_SAFETENSORS.get(storage_dtype(weight)) not in spec.contract.weight_dtypes:
        spec = None   # e.g. an FP8 layout holding float8_e5m2
    if spec is None:
        raise _Unsupported(f"comfy-kitchen layout {layout} ({storage_dtype(weight)}) has no marker format the "
                           f"pack's loaders read")
    if not hasattr(weight, "state_dict"):
        raise _Unsupported(f"{layout} weight is ComfyUI's own QuantizedTensor (no comfy-kitchen); load the file "
                           f"with MixedCheckpointLoader to save it")
    params = layout_params(weight)
    if params.get("transposed", False):
        raise _Unsupported(f"comfy-kitchen {layout} weight is held transposed; files store it untransposed")
    marker = spec.kitchen_marker(params)
    tensors = {key: t for key, t in weight.state_dict("weight").items()}
    for key, param in module._parameters.items():
        if key not in ("weight", "bias") and param is not None:
            tensors[key] = param   # e.g. upstream's input_scale
    return SavedLayer(name, marker, tensors)


class _Unsupported(Exception):
    pass


def saved_layer(name: str, module: nn.Module) -> SavedLayer | None:
    """The quantized layer `module` holds, or None if it is not quantized. Raises _Unsupported."""
    if isinstance(module, QuantLinear):
        layer = _from_quant_linear(name, module)
    elif is_quantized_tensor(getattr(module, "weight", None)):
        layer = _from_kitchen_weight(name, module)
    else:
        return None
    contract = marker_formats()[layer.marker["format"]].contract
    required, optional = contract.required, contract.optional
    roles = set(layer.tensors)
    if not required <= roles or roles - required - optional:
        raise _Unsupported(f"{layer.marker['format']} layer holds tensors {sorted(roles)}, the format stores "
                           f"{sorted(required)} (+ optional {sorted(optional)})")
    return layer


def _plain_tensors(module: nn.Module) -> Iterable[tuple[str, torch.Tensor]]:
    """The module's own entries of its state_dict: parameters, then persistent buffers."""
    for key, param in module._parameters.items():
        if param is not None:
            yield key, param
    for key, buf in module._buffers.items():
        if buf is not None and key not in module._non_persistent_buffers_set:
            yield key, buf


@dataclass
class SaveContents:
    """What goes into the file, in order, as (key, the model's own tensor)."""
    tensors: list[tuple[str, torch.Tensor]] = field(default_factory=list)
    layers: dict[str, SavedLayer] = field(default_factory=dict)
    plain: Counter = field(default_factory=Counter)   # safetensors dtype -> tensors kept as they are

    def markers(self) -> dict[str, dict]:
        return {name: layer.marker for name, layer in self.layers.items()}

    def format_counts(self) -> Counter:
        return Counter(layer.label() for layer in self.layers.values())

    def metadata(self, saved_by: str) -> dict[str, str]:
        """The file's __metadata__: the markers' header form, and what wrote the file and how."""
        return {
            METADATA_KEY: json.dumps({"format_version": "1.0", "layers": self.markers()}),
            "bigdit_saved_by": saved_by,
            "bigdit_version": pack_version(),
            "bigdit_formats": json.dumps(dict(sorted(self.format_counts().items()))),
            "bigdit_plain_dtypes": json.dumps(dict(sorted(self.plain.items()))),
        }

    def describe(self) -> list[str]:
        formats = ", ".join(f"{label} x{n}" for label, n in sorted(self.format_counts().items()))
        plain = ", ".join(f"{dtype} x{n}" for dtype, n in sorted(self.plain.items())) or "none"
        return [f"quantized layers: {len(self.layers)} ({formats})",
                f"other tensors, as they were: {sum(self.plain.values())} ({plain})"]


def save_contents(modules: Iterable[tuple[str, nn.Module]]) -> SaveContents:
    """The file's tensors for `modules`: (name, module) for every module of the model, parents first,
    names as in the model's state_dict ("" for the root). Raises SaveError naming every layer that
    has no marker format the loaders read, before anything is written."""
    contents = SaveContents()
    unsupported: dict[str, list[str]] = {}
    for name, module in modules:
        prefix = f"{name}." if name else ""
        try:
            layer = saved_layer(name, module)
        except _Unsupported as exc:
            unsupported.setdefault(str(exc), []).append(name)
            continue
        if layer is None:
            for key, tensor in _plain_tensors(module):
                contents.tensors.append((prefix + key, tensor))
                contents.plain[dtype_code(tensor.dtype, prefix + key)] += 1
            continue
        contents.layers[name] = layer
        contents.tensors.extend((f"{prefix}{role}", tensor) for role, tensor in layer.tensors.items())
        if getattr(module, "bias", None) is not None:
            contents.tensors.append((f"{prefix}bias", module.bias))
        contents.tensors.append((f"{name}{MARKER_SUFFIX}", marker_tensor(layer.marker)))
    if unsupported:
        reason, layers = next(iter(unsupported.items()))
        more = f" (and {len(unsupported) - 1} other reason(s))" if len(unsupported) > 1 else ""
        raise SaveError(f"cannot save {sum(map(len, unsupported.values()))} quantized layer(s): {reason}{more}; "
                        f"nothing was written", [n for names in unsupported.values() for n in names])
    return contents


def pack_version() -> str:
    """The pack's version from its pyproject.toml ("unknown" where the file is missing)."""
    try:
        text = (PACK_ROOT / "pyproject.toml").read_text(encoding="utf-8")
    except OSError:
        return "unknown"
    project = re.search(r"^\[project\]\s*$(.*?)(?=^\[|\Z)", text, re.M | re.S)
    version = project and re.search(r'^version\s*=\s*"([^"]+)"', project.group(1), re.M)
    return version.group(1) if version else "unknown"
