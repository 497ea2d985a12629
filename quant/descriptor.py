"""What a quantization format declares, once, in its own module (see registry.register_format).

A format module defines a `QuantFormat` subclass: its one name (options,
reports, markers and the registry all use it), how to build its LinearMethod,
whether it runs natively on a device, its comfy-kitchen layouts, and, where
checkpoints store it, its `Contract`. The loaders validate and convert every
format's layers through these declarations alone (loaders/markers.py,
loaders/layers.py), so adding a format touches no loader.
"""
from __future__ import annotations

import reprlib
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable

import torch

if TYPE_CHECKING:
    from .layer import Layer
    from .linear_method import LinearMethod


#: The role of an optional per-input-channel scale [K] that multiplies the layer's input before anything else
#: (AWQ smoothing, ModelOpt's `pre_quant_scale`); QuantLinear applies it, as upstream ComfyUI's Linear does.
PRE_QUANT_SCALE = "pre_quant_scale"


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
    # the weight scale's role (its per-tensor/channel or block checks), and the roles whose largest values
    # multiply with stored_max to bound the dequantized weight
    scale_role: str = "weight_scale"
    magnitude: tuple[str, ...] = ("weight_scale", "weight_scale_2")
    # other roles by their shape, in terms of N (stored rows), K (unpacked stored columns) and the marker's
    # numeric options (e.g. "N,K/group_size"), and their safetensors dtypes (float ones if not given)
    shapes: dict[str, str] = field(default_factory=dict)
    dtypes: dict[str, tuple[str, ...]] = field(default_factory=dict)

    @property
    def roles(self) -> frozenset[str]:
        return self.required | self.optional

    def storage_shape(self, in_features: int, out_features: int) -> tuple[int, int]:
        """The stored weight's shape for a Linear of in -> out."""
        return (-(-out_features // self.pad) * self.pad, -(-in_features // self.pad) * self.pad // self.pack)


@dataclass(frozen=True)
class MarkerParam:
    """A key a format's markers may carry (at the top level or under "params"), and what a writer can mean by it."""
    types: tuple[type, ...]
    default: object
    valid: Callable[[object], bool] = lambda value: True
    means: str = ""                          # the values a writer can mean, for messages


def power_of_4(value) -> bool:
    """A Hadamard group size comfy-kitchen builds (4, 16, 64, ...)."""
    return value >= 4 and value & (value - 1) == 0 and (value.bit_length() - 1) % 2 == 0


#: convert_to_quant's key of per-tensor/channel formats: whether weight_scale holds one value per row.
PER_ROW = MarkerParam((bool, type(None)), None, means="true or false")

#: Keys every marker may carry: the format, and the object upstream ComfyUI also reads options from.
MARKER_KEYS = ("format", "params")


def read_marker(params: dict[str, MarkerParam], marker: dict) -> tuple[dict, list[str]]:
    """(the options `params` declares, defaults filled in; the marker's keys no format reads).

    A key at the top level wins over the same key under "params", as in upstream ComfyUI's loader. A declared
    key whose value no writer could mean (a group size of 0), or a "params" that is no object, is a ValueError,
    used or not."""
    nested = marker.get("params", {})
    if not isinstance(nested, dict):
        # upstream reads such a marker as having no options: ConvRot data would run as plain INT8
        raise ValueError(f"bad marker: params {reprlib.repr(nested)} is not a JSON object (expected an object "
                         "of the format's options)")
    unknown = [f"params.{key}" for key in nested if key not in params]
    unknown += [key for key in marker if key not in params and key not in MARKER_KEYS]
    values = {}
    for key, param in params.items():
        value = marker.get(key, nested.get(key, param.default))
        # JSON has no int/bool distinction that Python keeps: True is an int there, 1 is no bool
        if (not isinstance(value, param.types) or (isinstance(value, bool) and bool not in param.types)
                or not param.valid(value)):
            raise ValueError(f"bad marker: {key} {value!r} is a value no writer means"
                             + (f" (expected {param.means})" if param.means else ""))
        values[key] = value
    return values, unknown


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
    #: What an online format is, for the nodes' tooltips: "name: summary."
    summary: str = ""
    #: Its method takes the nodes' group_size as its ConvRot rotation group (QuantizeModelINT8 offers it).
    rotation_group: bool = False
    #: The rotation groups its method takes, which the nodes offer as group_size.
    group_sizes: tuple[int, ...] = ()
    #: How the nodes' descriptions name it among the marker formats (default: its name).
    label: str = ""
    #: Option spellings of earlier versions, read as this name.
    aliases: tuple[str, ...] = ()
    #: Why its layers cannot be saved as a marker checkpoint, where they cannot.
    unsaveable: str | None = None
    #: What the loaders offer for layers a file stores in this format (the first is their default): the
    #: modes `stored_decision` takes. None of them: loaded as stored.
    conversion_modes: tuple[str, ...] = ()
    #: The node input that sets that mode (e.g. the loaders' "nvfp4"), where a node offers one.
    conversion_option: str | None = None
    #: The loaders offer that input, a choice of the modes, with this tooltip, in the order of
    #: `conversion_rank` (saved workflows hold an input's value by its place: a new input takes the next rank).
    #: Empty: no loader offers it (FP8's is QuantizeModelINT8's switch).
    conversion_tooltip: str = ""
    conversion_rank: int = 0
    #: The mode a load that quantizes (LoadH3Quantized with a quantization) takes for these layers in place of
    #: the input, which that loader then does not offer; None: it offers the input.
    quantizing_conversion: str | None = None
    #: An older file convention whose files hold this format's layers ("scaled_fp8", "quanto"), read by
    #: `read_convention`.
    convention: str | None = None
    #: What marks a file as of that convention, as messages name it ("a scaled_fp8 marker").
    convention_label: str = ""
    #: Weights of these (non-float) torch dtypes, in a module of someone else's, are this format's layers.
    storage_dtypes: tuple[torch.dtype, ...] = ()
    #: auto's preference among the formats a GPU runs natively (lower first; None: never auto's), from the
    #: compute capability `auto_from`, and on CPU where `auto_on_cpu`.
    auto_rank: int | None = None
    auto_from: tuple[int, int] = (99, 0)
    auto_on_cpu: bool = False
    #: Where a load is asked to fit its weights into fewer bytes (`fit_gib`), the formats layers move to, in
    #: this order (lower first; None: never moved to).
    fit_rank: int | None = None
    #: The keys its markers may carry beside "format" (read_marker checks their values).
    marker_params: dict[str, MarkerParam] = {}

    def method(self, **options) -> "LinearMethod":
        """The LinearMethod; options it does not take are ignored (callers pass one set to every format)."""
        raise NotImplementedError

    def native(self, device: torch.device) -> bool:
        """Whether its GEMM runs natively on `device` (else an emulation or a dequantized matmul)."""
        return False

    def variants(self) -> tuple[dict, ...]:
        """Option sets for `method`, most preferred first, for picking the first that takes a shape."""
        return ({},)

    def stored_decision(self, layer: "Layer", mode: str | None, context) -> "Layer":
        """`layer`, stored in this format, decided under one of its `conversion_modes` (None: as stored) by
        `layer.conversion`: a target method to re-quantize it to, or None and how it runs. `context`
        (decision.StoredContext) gives the device, the config's choice for a full-precision layer, and the
        device's native formats."""
        return layer.conversion(None, "already quantized")

    def convention_keys(self, file) -> list[str]:
        """The keys (tensors, or metadata) that make `file` (loaders/conventions.py's ConventionFile) one of this
        format's convention; none: another kind of file."""
        return []

    def read_convention(self, file):
        """The file's layers, validated (a ConventionLayers, made with `file.result`); CheckpointError otherwise."""
        raise NotImplementedError

    def unmarked(self, file) -> tuple[str, list[str]] | None:
        """(the problem, its layers) of a file that is not of this convention but looks like one (its marker
        missing), or None."""
        return None

    def foreign(self, file) -> str | None:
        """Why a file that names a convention this format does not read cannot load, or None."""
        return None

    def conversion_note(self, converted: list, kept: int, mode: str | None) -> list[str]:
        """The quantization pass's report lines on the layers it met in this format: those it `converted`
        (Layer records) and how many it `kept`, under `mode`."""
        return []

    def marker_meaning(self, marker: dict) -> dict:
        """What a marker makes the loader do (its defaults filled in): two forms of one layer must agree on it."""
        try:
            values, _ = read_marker(self.marker_params, marker)
        except ValueError:
            values = {key: marker.get(key) for key in self.marker_params}
        return {"format": marker["format"], **values}

    def marker_options(self, values: dict, in_features: int) -> dict:
        """The method options of a marker's values (read_marker's), for a layer of `in_features`; ValueError
        with the problem where they cannot be this layer's."""
        return dict(values)

    def saved_marker(self, method: "LinearMethod") -> dict | None:
        """The marker a layer of `method` is saved with (None: no marker format stores it)."""
        return {"format": self.name} if self.marker else None

    def weight_format(self, params: dict, storage_dtype: torch.dtype) -> str | None:
        """The name the quantization pass reports for a comfy-kitchen weight of this format (None: its layout's)."""
        return None

    def kitchen_marker(self, params: dict) -> dict:
        """The marker of a comfy-kitchen weight of this format, from its layout params."""
        return {"format": self.name}
