"""Host memory: how much is really free, and giving it back to the system while a loader works (where the
platform lacks a call, it is a no-op).

- `free_ram()`: the memory a process can take without pushing out anything in use:
  free memory and the page cache nobody used lately (the kernel's inactive file
  pages), within the limits of the process's memory cgroup. psutil's `available`
  counts all reclaimable page cache, the model files a host pages its weights
  from included, and knows nothing of a cgroup's limit: a container limited to
  64 GiB on a 125 GiB machine sees the machine's.

- `ram_room()`: `free_ram`, never more than psutil's `available` (what the host reads for its RAM decisions,
  and what the benchmark's emulated hosts patch).
- `release_pages(address, nbytes)`: madvise(MADV_DONTNEED) on whole pages of a
  private file map (loaders/file_map.py): the pages stop being the process's, and
  reading them again faults them in from the file.
- `trim_heap()`: glibc's malloc_trim(0). Quantizing a layer on the CPU makes
  temporaries of its size (its weight in fp32, twice), freed once the layer is
  built, between the quantized tensors that stay; glibc keeps such holes of its
  heap resident (measured: 0.36 GiB of holes beside a 0.14 GiB FP8 model), and
  malloc_trim gives their pages back.
"""
from __future__ import annotations

import ctypes
import mmap
import os

PAGE = mmap.PAGESIZE
MEMINFO = "/proc/meminfo"
SELF_CGROUP = "/proc/self/cgroup"
CGROUP_ROOT = "/sys/fs/cgroup"
_NO_LIMIT = 1 << 60  # cgroup v1 writes "no limit" as a huge number

try:  # what the host reads for its RAM decisions (and the benchmark's emulated hosts patch)
    import psutil
except ImportError:
    psutil = None


def _libc_function(name: str):
    try:
        return getattr(ctypes.CDLL(None, use_errno=True), name)
    except (OSError, AttributeError, TypeError):  # no C library to open (Windows), or no such function
        return None


_MADV_DONTNEED = getattr(mmap, "MADV_DONTNEED", None)
_madvise = _libc_function("madvise") if _MADV_DONTNEED is not None else None
if _madvise is not None:
    _madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    _madvise.restype = ctypes.c_int
_malloc_trim = _libc_function("malloc_trim")  # glibc only
if _malloc_trim is not None:
    _malloc_trim.argtypes = [ctypes.c_size_t]
    _malloc_trim.restype = ctypes.c_int


def release_pages(address: int, nbytes: int) -> int:
    """Give back the whole pages inside [address, address + nbytes) of a private file map; returns their bytes
    (0 where the platform cannot). A page written since it was mapped is discarded, not kept."""
    if _madvise is None:
        return 0
    first, last = -(-address // PAGE) * PAGE, (address + nbytes) // PAGE * PAGE
    if last <= first or _madvise(first, last - first, _MADV_DONTNEED) != 0:
        return 0
    return last - first


def trim_heap() -> None:
    """Return the C heap's free pages to the system (glibc; elsewhere nothing)."""
    if _malloc_trim is not None:
        _malloc_trim(0)


def _read(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read()
    except OSError:
        return None


def _fields(text: str | None, scale_kb: bool = False) -> dict[str, int]:
    """`name value` lines (memory.stat) or `name: value kB` lines (/proc/meminfo), in bytes."""
    out = {}
    for line in (text or "").splitlines():
        parts = line.replace(":", " ").split()
        if len(parts) >= 2 and parts[1].isdigit():
            out[parts[0]] = int(parts[1]) * (1024 if scale_kb and parts[2:3] == ["kB"] else 1)
    return out


def _cgroup_dirs() -> list[tuple[str, bool]]:
    """The folders of this process's memory cgroup and its ancestors, innermost first, each with whether it is
    cgroup v2; a path the mount does not show (a container's own namespace) counts as the mount's root."""
    found = []
    for line in (_read(SELF_CGROUP) or "").splitlines():
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        v2 = parts[1] == ""
        if not v2 and "memory" not in parts[1].split(","):
            continue
        root = os.path.normpath(CGROUP_ROOT if v2 else os.path.join(CGROUP_ROOT, "memory"))
        folder = os.path.normpath(os.path.join(root, parts[2].strip().lstrip("/")))
        if not os.path.isdir(folder):
            folder = root
        while folder.startswith(root):
            found.append((folder, v2))
            folder = os.path.dirname(folder)
    return found


def _cgroup_room() -> int | None:
    """The memory left under the tightest limit of this process's memory cgroups, its inactive page cache counted
    as room; None without a limit."""
    rooms = []
    for folder, v2 in _cgroup_dirs():
        limit_file, usage_file, inactive = (("memory.max", "memory.current", "inactive_file") if v2 else
                                            ("memory.limit_in_bytes", "memory.usage_in_bytes", "total_inactive_file"))
        limit, usage = (_read(os.path.join(folder, name)) for name in (limit_file, usage_file))
        if limit is None or usage is None or not limit.strip().isdigit() or int(limit) >= _NO_LIMIT:
            continue
        stat = _fields(_read(os.path.join(folder, "memory.stat")))
        rooms.append(int(limit) - int(usage) + stat.get(inactive, 0))
    return max(0, min(rooms)) if rooms else None


def free_ram() -> int | None:
    """The bytes of host memory this process can take without pushing out anything in use (see the module's
    docstring); None where the system does not say (no /proc/meminfo)."""
    info = _fields(_read(MEMINFO), scale_kb=True)
    if "MemFree" not in info:
        return None
    free = info["MemFree"] + info.get("Inactive(file)", 0)
    room = _cgroup_room()
    return free if room is None else min(free, room)


def ram_room() -> int | None:
    """The bytes of host memory this process may take now: `free_ram`, never more than psutil's `available`;
    None where neither says."""
    known = [free_ram()] + ([psutil.virtual_memory().available] if psutil is not None else [])
    known = [k for k in known if k is not None]
    return min(known) if known else None
