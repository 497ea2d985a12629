"""ComfyUI's scaled_fp8 checkpoints (Comfy-Org's `*_fp8_scaled.safetensors`), read as FP8 layers.

The format, as ComfyUI 0.3.75 reads it natively (upstream converts it to float8_e4m3fn
markers on load, `comfy.utils.convert_old_quants`):
  <prefix>scaled_fp8      a marker tensor; its dtype is the weights' FP8 dtype (F32 stands for
                          F8_E4M3), two elements ask for full-precision matmuls
  <layer>.weight          F8_E4M3 [N, K], for every layer under <prefix> with a scale_weight
  <layer>.scale_weight    a float scalar: the dequantized weight is weight * scale_weight
  <layer>.scale_input     optional float scalar, a static activation scale; writers store 1.0
                          when they have none, which upstream drops, and so does this reader
Each such layer becomes a float8_e4m3fn layer with a per-tensor weight_scale.
"""
from __future__ import annotations

import torch

from ..dtypes import dtype_name
from ..quant.registry import convention_format
from .layers import (Check, LayerFormat, Problems, check_scales, checked, expect_dtype, float_scale,
                     is_scalar)
from .safetensors_header import HeaderReader, SafetensorsHeader

MARKER = "scaled_fp8"
FP8_FORMAT = convention_format(MARKER).name
FP8 = torch.float8_e4m3fn   # the FP8 layers' weights
_ROLES = {"scale_weight": "weight_scale", "scale_input": "input_scale"}   # file suffix -> FP8 method role
_NAMES = {"weight_scale": "scaled_fp8 scale_weight", "input_scale": "scaled_fp8 scale_input"}
_WEIGHT_DTYPES = {"F8_E4M3": FP8, "F32": FP8, "F8_E5M2": torch.float8_e5m2}


def marker_keys(header: SafetensorsHeader) -> list[str]:
    return [k for k in header.tensors if k == MARKER or k.endswith("." + MARKER)]


def unmarked_fp8_scales(header: SafetensorsHeader) -> list[str]:
    """Layers of a file without a marker that still look scaled_fp8 (an F8 weight beside a scale_weight)."""
    return [key.rpartition(".")[0] for key in header.tensors if key.endswith(".scale_weight")
            and header.tensors.get(key[:-len("scale_weight")] + "weight", (None, ""))[1].startswith("F8")]


def inspect_scaled_fp8(header: SafetensorsHeader, read: HeaderReader,
                       check: Check = None) -> tuple[dict[str, LayerFormat], set[str], list[str]]:
    """(layers, keys they claim beyond their tensors, notes) of a scaled_fp8 file, validated:
    an E4M3 marker, every scale under a marker's prefix with an F8_E4M3 2-D weight beside it,
    scales finite, positive float scalars. Raises CheckpointError naming the file and layers."""
    problems = Problems(header.path)
    markers = marker_keys(header)
    prefixes = []
    for key in markers:
        dtype = header.tensors[key].dtype
        fp8 = _WEIGHT_DTYPES.get(dtype)
        if fp8 is None:
            problems.add(f"bad scaled_fp8 marker: its dtype must name the weights' FP8 type (F8_E4M3, or F32 "
                         f"for it), found {dtype}", key)
        elif fp8 != FP8:
            problems.add(f"unsupported scaled_fp8 weights {dtype_name(fp8)}: the pack's FP8 layers "
                         f"are {FP8_FORMAT}; load this file with ComfyUI's UNETLoader", key)
        prefixes.append(key[:-len(MARKER)])
    problems.raise_if_any()

    layers, claimed, placeholders = {}, set(markers), 0
    scaled = sorted({key.rpartition(".")[0] for key in header.tensors
                     if key.rpartition(".")[2] in _ROLES})
    for name in checked(scaled, check):
        present = header.companions(name)
        claimed.update(present[suffix] for suffix in _ROLES if suffix in present)
        if not any(name.startswith(prefix) for prefix in prefixes):
            problems.add(f"scale tensor(s) outside the model the scaled_fp8 marker covers "
                         f"(prefix {', '.join(repr(p) for p in prefixes)})", name)
            continue
        layer = _check_layer(header, name, present, problems)
        if layer is None:
            continue
        scale_input = layer.tensors.get("input_scale")
        if scale_input is not None and float(read(scale_input).float().reshape(-1)[0]) == 1.0:
            layer = LayerFormat(name, layer.format, {r: k for r, k in layer.tensors.items() if r != "input_scale"},
                                layer.storage_shape, source=layer.source)
            placeholders += 1
        layers[name] = layer
    problems.raise_if_any()
    for layer in checked(layers.values(), check):
        check_scales(layer, read, problems, _NAMES)
    problems.raise_if_any()

    notes = []
    if placeholders:
        notes.append(f"scaled_fp8: scale_input 1.0 (a writer's placeholder) on {placeholders} layer(s) ignored, "
                     f"their activations are scaled per token")
    if any(header.tensors[key].numel == 2 for key in markers):
        notes.append("scaled_fp8: the file asks for full-precision matmuls; its layers run as the pack's FP8 "
                     "layers (FP8 activations, per token)")
    return layers, claimed, notes


def _check_layer(header: SafetensorsHeader, name: str, present: dict[str, str],
                 problems: Problems) -> LayerFormat | None:
    if "scale_weight" not in present:
        problems.add("scaled_fp8 scale_input without a scale_weight", name)
        return None
    if "weight" not in present:
        problems.add("scaled_fp8 scale_weight without a weight", name)
        return None
    weight = header.tensors[present["weight"]]
    if not expect_dtype(weight, ("F8_E4M3",), "scaled_fp8 weight", name, problems):
        return None
    if len(weight.shape) != 2:
        problems.add(f"shape mismatch: scaled_fp8 weight must be 2-D, found {list(weight.shape)}", name)
        return None
    tensors = {"weight": present["weight"]}
    for suffix, role in _ROLES.items():
        if suffix not in present:
            continue
        info = header.tensors[present[suffix]]
        if not float_scale(info, f"scaled_fp8 {suffix}", name, problems):
            return None
        if not is_scalar(info):
            problems.add(f"shape mismatch: scaled_fp8 {suffix} must be a scalar, found {list(info.shape)}", name)
            return None
        tensors[role] = present[suffix]
    return LayerFormat(name, FP8_FORMAT, tensors, tuple(weight.shape), source=MARKER)
