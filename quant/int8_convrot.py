"""Online INT8 ConvRot, through comfy-kitchen or the pack's Triton kernels.

Weights: per-output-channel INT8 after a group-wise Hadamard rotation
(ConvRot), which spreads outliers across each group before rounding.
Activations: rotated and quantized per token at run time, inside
int8_triton's kernels on CUDA from sm80 (where they measured 1.4-1.6x
comfy-kitchen's at every H3 shape on the H100 and H200), else comfy-kitchen's
fused kernel (its eager backend composes the same from torch ops on CPU).
Nothing is timed to choose: a measurement kept in the tuning store overrides
that default, made only where asked (BIGDIT_INT8_TUNE=1, quant/kernel_select.py);
`BIGDIT_INT8_KERNEL` pins one.
"""
from __future__ import annotations

import importlib.metadata
import os

import torch
import torch.nn.functional as F

from ..hardware import cuda_at_least
from . import compiled_ops, int8_lora, int8_triton, swiglu, tuning, witness
from .descriptor import PER_ROW, Contract, MarkerParam, QuantFormat, power_of_4
from .layer import Layer
from .kernel_select import KernelChooser, rows_bucket
from .linear_method import LinearMethod, output_dtype
from .low_rank import LowRank
from .registry import register_format

CONVROT = "int8_convrot"        # the online format (its files carry int8_tensorwise markers with convrot flags)
TENSORWISE = "int8_tensorwise"  # ComfyUI's marker format, with or without the rotation
LAYOUT = "TensorWiseINT8Layout"
GROUP_SIZES = (16, 64, 256)

# Row split: 8192-row calls dodge a slow Stream-K schedule of kitchen's long GEMMs on
# some GPUs and cost a few percent on others, so it is a candidate where the user asks for tuning.
DEFAULT_SPLIT_ROWS = 8192
# The Triton kernels are the default from Ampere on; on Turing (not measured with them) kitchen's kernel.
TRITON_FROM = (8, 0)


def _kitchen_version() -> str | None:
    try:
        return importlib.metadata.version("comfy-kitchen")
    except importlib.metadata.PackageNotFoundError:
        return None


#: The INT8 kernels' version: the Triton kernels' source and comfy-kitchen's release, which a stored kernel
#: choice (and a stored conversion measurement, quant/auto.py) was measured with.
KERNEL_VERSION = tuning.digest(int8_triton.KERNEL_VERSION, _kitchen_version())
_chooser = KernelChooser(CONVROT, force_env="BIGDIT_INT8_KERNEL",
                         known=("kitchen", "kitchen_split", "triton", "dequant"), version=KERNEL_VERSION)


def pinned_kernel() -> str | None:
    """The INT8 kernel BIGDIT_INT8_KERNEL pins ("auto" or None: none)."""
    return _chooser.forced()


def _env_int(name: str) -> int | None:
    value = os.environ.get(name, "").strip()
    return int(value) if value else None


def forced_row_split(rows: int, out_features: int) -> int | None:
    """The user's row split from env vars: rows per call, 0 for "never split", None when unset.

    BIGDIT_INT8_MAX_ROWS (<= 0: never split) and BIGDIT_INT8_MIN_SPLIT_N. When
    MAX_ROWS is set it decides alone: the measured choice is off.
    """
    max_rows = _env_int("BIGDIT_INT8_MAX_ROWS")
    if max_rows is None:
        return None
    if max_rows <= 0 or rows <= max_rows or out_features < (_env_int("BIGDIT_INT8_MIN_SPLIT_N") or 0):
        return 0
    return max_rows


class Int8ConvRotMethod(LinearMethod):
    """INT8 with per-channel (or per-tensor) weight scales; `convrot=False` is
    plain `int8_tensorwise`, as ComfyUI checkpoints without the rotation store it."""
    name = CONVROT
    kernel_version = KERNEL_VERSION  # what a stored measurement of its speed was made with

    def __init__(self, group_size: int = 256, row_split: str = "auto", convrot: bool = True):
        if convrot and group_size not in GROUP_SIZES:
            raise ValueError(f"group_size must be one of {GROUP_SIZES}, got {group_size}")
        if row_split not in ("auto", "off"):
            raise ValueError(f"row_split must be 'auto' or 'off', got {row_split!r}")
        self.group_size = group_size
        self.row_split = row_split
        self.convrot = convrot
        if not convrot:
            self.name = TENSORWISE

    def describe(self) -> str:
        return f"{CONVROT}(g={self.group_size})" if self.convrot else TENSORWISE

    def skip_reason(self, in_features: int, out_features: int) -> str | None:
        if self.convrot and in_features % self.group_size:
            return f"in_features {in_features} not divisible by group size {self.group_size}"
        return None

    def quantize_weight(self, weight: torch.Tensor) -> dict[str, torch.Tensor]:
        from comfy_kitchen.tensor.int8 import TensorWiseINT8Layout

        qdata, params = TensorWiseINT8Layout.quantize(
            weight, is_weight=True, per_channel=True, convrot=self.convrot,
            convrot_groupsize=self.group_size, stochastic_rounding=0)
        return {"weight": qdata, "weight_scale": params.scale.to(torch.float32)}

    def _params(self, scale: torch.Tensor, compute_dtype: torch.dtype, shape):
        from comfy_kitchen.tensor.int8 import TensorWiseINT8Layout
        return TensorWiseINT8Layout.Params(
            scale=scale, orig_dtype=compute_dtype, orig_shape=tuple(shape), is_weight=True,
            convrot=self.convrot, convrot_groupsize=self.group_size)

    def dequantize(self, layer, device=None) -> torch.Tensor:
        from comfy_kitchen.tensor.int8 import TensorWiseINT8Layout
        t = layer.tensors_on(device)
        params = self._params(t["weight_scale"], layer.compute_dtype, t["weight"].shape)
        return TensorWiseINT8Layout.dequantize(t["weight"], params)

    fuses_low_rank = True  # apply(low_rank=...): the Triton path adds a LoRA's part in its GEMM's epilogue

    def apply(self, layer, x: torch.Tensor, input_act: str | None = None,
              low_rank: LowRank | None = None) -> torch.Tensor:
        """The layer's output; with `low_rank` (a LoRA branch's part) plus that part, inside the Triton GEMM where
        that is the kernel chosen (int8_lora), else by an addmm after the GEMM of the activated input."""
        t = layer.tensors_for(x)
        weight, scale, bias = t["weight"], t["weight_scale"], t.get("bias")
        lead = x.shape[:-1]
        x2d = x.reshape(-1, x.shape[-1])
        out_dtype = output_dtype(x, layer.compute_dtype)

        def kitchen() -> torch.Tensor:
            return compiled_ops.int8_linear(x2d, weight, scale, bias, out_dtype, convrot=self.convrot,
                                            convrot_groupsize=self.group_size, input_act=input_act)

        def triton_fused() -> torch.Tensor:
            return compiled_ops.int8_linear_triton(x2d, weight, scale, bias, out_dtype, convrot=self.convrot,
                                                   convrot_groupsize=self.group_size, input_act=input_act)

        def split(rows_per_call: int) -> torch.Tensor:
            return compiled_ops.int8_linear_split(x2d, weight, scale, bias, out_dtype, convrot=self.convrot,
                                                  convrot_groupsize=self.group_size, input_act=input_act,
                                                  rows_per_call=rows_per_call)

        def dequant_gemm() -> torch.Tensor:
            from .kitchen_api import apply_input_act
            if not torch.compiler.is_compiling():
                witness.count_kernel(int8_triton.TALLY, "dequant")
            w = self.dequantize(layer, x.device).to(out_dtype)
            return F.linear(apply_input_act(x2d, input_act).to(out_dtype), w,
                            None if bias is None else bias.to(out_dtype))

        def with_branch(compute) -> torch.Tensor:
            """compute() plus the LoRA's part by an addmm, on the input activated once for both (the candidates
            read x2d and input_act when called)."""
            nonlocal x2d, input_act
            x2d, input_act = swiglu.activated(x2d, input_act), None
            out = compute()
            low_rank.add_to(x2d, out)
            return out

        rows, n_out = x2d.shape[0], weight.shape[0]
        forced_rows = forced_row_split(rows, n_out)
        if forced_rows:
            compute = lambda: split(forced_rows)  # noqa: E731
            return (compute() if low_rank is None else with_branch(compute)).reshape(*lead, n_out)
        candidates = {"kitchen": kitchen}
        if (forced_rows is None and x.device.type == "cuda" and self.row_split == "auto"
                and rows > DEFAULT_SPLIT_ROWS):
            candidates["kitchen_split"] = lambda: split(DEFAULT_SPLIT_ROWS)
        if int8_triton.available(x2d, weight, scale, bias, out_dtype, self.convrot, self.group_size, input_act):
            candidates["triton"] = triton_fused
        # dequant runs only when forced: timed inside a forward it can look faster than the
        # fused kernel (allocator and clock effects) when side by side it is not, and would
        # be picked wrongly.
        candidates["dequant"] = dequant_gemm
        shape = (rows_bucket(rows), x2d.shape[1], n_out, out_dtype, input_act, tuple(candidates))
        choice = _chooser.choose(x.device, shape, candidates, measured=("kitchen", "kitchen_split", "triton"),
                                 default="triton" if x.is_cuda and cuda_at_least(x.device, TRITON_FROM) else "kitchen")
        if low_rank is not None:
            compute = candidates[choice]
            if choice == "triton" and int8_lora.fusable(x2d, low_rank):
                try:
                    out = int8_lora.linear_low_rank(x2d, weight, scale, bias, out_dtype, self.convrot,
                                                    self.group_size, input_act, low_rank)
                except int8_triton.Compiling:  # kitchen's GEMM meanwhile, not the Triton one without the LoRA
                    out, compute = None, kitchen
                if out is not None:
                    return out.reshape(*lead, n_out)
            return with_branch(compute).reshape(*lead, n_out)
        out = candidates[choice]()
        return out.reshape(*lead, n_out)


def _int8_marker(convrot: bool, group_size: int) -> dict:
    if convrot:
        return {"format": TENSORWISE, "convrot": True, "convrot_groupsize": int(group_size)}
    return {"format": TENSORWISE}


@register_format
class Int8ConvRotFormat(QuantFormat):
    """Online INT8 ConvRot; saved as int8_tensorwise markers with the rotation's flags."""
    name = CONVROT
    online = True
    rotation_group = True
    summary = "INT8 weights and per-token activations with ConvRot rotation (native from sm75)"
    auto_rank, auto_from = 1, (7, 5)
    group_sizes = GROUP_SIZES
    auto_on_cpu = True   # no fast format on CPU; INT8 still halves memory

    def method(self, group_size: int = 256, row_split: str = "auto", **_) -> LinearMethod:
        return Int8ConvRotMethod(group_size=group_size, row_split=row_split)

    def native(self, device: torch.device) -> bool:
        return cuda_at_least(device, (7, 5))  # comfy-kitchen's INT8 GEMM; CPU runs its eager reference

    def variants(self) -> tuple[dict, ...]:
        return tuple({"group_size": g} for g in sorted(GROUP_SIZES, reverse=True))  # largest group that fits

    def saved_marker(self, method) -> dict:
        return _int8_marker(method.convrot, method.group_size)


@register_format
class Int8TensorwiseFormat(QuantFormat):
    """ComfyUI's int8_tensorwise markers: weight I8 [N, K]; weight_scale float, per tensor or [N, 1];
    convrot / convrot_groupsize at the marker's top level or under "params"; convert_to_quant adds
    "per_row" (checked against the stored scale)."""
    name = TENSORWISE
    marker = True
    label = f"{TENSORWISE} with or without ConvRot"
    kitchen_layouts = (LAYOUT,)
    contract = Contract(required=frozenset({"weight", "weight_scale"}), weight_dtypes=("I8",),
                        encodings={"weight_scale": "float"}, stored_max=128.0)   # int8's -128
    # auto: kept as stored, re-quantized at load to this GPU's fastest native format (FP8 on sm89+) only where
    # the tuning store holds a measurement of the layer's shape on this GPU that says the conversion pays
    # (quant/auto.py); keep; requantize: to that format wherever there is one
    conversion_modes = ("auto", "keep", "requantize")
    conversion_option = "int8"
    conversion_tooltip = ("INT8 marker layers (with or without ConvRot, as in Comfy-Org's files). auto: kept as "
                          "the file stores them, on the pack's INT8 kernel; a layer is re-quantized while loading "
                          "to this GPU's fastest native format (FP8 on sm89+) only where a measurement kept in the "
                          "tuning store says that pays at its shape (BIGDIT_INT8_TUNE=1 makes them). Nothing is "
                          "timed at load. keep: always INT8. requantize: to that format wherever the GPU has one. "
                          "The report says which path the layers took and why.")
    conversion_rank = 1   # after nvfp4's
    marker_params = {
        "convrot": MarkerParam((bool,), False, means="true or false"),
        "convrot_groupsize": MarkerParam((int,), 256, power_of_4, "a power of 4 from 4 up"),
        "per_row": PER_ROW,
    }

    def method(self, convrot: bool = False, convrot_groupsize: int = 256, **_) -> LinearMethod:
        return Int8ConvRotMethod(group_size=convrot_groupsize, convrot=convrot)

    def native(self, device: torch.device) -> bool:
        return cuda_at_least(device, (7, 5))

    def stored_decision(self, layer, mode, context) -> Layer:
        if mode == "requantize":
            target = next((m for m in context.fastest_native(layer) if m.name != CONVROT), None)
            if target is not None:
                label = f"re-quantized at load to {target.describe()}"
                return layer.conversion(target, label, label, label)
        elif mode == "auto":
            # converted only where a kept measurement says it pays (quant/auto.py): nothing is timed at load
            target, why, numbers = context.faster_native(layer, self.method(**layer.options))
            # the report's headline counts the paths (why included); the record gives the numbers
            if target is not None:
                path = f"re-quantized at load to {target.describe()}: {why}"
                return layer.conversion(target, f"{path} ({numbers})", path, f"{path} ({numbers})")
            path = f"kept as INT8: {why}"
            return layer.conversion(None, f"already quantized; {path} ({numbers})", path, f"{path} ({numbers})")
        return layer.conversion(None, "already quantized")

    def marker_meaning(self, marker: dict) -> dict:
        meaning = super().marker_meaning(marker)
        meaning.pop("per_row")  # it describes the stored scale, which both forms share
        if meaning["convrot"] is not True:
            meaning.pop("convrot_groupsize")
        return meaning

    def marker_options(self, values: dict, in_features: int) -> dict:
        convrot, group_size = values["convrot"], values["convrot_groupsize"]
        if convrot and (group_size not in GROUP_SIZES or in_features % group_size):
            raise ValueError(f"bad marker: convrot_groupsize {group_size} must be one of {list(GROUP_SIZES)} "
                             f"and divide in_features {in_features}")
        return {"convrot": convrot, "convrot_groupsize": group_size}

    def saved_marker(self, method) -> dict:
        return _int8_marker(method.convrot, method.group_size)

    def weight_format(self, params: dict, storage_dtype: torch.dtype) -> str:
        return CONVROT if params.get("convrot", False) else TENSORWISE

    def kitchen_marker(self, params: dict) -> dict:
        return _int8_marker(params.get("convrot", False), params.get("convrot_groupsize", 256))
