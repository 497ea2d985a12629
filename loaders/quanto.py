"""Self-describing Optimum Quanto qint8 checkpoints (as mmgp/DeepBeepMeep write them), checked strictly.

Metadata: `quantization_format` = "quanto" and `quantization_map_base64` =
base64(JSON {prefix: {"weights": "qint8", "activations": "none"}}).
Tensors per prefix: `<prefix>.weight._data` (I8 [out, in]), `<prefix>.weight._scale`
(float [out, 1]), and optionally `<prefix>.input_scale` / `<prefix>.output_scale`
(float scalars), plus an optional `<prefix>.bias`.

The contract, as sglang enforces it for the same files:
- the map's prefixes are exactly the `._data` prefixes;
- weight-only qint8: any other weight type or any activation quantization is refused;
- dtypes and shapes as above;
- the auxiliary input/output scales equal exactly 1 (weight-only layers ignore them).
The layers are normalized to the roles `weight` / `weight_scale`.
"""
from __future__ import annotations

import base64
import binascii

from ..quant.registry import convention_format
from .errors import CheckpointError, name_list
from .layers import Check, LayerFormat, Problems, check_scales, checked, expect_dtype, float_scale, is_scalar
from .safetensors_header import HeaderReader, SafetensorsHeader, parse_json, short_repr

FORMAT_KEY = "quantization_format"
MAP_KEY = "quantization_map_base64"
DATA_SUFFIX = ".weight._data"
SCALE_SUFFIX = ".weight._scale"
QUANTO = convention_format("quanto")
AUXILIARY_SCALES = QUANTO.contract.ignored   # input_scale, output_scale


def is_quanto(header: SafetensorsHeader) -> bool:
    return header.metadata.get(FORMAT_KEY) == "quanto"


def read_quantization_map(header: SafetensorsHeader) -> dict[str, dict]:
    path = header.path
    encoded = header.metadata.get(MAP_KEY)
    if encoded is None:
        raise CheckpointError(path, f'{FORMAT_KEY} is "quanto" but the metadata has no {MAP_KEY}')
    try:
        decoded = base64.b64decode(encoded, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise CheckpointError(path, f"{MAP_KEY} is not base64-encoded JSON ({exc})") from exc
    qmap = parse_json(path, decoded, f"{MAP_KEY} is not base64-encoded JSON")
    if not isinstance(qmap, dict) or not all(isinstance(v, dict) for v in qmap.values()):
        raise CheckpointError(path, f"{MAP_KEY} must be a JSON object of {{prefix: {{weights, activations}}}}")
    return qmap


def inspect_quanto(header: SafetensorsHeader, read: HeaderReader, check: Check = None) -> dict[str, LayerFormat]:
    """Every declared layer, validated against the contract above. Raises CheckpointError.
    `check` is called now and then (e.g. to stop on an interrupt)."""
    path = header.path
    qmap = read_quantization_map(header)
    # What the map declares is checked first: a file of another kind fails with its reason.
    activated = [p for p, entry in qmap.items() if entry.get("activations") != "none"]
    if activated:
        kinds = sorted({short_repr(qmap[p].get("activations")) for p in activated})
        raise CheckpointError(path, f"activation quantization is not supported: Quanto layers with activations "
                                    f"{', '.join(kinds)}; only weight-only qint8 (activations 'none') loads", activated)
    not_qint8 = [p for p, entry in qmap.items() if entry.get("weights") != "qint8"]
    if not_qint8:
        kinds = sorted({short_repr(qmap[p].get("weights")) for p in not_qint8})
        raise CheckpointError(path, f"Quanto weights of type {', '.join(kinds)} are not supported: only qint8 is",
                              not_qint8)

    data_prefixes = [k[:-len(DATA_SUFFIX)] for k in header.tensors if k.endswith(DATA_SUFFIX)]
    with_data = set(data_prefixes)
    only_map = [p for p in qmap if p not in with_data]
    only_data = [p for p in data_prefixes if p not in qmap]
    if only_map or only_data:
        parts = []
        if only_map:
            parts.append(f"in the quantization map but without {DATA_SUFFIX} tensors: {name_list(only_map)}")
        if only_data:
            parts.append(f"{DATA_SUFFIX} tensors missing from the quantization map: {name_list(only_data)}")
        raise CheckpointError(path, "prefix-set mismatch: " + "; ".join(parts), only_map + only_data)

    problems = Problems(path)
    layers = {}
    for prefix in checked(qmap, check):
        layer = _check_prefix(header, prefix, problems)
        if layer is not None:
            layers[prefix] = layer
    problems.raise_if_any()
    for layer in checked(layers.values(), check):
        check_scales(layer, read, problems)
        for role in AUXILIARY_SCALES:
            key = f"{layer.name}.{role}"
            if key in header.tensors and float(read(key).float().reshape(())) != 1.0:
                problems.add(f"non-unit Quanto {role}: weight-only qint8 layers need it to be exactly 1, "
                             f"found {float(read(key).float().reshape(()))}", layer.name)
    problems.raise_if_any()
    return layers


def _check_prefix(header: SafetensorsHeader, prefix: str, problems: Problems) -> LayerFormat | None:
    data_key, scale_key = prefix + DATA_SUFFIX, prefix + SCALE_SUFFIX
    if prefix + ".weight" in header.tensors:
        problems.add("both a plain .weight and a Quanto .weight._data tensor", prefix)
        return None
    if scale_key not in header.tensors:
        problems.add(f"Quanto layer is missing {SCALE_SUFFIX}", prefix)
        return None
    extra = sorted(set(header.companions(prefix)) - {"bias", *AUXILIARY_SCALES})
    extra += sorted(f"weight.{suffix}" for suffix, key in header.companions(prefix + ".weight").items()
                    if key not in (data_key, scale_key))
    if extra:
        problems.add(f"unsupported companion tensor(s) for a Quanto qint8 layer: {', '.join(extra)}", prefix)
        return None
    data, scale = header.tensors[data_key], header.tensors[scale_key]
    if not expect_dtype(data, ("I8",), "Quanto weight._data", prefix, problems):
        return None
    if len(data.shape) != 2:
        problems.add(f"shape mismatch: Quanto weight._data must be 2-D, found {list(data.shape)}", prefix)
        return None
    if not float_scale(scale, "Quanto weight._scale", prefix, problems):
        return None
    if scale.shape != (data.shape[0], 1):
        problems.add(f"shape mismatch: Quanto weight._scale must be [{data.shape[0]}, 1] (per output channel), "
                     f"found {list(scale.shape)}", prefix)
        return None
    for role in AUXILIARY_SCALES:
        info = header.tensors.get(f"{prefix}.{role}")
        if info is None:
            continue
        if not float_scale(info, f"Quanto {role}", prefix, problems):
            return None
        if not is_scalar(info):
            problems.add(f"shape mismatch: Quanto {role} must be a scalar, found {list(info.shape)}", prefix)
            return None
    return LayerFormat(prefix, QUANTO.name, {"weight": data_key, "weight_scale": scale_key},
                       tuple(data.shape), {}, "quanto map")
