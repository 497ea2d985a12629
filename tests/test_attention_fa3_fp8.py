"""FP8 attention: the quantization's torch reference, k smoothing, the error
of FP8 attention (emulated on CPU), the fa3_fp8 backend's declarations and
fallback, auto's accuracy check, and the Triton kernels (in Triton's
interpreter on CPU; bit for bit and against FA3 on a GPU).

Emulated FP8 attention: q, k, v quantized by the reference, dequantized, and
SDPA in fp32, against fp32 SDPA on the same bf16 inputs. It leaves out FA3's
own FP8 rounding of the probabilities (about 0.007 more on random inputs).
Tolerances (measured in brackets): locality-structured inputs relative L2
<= 0.04 and cosine >= 0.999 (0.032, 0.9995); random N(0, 1) inputs <= 0.055
and >= 0.998 (0.047, 0.9989).
"""
import logging
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import fp8_qkv_reference as reference
from bench.attention_inputs import cosine, random_qkv, relative_error, structured_qkv
from bigdit.attention import Router, base, fp8_qkv, registry
from bigdit.attention.fa3_fp8 import FA3Fp8
from probes import snapshot


PACK_ROOT = Path(__file__).resolve().parent.parent
FP8 = torch.float8_e4m3fn


def bshd(*ts):
    return tuple(t.transpose(1, 2) for t in ts)


def emulated(q, k, v, *, smooth_k=True):
    """FP8 attention as FA3 computes it, up to its own rounding of the probabilities (BHSD, fp32)."""
    x = reference.reference_quantize(q, k, v, "BHSD", reference.reference_stats(q, k, v, "BHSD", smooth_k=smooth_k))
    qd, kd, vd = (reference.dequantize(t, x.descale[i]).transpose(1, 2) for i, t in enumerate((x.q, x.k, x.v)))
    return F.scaled_dot_product_attention(qd, kd, vd)


def exact(q, k, v):
    return F.scaled_dot_product_attention(q.float(), k.float(), v.float())


# ---- the reference ----------------------------------------------------------

def test_reference_scales_and_rounding():
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 3, 50, 64, generator=g).to(torch.bfloat16) for _ in range(3))
    v[1, 2] = 0  # an all-zero head takes the minimum scale
    st = reference.reference_stats(q, k, v, "BHSD")
    x = reference.reference_quantize(q, k, v, "BHSD", st)
    assert x.q.dtype == FP8 and x.q.shape == (2, 50, 3, 64) and x.q.is_contiguous()
    assert x.descale.shape == (3, 2, 3) and x.descale.dtype == torch.float32
    torch.testing.assert_close(st.k_mean, k.float().mean(dim=2), rtol=0, atol=0)
    smoothed = k.float() - st.k_mean[:, :, None]
    for i, src in enumerate((q.float(), smoothed, v.float())):
        amax = src.abs().amax(dim=(2, 3))
        expected = torch.where(amax > 0, amax * fp8_qkv.INV_FP8_MAX, torch.tensor(fp8_qkv.MIN_SCALE))
        assert torch.equal(x.descale[i], expected)
        out = (x.q, x.k, x.v)[i]
        back = reference.dequantize(out, x.descale[i]).transpose(1, 2)
        # E4M3: half an ulp is 2^-4 relative in the normal range, 2^-10 of the scale among subnormals
        bound = src.abs() * 2.0 ** -4 + x.descale[i][:, :, None, None] * 2.0 ** -10
        assert ((back - src).abs() <= bound).all()
        # each head's largest value is FP8's largest
        assert torch.equal(out.float().abs().amax(dim=(1, 3)).T.contiguous(),
                           torch.where(amax > 0, fp8_qkv.FP8_MAX, 0.0).T.contiguous())
    assert not x.v[1, :, 2].float().any()


def test_reference_reads_either_layout_and_writes_bshd():
    q, k, v = random_qkv(1, 2, 70, 128, seed=1)
    a = reference.reference_quantize(q, k, v, "BHSD", reference.reference_stats(q, k, v, "BHSD"))
    qs, ks, vs = (t.transpose(1, 2).contiguous() for t in (q, k, v))  # a real BSHD tensor
    b = reference.reference_quantize(qs, ks, vs, "BSHD", reference.reference_stats(qs, ks, vs, "BSHD"))
    for x, y in ((a.q, b.q), (a.k, b.k), (a.v, b.v)):
        assert torch.equal(x.view(torch.uint8), y.view(torch.uint8))
    assert torch.equal(a.descale, b.descale)


# ---- k smoothing -----------------------------------------------------------------

def test_smoothing_k_leaves_attention_unchanged():
    q, k, v = (t.double() for t in structured_qkv(1, 4, (4, 8, 8), seed=2))
    smoothed = k - k.mean(dim=2, keepdim=True)
    torch.testing.assert_close(F.scaled_dot_product_attention(q, smoothed, v),
                               F.scaled_dot_product_attention(q, k, v), rtol=0, atol=1e-12)


def test_smoothing_k_removes_the_error_of_a_key_offset():
    # keys with a shared per-channel offset of 3x their spread, as video DiTs' keys have
    q, k, v = structured_qkv(1, 4, (8, 16, 16), seed=3)
    g = torch.Generator().manual_seed(5)
    k = (k.float() + 3 * k.float().pow(2).mean().sqrt() * torch.randn(1, 4, 1, 128, generator=g)).to(k.dtype)
    ref = exact(q, k, v)
    plain, smooth = (relative_error(emulated(q, k, v, smooth_k=s), ref) for s in (False, True))
    assert smooth < 0.04 and plain > 1.4 * smooth, (plain, smooth)  # measured 0.053 and 0.032


# ---- error of FP8 attention (emulated) ---------------------------------------

@pytest.mark.parametrize("kind, max_error, min_cosine", [("structured", 0.04, 0.999), ("random", 0.055, 0.998)])
def test_emulated_fp8_attention_error(kind, max_error, min_cosine):
    q, k, v = (structured_qkv(1, 4, (8, 16, 16), seed=0) if kind == "structured" else random_qkv(1, 4, 2048, seed=0))
    out, ref = emulated(q, k, v), exact(q, k, v)
    err = relative_error(out, ref)
    assert err <= max_error and cosine(out, ref) >= min_cosine
    assert err > 0.01  # it is FP8: an error this small would mean nothing was quantized


# ---- the backend's declarations and fallback -------------------------------

def test_fa3_fp8_declarations():
    c = FA3Fp8.constraints
    assert c.devices == frozenset({"cuda"}) and c.min_capability == c.max_capability == (9, 0)
    assert c.dtypes == base.HALF_DTYPES and not c.masks and not c.grouped_kv and c.cross
    assert c.head_dims == frozenset({64, 96, 128, 192, 256})
    fa3, why = base.load("fa3_fwd_interface", "flash_attn_func", "fa3-fwd")
    if fa3 is None:
        assert FA3Fp8().unavailable() == why and why.startswith("fa3-fwd ")
    assert registry.create("fa3_fp8").name == registry.parse("Flash-FP8") == "fa3_fp8"
    assert "fa3_fp8" in registry.DENSE_BACKENDS


def test_fa3_fp8_falls_back_on_cpu_with_one_reason(caplog):
    router = Router("fa3_fp8", dense_backend="sdpa")
    q, k, v = random_qkv(1, 2, 64, 128, dtype=torch.bfloat16)
    with caplog.at_level(logging.WARNING, logger="bigdit.attention.router"):
        outs = [router(q, k, v) for _ in range(2)]
    (warning,) = [r.getMessage() for r in caplog.records if "fa3_fp8 cannot" in r.getMessage()]
    assert "(needs cuda, got a cpu tensor); running sdpa instead" in warning
    assert all(torch.equal(o, F.scaled_dot_product_attention(q, k, v)) for o in outs)
    assert snapshot(router.stats)["fallbacks"] == {"fa3_fp8 -> sdpa: needs cuda, got a cpu tensor": 2}


def test_auto_weighs_fa3_fp8_as_approximate():
    # not exact: the end-to-end run measured latent cosine 0.994 with it; auto checks it on a probe first
    assert FA3Fp8.max_error == 0.05
    assert "fa3_fp8" in [impl.label for impl in registry.create("auto").kernels]


# ---- the Triton kernels -------------------------------------------------------

INTERPRETED = textwrap.dedent("""
    import sys, types, torch
    pkg = types.ModuleType("bigdit"); pkg.__path__ = [sys.argv[1]]; sys.modules["bigdit"] = pkg
    from bigdit.attention import fp8_qkv as f
    sys.path.insert(0, sys.argv[1] + "/tests")
    import fp8_qkv_reference as reference
    g = torch.Generator().manual_seed(0)
    # (layout, batch, heads, q tokens, k/v tokens, head dim): two statistics chunks; cross-attention
    # with an odd head dim in (B, S, H, D)
    for layout, b, h, sq, skv, d in (("BHSD", 1, 2, 1100, 1100, 128), ("BSHD", 2, 1, 77, 300, 96)):
        shape = lambda s: (b, h, s, d) if layout == "BHSD" else (b, s, h, d)
        q = (torch.randn(shape(sq), generator=g) * 3).to(torch.bfloat16)
        k = (torch.randn(shape(skv), generator=g) + 4 * torch.randn(d, generator=g)).to(torch.bfloat16)
        v = torch.randn(shape(skv), generator=g).to(torch.bfloat16)
        if layout == "BSHD":
            v[1] = 0
        st = f.stats(q, k, v, layout)
        ref = reference.reference_stats(q, k, v, layout)
        torch.testing.assert_close(st.k_mean, ref.k_mean, rtol=1e-5, atol=1e-6)  # summation order
        assert torch.equal(st.amax, reference.reference_stats(q, k, v, layout, k_mean=st.k_mean).amax)
        # float32 output: the values just before the FP8 cast (the interpreter's float8 cast is
        # numpy's, not the GPU's; the GPU test checks the cast bit for bit)
        got = f.quantize(q, k, v, layout, st, out_dtype=torch.float32)
        want = reference.reference_quantize(q, k, v, layout, st, out_dtype=torch.float32)
        for x, y in ((got.q, want.q), (got.k, want.k), (got.v, want.v)):
            assert x.shape == y.shape and torch.equal(x, y)
        assert torch.equal(got.descale, want.descale)
    print("ok")
""")


def test_kernels_in_the_triton_interpreter():
    pytest.importorskip("triton", reason="Triton is not installed")
    result = subprocess.run([sys.executable, "-c", INTERPRETED, str(PACK_ROOT)], capture_output=True, text=True,
                            env={**os.environ, "TRITON_INTERPRET": "1"}, timeout=300)
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr[-3000:]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("layout", ["BHSD", "BSHD"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_kernels_match_the_reference_bit_for_bit(layout, dtype):
    pytest.importorskip("triton", reason="Triton is not installed")
    q, k, v = structured_qkv(2, 3, (5, 30, 52), device="cuda", dtype=dtype, seed=6)  # 7800 tokens
    k = k + torch.randn(2, 3, 1, 128, device="cuda", dtype=dtype)  # a key offset to smooth away
    if layout == "BSHD":
        q, k, v = (t.transpose(1, 2).contiguous() for t in (q, k, v))
    st = fp8_qkv.stats(q, k, v, layout)
    ref = reference.reference_stats(*(t.cpu() for t in (q, k, v)), layout)
    torch.testing.assert_close(st.k_mean.cpu(), ref.k_mean, rtol=1e-5, atol=1e-6)  # summation order
    same_mean = reference.reference_stats(*(t.cpu() for t in (q, k, v)), layout, k_mean=st.k_mean.cpu())
    assert torch.equal(st.amax.cpu(), same_mean.amax)
    got = fp8_qkv.quantize_qkv(q, k, v, layout)
    want = reference.reference_quantize(*(t.cpu() for t in (q, k, v)), layout, same_mean)
    for x, y in ((got.q, want.q), (got.k, want.k), (got.v, want.v)):
        assert x.dtype == FP8 and torch.equal(x.cpu().view(torch.uint8), y.view(torch.uint8))
    assert torch.equal(got.descale.cpu(), want.descale)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("layout", ["BHSD", "BSHD"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_fa3_fp8_against_exact_attention(layout, dtype):
    q, k, v = structured_qkv(1, 4, (8, 16, 16), device="cuda", dtype=dtype, seed=7)
    args = (q, k, v) if layout == "BHSD" else bshd(q, k, v)
    try:
        call = registry.create("fa3_fp8").kernel_call(*args, layout=layout)
    except base.Unsupported as e:
        pytest.skip(f"fa3_fp8: {e}")
    out = call.run()
    assert out.dtype == dtype and out.shape == args[0].shape
    if layout == "BSHD":
        out = out.transpose(1, 2)
    ref = exact(q, k, v)
    # the emulated error plus FA3's FP8 probabilities
    assert relative_error(out, ref) < 0.05 and cosine(out, ref) > 0.998
    assert relative_error(out, ref) < 1.3 * relative_error(emulated(q, k, v), ref)
    # cross-attention: text-length keys, not a multiple of any tile
    kc, vc = random_qkv(1, 4, 333, device="cuda", dtype=dtype, seed=8)[:2]
    out = registry.create("fa3_fp8")(q, kc, vc)
    assert relative_error(out, exact(q, kc, vc)) < 0.06
