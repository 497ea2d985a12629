"""The first-call checks (quant/real_error.py) a quantize-once cache file carries, and the fallbacks they took.

A miss writes its model before the model's first call, while the checks of the layers auto chose or converted are
still pending. So the file holds what a hit needs to check those layers the same way (`check_tensors`): each one's
sketch, as the layer's companions `<layer>.bigdit_check_sketch` (bf16 [SKETCH_DIM, in]: 128 bytes per input
feature) and `<layer>.bigdit_check_sketch_bias` (fp32 [SKETCH_DIM], where the layer has a bias), which the loaders
never hand to the model (loaders/markers.py CHECK_ROLES); and in the metadata (CHECKS_METADATA) the format each was
built in and its fallbacks' labels. A hit gives each such layer the same check (`attach_checks`): the sketch read
from the file, the fallbacks rebuilt from the source file as the miss built them (auto's later formats and full
precision for a plain weight, the stored layer and its dequantized weight for a conversion), from slices of the
source's map, read only when a check rejects the layer.

A fallback a check takes, in any session, is kept beside the cache file (`fallbacks_path`, one small JSON per
file: by layer, the fallback taken and the numbers; `keep_fallbacks`). The next load of that file (a hit, or a miss
that writes it again) builds those fallbacks at load and computes with them from the first call, unchecked
(`take_kept`): the entry's bytes stay as written, and nothing is checked twice.
"""
from __future__ import annotations

import json
import os
import secrets

import torch

from ..pack_logging import pack_logger
from ..quant.linear import QuantLinear
from ..quant.real_error import (RealError, RealErrorCheck, OutputSketch, auto_fallbacks, conversion_fallbacks)
from ..quant.registry import get_method
from .checkpoint import CheckpointContents, TensorSource
from .errors import CheckpointError
from .markers import CHECK_ROLES
from .safetensors_header import SafetensorsHeader
from .safetensors_writer import SUFFIX

log = pack_logger(__name__)

CHECKS_METADATA = "bigdit_cache_checks"  # {layer: {"format": built in, "fallbacks": [labels, in order]}}
SKETCH, SKETCH_BIAS = CHECK_ROLES
FALLBACKS_SUFFIX = ".fallbacks.json"


# ---- a miss: what the file carries -----------------------------------------------------------------------------

def pending(layers: dict[str, QuantLinear]) -> dict[str, RealErrorCheck]:
    """The layers' first-call checks that are still to run, by layer name."""
    return {name: layer.real_check for name, layer in layers.items()
            if isinstance(layer.real_check, RealErrorCheck) and layer.real_check.pending}


def check_tensors(layers: dict[str, QuantLinear]) -> tuple[list[tuple[str, torch.Tensor]], dict]:
    """(the sketches of the layers' pending checks as the file's tensors, their CHECKS_METADATA)."""
    tensors, described = [], {}
    for name, check in pending(layers).items():
        tensors.append((f"{name}.{SKETCH}", check.sketch.weight))
        if check.sketch.bias is not None:
            tensors.append((f"{name}.{SKETCH_BIAS}", check.sketch.bias))
        described[name] = {"format": layers[name].method.name, "fallbacks": [f.label for f in check.fallbacks]}
    return tensors, described


# ---- a hit: the same checks --------------------------------------------------------------------------------------

def described_checks(header: SafetensorsHeader) -> dict[str, dict]:
    """The checks a cache file carries (CHECKS_METADATA; {} where it carries none); raises CheckpointError where the
    metadata is not what `check_tensors` writes."""
    text = header.metadata.get(CHECKS_METADATA)
    if text is None:
        return {}
    try:
        described = json.loads(text)
    except ValueError:
        described = None
    if not (isinstance(described, dict) and all(
            isinstance(said, dict) and isinstance(said.get("format"), str) and isinstance(said.get("fallbacks"), list)
            for said in described.values())):
        raise CheckpointError(header.path, f"its {CHECKS_METADATA} metadata is not a map of layers to checks")
    return described


def attach_checks(layers: dict[str, QuantLinear], entry: TensorSource, described: dict[str, dict],
                  source: CheckpointContents, selector) -> int:
    """Give each layer `described` names (`described_checks` of the cache file `entry` maps) the check the miss gave
    it: its sketch from `entry`, its fallbacks rebuilt from `source` (the source file in the model's names) with
    `selector` (the load's quantization: auto's later formats). Returns the number of layers. Raises
    CheckpointError, naming the cache file and the layers, where a layer, its sketch or its fallbacks are not what
    the file says; nothing is attached then."""
    if not described:
        return 0
    mapped = source.open()  # read only where a fallback is built
    checks, wrong = {}, {}
    for name, said in described.items():
        layer = layers.get(name)
        if layer is None or layer.method.name != said["format"]:
            wrong.setdefault(f"not a {said['format']} layer of the model", []).append(name)
            continue
        try:
            sketch = OutputSketch.stored(entry(f"{name}.{SKETCH}").clone(),
                                         _optional(entry, f"{name}.{SKETCH_BIAS}"), layer.out_features)
        except (CheckpointError, ValueError) as exc:
            wrong.setdefault(f"no sketch of its check ({exc})", []).append(name)
            continue
        if sketch.weight.shape[1] != layer.in_features:
            wrong.setdefault(f"a sketch of {sketch.weight.shape[1]} input features", []).append(name)
            continue
        fallbacks = _fallbacks(name, layer, source, mapped, selector, said["format"])
        if fallbacks is None or [f.label for f in fallbacks] != said["fallbacks"]:
            found = "none" if fallbacks is None else ", ".join(f.label for f in fallbacks)
            wrong.setdefault(f"its fallbacks were {', '.join(map(str, said['fallbacks']))} and are {found} now",
                             []).append(name)
            continue
        checks[name] = RealErrorCheck(name, sketch, fallbacks)
    if wrong:
        problem, names = next(iter(wrong.items()))
        raise CheckpointError(entry.path, f"first-call checks that cannot be made again: {problem}", names)
    for name, check in checks.items():
        layers[name].real_check = check
    return len(checks)


def _optional(entry: TensorSource, key: str) -> torch.Tensor | None:
    return entry(key).clone() if key in entry.header.tensors else None


def _fallbacks(name: str, layer: QuantLinear, source: CheckpointContents, mapped: TensorSource, selector,
               built_format: str):
    """The fallbacks a miss gave `layer`, from the source: a stored layer's (a conversion), or a plain weight's
    (auto's choice); None where the source has neither under the layer's name."""
    stored = source.layers.get(name)
    if stored is not None:
        return conversion_fallbacks(get_method(stored.format, **stored.options), source.layer_tensors(mapped, name),
                                    layer.in_features, layer.out_features, layer.bias, layer.compute_dtype)
    key = source.plain_keys.get(f"{name}.weight")
    own = next((m for m in getattr(selector, "methods", {}).values() if m.name == built_format), None)
    if key is None or own is None:
        return None
    weight = mapped(key)
    if tuple(weight.shape) != (layer.out_features, layer.in_features):
        return None
    return auto_fallbacks(selector, own, weight, layer.bias, layer.compute_dtype)


# ---- the fallbacks taken, kept beside the file ---------------------------------------------------------------------

def fallbacks_path(entry: str) -> str:
    """Where the fallbacks the checks of the cache file `entry` took are kept."""
    return (entry[:-len(SUFFIX)] if entry.endswith(SUFFIX) else entry) + FALLBACKS_SUFFIX


def read_kept(path: str) -> dict[str, dict]:
    """The fallbacks kept at `path` ({layer: {"runs": the fallback, ...}}); {} where there are none, or none that
    can be read (the checks then run again)."""
    try:
        with open(path, encoding="utf-8") as f:
            kept = json.load(f)
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as exc:
        log.warning("the fallbacks kept in %s cannot be read (%s); the checks run again", path, exc)
        return {}
    if not isinstance(kept, dict):
        return {}
    return {name: taken for name, taken in kept.items()
            if isinstance(taken, dict) and isinstance(taken.get("runs"), str)}


def keep_fallback(path: str, outcome: RealError) -> None:
    """Add the fallback a check took (`outcome`) to those kept at `path`; a file that cannot be written is logged and
    left (the next load checks the layer again)."""
    kept = read_kept(path)
    kept[outcome.name] = {"runs": outcome.runs, "format": outcome.format, "error": outcome.error,
                          "sampled": outcome.sampled, "rows": outcome.rows, "tried": [list(t) for t in outcome.tried]}
    tmp = f"{path}.{secrets.token_hex(4)}.tmp"
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(kept, f, indent=1, sort_keys=True)
        os.replace(tmp, path)
    except OSError as exc:
        log.warning("could not keep %s's fallback in %s (%s); the next load checks it again", outcome.name, path, exc)
        try:
            os.unlink(tmp)
        except OSError:
            pass


def keep_fallbacks(layers: dict[str, QuantLinear], path: str) -> None:
    """Have the layers' pending checks keep the fallback they take at `path`."""
    for check in pending(layers).values():
        check.on_fallback = lambda outcome: keep_fallback(path, outcome)


def take_kept(layers: dict[str, QuantLinear], kept: dict[str, dict], device: torch.device) -> list[tuple[str, dict]]:
    """Each layer with a fallback in `kept` (read_kept) computes with it from its first call, unchecked, built now
    on `device`; the (layer, what was kept) taken. A layer whose check has no such fallback is checked as usual."""
    checks, taken = pending(layers), []
    for name, said in kept.items():
        check = checks.get(name)
        if check is not None and check.take(said["runs"], device):
            taken.append((name, said))
    return taken


def describe_taken(taken: list[tuple[str, dict]], path: str) -> str:
    """One line for the report: the layers that compute with a kept fallback."""
    shown = "; ".join(f"{name}: {said.get('format', '?')} -> {said['runs']}" for name, said in taken[:3])
    more = "; ..." if len(taken) > 3 else ""
    return (f"{len(taken)} layer(s) compute with the fallback an earlier load's first-call check took, unchecked "
            f"({shown}{more}; kept in {os.path.basename(path)})")
