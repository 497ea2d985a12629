"""A safetensors header, read and checked without trusting the file.

Layout: 8 bytes little-endian header length n, n bytes of JSON
{tensor name: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": {str: str}},
then the data. Offsets are relative to the end of the header.
"""
from __future__ import annotations

import json
import math
import os
import struct
from dataclasses import dataclass

from .errors import CheckpointError

# safetensors' own reader refuses headers over 100 MB; a real checkpoint's is well under 1 MB.
MAX_HEADER_BYTES = 100_000_000
# Metadata strings (markers, Quanto maps, configs) of a real checkpoint take
# kilobytes to a few hundred; more than this is a malformed or hostile file.
MAX_METADATA_BYTES = 8 * 1024 * 1024

DTYPE_SIZES = {
    "BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1, "F8_E8M0": 1,
    "I16": 2, "U16": 2, "F16": 2, "BF16": 2,
    "I32": 4, "U32": 4, "F32": 4,
    "I64": 8, "U64": 8, "F64": 8,
}
FLOAT_DTYPES = ("F16", "BF16", "F32", "F64")


@dataclass(frozen=True)
class TensorInfo:
    name: str
    dtype: str                  # safetensors dtype name, e.g. "BF16", "I8", "F8_E4M3"
    shape: tuple[int, ...]
    begin: int                  # byte offsets relative to the data section
    end: int

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.end - self.begin


@dataclass(frozen=True)
class SafetensorsHeader:
    path: str
    metadata: dict[str, str]
    tensors: dict[str, TensorInfo]
    data_start: int             # file offset of the data section
    file_size: int


def read_header(path, max_header_bytes: int = MAX_HEADER_BYTES,
                max_metadata_bytes: int = MAX_METADATA_BYTES) -> SafetensorsHeader:
    """Parse and check the header of `path`; raises CheckpointError naming the file and tensors.

    Checks: the header length is bounded and inside the file; the header is a
    JSON object; metadata is str -> str and bounded; every tensor has a known
    dtype, a shape whose byte size matches its offsets, and data that lies
    inside the file (a truncated file fails here, naming the missing tensors).
    """
    path = os.fspath(path)
    try:
        with open(path, "rb") as f:
            file_size = os.fstat(f.fileno()).st_size
            if file_size < 8:
                raise CheckpointError(path, f"not a safetensors file: {file_size} bytes, shorter than the 8-byte header length")
            (header_len,) = struct.unpack("<Q", f.read(8))
            if header_len > max_header_bytes:
                raise CheckpointError(path, f"oversized header: {header_len} bytes declared, over the "
                                            f"{max_header_bytes}-byte bound")
            if 8 + header_len > file_size:
                raise CheckpointError(path, f"truncated file: the header declares {header_len} bytes but the file "
                                            f"has only {file_size - 8} after the length field")
            raw = f.read(header_len)
    except OSError as exc:
        raise CheckpointError(path, f"cannot read the file ({exc.strerror or exc})") from exc
    try:
        header = json.loads(raw)
    except (UnicodeDecodeError, ValueError) as exc:
        raise CheckpointError(path, f"the safetensors header is not valid JSON ({exc})") from exc
    if not isinstance(header, dict):
        raise CheckpointError(path, "the safetensors header is not a JSON object")

    metadata = header.pop("__metadata__", None) or {}
    if not isinstance(metadata, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()):
        raise CheckpointError(path, "__metadata__ must map strings to strings")
    metadata_bytes = sum(len(k.encode()) + len(v.encode()) for k, v in metadata.items())
    if metadata_bytes > max_metadata_bytes:
        largest = max(metadata, key=lambda k: len(metadata[k]))
        raise CheckpointError(path, f"oversized metadata: {metadata_bytes} bytes, over the {max_metadata_bytes}-byte "
                                    f"bound (largest entry {largest!r}: {len(metadata[largest])} bytes)")

    data_start = 8 + header_len
    data_size = file_size - data_start
    tensors, beyond_end = {}, []
    for name, entry in header.items():
        info = _tensor_info(path, name, entry)
        if info.end > data_size:
            beyond_end.append(name)
        tensors[name] = info
    if beyond_end:
        raise CheckpointError(path, f"truncated file: {len(beyond_end)} tensor(s) end past the file's last byte "
                                    f"({file_size} bytes)", beyond_end)
    return SafetensorsHeader(path, metadata, tensors, data_start, file_size)


def _tensor_info(path: str, name: str, entry) -> TensorInfo:
    if not isinstance(entry, dict):
        raise CheckpointError(path, f"tensor {name!r}: header entry is not an object", [name])
    dtype, shape, offsets = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
    if dtype not in DTYPE_SIZES:
        raise CheckpointError(path, f"tensor {name!r}: unsupported dtype {dtype!r}", [name])
    if not isinstance(shape, list) or not all(isinstance(d, int) and d >= 0 for d in shape):
        raise CheckpointError(path, f"tensor {name!r}: bad shape {shape!r}", [name])
    if (not isinstance(offsets, list) or len(offsets) != 2 or not all(isinstance(o, int) for o in offsets)
            or not 0 <= offsets[0] <= offsets[1]):
        raise CheckpointError(path, f"tensor {name!r}: bad data_offsets {offsets!r}", [name])
    info = TensorInfo(name, dtype, tuple(shape), offsets[0], offsets[1])
    if info.nbytes != info.numel * DTYPE_SIZES[dtype]:
        raise CheckpointError(path, f"tensor {name!r}: {info.nbytes} bytes of data for shape {list(shape)} "
                                    f"{dtype} ({info.numel * DTYPE_SIZES[dtype]} expected)", [name])
    return info
