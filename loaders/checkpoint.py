"""One entry point: a safetensors file -> CheckpointContents (tensor access, per-layer formats, report).

Auto-detects ComfyUI per-layer markers (both forms) and the older conventions the
registry's formats read (ComfyUI's scaled_fp8 files, self-describing Quanto qint8
files: `QuantFormat.read_convention`); anything else is a plain checkpoint. Everything is validated
here, before a model exists; after the model is built, `require_consumed`
checks that every quantized layer found a Linear to load into.
"""
from __future__ import annotations

import os
from collections import Counter
from dataclasses import dataclass, field, replace
from typing import Callable

import torch

from ..dtypes import FLOAT_DTYPES, SAFETENSORS_TO_TORCH
from .errors import CheckpointError
from .layers import Check, LayerFormat, method_tensors
from .file_map import FileMap
from .markers import CHECK_ROLES, MARKER_SUFFIX, has_markers, inspect_markers
from .conventions import ConventionFile
from ..dtypes import torch_dtype
from .safetensors_header import FLOAT_HEADER_DTYPES, HeaderReader, SafetensorsHeader, read_header
from ..quant.registry import convention_formats, formats

MARKER_KIND = "ComfyUI per-layer markers"


MarkFileSlice = Callable[[torch.Tensor, int], None]


class TensorSource:
    """Lazy tensor access to one safetensors file, zero-copy: it maps the file once, privately, as
    safetensors does (torch's file storage), and hands out each tensor as a slice of the map, by the
    checked header. `file_map.release(tensor)` gives back the pages of a tensor once it was consumed.
    With `mark` (a host that pages weights from their file), each tensor's storage is marked with its byte
    offset in the file; views of it keep the mark, a tensor computed from it has none.

    Tensors handed out stay valid after `close()` (each holds the map).
    """

    def __init__(self, path: str, header: SafetensorsHeader, mark: MarkFileSlice | None = None):
        self.path, self.header, self.mark = path, header, mark
        try:
            self._storage = torch.UntypedStorage.from_file(path, shared=False, nbytes=header.file_size)
        except (OSError, RuntimeError) as exc:  # gone, unreadable, or shorter than when it was inspected
            raise CheckpointError(path, f"cannot map the file ({exc})") from exc
        self.file_map = FileMap(self._storage.data_ptr(), header.file_size)

    def __call__(self, key: str) -> torch.Tensor:
        info = self.header.tensors.get(key)
        if info is None:
            raise CheckpointError(self.path, f"no tensor {key!r} in the file", [key])
        try:
            dtype = torch_dtype(info.dtype)
        except AttributeError:
            raise CheckpointError(self.path, f"tensor {key!r}: this torch has no dtype {info.dtype}", [key]) from None
        if not info.nbytes:
            return torch.empty(info.shape, dtype=dtype)
        start = self.header.data_start + info.begin
        raw = torch.empty(0, dtype=torch.uint8).set_(self._storage[start:start + info.nbytes])
        if self.mark is not None:
            self.mark(raw, start)
        return raw.view(dtype).reshape(info.shape)

    def close(self) -> None:
        self._storage = None

    def __enter__(self) -> "TensorSource":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


@dataclass
class CheckpointContents:
    path: str
    header: SafetensorsHeader
    kind: str                               # "ComfyUI per-layer markers", "ComfyUI scaled_fp8", "Quanto qint8", "plain"
    layers: dict[str, LayerFormat]          # by module name in the loader's namespace
    plain_keys: dict[str, str]              # loader-side key -> file key, tensors handed over as stored
    notes: list[str] = field(default_factory=list)

    def open(self, mark: MarkFileSlice | None = None) -> TensorSource:
        return TensorSource(self.path, self.header, mark)

    def layer_tensors(self, source: TensorSource, name: str) -> dict[str, torch.Tensor]:
        """The quantized layer's tensors, by role, as its LinearMethod stores them."""
        layer = self.layers[name]
        return method_tensors(layer, {role: source(key) for role, key in layer.tensors.items()})

    def proxy_dtype(self) -> torch.dtype:
        """The checkpoint's main float dtype among its unquantized matrices (bf16 if none)."""
        counts = Counter()
        for key in self.plain_keys.values():
            info = self.header.tensors[key]
            dtype = SAFETENSORS_TO_TORCH.get(info.dtype)
            if dtype in FLOAT_DTYPES and len(info.shape) >= 2:
                counts[dtype] += info.numel
        return counts.most_common(1)[0][0] if counts else torch.bfloat16

    def state_dict(self, source: TensorSource) -> dict[str, torch.Tensor]:
        """What a model loader sees: the plain tensors, and for each quantized layer a
        zero-cost stand-in `<layer>.weight` of its logical shape (the model's own
        architecture detection reads shapes; the layer loads its real tensors itself)."""
        sd = {new: source(old) for new, old in self.plain_keys.items()}
        proxy = torch.zeros((), dtype=self.proxy_dtype())
        for name, layer in self.layers.items():
            sd[f"{name}.weight"] = proxy.expand(layer.logical_shape())
        return sd

    def renamed(self, rules: list[tuple[str, str]], only_matching: bool = False) -> "CheckpointContents":
        """The contents with key prefixes replaced (first matching rule wins).

        With `only_matching`, keys no rule matches are dropped, as a model loader
        that strips a prefix drops the rest; dropping a quantized layer that way is
        an error. Two names mapping to one is a mapping collision (an error).
        """
        targets: dict[str, str] = {}
        collisions: list[tuple[str, str, str]] = []
        dropped_layers: list[str] = []

        def place(new: str | None, old: str, is_layer: bool) -> None:
            if new is None:
                if is_layer:
                    dropped_layers.append(old)
                return
            if new in targets and targets[new] != old:
                collisions.append((targets[new], old, new))
            targets[new] = old

        layers, plain = {}, {}
        for name, layer in self.layers.items():
            new = _rename(name, rules, only_matching)
            place(None if new is None else f"{new}.weight", name, True)
            if new is not None:
                layers[new] = layer.with_name(new)
        for key, old in self.plain_keys.items():
            new = _rename(key, rules, only_matching)
            place(new, key, False)
            if new is not None:
                plain[new] = old
        if collisions:
            first, second, target = collisions[0]
            raise CheckpointError(self.path, f"mapping collision: {len(collisions)} name(s) map onto another "
                                             f"({first!r} and {second!r} both become {target!r})",
                                  [name for collision in collisions for name in collision[:2]])
        if dropped_layers:
            prefixes = ", ".join(repr(old) for old, _ in rules)
            raise CheckpointError(self.path, f"quantized layers outside the loaded model (prefix {prefixes})",
                                  dropped_layers)
        return replace(self, layers=layers, plain_keys=plain)

    def unconsumed(self, consumed) -> list[str]:
        consumed = set(consumed)
        return [name for name in self.layers if name not in consumed]

    def require_consumed(self, consumed) -> None:
        """Every quantized layer must have been loaded by a Linear of the model."""
        missing = self.unconsumed(consumed)
        if missing:
            raise CheckpointError(self.path, f"unconsumed markers: {len(missing)} quantized layer(s) match no Linear "
                                             f"layer of the model, so the load was abandoned", missing)

    def describe(self) -> list[str]:
        counts = Counter(layer.format for layer in self.layers.values())
        formats = ", ".join(f"{fmt} x{n}" for fmt, n in sorted(counts.items())) or "none"
        return [f"checkpoint {os.path.basename(self.path)}: {self.kind}; quantized layers in the file: {formats}",
                *self.notes]


def _rename(name: str, rules: list[tuple[str, str]], only_matching: bool) -> str | None:
    for old, new in rules:
        if name.startswith(old):
            return new + name[len(old):]
    return None if only_matching else name


def scale_only_dtypes() -> frozenset[str]:
    """Safetensors dtypes only a quantized layer's block scales have (E8M0): no weight or plain tensor is one."""
    contracts = [spec.contract for spec in formats().values() if spec.contract is not None]
    weights = {dtype for c in contracts for dtype in c.weight_dtypes}
    scales = {dtype for c in contracts for dtype in (*c.block_scale_dtypes, *c.encodings.values())}
    return frozenset(scales - weights - set(FLOAT_HEADER_DTYPES) - {"U8", "float"})


def _refuse_stray_scales(header: SafetensorsHeader, plain: dict[str, str]) -> None:
    """A plain tensor in a scale-only dtype would reach the model as a weight (torch's bare size mismatch)."""
    only_scales = scale_only_dtypes()
    stray = [key for key in plain if header.tensors[key].dtype in only_scales]
    if stray:
        dtypes = sorted({header.tensors[key].dtype for key in stray})
        owners = sorted(spec.name for spec in formats().values()
                        if spec.contract is not None and set(dtypes) & set(spec.contract.block_scale_dtypes))
        raise CheckpointError(header.path, f"{'/'.join(dtypes)} tensor(s) where plain tensors belong: that dtype "
                                           f"holds only block scales ({', '.join(owners)} weight_scale), so a "
                                           "quantized layer's marker or weight is missing", stray)


def inspect_checkpoint(path, check: Check = None) -> CheckpointContents:
    """Read and validate `path`; raises CheckpointError naming the file and layers.

    The work is linear in the number of tensors; `check` is called now and then,
    so a caller can stop a long inspection (ComfyUI's interrupt) by raising from it."""
    path = os.fspath(path)
    header = read_header(path)
    with HeaderReader(header) as source:
        file = ConventionFile(header, source, check)
        marked = has_markers(header)
        conventions = {name: keys for name, spec in convention_formats().items()
                       if (keys := spec.convention_keys(file))}
        if marked + len(conventions) > 1:
            kinds = ["ComfyUI markers"] * marked + [convention_formats()[name].convention_label
                                                    for name in conventions]
            raise CheckpointError(path, f"the file has both {' and '.join(kinds)}",
                                  [key for keys in conventions.values() for key in keys])
        extra_claimed = set()
        if marked:
            notes = []
            kind, layers = MARKER_KIND, inspect_markers(header, source, check, notes)
        elif conventions:
            found = convention_formats()[next(iter(conventions))].read_convention(file)
            kind, layers, extra_claimed, notes = found.kind, found.layers, found.claimed, found.notes
        else:
            for spec in convention_formats().values():
                problem = spec.foreign(file)
                if problem is not None:
                    raise CheckpointError(path, problem)
                unmarked = spec.unmarked(file)
                if unmarked is not None:
                    raise CheckpointError(path, *unmarked)
            kind, layers, notes = "plain", {}, []
    claimed = {key for layer in layers.values() for key in layer.tensors.values()} | extra_claimed
    claimed |= {f"{name}{MARKER_SUFFIX}" for name in layers}
    claimed |= {f"{name}.{role}" for name in layers for role in CHECK_ROLES}  # a cache file's checks: not weights
    claimed |= {f"{name}.{aux}" for name, layer in layers.items() for aux in layer.contract.ignored}
    plain = {key: key for key in header.tensors if key not in claimed}
    _refuse_stray_scales(header, plain)
    sources = Counter(layer.source for layer in layers.values())
    if marked:
        notes.append("markers read from " + ", ".join(f"{src} x{n}" for src, n in sorted(sources.items())))
    return CheckpointContents(path, header, kind, layers, plain, notes)
