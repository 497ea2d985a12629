"""Optimum Quanto qint8 weight-only layers, as self-describing Quanto checkpoints store them, and their reader.

Stored tensors (after the loader renames Quanto's `weight._data` / `weight._scale`):
  weight        int8 [N, K]
  weight_scale  float [N, 1]   per output channel, in the checkpoint's dtype

The active layer's weight is dequantized just before its matmul, so this is a
resident-memory format, not a speed format: weights take half of bf16's memory
while resident, and each call pays a dequantization on top of a bf16 GEMM.
"""
from __future__ import annotations

import base64
import binascii

import torch
import torch.nn.functional as F

from .descriptor import Contract, QuantFormat
from .linear_method import LinearMethod, output_dtype
from .registry import register_format

NAME = "quanto_qint8"
QINT8_MIN, QINT8_MAX = -128, 127


class QuantoInt8Method(LinearMethod):
    name = NAME

    def describe(self) -> str:
        return f"{NAME} (weight-only, dequantized per call)"

    def quantize_weight(self, weight: torch.Tensor) -> dict[str, torch.Tensor]:
        # Quanto's per-axis qint8: absmax / qmax per output channel, in the weight's dtype.
        scale = weight.abs().amax(dim=1, keepdim=True) / QINT8_MAX
        scale = torch.where(scale == 0, torch.ones_like(scale), scale)
        data = torch.round(weight / scale).clamp_(QINT8_MIN, QINT8_MAX).to(torch.int8)
        return {"weight": data, "weight_scale": scale}

    def dequantize(self, layer, device=None) -> torch.Tensor:
        dtype, t = layer.compute_dtype, layer.tensors_on(device)
        return t["weight"].to(dtype) * t["weight_scale"].to(dtype)

    def apply(self, layer, x: torch.Tensor, input_act: str | None = None) -> torch.Tensor:
        from .kitchen_api import apply_input_act
        t = layer.tensors_for(x)
        dtype = output_dtype(x, layer.compute_dtype)
        weight = t["weight"].to(dtype) * t["weight_scale"].to(dtype)
        bias = t.get("bias")
        return F.linear(apply_input_act(x, input_act).to(dtype), weight, None if bias is None else bias.to(dtype))


@register_format
class QuantoQint8Format(QuantFormat):
    """Quanto's file contract itself (a quantization map, `weight._data` / `weight._scale`) is read by
    `read_quanto` below; the roles are the renamed tensors."""
    name = NAME
    convention = "quanto"
    convention_label = "a Quanto quantization map"
    unsaveable = "Quanto qint8 is weight-only with its own file contract, not a ComfyUI marker format"
    contract = Contract(required=frozenset({"weight", "weight_scale"}), weight_dtypes=("I8",),
                        encodings={"weight_scale": "float"}, scales_as_stored=True, stored_max=128.0,
                        ignored=("input_scale", "output_scale"))   # weight-only layers need them to be 1

    def method(self, **_) -> LinearMethod:
        return QuantoInt8Method()

    def convention_keys(self, file) -> list[str]:
        return [FORMAT_KEY] if file.metadata.get(FORMAT_KEY) == "quanto" else []

    def foreign(self, file) -> str | None:
        """A file that names another quantization format in Quanto's metadata key."""
        kind = file.metadata.get(FORMAT_KEY)
        return None if kind in (None, "quanto") else f"unsupported {FORMAT_KEY} {kind!r} (supported: quanto)"

    def read_convention(self, file):
        notes = ["Quanto qint8 is a resident-memory format, not a speed format: each layer's weight is "
                 "dequantized just before its matmul"]
        return file.result("Quanto qint8", read_quanto(file, self.contract.ignored), notes=notes)


# ---- Self-describing Optimum Quanto qint8 checkpoints (as mmgp/DeepBeepMeep write them), checked strictly ------
# Metadata: `quantization_format` = "quanto" and `quantization_map_base64` = base64(JSON {prefix: {"weights":
# "qint8", "activations": "none"}}). Tensors per prefix: `<prefix>.weight._data` (I8 [out, in]),
# `<prefix>.weight._scale` (float [out, 1]), optionally `<prefix>.input_scale` / `<prefix>.output_scale` (float
# scalars) and `<prefix>.bias`. The contract, as sglang enforces it for the same files: the map's prefixes are
# exactly the `._data` prefixes; weight-only qint8 (any other weight type or activation quantization is
# refused); dtypes and shapes as above; the auxiliary input/output scales equal exactly 1 (weight-only layers
# ignore them). The layers are normalized to the roles `weight` / `weight_scale`.

FORMAT_KEY = "quantization_format"
MAP_KEY = "quantization_map_base64"
DATA_SUFFIX = ".weight._data"
SCALE_SUFFIX = ".weight._scale"


def read_quantization_map(file) -> dict[str, dict]:
    encoded = file.metadata.get(MAP_KEY)
    if encoded is None:
        file.fail(f'{FORMAT_KEY} is "quanto" but the metadata has no {MAP_KEY}')
    try:
        decoded = base64.b64decode(encoded, validate=True)
    except (binascii.Error, ValueError) as exc:
        file.fail(f"{MAP_KEY} is not base64-encoded JSON ({exc})")
    qmap = file.parse_json(decoded, f"{MAP_KEY} is not base64-encoded JSON")
    if not isinstance(qmap, dict) or not all(isinstance(v, dict) for v in qmap.values()):
        file.fail(f"{MAP_KEY} must be a JSON object of {{prefix: {{weights, activations}}}}")
    return qmap


def read_quanto(file, auxiliary: tuple[str, ...]) -> dict:
    """Every declared layer (loaders/conventions.py's ConventionFile), validated against the contract above.
    Raises CheckpointError naming the file and layers."""
    qmap = read_quantization_map(file)
    # What the map declares is checked first: a file of another kind fails with its reason.
    activated = [p for p, entry in qmap.items() if entry.get("activations") != "none"]
    if activated:
        kinds = sorted({file.short_repr(qmap[p].get("activations")) for p in activated})
        file.fail(f"activation quantization is not supported: Quanto layers with activations {', '.join(kinds)}; "
                  f"only weight-only qint8 (activations 'none') loads", activated)
    not_qint8 = [p for p, entry in qmap.items() if entry.get("weights") != "qint8"]
    if not_qint8:
        kinds = sorted({file.short_repr(qmap[p].get("weights")) for p in not_qint8})
        file.fail(f"Quanto weights of type {', '.join(kinds)} are not supported: only qint8 is", not_qint8)

    data_prefixes = [k[:-len(DATA_SUFFIX)] for k in file.tensors if k.endswith(DATA_SUFFIX)]
    with_data = set(data_prefixes)
    only_map = [p for p in qmap if p not in with_data]
    only_data = [p for p in data_prefixes if p not in qmap]
    if only_map or only_data:
        parts = []
        if only_map:
            parts.append(f"in the quantization map but without {DATA_SUFFIX} tensors: {file.name_list(only_map)}")
        if only_data:
            parts.append(f"{DATA_SUFFIX} tensors missing from the quantization map: {file.name_list(only_data)}")
        file.fail("prefix-set mismatch: " + "; ".join(parts), only_map + only_data)

    problems = file.problems
    layers = {}
    for prefix in file.checked(qmap):
        layer = _quanto_layer(file, prefix, auxiliary)
        if layer is not None:
            layers[prefix] = layer
    problems.raise_if_any()
    for layer in file.checked(layers.values()):
        file.check_scales(layer)
        for role in auxiliary:
            key = f"{layer.name}.{role}"
            if key in file.tensors and float(file.read(key).float().reshape(())) != 1.0:
                problems.add(f"non-unit Quanto {role}: weight-only qint8 layers need it to be exactly 1, "
                             f"found {float(file.read(key).float().reshape(()))}", layer.name)
    problems.raise_if_any()
    return layers


def _quanto_layer(file, prefix: str, auxiliary: tuple[str, ...]):
    problems = file.problems
    data_key, scale_key = prefix + DATA_SUFFIX, prefix + SCALE_SUFFIX
    if prefix + ".weight" in file.tensors:
        problems.add("both a plain .weight and a Quanto .weight._data tensor", prefix)
        return None
    if scale_key not in file.tensors:
        problems.add(f"Quanto layer is missing {SCALE_SUFFIX}", prefix)
        return None
    extra = sorted(set(file.companions(prefix)) - {"bias", *auxiliary})
    extra += sorted(f"weight.{suffix}" for suffix, key in file.companions(prefix + ".weight").items()
                    if key not in (data_key, scale_key))
    if extra:
        problems.add(f"unsupported companion tensor(s) for a Quanto qint8 layer: {', '.join(extra)}", prefix)
        return None
    data, scale = file.tensors[data_key], file.tensors[scale_key]
    if not file.expect_dtype(data, ("I8",), "Quanto weight._data", prefix):
        return None
    if len(data.shape) != 2:
        problems.add(f"shape mismatch: Quanto weight._data must be 2-D, found {list(data.shape)}", prefix)
        return None
    if not file.float_scale(scale, "Quanto weight._scale", prefix):
        return None
    if scale.shape != (data.shape[0], 1):
        problems.add(f"shape mismatch: Quanto weight._scale must be [{data.shape[0]}, 1] (per output channel), "
                     f"found {list(scale.shape)}", prefix)
        return None
    for role in auxiliary:
        info = file.tensors.get(f"{prefix}.{role}")
        if info is None:
            continue
        if not file.float_scale(info, f"Quanto {role}", prefix):
            return None
        if not file.is_scalar(info):
            problems.add(f"shape mismatch: Quanto {role} must be a scalar, found {list(info.shape)}", prefix)
            return None
    return file.layer(prefix, NAME, {"weight": data_key, "weight_scale": scale_key}, tuple(data.shape), {},
                      "quanto map")
