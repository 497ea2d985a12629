"""FP8 E4M3 linear layers: online (per-channel weights, per-token activations) and from checkpoints.

Weights carry an fp32 `weight_scale`, per output channel ([N, 1], online) or
per tensor (ComfyUI's scaled-fp8 checkpoints). Activations are quantized per
token at run time, or with the checkpoint's static `input_scale`. On sm89+
the GEMM is `torch._scaled_mm` with row-wise scales; elsewhere the same
quantize-dequantize arithmetic runs in fp32, so CPU results track the GPU's.
"""
from __future__ import annotations

import functools
import logging

import torch
import torch.nn.functional as F

from .method import LinearMethod

log = logging.getLogger(__name__)

FP8 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8).max  # 448
_MIN_SCALE = 1e-12  # an all-zero row would otherwise divide by zero


def _input_act(x: torch.Tensor, input_act: str | None) -> torch.Tensor:
    from .kitchen_api import apply_input_act
    return apply_input_act(x, input_act)


def quantize_rows(x: torch.Tensor, input_act: str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(fp8 rows, fp32 [M, 1] scales) for a 2-D activation, the input activation folded in."""
    x = _input_act(x, input_act)
    return _cast_rows(x, _row_absmax(x))


def _row_absmax(x: torch.Tensor) -> torch.Tensor:
    # The inf-norm reduces without materialising |x|, and is exact in x's dtype.
    return torch.linalg.vector_norm(x, float("inf"), dim=-1, keepdim=True)


def _cast_rows(x: torch.Tensor, absmax: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    scale = (absmax.float() / FP8_MAX).clamp_(min=_MIN_SCALE)
    return (x.float() / scale).clamp_(-FP8_MAX, FP8_MAX).to(FP8), scale


_compiled: dict[str, object] = {}
_compile_failed = False
_triton_failed = False


def _fast_quantize_rows(x: torch.Tensor, input_act: str | None):
    """quantize_rows in as few memory passes as this machine allows.

    The activation pass is what separates FP8's end-to-end speed from the raw
    GEMM's. First choice: the one-pass Triton kernel (fp8_rows). Otherwise a
    plain input takes torch's row inf-norm, then one compiled elementwise
    cast, and an input activation is folded into one compiled kernel; without
    a compiler, eager torch.
    """
    global _compile_failed, _triton_failed
    if input_act in (None, "swiglu") and not _triton_failed:
        from . import fp8_rows
        width = x.shape[1] // (2 if input_act == "swiglu" else 1)
        if fp8_rows.available(x, width):
            try:
                return fp8_rows.quantize_rows(x, input_act == "swiglu", FP8_MAX, _MIN_SCALE)
            except Exception as exc:  # a Triton that imports but cannot compile for this GPU
                _triton_failed = True
                log.warning("FP8: the Triton activation quantizer failed (%s); using torch.compile or eager "
                            "torch instead (slower)", exc)
    if not _compile_failed:
        try:
            if not _compiled:
                _compiled["cast"] = torch.compile(_cast_rows)
                _compiled["act"] = torch.compile(quantize_rows)
            torch._dynamo.mark_dynamic(x, 0)  # token counts vary; widths do not
            if input_act is None:
                absmax = _row_absmax(x)
                torch._dynamo.mark_dynamic(absmax, 0)
                return _compiled["cast"](x, absmax)
            return _compiled["act"](x, input_act)
        except Exception as exc:  # no Triton / no compiler on this machine
            _compile_failed = True
            log.warning("FP8: torch.compile unavailable (%s); activation quantization runs eagerly (slower)", exc)
    return quantize_rows(x, input_act)


@functools.lru_cache(maxsize=None)
def _capability(device: torch.device) -> tuple[int, int]:
    return torch.cuda.get_device_capability(device)


def native_fp8_supported(device: torch.device) -> bool:
    return device.type == "cuda" and _capability(device) >= (8, 9)


class Fp8Method(LinearMethod):
    name = "float8_e4m3fn"

    def skip_reason(self, in_features: int, out_features: int) -> str | None:
        # cuBLASLt FP8 GEMMs need both dims to be multiples of 16.
        if in_features % 16 or out_features % 16:
            return f"shape {out_features}x{in_features} not a multiple of 16 (FP8 GEMM)"
        return None

    def describe(self) -> str:
        return "float8_e4m3fn (per-channel weights, per-token activations)"

    def quantize_weight(self, weight: torch.Tensor) -> dict[str, torch.Tensor]:
        w = weight.float()
        scale = (w.abs().amax(dim=1, keepdim=True) / FP8_MAX).clamp_(min=_MIN_SCALE)
        return {"weight": (w / scale).clamp_(-FP8_MAX, FP8_MAX).to(FP8), "weight_scale": scale}

    @staticmethod
    def _row_scales(weight_scale: torch.Tensor, n_out: int) -> torch.Tensor:
        """Weight scales as a [1, N] fp32 row, whether stored per tensor or per channel."""
        if weight_scale.numel() == 1:
            return weight_scale.float().reshape(1, 1).expand(1, n_out).contiguous()
        return weight_scale.float().reshape(1, n_out)

    def dequantize(self, layer) -> torch.Tensor:
        scales = self._row_scales(layer.weight_scale, layer.out_features).reshape(-1, 1)
        return (layer.weight.float() * scales).to(layer.compute_dtype)

    def apply(self, layer, x: torch.Tensor, input_act: str | None = None) -> torch.Tensor:
        t = layer.tensors_for(x)
        weight, bias = t["weight"], t.get("bias")
        n_out = weight.shape[0]
        out_dtype = x.dtype if x.dtype in (torch.float16, torch.bfloat16) else layer.compute_dtype
        lead = x.shape[:-1]
        x2d = x.reshape(-1, x.shape[-1])
        input_scale = t.get("input_scale")
        native = native_fp8_supported(x.device)
        if input_scale is not None:
            # Static activation scale from the checkpoint.
            xa = _input_act(x2d, input_act).float()
            xq = (xa / input_scale.float()).clamp_(-FP8_MAX, FP8_MAX).to(FP8)
            x_scale = input_scale.float().reshape(1, 1).expand(xq.shape[0], 1).contiguous()
        elif native:
            xq, x_scale = _fast_quantize_rows(x2d, input_act)
        else:
            xq, x_scale = quantize_rows(x2d, input_act)
        w_scale = self._row_scales(t["weight_scale"], n_out)
        if native:
            # cuBLASLt fuses a bias only into 16-bit outputs.
            fused_bias = bias is not None and out_dtype != torch.float32
            out = torch._scaled_mm(xq, weight.t(), scale_a=x_scale, scale_b=w_scale,
                                   bias=bias.to(out_dtype) if fused_bias else None,
                                   out_dtype=out_dtype, use_fast_accum=True)
            if bias is not None and not fused_bias:
                out += bias.to(out_dtype)
        else:
            out = F.linear(xq.float() * x_scale, weight.float() * w_scale.reshape(-1, 1),
                           None if bias is None else bias.float()).to(out_dtype)
        return out.reshape(*lead, n_out)
