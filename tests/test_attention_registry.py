"""Backend names, declared constraints, selection and fallbacks (CPU)."""
import logging
import re

import pytest
import torch
import torch.nn.functional as F

from bigdit.attention import Constraints, Router, Unsupported, base, kernels, registry
from bigdit.attention.base import Backend, Impl
from bigdit.pack_logging import PREFIX
from probes import snapshot

WARN_LOGGER = "bigdit.attention.router"


def qkv(b=1, h=2, s=64, d=64, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(b, h, s, d, generator=g, dtype=dtype) for _ in range(3))


def fallback_warnings(caplog, name):
    return [r for r in caplog.records
            if r.levelno == logging.WARNING and r.getMessage().startswith(f"{PREFIX}attention: {name} cannot")]


@pytest.mark.parametrize("spelling, name", [
    ("sdpa", "sdpa"), ("PyTorch", "sdpa"), ("SDPA", "sdpa"),
    ("sage", "sage"), ("SageAttention", "sage"), ("sage_attn", "sage"), ("sage-attn", "sage"),
    ("fa", "flash"), ("flash_attn", "flash"), ("Flash", "flash"), ("flash-attn", "flash"),
    ("kitchen_int8", "kitchen_int8"), ("INT8", "kitchen_int8"), ("Kitchen-INT8", "kitchen_int8"),
    ("sol", "sol"), ("sol_attn", "sol"), ("Sol-Attn", "sol"), (" auto ", "auto"),
    ("fa3_fp8", "fa3_fp8"), ("FA3-FP8", "fa3_fp8"), ("flash_fp8", "fa3_fp8"),
])
def test_names_and_aliases(spelling, name):
    assert registry.parse(spelling) == name
    assert registry.create(spelling).name == name


def test_unknown_name_lists_the_valid_ones():
    with pytest.raises(ValueError) as info:
        registry.parse("xformers")
    message = str(info.value)
    assert "'xformers'" in message
    for name in registry.BACKENDS:
        assert name in message


def test_sol_is_no_dense_backend():
    with pytest.raises(ValueError) as info:
        registry.parse("sol_attn", dense=True)
    assert "sol" not in str(info.value).split("valid:")[1].split("(aliases")[0]
    with pytest.raises(ValueError):
        Router("sage", dense_backend="sol")


@pytest.mark.parametrize("name", ["flash", "fa3_fp8", "sage", "kitchen_int8"])
def test_cuda_only_backend_falls_back_on_cpu_with_one_warning(name, caplog):
    router = Router(name)
    q, k, v = qkv()
    with caplog.at_level(logging.WARNING, logger=WARN_LOGGER):
        outs = [router(q, k, v) for _ in range(3)]
    warnings = fallback_warnings(caplog, name)
    assert len(warnings) == 1, [r.getMessage() for r in caplog.records]
    assert "needs cuda, got a cpu tensor" in warnings[0].getMessage()
    assert "auto:sdpa" in warnings[0].getMessage()  # where it went: the dense backend, SDPA on CPU
    expected = F.scaled_dot_product_attention(q, k, v)
    for out in outs:
        assert torch.equal(out, expected)
    stats = snapshot(router.stats)
    assert stats["calls"] == {"auto:sdpa": 3}
    assert sum(stats["fallbacks"].values()) == 3  # every call is counted, only the first warned


@pytest.mark.kitchen_feature("sol_attn")
def test_each_distinct_reason_warns_once(caplog):
    router = Router("sol", dense_backend="sdpa", sol_min_tokens=256)
    short = qkv(s=128, d=128)
    q, _, _ = qkv(s=256, d=128)
    cross_k, cross_v = qkv(s=64, d=128)[:2]
    with caplog.at_level(logging.WARNING, logger=WARN_LOGGER):
        for _ in range(2):
            router(*short)
            router(q, cross_k, cross_v)
    messages = [r.getMessage() for r in fallback_warnings(caplog, "sol")]
    assert len(messages) == 2, messages
    assert "fewer than 256 tokens" in messages[0]
    assert "cross-attention" in messages[1]


def test_sol_without_kitchen_sol_attn_falls_back_and_says_why(caplog, monkeypatch):
    # comfy-kitchen 0.2.31 (upstream ComfyUI 0.33.0's pin) has no sol_attn; the integration
    # suite sees it for real on that host
    import comfy_kitchen
    monkeypatch.delattr(comfy_kitchen, "sol_attn", raising=False)
    router = Router("sol", dense_backend="sdpa", sol_min_tokens=0)
    q, k, v = qkv(s=256, d=128)
    with caplog.at_level(logging.WARNING, logger=WARN_LOGGER):
        out = router(q, k, v)
    (message,) = [r.getMessage() for r in fallback_warnings(caplog, "sol")]
    assert re.search(r"comfy-kitchen \S+ has no sol_attn \(a newer comfy-kitchen has it", message), message
    assert torch.equal(out, F.scaled_dot_product_attention(q, k, v))


def test_chain_is_backend_then_dense_then_sdpa(caplog):
    router = Router("sage", dense_backend="flash")
    q, k, v = qkv()
    with caplog.at_level(logging.WARNING, logger=WARN_LOGGER):
        out = router(q, k, v)
    assert len(fallback_warnings(caplog, "sage")) == 1
    assert len(fallback_warnings(caplog, "flash")) == 1
    assert snapshot(router.stats)["calls"] == {"sdpa": 1}
    assert torch.equal(out, F.scaled_dot_product_attention(q, k, v))


class _Failing(Impl):
    """Stands in for a GPU kernel that raises at run time (a Triton or CUDA
    error); CPU tests cannot make a real one fail."""

    label = "broken"
    constraints = Constraints(devices=None)

    def _run(self, q, k, v, layout, mask, scale):
        raise RuntimeError("kernel launch failed\nsecond line")


def test_kernel_failing_at_run_time_falls_back_once(caplog):
    router = Router("flash", dense_backend="sdpa")
    router.backend = Backend("flash", [_Failing()])
    q, k, v = qkv()
    with caplog.at_level(logging.WARNING, logger=WARN_LOGGER):
        outs = [router(q, k, v) for _ in range(2)]
    (warning,) = fallback_warnings(caplog, "flash")
    assert "broken failed: RuntimeError: kernel launch failed" in warning.getMessage()
    assert "second line" not in warning.getMessage()
    assert all(torch.equal(o, F.scaled_dot_product_attention(q, k, v)) for o in outs)


def test_backend_call_raises_unsupported_with_reason():
    q, k, v = qkv()
    with pytest.raises(Unsupported, match="needs cuda"):
        registry.create("sage")(q, k, v)
    # flash has four kernels; identical reasons are reported once
    with pytest.raises(Unsupported) as info:
        registry.create("flash").kernel_call(q, k, v)
    assert str(info.value) == "needs cuda, got a cpu tensor"


def test_sdpa_backend_is_sdpa_in_both_layouts():
    q, k, v = qkv(s=48)
    sdpa = registry.create("sdpa")
    expected = F.scaled_dot_product_attention(q, k, v)
    assert torch.equal(sdpa(q, k, v), expected)
    bshd = [t.transpose(1, 2) for t in (q, k, v)]
    assert torch.equal(sdpa(*bshd, layout="BSHD"), expected.transpose(1, 2))
    with pytest.raises(ValueError, match="layout"):
        sdpa(q, k, v, layout="SBHD")


@pytest.mark.parametrize("constraints, call, reason", [
    (Constraints(devices=None, head_dims=frozenset({64, 128})), dict(d=96), "head dim 96 not in [64, 128]"),
    (Constraints(devices=None, max_head_dim=128), dict(d=160), "head dim 160 > 128"),
    (Constraints(devices=None, dtypes=base.HALF_DTYPES), dict(dtype=torch.float32), "dtype torch.float32"),
    (Constraints(devices=None, masks=False), dict(mask=True), "takes no attention mask"),
    (Constraints(devices=None, cross=False), dict(sk=32), "query and key lengths differ"),
    (Constraints(), dict(), "needs cuda"),
])
def test_constraints_decline_with_reasons(constraints, call, reason):
    d, dtype = call.get("d", 64), call.get("dtype", torch.float32)
    q = torch.zeros(1, 2, 64, d, dtype=dtype)
    k = torch.zeros(1, 2, call.get("sk", 64), d, dtype=dtype)
    mask = torch.ones(64, k.shape[2], dtype=torch.bool) if call.get("mask") else None
    with pytest.raises(Unsupported, match=reason.replace("[", r"\[").replace("]", r"\]")):
        constraints.check(q, k, k, "BHSD", mask)
    ok = Constraints(devices=None)
    ok.check(q, k, k, "BHSD", mask)  # the permissive declaration accepts the same call


def test_missing_package_is_a_reason_not_an_error():
    fn, why = base.load("bigdit_no_such_module", "f", "no-such-package")
    assert fn is None and why == "no-such-package is not installed"
    fn, why = base.load("math", "sqrt", "python")
    assert why is None and fn(4.0) == 2.0


def test_auto_on_cpu_is_sdpa_unmeasured():
    q, k, v = qkv()
    backend = registry.create("auto")
    assert backend.kernel_call(q, k, v).label == "auto:sdpa"
    assert backend.take_choices() == ["1x2x64x64 float32: sdpa (not measured: one candidate)"]


def test_fa3_fwd_declares_the_dtypes_its_build_has():
    fa3 = kernels.FA3Fwd()
    config, _ = base.load("fa3_fwd_config", "CONFIG", "fa3-fwd")
    expected = ({torch.bfloat16} if config and config["build_flags"].get("FLASHATTENTION_DISABLE_FP16")
                else {torch.float16, torch.bfloat16})
    assert set(fa3.constraints.dtypes) == expected


def test_sdpa_selected_never_tries_the_dense_backend(caplog):
    router = Router("sdpa", dense_backend="flash")
    q, k, v = qkv(dtype=torch.float64)  # SDPA takes any dtype
    with caplog.at_level(logging.WARNING, logger=WARN_LOGGER):
        out = router(q, k, v)
    assert not caplog.records
    assert snapshot(router.stats) == {"calls": {"sdpa": 1}, "fallbacks": {}, "scheduled_dense": {}}
    assert torch.equal(out, F.scaled_dot_product_attention(q, k, v))
