"""How much of a file the page cache holds (Linux's mincore), for the benchmarks and the read-ahead's tests, and
which of a safetensors file's tensors its newly cached pages belong to."""
import ctypes
import json
import mmap
import os
import re
import struct


def cached_bytes(path) -> int | None:
    """The bytes of `path` in the page cache; None where the system has no mincore (not Linux) or the file cannot be
    mapped."""
    return cached_size(path, resident_pages(path))


def cached_size(path, pages: bytes | None) -> int | None:
    """The bytes of `path` its `pages` (resident_pages) say are cached; None where they are unknown."""
    return None if pages is None else min(os.path.getsize(path), pages.count(1) * mmap.PAGESIZE)


def resident_pages(path) -> bytes | None:
    """One byte per page of `path`, 1 where the page cache holds the page: mincore over a read-only shared map of it
    (mapping faults nothing in); None where the system has no mincore (not Linux) or the file cannot be mapped."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.mmap.restype, libc.mmap.argtypes = ctypes.c_void_p, [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int,
                                                                   ctypes.c_int, ctypes.c_int, ctypes.c_long]
        libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p]
        libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
        prot, shared = mmap.PROT_READ, mmap.MAP_SHARED
        size = os.path.getsize(path)
        if size == 0:
            return b""
        fd = os.open(path, os.O_RDONLY)
    except (OSError, AttributeError, TypeError):  # TypeError: no CDLL(None) (Windows)
        return None
    try:
        addr = libc.mmap(None, size, prot, shared, fd, 0)
        if addr in (None, ctypes.c_void_p(-1).value):
            return None
        try:
            pages = -(-size // mmap.PAGESIZE)
            vec = ctypes.create_string_buffer(pages)
            if libc.mincore(addr, size, vec) != 0:
                return None
            return vec.raw[:pages].translate(_LOW_BIT)  # bit 0 of each byte: the page is resident
        finally:
            libc.munmap(addr, size)
    finally:
        os.close(fd)


_LOW_BIT = bytes(b & 1 for b in range(256))


def tensor_pages(path) -> tuple[list[int], list[str]] | None:
    """A safetensors file's layout by page: (each part's first page, ascending; its group), the header ("header")
    and then each tensor's data in file order, grouped by name with each run of digits as "*"
    ("blocks.*.attn.qkv.weight"), a page shared by parts counted as the last one's starting on it; None for a file
    that does not read as safetensors."""
    try:
        with open(path, "rb") as f:
            (length,) = struct.unpack("<Q", f.read(8))
            if length > min(os.path.getsize(path) - 8, 100 * 2 ** 20):  # no header of that size: not safetensors
                return None
            header = json.loads(f.read(length))
        tensors = sorted((entry["data_offsets"][0], name) for name, entry in header.items() if name != "__metadata__")
    except (OSError, ValueError, KeyError, TypeError, struct.error):
        return None
    starts, groups = [0], ["header"]
    for offset, name in tensors:
        page = (8 + length + offset) // mmap.PAGESIZE
        group = re.sub(r"\d+", "*", name)
        if page == starts[-1]:  # a page shared by parts: the last one starting on it
            groups[-1] = group
            continue
        starts.append(page)
        groups.append(group)
    return starts, groups


def newly_cached(before: bytes, after: bytes, layout: tuple[list[int], list[str]]) -> dict[str, int]:
    """{group: bytes} of the pages cached in `after` that were not in `before` (resident_pages of one file at two
    times), by the group of the part each page belongs to (tensor_pages); needs numpy."""
    import numpy as np
    n = min(len(before), len(after))
    new = np.flatnonzero(np.frombuffer(after, np.uint8)[:n] > np.frombuffer(before, np.uint8)[:n])
    if not new.size:
        return {}
    starts, groups = layout
    names = sorted(set(groups))
    index = {g: i for i, g in enumerate(names)}
    ids = np.array([index[g] for g in groups])
    counts = np.bincount(ids[np.searchsorted(np.array(starts), new, side="right") - 1], minlength=len(names))
    return {names[i]: int(c) * mmap.PAGESIZE for i, c in enumerate(counts) if c}
