"""The pack's INT8 Triton kernels (quant/int8_triton.py) against references, and their place in Int8ConvRotMethod.

On CPU the kernels run in Triton's interpreter, in a process of their own (tests/int8_triton_interpreted.py:
the interpreter is chosen when a kernel is defined, and other tests import Triton first). Without the
interpreter a CPU call is not theirs: the method computes kitchen's result. GPU tests (marked gpu) hold the
kernels to comfy-kitchen's CUDA int8_linear at H3's widths.
"""
import logging
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from bigdit.quant import QuantConfig, compiled_ops, quantize_layers
from bigdit.quant.int8_convrot import Int8ConvRotMethod
from bigdit.quant.kitchen_api import apply_input_act, hadamard

it = pytest.importorskip("bigdit.quant.int8_triton")
if it.triton is None:
    pytest.skip("Triton (with tensor descriptors) cannot be imported", allow_module_level=True)

TESTS = Path(__file__).resolve().parent
CHECKS = ["activation", "activation_pieces", "gemm_int32", "gemm_epilogue", "int8_linear_vs_kitchen", "unavailable", "method_and_compile",
          "shipped_configs", "gemm_low_rank", "method_low_rank", "w4a8_method", "w4a8_decode", "w4a8_fused_gemm",
          "persistent_gemm"]


@pytest.mark.parametrize("check", CHECKS)
def test_kernels_in_the_triton_interpreter(check):
    """Each check asserts against its reference (see the script): rotate + quantize within one code on ties and
    scales to fp32 rounding, the int32 sums exactly, the epilogue to one output rounding, the whole path no
    worse than 1.1x kitchen's eager error, the method forced to it and compiled as one op, and each of those
    with every config the pack ships."""
    env = {k: v for k, v in os.environ.items() if k != "BIGDIT_INT8_KERNEL"}
    result = subprocess.run([sys.executable, str(TESTS / "int8_triton_interpreted.py"), check], capture_output=True,
                            text=True, env={**env, "TRITON_INTERPRET": "1"}, timeout=300)
    last = result.stdout.strip().splitlines()[-1] if result.stdout.strip() else ""
    if result.returncode == 0 and last.startswith(f"skip {check}: "):
        pytest.skip(last)
    assert result.returncode == 0 and last == f"ok {check}", result.stderr[-3000:]


def test_kitchens_hadamard_256_is_the_kronecker_square_of_its_16():
    """The kernel rotates a group of 256 as H16 (x) H16 by two 16-wide products, using H16's symmetry."""
    h16, h256 = hadamard(16, "cpu"), hadamard(256, "cpu")
    assert torch.equal(h16, h16.T)
    assert torch.equal(torch.kron(h16, h16), h256)
    x = torch.randn(3, 256, dtype=torch.float64)
    two_steps = (h16.double() @ (x.reshape(3, 16, 16) @ h16.double())).reshape(3, 256)
    assert torch.allclose(two_steps, x @ h256.double(), rtol=1e-12, atol=1e-12)


def quantized(k=512, n=96, group=256, dtype=torch.bfloat16, device="cpu", bias=True):
    torch.manual_seed(0)
    layer = nn.Linear(k, n, bias=bias).to(device, dtype)
    return layer, quantize_layers(nn.Sequential(layer), QuantConfig(method=Int8ConvRotMethod(group)))[0]["0"]


@pytest.mark.skipif(it._INTERPRETED, reason="this process runs Triton's interpreter")
def test_cpu_without_the_interpreter_is_kitchens(monkeypatch):
    _, q = quantized()
    x = torch.randn(2, 7, 512, dtype=torch.bfloat16)
    t = q.tensors_for(x)
    reason = it.unavailable_reason(x, t["weight"], t["weight_scale"], t["bias"], torch.bfloat16, True, 256, None)
    assert reason is not None and "cpu" in reason
    import comfy_kitchen as ck
    kitchen = ck.int8_linear(x, t["weight"], t["weight_scale"], t["bias"], torch.bfloat16, convrot=True,
                             convrot_groupsize=256, input_act=None)
    monkeypatch.setenv("BIGDIT_INT8_KERNEL", "triton")  # forced where it cannot run: the default, kitchen
    assert torch.equal(q(x), kitchen)


def test_a_failing_kernel_warns_once_and_kitchen_computes(monkeypatch, caplog):
    def broken(*args, **kwargs):
        raise RuntimeError("no kernel for this GPU")

    monkeypatch.setattr(it, "int8_linear", broken)
    monkeypatch.setattr(it, "_failure", None)
    monkeypatch.setattr(it, "_warned", set())
    _, q = quantized()
    x = torch.randn(9, 512, dtype=torch.bfloat16)
    t = q.tensors_for(x)
    args = (x, t["weight"], t["weight_scale"], t["bias"], torch.bfloat16, True, 256, None)
    kitchen = compiled_ops._kitchen_int8_linear(*args)
    with caplog.at_level(logging.WARNING):
        for _ in range(2):
            assert torch.equal(it.linear_or_kitchen(*args, kitchen=compiled_ops._kitchen_int8_linear), kitchen)
    assert sum("Triton kernels failed" in r.message for r in caplog.records) == 1
    assert "failed earlier" in it.unavailable_reason(*args)


# --- GPU (run on the H200 by the lead) ---------------------------------------------------------------------
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def test_down_rows_rotates_as_kitchen_rotates_weights_and_quantizes_each_row():
    """A LoRA's down matrix for the INT8 path's rows: rotated as comfy-kitchen rotates a ConvRot weight (its own
    _rotate_weight, the reference), then each row to int8 within half a step of its scale, its largest value at 127;
    a zero row keeps a positive scale and zero codes; without ConvRot, the matrix itself quantized."""
    from comfy_kitchen.tensor.int8_utils import _build_hadamard, _rotate_weight
    from bigdit.quant.int8_lora import down_rows
    torch.manual_seed(2)
    down = torch.randn(24, 512, dtype=torch.bfloat16) * 0.05
    down[3] = 0
    for convrot, group in ((True, 256), (True, 64), (False, 256)):
        q, scale = down_rows(down, convrot, group)
        ref = _rotate_weight(down.float(), _build_hadamard(group), group) if convrot else down.float()
        assert q.dtype == torch.int8 and q.shape == (24, 512) and scale.shape == (24,) and bool((scale > 0).all())
        assert bool(((q.float() * scale[:, None] - ref).abs() <= scale[:, None] * 0.5001 + 1e-8).all()), (convrot, group)
        assert q[3].eq(0).all() and q.abs().amax(dim=1)[torch.arange(24) != 3].eq(127).all(), (convrot, group)


@pytest.mark.skipif(it._INTERPRETED, reason="this process runs Triton's interpreter")
@pytest.mark.parametrize("act", [None, "swiglu"])
def test_a_lora_part_the_fused_path_cannot_take_is_added_after_the_gemm(monkeypatch, act):
    """Where the fused path cannot run (on CPU; under a row split the user forces), the method adds a LoRA's part by
    an addmm on the input activated once: the same numbers as the layer's own output plus the part computed apart."""
    from bigdit.quant.low_rank import LowRank
    from bigdit.quant.swiglu import activated
    _, q = quantized(256, 96)
    torch.manual_seed(1)
    x = torch.randn(2, 50, 512 if act else 256, dtype=torch.bfloat16)
    part = LowRank((None, None, None), torch.randn(8, 256, dtype=torch.bfloat16) * 0.06, None,
                   torch.randn(96, 8, dtype=torch.bfloat16) * 0.05, 0.5)
    for max_rows in (None, "16"):
        if max_rows:
            monkeypatch.setenv("BIGDIT_INT8_MAX_ROWS", max_rows)
        xa = activated(x, act).reshape(100, 256)
        want = q.method.apply(q, xa).reshape(100, 96).addmm(part.hidden(xa), part.up.t(), alpha=0.5)
        got = q.method.apply(q, x, act, low_rank=part)
        assert got.shape == (2, 50, 96) and torch.equal(got.reshape(100, 96), want), max_rows
        assert not torch.equal(want, q.method.apply(q, xa).reshape(100, 96))  # the part is there


def rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def cuda_weights(n, k, group, per_channel=True, seed=0):
    from comfy_kitchen.tensor.int8 import TensorWiseINT8Layout
    torch.manual_seed(seed)
    weight = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * k ** -0.5
    qdata, params = TensorWiseINT8Layout.quantize(weight, is_weight=True, per_channel=per_channel,
                                                  convrot=per_channel, convrot_groupsize=group)
    return weight, qdata, params.scale.float()


@pytest.mark.parametrize("k,n,group,act", [(5376, 2048, 256, None), (7168, 1024, 256, None),
                                           (14336, 1024, 256, "swiglu"), (5376, 1024, 64, None),
                                           (5120, 1024, 16, "swiglu")])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.gpu
@needs_cuda
def test_triton_against_kitchens_cuda_int8_linear(k, n, group, act, bias):
    """At H3's widths and a few hundred rows: error from the float reference within 1.1x kitchen's own."""
    import comfy_kitchen as ck
    assert ck.registry.is_available("cuda")
    weight, qdata, w_scale = cuda_weights(n, k, group)
    b = torch.randn(n, device="cuda", dtype=torch.bfloat16) * 0.1 if bias else None
    x = torch.randn(333, 2 * k if act else k, device="cuda", dtype=torch.bfloat16)
    x[7, :4] *= 40  # hot channels
    ref = F.linear(apply_input_act(x, act).double(), weight.double(), None if b is None else b.double())
    assert it.available(x, qdata, w_scale, b, torch.bfloat16, True, group, act)
    ours = it.int8_linear(x, qdata, w_scale, b, torch.bfloat16, True, group, act)
    theirs = ck.int8_linear(x, qdata, w_scale, b, torch.bfloat16, convrot=True, convrot_groupsize=group,
                            input_act=act)
    assert ours.dtype == torch.bfloat16 and ours.shape == theirs.shape
    assert rel(ours, ref) <= 1.1 * rel(theirs, ref), (rel(ours, ref), rel(theirs, ref))


@pytest.mark.parametrize("act", [None, "swiglu"])
@pytest.mark.gpu
@needs_cuda
def test_activation_kernel_against_its_definition_on_cuda(act):
    """Rotate + quantize on the GPU against the torch definition (float64 rotation): scales to fp32 rounding,
    codes within one; apart from rounding ties only SwiGLU's exp (an ulp of bf16 against torch's) moves any."""
    k = 5376
    x = torch.randn(300, 2 * k if act else k, device="cuda", dtype=torch.bfloat16) * 3
    x[1] = 0
    x[2] *= 1e-4  # a row of small values beside normal ones
    q, scale = it.quantize_rows(x, True, 256, act)
    v = (apply_input_act(x, act).double().reshape(300, -1, 256) @ hadamard(256, "cuda").double()).reshape(300, k)
    v = v.float()
    ref_scale = (v.abs().amax(1, keepdim=True) / 127.0).clamp(min=1e-30)
    ref_q = torch.round((v * torch.reciprocal(ref_scale)).clamp(-128, 127)).to(torch.int8)
    diff = (q.int() - ref_q.int()).abs()
    assert diff.max() <= 1
    if act is None:
        assert torch.allclose(scale, ref_scale, rtol=1e-6, atol=0)
        assert diff.float().mean() < 1e-5
    else:
        assert torch.allclose(scale, ref_scale, rtol=2 ** -7, atol=0)
        assert diff.float().mean() < 2e-3


@pytest.mark.parametrize("tma", [False, True])
@pytest.mark.gpu
@needs_cuda
def test_gemm_sums_exactly_on_cuda(tma):
    """int32 accumulation equals torch._int_mm's at tile edges (333 rows, 1040 columns), either kernel."""
    if tma and torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("TMA needs sm90+")
    a = torch.randint(-127, 128, (333, 5376), device="cuda", dtype=torch.int8)
    w = torch.randint(-127, 128, (1040, 5376), device="cuda", dtype=torch.int8)
    out = it.gemm(a, torch.ones(333, 1, device="cuda"), w, torch.ones(1040, device="cuda"), None, torch.float32,
                  tma=tma)
    exact = torch._int_mm(torch.cat([a, a.new_zeros(3, 5376)]), w.t())[:333]  # (cuBLAS wants rows > 16)
    assert torch.equal(out.to(torch.int64), exact.to(torch.int64))  # |sums| < 2^24: exact in fp32


@pytest.mark.gpu
@needs_cuda
def test_the_method_runs_triton_by_default_timing_nothing(monkeypatch):
    """Forced or not, the method runs the Triton kernels on sm80+ (their result, bit for bit), and nothing is
    timed: neither the kernel choice nor the kernels' configs (the shipped table's or the rule's)."""
    from probes import chooser
    from bigdit.quant import kernel_select

    def untimed(*args, **kwargs):
        raise AssertionError("timed without being asked")
    monkeypatch.setattr(kernel_select, "_time_ms", untimed)
    monkeypatch.setattr(it, "time_ms", untimed)
    monkeypatch.delenv("BIGDIT_INT8_TUNE", raising=False)
    if torch.cuda.get_device_capability() < (8, 0):
        pytest.skip("the Triton kernels are the default from sm80")
    calls = []
    real = it.int8_linear
    monkeypatch.setattr(it, "int8_linear", lambda *a: calls.append(a[0].shape) or real(*a))
    _, q = quantized(5376, 2048, device="cuda")
    x = torch.randn(9000, 5376, device="cuda", dtype=torch.bfloat16)
    t = q.tensors_for(x)
    expected = real(x, t["weight"], t["weight_scale"], t["bias"], torch.bfloat16, True, 256, None)
    monkeypatch.setenv("BIGDIT_INT8_KERNEL", "triton")
    assert torch.equal(q(x), expected) and len(calls) == 1
    monkeypatch.delenv("BIGDIT_INT8_KERNEL")
    monkeypatch.delenv("BIGDIT_INT8_MAX_ROWS", raising=False)
    before = dict(chooser().timings)
    assert torch.equal(q(x), expected) and len(calls) == 2
    assert chooser().timings == before
    sources = {source for (kernel, _, shape), (_, source) in it._CHOSEN.items() if shape[0] == 16384}
    assert sources and sources <= {"store", "shipped", "rule"}, sources


@pytest.mark.parametrize("act", [None, "swiglu"])
@pytest.mark.gpu
@needs_cuda
def test_fullgraph_inductor_with_triton_forced_on_cuda(monkeypatch, act):
    monkeypatch.setenv("BIGDIT_INT8_KERNEL", "triton")
    _, q = quantized(1024, 2048, device="cuda")
    x = torch.randn(3, 700, 2048 if act else 1024, device="cuda", dtype=torch.bfloat16)
    eager = q(x, input_act=act)
    torch._dynamo.reset()
    out = torch.compile(q, backend="inductor", fullgraph=True)(x, input_act=act)
    assert rel(out, eager) < 1e-2


@pytest.mark.gpu
@needs_cuda
def test_a_compiled_layer_runs_the_chosen_kernel(monkeypatch, tmp_path):
    """Compiled before any eager call (as ComfyUI's TorchCompileModel does), an INT8 layer runs the kernel the
    choice names, nothing timed: the Triton kernels by default (sm80+), counted in the run report from inside the
    compiled graph; and kitchen's where a kept measurement chose it for the shape."""
    from bigdit.quant import int8_convrot, kernel_select, tuning, witness
    from bigdit.quant.kernel_select import rows_bucket
    if torch.cuda.get_device_capability() < (8, 0):
        pytest.skip("the Triton kernels are the default from sm80")

    def untimed(*args, **kwargs):
        raise AssertionError("timed without being asked")
    monkeypatch.setattr(kernel_select, "_time_ms", untimed)
    monkeypatch.setattr(it, "time_ms", untimed)
    for name in ("BIGDIT_INT8_KERNEL", "BIGDIT_INT8_MAX_ROWS", "BIGDIT_INT8_TUNE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(tuning, "_current", tuning.current())
    tuning.use(str(tmp_path / tuning.FILE_NAME))
    monkeypatch.setattr(int8_convrot._chooser, "choices", {})
    monkeypatch.setattr(witness, "TALLY", witness.KernelTally())
    _, q = quantized(1024, 2048, device="cuda")
    x = torch.randn(3, 700, 1024, device="cuda", dtype=torch.bfloat16)
    run = witness.RunWitness({"q": q})
    torch._dynamo.reset()
    compiled = torch.compile(q, backend="inductor", fullgraph=True)
    out = compiled(x)
    compiled(x)
    count = run.take()
    assert count.kernels == {("int8", "triton"): 2}, count.kernels
    assert re.fullmatch(r"ran int8: triton x2 calls( \(first launches at \d+ shapes: [\d.]+ s, compiling what "
                        r"Triton's cache lacked\))?", count.render_kernels()), count.render_kernels()
    eager = q(x)  # the same kernel eagerly: the same numbers
    assert torch.equal(out, eager)
    run.take()

    shape = (rows_bucket(2100), 1024, 2048, torch.bfloat16, None, ("kitchen", "triton", "dequant"))
    tuning.current().put(tuning.device_key(x.device), f"{int8_convrot.CONVROT}.kernel", int8_convrot.KERNEL_VERSION,
                         "|".join(map(str, shape)), {"choice": "kitchen", "ms": {}})
    monkeypatch.setattr(int8_convrot._chooser, "choices", {})
    torch._dynamo.reset()
    torch.compile(q, backend="inductor", fullgraph=True)(x)
    assert run.take().kernels == {("int8", "kitchen"): 1}
