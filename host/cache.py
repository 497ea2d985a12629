"""LoadH3Quantized's quantize-once cache, ComfyUI's side: the folder, the key's environment, a hit, and a miss's file.

A load that quantized writes its model as a marker file into the cache folder (loaders/saving.py through
the streaming writer: the model's own tensors, one at a time, into a temporary file renamed when complete);
the next load with the same key (loaders/quant_cache.py: the source's data, the options, the pack's quantizing code,
this device, ComfyUI, torch, Triton, comfy-kitchen and the BIGDIT_* knobs) loads that file through the one load
pipeline as MixedCheckpointLoader loads a marker file, nothing quantized: under dynamic VRAM the host pages its
weights from it through the file slices it marks (Host.file_slices), so RAM holds one copy. A miss's model is paged
from the file it just wrote (host/file_backed.py), not from a scratch file.

A miss's file also carries the first-call checks of the layers auto chose or converted, and a hit makes them again,
their fallbacks from the source file; a fallback a check takes is kept beside the file and taken at the next load
(loaders/entry_checks.py).

The folder: $BIGDIT_QUANT_CACHE, else the first `bigdit_cache` path of ComfyUI's extra_model_paths.yaml, else
models/bigdit_cache. Its limit: $BIGDIT_QUANT_CACHE_GIB (default 100; 0 turns the cache off). Any failure to
use the cache (an entry that does not load, whatever the error) rebuilds it; any failure to write it (a full disk, a
folder that cannot be written) loads as without it; the report says which, and why.
"""
from __future__ import annotations

import dataclasses
import importlib.metadata
import json
import math
import os
import shutil
import time
import weakref
from dataclasses import dataclass

import comfy.model_management
import folder_paths
import torch

from ..hardware import cuda_capability
from ..loaders.checkpoint import TensorSource
from ..loaders.entry_checks import (CHECKS_METADATA, attach_checks, check_tensors, describe_taken, described_checks,
                                    fallbacks_path, keep_fallbacks, read_kept, take_kept)
from ..loaders.errors import CheckpointError
from ..loaders.load import LoadOptions, load, model_contents
from ..loaders.quant_cache import (COMPUTE_METADATA, ENV_FOLDER, ENV_LIMIT, KEPT_METADATA, KEY_METADATA,
                                   QUANTIZING_CODE, DigestMemo, OpenEntry, cache_key, check_entry, code_digest,
                                   entry_name, file_version, key_text, may_hit, missing_reason, plan_write,
                                   remove_stale_partials, scan, source_digest)
from ..loaders.safetensors_writer import data_bytes, encode_header, write_safetensors
from ..loaders.saving import SaveError, save_contents
from ..pack_logging import pack_logger
from ..quant.layer import CONVERT, QUANTIZE
from ..quant.quantize_pass import online_method
from ..units import GIB, MIB, format_gib
from .file_backed import WrittenFile, give_back_pages
from .model import DIFFUSION_PREFIX, quantized_layers, view_modules

log = pack_logger(__name__)

FOLDER_NAME = "bigdit_cache"  # models/<it>, and its name in extra_model_paths.yaml
DEFAULT_LIMIT_GIB = 100.0
LABEL = "quantize-once cache"
#: The host's modules on the path from a file to a cache file's bytes, in the key's code digest beside the core's.
HOST_CODE = ("host/building.py", "host/cache.py", "host/layers.py", "host/model.py")
# the host's interrupt (a user's cancel) passes through a hit; any other failure rebuilds
_INTERRUPTS = tuple(t for t in (getattr(comfy.model_management, "InterruptProcessingException", None),) if t)
_CLEANED: set[str] = set()  # folders whose crash leftovers this process removed


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


def _distribution(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def host_version() -> str | None:
    """ComfyUI's version as it reports itself (its comfyui_version module), None where it does not."""
    try:
        import comfyui_version
    except ImportError:
        return None
    return getattr(comfyui_version, "__version__", None)


def environment(device) -> dict:
    """What decides the quantized bytes besides the file, the options, the pack's code and its knobs: the device,
    the host and the libraries."""
    device = torch.device(device)
    found = {"device": device.type, "comfyui": host_version(), "torch": torch.__version__, "cuda": torch.version.cuda,
             "triton": _distribution("triton"), "comfy_kitchen": _distribution("comfy-kitchen")}
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
    entries, partials = scan(found.folder)
    if found.folder not in _CLEANED:  # the first use in this process: what crashed writes left
        _CLEANED.add(found.folder)
        remove_stale_partials(partials)
    real, memo = os.path.realpath(path), DigestMemo(found.folder)
    inputs = {k: v for k, v in dataclasses.asdict(options).items() if k != "title"}
    code = code_digest(parts=QUANTIZING_CODE + HOST_CODE)

    def entry_of(source):
        key = cache_key(source, inputs, environment(device), code)
        return key, os.path.join(found.folder, entry_name(path, key))

    try:
        before = file_version(real)
        source = source_digest(real, memo) if may_hit(before, memo, entries) else None
    except CheckpointError as exc:  # loading names the file's problem, if it has one
        loaded, report = load(path, options, device, host)
        report.notes.append(f"{LABEL}: skipped (cannot key the file: {exc})")
        return loaded, report, None
    why = "no cache file yet"
    if source is not None:
        key, entry = entry_of(source)
        hit = _hit(entry, key, real, source.version, options, device, host)
        if not isinstance(hit, str):
            return (*hit, None)
        why = hit or missing_reason(entries, key)
    loaded, report = load(path, options, device, host)
    skipped = _not_worth_caching(report)
    if skipped:  # no entry to write, so no digest to take of the file
        report.notes.append(f"{LABEL}: miss ({why}); {skipped}")
        return loaded, report, None
    digested_late = source is None
    try:
        if digested_late:  # no entry could stand for it: its digest now, from what the load read
            source = source_digest(real, memo)
        # a file written meanwhile: the weights may be of either version, an entry for neither
        problem = None if source.version == before == file_version(real) else "the source file changed while it loaded"
    except CheckpointError as exc:
        problem = f"cannot key the file: {exc}"
    if problem is None:
        key, entry = entry_of(source)
        if digested_late and os.path.exists(entry):  # a file the scan could not read as an entry: say what it is
            why = check_entry(entry, key)[1] or why
        written, note, headline = _write(loaded, report, key, entry, found, *scan(found.folder))
        if written is not None:
            taken = _kept_fallbacks(loaded, entry, device)
            note += f"; {taken}" if taken else ""
    else:
        written, note, headline = None, f"not written: {problem}", "cache not written"
    report.notes.append(f"{LABEL}: miss ({why}); {note}")
    if headline:
        report.headline_notes.append(headline)
    return loaded, report, written


#: A load writes an entry only where the layers it quantized or converted held at least this share of the Linear
#: weights' bytes in the source: an entry is the whole model, and quantizing a few plain layers of an already
#: quantized file again (the bf16 refiners of an INT8 file) costs far less than writing and reading that file.
WORTH_CACHING = 0.5


def _not_worth_caching(report) -> str | None:
    """Why the loaded model is not written to the cache, or None where it is."""
    done = sum(record.bytes_before for record in report.records if record.action in (QUANTIZE, CONVERT))
    if not done:
        return "not written: nothing was quantized or converted, the file loads as it is"
    total = report.bytes_before()
    if done < WORTH_CACHING * total:
        return (f"not written: the layers quantized or converted at load held {format_gib(done)} of the "
                f"{format_gib(total)} of Linear weights; quantizing them again costs less than a cache file of the "
                f"whole model")
    return None


def _hit(entry: str, key: dict, path: str, version: str, options: LoadOptions, device, host):
    """(the patcher, the report) of the cache file at `entry` for the source at `path` (keyed as `version` of the
    file), or why it cannot stand for the load ("" where there is none): any failure, whatever its kind, is a reason
    to rebuild."""
    start = time.perf_counter()
    try:
        opened = OpenEntry(entry)  # held while the file loads: the checked file is the loaded one
    except (FileNotFoundError, NotADirectoryError):
        return ""
    except OSError as exc:
        return f"the cache file cannot be opened ({exc})"
    with opened:
        try:
            header, why = check_entry(entry, key)
            if header is None:
                return why
            loaded, report = load(entry, LoadOptions(options.title), device, host)  # as stored: nothing converted
            checked = _checks_again(loaded, header, entry, path, version, options, device, host)
            if not opened.same():
                return "the cache file was replaced while it was checked and loaded"
            wanted, kept = (json.loads(header.metadata.get(name, "null")) for name in (COMPUTE_METADATA, KEPT_METADATA))
            if compute_dtypes(loaded) != wanted or not isinstance(kept, dict):
                return f"stale: the model computes in {compute_dtypes(loaded)} here, the file was written for {wanted}"
            taken = _kept_fallbacks(loaded, entry, device)
        except _INTERRUPTS:
            raise
        except Exception as exc:  # noqa: BLE001 - whatever went wrong, the source can still be loaded
            log.warning("%s: %s does not load, rebuilding it: %s: %s", LABEL, entry, type(exc).__name__, exc)
            return f"the cache file does not load ({type(exc).__name__}: {exc})"
    for record in report.kept:  # as the load that quantized decided them
        record.reason = kept.get(record.name, record.reason)
    try:
        os.utime(entry)  # used now: eviction goes least recently used first
    except OSError:
        pass
    report.notes.insert(0, f"{LABEL}: hit, loaded {entry} as stored ({format_gib(header.file_size)}, "
                           f"{time.perf_counter() - start:.1f} s): nothing was quantized"
                           + (f"; the first-call checks of {checked} layer(s) from its sketches" if checked else "")
                           + (f"; {taken}" if taken else ""))
    report.headline_notes.append("cache hit")
    return loaded, report


def _checks_again(loaded, header, entry: str, path: str, version: str, options: LoadOptions, device, host) -> int:
    """Give a hit's layers the first-call checks its cache file carries (loaders/entry_checks.py), their fallbacks
    from the source file at `path`, which must still be the `version` the key was made from; the number of layers."""
    described = described_checks(header)
    if not described:
        return 0
    source = model_contents(path, options, host)
    selector = None if options.quantization == "none" else online_method(options.quantization, options.group_size,
                                                                         device)
    with TensorSource(entry, header) as held:
        checked = attach_checks(quantized_layers(loaded), held, described, source, selector)
    if file_version(path) != version:  # read after its map was made: the map holds the keyed data
        raise CheckpointError(path, "the source file changed while its cache file loaded")
    return checked


def _kept_fallbacks(loaded, entry: str, device) -> str | None:
    """The fallbacks earlier loads' checks took for `entry`'s layers, taken now (what the report says of them, or
    None); the checks still to run keep theirs for the next load."""
    layers, kept_at = quantized_layers(loaded), fallbacks_path(entry)
    taken = take_kept(layers, read_kept(kept_at), device)
    keep_fallbacks(layers, kept_at)
    return describe_taken(taken, kept_at) if taken else None


def _write(patcher, report, key: dict, entry: str, found: Settings, entries, partials):
    """Write the loaded model (one worth caching: `_not_worth_caching`) to `entry`, given the folder's `entries`
    and `partials` (quant_cache.scan); (the WrittenFile or None, the report's note, a headline or None)."""
    start = time.perf_counter()
    try:
        contents = save_contents(view_modules(patcher, remove_duplicate=False))
    except SaveError as exc:
        return None, f"not written: {exc}", "cache not written"
    checks, described = check_tensors(quantized_layers(patcher))  # what a hit needs to check the same layers
    tensors = contents.tensors + checks
    metadata = {**contents.metadata(f"LoadH3Quantized ({LABEL})"), KEY_METADATA: key_text(key),
                COMPUTE_METADATA: json.dumps(compute_dtypes(patcher)),
                KEPT_METADATA: json.dumps({record.name: record.reason for record in report.kept}),
                **({CHECKS_METADATA: json.dumps(described)} if described else {})}
    size = len(encode_header(tensors, metadata)) + data_bytes(tensors)
    if size > found.limit:
        return None, (f"not written: its {format_gib(size)} are over the cache's limit of "
                      f"{format_gib(found.limit)} ({ENV_LIMIT})"), "cache not written"
    evicted = []
    try:
        os.makedirs(found.folder, exist_ok=True)
        live = remove_stale_partials(partials)
        evict, no_room = plan_write(entries, live, size, found.limit, shutil.disk_usage(found.folder).free,
                                    replacing=entry)
        if no_room:
            return None, f"not written to {found.folder} ({no_room}); loaded as without the cache", "cache not written"
        for old in evict:
            for gone in (old.path, fallbacks_path(old.path)):
                try:
                    os.unlink(gone)
                except FileNotFoundError:  # another server evicted it, or its checks took no fallback
                    pass
            evicted.append(old)
        write_safetensors(entry, tensors, metadata, overwrite=True)
    except OSError as exc:
        log.warning("%s: could not write %s: %s", LABEL, entry, exc)
        return None, (f"not written to {found.folder} ({type(exc).__name__}: {exc}); loaded as without the "
                      "cache"), "cache not written"
    finally:
        give_back_pages(tensor for _, tensor in contents.tensors)
    note = f"wrote {entry} ({format_gib(size)}, {time.perf_counter() - start:.1f} s) for the next load"
    if described:
        note += (f", with the first-call checks of {len(described)} layer(s) "
                 f"({data_bytes(checks) / MIB:.1f} MiB of sketches)")
    if evicted:
        note += (f"; evicted the {len(evicted)} least recently used file(s) "
                 f"({format_gib(sum(e.size for e in evicted))}) to stay under {format_gib(found.limit)}")
    written = WrittenFile(entry, {DIFFUSION_PREFIX + name: (name, weakref.ref(tensor))
                                  for name, tensor in contents.tensors})
    return written, note, "cache written"
