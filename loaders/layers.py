"""What one quantized layer of a checkpoint is: its format, its tensors, and how they are checked.

Shared by the ComfyUI per-layer markers (markers.py), scaled_fp8 files and Quanto
maps (quanto.py). Roles are the parameter names a QuantLinear gets (`weight`,
`weight_scale`, `weight_scale_2`, `input_scale`); `tensors` maps each role to its
key in the file. Every per-format fact comes from the format's Contract
(quant/descriptor.py), found by name in quant/registry.py.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch

from ..dtypes import torch_dtype
from ..quant.descriptor import Contract, QuantFormat
from ..quant.registry import format_spec
from .errors import CheckpointError
from .safetensors_header import DTYPE_SIZES, FLOAT_HEADER_DTYPES, HeaderReader, TensorInfo

# Called now and then during long inspections; raising from it (e.g. on a user's interrupt) stops them.
Check = Callable[[], None] | None


def checked(items, check: Check, every: int = 256):
    """`items`, calling `check()` before the first and then every `every` items."""
    for i, item in enumerate(items):
        if check is not None and i % every == 0:
            check()
        yield item


def roundup(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


@dataclass(frozen=True)
class LayerFormat:
    name: str                   # module name in the checkpoint's namespace, e.g. "blocks.0.ffn.0"
    format: str                 # a registered format with a Contract
    tensors: dict[str, str]     # role -> tensor key in the file
    storage_shape: tuple[int, int]
    options: dict = field(default_factory=dict)   # method options, e.g. convrot flags
    source: str = ""            # where the layer was declared

    @property
    def spec(self) -> QuantFormat:
        return format_spec(self.format)

    @property
    def contract(self) -> Contract:
        return self.spec.contract

    def logical_shape(self) -> tuple[int, int]:
        """[out, in] of the weight this layer stands for (padded for the block formats)."""
        rows, cols = self.storage_shape
        return (rows, cols * self.contract.pack)

    def mismatch(self, in_features: int, out_features: int) -> str | None:
        """Why the stored tensors cannot be a [out, in] Linear weight, or None."""
        expected = self.contract.storage_shape(in_features, out_features)
        if tuple(self.storage_shape) != expected:
            return (f"{self.format} weight {list(self.storage_shape)} does not fit a Linear of "
                    f"{in_features}->{out_features} (expected {list(expected)})")
        return None

    def with_name(self, name: str) -> "LayerFormat":
        return LayerFormat(name, self.format, self.tensors, self.storage_shape, self.options, self.source)


class Problems:
    """Collects per-layer problems; raises one CheckpointError for the first kind, naming all its layers."""

    def __init__(self, path: str):
        self.path = path
        self._layers: dict[str, list[str]] = {}

    def add(self, problem: str, layer: str) -> None:
        self._layers.setdefault(problem, []).append(layer)

    def raise_if_any(self) -> None:
        for problem, layers in self._layers.items():
            raise CheckpointError(self.path, problem, layers)


# ---- tensor checks ----------------------------------------------------------

def is_scalar(info: TensorInfo) -> bool:
    return info.numel == 1 and len(info.shape) <= 1


def per_tensor_or_channel(info: TensorInfo, rows: int) -> bool:
    """A scale stored per tensor (1 element) or per output channel ([N], [N, 1])."""
    return is_scalar(info) or info.shape in ((rows,), (rows, 1)) or info.shape == (1, 1)


def non_finite(tensor: torch.Tensor, encoding: str) -> bool:
    """Whether a scale holds NaN or Inf; `encoding` says how U8 storage is to be read."""
    raw = tensor.view(torch.uint8) if tensor.element_size() == 1 else None
    if encoding == "F8_E8M0":
        return bool((raw == 0xFF).any())            # E8M0's only non-finite code
    if encoding == "F8_E4M3":
        return bool(((raw & 0x7F) == 0x7F).any())   # E4M3FN: NaN, no infinities
    return not bool(torch.isfinite(tensor.float()).all())


# A dequantized weight must stay finite in every compute dtype ComfyUI may choose; float16 is the narrowest.
WEIGHT_LIMIT = torch.finfo(torch.float16).max
_BLOCK_VIEWS = ("F8_E4M3", "F8_E8M0")  # 8-bit float scales stored as U8


def _decoded(tensor: torch.Tensor, encoding: str) -> torch.Tensor:
    if encoding in _BLOCK_VIEWS:
        return tensor.view(torch.uint8).view(torch_dtype(encoding)).float()
    return tensor.double()


# The smallest code that is NaN or negative: below it, an 8-bit float's codes order as its values.
_ORDERED_BELOW = {"F8_E4M3": 0x7F, "F8_E8M0": 0xFF}


def _ordered_range(read: HeaderReader, key: str, encoding: str) -> tuple[float, float] | None:
    """(smallest, largest) value of an 8-bit float scale from its smallest and largest code alone, where no code is
    NaN or negative; None otherwise (the scale is read and decoded whole, to say what is wrong)."""
    if encoding not in _ORDERED_BELOW or DTYPE_SIZES[read.header.tensors[key].dtype] != 1:
        return None
    low, high = read.byte_range(key)
    if high >= _ORDERED_BELOW[encoding]:
        return None
    values = _decoded(torch.tensor([low, high], dtype=torch.uint8), encoding)
    return float(values[0]), float(values[1])


def check_scales(layer: LayerFormat, read: HeaderReader, problems: Problems,
                 names: dict[str, str] | None = None) -> None:
    """Refuse scales no quantizer writes: NaN/Inf, zero or negative per-tensor/channel scales,
    negative block scales, and scales so large that the dequantized weight leaves float16's range.
    `names` gives a role its name in messages where the file calls it otherwise (default "<format> <role>").
    The scales and how to read them are the contract's `encodings`.

    Only the scale tensors are read (they are small), except for a weight whose scale fails the
    cheap bound stored_max x max(scale): then, where the weight is stored unpacked (one scale per
    tensor or channel), its real max |q| decides.
    """
    contract = layer.contract

    def named(role):
        return (names or {}).get(role, f"{layer.format} {role}")

    scales = {}
    for role, encoding in contract.encodings.items():
        key = layer.tensors.get(role)
        if key is None or read.header.tensors[key].nbytes == 0:
            continue
        ordered = _ordered_range(read, key, encoding)  # block scales: gigabytes in a big file, mostly this way
        if ordered is not None:
            smallest, largest = ordered
        else:
            tensor = read(key)
            if tensor.element_size() > 1:
                encoding = "float"    # a role stored as fp8 bytes or as floats (e.g. W4A8's group scales)
            if non_finite(tensor, encoding):
                problems.add(f"non-finite (NaN/Inf) values in {named(role)}", layer.name)
                return
            values = _decoded(tensor, encoding)
            smallest, largest = float(values.min()), float(values.max())
        if smallest < 0 or (smallest == 0 and encoding == "float"):
            problems.add(f"{'negative' if smallest < 0 else 'zero'} values in {named(role)} "
                         f"(min {smallest:g}): no quantizer writes them", layer.name)
            return
        scales[role] = largest
    if contract.scale_role not in scales:
        return
    largest = 1.0
    for role in contract.magnitude:
        largest *= scales.get(role, 1.0)
    bound = contract.stored_max * largest
    if bound > WEIGHT_LIMIT and contract.block is None and contract.scale_role == "weight_scale":
        weight = read(layer.tensors["weight"])
        stored = weight.to(torch.int16) if weight.dtype == torch.int8 else weight.float()
        bound = float(stored.abs().max()) * largest if weight.numel() else 0.0
    if bound > WEIGHT_LIMIT:
        problems.add(f"{named(contract.scale_role)} too large (max {largest:.3g}): the dequantized weight reaches "
                     f"{bound:.3g}, beyond float16's range ({WEIGHT_LIMIT:g})", layer.name)


def _dimension(term: str, sizes: dict) -> int | None:
    """One term of a declared shape: a name or number, or one divided by another (None where it does not divide)."""
    numerator, _, denominator = term.partition("/")

    def value(name):
        return int(name) if name.isdigit() else sizes[name]
    top, bottom = value(numerator.strip()), value(denominator.strip()) if denominator else 1
    return top // bottom if bottom > 0 and top % bottom == 0 else None


def check_role_shapes(layer: str, fmt: str, contract: Contract, info: dict[str, TensorInfo], rows: int,
                      columns: int, options: dict, problems: Problems) -> bool:
    """The roles the contract gives a shape (in N = stored rows, K = unpacked stored columns and the marker's
    options): each tensor present has that shape and one of its dtypes (float ones by default)."""
    sizes = {**{k: v for k, v in options.items() if isinstance(v, int)}, "N": rows, "K": columns}
    for role, spec in contract.shapes.items():
        if role not in info:
            continue
        if not expect_dtype(info[role], contract.dtypes.get(role, FLOAT_HEADER_DTYPES), f"{fmt} {role}", layer,
                            problems):
            return False
        expected = tuple(_dimension(term, sizes) for term in spec.split(",") if term.strip())
        if None in expected or tuple(info[role].shape) != expected:
            problems.add(f"shape mismatch: {fmt} {role} must be [{spec}] = {list(expected)} for a weight of "
                         f"{rows} rows and {columns} columns, found {list(info[role].shape)}", layer)
            return False
    return True


def expect_dtype(info: TensorInfo, allowed: tuple[str, ...], what: str, layer: str, problems: Problems) -> bool:
    if info.dtype in allowed:
        return True
    problems.add(f"dtype mismatch: {what} must be {' or '.join(allowed)}, found {info.dtype}", layer)
    return False


def float_scale(info: TensorInfo, what: str, layer: str, problems: Problems) -> bool:
    return expect_dtype(info, FLOAT_HEADER_DTYPES, what, layer, problems)


# ---- tensors as the methods take them ---------------------------------------

def method_tensors(layer: LayerFormat, raw: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The file's tensors for `layer` in the dtypes and shapes its LinearMethod stores.

    Per-tensor scales become fp32 scalars, per-channel ones fp32 [N, 1] (unless the
    contract keeps them as stored, as it keeps the roles it declares shapes of); the
    contract's views apply to one-byte storage (block scales stored as uint8 are viewed
    as their fp8 type), and its dropped roles are left out.
    """
    contract = layer.contract
    out = {}
    for role, tensor in raw.items():
        view = contract.views.get(role)
        if view is not None and tensor.element_size() == 1:
            out[role] = tensor.view(view)
        elif role == "weight" or contract.scales_as_stored or role in contract.shapes:
            out[role] = tensor
        elif role in contract.dropped:
            continue
        elif tensor.numel() == 1:
            out[role] = tensor.float().reshape(())
        else:
            out[role] = tensor.float().reshape(-1, 1)
    return out
