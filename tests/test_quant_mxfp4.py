"""Online MXFP4 (OCP MX v1.0) on CPU: the encoder bit by bit against hand-worked
blocks and reference implementations, round-trip bounds, the layer skips, and
the emulated forward against bf16/fp32 references."""
import sys
import types

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from bigdit.host.layers import ComfyQuantLinear
from bigdit.quant import QuantConfig, get_method, quantize_layers
from bigdit.quant import mxfp4
from bigdit.quant.mxfp4 import (
    BLOCK_SIZE, MIN_OUTPUT_DIM, ExecutionPath, Mxfp4Method, dequantize_mxfp4, execution_path,
    quantize_mxfp4, swizzle_scales,
)


def rel_err(out, ref):
    return ((out.float() - ref.float()).norm() / ref.float().norm()).item()


def block(*values, fill=0.0):
    """One 32-element block: `values` first, then `fill`."""
    return torch.tensor(list(values) + [fill] * (BLOCK_SIZE - len(values)), dtype=torch.float32)


def nibbles(packed):
    """The E2M1 codes in element order (element 2i is the low nibble of byte i)."""
    return torch.stack([packed & 0xF, packed >> 4], dim=-1).flatten(-2).tolist()


# ---- hand-worked blocks ------------------------------------------------------
# E2M1 codes: 0:0 1:0.5 2:1 3:1.5 4:2 5:3 6:4 7:6, +8 for the sign.
# Scale byte: 127 + floor(log2(amax)) - 2, clamped at 0.

def test_zero_block():
    packed, scales = quantize_mxfp4(block())
    assert scales.tolist() == [0]  # log2(0) = -inf clamps to E8M0's emin, 2^-127
    assert packed.tolist() == [0] * 16
    assert torch.equal(dequantize_mxfp4(packed, scales), block())


def test_power_of_two_amax():
    # amax 8 = 2^3: shared_exp 3 - 2 = 1, scale 2: the block is the codes of x / 2.
    packed, scales = quantize_mxfp4(block(8.0, -2.0, 1.0, 6.0, 0.5, -12.0, 3.0, 1e-9))
    assert scales.tolist() == [128]
    assert nibbles(packed)[:8] == [0x6, 0xA, 0x1, 0x5, 0x0, 0xF, 0x3, 0x0]
    # Two elements per byte, the even one in the low nibble.
    assert packed[:4].tolist() == [0xA6, 0x51, 0xF0, 0x03]
    assert dequantize_mxfp4(packed, scales)[:8].tolist() == [8.0, -2.0, 1.0, 6.0, 0.0, -12.0, 3.0, 0.0]


def test_ties_round_to_even():
    # amax 5: shared_exp 0, scale 1, so the values are their own scaled values.
    values = [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -0.75, -2.5, -5.0, 0.26, 2.6, 4.9, 1.2]
    expected = [0x0, 0x2, 0x2, 0x4, 0x4, 0x6, 0x6, 0xA, 0xC, 0xE, 0x1, 0x5, 0x6, 0x2]
    packed, scales = quantize_mxfp4(block(*values))
    assert scales.tolist() == [127]
    assert nibbles(packed)[:len(values)] == expected


def test_subnormal_saturation_and_negative_zero():
    # amax 7.5: shared_exp 0; 7.5 and 6.9 exceed the largest E2M1 normal and saturate to 6.
    values = [7.5, -6.9, 0.5, -0.5, 0.3, 0.2, -0.0, -0.1, 0.0]
    expected = [0x7, 0xF, 0x1, 0x9, 0x1, 0x0, 0x8, 0x8, 0x0]
    packed, scales = quantize_mxfp4(block(*values))
    assert scales.tolist() == [127]
    assert nibbles(packed)[:len(values)] == expected
    decoded = dequantize_mxfp4(packed, scales)
    assert decoded[:6].tolist() == [6.0, -6.0, 0.5, -0.5, 0.5, 0.0]
    assert torch.signbit(decoded[6]) and torch.signbit(decoded[7]) and not torch.signbit(decoded[8])


def test_scale_range_ends():
    # amax 2^-125: shared_exp -127 = E8M0's emin, byte 0; 2^-125 / 2^-127 = 4 is exact.
    tiny = 2.0 ** -125
    packed, scales = quantize_mxfp4(block(tiny, -tiny / 4, tiny / 16))
    assert scales.tolist() == [0]
    assert nibbles(packed)[:3] == [0x6, 0xA, 0x0]  # 4, -1 and 0.25 (a tie, to 0)
    assert dequantize_mxfp4(packed, scales)[:3].tolist() == [tiny, -tiny / 4, 0.0]
    # Below E8M0's range the scale stays at 2^-127 and small elements flush to zero.
    packed, scales = quantize_mxfp4(block(2.0 ** -130))
    assert scales.tolist() == [0] and packed.tolist() == [0] * 16
    # The largest finite amax: 1.5 * 2^127 -> shared_exp 125, element 6.
    big = 1.5 * 2.0 ** 127
    packed, scales = quantize_mxfp4(block(big, -big))
    assert scales.tolist() == [252] and nibbles(packed)[:2] == [0x7, 0xF]
    assert dequantize_mxfp4(packed, scales)[:2].tolist() == [big, -big]


@pytest.mark.parametrize("special", [float("nan"), float("inf"), float("-inf")])
def test_nan_or_inf_makes_a_nan_block(special):
    # A NaN or infinite amax gives the NaN scale 0xFF (E8M0 has no Inf); the whole block
    # decodes to NaN. Our elements of such a block are 0. Other blocks are unaffected.
    row = torch.cat([block(1.0, special), block(4.0)])
    packed, scales = quantize_mxfp4(row)
    assert scales.tolist() == [0xFF, 127]
    assert packed[:16].tolist() == [0] * 16
    decoded = dequantize_mxfp4(packed, scales)
    assert torch.isnan(decoded[:32]).all() and decoded[32] == 4.0


def test_bf16_fp16_fp32_inputs_encode_alike():
    torch.manual_seed(0)
    x = torch.randn(8, 128).bfloat16()
    reference = quantize_mxfp4(x.float())
    for dtype in (torch.bfloat16, torch.float16):
        packed, scales = quantize_mxfp4(x.to(dtype))
        assert torch.equal(packed, reference[0]) and torch.equal(scales, reference[1])


def test_rejects_partial_blocks():
    with pytest.raises(ValueError, match="divisible by 32"):
        quantize_mxfp4(torch.zeros(2, 48))


# ---- reference implementations ----------------------------------------------

def test_elements_match_torchao_derived_rne_and_fp4x2_packing():
    """Every multiple of 1/64 in (-8, 8), in blocks pinned to scale 1 by a 7.0.

    Element rounding against comfy-kitchen's `_f32_to_floatx_unpacked` (torchao's
    RNE FP32 -> E2M1 code). Packing against comfy-kitchen's `pack_uint4` with
    hi_first=False, the order of torch's float4_e2m1fn_x2 helpers, torchao and AITER.
    """
    from comfy_kitchen.float_utils import _f32_to_floatx_unpacked, pack_uint4

    grid = torch.arange(-511, 512, dtype=torch.float32) / 64
    blocks = torch.cat([grid, torch.zeros(-len(grid) % 31)]).reshape(-1, 31)
    x = torch.cat([torch.full((len(blocks), 1), 7.0), blocks], dim=1)  # one block per row
    packed, scales = quantize_mxfp4(x)
    assert (scales == 127).all()
    reference_codes = _f32_to_floatx_unpacked(x, 2, 1)
    assert torch.equal(torch.tensor(nibbles(packed), dtype=torch.uint8), reference_codes)
    assert torch.equal(packed, pack_uint4(reference_codes, hi_first=False))


def test_matches_torchao_to_mx_floor_bit_exact():
    """torchao's MX reference (prototype.mx_formats.to_mx, OCP FLOOR scaling), where installed.

    Not in the CI environment (its wheel carries compiled extensions); install
    torchao to run this. Scales spanning 1e-30..1e30, zero and -0 blocks.
    """
    mx_tensor = pytest.importorskip("torchao.prototype.mx_formats.mx_tensor")
    torch.manual_seed(0)
    w = torch.randn(64, 1024) * torch.logspace(-30, 30, 64).unsqueeze(1)
    w[3, 5] = 0.0
    w[4, :32] = 0.0
    w[5, :32] = -0.0
    for dtype in (torch.float32, torch.bfloat16):
        x = w.to(dtype)
        ref_scales, ref_packed = mx_tensor.to_mx(x, torch.float4_e2m1fn_x2, BLOCK_SIZE)
        packed, scales = quantize_mxfp4(x)
        assert torch.equal(scales, ref_scales.view(torch.uint8))
        assert torch.equal(packed, ref_packed.view(torch.uint8))


def test_scale_swizzle_matches_cublas_layout_formula():
    """cuBLAS block-scaling layout: 128x4 tiles of 512 bytes, row-major over tiles;
    inside a tile, scale (r, c) sits at (r % 32) * 16 + (r // 32) * 4 + c."""
    scales = torch.randint(0, 255, (300, 9), dtype=torch.uint8)
    swizzled = swizzle_scales(scales)
    assert swizzled.shape == (384 * 12,)  # padded to 3 x 3 tiles
    tiles_per_row = 3
    for r in range(300):
        for c in range(9):
            tile = (r // 128) * tiles_per_row + c // 4
            offset = tile * 512 + (r % 128 % 32) * 16 + (r % 128 // 32) * 4 + c % 4
            assert swizzled[offset] == scales[r, c]


# ---- round trip ---------------------------------------------------------------

def test_gaussian_round_trip_error():
    torch.manual_seed(0)
    w = torch.randn(256, 4096)
    packed, scales = quantize_mxfp4(w)
    assert packed.shape == (256, 2048) and scales.shape == (256, 128)
    # Measured 0.115 for N(0, 1); below 0.10 would mean something skipped the 4-bit rounding.
    assert 0.10 < rel_err(dequantize_mxfp4(packed, scales), w) < 0.12


def test_round_trip_error_per_element_bound():
    """Half an E2M1 step of the block's scale, or the saturation for the few values above 6."""
    torch.manual_seed(1)
    w = torch.randn(64, 512) * torch.logspace(-3, 3, 64).unsqueeze(1)
    packed, scales = quantize_mxfp4(w)
    scale = mxfp4.e8m0_to_float(scales).repeat_interleave(BLOCK_SIZE, dim=-1)
    scaled = (w / scale).abs()
    step_half = torch.where(scaled < 2, 0.25, torch.where(scaled < 4, 0.5, 1.0))
    bound = torch.maximum(step_half, scaled - 6) * scale
    assert ((dequantize_mxfp4(packed, scales) - w).abs() <= bound).all()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_decode_dtypes_are_exact(dtype):
    torch.manual_seed(0)
    w = torch.randn(16, 256).to(dtype)
    packed, scales = quantize_mxfp4(w)
    decoded = dequantize_mxfp4(packed, scales, dtype)
    assert decoded.dtype == dtype
    assert torch.equal(decoded, dequantize_mxfp4(packed, scales).to(dtype))


# ---- the method: skips, report, forward -----------------------------------------

class Tiny(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(256, 512)
        self.narrow = nn.Linear(256, 128)     # output dim below MIN_OUTPUT_DIM
        self.odd = nn.Linear(100, 256)        # in_features not a multiple of 32
        self.to(torch.bfloat16)


def test_output_dim_and_block_skips():
    assert MIN_OUTPUT_DIM == 256
    replacements, report = quantize_layers(Tiny(), QuantConfig(method=Mxfp4Method()))
    assert set(replacements) == {"proj"}
    reasons = {r.name: r.reason for r in report.kept}
    assert reasons["narrow"] == "output dim 128 < 256 (MXFP4 minimum)"
    assert reasons["odd"] == "in_features 100 not divisible by the MX block size 32"
    assert report.summary_line() == "quantized 1/3 linear layers"
    assert report.method_counts() == {"mxfp4": 1}
    # 4.25 bits per weight: packed bytes plus one scale byte per 32.
    assert report.bytes_before() - report.bytes_after() == 256 * 512 * 2 - (256 * 512 // 2 + 256 * 512 // 32)


def test_min_output_dim_is_overridable_and_ignored_layers_apply():
    method = get_method("mxfp4", min_output_dim=64, group_size=256)  # group_size: not an MX option
    replacements, _ = quantize_layers(Tiny(), QuantConfig(method=method))
    assert set(replacements) == {"proj", "narrow"}
    replacements, report = quantize_layers(Tiny(), QuantConfig(method=method, ignored=("pro*",)))
    assert set(replacements) == {"narrow"}
    assert {r.name: r.reason for r in report.kept}["proj"] == "ignored (matches 'pro*')"
    with pytest.raises(ValueError, match="min_output_dim"):
        Mxfp4Method(min_output_dim=-1)


def test_cpu_runs_emulated_and_says_so():
    path = execution_path("cpu")
    assert path.name == "emulated"
    method = Mxfp4Method(device="cpu")
    assert method.describe() == "mxfp4 (emulated: dequantize + matmul in the model's dtype; no MXFP4 GEMM on cpu)"
    with pytest.raises(ValueError, match="'native' is not available here: no MXFP4 GEMM on cpu"):
        Mxfp4Method(path="native", device="cpu")
    with pytest.raises(ValueError, match="path must be one of"):
        Mxfp4Method(path="fast")


def test_native_probe_reports_refusal_instead_of_raising():
    reason = mxfp4._native_probe_failure(torch.device("cpu"))
    assert reason is not None and reason.startswith("torch._scaled_mm refused MXFP4")


def make_linear(k, n, bias=True, dtype=torch.bfloat16, seed=0):
    torch.manual_seed(seed)
    layer = nn.Linear(k, n, bias=bias)
    with torch.no_grad():
        layer.weight.normal_(0, k ** -0.5)
    return layer.to(dtype)


def quantize_one(layer, **method_kw):
    replacements, _ = quantize_layers(nn.Sequential(layer), QuantConfig(method=Mxfp4Method(**method_kw)),
                                      layer_type=ComfyQuantLinear)
    return replacements["0"]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_forward_matches_dequantized_weight_and_is_close_to_reference(dtype):
    layer = make_linear(512, 384, dtype=dtype)
    qlayer = quantize_one(layer, device="cpu")
    assert qlayer.weight.dtype == torch.uint8 and qlayer.weight.shape == (384, 256)
    assert qlayer.weight_scale.shape == (384, 16)
    x = torch.randn(2, 17, 512, dtype=dtype)
    out = qlayer(x)
    assert out.dtype == dtype and out.shape == (2, 17, 384)
    # Emulation is exactly F.linear with the decoded weight.
    assert torch.equal(out, F.linear(x, qlayer.method.dequantize(qlayer), layer.bias))
    # Against the unquantized layer in fp32: the 4-bit weight error (~0.115) carries through.
    ref = F.linear(x.float(), layer.weight.float(), layer.bias.float())
    assert rel_err(out, ref) < 0.13
    assert F.cosine_similarity(out.float().flatten(), ref.flatten(), dim=0) > 0.99


def test_swiglu_input_activation_matches_unfused():
    qlayer = quantize_one(make_linear(256, 256, bias=False), device="cpu")
    x = torch.randn(10, 512, dtype=torch.bfloat16)
    gate, up = x.chunk(2, dim=-1)
    assert torch.equal(qlayer(x, input_act="swiglu"), qlayer(F.silu(gate) * up))


def test_row_chunking_changes_nothing(monkeypatch):
    torch.manual_seed(0)
    w = torch.randn(300, 512, dtype=torch.bfloat16)
    whole = Mxfp4Method(device="cpu").quantize_weight(w)
    decoded = dequantize_mxfp4(whole["weight"], whole["weight_scale"], torch.bfloat16)
    monkeypatch.setattr(mxfp4, "_ENCODE_CHUNK_ELEMENTS", 512 * 7)  # 7 rows per chunk
    monkeypatch.setattr(mxfp4, "_DECODE_CHUNK_ELEMENTS", 512 * 11)
    chunked = Mxfp4Method(device="cpu").quantize_weight(w)
    assert all(torch.equal(whole[k], chunked[k]) for k in whole)
    assert torch.equal(dequantize_mxfp4(chunked["weight"], chunked["weight_scale"], torch.bfloat16), decoded)


def test_lora_weight_protocol_requantizes():
    """ComfyUI's convert_weight/set_weight (LoRA) through MXFP4: decode, patch, encode again."""
    qlayer = quantize_one(make_linear(256, 256), device="cpu")
    decoded = qlayer.convert_weight(torch.empty(0, dtype=torch.float32))
    assert decoded.dtype == torch.float32 and torch.equal(decoded, qlayer.method.dequantize(qlayer).float())
    patched = decoded + 0.01
    qlayer.set_weight(patched)
    expected = dequantize_mxfp4(*quantize_mxfp4(patched.bfloat16()), torch.bfloat16)
    assert torch.equal(qlayer.method.dequantize(qlayer), expected)


# ---- the AITER path's plumbing, with AITER's GPU kernels stood in for ------------

def fake_aiter(monkeypatch, out_param: bool):
    """Install a stand-in `aiter` whose kernels compute with this module's encoder.

    `out_param`: the older gemm_a4w4 signature with a caller-allocated output.
    Records calls so the test sees the seed's sequence.
    """
    calls = []

    def dynamic_mxfp4_quant(x, shuffle=False):
        calls.append(("quant", tuple(x.shape), shuffle))
        packed, scales = quantize_mxfp4(x)
        return packed.view(torch.float4_e2m1fn_x2), scales.view(torch.float8_e8m0fnu)

    def shuffle_weight(w):
        calls.append(("shuffle", tuple(w.shape)))
        return w

    def product(a, b, a_scale, b_scale):
        lhs = dequantize_mxfp4(a.view(torch.uint8), a_scale.view(torch.uint8))
        rhs = dequantize_mxfp4(b.view(torch.uint8), b_scale.view(torch.uint8))
        return (lhs @ rhs.T).bfloat16()

    if out_param:
        def gemm_a4w4(A, B, A_scale, B_scale, out, bias=None):
            calls.append(("gemm", tuple(out.shape)))
            out[:A.shape[0]] = product(A, B, A_scale, B_scale)
            return out
    else:
        def gemm_a4w4(A, B, A_scale, B_scale, bias=None):
            calls.append(("gemm", None))
            return product(A, B, A_scale, B_scale)

    modules = {
        "aiter": types.ModuleType("aiter"),
        "aiter.ops": types.ModuleType("aiter.ops"),
        "aiter.ops.gemm_op_a4w4": types.SimpleNamespace(gemm_a4w4=gemm_a4w4),
        "aiter.ops.shuffle": types.SimpleNamespace(shuffle_weight=shuffle_weight),
        "aiter.utility": types.ModuleType("aiter.utility"),
        "aiter.utility.fp4_utils": types.SimpleNamespace(dynamic_mxfp4_quant=dynamic_mxfp4_quant),
    }
    for name, module in modules.items():
        monkeypatch.setitem(sys.modules, name, module)
    monkeypatch.setitem(mxfp4._DETECTED, "cpu", ExecutionPath("aiter", "AITER gemm_a4w4, MXFP4 activations"))
    return calls


@pytest.mark.parametrize("out_param", [True, False])
def test_aiter_path_follows_the_seed(monkeypatch, out_param):
    calls = fake_aiter(monkeypatch, out_param)
    layer = make_linear(256, 512)
    qlayer = quantize_one(layer, device="cpu")
    assert qlayer.method.describe() == "mxfp4 (AITER gemm_a4w4, MXFP4 activations)"
    assert calls == [("quant", (512, 256), True), ("shuffle", (512, 128))]
    x = torch.randn(3, 100, 256, dtype=torch.bfloat16)
    out = qlayer(x)
    assert calls[2] == ("quant", (300, 256), True)
    assert calls[3] == ("gemm", (512, 512) if out_param else None)  # 300 rows padded to 256-row tiles
    assert out.shape == (3, 100, 512) and out.dtype == torch.bfloat16
    # W4A4: both operands quantized, then the bias.
    packed_x, scales_x = quantize_mxfp4(x.reshape(300, 256))
    w = dequantize_mxfp4(qlayer.weight, qlayer.weight_scale)
    expected = ((dequantize_mxfp4(packed_x, scales_x) @ w.T).bfloat16() + layer.bias).reshape(3, 100, 512)
    assert torch.equal(out, expected)
    with pytest.raises(NotImplementedError, match="pre-shuffled"):
        qlayer.method.dequantize(qlayer)


def test_detection_gives_reasons_and_never_raises(monkeypatch):
    """Detection on GPUs this machine lacks, with the device queries stood in for."""
    cuda = torch.device("cuda")
    monkeypatch.setattr(torch.version, "hip", "7.0")
    monkeypatch.setattr(mxfp4, "_rocm_arch", lambda device: "gfx942:sramecc+:xnack-")
    assert mxfp4._detect(cuda).reason == "ROCm gfx942:sramecc+:xnack-: MXFP4 GEMMs need gfx950 (MI350+)"
    monkeypatch.setattr(mxfp4, "_rocm_arch", lambda device: "gfx950")
    monkeypatch.setitem(sys.modules, "aiter", None)  # `import aiter` raises ImportError
    path = mxfp4._detect(cuda)
    assert path.name == "emulated"
    assert path.reason.startswith("ROCm gfx950: AITER's MXFP4 kernels are not importable (ModuleNotFoundError")
    fake_aiter(monkeypatch, out_param=False)
    assert mxfp4._detect(cuda).name == "aiter"

    monkeypatch.setattr(torch.version, "hip", None)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    assert mxfp4._detect(cuda).reason == "CUDA sm90 has no FP4 tensor cores (sm100+)"

    def broken(device):
        raise RuntimeError("no driver")
    monkeypatch.setattr(mxfp4, "_detect", broken)
    monkeypatch.delitem(mxfp4._DETECTED, "cuda:7", raising=False)
    path = execution_path("cuda:7")
    assert path.name == "emulated" and path.reason == "MXFP4 detection failed (RuntimeError: no driver)"
    monkeypatch.delitem(mxfp4._DETECTED, "cuda:7")
