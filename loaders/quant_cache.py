"""The quantize-once cache's pure parts: a load's key, its file's name, whether a file may be trusted, eviction.

A load that quantized keeps its model as a marker file (loaders/saving.py) in a cache folder; the next load
with the same key loads that file as stored. The key is what the quantized bytes depend on: the source file
(its real path, size, modification time and a hash of its header), the load's options, the environment that
decides them (device, compute capability, torch and comfy-kitchen) and the pack's version and cache layout.
A file's name holds a hash of the source's path and the options only, so a load after the source, the pack or
the device changed finds the old file at its entry's name and rebuilds it in place (no stale file lingers); its
metadata holds the whole key, and it is used only where that repeats the key exactly. A file cut short fails its header's sizes (safetensors_header.read_header).

Only the pack's own files count (an entry's name pattern and a key in its metadata): they are evicted least
recently used first (a hit touches its file) to keep the folder under its limit; anything else in the folder
is never read as a model, counted or removed. Work on the folder is bounded by MAX_ENTRIES.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import struct
import time
from dataclasses import dataclass

from .errors import CheckpointError
from .safetensors_header import MAX_HEADER_BYTES, SafetensorsHeader, read_header
from .safetensors_writer import SUFFIX

#: Bumped when what a cache file holds changes meaning (its layout, or what a hit assumes of it).
CACHE_LAYOUT = 1
KEY_METADATA = "bigdit_cache_key"              # the whole key, as key_text writes it
COMPUTE_METADATA = "bigdit_cache_compute_dtypes"  # the quantized layers' compute dtypes, checked once built
KEPT_METADATA = "bigdit_cache_kept"            # {layer: why the load that wrote it kept it}, for a hit's report
MAX_ENTRIES = 4096                             # directory entries looked at when the folder is scanned
MAX_SCANNED_HEADER = 16 * 2 ** 20              # the most of a header read to tell a cache file (theirs are smaller)
PARTIAL_AGE_S = 3600                           # a write's temporary file older than this was left by a crash
_NAME = re.compile(r"[A-Za-z0-9._-]{1,64}-[0-9a-f]{20}" + re.escape(SUFFIX))
_PARTIAL = re.compile(r"\.[A-Za-z0-9._-]{1,64}-[0-9a-f]{20}" + re.escape(SUFFIX) + r"\.[0-9a-f]{8}\.partial")
# the key's parts a file's name does not hold, by what a change of each means
_STALE = {"source": "the source file changed", "environment": "the device or torch/comfy-kitchen changed",
          "pack": "the pack's version changed", "layout": "the cache's layout changed"}


def header_digest(path: str) -> str:
    """sha256 of the file's 8-byte length and JSON header (names, dtypes, shapes, offsets, metadata)."""
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            raw = f.read(8)
            (length,) = struct.unpack("<Q", raw) if len(raw) == 8 else (None,)
            if length is None or length > min(MAX_HEADER_BYTES, size - 8):
                raise CheckpointError(path, "not a safetensors file (its header length is not inside the file)")
            return hashlib.sha256(raw + f.read(length)).hexdigest()
    except OSError as exc:
        raise CheckpointError(path, f"cannot read the file ({exc.strerror or exc})") from exc


def cache_key(source: str, options: dict, environment: dict, pack: str) -> dict:
    """The key of a load of `source` with `options` (JSON values) in `environment`, by the pack at version `pack`."""
    real = os.path.realpath(source)
    stat = os.stat(real)
    key = {"layout": CACHE_LAYOUT, "pack": pack, "options": options, "environment": environment,
           "source": {"path": real, "size": stat.st_size, "mtime_ns": stat.st_mtime_ns,
                      "header_sha256": header_digest(real)}}
    return json.loads(key_text(key))  # as a file's metadata reads back (tuples become lists)


def key_text(key: dict) -> str:
    return json.dumps(key, sort_keys=True, separators=(",", ":"))


def entry_name(key: dict) -> str:
    """The file name of the key's entry: the source's name (shortened to safe characters) and a hash of its
    path and the options."""
    stem = os.path.basename(key["source"]["path"])
    stem = re.sub(r"[^A-Za-z0-9._-]", "_", stem[:-len(SUFFIX)] if stem.endswith(SUFFIX) else stem)[:64]
    where = key_text({"path": key["source"]["path"], "options": key["options"]})
    return f"{stem.lstrip('.') or 'model'}-{hashlib.sha256(where.encode()).hexdigest()[:20]}{SUFFIX}"


def check_entry(path: str, key: dict) -> tuple[SafetensorsHeader | None, str]:
    """(the header, "") where the file at `path` is the entry of `key`; else (None, why not)."""
    if not os.path.isfile(path):
        return None, "no cache file yet"
    try:
        header = read_header(path)
    except CheckpointError as exc:
        return None, f"the cache file is damaged or cut short ({exc.problem})"
    stored = header.metadata.get(KEY_METADATA)
    try:
        stored = json.loads(stored) if stored is not None else None
    except ValueError:
        stored = None
    if not isinstance(stored, dict):
        return None, "the file there was not written by the cache"
    if stored.get("options") != key["options"] or stored.get("source", {}).get("path") != key["source"]["path"]:
        return None, "the file there was written for another source file or other options"
    changed = [why for part, why in _STALE.items() if stored.get(part) != key[part]]
    if changed or key_text(stored) != key_text(key):
        return None, "stale: " + ("; ".join(changed) or "its key differs")
    return header, ""


@dataclass(frozen=True)
class Entry:
    path: str
    size: int
    used: float     # modification time: when it was written or last hit


def is_entry(path: str) -> bool:
    """Whether `path` is one of the cache's files: its name pattern, and a key in its metadata."""
    if not _NAME.fullmatch(os.path.basename(path)):
        return False
    try:
        return KEY_METADATA in read_header(path, max_header_bytes=MAX_SCANNED_HEADER).metadata
    except CheckpointError:
        return False


def scan(folder: str) -> tuple[list[Entry], list[str]]:
    """(the cache's files in `folder`, the temporary files of writes a crash left there), looking at no more
    than MAX_ENTRIES directory entries."""
    entries, partials, now = [], [], time.time()
    try:
        with os.scandir(folder) as listing:
            for seen, item in enumerate(listing):
                if seen >= MAX_ENTRIES:
                    break
                try:
                    if not item.is_file(follow_symlinks=False):
                        continue
                    if _PARTIAL.fullmatch(item.name):
                        if now - item.stat().st_mtime > PARTIAL_AGE_S:
                            partials.append(item.path)
                    elif is_entry(item.path):
                        stat = item.stat()
                        entries.append(Entry(item.path, stat.st_size, stat.st_mtime))
                except OSError:  # gone meanwhile (another server evicting)
                    continue
    except FileNotFoundError:
        pass
    return entries, partials


def evictions(entries: list[Entry], incoming: int, limit: int, replacing: str | None = None) -> list[Entry]:
    """The entries to remove, least recently used first, so that the rest and `incoming` bytes fit in `limit`
    (`replacing`: the entry the new file replaces, which goes anyway)."""
    kept = sorted((e for e in entries if e.path != replacing), key=lambda e: (e.used, e.path))
    used, out = sum(e.size for e in kept), []
    while kept and used + incoming > limit:
        oldest = kept.pop(0)
        used -= oldest.size
        out.append(oldest)
    return out
