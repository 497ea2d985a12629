"""A safetensors header, read and checked without trusting the file.

Layout: 8 bytes little-endian header length n, n bytes of JSON
{tensor name: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": {str: str}},
then the data. Offsets are relative to the end of the header.
"""
from __future__ import annotations

import json
import math
import mmap
import os
import reprlib
import struct
from dataclasses import dataclass, field
from typing import NamedTuple

from ..dtypes import SAFETENSORS_TO_TORCH
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
FLOAT_HEADER_DTYPES = ("F16", "BF16", "F32", "F64")


class TensorInfo(NamedTuple):     # a tuple: a header holds one per tensor, tens of thousands
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
    # module name -> {suffix: key} of the tensors directly under it, built once (lookups stay linear overall)
    children: dict[str, dict[str, str]] = field(default_factory=dict, repr=False)

    def companions(self, name: str) -> dict[str, str]:
        """{suffix: key} of the tensors stored directly under module `name` (e.g. weight, weight_scale)."""
        return self.children.get(name, {})


class HeaderReader:
    """Reads single tensors of a checked header straight from the file's mapped bytes (a copy each).

    Inspection reads many tiny tensors (markers, scales); this costs a slice per tensor, where a
    general reader costs far more per call. Use as a context manager; tensors stay valid after it.
    """

    def __init__(self, header: "SafetensorsHeader"):
        self.header = header
        self._dtypes = SAFETENSORS_TO_TORCH
        try:
            with open(header.path, "rb") as f:
                self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) if header.file_size else None
        except (OSError, ValueError) as exc:
            raise CheckpointError(header.path, f"cannot read the file ({exc})") from exc

    def raw(self, key: str) -> bytes:
        """The tensor's stored bytes."""
        info = self.header.tensors[key]
        start = self.header.data_start + info.begin
        data = self._map[start:start + info.nbytes] if info.nbytes else b""
        if len(data) != info.nbytes:    # the file shrank since its header was read
            raise self._truncated(key)
        return data

    def _truncated(self, key: str) -> CheckpointError:
        return CheckpointError(self.header.path, f"truncated file: tensor {key!r} ends past the file's end", [key])

    def byte_range(self, key: str) -> tuple[int, int]:
        """(smallest, largest) byte of a non-empty tensor's stored bytes, read in place: no copy (a text encoder's
        block scales are about 2 GB), its pages read as a loader would read them."""
        import numpy as np
        info = self.header.tensors[key]
        start = self.header.data_start + info.begin
        view = memoryview(self._map)[start:start + info.nbytes]
        try:
            if len(view) != info.nbytes:
                raise self._truncated(key)
            codes = np.frombuffer(view, dtype=np.uint8)
            low, high = int(codes.min()), int(codes.max())
            del codes  # the mapping cannot close while an array holds it
            return low, high
        finally:
            view.release()

    def __call__(self, key: str):
        import torch
        info = self.header.tensors[key]
        dtype = self._dtypes[info.dtype]
        if info.nbytes == 0:
            return torch.empty(info.shape, dtype=dtype)
        return torch.frombuffer(bytearray(self.raw(key)), dtype=dtype).reshape(info.shape)

    def close(self) -> None:
        if self._map is not None:
            self._map.close()
            self._map = None

    def __enter__(self) -> "HeaderReader":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def short_repr(value, limit: int = 80) -> str:
    """A bounded repr of parsed JSON for error messages (depth and length capped, never recursive)."""
    text = _REPR.repr(value)
    return text if len(text) <= limit else text[:limit - 3] + "..."


_REPR = reprlib.Repr()
_REPR.maxlevel, _REPR.maxstring, _REPR.maxother = 3, 60, 60


def parse_json(path: str, text, problem: str, layers=()):
    """json.loads that turns every failure, nesting past Python's recursion limit included, into
    CheckpointError(path, f"{problem} (why)", layers)."""
    try:
        return json.loads(text)
    except RecursionError:
        raise CheckpointError(path, f"{problem} (nested too deeply)", layers) from None
    except (UnicodeDecodeError, ValueError) as exc:
        raise CheckpointError(path, f"{problem} ({exc})", layers) from exc


def read_header(path, max_header_bytes: int = MAX_HEADER_BYTES,
                max_metadata_bytes: int = MAX_METADATA_BYTES) -> SafetensorsHeader:
    """Parse and check the header of `path`; raises CheckpointError naming the file and tensors.

    Checks: the header length is bounded and inside the file; the header is a
    JSON object; metadata is str -> str and bounded; every tensor has a known
    dtype, a shape whose byte size matches its offsets, and data that lies
    inside the file (a truncated file fails here, naming the missing tensors);
    the tensors' data covers the data section exactly, as safetensors requires.
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
    header = parse_json(path, raw, "the safetensors header is not valid JSON")
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
    tensors, beyond_end, children = {}, [], {}
    for name, entry in header.items():
        info = _tensor_info(path, name, entry)
        if info.end > data_size:
            beyond_end.append(name)
        tensors[name] = info
        parent, dot, suffix = name.rpartition(".")
        if dot:
            children.setdefault(parent, {})[suffix] = name
    if beyond_end:
        raise CheckpointError(path, f"truncated file: {len(beyond_end)} tensor(s) end past the file's last byte "
                                    f"({file_size} bytes)", beyond_end)
    _check_layout(path, tensors, data_size)
    return SafetensorsHeader(path, metadata, tensors, data_start, file_size, children)


def _check_layout(path: str, tensors: dict[str, TensorInfo], data_size: int) -> None:
    """safetensors' own rule (safe_open refuses anything else): ordered by offsets, the tensors fill the data
    section back to back from its first byte to the file's last, with no overlap and no gap."""
    end, previous = 0, None
    for info in sorted(tensors.values(), key=lambda t: (t.begin, t.end, t.name)):
        if info.begin != end:
            if info.begin < end:
                where = f"start inside tensor {previous.name!r} ({_span(previous)})"
            elif previous is None:
                where = f"leave the data section's first {info.begin} bytes to no tensor"
            else:
                where = f"leave a gap of {info.begin - end} bytes after tensor {previous.name!r} ({_span(previous)})"
            raise CheckpointError(path, f"invalid offset for tensor {info.name!r}: its data_offsets {_span(info)} "
                                        f"{where}; safetensors requires the tensors to fill the data section back "
                                        "to back", [info.name] + ([previous.name] if previous else []))
        end, previous = info.end, info
    if end != data_size:
        after = f", after tensor {previous.name!r} ({_span(previous)})," if previous else ""
        raise CheckpointError(path, f"incomplete metadata, file not fully covered: the data section's last "
                                    f"{data_size - end} bytes{after} belong to no tensor",
                              [previous.name] if previous else [])


def _span(info: TensorInfo) -> str:
    return f"[{info.begin}, {info.end}]"


def _tensor_info(path: str, name: str, entry) -> TensorInfo:
    # The common case in one pass (a header may list tens of thousands of tensors); else find the fault.
    if type(entry) is dict:
        dtype, shape, offsets = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
        if type(dtype) is str and dtype in DTYPE_SIZES and type(shape) is list and type(offsets) is list \
                and len(offsets) == 2 and type(offsets[0]) is int and type(offsets[1]) is int:
            begin, end = offsets
            numel = 1
            for d in shape:
                if type(d) is not int or d < 0:
                    break
                numel *= d
            else:
                if 0 <= begin <= end and end - begin == numel * DTYPE_SIZES[dtype]:
                    return _new_info(TensorInfo, (name, dtype, tuple(shape), begin, end))
    _refuse_entry(path, name, entry)


_new_info = tuple.__new__     # TensorInfo's own __new__ adds a call per tensor


def _refuse_entry(path: str, name: str, entry) -> None:
    if not isinstance(entry, dict):
        raise CheckpointError(path, f"tensor {name!r}: header entry is not an object", [name])
    dtype, shape, offsets = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
    if not isinstance(dtype, str) or dtype not in DTYPE_SIZES:
        raise CheckpointError(path, f"tensor {name!r}: unsupported dtype {short_repr(dtype)}", [name])
    if type(shape) is not list or not all(type(d) is int and d >= 0 for d in shape):
        raise CheckpointError(path, f"tensor {name!r}: bad shape {short_repr(shape)}", [name])
    if (type(offsets) is not list or len(offsets) != 2 or type(offsets[0]) is not int or type(offsets[1]) is not int
            or not 0 <= offsets[0] <= offsets[1]):
        raise CheckpointError(path, f"tensor {name!r}: bad data_offsets {short_repr(offsets)}", [name])
    expected = math.prod(shape) * DTYPE_SIZES[dtype]
    raise CheckpointError(path, f"tensor {name!r}: {offsets[1] - offsets[0]} bytes of data for shape "
                                f"{short_repr(shape)} {dtype} ({expected} expected)", [name])
