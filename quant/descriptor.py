"""What a quantization format declares, once, in its own module (see registry.register_format).

A format module defines a `QuantFormat` subclass: its one name (options,
reports, markers and the registry all use it), how to build its LinearMethod,
whether it runs natively on a device, its comfy-kitchen layouts, and, where
checkpoints store it, its `Contract`. The loaders validate and convert every
format's layers through these declarations alone (loaders/markers.py,
loaders/layers.py), so adding a format touches no loader.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from .linear_method import LinearMethod


@dataclass(frozen=True, eq=False)
class Contract:
    """One quantized layer as a checkpoint stores it. Roles are the QuantLinear's parameter names
    (`weight`, `weight_scale`, ...), tensors `<layer>.<role>` in the file."""
    required: frozenset[str]
    optional: frozenset[str] = frozenset()
    weight_dtypes: tuple[str, ...] = ()      # safetensors dtype codes of the stored weight
    weight_note: str = ""                    # messages say "<format> weight (<note>)"
    pack: int = 1                            # weight elements per stored element (two E2M1 codes per byte)
    pad: int = 1                             # rows and (unpacked) columns are padded to multiples of this
    # weight_scale: None for one scale per tensor or per output channel ([N, 1]); else one per `block`
    # input elements in comfy-kitchen's blocked layout, [roundup(N, 128), roundup(K / block, 4)]
    block: int | None = None
    block_scale_dtypes: tuple[str, ...] = ()
    # scale role -> how its values are read: "float", or the fp8 type its (possibly U8) bytes hold
    encodings: dict[str, str] = field(default_factory=dict)
    views: dict[str, torch.dtype] = field(default_factory=dict)   # role -> dtype the method views the bytes as
    dropped: frozenset[str] = frozenset()    # roles the file may carry that the method does not take
    scales_as_stored: bool = False           # scales keep the file's dtype and shape (else fp32, [] or [N, 1])
    stored_max: float = 0.0                  # largest magnitude a stored weight value can have
    ignored: tuple[str, ...] = ()            # `<layer>.<name>` tensors the file may add, which the layer ignores

    @property
    def roles(self) -> frozenset[str]:
        return self.required | self.optional

    def storage_shape(self, in_features: int, out_features: int) -> tuple[int, int]:
        """The stored weight's shape for a Linear of in -> out."""
        return (-(-out_features // self.pad) * self.pad, -(-in_features // self.pad) * self.pad // self.pack)


class QuantFormat:
    """A format's declarations; subclasses override what differs and register with `@register_format`."""
    name: str = ""
    #: What a checkpoint stores per layer, or None where no file holds the format (online only).
    contract: Contract | None = None
    #: Whether the contract is a ComfyUI per-layer marker format (`{"format": name, ...}`).
    marker: bool = False
    #: comfy-kitchen layouts (QuantizedTensor) whose weights are this format's layers.
    kitchen_layouts: tuple[str, ...] = ()
    #: Offered for quantizing while loading (LoadH3Quantized's `quantization`).
    online: bool = False
    #: Option spellings of earlier versions, read as this name.
    aliases: tuple[str, ...] = ()
    #: Why its layers cannot be saved as a marker checkpoint, where they cannot.
    unsaveable: str | None = None
    #: Off its native devices the weight is dequantized before each matmul (loaders report the path).
    dequantized_elsewhere: bool = False

    def method(self, **options) -> "LinearMethod":
        """The LinearMethod; options it does not take are ignored (callers pass one set to every format)."""
        raise NotImplementedError

    def native(self, device: torch.device) -> bool:
        """Whether its GEMM runs natively on `device` (else an emulation or a dequantized matmul)."""
        return False

    def variants(self) -> tuple[dict, ...]:
        """Option sets for `method`, most preferred first, for picking the first that takes a shape."""
        return ({},)

    def marker_meaning(self, marker: dict) -> dict:
        """What a marker makes the loader do (its defaults filled in): two forms of one layer must agree on it."""
        return {"format": marker["format"]}

    def marker_options(self, marker: dict, in_features: int) -> dict:
        """The method options a valid marker gives; ValueError with the problem for an invalid one."""
        return {}

    def saved_marker(self, method: "LinearMethod") -> dict | None:
        """The marker a layer of `method` is saved with (None: no marker format stores it)."""
        return {"format": self.name} if self.marker else None

    def kitchen_marker(self, params: dict) -> dict:
        """The marker of a comfy-kitchen weight of this format, from its layout params."""
        return {"format": self.name}
