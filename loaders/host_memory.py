"""Giving host memory back to the system while a loader works: where the platform lacks a call, it is a no-op.

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

PAGE = mmap.PAGESIZE


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
