"""Numerics every method shares: the output dtype rule, and FP8's row quantization formula (torch path).

The rule (quant/linear_method.py): a quantized layer returns its input's dtype, as
torch.nn.Linear and ComfyUI's cast layers do, whatever its format and compute
dtype, so layers of different formats side by side (q, k, v) agree.
"""
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from bigdit.host.layers import ComfyQuantLinear
from bigdit.quant import fp8
from bigdit.quant.quantize_pass import quantize_linear
from bigdit.quant.registry import get_method

DTYPES = (torch.float32, torch.bfloat16, torch.float16)  # all three run on CPU
METHODS = {
    "int8_convrot": {"group_size": 64},
    "int8_tensorwise": {},
    "float8_e4m3fn": {},
    "mxfp4": {"min_output_dim": 0, "path": "emulated"},
    "nvfp4": {},
    "mxfp8": {},
    "quanto_qint8": {},
}
# Relative error of each format against the fp32 layer on these random shapes (measured ~0.4x of these).
TOLERANCE = {"int8_convrot": 0.03, "int8_tensorwise": 0.03, "float8_e4m3fn": 0.08, "mxfp4": 0.25, "nvfp4": 0.2,
             "mxfp8": 0.06, "quanto_qint8": 0.015}


def rel_err(out, ref):
    return ((out.float() - ref).norm() / ref.norm()).item()


def layer_pair(name, compute_dtype):
    torch.manual_seed(0)
    plain = nn.Linear(128, 64).to(compute_dtype)
    return plain, quantize_linear(plain, get_method(name, **METHODS[name]), torch.device("cpu"),
                                  layer_type=ComfyQuantLinear)


@pytest.mark.parametrize("compute_dtype", DTYPES, ids=str)
@pytest.mark.parametrize("name", METHODS)
def test_every_method_returns_the_input_dtype(name, compute_dtype):
    plain, layer = layer_pair(name, compute_dtype)
    for dtype in DTYPES:
        x = torch.randn(3, 5, 128, dtype=dtype)
        out = layer(x)
        assert out.dtype == dtype and out.shape == (3, 5, 64), (name, compute_dtype, dtype)
        ref = F.linear(x.float(), plain.weight.float(), plain.bias.float())
        assert rel_err(out, ref) < TOLERANCE[name], (name, compute_dtype, dtype)
        # The fused input activation and ComfyUI's per-call weight patches keep the rule too.
        assert layer(torch.randn(2, 256, dtype=dtype), input_act="swiglu").dtype == dtype
        layer.weight_function = [lambda w: w]
        assert layer(x).dtype == dtype
        layer.weight_function = []


def test_fp8_static_input_scale_returns_the_input_dtype():
    _, layer = layer_pair("float8_e4m3fn", torch.bfloat16)
    layer.input_scale = nn.Parameter(torch.tensor(0.01), requires_grad=False)
    for dtype in DTYPES:
        assert layer(torch.randn(4, 128, dtype=dtype)).dtype == dtype


def test_mixed_formats_feed_sdpa():
    """The failure this rule fixes: FP8 q and k with INT8 v, fp32 activations, into SDPA."""
    projections = [layer_pair(name, torch.bfloat16)[1] for name in ("float8_e4m3fn", "float8_e4m3fn", "int8_convrot")]
    x = torch.randn(1, 7, 128)
    q, k, v = (p(x).reshape(1, 7, 1, 64).transpose(1, 2) for p in projections)
    assert F.scaled_dot_product_attention(q, k, v).dtype == torch.float32


# ---- FP8 rows: the one formula every path computes -------------------------------

def definition(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The documented formula in numpy float32 arithmetic (torch only for the final FP8 cast)."""
    v = x.float().numpy()
    absmax = np.abs(v).max(axis=1, keepdims=True)
    scale = np.maximum(absmax * np.float32(1 / 448), np.float32(1e-12))
    inv_scale = np.float32(1) / scale
    assert scale.dtype == inv_scale.dtype == np.float32
    q = np.clip(v * inv_scale, np.float32(-448), np.float32(448))
    return torch.from_numpy(q).to(fp8.FP8), torch.from_numpy(scale)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_fp8_rows_are_the_documented_formula(dtype):
    torch.manual_seed(0)
    x = torch.randn(64, 1000, dtype=dtype) * 3
    x[1] = 0  # takes the minimum scale
    x[2] *= 1e-3  # values that round to FP8 subnormals
    x[3, 7] = 1e4  # one outlier sets its row's scale
    q, scale = fp8.quantize_rows(x)
    ref_q, ref_scale = definition(x)
    assert torch.equal(scale, ref_scale)
    assert torch.equal(q.view(torch.uint8), ref_q.view(torch.uint8))


def test_fp8_row_scales_and_reciprocals():
    absmax = torch.tensor([[448.0], [1.0], [0.0], [3e-10]])
    scale, inv_scale = fp8.row_scales(absmax)
    assert scale.dtype == inv_scale.dtype == torch.float32
    assert scale[0].item() == 1.0 and inv_scale[0].item() == 1.0
    assert scale[1].item() == fp8.INV_FP8_MAX == np.float32(1 / 448)
    assert scale[2].item() == scale[3].item() == np.float32(1e-12)  # the floor: no division by zero
    assert torch.equal(inv_scale, (1 / scale.double()).float())  # correctly rounded


def test_fp8_rows_saturate_at_448_and_round_trip_within_half_a_step():
    torch.manual_seed(1)
    x = torch.randn(32, 512) * torch.logspace(-3, 3, 32).reshape(-1, 1)
    q, scale = fp8.quantize_rows(x)
    values = q.float()
    # The row maximum lands on +-448 exactly, never beyond (absmax / scale may round just above 448).
    assert torch.equal(values.abs().amax(dim=1), torch.full((32,), 448.0))
    assert torch.isfinite(values).all()
    # E4M3 has 3 mantissa bits: half a step is 2^-4 of a normal value; subnormals step by 2^-9.
    error = (values * scale - x).abs()
    assert (error <= (2 ** -4 + 1e-6) * x.abs() + 2 ** -10 * scale).all()  # 1e-6: fp32 products


def test_fp8_static_input_scale_saturates_instead_of_overflowing():
    """A checkpoint's static input scale can be exceeded at run time: values clamp to +-448 (never NaN)."""
    _, layer = layer_pair("float8_e4m3fn", torch.bfloat16)
    layer.input_scale = nn.Parameter(torch.tensor(1e-3), requires_grad=False)  # covers |x| <= 0.448
    x = torch.randn(4, 128) * 100
    clamped = x.clamp(-0.448, 0.448)
    assert torch.isfinite(layer(x)).all()
    assert torch.equal(layer(x), layer(clamped))


@pytest.mark.parametrize("dtype", (torch.bfloat16, torch.float16), ids=str)
def test_fp8_swiglu_folded_is_the_unfused_activation_in_the_input_dtype(dtype):
    """The fold computes silu(gate) * up in x's dtype, as the model's own unfused code, then the same rows."""
    torch.manual_seed(2)
    x = torch.randn(16, 512, dtype=dtype) * 2
    gate, up = x.chunk(2, dim=-1)
    unfused = F.silu(gate) * up
    assert unfused.dtype == dtype
    q, scale = fp8.quantize_rows(x, "swiglu")
    ref_q, ref_scale = definition(unfused)
    assert torch.equal(scale, ref_scale) and torch.equal(q.view(torch.uint8), ref_q.view(torch.uint8))
    layer = quantize_linear(nn.Linear(256, 64).to(dtype), get_method("float8_e4m3fn"), torch.device("cpu"))
    assert torch.equal(layer(x, input_act="swiglu"), layer(unfused))


def test_fp8_weights_use_the_same_row_formula():
    torch.manual_seed(3)
    weight = torch.randn(64, 128, dtype=torch.bfloat16)
    stored = get_method("float8_e4m3fn").quantize_weight(weight)
    ref_q, ref_scale = definition(weight)
    assert stored["weight_scale"].shape == (64, 1) and torch.equal(stored["weight_scale"], ref_scale)
    assert torch.equal(stored["weight"].view(torch.uint8), ref_q.view(torch.uint8))


def test_fp8_gemm_without_an_algorithm_for_its_fused_bias_adds_the_bias_after(monkeypatch):
    """cuBLASLt has no algorithm for some shapes with a fused bias (an H100: 18 rows, 16384 -> 4096,
    tests/bench/results/fp8-scaled-mm-bias-probe-nvidia-h100-2026-12-06.log): the same product runs without the
    epilogue and the bias is added after. The GPU's GEMM is stood in for on CPU: the plain product of the
    dequantized operands, refusing a bias as cuBLASLt does there."""
    calls = []

    def scaled_mm(a, b, scale_a, scale_b, bias=None, out_dtype=None, use_fast_accum=False):
        calls.append(bias is not None)
        if bias is not None:
            raise RuntimeError("CUDA error: CUBLAS_STATUS_NOT_SUPPORTED when calling `cublasLtMatmulAlgoGetHeuristic`")
        return ((a.float() * scale_a) @ (b.float() * scale_b.reshape(1, -1))).to(out_dtype)

    monkeypatch.setattr(fp8, "native_fp8_supported", lambda device: True)
    monkeypatch.setattr(fp8, "_fast_quantize_rows", fp8.quantize_rows)
    monkeypatch.setattr(fp8, "_NO_FUSED_BIAS", set())
    monkeypatch.setattr(torch, "_scaled_mm", scaled_mm)
    gen = torch.Generator().manual_seed(0)
    linear = nn.Linear(64, 32, bias=True).to(torch.bfloat16)
    with torch.no_grad():
        linear.bias.normal_(generator=gen)
    layer = quantize_linear(linear, get_method("float8_e4m3fn"), torch.device("cpu"))
    x = torch.randn(18, 64, generator=gen).to(torch.bfloat16)
    out = layer(x)
    assert calls == [True, False]
    reference = F.linear(x.float(), linear.weight.float(), linear.bias.float())
    assert float((out.float() - reference).norm() / reference.norm()) < 0.05  # FP8's own error, bias included
    assert torch.equal(layer(x), out) and calls == [True, False, False]  # the refused shape is not tried again
    layer(torch.randn(5, 64, generator=gen).to(torch.bfloat16))
    assert calls[3:] == [True, False]  # another shape is
    monkeypatch.setattr(torch, "_scaled_mm", lambda *a, **k: (_ for _ in ()).throw(RuntimeError("other failure")))
    with pytest.raises(RuntimeError, match="other failure"):
        layer(x)
