"""LoadH3Quantized's quantize-once cache, ComfyUI's side: the folder, a hit, and a miss's file.

A load that quantized writes its model as a marker file into the cache folder (loaders/saving.py through
the streaming writer: the model's own tensors, one at a time, into a temporary file renamed when complete);
the next load with the same key (loaders/quant_cache.py) loads that file through the one load pipeline as
MixedCheckpointLoader loads a marker file, nothing quantized: under dynamic VRAM the host pages its weights
from it through the file slices it marks (Host.file_slices), so RAM holds one copy. A miss's model is paged
from the file it just wrote (host/file_backed.py), not from a scratch file.

The folder: $BIGDIT_QUANT_CACHE, else the first `bigdit_cache` path of ComfyUI's extra_model_paths.yaml, else
models/bigdit_cache. Its limit: $BIGDIT_QUANT_CACHE_GIB (default 100; 0 turns the cache off). Any failure to
use or write the cache (a full disk, a folder that cannot be written) falls back to loading as without it, and
the report says so.
"""
from __future__ import annotations

import dataclasses
import importlib.metadata
import json
import math
import os
import time
import weakref
from dataclasses import dataclass

import folder_paths
import torch

from ..hardware import cuda_capability
from ..loaders.errors import CheckpointError
from ..loaders.load import LoadOptions, load
from ..loaders.quant_cache import (COMPUTE_METADATA, KEPT_METADATA, KEY_METADATA, cache_key, check_entry,
                                   entry_name, evictions, key_text, scan)
from ..loaders.safetensors_writer import data_bytes, encode_header, write_safetensors
from ..loaders.saving import SaveError, pack_version, save_contents
from ..pack_logging import pack_logger
from ..quant.layer import CONVERT, QUANTIZE
from ..units import GIB, format_gib
from .file_backed import WrittenFile, give_back_pages
from .model import DIFFUSION_PREFIX, quantized_layers, view_modules

log = pack_logger(__name__)

ENV_FOLDER, ENV_LIMIT = "BIGDIT_QUANT_CACHE", "BIGDIT_QUANT_CACHE_GIB"
FOLDER_NAME = "bigdit_cache"  # models/<it>, and its name in extra_model_paths.yaml
DEFAULT_LIMIT_GIB = 100.0
LABEL = "quantize-once cache"


@dataclass(frozen=True)
class Settings:
    folder: str
    limit: int  # bytes


def settings() -> tuple[Settings | None, str]:
    """(the cache's folder and limit, "") or (None, why it is off)."""
    text = os.environ.get(ENV_LIMIT, "").strip()
    try:
        gib = float(text) if text else DEFAULT_LIMIT_GIB
    except ValueError:
        gib = math.nan
    if not (math.isfinite(gib) and gib >= 0):
        return None, f"{ENV_LIMIT}={text!r} is not a number of GiB"
    if gib == 0:
        return None, f"{ENV_LIMIT}=0"
    return Settings(cache_folder(), int(gib * GIB)), ""


def cache_folder() -> str:
    """The cache's folder, whether the cache is on or off (the tuning store sits beside it, host/tuning.py)."""
    folder = os.environ.get(ENV_FOLDER, "").strip()
    if not folder:
        try:
            folder = folder_paths.get_folder_paths(FOLDER_NAME)[0]
        except (KeyError, IndexError):  # not in extra_model_paths.yaml
            folder = os.path.join(folder_paths.models_dir, FOLDER_NAME)
    return os.path.abspath(folder)


def environment(device) -> dict:
    """What decides the quantized bytes besides the file and the options: the device and the libraries."""
    device = torch.device(device)
    try:
        kitchen = importlib.metadata.version("comfy-kitchen")
    except importlib.metadata.PackageNotFoundError:
        kitchen = None
    found = {"device": device.type, "torch": torch.__version__, "comfy_kitchen": kitchen}
    if device.type == "cuda":
        found.update(name=torch.cuda.get_device_name(device), capability=list(cuda_capability(device)))
    return found


def compute_dtypes(patcher) -> list[str]:
    return sorted({str(layer.compute_dtype) for layer in quantized_layers(patcher).values()})


def load_with_cache(path: str, options: LoadOptions, device, host) -> tuple[object, object, WrittenFile | None]:
    """(the patcher, the report, the cache file the model was written to, if it was): `path` loaded through the
    cache (see the module's docstring); the report says whether it was hit, missed or skipped, and why."""
    found, why = settings()
    if found is None:
        loaded, report = load(path, options, device, host)
        report.notes.append(f"{LABEL}: off ({why})")
        return loaded, report, None
    try:
        key = cache_key(path, {k: v for k, v in dataclasses.asdict(options).items() if k != "title"},
                        environment(device), pack_version())
    except (CheckpointError, OSError) as exc:  # loading names the file's problem, if it has one
        loaded, report = load(path, options, device, host)
        report.notes.append(f"{LABEL}: skipped (cannot key the file: {exc})")
        return loaded, report, None
    entry = os.path.join(found.folder, entry_name(key))
    header, why = check_entry(entry, key)
    if header is not None:
        hit = _hit(entry, header, options, device, host)
        if isinstance(hit, str):
            why = hit
        else:
            return (*hit, None)
    loaded, report = load(path, options, device, host)
    written, note, headline = _write(loaded, report, key, entry, found)
    report.notes.append(f"{LABEL}: miss ({why}); {note}")
    if headline:
        report.headline_notes.append(headline)
    return loaded, report, written


def _hit(entry: str, header, options: LoadOptions, device, host):
    """(the patcher, the report) of the cache file at `entry`, or why it cannot stand for the load."""
    start = time.perf_counter()
    try:
        loaded, report = load(entry, LoadOptions(options.title), device, host)  # as stored: nothing converted
    except (CheckpointError, OSError) as exc:
        return f"the cache file does not load ({exc})"
    try:
        wanted, kept = (json.loads(header.metadata.get(name, "null")) for name in (COMPUTE_METADATA, KEPT_METADATA))
    except ValueError:
        wanted = kept = None
    if compute_dtypes(loaded) != wanted or not isinstance(kept, dict):
        return f"stale: the model computes in {compute_dtypes(loaded)} here, the file was written for {wanted}"
    for record in report.kept:  # as the load that quantized decided them
        record.reason = kept.get(record.name, record.reason)
    try:
        os.utime(entry)  # used now: eviction goes least recently used first
    except OSError:
        pass
    report.notes.insert(0, f"{LABEL}: hit, loaded {entry} as stored ({format_gib(header.file_size)}, "
                           f"{time.perf_counter() - start:.1f} s): nothing was quantized")
    report.headline_notes.append("cache hit")
    return loaded, report


def _write(patcher, report, key: dict, entry: str, found: Settings):
    """Write the loaded model to `entry`; (the WrittenFile or None, the report's note, a headline or None)."""
    start = time.perf_counter()
    if not any(record.action in (QUANTIZE, CONVERT) for record in report.records):
        return None, "not written: nothing was quantized or converted, the file loads as it is", None
    try:
        contents = save_contents(view_modules(patcher, remove_duplicate=False))
    except SaveError as exc:
        return None, f"not written: {exc}", "cache not written"
    metadata = {**contents.metadata(f"LoadH3Quantized ({LABEL})"), KEY_METADATA: key_text(key),
                COMPUTE_METADATA: json.dumps(compute_dtypes(patcher)),
                KEPT_METADATA: json.dumps({record.name: record.reason for record in report.kept})}
    size = len(encode_header(contents.tensors, metadata)) + data_bytes(contents.tensors)
    if size > found.limit:
        return None, (f"not written: its {format_gib(size)} are over the cache's limit of "
                      f"{format_gib(found.limit)} ({ENV_LIMIT})"), "cache not written"
    evicted = []
    try:
        os.makedirs(found.folder, exist_ok=True)
        entries, partials = scan(found.folder)
        for leftover in partials:
            os.unlink(leftover)
        for old in evictions(entries, size, found.limit, replacing=entry):
            os.unlink(old.path)
            evicted.append(old)
        write_safetensors(entry, contents.tensors, metadata, overwrite=True)
    except OSError as exc:
        log.warning("%s: could not write %s: %s", LABEL, entry, exc)
        return None, (f"not written to {found.folder} ({type(exc).__name__}: {exc}); loaded as without the "
                      "cache"), "cache not written"
    finally:
        give_back_pages(tensor for _, tensor in contents.tensors)
    note = f"wrote {entry} ({format_gib(size)}, {time.perf_counter() - start:.1f} s) for the next load"
    if evicted:
        note += (f"; evicted the {len(evicted)} least recently used file(s) "
                 f"({format_gib(sum(e.size for e in evicted))}) to stay under {format_gib(found.limit)}")
    written = WrittenFile(entry, {DIFFUSION_PREFIX + name: (name, weakref.ref(tensor))
                                  for name, tensor in contents.tensors})
    return written, note, "cache written"
