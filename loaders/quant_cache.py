"""The quantize-once cache's pure parts: a load's key, its entry's name, whether a file is that entry, the folder's
scan and the plan of a write (its room and what it evicts).

A load that quantized keeps its model as a marker file (loaders/saving.py) in a cache folder; the next load with the
same key loads that file as stored. The key is everything the quantized bytes can depend on:
- the source's data: its size and a sha256 of all its bytes (`source_digest`; a copy with other data and the same
  name, size, header and modification time is another file). The digest is worked out once per version of the file
  and remembered in the folder (`DigestMemo`), by the file's device, inode, size, modification and change times;
  where no entry can stand for a load (`may_hit`), the host reads it after the load;
- the load's options;
- the pack's own code that decides and produces the bytes: a digest of its source (`code_digest`), not a version
  someone must remember to bump;
- the environment: device, host and libraries (the host says which: ComfyUI, torch, Triton, comfy-kitchen);
- every `BIGDIT_*` environment variable but those named in NOT_KEYED (`knobs`): a new knob is in the key unless
  someone states here why it cannot change a cache file;
- the cache's layout.
An entry's name holds a hash of the whole key, so loads with different keys (two servers with other GPUs or torch
sharing one folder) keep an entry each and never rewrite each other's; its metadata holds the key, and a file is
used only where that repeats the key exactly.

A hit opens its file once (`OpenEntry`) and holds it while it loads by path: the cache only ever replaces a file by
renaming a new one over it, and an inode held open cannot be reused, so a path that still names the held inode after
the load named it throughout (the header checked and every tensor loaded are that file's).

An entry carries its layers' first-call checks, and the fallbacks they take are kept beside it (`entry_checks.py`;
removed with the entry). Only the pack's own files count (an entry's name pattern and a key in its metadata), and the
hidden temporary files of writes (`.partial`): a live write's counts against the limit, one a crash left (not written to for PARTIAL_AGE_S)
is removed. Entries are evicted least recently used first (a hit touches its file) to keep the folder under its
limit; a write first checks its room on the disk, with a margin, and evicts nothing where it has none. Anything else
in the folder is never read as a model, counted or removed. Work on the folder is bounded by MAX_ENTRIES.
"""
from __future__ import annotations

import functools
import hashlib
import json
import os
import re
import secrets
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from ..threads import name_this_thread
from ..units import MIB, format_gib
from .errors import CheckpointError
from .safetensors_header import SafetensorsHeader, read_header
from .safetensors_writer import SUFFIX
from .saving import PACK_ROOT

#: Bumped when what a cache file holds changes meaning (its layout, or what a hit assumes of it).
CACHE_LAYOUT = 3
KEY_METADATA = "bigdit_cache_key"              # the whole key, as key_text writes it
COMPUTE_METADATA = "bigdit_cache_compute_dtypes"  # the quantized layers' compute dtypes, checked once built
KEPT_METADATA = "bigdit_cache_kept"            # {layer: why the load that wrote it kept it}, for a hit's report
MAX_ENTRIES = 4096                             # directory entries looked at when the folder is scanned
MAX_SCANNED_HEADER = 16 * 2 ** 20              # the most of a header read to tell a cache file (theirs are smaller)
PARTIAL_AGE_S = 600                            # a write appends every few seconds: a temporary file left this long
                                               # was left by a crash

#: The pack's code that decides and produces a cache file's bytes (folders: every .py under them); the host adds
#: its own modules on that path (host/cache.py).
QUANTIZING_CODE = ("quant", "loaders", "dtypes.py", "hardware.py", "units.py")

ENV_FOLDER, ENV_LIMIT = "BIGDIT_QUANT_CACHE", "BIGDIT_QUANT_CACHE_GIB"
KNOB_PREFIX = "BIGDIT_"
#: The BIGDIT_* environment variables that cannot change a cache file, and why; every other one is in the key
#: (tests/test_quant_cache.py checks the pack's sources against this list).
NOT_KEYED = {
    ENV_FOLDER: "the cache's own folder",
    ENV_LIMIT: "the cache's own size limit",
    "BIGDIT_SOL_MIN_TOKENS": "Sol attention's threshold, read while sampling",
    "BIGDIT_READ_AHEAD": "whether a queued prompt's files are read into the page cache, before any load",
}

_NAME = re.compile(r"[A-Za-z0-9._-]{1,64}-[0-9a-f]{20}" + re.escape(SUFFIX))
_PARTIAL = re.compile(r"\.[A-Za-z0-9._-]{1,64}-[0-9a-f]{20}" + re.escape(SUFFIX) + r"\.[0-9a-f]{8}\.partial")
# the key's parts, by what a difference in each means (a miss's report names them)
PARTS = {"source": "the source file's data", "options": "the load's inputs", "code": "the pack's quantizing code",
         "environment": "the device, ComfyUI, torch, Triton or comfy-kitchen",
         "knobs": "a BIGDIT_* environment variable", "layout": "the cache's layout"}


# ---- the key ------------------------------------------------------------------------------------------------------

@functools.cache
def code_digest(root: str = str(PACK_ROOT), parts: tuple[str, ...] = QUANTIZING_CODE) -> str:
    """sha256 of the names and contents of the .py files of `parts` (folders, searched whole, and files) under
    `root`; once per process. A part that is missing counts as its name alone."""
    digest = hashlib.sha256()
    for part in sorted(parts):
        base = Path(root, part)
        files = sorted(base.rglob("*.py")) if base.is_dir() else [base]
        for path in files:
            if "__pycache__" in path.parts:
                continue
            digest.update(path.relative_to(root).as_posix().encode() + b"\0")
            digest.update(hashlib.sha256(path.read_bytes()).digest() if path.is_file() else b"missing")
    return digest.hexdigest()


def knobs(environ=os.environ) -> dict[str, str]:
    """The environment's BIGDIT_* variables that can change a cache file: all but NOT_KEYED."""
    return {name: value for name, value in sorted(environ.items())
            if name.startswith(KNOB_PREFIX) and name not in NOT_KEYED}


DIGEST_CHUNK = 16 * MIB
DIGEST_THREADS = 8
MEMO_NAME = ".bigdit_source_digests.json"
MAX_MEMO = 256          # files remembered; the least recently used are forgotten
MEMO_SETTLE_S = 2.0     # a file changed this recently is not remembered (filesystems with coarse timestamps)


def file_digest(path: str) -> tuple[str, os.stat_result]:
    """(sha256 of the file: of its size and of the sha256 of each DIGEST_CHUNK bytes, the chunks hashed on up to
    DIGEST_THREADS threads; the file's stat when it was read). Raises CheckpointError where the file changed while
    it was read."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_BINARY", 0))
    except OSError as exc:
        raise CheckpointError(path, f"cannot read the file ({exc.strerror or exc})") from exc
    try:
        before = os.fstat(fd)

        def chunk(offset: int) -> bytes:
            return hashlib.sha256(os.pread(fd, DIGEST_CHUNK, offset)).digest()

        offsets = range(0, before.st_size, DIGEST_CHUNK)
        with ThreadPoolExecutor(max(1, min(DIGEST_THREADS, os.cpu_count() or 1, len(offsets))),
                                initializer=name_this_thread, initargs=("bigdit-digest",)) as pool:
            digest = hashlib.sha256(before.st_size.to_bytes(8, "little"))
            for part in pool.map(chunk, offsets):
                digest.update(part)
        after = os.fstat(fd)
    except OSError as exc:
        raise CheckpointError(path, f"cannot read the file ({exc.strerror or exc})") from exc
    finally:
        os.close(fd)
    if _version(before) != _version(after):
        raise CheckpointError(path, "the file changed while it was read")
    return digest.hexdigest(), before


def _version(stat: os.stat_result) -> str:
    """What tells one version of a file from another: its device and inode (a copy is another file), size, and its
    modification and change times (a write changes both; a copy can keep the first, never the second)."""
    return f"{stat.st_dev}:{stat.st_ino}:{stat.st_size}:{stat.st_mtime_ns}:{stat.st_ctime_ns}"


class DigestMemo:
    """The digests of source files already read, in the cache folder (MEMO_NAME), by each file's `_version`; a file
    the memo cannot be read or written from is hashed again, nothing else."""

    def __init__(self, folder: str):
        self.path = os.path.join(folder, MEMO_NAME)

    def _read(self) -> dict:
        try:
            with open(self.path, encoding="utf-8") as f:
                found = json.load(f)
        except (OSError, ValueError):
            return {}
        return found if isinstance(found, dict) else {}

    def get(self, version: str) -> str | None:
        found = self._read().get(version)
        return found[0] if isinstance(found, list) and len(found) == 2 and isinstance(found[0], str) else None

    def put(self, version: str, digest: str) -> None:
        memo = self._read()
        memo[version] = [digest, time.time()]
        kept = dict(sorted(memo.items(), key=lambda item: _used(item[1]))[-MAX_MEMO:])
        tmp = f"{self.path}.{secrets.token_hex(4)}.tmp"
        try:
            os.makedirs(os.path.dirname(self.path), exist_ok=True)
            with open(tmp, "w", encoding="utf-8") as f:
                json.dump(kept, f)
            os.replace(tmp, self.path)
        except OSError:
            try:
                os.unlink(tmp)
            except OSError:
                pass


def _used(value) -> float:
    return value[1] if isinstance(value, list) and len(value) == 2 and isinstance(value[1], (int, float)) else 0.0


@dataclass(frozen=True)
class Source:
    """A source file's data as the key knows it (its size and sha256), and the version of the file (`file_version`)
    they were read from."""
    version: str
    size: int
    sha256: str


def file_version(path: str) -> str:
    try:
        return _version(os.stat(path))
    except OSError as exc:
        raise CheckpointError(path, f"cannot read the file ({exc.strerror or exc})") from exc


def source_digest(path: str, memo: DigestMemo | None = None) -> Source:
    """The file at `path` as file_digest reads it, from `memo` where it holds this version of the file, else read
    whole and remembered there."""
    version = file_version(path)
    known = memo.get(version) if memo is not None else None
    if known is not None:
        return Source(version, int(version.split(":")[2]), known)
    digest, stat = file_digest(path)
    if memo is not None and time.time() - stat.st_ctime > MEMO_SETTLE_S:
        memo.put(_version(stat), digest)
    return Source(_version(stat), stat.st_size, digest)


def may_hit(version: str, memo: DigestMemo, entries: list["Entry"]) -> bool:
    """Whether a load of this version of a file can hit: the memo knows its digest, or an entry of the folder was
    written from a file of its size. Elsewhere the load is a miss whatever the file holds, and its digest can wait
    until the load has read the file (from the page cache then, where it fits)."""
    size = int(version.split(":")[2])
    return memo.get(version) is not None or any(isinstance(entry.key.get("source"), dict) and
                                                entry.key["source"].get("size") == size for entry in entries)


def cache_key(source: Source, options: dict, environment: dict, code: str, environ=os.environ) -> dict:
    """The key of a load of `source` with `options` (JSON values) in `environment` by the pack's code `code`
    (code_digest), with the knobs of `environ`."""
    key = {"layout": CACHE_LAYOUT, "code": code, "options": options, "environment": environment,
           "knobs": knobs(environ), "source": {"size": source.size, "sha256": source.sha256}}
    return json.loads(key_text(key))  # as a file's metadata reads back (tuples become lists)


def key_text(key: dict) -> str:
    return json.dumps(key, sort_keys=True, separators=(",", ":"))


def entry_name(source: str, key: dict) -> str:
    """The file name of the key's entry: the source's name (shortened to safe characters) and a hash of the whole
    key."""
    stem = os.path.basename(os.path.realpath(source))
    stem = re.sub(r"[^A-Za-z0-9._-]", "_", stem[:-len(SUFFIX)] if stem.endswith(SUFFIX) else stem)[:64]
    return f"{stem.lstrip('.') or 'model'}-{hashlib.sha256(key_text(key).encode()).hexdigest()[:20]}{SUFFIX}"


def differences(stored: dict, key: dict) -> list[str]:
    """What differs between two keys, as PARTS says it."""
    return [why for part, why in PARTS.items() if stored.get(part) != key.get(part)]


def missing_reason(entries: list["Entry"], key: dict) -> str:
    """Why no entry stood for `key` where none was at its name: the folder's entries of the same source data, if
    any, and what their keys differ in."""
    same_source = [entry for entry in entries if entry.key.get("source") == key["source"]]
    if not same_source:
        return "no cache file yet"
    parts = sorted({why for entry in same_source for why in differences(entry.key, key)})
    return (f"no cache file for this key yet; the folder's {len(same_source)} file(s) of this source differ in: "
            + ", ".join(parts))


# ---- a hit --------------------------------------------------------------------------------------------------------

def stored_key(header: SafetensorsHeader) -> dict | None:
    """The key in a file's metadata, or None where it holds none."""
    try:
        stored = json.loads(header.metadata.get(KEY_METADATA, "null"))
    except ValueError:
        return None
    return stored if isinstance(stored, dict) else None


class OpenEntry:
    """The file at an entry's name, opened once and held (see the module's docstring); `same()` tells whether the
    path still names it. Use as a context manager."""

    def __init__(self, path: str):
        self.path = path
        self._fd = os.open(path, os.O_RDONLY | getattr(os, "O_BINARY", 0))
        stat = os.fstat(self._fd)
        self.identity = (stat.st_dev, stat.st_ino, stat.st_size)

    def same(self) -> bool:
        try:
            stat = os.stat(self.path)
        except OSError:
            return False
        return (stat.st_dev, stat.st_ino, stat.st_size) == self.identity

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def __enter__(self) -> "OpenEntry":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def check_entry(path: str, key: dict) -> tuple[SafetensorsHeader | None, str]:
    """(the header, "") where the file at `path` is the entry of `key`; else (None, why not)."""
    try:
        header = read_header(path)
    except CheckpointError as exc:
        return None, f"the cache file is damaged or cut short ({exc.problem})"
    stored = stored_key(header)
    if stored is None:
        return None, "the file there was not written by the cache"
    if key_text(stored) != key_text(key):
        return None, "the file there was written for another key (" + ("; ".join(differences(stored, key))
                                                                         or "its key differs") + ")"
    return header, ""


# ---- the folder ---------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Entry:
    path: str
    size: int
    used: float     # modification time: when it was written or last hit
    key: dict = field(default_factory=dict)


@dataclass(frozen=True)
class Partial:
    path: str
    size: int
    stale: bool     # not written to for PARTIAL_AGE_S: left by a crash


def entry_key(path: str) -> dict | None:
    """The key of the cache's file at `path` (its name pattern, and a key in its metadata), or None where it is
    not one."""
    if not _NAME.fullmatch(os.path.basename(path)):
        return None
    try:
        return stored_key(read_header(path, max_header_bytes=MAX_SCANNED_HEADER))
    except CheckpointError:
        return None


def is_entry(path: str) -> bool:
    return entry_key(path) is not None


def scan(folder: str) -> tuple[list[Entry], list[Partial]]:
    """(the cache's files in `folder`, the temporary files of writes there), looking at no more than MAX_ENTRIES
    directory entries."""
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
                        stat = item.stat()
                        partials.append(Partial(item.path, stat.st_size, now - stat.st_mtime > PARTIAL_AGE_S))
                    elif (key := entry_key(item.path)) is not None:
                        stat = item.stat()
                        entries.append(Entry(item.path, stat.st_size, stat.st_mtime, key))
                except OSError:  # gone meanwhile (another server evicting)
                    continue
    except OSError:  # no folder yet, or none that can be read: nothing of the cache's (a write says why)
        pass
    return entries, partials


def remove_stale_partials(partials: list[Partial]) -> list[Partial]:
    """Remove the temporary files crashes left; the rest (live writes)."""
    live = []
    for partial in partials:
        if not partial.stale:
            live.append(partial)
            continue
        try:
            os.unlink(partial.path)
        except OSError:  # gone meanwhile
            pass
    return live


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


def room_margin(size: int) -> int:
    """What a write leaves free on the disk beyond its file: a twentieth of it, at least 256 MiB."""
    return max(size // 20, 256 * MIB)


def plan_write(entries: list[Entry], live: list[Partial], size: int, limit: int, free: int,
               replacing: str | None = None) -> tuple[list[Entry], str]:
    """(the entries to evict, "") for a new file of `size` bytes, where the limit counts the cache's files and the
    live writes (`live`); or ([], why not) where the disk's `free` bytes, with what those evictions free, leave less
    than the file and its margin: nothing is evicted then."""
    evicted = evictions(entries, size + sum(p.size for p in live), limit, replacing)
    freed = sum(e.size for e in evicted) + sum(e.size for e in entries if e.path == replacing)
    need = size + room_margin(size)
    if free + freed < need:
        return [], (f"not enough disk space: {format_gib(size)} and a margin of {format_gib(room_margin(size))} "
                    f"needed, {format_gib(free)} free" + (f" ({format_gib(freed)} more once the cache's evictions "
                                                         "are done)" if freed else "") + "; nothing was evicted")
    return evicted, ""
