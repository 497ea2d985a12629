"""FP8 E4M3 linear layers: online (per-channel weights, per-token activations) and from checkpoints.

Weights carry an fp32 `weight_scale`, per output channel ([N, 1], online) or
per tensor (ComfyUI's scaled-fp8 checkpoints). Activations are quantized per
token at run time, or with the checkpoint's static `input_scale`. On sm89+
the GEMM is `torch._scaled_mm` with row-wise scales; elsewhere the same
quantize-dequantize arithmetic runs in fp32, so CPU results track the GPU's.
Every path quantizes rows by one formula (`quantize_rows`), bit for bit.
"""
from __future__ import annotations


import torch
import torch.nn.functional as F

from ..dtypes import HALF_DTYPES, dtype_name
from ..hardware import cuda_at_least
from ..pack_logging import pack_logger
from .descriptor import PER_ROW, Contract, QuantFormat
from .layer import Layer
from .linear_method import LinearMethod, output_dtype
from .registry import register_format

log = pack_logger(__name__)

NAME = "float8_e4m3fn"

FP8 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8).max  # 448
# 1/448 as the nearest fp32: the scale is a product, so torch (CPU, CUDA) and Triton compute it alike
# (torch's CUDA division by a scalar is itself a product with a reciprocal).
INV_FP8_MAX = torch.tensor(1 / FP8_MAX, dtype=torch.float32).item()
_MIN_SCALE = 1e-12  # an all-zero row would otherwise get a zero scale

# ComfyUI's scaled_fp8 files (read_scaled_fp8, at the end)
SCALED_FP8 = "scaled_fp8"
_SCALED_ROLES = {"scale_weight": "weight_scale", "scale_input": "input_scale"}   # file suffix -> role
_SCALED_NAMES = {"weight_scale": "scaled_fp8 scale_weight", "input_scale": "scaled_fp8 scale_input"}
_SCALED_WEIGHT_DTYPES = {"F8_E4M3": FP8, "F32": FP8, "F8_E5M2": torch.float8_e5m2}


def _input_act(x: torch.Tensor, input_act: str | None) -> torch.Tensor:
    if input_act is None:
        return x
    from .kitchen_api import apply_input_act
    return apply_input_act(x, input_act)


def quantize_rows(x: torch.Tensor, input_act: str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(fp8 rows, fp32 [M, 1] scales) for a 2-D activation, the input activation folded in.

    The definition every path computes bit for bit (fp8_rows' Triton kernel
    included), in fp32: scale = max(absmax * fp32(1/448), 1e-12), then
    q = fp8(clamp(x * (1 / scale), -448, 448)), the reciprocal correctly
    rounded once per row. Per-element products round the same everywhere;
    per-element divisions do not (Triton's is approximate, IEEE division is slow).
    """
    x = _input_act(x, input_act)
    scale, inv_scale = row_scales(_row_absmax(x))
    return _cast_rows(x, inv_scale), scale


def _row_absmax(x: torch.Tensor) -> torch.Tensor:
    # The inf-norm reduces without materialising |x|, and is exact in x's dtype.
    return torch.linalg.vector_norm(x, float("inf"), dim=-1, keepdim=True)


def row_scales(absmax: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(scale, 1 / scale), fp32: a row's absmax maps to FP8's largest value."""
    scale = (absmax.float() * INV_FP8_MAX).clamp_(min=_MIN_SCALE)
    return scale, torch.reciprocal(scale)


def _cast_rows(x: torch.Tensor, inv_scale: torch.Tensor) -> torch.Tensor:
    return (x.float() * inv_scale).clamp_(-FP8_MAX, FP8_MAX).to(FP8)


_compiled: dict[str, object] = {}
_compile_failed = False
_triton_failed = False


def _fast_quantize_rows(x: torch.Tensor, input_act: str | None):
    """quantize_rows in as few memory passes as this machine allows, with the same result.

    The activation pass is what separates FP8's end-to-end speed from the raw
    GEMM's. First choice: the one-pass Triton kernel (fp8_rows). Otherwise the
    input activation runs eagerly, torch's row inf-norm and the per-row
    scales follow, and one compiled elementwise kernel casts; without a
    compiler, eager torch.
    """
    global _compile_failed, _triton_failed
    if input_act in (None, "swiglu") and not _triton_failed:
        from . import fp8_rows
        width = x.shape[1] // (2 if input_act == "swiglu" else 1)
        if fp8_rows.available(x, width):
            try:
                return fp8_rows.quantize_rows(x, input_act == "swiglu", INV_FP8_MAX, FP8_MAX, _MIN_SCALE)
            except Exception as exc:  # a Triton that imports but cannot compile for this GPU
                _triton_failed = True
                log.warning("FP8: the Triton activation quantizer failed (%s); using torch.compile or eager "
                            "torch instead (slower)", exc)
    if not _compile_failed:
        try:
            if not _compiled:
                _compiled["cast"] = torch.compile(_cast_rows)
            x = _input_act(x, input_act)
            scale, inv_scale = row_scales(_row_absmax(x))
            torch._dynamo.mark_dynamic(x, 0)  # token counts vary; widths do not
            torch._dynamo.mark_dynamic(inv_scale, 0)
            return _compiled["cast"](x, inv_scale), scale
        except Exception as exc:  # no Triton / no compiler on this machine
            _compile_failed = True
            log.warning("FP8: torch.compile unavailable (%s); activation quantization runs eagerly (slower)", exc)
    return quantize_rows(x, input_act)


def native_fp8_supported(device: torch.device) -> bool:
    return cuda_at_least(device, (8, 9))


class Fp8Method(LinearMethod):
    name = NAME

    def skip_reason(self, in_features: int, out_features: int) -> str | None:
        # cuBLASLt FP8 GEMMs need both dims to be multiples of 16.
        if in_features % 16 or out_features % 16:
            return f"shape {out_features}x{in_features} not a multiple of 16 (FP8 GEMM)"
        return None

    def describe(self) -> str:
        return f"{NAME} (per-channel weights, per-token activations)"

    def quantize_weight(self, weight: torch.Tensor) -> dict[str, torch.Tensor]:
        # A weight's output channels are rows: the same quantizer as the activations'.
        q, scale = quantize_rows(weight)
        return {"weight": q, "weight_scale": scale}

    @staticmethod
    def _row_scales(weight_scale: torch.Tensor, n_out: int) -> torch.Tensor:
        """Weight scales as a [1, N] fp32 row, whether stored per tensor or per channel."""
        if weight_scale.numel() == 1:
            return weight_scale.float().reshape(1, 1).expand(1, n_out).contiguous()
        return weight_scale.float().reshape(1, n_out)

    def dequantize(self, layer, device=None) -> torch.Tensor:
        t = layer.tensors_on(device)
        scales = self._row_scales(t["weight_scale"], layer.out_features).reshape(-1, 1)
        return (t["weight"].float() * scales).to(layer.compute_dtype)

    def apply(self, layer, x: torch.Tensor, input_act: str | None = None) -> torch.Tensor:
        t = layer.tensors_for(x)
        weight, bias = t["weight"], t.get("bias")
        n_out = weight.shape[0]
        out_dtype = output_dtype(x, layer.compute_dtype)
        lead = x.shape[:-1]
        x2d = x.reshape(-1, x.shape[-1])
        input_scale = t.get("input_scale")
        native = native_fp8_supported(x.device)
        if input_scale is not None:
            # Static activation scale from the checkpoint.
            xq = _cast_rows(_input_act(x2d, input_act), torch.reciprocal(input_scale.float()).reshape(1, 1))
            x_scale = input_scale.float().reshape(1, 1).expand(xq.shape[0], 1).contiguous()
        elif native:
            xq, x_scale = _fast_quantize_rows(x2d, input_act)
        else:
            xq, x_scale = quantize_rows(x2d, input_act)
        w_scale = self._row_scales(t["weight_scale"], n_out)
        if native:
            # Row-wise scaled GEMMs write 16-bit outputs (fp32 only on some torch versions); an fp32
            # input gets the 16-bit result widened. cuBLASLt fuses a bias only into 16-bit outputs.
            gemm_dtype = out_dtype if out_dtype != torch.float32 else _sixteen_bit(layer.compute_dtype)
            shape = (x.device, xq.shape[0], xq.shape[1], n_out, out_dtype)
            fused_bias = bias is not None and gemm_dtype == out_dtype and (
                torch.compiler.is_compiling() or shape not in _NO_FUSED_BIAS)  # a trace keeps its own
            try:
                out = torch._scaled_mm(xq, weight.t(), scale_a=x_scale, scale_b=w_scale,
                                       bias=bias.to(out_dtype) if fused_bias else None,
                                       out_dtype=gemm_dtype, use_fast_accum=True).to(out_dtype)
            except RuntimeError as exc:
                # cuBLASLt finds no algorithm for some shapes with a fused bias (seen on an H100: 18 rows,
                # 16384 -> 4096): the same product without the epilogue, the bias added after
                if not fused_bias or "NOT_SUPPORTED" not in str(exc):
                    raise
                fused_bias = False
                _NO_FUSED_BIAS.add(shape)  # its next calls go straight to the product without the epilogue
                out = torch._scaled_mm(xq, weight.t(), scale_a=x_scale, scale_b=w_scale, out_dtype=gemm_dtype,
                                       use_fast_accum=True).to(out_dtype)
            if bias is not None and not fused_bias:
                out += bias.to(out_dtype)
        else:
            out = F.linear(xq.float() * x_scale, weight.float() * w_scale.reshape(-1, 1),
                           None if bias is None else bias.float()).to(out_dtype)
        return out.reshape(*lead, n_out)


#: (device, rows, in, out, dtype) of the GEMMs cuBLASLt refused a fused bias for, in this process
_NO_FUSED_BIAS: set[tuple] = set()


def _sixteen_bit(dtype: torch.dtype) -> torch.dtype:
    return dtype if dtype in HALF_DTYPES else torch.bfloat16


@register_format
class Fp8Format(QuantFormat):
    """FP8 E4M3, online and from ComfyUI markers: weight F8_E4M3 [N, K]; weight_scale float, per tensor or
    [N, 1]; input_scale optional, a static activation scale. scaled_fp8 files load as these layers too."""
    name = NAME
    marker = True
    online = True
    summary = "FP8 per-channel weights, per-token activations (sm89+ native)"
    aliases = ("fp8_e4m3fn",)   # LoadH3Quantized's option before it took the markers' spelling
    kitchen_layouts = ("TensorCoreFP8Layout", "TensorCoreFP8E4M3Layout")   # ComfyUI registers both names
    # a plain FP8 weight in someone's Linear (ComfyUI's fp8 weight dtypes, scaled or not) is an FP8 layer
    storage_dtypes = (torch.float8_e4m3fn, torch.float8_e5m2)
    # FP8 layers stay as they are, or are dequantized and quantized again with the quantization asked for
    conversion_modes = ("keep", "requantize")
    conversion_option = "requantize_fp8"   # QuantizeModelINT8's switch
    auto_rank, auto_from = 0, (8, 9)   # its GEMMs outrun INT8 ConvRot's from sm89
    contract = Contract(required=frozenset({"weight", "weight_scale"}), optional=frozenset({"input_scale"}),
                        weight_dtypes=("F8_E4M3",), encodings={"weight_scale": "float", "input_scale": "float"},
                        stored_max=FP8_MAX)
    marker_params = {"per_row": PER_ROW}

    def method(self, **_) -> LinearMethod:
        return Fp8Method()

    def native(self, device: torch.device) -> bool:
        return native_fp8_supported(device)

    def weight_format(self, params: dict, storage_dtype: torch.dtype) -> str:
        return dtype_name(storage_dtype)

    def stored_decision(self, layer, mode, context) -> Layer:
        if mode != "requantize":
            return layer.conversion(None, "already quantized")
        method, reason = context.float_choice(layer, torch.float8_e4m3fn)
        if method is not None:
            reason = f"re-quantized from {layer.stored_label or NAME}: {reason}"
        return layer.conversion(method, reason)

    convention = SCALED_FP8
    convention_label = "a scaled_fp8 marker"

    def convention_keys(self, file) -> list[str]:
        return [k for k in file.tensors if k == SCALED_FP8 or k.endswith("." + SCALED_FP8)]

    def unmarked(self, file):
        """Layers of a file without a marker that still look scaled_fp8 (an F8 weight beside a scale_weight)."""
        layers = [key.rpartition(".")[0] for key in file.tensors if key.endswith(".scale_weight")
                  and file.tensors.get(key[:-len("scale_weight")] + "weight", (None, ""))[1].startswith("F8")]
        return ("FP8 weights with scale_weight but no scaled_fp8 marker: the scales would be ignored",
                layers) if layers else None

    def read_convention(self, file):
        return read_scaled_fp8(file, self.convention_keys(file))

    def conversion_note(self, converted, kept, mode) -> list[str]:
        notes = []
        if converted:
            targets = ", ".join(sorted({layer.method.name for layer in converted}))
            notes.append(f"re-quantized {len(converted)} fp8 layers to {targets}")
        if kept:
            notes.append(f"kept {kept} fp8 layers as they were" + ("" if mode == "requantize" else
                                                                   " (requantize_fp8 is off)"))
        return notes


# ---- ComfyUI's scaled_fp8 files (Comfy-Org's `*_fp8_scaled.safetensors`), read as FP8 layers --------------------
# As ComfyUI 0.3.75 reads them natively (upstream converts them to float8_e4m3fn markers on load,
# `comfy.utils.convert_old_quants`):
#   <prefix>scaled_fp8     a marker tensor; its dtype is the weights' FP8 dtype (F32 stands for F8_E4M3), two
#                          elements ask for full-precision matmuls
#   <layer>.weight         F8_E4M3 [N, K], for every layer under <prefix> with a scale_weight
#   <layer>.scale_weight   a float scalar: the dequantized weight is weight * scale_weight
#   <layer>.scale_input    optional float scalar, a static activation scale; writers store 1.0 when they have
#                          none, which upstream drops, and so does this reader
# Each such layer becomes a float8_e4m3fn layer with a per-tensor weight_scale.



def read_scaled_fp8(file, markers: list[str]):
    """The layers of a scaled_fp8 file (loaders/conventions.py's ConventionFile), validated: an E4M3 marker,
    every scale under a marker's prefix with an F8_E4M3 2-D weight beside it, scales finite, positive float
    scalars. Raises CheckpointError naming the file and layers."""
    problems = file.problems
    prefixes = []
    for key in markers:
        dtype = file.tensors[key].dtype
        fp8 = _SCALED_WEIGHT_DTYPES.get(dtype)
        if fp8 is None:
            problems.add(f"bad scaled_fp8 marker: its dtype must name the weights' FP8 type (F8_E4M3, or F32 "
                         f"for it), found {dtype}", key)
        elif fp8 != FP8:
            problems.add(f"unsupported scaled_fp8 weights {dtype_name(fp8)}: the pack's FP8 layers "
                         f"are {NAME}; load this file with ComfyUI's UNETLoader", key)
        prefixes.append(key[:-len(SCALED_FP8)])
    problems.raise_if_any()

    layers, claimed, placeholders = {}, set(markers), 0
    scaled = sorted({key.rpartition(".")[0] for key in file.tensors if key.rpartition(".")[2] in _SCALED_ROLES})
    for name in file.checked(scaled):
        present = file.companions(name)
        claimed.update(present[suffix] for suffix in _SCALED_ROLES if suffix in present)
        if not any(name.startswith(prefix) for prefix in prefixes):
            problems.add(f"scale tensor(s) outside the model the scaled_fp8 marker covers "
                         f"(prefix {', '.join(repr(p) for p in prefixes)})", name)
            continue
        layer = _scaled_layer(file, name, present)
        if layer is None:
            continue
        scale_input = layer.tensors.get("input_scale")
        if scale_input is not None and float(file.read(scale_input).float().reshape(-1)[0]) == 1.0:
            layer = file.layer(name, layer.format, {r: k for r, k in layer.tensors.items() if r != "input_scale"},
                               layer.storage_shape, source=layer.source)
            placeholders += 1
        layers[name] = layer
    problems.raise_if_any()
    for layer in file.checked(layers.values()):
        file.check_scales(layer, _SCALED_NAMES)
    problems.raise_if_any()

    notes = []
    if placeholders:
        notes.append(f"scaled_fp8: scale_input 1.0 (a writer's placeholder) on {placeholders} layer(s) ignored, "
                     f"their activations are scaled per token")
    if any(file.tensors[key].numel == 2 for key in markers):
        notes.append("scaled_fp8: the file asks for full-precision matmuls; its layers run as the pack's FP8 "
                     "layers (FP8 activations, per token)")
    return file.result("ComfyUI scaled_fp8", layers, claimed, notes)


def _scaled_layer(file, name: str, present: dict[str, str]):
    problems = file.problems
    if "scale_weight" not in present:
        problems.add("scaled_fp8 scale_input without a scale_weight", name)
        return None
    if "weight" not in present:
        problems.add("scaled_fp8 scale_weight without a weight", name)
        return None
    weight = file.tensors[present["weight"]]
    if not file.expect_dtype(weight, ("F8_E4M3",), "scaled_fp8 weight", name):
        return None
    if len(weight.shape) != 2:
        problems.add(f"shape mismatch: scaled_fp8 weight must be 2-D, found {list(weight.shape)}", name)
        return None
    tensors = {"weight": present["weight"]}
    for suffix, role in _SCALED_ROLES.items():
        if suffix not in present:
            continue
        info = file.tensors[present[suffix]]
        if not file.float_scale(info, f"scaled_fp8 {suffix}", name):
            return None
        if not file.is_scalar(info):
            problems.add(f"shape mismatch: scaled_fp8 {suffix} must be a scalar, found {list(info.shape)}", name)
            return None
        tensors[role] = present[suffix]
    return file.layer(name, NAME, tensors, tuple(weight.shape), source=SCALED_FP8)
