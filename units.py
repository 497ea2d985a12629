"""Byte sizes as the pack's reports write them, and the power-of-two buckets its measurements are keyed by."""
MIB = 1024 ** 2
GIB = 1024 ** 3


def format_gib(n_bytes: float, spec: str = ".2f") -> str:
    """`n_bytes` in GiB, e.g. "1.25 GiB"; `spec` is the number's format."""
    return f"{n_bytes / GIB:{spec}} GiB"


def next_pow2(n: int) -> int:
    """The least power of two at least `n` (1 for n <= 1): row counts and sequence lengths are keyed by it, so a
    new batch or prompt length is measured once per bucket; kernels rank alike within one."""
    return 1 << max(0, (n - 1).bit_length())
