"""Byte sizes as the pack's reports write them."""
MIB = 1024 ** 2
GIB = 1024 ** 3


def format_gib(n_bytes: float, spec: str = ".2f") -> str:
    """`n_bytes` in GiB, e.g. "1.25 GiB"; `spec` is the number's format."""
    return f"{n_bytes / GIB:{spec}} GiB"
