"""ComfyUI per-layer quantization markers, in both forms, checked layer by layer.

Tensor form (upstream ComfyUI): a uint8 tensor `<layer>.comfy_quant` holding
UTF-8 JSON, {"format": <name>, <the format's options>}.
Header form (ComfyUI 0.3.75): metadata `_quantization_metadata` =
{"format_version": "1.0", "layers": {"<layer>": {"format": ...}}}.

The formats are the registered ones with `marker` set (quant/registry.py);
each one's Contract (quant/descriptor.py, declared in its own module) says
its companion tensors (`<layer>.<role>`), dtypes and shapes, and this module
checks any format by it. The block-scale layouts are comfy-kitchen's (its
layouts read them as stored).

A layer marked in both forms must agree: the two are merged when every key
they share has one value and they mean the same format and parameters (one
form may add keys, e.g. convert_to_quant's tensors add "per_row"); anything
else is a conflict naming both.
"""
from __future__ import annotations

import os

from ..pack_logging import pack_logger
from ..quant.descriptor import Contract, QuantFormat, read_marker
from ..quant.registry import marker_formats
from .errors import CheckpointError, name_list
from .layers import (Check, LayerFormat, Problems, check_role_shapes, check_scales, checked, expect_dtype,
                     float_scale, is_scalar, per_tensor_or_channel, roundup)
from .safetensors_header import MAX_METADATA_BYTES, HeaderReader, SafetensorsHeader, parse_json, short_repr

log = pack_logger(__name__)

MARKER_SUFFIX = ".comfy_quant"
#: A quantized layer's companions that hold the reference of its first-call check, which the quantize-once cache's
#: files carry (loaders/entry_checks.py): read by the cache, never loaded as the layer's or the model's tensors.
CHECK_ROLES = ("bigdit_check_sketch", "bigdit_check_sketch_bias")
METADATA_KEY = "_quantization_metadata"
# A real marker is about a hundred bytes of flat JSON; the tensors' total is bounded like the metadata.
MAX_MARKER_BYTES = 4096
MAX_MARKERS_BYTES = MAX_METADATA_BYTES
MAX_MARKER_DEPTH = 4


def has_markers(header: SafetensorsHeader) -> bool:
    return METADATA_KEY in header.metadata or any(k.endswith(MARKER_SUFFIX) for k in header.tensors)


def marker_keys(header: SafetensorsHeader) -> list[str]:
    return [k for k in header.tensors if k.endswith(MARKER_SUFFIX)]


def read_markers(header: SafetensorsHeader, read: HeaderReader,
                 check: Check = None) -> dict[str, tuple[dict, str]]:
    """{layer: (marker dict, source)} from both forms, merged per layer; conflicts are an error."""
    path = header.path
    keys = marker_keys(header)
    oversized = [key for key in keys if header.tensors[key].nbytes > MAX_MARKER_BYTES]
    if oversized:
        raise CheckpointError(path, f"oversized marker: {oversized[0]} holds {header.tensors[oversized[0]].nbytes} "
                                    f"bytes, over the {MAX_MARKER_BYTES}-byte bound",
                              [key[:-len(MARKER_SUFFIX)] for key in oversized])
    total = sum(header.tensors[key].nbytes for key in keys)
    if total > MAX_MARKERS_BYTES:
        raise CheckpointError(path, f"oversized markers: {total} bytes of {MARKER_SUFFIX[1:]} tensors, over the "
                                    f"{MAX_MARKERS_BYTES}-byte bound")
    markers: dict[str, tuple[dict, str]] = {}
    parsed: dict[bytes, dict] = {}      # a file's markers repeat a few texts: each is parsed and checked once
    for key in checked(keys, check):
        layer = key[:-len(MARKER_SUFFIX)]
        if header.tensors[key].dtype != "U8":
            raise CheckpointError(path, f"bad marker: {key} must be a U8 tensor of JSON bytes, "
                                        f"found {header.tensors[key].dtype}", [layer])
        raw = read.raw(key)
        if raw not in parsed:
            parsed[raw] = _marker_dict(path, layer, parse_json(path, raw, f"bad marker JSON in {key}", [layer]), key)
        markers[layer] = (parsed[raw], "comfy_quant tensor")

    text = header.metadata.get(METADATA_KEY)
    if text is not None:
        meta = parse_json(path, text, f"bad marker JSON in metadata {METADATA_KEY}")
        layers = meta.get("layers") if isinstance(meta, dict) else None
        if not isinstance(layers, dict):
            raise CheckpointError(path, f'bad marker JSON: metadata {METADATA_KEY} has no "layers" object')
        for layer, marker in checked(layers.items(), check):
            marker = _marker_dict(path, layer, marker, METADATA_KEY)
            if layer in markers:
                markers[layer] = (_merged(path, layer, markers[layer][0], marker), "both forms")
            else:
                markers[layer] = (marker, METADATA_KEY)
    return markers


def _marker_dict(path: str, layer: str, marker, where: str) -> dict:
    if not isinstance(marker, dict) or not isinstance(marker.get("format"), str):
        raise CheckpointError(path, f'bad marker JSON in {where}: expected an object with a "format" string, '
                                    f"found {short_repr(marker)}", [layer])
    if _deeper_than(marker, MAX_MARKER_DEPTH):
        raise CheckpointError(path, f"bad marker JSON in {where}: nested more than {MAX_MARKER_DEPTH} levels deep",
                              [layer])
    return marker


def _deeper_than(value, limit: int) -> bool:
    stack = [(value, 1)]
    while stack:
        value, depth = stack.pop()
        if isinstance(value, (dict, list)):
            if depth > limit:
                return True
            stack.extend((child, depth + 1) for child in (value.values() if isinstance(value, dict) else value))
    return False


def _meaning(marker: dict) -> dict:
    """What a marker makes the loader do: its format and its options (defaults filled in)."""
    spec = marker_formats().get(marker["format"])
    return spec.marker_meaning(marker) if spec is not None else {"format": marker["format"]}


def _merged(path: str, layer: str, tensor_form: dict, header_form: dict) -> dict:
    differ = sorted(k for k in tensor_form.keys() & header_form.keys() if tensor_form[k] != header_form[k])
    a, b = _meaning(tensor_form), _meaning(header_form)
    differ += sorted(k for k in a.keys() | b.keys() if a.get(k) != b.get(k) and k not in differ)
    if differ:
        raise CheckpointError(path, f"conflicting markers: {MARKER_SUFFIX[1:]} tensor says {short_repr(tensor_form, 200)}, "
                                    f"{METADATA_KEY} says {short_repr(header_form, 200)} (they differ in "
                                    f"{', '.join(differ)})", [layer])
    return {**header_form, **tensor_form}


def inspect_markers(header: SafetensorsHeader, read: HeaderReader, check: Check = None,
                    notes: list[str] | None = None) -> dict[str, LayerFormat]:
    """Every marked layer, validated: format supported, marker values a writer can mean, companions
    present with the right dtypes and shapes, no unknown companions, scales a quantizer could have
    written (see check_scales). Raises CheckpointError. Marker keys no format reads are named in one
    warning per file (logged, and appended to `notes`). `check` is called now and then (e.g. to stop
    on an interrupt)."""
    markers = read_markers(header, read, check)
    supported = marker_formats()
    unknown: dict[str, list[str]] = {}
    for layer, (marker, _) in markers.items():
        if marker["format"] not in supported:
            unknown.setdefault(marker["format"], []).append(layer)
    if unknown:
        formats = ", ".join(repr(f) for f in unknown)
        raise CheckpointError(header.path, f"unsupported quantization format {formats} (supported: "
                                           f"{', '.join(supported)}); nothing was loaded",
                              [layer for layers in unknown.values() for layer in layers])
    problems = Problems(header.path)
    layers = {}
    unread: dict[str, list[str]] = {}
    for name, (marker, source) in checked(markers.items(), check):
        layer = _check_layer(header, name, marker, supported[marker["format"]], source, problems, unread)
        if layer is not None:
            layers[name] = layer
    problems.raise_if_any()
    if unread:
        note = unread_keys_note(header.path, unread)
        log.warning(note)
        if notes is not None:
            notes.append(note)
    for layer in checked(layers.values(), check):
        check_scales(layer, read, problems)
    problems.raise_if_any()
    return layers


def unread_keys_note(path: str, unread: dict[str, list[str]]) -> str:
    """One line for a file's marker keys no format reads: {key: layers}."""
    keys = "; ".join(f"{key!r} (layer{'s' if len(layers) > 1 else ''}: {name_list(layers)})"
                     for key, layers in unread.items())
    return (f"{os.path.basename(path)}: marker key(s) the loader does not read, so they change nothing: {keys}; "
            "if the file's writer meant something by them, the layers may load otherwise than it meant")


def _check_layer(header: SafetensorsHeader, name: str, marker: dict, spec: QuantFormat, source: str,
                 problems: Problems, unread: dict[str, list[str]]) -> LayerFormat | None:
    fmt, contract = spec.name, spec.contract
    try:
        values, unknown = read_marker(spec.marker_params, marker)
    except ValueError as exc:
        problems.add(str(exc), name)
        return None
    for key in unknown:
        unread.setdefault(key, []).append(name)
    required, optional = contract.required, contract.optional
    present = header.companions(name)
    missing = sorted(required - set(present))
    if missing:
        problems.add(f"{fmt} layer is missing tensor(s) {', '.join(missing)}", name)
        return None
    extra = sorted(set(present) - required - optional - {"bias", MARKER_SUFFIX[1:], *CHECK_ROLES})
    if extra:
        problems.add(f"unsupported companion tensor(s) for {fmt}: {', '.join(extra)}", name)
        return None
    stored = contract.roles  # once, not once per companion
    tensors = {role: key for role, key in present.items() if role in stored}
    info = {role: header.tensors[key] for role, key in tensors.items()}
    weight = info["weight"]
    if len(weight.shape) != 2:
        problems.add(f"shape mismatch: {fmt} weight must be 2-D, found {list(weight.shape)}", name)
        return None
    rows, cols = weight.shape
    ok = (_weight_and_scale(name, fmt, contract, info, rows, cols, problems)
          and check_role_shapes(name, fmt, contract, info, rows, cols * contract.pack, values, problems))
    if ok and values.get("per_row") is not None:
        ok = _per_row_agrees(name, values["per_row"], info[contract.scale_role], rows, fmt, problems)
    for role in ("input_scale", "weight_scale_2"):
        if role in info and ok:
            ok = float_scale(info[role], role, name, problems)
            if ok and not is_scalar(info[role]):
                problems.add(f"shape mismatch: {fmt} {role} must be a scalar, found {list(info[role].shape)}", name)
                ok = False
    if not ok:
        return None
    try:
        options = spec.marker_options(values, cols * contract.pack)
    except ValueError as exc:
        problems.add(str(exc), name)
        return None
    return LayerFormat(name, fmt, tensors, (rows, cols), options, source)


def _weight_and_scale(name, fmt: str, contract: Contract, info, rows, cols, problems) -> bool:
    """The weight's dtype and padding, then weight_scale's dtype and shape (per tensor/channel, or blocked)."""
    what = f"{fmt} weight" + (f" ({contract.weight_note})" if contract.weight_note else "")
    if not expect_dtype(info["weight"], contract.weight_dtypes, what, name, problems):
        return False
    if contract.pad > 1 and (rows % contract.pad or (cols * contract.pack) % contract.pad):
        columns = f" (rows, and columns x{contract.pack})" if contract.pack > 1 else ""
        problems.add(f"shape mismatch: {fmt} weight {[rows, cols]} is not padded to {contract.pad}{columns}", name)
        return False
    scale = info.get(contract.scale_role)
    if contract.scale_role in contract.shapes:
        return True     # checked with the other roles of declared shapes
    if contract.block is None:
        return _channel_scale(name, scale, rows, fmt, problems)
    return (expect_dtype(scale, contract.block_scale_dtypes, f"{fmt} weight_scale", name, problems)
            and _block_scale(name, scale, rows, cols * contract.pack // contract.block, fmt, problems))


def _channel_scale(name, info, rows, fmt, problems) -> bool:
    if not float_scale(info, f"{fmt} weight_scale", name, problems):
        return False
    if not per_tensor_or_channel(info, rows):
        problems.add(f"shape mismatch: {fmt} weight_scale must be a scalar or [{rows}, 1], "
                     f"found {list(info.shape)}", name)
        return False
    return True


def _per_row_agrees(name, per_row, scale, rows, fmt, problems) -> bool:
    """A marker's "per_row" must describe the stored weight_scale (per output row, or one per tensor)."""
    if rows > 1 and per_row != (scale.numel == rows):
        problems.add(f'shape mismatch: the marker says "per_row": {str(per_row).lower()} but {fmt} weight_scale '
                     f"is {list(scale.shape)} for {rows} rows", name)
        return False
    return True


def _block_scale(name, info, rows, blocks_per_row, fmt, problems) -> bool:
    expected = (roundup(rows, 128), roundup(blocks_per_row, 4))
    if info.shape != expected:
        problems.add(f"shape mismatch: {fmt} weight_scale must be {list(expected)} (comfy-kitchen's blocked "
                     f"layout), found {list(info.shape)}", name)
        return False
    return True
