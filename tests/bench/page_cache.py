"""How much of a file the page cache holds (Linux's mincore), for the benchmarks and the read-ahead's tests."""
import ctypes
import mmap
import os


def cached_bytes(path) -> int | None:
    """The bytes of `path` in the page cache: mincore over a read-only shared map of it (mapping faults nothing
    in); None where the system has no mincore (not Linux) or the file cannot be mapped."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.mmap.restype, libc.mmap.argtypes = ctypes.c_void_p, [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int,
                                                                   ctypes.c_int, ctypes.c_int, ctypes.c_long]
        libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p]
        libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
        prot, shared = mmap.PROT_READ, mmap.MAP_SHARED
        size = os.path.getsize(path)
        if size == 0:
            return 0
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
            resident = vec.raw[:pages].translate(_LOW_BIT).count(1)  # bit 0 of each byte: the page is resident
        finally:
            libc.munmap(addr, size)
    finally:
        os.close(fd)
    return min(size, resident * mmap.PAGESIZE)


_LOW_BIT = bytes(b & 1 for b in range(256))
