"""QuantLinear: the module that replaces an nn.Linear whose weight was quantized.

It holds the method's stored tensors as frozen parameters (so `.to()`,
`state_dict()` and a host's size accounting see their true bytes) and
delegates the forward to the method. `quantized_layer` makes one from a
full-precision weight, for every caller; `requantized_layer` is the one
dequantize-then-quantize routine (a stored layer converted to another format).

Three generic hooks serve a host that manages weights itself (host/ adapts
ComfyUI's protocols onto them, in a subclass): `weight_pager` (the host pages
weight and bias, and hands each call the device copies), per-call weight
transforms (`weight_patches`, applied to the dequantized weight) and branches
beside the GEMM (`output_branches`, each adding its part to the output: a
LoRA's low-rank branch, host/lora_branch.py). A patch
written into the stored tensors (`write_patched`, or `quantized_patch` once and
`write_patched_tensors` each time it is written back) keeps the tensors it
replaced until `restore_unpatched`.
"""
from __future__ import annotations

from typing import Callable, Protocol

import torch
from torch import nn

from .descriptor import PRE_QUANT_SCALE
from . import swiglu
from .kitchen_api import apply_input_act
from .witness import count_run


class LayerMethod(Protocol):
    """What a QuantLinear needs of its method; every LinearMethod (quant/linear_method.py) is one.

    Spelled out here so that this module, which the methods build on, does not import them."""
    name: str

    def quantize_weight(self, weight: torch.Tensor) -> dict[str, torch.Tensor]: ...

    def apply(self, layer: "QuantLinear", x: torch.Tensor, input_act: str | None = None) -> torch.Tensor: ...

    def dequantize(self, layer: "QuantLinear", device: torch.device | None = None) -> torch.Tensor: ...

    def describe(self) -> str: ...


def quantized_layer(method: LayerMethod, weight: torch.Tensor, in_features: int, out_features: int,
                    bias: torch.Tensor | None, compute_dtype: torch.dtype, device: torch.device,
                    home: torch.device, to_home: Callable[[torch.Tensor], torch.Tensor] | None = None,
                    layer_type: type["QuantLinear"] | None = None) -> "QuantLinear":
    """`weight` [out, in] quantized by `method` on `device`, as a QuantLinear whose tensors live on `home`
    (moved there by `to_home` if given: a loader's pinned staging), of `layer_type` (a host's subclass).

    The one way a quantized layer is made from a full-precision weight: the
    quantization pass, auto's measurement and the loaders all build through it,
    so only this layer's weight is on `device` at a time. `weight` is not modified.
    """
    with torch.no_grad():
        tensors = method.quantize_weight(weight.to(device))
    move = to_home or (lambda t: t.to(home))
    tensors = {k: move(v) for k, v in tensors.items()}
    return (layer_type or QuantLinear)(method, in_features, out_features, tensors, bias, compute_dtype)


def dequantized_weight(method: LayerMethod, tensors: dict[str, torch.Tensor], in_features: int, out_features: int,
                       compute_dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """The full-precision [out, in] weight that `method`'s stored `tensors` represent, computed on `device`,
    with a smoothing `pre_quant_scale` folded in (the weight then computes without it)."""
    on_device = {k: v.to(device) for k, v in tensors.items()}
    stand_in = QuantLinear(method, in_features, out_features, on_device, None, compute_dtype)
    with torch.no_grad():
        return _smoothing_folded(method.dequantize(stand_in), on_device.get(PRE_QUANT_SCALE))


def _smoothing_folded(weight: torch.Tensor, pre_scale: torch.Tensor | None) -> torch.Tensor:
    """`weight` [out, in] times the smoothing scale [in] its layer multiplies the input by (AWQ's
    pre_quant_scale): the weight that computes the same without it."""
    return weight if pre_scale is None else weight * pre_scale.to(weight.device, weight.dtype)


def requantized_layer(source: nn.Module, target: LayerMethod, device: torch.device, home: torch.device,
                      layer_type: type["QuantLinear"] | None = None, *,
                      dequantize: Callable[[nn.Module, torch.device], torch.Tensor] | None = None,
                      compute_dtype: torch.dtype | None = None,
                      watch: Callable[["QuantLinear", torch.Tensor], None] | None = None) -> "QuantLinear":
    """The one dequantize-then-quantize routine: `source`'s weight dequantized on `device` (a QuantLinear's by
    its method; another stored layer's, a host's own, by `dequantize(source, device)`, computing in
    `compute_dtype`), its smoothing pre_quant_scale folded in, and quantized by `target`, as a layer on `home`
    with `source`'s bias, of `layer_type` (default: a QuantLinear source's type). `watch(new layer, weight)` is
    handed the full-precision weight it was quantized from (a first-call check's reference), so none dequantizes
    it again.

    A patch written into `source` (a LoRA) is left out, as its host patches the new layer itself: a layer that
    does not hold its unpatched weight (the host keeps it) raises."""
    if isinstance(source, QuantLinear):
        held = source._unpatched
        tensors = source.stored_tensors() if held is not None and "weight" not in held else source.unpatched_tensors()
        weight = dequantized_weight(source.method, tensors, source.in_features, source.out_features,
                                    source.compute_dtype, device)
        compute_dtype, layer_type = source.compute_dtype, layer_type or type(source)
    else:
        with torch.no_grad():
            weight = _smoothing_folded(dequantize(source, device), source._parameters.get(PRE_QUANT_SCALE))
    bias = source._parameters.get("bias")
    bias = None if bias is None else bias.detach().to(compute_dtype)
    built = quantized_layer(target, weight, source.in_features, source.out_features, bias, compute_dtype,
                            device, home, layer_type=layer_type)
    if watch is not None:
        watch(built, weight)
    return built


class QuantLinear(nn.Module):
    def __init__(self, method: LayerMethod, in_features: int, out_features: int,
                 tensors: dict[str, torch.Tensor], bias: torch.Tensor | None,
                 compute_dtype: torch.dtype):
        super().__init__()
        self.method = method
        self.in_features = in_features
        self.out_features = out_features
        self.compute_dtype = compute_dtype
        for key, tensor in tensors.items():
            self.register_parameter(key, nn.Parameter(tensor, requires_grad=False))
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)
        # Where the host pages weight and bias itself: `weight_pager(layer, device)` is a context manager
        # yielding {"weight", "bias"} on `device` for one call, or None where the host does not page this layer.
        self.weight_pager: Callable | None = None
        self._paged: dict[str, torch.Tensor | None] | None = None
        # While a patch is written into the stored tensors: the tensors it replaced (see write_patched), and the
        # relative error of its requantized weight against the patched one. A plain dict, so that nn.Module does
        # not register them as parameters.
        self._unpatched: dict[str, nn.Parameter] | None = None
        self.patch_error: float | None = None
        self.runs = 0  # calls, for the run-time witness (quant/witness.py)
        # auto's choice checked at the first real call, then any fallback's route (quant/real_error.py): called as
        # `real_check(layer, x, input_act)` in place of the method's apply; `real_error` is the check's outcome.
        self.real_check: Callable | None = None
        self.real_error = None

    def tensors_on(self, device: torch.device | None = None) -> dict[str, torch.Tensor]:
        """This layer's parameters on `device` (default: the weight's); a per-call copy of those elsewhere.

        A host's partial loading may leave whole layers in RAM; a host that pages weight and bias leaves those
        there and moves the other tensors.
        """
        device = self.weight.device if device is None else device
        out = {}
        paged = self._paged if self._paged is not None and self._paged["weight"].device == device else {}
        for key, param in self._parameters.items():
            if key in paged:
                param = paged[key]
            if param is None:
                continue
            # Only host-to-device copies may be asynchronous: a tensor copied to the CPU is read at once.
            out[key] = param if param.device == device else param.to(device, non_blocking=device.type != "cpu")
        return out

    def tensors_for(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        """This layer's parameters on x's device."""
        return self.tensors_on(x.device)

    def stored_tensors(self) -> dict[str, torch.Tensor]:
        """The method's tensors by role (bias excluded), as a checkpoint stores them.

        Raises while a patch (e.g. a LoRA) is written into the layer: the tensors would carry it.
        """
        if self._unpatched is not None:
            raise RuntimeError("a weight patch (e.g. a LoRA) is written into this layer")
        return {key: param for key, param in self._parameters.items() if param is not None and key != "bias"}

    def unpatched_tensors(self) -> dict[str, torch.Tensor]:
        """The method's tensors without any patch written in (those the patch replaced, where one is)."""
        held = {k: v for k, v in {**self._parameters, **(self._unpatched or {})}.items()
                if v is not None and k != "bias"}
        return held

    def forward(self, x: torch.Tensor, input_act: str | None = None) -> torch.Tensor:
        count_run(self)
        if self.weight_pager is None:
            return self._forward(x, input_act)
        with self.weight_pager(self, x.device) as paged:
            self._paged = paged
            try:
                return self._forward(x, input_act)
            finally:
                self._paged = None

    def _forward(self, x: torch.Tensor, input_act: str | None) -> torch.Tensor:
        pre_scale = self._parameters.get(PRE_QUANT_SCALE)
        if pre_scale is not None:
            # a smoothing scale (AWQ) multiplies the input before all else, as in upstream ComfyUI's Linear:
            # under a LoRA too, which patches the stored weight
            x = apply_input_act(x, input_act) * pre_scale.to(x.device, x.dtype)
            input_act = None
        branches = self.output_branches()
        weight_patches, bias_patches = self.weight_patches("weight"), self.weight_patches("bias")
        if (len(branches) == 1 and getattr(self.method, "fuses_low_rank", False) and not weight_patches
                and not bias_patches and self.real_check is None):
            low_rank = getattr(branches[0], "low_rank", None)
            part = low_rank() if low_rank is not None else None
            if part is not None:  # the branch's part added by the method, from its own rows where it can
                return self.method.apply(self, x, input_act=input_act, low_rank=part)
        if branches and input_act is not None:
            x, input_act = swiglu.activated(x, input_act), None  # once, for the GEMM and the branches
        if weight_patches or bias_patches:
            out = self._forward_patched(x, input_act, weight_patches, bias_patches)
        elif self.real_check is not None:
            out = self.real_check(self, x, input_act)
        else:
            out = self.method.apply(self, x, input_act=input_act)
        if branches:
            out = out.contiguous()
            for branch in branches:
                out = branch(x, out)
        return out

    def weight_patches(self, name: str) -> list:
        """Per-call transforms of the dequantized `name` ("weight" or "bias"), in order; a host's subclass
        gives its own (host/layers.py)."""
        return []

    def output_branches(self) -> list[Callable[[torch.Tensor, torch.Tensor], torch.Tensor]]:
        """Callables `branch(x, out)` run after the GEMM, in order, on its input (activation and smoothing
        applied) and its output, which is the layer's own: each returns the output with its part added (in
        place or not). A lone branch may also offer `low_rank()`: its whole part as a quant.low_rank.LowRank, or
        None; a method that `fuses_low_rank` then adds it itself, on the input before its activation (the INT8
        Triton path from its own quantized rows, in its GEMM's epilogue). A host's subclass gives its own
        (host/layers.py)."""
        return []

    def _forward_patched(self, x: torch.Tensor, input_act: str | None, weight_patches: list,
                         bias_patches: list) -> torch.Tensor:
        """Per-call weight transforms act on the dequantized weight."""
        weight = self.method.dequantize(self, x.device).to(x.dtype)
        for patch in weight_patches:
            weight = patch(weight)
        bias = self._paged["bias"] if self._paged is not None else self.bias
        bias = None if bias is None else bias.to(x.device, x.dtype)
        for patch in bias_patches:
            bias = patch(bias)
        return torch.nn.functional.linear(apply_input_act(x, input_act), weight, bias)

    def dequantized(self, device: torch.device | None = None, dtype: torch.dtype | None = None,
                    unpatched: bool = False) -> torch.Tensor:
        """The full-precision weight (`unpatched`: without a patch written in), on `device`, in `dtype`."""
        source = self
        if unpatched and self._unpatched is not None and "weight" in self._unpatched:
            source = QuantLinear(self.method, self.in_features, self.out_features, self.unpatched_tensors(),
                                 None, self.compute_dtype)
        return self.method.dequantize(source, device).to(dtype or self.compute_dtype)

    def quantized_patch(self, weight: torch.Tensor) -> tuple[dict[str, torch.Tensor], float]:
        """A patched full-precision `weight` quantized by this layer's method with fresh scales (a LoRA may widen a
        row's range), on its device: (the method's tensors, for write_patched_tensors; the relative L2 error of
        their dequantized weight against `weight`, what the requantization costs)."""
        with torch.no_grad():
            fresh = self.method.quantize_weight(weight.to(self.compute_dtype))
            held = {k: v for k, v in self.unpatched_tensors().items() if k != PRE_QUANT_SCALE}
            stand_in = QuantLinear(self.method, self.in_features, self.out_features, {**held, **fresh}, None,
                                   self.compute_dtype)
            exact = weight.float()
            error = (torch.linalg.vector_norm(self.method.dequantize(stand_in, weight.device).float() - exact)
                     / torch.linalg.vector_norm(exact).clamp_min(torch.finfo(torch.float32).tiny))
        return fresh, float(error)

    def write_patched(self, weight: torch.Tensor, keep_weight: bool = True) -> None:
        """Quantize a patched full-precision `weight` with fresh scales into this layer (quantized_patch, then
        write_patched_tensors)."""
        fresh, error = self.quantized_patch(weight)
        self.write_patched_tensors(fresh, keep_weight, error)

    def write_patched_tensors(self, fresh: dict[str, torch.Tensor], keep_weight: bool = True,
                              error: float | None = None) -> None:
        """Write a patch quantized already (`quantized_patch`'s tensors, `error` its cost) into this layer, each
        tensor where the one it replaces is (the very tensor where it is there already), keeping the tensors it
        replaces for `restore_unpatched` (a patch on a patch keeps the first ones). `keep_weight` False: the
        unpatched weight is kept elsewhere (a host's backup) and is not held twice. New Parameters, never writes
        into the old storage, which a backup may share."""
        if self._unpatched is None:
            self._unpatched = {k: getattr(self, k) for k in fresh if k != "weight" or keep_weight}
        for key, tensor in fresh.items():
            device = self._parameters[key].device
            # written into _parameters directly: a host subclass may read an assignment of `weight` as a restore
            self._parameters[key] = (tensor if isinstance(tensor, nn.Parameter) and tensor.device == device
                                     else nn.Parameter(tensor.to(device), requires_grad=False))
        self.patch_error = error

    def restore_unpatched(self, weight_too: bool = True) -> None:
        """Put back the tensors `write_patched` replaced, the very ones (without `weight_too`: all but the weight,
        which the caller restores)."""
        unpatched, self._unpatched = self._unpatched, None
        self.patch_error = None
        for key, tensor in (unpatched or {}).items():
            if key != "weight" or weight_too:
                self._parameters[key] = tensor

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias is not None}, format={self.method.describe()}")
