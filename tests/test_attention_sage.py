"""The sage backend's dispatch and fallbacks on CPU: which SageAttention kernel each GPU
architecture gets, with what arguments, and what runs where a kernel is not installed or built.

SageAttention's kernels cannot run on a CPU, so a stand-in `sageattention` module replaces the
package: each entry point records its call and computes exact attention (SDPA) with the layout
and scale it was given, and it asserts what the real ones assert (fp16/bf16, head dim <= 128,
last dimension contiguous). The GPU is stood in for by its compute capability, and the kernels'
device constraint is lifted (the tensors are on the CPU). Everything else is the pack's code.
"""
import dataclasses
import logging
import sys
import types

import pytest
import torch
import torch.nn.functional as F

from bigdit.attention import Router, Unsupported, base, registry, sage
from bigdit.attention.kernels import _sdpa
from probes import snapshot

ENTRIES = ("sageattn_qk_int8_pv_fp8_cuda_sm90", "sageattn_qk_int8_pv_fp8_cuda", "sageattn_qk_int8_pv_fp16_cuda",
           "sageattn_qk_int8_pv_fp16_triton")
BUILT = ("SM80_ENABLED", "SM89_ENABLED", "SM90_ENABLED")


class FakeSage:
    """A stand-in sageattention: 2.x (its entry points, `core` with the built flags) or 1.x."""

    def __init__(self, monkeypatch, major=2, built=BUILT):
        self.calls = []
        mod, core = types.ModuleType("sageattention"), types.ModuleType("sageattention.core")
        if major == 2:
            for name in ENTRIES:
                setattr(mod, name, self._entry(name))
            mod.sageattn = self._entry("sageattn")  # 2.x's own dispatcher: the pack never calls it
            for flag in BUILT:
                setattr(core, flag, flag in built)
            mod.core = core
            monkeypatch.setitem(sys.modules, "sageattention.core", core)
        else:
            mod.sageattn = self._sage1
        monkeypatch.setitem(sys.modules, "sageattention", mod)

    def _entry(self, name):
        def fn(q, k, v, tensor_layout="HND", is_causal=False, sm_scale=None, **kwargs):
            assert q.dtype in (torch.float16, torch.bfloat16) and q.shape[-1] <= 128
            assert q.stride(-1) == 1 and k.stride(-1) == 1 and v.stride(-1) == 1, "Last dim must be contiguous."
            assert not is_causal
            self.calls.append((name, tensor_layout, sm_scale, kwargs))
            return _sdpa(q, k, v, "BHSD" if tensor_layout == "HND" else "BSHD", None, sm_scale)
        return fn

    def _sage1(self, q, k, v, tensor_layout="HND", is_causal=False, sm_scale=None, smooth_k=True):
        self.calls.append(("sageattn", tensor_layout, sm_scale, {"smooth_k": smooth_k}))
        seq = 2 if tensor_layout == "HND" else 1
        if smooth_k:
            k -= k.mean(dim=seq, keepdim=True)  # as 1.0.6 does: in place, in the caller's tensor
        return _sdpa(q, k, v, "BHSD" if tensor_layout == "HND" else "BSHD", None, sm_scale)


@pytest.fixture
def gpu(monkeypatch):
    """`gpu((9, 0))`: the kernels see a GPU of that compute capability (their tensors stay on the CPU)."""
    monkeypatch.setattr(base, "LOADED", {})  # the stand-in is imported afresh, and forgotten after
    for cls in sage.KERNELS:
        monkeypatch.setattr(cls, "constraints", dataclasses.replace(cls.constraints, devices=None))

    def set_capability(cap):
        monkeypatch.setattr(base, "capability", lambda device: cap)
        monkeypatch.setattr(sage, "capability", lambda device: cap)
    return set_capability


def qkv(b=1, h=2, s=96, d=64, dtype=torch.bfloat16, seed=0):
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(b, h, s, d, generator=g).to(dtype) for _ in range(3))


def warnings_of(caplog):
    return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]


@pytest.mark.parametrize("cap, label, entry, options", [
    ((9, 0), "sage2_sm90", "sageattn_qk_int8_pv_fp8_cuda_sm90", {"pv_accum_dtype": "fp32+fp32"}),
    ((8, 9), "sage2_fp8", "sageattn_qk_int8_pv_fp8_cuda", {"pv_accum_dtype": "fp32+fp16", "qk_quant_gran": "per_thread"}),
    ((12, 0), "sage2_fp8", "sageattn_qk_int8_pv_fp8_cuda", {"pv_accum_dtype": "fp32+fp16", "qk_quant_gran": "per_warp"}),
    ((8, 0), "sage2_fp16", "sageattn_qk_int8_pv_fp16_cuda", {"pv_accum_dtype": "fp32"}),
    ((8, 6), "sage2_fp16", "sageattn_qk_int8_pv_fp16_cuda", {"pv_accum_dtype": "fp32"}),
    ((10, 0), "sage2_triton", "sageattn_qk_int8_pv_fp16_triton", {}),
])
@pytest.mark.parametrize("layout", ["BHSD", "BSHD"])
def test_each_architecture_gets_its_kernel(monkeypatch, gpu, caplog, cap, label, entry, options, layout):
    fake = FakeSage(monkeypatch)
    gpu(cap)
    q, k, v = qkv()
    args = (q, k, v) if layout == "BHSD" else tuple(t.transpose(1, 2) for t in (q, k, v))
    with caplog.at_level(logging.WARNING):
        call = registry.create("sage").kernel_call(*args, layout=layout, scale=0.2)
        out = call.run()
    assert call.label == f"sage:{label}"
    assert fake.calls == [(entry, "HND" if layout == "BHSD" else "NHD", 0.2, options)]
    assert torch.equal(out, _sdpa(*args, layout, None, 0.2))
    assert not warnings_of(caplog)  # the kernel meant for this GPU ran: nothing to say


def test_a_kernel_missing_from_the_build_runs_the_next_and_says_so_once(monkeypatch, gpu, caplog):
    # a build for the H200 only (build-sage2.sh's default), on an RTX 4090
    fake = FakeSage(monkeypatch, built=("SM90_ENABLED",))
    gpu((8, 9))
    backend = registry.create("sage")
    q, k, v = qkv()
    with caplog.at_level(logging.WARNING):
        labels = [backend.kernel_call(q, k, v).label for _ in range(3)]
    assert labels == ["sage:sage2_triton"] * 3
    (message,) = warnings_of(caplog)
    assert message.endswith("attention: sage runs sage2_triton: sage2_fp8 is unavailable (this sageattention "
                            "build has no sm89/sm120 kernel (built without that architecture)). Said once.")
    backend(q, k, v)
    assert [c[0] for c in fake.calls] == ["sageattn_qk_int8_pv_fp16_triton"]


def test_sageattention_1_still_runs_and_leaves_the_callers_keys_alone(monkeypatch, gpu, caplog):
    fake = FakeSage(monkeypatch, major=1)
    gpu((9, 0))
    q, k, v = qkv(d=128)
    saved = k.clone()
    with caplog.at_level(logging.WARNING):
        router = Router("sage", dense_backend="sdpa")
        out = router(q, k, v)
    assert snapshot(router.stats)["calls"] == {"sage:sage1": 1}
    assert fake.calls[0][:3] == ("sageattn", "HND", None) and fake.calls[0][3] == {"smooth_k": False}
    assert torch.equal(k, saved)
    # smoothing the keys leaves attention unchanged: the result is attention of the caller's tensors
    torch.testing.assert_close(out.float(), F.scaled_dot_product_attention(q.float(), k.float(), v.float()),
                               atol=2e-2, rtol=0)
    (message,) = warnings_of(caplog)
    assert "sage runs sage1: sage2_sm90 is unavailable (sageattention 1.x is installed" in message


def test_sage1_takes_only_its_head_dims(monkeypatch, gpu):
    FakeSage(monkeypatch, major=1)
    gpu((9, 0))
    with pytest.raises(Unsupported, match=r"head dim 80 not in \[64, 96, 128\]"):
        registry.create("sage").kernel_call(*qkv(d=80))


@pytest.mark.parametrize("call, reason", [
    (dict(mask=True), "takes no attention mask"),
    (dict(d=256), "head dim 256 > 128"),
    (dict(dtype=torch.float32), "dtype torch.float32 not in"),
    (dict(cap=(7, 5)), "built for compute capability 9.0, GPU is 7.5"),
])
def test_calls_no_sage_kernel_takes_fall_back_with_one_reason(monkeypatch, gpu, caplog, call, reason):
    fake = FakeSage(monkeypatch)
    gpu(call.get("cap", (9, 0)))
    q, k, v = qkv(d=call.get("d", 64), dtype=call.get("dtype", torch.bfloat16))
    mask = torch.ones(1, 1, 1, q.shape[2], dtype=torch.bool) if call.get("mask") else None
    router = Router("sage", dense_backend="sdpa")
    with caplog.at_level(logging.WARNING):
        for _ in range(2):
            out = router(q, k, v, mask=mask)
    (message,) = warnings_of(caplog)
    assert "attention: sage cannot take this call" in message and reason in message, message
    assert fake.calls == []
    assert torch.equal(out, F.scaled_dot_product_attention(q, k, v, attn_mask=mask))


def test_head_dims_below_128_and_a_strided_head_dim_reach_the_kernel_as_it_needs(monkeypatch, gpu):
    fake = FakeSage(monkeypatch)
    gpu((9, 0))
    q, k, v = qkv(d=96)
    strided = q.transpose(-1, -2).contiguous().transpose(-1, -2)  # stride(-1) != 1
    out = registry.create("sage")(strided, k, v)
    assert fake.calls[0][0] == "sageattn_qk_int8_pv_fp8_cuda_sm90"
    assert torch.equal(out, _sdpa(q, k, v, "BHSD", None, None))


def test_sage_kernels_declare_what_they_take():
    for cls in sage.KERNELS:
        c = cls.constraints
        assert c.devices == frozenset({"cuda"}) and not c.masks and not c.grouped_kv and c.cross
        assert c.dtypes == base.HALF_DTYPES or cls is sage.Sage1
        assert cls.max_error == sage.MAX_ERROR  # approximate: auto weighs them against exact attention
    assert sage.Sage2Sm90.constraints.capabilities == {(9, 0)}
    assert sage.Sage2Fp8.constraints.capabilities == {(8, 9), (12, 0), (12, 1)}
    assert sage.Sage2Fp16.constraints.capabilities == {(8, 0), (8, 6), (8, 7)}
    assert registry.parse("SageAttention2") == registry.parse("sage2") == "sage"
