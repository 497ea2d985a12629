"""Online MXFP4: OCP Microscaling Formats (MX) Specification v1.0, "MXFP4".

Format: FP4 E2M1 elements in blocks of 32 consecutive input features, one E8M0
scale per block; an element decodes as 2^(scale - 127) * element.

Stored tensors (every execution path but AITER's):
  weight        uint8 [N, K/2]   two E2M1 codes per byte: element 2i in the LOW
                                 nibble, element 2i+1 in the high nibble. The spec
                                 leaves the byte layout open; this is the order of
                                 torch.float4_e2m1fn_x2, which torch._scaled_mm and
                                 AITER read. (comfy-kitchen's NVFP4 defaults to the
                                 opposite, hi_first=True; its swap_nibbles converts.)
  weight_scale  uint8 [N, K/32]  E8M0 biased exponents; 0xFF is NaN.

Execution paths, detected once per device (`execution_path`):
  aiter     ROCm gfx95x (MI350+) with AITER importable: AITER's dynamic MXFP4
            activation quantization and gemm_a4w4 (W4A4). AITER quantizes the
            weights too, into its pre-shuffled layout, with its own scale rounding.
  native    NVIDIA sm100+ where torch._scaled_mm multiplies float4_e2m1fn_x2 with
            E8M0 block scales and a probe agrees with the emulation: W4A4, the
            activations quantized per call by this module's encoder.
  emulated  everywhere else (CPU, NVIDIA before sm100, ROCm without AITER): the
            weight is dequantized and multiplied in the model's dtype; activations
            are not quantized.
comfy-kitchen 0.2.40 offers no MXFP4 GEMM (its cuBLAS FP4 entry refuses E8M0 scales).
"""
from __future__ import annotations

import inspect
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..dtypes import HALF_DTYPES
from ..pack_logging import pack_logger
from .descriptor import QuantFormat
from .linear_method import LinearMethod, default_device, output_dtype
from .registry import register_format

log = pack_logger(__name__)

NAME = "mxfp4"

BLOCK_SIZE = 32          # MX block size k (spec: 32 for every concrete MX format)
E2M1_EMAX = 2            # emax_elem: the largest E2M1 normal is 6.0 = 1.5 * 2^2
E8M0_BIAS = 127          # E8M0: value 2^(byte - 127), emin -127, no zero, no sign
E8M0_NAN = 0xFF
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)  # codes 0..7; bit 3 is the sign

# Layers with fewer outputs stay unquantized: AITER's gemm_a4w4 ASM kernel
# loses precision when N is below its minimum tile. Applied on every path so a
# model quantizes the same way on every machine.
MIN_OUTPUT_DIM = 256

PATHS = ("auto", "aiter", "native", "emulated")
EMULATED_DETAIL = "emulated: dequantize + matmul in the model's dtype"

# Row chunks bound the work buffers however large the layer is: about 16 MiB
# per fp32 buffer when encoding a weight, 64 MiB per int32 index buffer when
# decoding one (few chunks, so few kernel launches per forward).
_ENCODE_CHUNK_ELEMENTS = 1 << 22
_DECODE_CHUNK_ELEMENTS = 1 << 24


# ---- the encoder and decoder ------------------------------------------------

_RNE_BOUNDARIES: dict[torch.device, torch.Tensor] = {}


def _rne_boundaries(device: torch.device) -> torch.Tensor:
    """Midpoints between consecutive E2M1 magnitudes, for torch.bucketize.

    Round to nearest, ties to even: a tie goes to the code whose mantissa bit is
    0, so 0.25 -> 0, 0.75 -> 1.0, 1.25 -> 1.0, 1.75 -> 2.0, 2.5 -> 2.0,
    3.5 -> 4.0, 5.0 -> 4.0. bucketize(right=False) counts the boundaries strictly
    below a value, so a midpoint whose tie rounds up is replaced by the float
    just below it. Everything above 5.0 lands on code 7 (6.0): the saturation.
    """
    if device not in _RNE_BOUNDARIES:
        mids = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0], dtype=torch.float32)
        ties_up = torch.tensor([False, True, False, True, False, True, False])
        _RNE_BOUNDARIES[device] = torch.where(ties_up, torch.nextafter(mids, torch.zeros(())), mids).to(device)
    return _RNE_BOUNDARIES[device]


def quantize_mxfp4(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """MXFP4 encoding of `x` along its last dimension.

    Returns (packed uint8 [..., K/2], scales uint8 [..., K/32]), with the
    nibble order described in the module docstring.
    """
    k = x.shape[-1]
    if k % BLOCK_SIZE:
        raise ValueError(f"MXFP4 needs the last dimension divisible by {BLOCK_SIZE}, got {k}")
    blocks = x.float().reshape(*x.shape[:-1], k // BLOCK_SIZE, BLOCK_SIZE)
    amax = blocks.abs().amax(dim=-1)  # NaN if the block holds a NaN
    finite = torch.isfinite(amax)

    # Spec §6.3 (conversion to MX), step 1: shared_exp = floor(log2(amax)) - emax_elem.
    # frexp gives amax = m * 2^e with m in [0.5, 1), so floor(log2(amax)) = e - 1
    # exactly; a float log2 rounds values just below a power of two up to it.
    _, exponent = torch.frexp(amax)
    shared_exp = exponent - 1 - E2M1_EMAX
    # The scale must be an E8M0 value: clamp to its emin, -127. An all-zero block
    # (log2(0) = -inf) lands there too; any scale encodes it exactly.
    shared_exp = torch.where(amax > 0, shared_exp, -E8M0_BIAS).clamp_min(-E8M0_BIAS)
    # No clamp above: finite fp32 input has amax < 2^128, so shared_exp <= 125 < 127
    # (E8M0's emax). A NaN or infinite amax gets the NaN scale (E8M0 has no Inf),
    # as the spec authors' reference emulation (microxcaling) does; a NaN scale
    # makes every element of its block NaN, so the elements are left 0.
    shared_exp = torch.where(finite, shared_exp, 0)

    # §6.3, then: P_i = quantize_to_element_format(V_i / X), X = 2^shared_exp:
    # E2M1 round to nearest even, normal numbers clamped to the largest normal
    # (saturation to +-6). X is a power of two, so V_i / X is exact wherever it
    # matters (a quotient too small for a normal float rounds to 0 either way).
    inv_scale = ((E8M0_BIAS - shared_exp) << 23).view(torch.float32)
    scaled = blocks * inv_scale.unsqueeze(-1)
    codes = torch.bucketize(scaled.abs(), _rne_boundaries(x.device), out_int32=True).to(torch.uint8)
    # The sign survives rounding to zero: -0.0 and tiny negatives encode as -0 (0x8).
    codes |= torch.signbit(scaled).to(torch.uint8) << 3
    codes = torch.where(finite.unsqueeze(-1), codes, 0).reshape(x.shape)

    scales = torch.where(finite, shared_exp + E8M0_BIAS, E8M0_NAN).to(torch.uint8)
    packed = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return packed, scales


def e8m0_to_float(scales: torch.Tensor) -> torch.Tensor:
    """E8M0 bytes as fp32 powers of two (0x00 is 2^-127, an fp32 subnormal; 0xFF is NaN)."""
    bits = torch.where(scales == 0, 0x00400000, scales.to(torch.int32) << 23)
    return torch.where(scales == E8M0_NAN, torch.nan, bits.view(torch.float32))


_PAIR_LUTS: dict[tuple[torch.device, torch.dtype], torch.Tensor] = {}


def _pair_lut(device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """[256, 2]: a packed byte -> (its low-nibble value, its high-nibble value)."""
    key = (device, dtype)
    lut = _PAIR_LUTS.get(key)
    if lut is None:
        nibble = torch.tensor(E2M1_VALUES + tuple(-v for v in E2M1_VALUES), dtype=torch.float32)
        byte = torch.arange(256)
        lut = torch.stack([nibble[byte & 0xF], nibble[byte >> 4]], dim=1).to(device, dtype)
        _PAIR_LUTS[key] = lut
    return lut


def dequantize_mxfp4(packed: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The values `quantize_mxfp4` encoded, [..., K] in `dtype`."""
    # E2M1 values times powers of two are exact in bf16 and fp32; fp16's narrow
    # exponent range needs the product formed in fp32 first.
    work = torch.float32 if dtype == torch.float16 else dtype
    k = packed.shape[-1] * 2
    packed2d = packed.reshape(-1, k // 2)
    scales2d = e8m0_to_float(scales.reshape(-1, k // BLOCK_SIZE)).to(work).unsqueeze(-1)
    lut = _pair_lut(packed.device, work)
    out = torch.empty(packed2d.shape[0], k // BLOCK_SIZE, BLOCK_SIZE, dtype=work, device=packed.device)
    step = max(1, _DECODE_CHUNK_ELEMENTS // k)
    for i in range(0, packed2d.shape[0], step):
        values = F.embedding(packed2d[i:i + step].to(torch.int32), lut).view(-1, k // BLOCK_SIZE, BLOCK_SIZE)
        torch.mul(values, scales2d[i:i + step], out=out[i:i + step])
    return out.reshape(*packed.shape[:-1], k).to(dtype)


def swizzle_scales(scales: torch.Tensor) -> torch.Tensor:
    """[rows, K/32] scales in cuBLAS's block-scaling layout (128x4 tiles stored as 32x16), flattened."""
    rows, cols = scales.shape
    padded_rows, padded_cols = -(-rows // 128) * 128, -(-cols // 4) * 4
    padded = scales.new_zeros(padded_rows, padded_cols)
    padded[:rows, :cols] = scales
    tiles = padded.view(padded_rows // 128, 128, padded_cols // 4, 4).permute(0, 2, 1, 3)
    return tiles.reshape(-1, 4, 32, 4).transpose(1, 2).reshape(-1)


# ---- native GEMMs -----------------------------------------------------------

def scaled_mm_mxfp4(x2d: torch.Tensor, packed_w: torch.Tensor, scales_w: torch.Tensor) -> torch.Tensor:
    """x2d @ W.T through torch._scaled_mm's FP4 GEMM (sm100+), x2d quantized to MXFP4 here; bf16 out."""
    packed_x, scales_x = quantize_mxfp4(x2d)
    fp4, e8m0 = torch.float4_e2m1fn_x2, torch.float8_e8m0fnu
    return torch._scaled_mm(packed_x.view(fp4), packed_w.view(fp4).t(),
                            swizzle_scales(scales_x).view(e8m0), swizzle_scales(scales_w).view(e8m0),
                            out_dtype=torch.bfloat16)


def _aiter_kernels():
    """AITER's (dynamic_mxfp4_quant, shuffle_weight, gemm_a4w4); raises if AITER lacks them."""
    from aiter.ops.gemm_op_a4w4 import gemm_a4w4
    from aiter.ops.shuffle import shuffle_weight
    from aiter.utility.fp4_utils import dynamic_mxfp4_quant
    return dynamic_mxfp4_quant, shuffle_weight, gemm_a4w4


def _gemm_needs_out_buffer(gemm) -> bool:
    # Older AITER releases take a caller-allocated `out`; newer ones allocate it.
    try:
        out = inspect.signature(gemm).parameters.get("out")
    except (TypeError, ValueError):
        return False
    return out is not None and out.default is inspect.Parameter.empty


def aiter_linear(x2d: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor) -> torch.Tensor:
    """x2d @ W.T through AITER's MXFP4 quantizer and gemm_a4w4, W in AITER's pre-shuffled layout; bf16 out."""
    quantize, _, gemm = _aiter_kernels()
    if x2d.dtype not in HALF_DTYPES:  # AITER's quantizer takes 16-bit activations
        x2d = x2d.to(torch.bfloat16)
    x_fp4, x_scale = quantize(x2d.contiguous(), shuffle=True)
    rows, n_out = x2d.shape[0], weight.shape[0]
    if _gemm_needs_out_buffer(gemm):
        # Its kernels write whole 256-row tiles.
        out = torch.empty(-(-rows // 256) * 256, n_out, dtype=torch.bfloat16, device=x2d.device)
        return gemm(x_fp4, weight, x_scale, weight_scale, out)[:rows]
    return gemm(x_fp4, weight, x_scale, weight_scale)[:rows]


# ---- which path runs where ----------------------------------------------------

@dataclass(frozen=True)
class ExecutionPath:
    name: str          # "aiter", "native" or "emulated"
    detail: str        # what runs, for reports
    reason: str = ""   # for "emulated": why no native MXFP4 GEMM is used


def _emulated(reason: str) -> ExecutionPath:
    return ExecutionPath("emulated", EMULATED_DETAIL, reason)


def _rocm_arch(device: torch.device) -> str:
    return getattr(torch.cuda.get_device_properties(device), "gcnArchName", "") or "unknown arch"


def _native_probe_failure(device: torch.device) -> str | None:
    """None if torch._scaled_mm's MXFP4 GEMM runs here and agrees with the emulation, else why not."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(128, 256, generator=gen).to(device, torch.bfloat16)
    w = torch.randn(256, 256, generator=gen).to(device, torch.bfloat16)
    packed_w, scales_w = quantize_mxfp4(w)
    try:
        out = scaled_mm_mxfp4(x, packed_w, scales_w).float()
    except Exception as exc:  # an old cuBLAS or torch build says no in many ways
        return f"torch._scaled_mm refused MXFP4 ({type(exc).__name__}: {exc})"
    packed_x, scales_x = quantize_mxfp4(x)
    ref = dequantize_mxfp4(packed_x, scales_x) @ dequantize_mxfp4(packed_w, scales_w).T
    rel = ((out - ref).norm() / ref.norm()).item()
    # Same quantized operands: only bf16 output rounding (~0.4%) separates them.
    if not rel < 0.02:
        return f"torch._scaled_mm's MXFP4 result disagrees with the emulation (relative error {rel:.3g})"
    return None


def _detect(device: torch.device) -> ExecutionPath:
    if device.type != "cuda":
        return _emulated(f"no MXFP4 GEMM on {device.type}")
    if torch.version.hip:
        arch = _rocm_arch(device)
        if "gfx95" not in arch:
            return _emulated(f"ROCm {arch}: MXFP4 GEMMs need gfx950 (MI350+)")
        try:
            _aiter_kernels()
        except Exception as exc:
            return _emulated(f"ROCm {arch}: AITER's MXFP4 kernels are not importable ({type(exc).__name__}: {exc})")
        return ExecutionPath("aiter", "AITER gemm_a4w4, MXFP4 activations")
    major, minor = torch.cuda.get_device_capability(device)
    if major < 10:
        return _emulated(f"CUDA sm{major}{minor} has no FP4 tensor cores (sm100+)")
    if not (hasattr(torch, "float4_e2m1fn_x2") and hasattr(torch, "float8_e8m0fnu")):
        return _emulated(f"torch {torch.__version__} has no float4_e2m1fn_x2 / float8_e8m0fnu")
    problem = _native_probe_failure(device)
    if problem is not None:
        return _emulated(f"sm{major}{minor}: {problem}")
    return ExecutionPath("native", "native: torch._scaled_mm FP4 GEMM, MXFP4 activations")


_DETECTED: dict[str, ExecutionPath] = {}


def execution_path(device: torch.device | str | None = None) -> ExecutionPath:
    """How MXFP4 layers run on `device` (default: the first CUDA device, else CPU). Never raises."""
    device = torch.device(device) if device is not None else default_device()
    key = str(device)
    if key not in _DETECTED:
        try:
            found = _detect(device)
        except Exception as exc:
            found = _emulated(f"MXFP4 detection failed ({type(exc).__name__}: {exc})")
        if found.name == "emulated":
            log.info("MXFP4 on %s runs emulated: %s", device, found.reason)
        _DETECTED[key] = found
    return _DETECTED[key]


# ---- the method -----------------------------------------------------------------

class Mxfp4Method(LinearMethod):
    """Online MXFP4 weights; see the module docstring for the layout and the paths.

    `path`: "auto" (the best detected for `device`), "emulated", or "aiter" /
    "native" (ValueError naming the reason where unavailable).
    """
    name = NAME

    def __init__(self, min_output_dim: int = MIN_OUTPUT_DIM, path: str = "auto",
                 device: torch.device | str | None = None):
        if path not in PATHS:
            raise ValueError(f"path must be one of {PATHS}, got {path!r}")
        if min_output_dim < 0:
            raise ValueError(f"min_output_dim must be >= 0, got {min_output_dim}")
        detected = execution_path(device)
        if path == "emulated":
            self.path = detected if detected.name == "emulated" else _emulated("chosen by the `path` option")
        elif path in ("auto", detected.name):
            self.path = detected
        else:
            raise ValueError(f"MXFP4 path {path!r} is not available here: {detected.reason}")
        self.min_output_dim = min_output_dim
        self._aiter_dtypes: tuple[torch.dtype, torch.dtype] | None = None
        self._native_refused: set[tuple[int, int]] = set()

    def describe(self) -> str:
        if self.path.name == "emulated":
            return f"{NAME} ({self.path.detail}; {self.path.reason})"
        return f"{NAME} ({self.path.detail})"

    def skip_reason(self, in_features: int, out_features: int) -> str | None:
        if out_features < self.min_output_dim:
            return f"output dim {out_features} < {self.min_output_dim} (MXFP4 minimum)"
        if in_features % BLOCK_SIZE:
            return f"in_features {in_features} not divisible by the MX block size {BLOCK_SIZE}"
        return None

    def quantize_weight(self, weight: torch.Tensor) -> dict[str, torch.Tensor]:
        if self.path.name == "aiter":
            quantize, shuffle_weight, _ = _aiter_kernels()
            w = weight if weight.dtype in HALF_DTYPES else weight.to(torch.bfloat16)
            w_fp4, w_scale = quantize(w.contiguous(), shuffle=True)
            w_fp4 = shuffle_weight(w_fp4)
            self._aiter_dtypes = (w_fp4.dtype, w_scale.dtype)
            return {"weight": w_fp4.view(torch.uint8), "weight_scale": w_scale.view(torch.uint8)}
        rows_per_chunk = max(1, _ENCODE_CHUNK_ELEMENTS // weight.shape[1])
        parts = [quantize_mxfp4(weight[i:i + rows_per_chunk]) for i in range(0, weight.shape[0], rows_per_chunk)]
        return {"weight": torch.cat([p for p, _ in parts]), "weight_scale": torch.cat([s for _, s in parts])}

    def dequantize(self, layer, device=None) -> torch.Tensor:
        if self.path.name == "aiter":
            raise NotImplementedError("MXFP4 weights in AITER's pre-shuffled layout cannot be dequantized (a LoRA "
                                      "cannot be applied to them); quantize with mxfp4 after applying the LoRA")
        t = layer.tensors_on(device)
        return dequantize_mxfp4(t["weight"], t["weight_scale"], layer.compute_dtype)

    def apply(self, layer, x: torch.Tensor, input_act: str | None = None) -> torch.Tensor:
        t = layer.tensors_for(x)
        weight, scale, bias = t["weight"], t["weight_scale"], t.get("bias")
        out_dtype = output_dtype(x, layer.compute_dtype)
        x2d = x.reshape(-1, x.shape[-1])
        if input_act is not None:
            from .kitchen_api import apply_input_act
            x2d = apply_input_act(x2d, input_act)
        out = None
        if self.path.name == "aiter":
            w_dtype, s_dtype = self._aiter_dtypes
            out = aiter_linear(x2d, weight.view(w_dtype), scale.view(s_dtype))
        elif self.path.name == "native" and x.is_cuda and (weight.shape[0], x2d.shape[1]) not in self._native_refused:
            out = self._native_or_none(x2d, weight, scale)
        bias = None if bias is None else bias.to(out_dtype)
        if out is None:
            out = F.linear(x2d.to(out_dtype), dequantize_mxfp4(weight, scale, out_dtype), bias)
        else:
            out = out.to(out_dtype) if bias is None else out.to(out_dtype) + bias
        return out.reshape(*x.shape[:-1], layer.out_features)

    def _native_or_none(self, x2d, weight, scale) -> torch.Tensor | None:
        try:
            return scaled_mm_mxfp4(x2d, weight, scale)
        except Exception as exc:  # noqa: BLE001 - cuBLAS and torch refuse a shape in many ways
            # The probe passed, so this shape is what the GEMM refuses; emulate it from now on.
            shape = (weight.shape[0], x2d.shape[1])
            self._native_refused.add(shape)
            log.warning("MXFP4 native GEMM refused N=%d K=%d (%s); this shape runs emulated", *shape, exc)
            return None


@register_format
class Mxfp4Format(QuantFormat):
    """Online only: no checkpoint format the loaders read stores it."""
    name = NAME
    online = True
    summary = "MXFP4 (native on MI350+/sm100+, emulated elsewhere)"
    unsaveable = "MXFP4 is this pack's online format; no ComfyUI marker format stores it"

    def method(self, min_output_dim: int | None = None, path: str = "auto", device=None, **_) -> LinearMethod:
        return Mxfp4Method(MIN_OUTPUT_DIM if min_output_dim is None else min_output_dim, path=path, device=device)

    def native(self, device: torch.device) -> bool:
        return execution_path(device).name != "emulated"
