"""A safetensors writer that streams: one tensor in memory at a time, never a whole state dict.

safetensors' own writers take every tensor at once (and `save_file` copies them
into one buffer). Here the header is computed from dtypes and shapes first, then
each tensor's bytes are written in header order, so a caller can hand over the
tensors a model already holds (or produce them one by one). Layout as the format
defines it (see safetensors_header.py): 8-byte little-endian header length, the
JSON header padded with spaces so that the data starts at a multiple of 64 bytes,
then the data, with no gaps. A mapped tensor then starts on a cache line wherever
the sizes before it are multiples of 64 (weights nearly always are), where CPU
kernels take the same path as for memory torch allocated: at 40 bytes off, the
same int8 model sampled a latent 4.5e-7 apart (tests/integration/test_file_backed.py).

The file appears only when complete: bytes go to a temporary file in the same
folder, which replaces the target at the end and is removed on any error or
interrupt.
"""
from __future__ import annotations

import json
import os
import re
import secrets
import shutil
import sys
from typing import Callable, Sequence

import torch

from ..dtypes import TORCH_TO_SAFETENSORS
from ..units import format_gib
from .safetensors_header import DTYPE_SIZES

SUFFIX = ".safetensors"

_METADATA_KEY = "__metadata__"
DATA_ALIGNMENT = 64
_COPY_CHUNK = 64 * 1024 * 1024  # bytes per write: bounds the extra memory a GPU tensor's host copy costs


def dtype_code(dtype: torch.dtype, name: str = "") -> str:
    try:
        return TORCH_TO_SAFETENSORS[dtype]
    except KeyError:
        raise TypeError(f"tensor {name!r}: dtype {dtype} has no safetensors encoding") from None


def _plain(name: str, tensor) -> torch.Tensor:
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"tensor {name!r}: expected a torch.Tensor, got {type(tensor).__name__}")
    tensor = tensor.detach()
    if type(tensor) is not torch.Tensor:  # e.g. a comfy-kitchen QuantizedTensor: write its parts
        raise TypeError(f"tensor {name!r}: {type(tensor).__name__} is not a plain tensor; pass its stored parts")
    return tensor


def encode_header(tensors: Sequence[tuple[str, torch.Tensor]], metadata: dict[str, str] | None = None) -> bytes:
    """The 8-byte length and the padded JSON header for `tensors`, laid out in the given order."""
    header: dict = {}
    if metadata:
        if not all(isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()):
            raise TypeError("safetensors metadata must map strings to strings")
        header[_METADATA_KEY] = dict(metadata)
    offset = 0
    for name, tensor in tensors:
        if not isinstance(name, str) or not name or name == _METADATA_KEY:
            raise ValueError(f"bad tensor name {name!r}")
        if name in header:
            raise ValueError(f"tensor {name!r} appears twice")
        tensor = _plain(name, tensor)
        code = dtype_code(tensor.dtype, name)
        size = tensor.numel() * DTYPE_SIZES[code]
        header[name] = {"dtype": code, "shape": list(tensor.shape), "data_offsets": [offset, offset + size]}
        offset += size
    raw = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
    raw += b" " * (-(8 + len(raw)) % DATA_ALIGNMENT)
    return len(raw).to_bytes(8, "little") + raw


def data_bytes(tensors: Sequence[tuple[str, torch.Tensor]]) -> int:
    return sum(t.numel() * t.element_size() for _, t in tensors)


def _write_tensor(f, name: str, tensor: torch.Tensor) -> None:
    tensor = _plain(name, tensor)
    if tensor.numel() == 0:
        return
    flat = tensor.reshape(-1)
    # Bytes as stored in memory (little-endian: checked once per file), in chunks so a
    # GPU tensor is copied to the host a slice at a time.
    per_chunk = max(1, _COPY_CHUNK // tensor.element_size())
    for start in range(0, flat.numel(), per_chunk):
        part = flat[start:start + per_chunk].to("cpu").contiguous()
        f.write(memoryview(part.view(torch.uint8).numpy()))


def write_safetensors(path, tensors: Sequence[tuple[str, torch.Tensor]], metadata: dict[str, str] | None = None,
                      *, overwrite: bool = False, on_tensor: Callable[[str], None] | None = None,
                      durable: bool = True) -> int:
    """Write `tensors` ((name, tensor) in file order) to `path`; returns the file's size in bytes.

    Each tensor is read only when its turn comes (a CUDA tensor is copied to the
    host in 64 MiB slices). `on_tensor(name)` runs after each tensor is written
    (progress; it may raise to stop). Refuses to replace an existing file unless
    `overwrite`, and checks free disk space first. `durable` syncs the file to disk before it
    appears (a scratch file that dies with the process skips that wait). On any exception, interrupts
    included, the temporary file is removed and `path` is left as it was.
    """
    if sys.byteorder != "little":
        raise RuntimeError("safetensors is little-endian; writing from a big-endian machine is not supported")
    path = os.fspath(path)
    folder = os.path.dirname(os.path.abspath(path))
    if not overwrite and os.path.exists(path):
        raise FileExistsError(f"{path} already exists (set overwrite to replace it)")
    header = encode_header(tensors, metadata)
    total = len(header) + data_bytes(tensors)
    free = shutil.disk_usage(folder).free
    if total > free:
        raise OSError(f"not enough disk space for {path}: {format_gib(total)} needed, "
                      f"{format_gib(free)} free")
    # A hidden name without the .safetensors suffix: model lists never show it. Mode 0o666 less
    # the umask, as any file the user saves (mkstemp would make it private).
    tmp = os.path.join(folder, f".{os.path.basename(path)}.{secrets.token_hex(4)}.partial")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_BINARY", 0), 0o666)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(header)
            for name, tensor in tensors:
                _write_tensor(f, name, tensor)
                if on_tensor is not None:
                    on_tensor(name)
            f.flush()
            if durable:
                os.fsync(f.fileno())
        if not overwrite and os.path.exists(path):
            raise FileExistsError(f"{path} appeared while it was being written; nothing was replaced")
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
    return total


def target_path(folder: str, filename: str) -> tuple[str, str]:
    """(absolute path, name relative to `folder`) for the `filename` a user gave for a new file in
    models/diffusion_models (`folder`); ValueError if it could leave `folder`."""
    name = (filename or "").strip().replace("\\", "/")
    if not name:
        raise ValueError("filename is empty")
    if "\x00" in name or name.startswith("/") or re.match(r"[A-Za-z]:", name):
        raise ValueError(f"filename {filename!r} must be relative to models/diffusion_models")
    parts = name.split("/")
    if any(part in ("", ".", "..") or part.startswith(".") for part in parts):
        raise ValueError(f"filename {filename!r}: empty, '.', '..' and hidden path parts are not allowed")
    if not name.lower().endswith(SUFFIX):
        raise ValueError(f"filename {filename!r} must end in {SUFFIX}")
    # Checked on the name only: a sub-folder the user linked to another disk stays usable.
    return os.path.join(folder, *parts), "/".join(parts)
