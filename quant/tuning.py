"""Tuned kernel choices kept on disk: one small JSON file, whose path the host gives (beside its cache folder).

An entry is keyed by the GPU (its name and compute capability), the kernel and its version (a digest of the
kernel's source and of what it runs on, so that an edited kernel never reuses an old tuning) and the shape. A
file that is not this store's (unreadable, too large, not JSON, another layout or version) is ignored and
rewritten at the next write; entries of other GPUs are kept and never used here, and a kernel's entries of other
versions are dropped when it writes its own. Writes go to a temporary file renamed over the store, so a reader
sees the old file or the new one, never a part; where the OS locks files, writers take turns, each reading the
file again under the lock, so that concurrent servers lose none of each other's entries.

Nothing here measures. The kernels search (time their candidates) only where the user asked for it
(`search_asked`: BIGDIT_INT8_TUNE=1) and put what they found; otherwise they read entries and fall back to what
the pack ships and to rules.
"""
from __future__ import annotations

import functools
import hashlib
import inspect
import json
import os
import tempfile
import threading

import torch

from ..hardware import gpu_family
from ..pack_logging import pack_logger

try:  # POSIX; elsewhere Windows' byte-range lock, else none (the rename still keeps the file whole)
    import fcntl
except ImportError:
    fcntl = None
try:
    import msvcrt
except ImportError:
    msvcrt = None

log = pack_logger(__name__)

LAYOUT = "bigdit-tuning"
VERSION = 1
MAX_BYTES = 4 * 2 ** 20  # far above what tuning writes; a larger file is not this store's
TUNE_ENV = "BIGDIT_INT8_TUNE"
FILE_NAME = "bigdit_tuning.json"
_WARNED: set[tuple[str, str]] = set()


def search_asked() -> bool:
    """Whether the user asked for kernel searches (BIGDIT_INT8_TUNE=1); their results are kept in the store."""
    return os.environ.get(TUNE_ENV, "").strip().lower() in ("1", "true", "yes", "on")


def digest(*parts: object) -> str:
    """A short stable digest of `parts` (their str), for kernel versions."""
    return hashlib.sha256("\0".join(map(str, parts)).encode()).hexdigest()[:16]


def source_digest(*objects: object) -> str:
    """The digest of the source text of `objects` (functions, classes, modules)."""
    return digest(*(inspect.getsource(obj) for obj in objects))


@functools.lru_cache(maxsize=None)
def _gpu_name(index: int) -> str:
    # torch.compile folds get_device_properties into a constant (as hardware.cuda_capability relies on)
    return torch.cuda.get_device_properties(index).name


def _index(device) -> int | None:
    device = torch.device(device)
    if device.type != "cuda" or not torch.cuda.is_available():
        return None
    return device.index if device.index is not None else torch.cuda.current_device()


def device_key(device) -> str | None:
    """The store's key of a CUDA device: its name and compute capability ("NVIDIA H100 80GB HBM3 sm90"); None
    for any other device (nothing is tuned there)."""
    index = _index(device)
    return None if index is None else f"{_gpu_name(index)} {gpu_family(device)}"


def _entries(data) -> dict | None:
    """The entries of a parsed store file, or None where it is not this store's layout."""
    if not (isinstance(data, dict) and data.get("layout") == LAYOUT and data.get("version") == VERSION):
        return None
    entries = data.get("entries")
    if not isinstance(entries, dict):
        return None
    for kernels in entries.values():
        if not isinstance(kernels, dict) or not all(isinstance(shapes, dict) for shapes in kernels.values()):
            return None
    return entries


def read_entries(path: str) -> tuple[dict, str | None]:
    """(the file's entries, None), or ({}, why it is ignored); a missing file is an empty store."""
    try:
        with open(path, "rb") as f:
            raw = f.read(MAX_BYTES + 1)
    except FileNotFoundError:
        return {}, None
    except OSError as exc:
        return {}, f"cannot read it ({type(exc).__name__}: {exc})"
    if len(raw) > MAX_BYTES:
        return {}, f"over {MAX_BYTES} bytes"
    try:
        entries = _entries(json.loads(raw))
    except ValueError as exc:
        return {}, f"not JSON ({exc})"
    if entries is None:
        return {}, f"not a {LAYOUT} file of version {VERSION}"
    return entries, None


class _FileLock:
    """An exclusive lock on `path`.lock between processes, where the OS has one; else nothing."""

    def __init__(self, path: str):
        self.path = path + ".lock"
        self.handle = None

    def __enter__(self):
        try:
            self.handle = open(self.path, "a+b")
            if fcntl is not None:
                fcntl.flock(self.handle, fcntl.LOCK_EX)
            elif msvcrt is not None:
                self.handle.seek(0)
                msvcrt.locking(self.handle.fileno(), msvcrt.LK_LOCK, 1)
        except OSError:  # a folder that takes no lock file: the rename alone keeps the store whole
            self._close()
        return self

    def __exit__(self, *exc):
        self._close()

    def _close(self):
        if self.handle is not None:
            self.handle.close()  # closing releases either lock
            self.handle = None


class TuningStore:
    """The store at `path` (None: kept in memory only), read when made; `get` and `put` entries."""

    def __init__(self, path: str | None):
        self.path = path
        self._lock = threading.Lock()
        self.entries, self.problem = read_entries(path) if path else ({}, None)
        if self.problem and (path, self.problem) not in _WARNED:  # once a process: each load reads it again
            _WARNED.add((path, self.problem))
            log.warning("tuning store %s is ignored (%s); it is rewritten at the next tuning", path, self.problem)

    def get(self, device: str | None, kernel: str, version: str, shape: str):
        """The entry of `kernel` at `version` for `shape` on `device` (device_key), or None."""
        if device is None:
            return None
        return self.entries.get(device, {}).get(f"{kernel}@{version}", {}).get(shape)

    def put(self, device: str, kernel: str, version: str, shape: str, value) -> str | None:
        """Keep `value` (JSON) for the key, in memory and in the file; None, or why the file was not written."""
        with self._lock:
            _merge(self.entries, device, kernel, version, shape, value)
            if self.path is None:
                return None
            try:
                with _FileLock(self.path):
                    on_disk, _ = read_entries(self.path)  # another process's entries since this one read
                    _merge(on_disk, device, kernel, version, shape, value)
                    _write(self.path, on_disk)
                    self.entries = on_disk
            except (OSError, TypeError, ValueError) as exc:
                log.warning("could not write the tuning store %s (%s: %s); the tuning holds for this process",
                            self.path, type(exc).__name__, exc)
                return f"{type(exc).__name__}: {exc}"
            self.problem = None
            return None


def _merge(entries: dict, device: str, kernel: str, version: str, shape: str, value) -> None:
    kernels = entries.setdefault(device, {})
    for stale in [name for name in kernels if name.startswith(f"{kernel}@") and name != f"{kernel}@{version}"]:
        del kernels[stale]
    kernels.setdefault(f"{kernel}@{version}", {})[shape] = value


def _write(path: str, entries: dict) -> None:
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    text = json.dumps({"layout": LAYOUT, "version": VERSION, "entries": entries}, indent=1, sort_keys=True)
    fd, temporary = tempfile.mkstemp(prefix=f".{os.path.basename(path)}.", suffix=".partial", dir=folder)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(temporary, path)
    except BaseException:
        try:
            os.unlink(temporary)
        except OSError:
            pass
        raise


class KernelEntries:
    """One kernel's entries in the current store, keyed by a torch device (its `device_key`; nothing is kept for a
    device without one): the view the host hands a module that keeps decisions but does not import quant/
    (attention's `auto`)."""

    def __init__(self, kernel: str):
        self.kernel = kernel

    def get(self, device, version: str, shape: str):
        return current().get(device_key(device), self.kernel, version, shape)

    def put(self, device, version: str, shape: str, value) -> None:
        key = device_key(device)
        if key is not None:
            current().put(key, self.kernel, version, shape, value)


_current = TuningStore(None)


def current() -> TuningStore:
    """The store the kernels read and write (in memory only until the host names a file)."""
    return _current


def use(path: str | None) -> TuningStore:
    """Read the store at `path` (again, where it is the same file: other processes may have written it) and make
    it the current one."""
    global _current
    _current = TuningStore(path)
    return _current
