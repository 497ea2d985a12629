"""ComfyUI per-layer quantization markers, in both forms, checked layer by layer.

Tensor form (upstream ComfyUI): a uint8 tensor `<layer>.comfy_quant` holding
UTF-8 JSON, e.g. {"format": "int8_tensorwise", "convrot": true, "convrot_groupsize": 256}.
Header form (ComfyUI 0.3.75): metadata `_quantization_metadata` =
{"format_version": "1.0", "layers": {"<layer>": {"format": ...}}}.

Formats and their companion tensors (`<layer>.<role>`):
  int8_tensorwise  weight I8 [N, K]; weight_scale float, per tensor or [N, 1];
                   convrot / convrot_groupsize at the marker's top level or under "params"
  float8_e4m3fn    weight F8_E4M3 [N, K]; weight_scale float, per tensor or [N, 1]; input_scale optional
  nvfp4            weight U8 [N16, K16/2]; weight_scale F8_E4M3 (or U8) blocked
                   [roundup(N16, 128), roundup(K16/16, 4)]; weight_scale_2 fp32 scalar; input_scale optional
  mxfp8            weight F8_E4M3 [N32, K32]; weight_scale F8_E8M0 (or U8) blocked
                   [roundup(N32, 128), roundup(K32/32, 4)]; input_scale optional
The block-scale layouts are comfy-kitchen's (its layouts read them as stored).
"""
from __future__ import annotations

import json

from ..quant.int8_convrot import GROUP_SIZES
from .errors import CheckpointError
from .layers import (LayerFormat, Problems, TensorReader, check_scales, companion_keys, expect_dtype,
                     float_scale, is_scalar, per_tensor_or_channel, roundup)
from .safetensors_header import SafetensorsHeader

MARKER_SUFFIX = ".comfy_quant"
METADATA_KEY = "_quantization_metadata"
SUPPORTED_FORMATS = ("int8_tensorwise", "float8_e4m3fn", "nvfp4", "mxfp8")


def has_markers(header: SafetensorsHeader) -> bool:
    return METADATA_KEY in header.metadata or any(k.endswith(MARKER_SUFFIX) for k in header.tensors)


def marker_keys(header: SafetensorsHeader) -> list[str]:
    return [k for k in header.tensors if k.endswith(MARKER_SUFFIX)]


def read_markers(header: SafetensorsHeader, read: TensorReader) -> dict[str, tuple[dict, str]]:
    """{layer: (marker dict, source)} from both forms; conflicting duplicates are an error."""
    path = header.path
    markers: dict[str, tuple[dict, str]] = {}
    for key in marker_keys(header):
        layer = key[:-len(MARKER_SUFFIX)]
        if header.tensors[key].dtype != "U8":
            raise CheckpointError(path, f"bad marker: {key} must be a U8 tensor of JSON bytes, "
                                        f"found {header.tensors[key].dtype}", [layer])
        try:
            marker = json.loads(read(key).numpy().tobytes().decode("utf-8"))
        except (UnicodeDecodeError, ValueError) as exc:
            raise CheckpointError(path, f"bad marker JSON in {key} ({exc})", [layer]) from exc
        markers[layer] = (_marker_dict(path, layer, marker, key), "comfy_quant tensor")

    text = header.metadata.get(METADATA_KEY)
    if text is not None:
        try:
            meta = json.loads(text)
        except ValueError as exc:
            raise CheckpointError(path, f"bad marker JSON in metadata {METADATA_KEY} ({exc})") from exc
        layers = meta.get("layers") if isinstance(meta, dict) else None
        if not isinstance(layers, dict):
            raise CheckpointError(path, f'bad marker JSON: metadata {METADATA_KEY} has no "layers" object')
        for layer, marker in layers.items():
            marker = _marker_dict(path, layer, marker, METADATA_KEY)
            if layer in markers and markers[layer][0] != marker:
                raise CheckpointError(path, f"conflicting markers: {MARKER_SUFFIX[1:]} tensor says "
                                            f"{markers[layer][0]}, {METADATA_KEY} says {marker}", [layer])
            markers.setdefault(layer, (marker, METADATA_KEY))
    return markers


def _marker_dict(path: str, layer: str, marker, where: str) -> dict:
    if not isinstance(marker, dict) or not isinstance(marker.get("format"), str):
        raise CheckpointError(path, f'bad marker JSON in {where}: expected an object with a "format" string, '
                                    f"found {marker!r:.80}", [layer])
    return marker


def inspect_markers(header: SafetensorsHeader, read: TensorReader) -> dict[str, LayerFormat]:
    """Every marked layer, validated: format supported, companions present with the right
    dtypes and shapes, no unknown companions, finite scales. Raises CheckpointError."""
    markers = read_markers(header, read)
    unknown: dict[str, list[str]] = {}
    for layer, (marker, _) in markers.items():
        if marker["format"] not in SUPPORTED_FORMATS:
            unknown.setdefault(marker["format"], []).append(layer)
    if unknown:
        formats = ", ".join(repr(f) for f in unknown)
        raise CheckpointError(header.path, f"unsupported quantization format {formats} (supported: "
                                           f"{', '.join(SUPPORTED_FORMATS)}); nothing was loaded",
                              [layer for layers in unknown.values() for layer in layers])
    problems = Problems(header.path)
    layers = {}
    for name, (marker, source) in markers.items():
        layer = _check_layer(header, name, marker, source, problems)
        if layer is not None:
            layers[name] = layer
    problems.raise_if_any()
    for layer in layers.values():
        check_scales(layer, read, _SCALE_ENCODINGS[layer.format], problems)
    problems.raise_if_any()
    return layers


_ROLES = {
    "int8_tensorwise": ({"weight", "weight_scale"}, set()),
    "float8_e4m3fn": ({"weight", "weight_scale"}, {"input_scale"}),
    "nvfp4": ({"weight", "weight_scale", "weight_scale_2"}, {"input_scale"}),
    "mxfp8": ({"weight", "weight_scale"}, {"input_scale"}),
}
_SCALE_ENCODINGS = {
    "int8_tensorwise": {"weight_scale": "float"},
    "float8_e4m3fn": {"weight_scale": "float", "input_scale": "float"},
    "nvfp4": {"weight_scale": "F8_E4M3", "weight_scale_2": "float", "input_scale": "float"},
    "mxfp8": {"weight_scale": "F8_E8M0"},
}


def _check_layer(header: SafetensorsHeader, name: str, marker: dict, source: str,
                 problems: Problems) -> LayerFormat | None:
    fmt = marker["format"]
    required, optional = _ROLES[fmt]
    present = companion_keys(header, name)
    missing = sorted(required - set(present))
    if missing:
        problems.add(f"{fmt} layer is missing tensor(s) {', '.join(missing)}", name)
        return None
    extra = sorted(set(present) - required - optional - {"bias", MARKER_SUFFIX[1:]})
    if extra:
        problems.add(f"unsupported companion tensor(s) for {fmt}: {', '.join(extra)}", name)
        return None
    tensors = {role: key for role, key in present.items() if role in required | optional}
    info = {role: header.tensors[key] for role, key in tensors.items()}
    weight = info["weight"]
    if len(weight.shape) != 2:
        problems.add(f"shape mismatch: {fmt} weight must be 2-D, found {list(weight.shape)}", name)
        return None
    rows, cols = weight.shape
    ok = _FORMAT_CHECKS[fmt](name, info, rows, cols, problems)
    for role in ("input_scale", "weight_scale_2"):
        if role in info and ok:
            ok = float_scale(info[role], role, name, problems)
            if ok and not is_scalar(info[role]):
                problems.add(f"shape mismatch: {fmt} {role} must be a scalar, found {list(info[role].shape)}", name)
                ok = False
    options = _int8_options(marker, cols, name, problems) if fmt == "int8_tensorwise" and ok else {}
    if not ok or options is None:
        return None
    return LayerFormat(name, fmt, tensors, (rows, cols), options, source)


def _check_int8(name, info, rows, cols, problems) -> bool:
    return (expect_dtype(info["weight"], ("I8",), "int8_tensorwise weight", name, problems)
            and _channel_scale(name, info["weight_scale"], rows, "int8_tensorwise", problems))


def _check_fp8(name, info, rows, cols, problems) -> bool:
    return (expect_dtype(info["weight"], ("F8_E4M3",), "float8_e4m3fn weight", name, problems)
            and _channel_scale(name, info["weight_scale"], rows, "float8_e4m3fn", problems))


def _check_nvfp4(name, info, rows, cols, problems) -> bool:
    if not expect_dtype(info["weight"], ("U8",), "nvfp4 weight (packed E2M1 pairs)", name, problems):
        return False
    if rows % 16 or (cols * 2) % 16:
        problems.add(f"shape mismatch: nvfp4 weight {[rows, cols]} is not padded to 16 (rows, and columns x2)", name)
        return False
    return (expect_dtype(info["weight_scale"], ("F8_E4M3", "U8"), "nvfp4 weight_scale", name, problems)
            and _block_scale(name, info["weight_scale"], rows, cols * 2 // 16, "nvfp4", problems))


def _check_mxfp8(name, info, rows, cols, problems) -> bool:
    if not expect_dtype(info["weight"], ("F8_E4M3",), "mxfp8 weight", name, problems):
        return False
    if rows % 32 or cols % 32:
        problems.add(f"shape mismatch: mxfp8 weight {[rows, cols]} is not padded to 32", name)
        return False
    return (expect_dtype(info["weight_scale"], ("F8_E8M0", "U8"), "mxfp8 weight_scale", name, problems)
            and _block_scale(name, info["weight_scale"], rows, cols // 32, "mxfp8", problems))


_FORMAT_CHECKS = {"int8_tensorwise": _check_int8, "float8_e4m3fn": _check_fp8,
                  "nvfp4": _check_nvfp4, "mxfp8": _check_mxfp8}


def _channel_scale(name, info, rows, fmt, problems) -> bool:
    if not float_scale(info, f"{fmt} weight_scale", name, problems):
        return False
    if not per_tensor_or_channel(info, rows):
        problems.add(f"shape mismatch: {fmt} weight_scale must be a scalar or [{rows}, 1], "
                     f"found {list(info.shape)}", name)
        return False
    return True


def _block_scale(name, info, rows, blocks_per_row, fmt, problems) -> bool:
    expected = (roundup(rows, 128), roundup(blocks_per_row, 4))
    if info.shape != expected:
        problems.add(f"shape mismatch: {fmt} weight_scale must be {list(expected)} (comfy-kitchen's blocked "
                     f"layout), found {list(info.shape)}", name)
        return False
    return True


def _int8_options(marker: dict, in_features: int, name: str, problems: Problems) -> dict | None:
    params = marker.get("params") if isinstance(marker.get("params"), dict) else {}
    convrot = marker.get("convrot", params.get("convrot", False))
    group_size = marker.get("convrot_groupsize", params.get("convrot_groupsize", 256))
    if not isinstance(convrot, bool) or not isinstance(group_size, int):
        problems.add(f"bad marker: convrot must be true/false and convrot_groupsize an integer, "
                     f"found {convrot!r} / {group_size!r}", name)
        return None
    if convrot and (group_size not in GROUP_SIZES or in_features % group_size):
        problems.add(f"bad marker: convrot_groupsize {group_size} must be one of {list(GROUP_SIZES)} "
                     f"and divide in_features {in_features}", name)
        return None
    return {"convrot": convrot, "convrot_groupsize": group_size}
