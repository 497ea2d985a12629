"""Grouped W4A8 layers (upstream ComfyUI's `asym_w4a8_int8` markers), through comfy-kitchen's
AsymW4A8Int8Layout.

Stored tensors, exactly as the kitchen layout serializes them (K = in_features, G = group_size):
  weight             int8 [N, K/2]   two 4-bit codes per byte (low nibble = even column) of the
                                     ConvRot-rotated weight
  weight_s_rel       fp8 e4m3 (or uint8 bytes, or fp32) [N, K/G]   per-group scale relative to the row's
  weight_s_channel   fp32 [N]        per-row scale of the int8 grid the codes decode to
  weight_codebook    fp32 [16]       optional: the code -> level table (kitchen's Lloyd-Max levels)
  weight_correction  float [K/G, N]  optional: the asymmetric quantizer's per-group offsets (zero points)
Marker: {"format": "asym_w4a8_int8", "group_size": 16, "convrot_groupsize": 256}.

Kitchen's linear decodes the codes to int8 and runs its INT8 ConvRot linear, which rotates and
quantizes the activations per token, on every device (its eager reference on CPU): the numbers are
upstream ComfyUI's. Where the pack's INT8 kernels are the default (quant/int8_triton.py, CUDA from sm80),
the pack's decode kernel (quant/w4a8_triton.py, bit-equal to kitchen's) writes the int8 weight and those kernels
compute the linear, as for an INT8 ConvRot layer; for ConvRot groups other than 256 too, which kitchen's CUDA W4A8
refuses. The decoded weight is transient (one layer's, while its call runs), not a copy the model keeps.

Upstream 0.33.0's loader does not read weight_correction; the pack passes it to
kitchen, which applies it (a file with it computes here as kitchen means, not as that loader does).
"""
from __future__ import annotations

import torch

from ..hardware import cuda_at_least
from ..pack_logging import pack_logger
from . import compiled_ops, int8_lora, int8_triton, swiglu
from .descriptor import Contract, MarkerParam, QuantFormat, power_of_4
from .int8_convrot import TRITON_FROM, pinned_kernel
from .kitchen_layout import KitchenLayoutMethod
from .linear_method import output_dtype
from .low_rank import LowRank
from .registry import register_format

NAME = "asym_w4a8_int8"
LAYOUT = "AsymW4A8Int8Layout"
ROLES = {"s_rel": "weight_s_rel", "s_channel": "weight_s_channel", "codebook": "weight_codebook",
         "correction": "weight_correction"}   # kitchen's state_dict suffixes, as the file's roles


log = pack_logger(__name__)
_EAGER_WARNED: set[int] = set()  # rotation groups warned about, once each


def _group_size_ok(value: int) -> bool:
    return value >= 4 and (16 % value == 0 or value % 16 == 0)     # kitchen's rule


class W4A8Int8Method(KitchenLayoutMethod):
    name = NAME
    layout = LAYOUT

    def __init__(self, group_size: int = 16, convrot_groupsize: int = 256):
        self.group_size = group_size
        self.convrot_groupsize = convrot_groupsize

    def describe(self) -> str:
        return f"{NAME}(g={self.group_size}, rot={self.convrot_groupsize})"

    def kitchen_backend(self, device: torch.device) -> str | None:
        # comfy-kitchen's CUDA W4A8 GEMM (0.2.31, 0.2.40) rotates in groups of 256 only and raises for any
        # other; its eager backend computes the same layout on any device, slower
        if device.type != "cuda" or self.convrot_groupsize == 256:
            return None
        if self.convrot_groupsize not in _EAGER_WARNED:
            _EAGER_WARNED.add(self.convrot_groupsize)
            log.warning("%s layers with ConvRot group %d run on comfy-kitchen's eager backend (its CUDA kernel "
                        "takes group 256 only): correct, but slower; quantize with group_size 256 for the kernel",
                        NAME, self.convrot_groupsize)
        return "eager"

    def skip_reason(self, in_features: int, out_features: int) -> str | None:
        if in_features % 16 or in_features % self.group_size or in_features % self.convrot_groupsize:
            return (f"in_features {in_features} not divisible by 16, group size {self.group_size} and rotation "
                    f"group {self.convrot_groupsize}")
        return None

    def rotation_group(self) -> int:
        return self.convrot_groupsize

    def quantize_weight(self, weight: torch.Tensor) -> dict[str, torch.Tensor]:
        qdata, params = self.on_kitchen(lambda: self.layout_class().quantize(
            weight, group_size=self.group_size, convrot_groupsize=self.convrot_groupsize))
        tensors = {"weight": qdata}
        for field, role in ROLES.items():
            value = params.scale if field == "s_rel" else getattr(params, field)
            if value is not None:
                tensors[role] = value
        return tensors

    fuses_low_rank = True  # apply(low_rank=...): on the INT8 kernels, a LoRA's part in the GEMM's epilogue

    def _on_int8_kernels(self, t: dict[str, torch.Tensor], x: torch.Tensor) -> bool:
        """Where the pack's INT8 kernels are the default (unless BIGDIT_INT8_KERNEL pins another) and the layer has
        no zero points (the decodes have none: kitchen's linear computes those eagerly)."""
        return ("weight_correction" not in t and self.convrot_groupsize in int8_triton.GROUP_SIZES
                and pinned_kernel() in (None, "auto", "triton") and int8_triton.runs_on(x.device)
                and (not x.is_cuda or cuda_at_least(x.device, TRITON_FROM))
                and compiled_ops.w4a8_decodes(t["weight"], t["weight_s_rel"], self.group_size))

    def apply(self, layer, x: torch.Tensor, input_act: str | None = None,
              low_rank: LowRank | None = None) -> torch.Tensor:
        """The layer's output on the pack's INT8 kernels (`_on_int8_kernels`), else comfy-kitchen's W4A8 linear; with
        `low_rank` (a LoRA branch's part) plus that part, in the INT8 GEMM's epilogue where the layer runs those
        kernels eagerly on CUDA, else by an addmm after the GEMM of the activated input."""
        t = layer.tensors_for(x)
        x2d, n, out_dtype = x.reshape(-1, x.shape[-1]), layer.out_features, output_dtype(x, layer.compute_dtype)
        on_kernels, compiling = self._on_int8_kernels(t, x), False
        if low_rank is not None:
            if on_kernels and int8_lora.fusable(x2d, low_rank):
                weight = compiled_ops.w4a8_decoded(t["weight"], t["weight_s_rel"], t.get("weight_codebook"),
                                                   self.group_size)
                args = (weight, t["weight_s_channel"], t.get("bias"), out_dtype)
                try:
                    fused = int8_lora.linear_low_rank(x2d, *args, True, self.convrot_groupsize, input_act, low_rank)
                except int8_triton.Compiling:
                    compiling = True
                else:
                    if fused is not None:
                        return fused.reshape(*x.shape[:-1], n)
            x2d, input_act = swiglu.activated(x2d, input_act), None  # once, for the GEMM and the branch
        if compiling:  # kitchen's GEMM meanwhile, not the Triton one without the LoRA
            out = compiled_ops.int8_linear(x2d, *args, convrot=True, convrot_groupsize=self.convrot_groupsize,
                                           input_act=None)
        elif not on_kernels:
            out = super().apply(layer, x2d, input_act).reshape(-1, n)
        else:
            out = compiled_ops.w4a8_linear_triton(
                x2d, t["weight"], t["weight_s_rel"], t["weight_s_channel"], t.get("weight_codebook"), t.get("bias"),
                out_dtype, group_size=self.group_size,
                convrot_groupsize=self.convrot_groupsize, input_act=input_act)
        if low_rank is not None:
            low_rank.add_to(x2d, out)
        return out.reshape(*x.shape[:-1], n)

    def layout_params(self, tensors, layer, dtype):
        return self.layout_class().Params(
            scale=tensors["weight_s_rel"], s_channel=tensors["weight_s_channel"],
            codebook=tensors.get("weight_codebook"), correction=tensors.get("weight_correction"),
            orig_dtype=dtype, orig_shape=(layer.out_features, layer.in_features),
            group_size=self.group_size, convrot_groupsize=self.convrot_groupsize)


def _marker(group_size: int, convrot_groupsize: int) -> dict:
    return {"format": NAME, "group_size": int(group_size), "convrot_groupsize": int(convrot_groupsize)}


@register_format
class W4A8Int8Format(QuantFormat):
    name = NAME
    marker = True
    online = True
    rotation_group = True
    fit_rank = 0  # the more accurate 4-bit format (INT8 activations)
    summary = ("4-bit weights in groups of 16 (a 16-level codebook, fp8 group scales) decoded to INT8, INT8 "
               "activations with ConvRot: about 0.56 bytes per weight (INT8 GEMMs, sm80+: the pack's Triton "
               "kernels, else comfy-kitchen's)")
    kitchen_layouts = (LAYOUT,)
    contract = Contract(
        required=frozenset({"weight", "weight_s_rel", "weight_s_channel"}),
        optional=frozenset({"weight_codebook", "weight_correction"}),
        weight_dtypes=("I8",), weight_note="packed 4-bit codes", pack=2,
        scale_role="weight_s_channel", magnitude=("weight_s_channel",),
        shapes={"weight_s_rel": "N,K/group_size", "weight_s_channel": "N", "weight_codebook": "16",
                "weight_correction": "K/group_size,N"},
        dtypes={"weight_s_rel": ("F8_E4M3", "U8", "F32"), "weight_s_channel": ("F32",),
                "weight_codebook": ("F32",)},
        encodings={"weight_s_rel": "F8_E4M3", "weight_s_channel": "float"},
        views={"weight_s_rel": torch.float8_e4m3fn},
        stored_max=127.0)   # codes decode onto the int8 grid, clamped to +-127, times weight_s_channel
    marker_params = {
        "group_size": MarkerParam((int,), 16, _group_size_ok, "at least 4, dividing 16 or a multiple of 16"),
        "convrot_groupsize": MarkerParam((int,), 256, power_of_4, "a power of 4 from 4 up"),
    }

    def method(self, group_size: int = 256, weight_group: int = 16, **_) -> W4A8Int8Method:
        # group_size is the rotation's group, as for every ConvRot format (the nodes' group_size)
        return W4A8Int8Method(weight_group, group_size)

    def native(self, device: torch.device) -> bool:
        return W4A8Int8Method().native_supported(device)

    def marker_options(self, values: dict, in_features: int) -> dict:
        options = {"group_size": values["convrot_groupsize"], "weight_group": values["group_size"]}
        reason = self.method(**options).skip_reason(in_features, 0)
        if reason is not None:
            raise ValueError(f"bad marker: {reason}")
        return options

    def saved_marker(self, method) -> dict:
        return _marker(method.group_size, method.convrot_groupsize)

    def kitchen_marker(self, params: dict) -> dict:
        return _marker(params.get("group_size", 16), params.get("convrot_groupsize", 256))
