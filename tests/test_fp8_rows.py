"""The one-pass Triton FP8 row quantizer against the torch reference (fp8.quantize_rows).

On CPU it runs in Triton's interpreter (in a subprocess: the interpreter is
chosen when the kernel is defined); the GPU test compares bit for bit, except for values the
kernel's approximate division may round across an FP8 rounding midpoint.
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
    from bigdit.quant import fp8, fp8_rows
    torch.manual_seed(0)
    for swiglu, width in ((False, 100), (True, 64), (False, 300)):
        x = torch.randn(6, width * (2 if swiglu else 1), dtype=torch.bfloat16) * 3
        x[2] = 0  # an all-zero row takes the minimum scale
        # float32 output: the values just before the FP8 cast (the interpreter's float8
        # cast is numpy's, not the GPU's; the GPU test checks the cast bit for bit).
        v, scale = fp8_rows.quantize_rows(x, swiglu, fp8.FP8_MAX, fp8._MIN_SCALE, out_dtype=torch.float32)
        act = fp8._input_act(x, "swiglu" if swiglu else None).float()
        ref_scale = (act.abs().amax(-1, keepdim=True) / fp8.FP8_MAX).clamp(min=fp8._MIN_SCALE)
        assert v.shape == act.shape
        assert torch.allclose(scale, ref_scale, rtol=1e-2 if swiglu else 1e-6), (scale, ref_scale)
        assert torch.allclose(v * scale, act, rtol=1e-2 if swiglu else 1e-5, atol=1e-6)
        assert v.abs().max() <= fp8.FP8_MAX
    print("ok")
""")

def test_kernel_in_the_triton_interpreter():
    result = subprocess.run([sys.executable, "-c", CHECK, str(PACK_ROOT)], capture_output=True, text=True,
                            env={**os.environ, "TRITON_INTERPRET": "1"}, timeout=300)
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr[-3000:]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("swiglu,width", [(False, 7168), (False, 14336), (True, 14336), (False, 300)])
def test_kernel_matches_torch_on_cuda(swiglu, width):
    from bigdit.quant import fp8, fp8_rows
    x = torch.randn(257, width * (2 if swiglu else 1), device="cuda", dtype=torch.bfloat16)
    q, scale = fp8_rows.quantize_rows(x, swiglu, fp8.FP8_MAX, fp8._MIN_SCALE)
    ref_q, ref_scale = fp8.quantize_rows(x, "swiglu" if swiglu else None)
    if swiglu:  # silu computed in fp32 here, in bf16 by the torch reference
        assert torch.allclose(scale, ref_scale, rtol=1e-2)
        back, ref_back = q.float() * scale, ref_q.float() * ref_scale
        assert ((back - ref_back).norm() / ref_back.norm()) < 0.02
    else:
        assert torch.equal(scale, ref_scale)
        # Bit for bit, except where the kernel's approximate division (within 2 ulp) can move a value
        # across an FP8 rounding midpoint: within 4 ulp of one, either neighbour is right.
        exact = (x.float() / ref_scale).clamp(-fp8.FP8_MAX, fp8.FP8_MAX)
        ulps = 4 * torch.finfo(torch.float32).eps
        near_midpoint = ((exact * (1 - ulps)).to(fp8.FP8).view(torch.uint8)
                         != (exact * (1 + ulps)).to(fp8.FP8).view(torch.uint8))
        differs = q.view(torch.uint8) != ref_q.view(torch.uint8)
        assert not (differs & ~near_midpoint).any()
        assert near_midpoint.float().mean() < 1e-4  # the allowance stays a rare exception


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_a_failing_triton_kernel_falls_back_with_one_warning(monkeypatch, caplog):
    from bigdit.quant import fp8, fp8_rows

    def broken(*args, **kwargs):
        raise RuntimeError("no kernel for this GPU")

    monkeypatch.setattr(fp8_rows, "quantize_rows", broken)
    monkeypatch.setattr(fp8, "_triton_failed", False)
    x = torch.randn(64, 512, device="cuda", dtype=torch.bfloat16)
    ref_q, ref_scale = fp8.quantize_rows(x, None)
    with caplog.at_level("WARNING"):
        for _ in range(2):
            q, scale = fp8._fast_quantize_rows(x, None)
    # torch.compile's cast may round a value or two differently from eager torch's
    back, ref_back = q.float() * scale, ref_q.float() * ref_scale
    assert torch.allclose(scale, ref_scale) and ((back - ref_back).norm() / ref_back.norm()) < 1e-2
    assert sum("Triton activation quantizer failed" in r.message for r in caplog.records) == 1
