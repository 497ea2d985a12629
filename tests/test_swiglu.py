"""The one-pass Triton SwiGLU (quant/swiglu.py) against comfy-kitchen's eager `silu(gate).mul_(up)`, the activation
a quantized layer with a LoRA branch writes out for its GEMM and its branches.

Both round silu to the input's dtype and then the product; the only legitimate difference is silu's exp (Triton's
against torch's) moving a value by one ulp of its dtype before those roundings. On CPU the kernel runs in Triton's
interpreter (in a subprocess: the interpreter is chosen when the kernel is defined); on the GPU against kitchen's
CUDA result; and the layer's forward with a branch takes it, with one warning and kitchen's path where it fails.
"""
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

PACK_ROOT = Path(__file__).resolve().parent.parent

pytest.importorskip("triton", reason="Triton is not installed")

CHECK = textwrap.dedent("""
    import sys, types, torch
    pkg = types.ModuleType("bigdit"); pkg.__path__ = [sys.argv[1]]; sys.modules["bigdit"] = pkg
    from bigdit.quant import swiglu
    from bigdit.quant.kitchen_api import apply_input_act

    torch.manual_seed(0)
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        for width in (64, 1000, 2500):  # under, not a multiple of and over one block of columns
            x = (torch.randn(7, 2 * width + 5, dtype=dtype) * 3)[:, :2 * width]  # rows strided wider
            x[2] = 0
            out, ref = swiglu.swiglu(x), apply_input_act(x, "swiglu")
            assert out.shape == ref.shape == (7, width) and out.dtype == dtype, (out.shape, out.dtype)
            if dtype == torch.float16:  # the interpreter rounds to fp16 like the GPU: exp's ulp at most
                assert torch.allclose(out.float(), ref.float(), rtol=2 ** -10, atol=2 ** -24), (dtype, width)
            elif dtype == torch.bfloat16:  # the interpreter truncates fp32 -> bf16 twice (the GPU rounds)
                assert torch.allclose(out.float(), ref.float(), rtol=2 ** -6, atol=1e-30), (dtype, width)
            else:
                assert torch.allclose(out, ref, rtol=1e-6, atol=1e-30), (dtype, width)
            assert torch.equal(out[2], ref[2])
    print("ok")
""")


def test_kernel_in_the_triton_interpreter():
    result = subprocess.run([sys.executable, "-c", CHECK, str(PACK_ROOT)], capture_output=True, text=True,
                            env={**os.environ, "TRITON_INTERPRET": "1"}, timeout=300)
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr[-3000:]


def test_off_cuda_the_activation_is_kitchens():
    from bigdit.quant import swiglu
    from bigdit.quant.kitchen_api import apply_input_act
    x = torch.randn(3, 5, 64, dtype=torch.bfloat16)
    for act in ("swiglu", "gelu_tanh", None):
        assert torch.equal(swiglu.activated(x, act), apply_input_act(x, act))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("width,dtype", [(14336, torch.bfloat16), (300, torch.bfloat16), (5120, torch.float16)])
def test_kernel_matches_kitchens_swiglu_on_cuda(width, dtype):
    """Within two ulps of the dtype where silu's exp differs, on a few values at most; elsewhere bit for bit."""
    from bigdit.quant import swiglu
    from bigdit.quant.kitchen_api import apply_input_act
    x = (torch.randn(257, 2 * width + 64, device="cuda", dtype=dtype) * 3)[:, :2 * width]
    out, ref = swiglu.activated(x.reshape(1, 257, -1), "swiglu").reshape(257, width), apply_input_act(x, "swiglu")
    # a few fp32 ulps of exp move silu across a rounding midpoint of the dtype on about that many ulps over its
    # spacing (2^-16 of bf16's values, 2^-13 of fp16's), and the product then by up to two ulps; fp16's subnormals
    # below 2^-14 have an absolute ulp of 2^-24
    differs = out != ref
    assert differs.float().mean() < (1e-3 if dtype == torch.bfloat16 else 1e-2), differs.float().mean()
    ulp, tiny = (2 ** -7, 1e-38) if dtype == torch.bfloat16 else (2 ** -10, 2 ** -23)
    assert torch.allclose(out.float(), ref.float(), rtol=2 * ulp, atol=tiny)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_a_failing_kernel_falls_back_to_kitchen_with_one_warning(monkeypatch, caplog):
    from bigdit.quant import swiglu
    from bigdit.quant.kitchen_api import apply_input_act

    def broken(x, ahead=False):
        raise RuntimeError("no kernel for this GPU")

    monkeypatch.setattr(swiglu, "swiglu", broken)
    monkeypatch.setattr(swiglu, "_failed", None)
    x = torch.randn(64, 512, device="cuda", dtype=torch.bfloat16)
    with caplog.at_level("WARNING"):
        first, second = swiglu.activated(x, "swiglu"), swiglu.activated(x, "swiglu")
    assert torch.equal(first, apply_input_act(x, "swiglu")) and torch.equal(second, first)
    assert sum("SwiGLU: the one-pass Triton kernel failed" in r.getMessage() for r in caplog.records) == 1
