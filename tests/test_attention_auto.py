"""`auto` on CPU: the measurement's decision, the accuracy gate, the cache, the probe and the report.

On a CPU only SDPA takes a call, so these tests give auto stand-in kernels that run on the CPU
(exact attention, or exact attention plus an error of a set relative size, standing in for an
8-bit GPU kernel), and a clock that reads each kernel's set time (a CPU cannot time a GPU
kernel). The decision, the probe, the error check against fp32 SDPA, the cache and the report
are auto's own code.
"""
import logging

import pytest
import torch
import torch.nn.functional as F

from bigdit.attention import Constraints, Router, auto, registry
from bigdit.attention.base import Impl
from bigdit.attention.kernels import Sdpa, _sdpa
from probes import snapshot

RAN = []  # labels of the stand-in kernels, in the order they ran


class Kernel(Impl):
    """Exact attention (error 0) or attention off by `error` relative L2; `ms` per call on the clock."""

    def __init__(self, label, ms, error=None, fails=False):
        self.label, self.ms, self.max_error, self.fails, self.error = label, ms, (
            None if error is None else 0.05), fails, error or 0.0
        self.constraints = Constraints(devices=None)

    def _run(self, q, k, v, layout, mask, scale):
        RAN.append(self.label)
        if self.fails:
            raise RuntimeError("illegal memory access\nmore")
        out = _sdpa(q, k, v, layout, mask, scale)
        if not self.error:
            return out
        g = torch.Generator().manual_seed(0)
        noise = torch.randn(out.shape, generator=g)
        return out + noise * (self.error * out.float().norm() / noise.norm())


def clock(fn, device, calls):
    """The set time of the kernel `fn` runs."""
    before = len(RAN)
    for _ in range(calls):
        fn()
    kernel = RAN[before] if len(RAN) > before else "sdpa"  # plain SDPA records nothing
    return {k.label: k.ms for k in KERNELS}.get(kernel, 100.0)


KERNELS = []


@pytest.fixture
def kernels(monkeypatch):
    """`kernels(*stand_ins)`: auto's candidates are SDPA (100 ms on the clock) and these."""
    monkeypatch.setattr(auto, "_DECISIONS", {})
    monkeypatch.setattr(auto, "_STORE", None)
    monkeypatch.setattr(auto, "time_ms", clock)
    RAN.clear()

    def use(*stand_ins):
        KERNELS[:] = stand_ins
        monkeypatch.setattr(registry, "dense_kernels", lambda: [Sdpa(), *stand_ins])
        return registry.create("auto")
    yield use
    KERNELS.clear()


def qkv(b=1, h=2, s=128, d=64, seed=0):
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(b, h, s, d, generator=g) for _ in range(3))


def test_the_fastest_exact_kernel_wins_and_the_report_gives_the_timings(kernels, caplog):
    backend = kernels(Kernel("fast", 20.0), Kernel("slow", 40.0))
    q, k, v = qkv()
    with caplog.at_level(logging.INFO, logger="bigdit.attention.auto"):
        call = backend.kernel_call(q, k, v)
    assert call.label == "auto:fast"
    assert torch.equal(call.run(), F.scaled_dot_product_attention(q, k, v))
    line = "1x2x128x64 float32: fast; fast 20.00 ms, slow 40.00 ms, sdpa 100.00 ms"
    assert backend.take_choices() == [line]
    assert [r.getMessage() for r in caplog.records] == [f"[BigDiT] attention auto {line}"]


def test_an_approximate_kernel_within_its_bound_wins_when_fastest(kernels):
    backend = kernels(Kernel("exact", 30.0), Kernel("int8", 20.0, error=0.03))
    call = backend.kernel_call(*qkv())
    assert call.label == "auto:int8"
    (line,) = backend.take_choices()
    assert line.startswith("1x2x128x64 float32: int8; int8 20.00 ms (err 0.030), exact 30.00 ms"), line


def test_an_approximate_kernel_past_its_bound_never_runs(kernels):
    backend = kernels(Kernel("exact", 30.0), Kernel("fp8", 10.0, error=0.08))
    q, k, v = qkv()
    RAN.clear()
    call = backend.kernel_call(q, k, v)
    assert call.label == "auto:exact"
    assert RAN.count("fp8") == 1  # once, on the probe; never timed
    (line,) = backend.take_choices()
    assert line.endswith("; not used: fp8 (error 0.080 > 0.05)"), line
    assert "fp8 10.00" not in line


def test_the_decision_is_kept_per_shape_and_shared(kernels):
    backend = kernels(Kernel("fast", 20.0), Kernel("slow", 40.0))
    q, k, v = qkv()
    backend.kernel_call(q, k, v)
    RAN.clear()
    for _ in range(3):
        assert backend.kernel_call(q, k, v).label == "auto:fast"
    assert registry.create("auto").kernel_call(q, k, v).label == "auto:fast"  # another auto: the same decision
    assert RAN == []  # nothing measured again
    backend.kernel_call(*qkv(s=256))  # another shape is measured once
    assert sorted(set(RAN)) == ["fast", "slow"]
    assert len(auto._DECISIONS) == 2


def test_a_length_in_the_same_power_of_two_runs_the_decision_unmeasured(kernels):
    """A new prompt length changes the sequence: 100 and 128 share a bucket, 129 is the next one's; a mask keeps
    the exact length (its shape follows it)."""
    backend = kernels(Kernel("fast", 20.0), Kernel("slow", 40.0))
    backend.kernel_call(*qkv(s=128))
    RAN.clear()
    assert backend.kernel_call(*qkv(s=100, seed=1)).label == "auto:fast" and RAN == []
    backend.kernel_call(*qkv(s=129))
    assert sorted(set(RAN)) == ["fast", "slow"] and len(auto._DECISIONS) == 2
    assert auto.seq_bucket(1) == 1 and auto.seq_bucket(15787) == auto.seq_bucket(15451) == 16384
    q, k, v = qkv(s=100)
    RAN.clear()
    backend.kernel_call(q, k, v, mask=torch.ones(100, 100, dtype=torch.bool))
    assert sorted(set(RAN)) == ["fast", "slow"]  # masked: measured at its own length


def test_a_kernel_failing_while_measured_is_left_out(kernels):
    backend = kernels(Kernel("broken", 5.0, fails=True), Kernel("ok", 30.0))
    call = backend.kernel_call(*qkv())
    assert call.label == "auto:ok"
    (line,) = backend.take_choices()
    assert "not used: broken (failed: RuntimeError: illegal memory access)" in line and "more" not in line


def test_a_kernel_that_declines_the_call_is_not_measured(kernels):
    masked_only = Kernel("nomask", 1.0)
    masked_only.constraints = Constraints(devices=None, masks=False)
    backend = kernels(masked_only, Kernel("ok", 30.0))
    q, k, v = qkv()
    mask = torch.ones(1, 1, 1, 128, dtype=torch.bool)
    assert backend.kernel_call(q, k, v, mask=mask).label == "auto:ok"
    assert backend.kernel_call(q, k, v).label == "auto:nomask"  # unmasked: another shape key, measured apart


@pytest.mark.parametrize("shape, mask_shape, probe_shape, probe_mask", [
    ((2, 8, 3000, 64), (2, 1, 3000, 3000), (1, 4, 1024, 64), (1, 1, 1024, 3000)),
    ((1, 3, 100, 64), (1, 1, 1, 100), (1, 3, 100, 64), (1, 1, 1, 100)),
])
def test_the_probe_is_a_slice_of_the_call(shape, mask_shape, probe_shape, probe_mask):
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(shape, generator=g) for _ in range(3))
    mask = torch.rand(mask_shape, generator=g) > 0.1
    pq, pk, pv, pm = auto.probe(q, k, v, "BHSD", mask)
    assert pq.shape == probe_shape and pm.shape == probe_mask
    assert pk.shape == (1, probe_shape[1], shape[2], 64)  # every key
    heads = torch.linspace(0, shape[1] - 1, probe_shape[1]).round().long()
    assert torch.equal(pq, q[:1, heads, :probe_shape[2]]) and torch.equal(pk, k[:1, heads])
    # each query row's attention is the call's own
    full = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)[:1, heads, :probe_shape[2]]
    torch.testing.assert_close(F.scaled_dot_product_attention(pq, pk, pv, attn_mask=pm), full)
    # the same slice in (B, S, H, D)
    bshd = auto.probe(*(t.transpose(1, 2) for t in (q, k, v)), "BSHD", mask)
    assert torch.equal(bshd[0].transpose(1, 2), pq) and torch.equal(bshd[3], pm)


def test_probe_error_is_the_kernels_error_on_the_probe():
    q, k, v = qkv(h=8, s=1500)
    assert auto.probe_error(Kernel("int8", 1.0, error=0.04), q, k, v, "BHSD", None, None, {}) == \
        pytest.approx(0.04, rel=1e-3)
    assert auto.probe_error(Sdpa(), q, k, v, "BHSD", None, None, {}) < 1e-6


def test_router_reports_the_choice_of_its_dense_auto(kernels):
    kernels(Kernel("fast", 20.0))
    router = Router("sage", dense_backend="auto")  # sage declines on CPU: the dense auto decides
    router(*qkv())
    assert snapshot(router.stats)["calls"] == {"auto:fast": 1}
    assert router.take_choices() == ["auto 1x2x128x64 float32: fast; fast 20.00 ms, sdpa 100.00 ms"]
    assert router.take_choices() == []  # taken


def test_auto_measures_under_torch_compile_and_then_traces_without_breaks(kernels):
    backend = kernels(Kernel("fast", 20.0), Kernel("slow", 40.0))
    q, k, v = qkv()

    def attention(q, k, v):
        return backend(q, k, v) * 1

    torch._dynamo.reset()
    first = torch._dynamo.explain(attention)(q, k, v)
    assert first.graph_break_count == 1  # the measurement, run eagerly
    assert [d.label for d in auto._DECISIONS.values()] == ["fast"]
    torch._dynamo.reset()
    again = torch._dynamo.explain(attention)(q, k, v)
    assert again.graph_break_count == 0, [b.reason for b in again.break_reasons]
    out = torch.compile(attention, backend="eager", fullgraph=True)(q, k, v)
    assert torch.equal(out, F.scaled_dot_product_attention(q, k, v))


class Store:
    """A store of kept decisions in a dict, as the host's (quant/tuning.py KernelEntries) keys them."""

    def __init__(self, fails=False):
        self.entries, self.fails = {}, fails

    def get(self, device, version, shape):
        if self.fails:
            raise OSError("unreadable")
        return self.entries.get((str(device), version, shape))

    def put(self, device, version, shape, value):
        self.entries[(str(device), version, shape)] = value


def new_process(monkeypatch):
    """What a later server starts with: no decision in memory."""
    monkeypatch.setattr(auto, "_DECISIONS", {})
    RAN.clear()


def test_a_kept_decision_runs_in_a_later_process_without_measuring(kernels, monkeypatch):
    store = Store()
    auto.use_store(store)
    backend = kernels(Kernel("fast", 20.0), Kernel("slow", 40.0))
    q, k, v = qkv()
    assert backend.kernel_call(q, k, v).label == "auto:fast"
    ((_, version, shape), value), = store.entries.items()
    assert value == {"label": "fast", "timings": {"fast": 20.0, "slow": 40.0, "sdpa": 100.0}}
    assert version == auto.store_version() and shape.endswith("mask none; fast,sdpa,slow"), shape
    new_process(monkeypatch)
    backend = registry.create("auto")
    call = backend.kernel_call(q, k, v)
    assert call.label == "auto:fast" and RAN == []  # nothing timed
    assert backend.take_choices() == ["1x2x128x64 float32: fast (kept from an earlier measurement); fast 20.00 ms, "
                                      "slow 40.00 ms, sdpa 100.00 ms"]
    assert torch.equal(call.run(), F.scaled_dot_product_attention(q, k, v))
    RAN.clear()
    assert registry.create("auto").kernel_call(*qkv(s=65)).label == "auto:fast" and RAN == []  # the same bucket
    new_process(monkeypatch)
    assert registry.create("auto").kernel_call(*qkv(s=120)).label == "auto:fast" and RAN == []  # kept for it too
    assert shape == "BHSD q[1, 2, 128, 64] k[1, 2, 128, 64] v[1, 2, 128, 64] float32, mask none; fast,sdpa,slow"
    backend.kernel_call(*qkv(s=256))  # another shape: measured, and kept
    assert sorted(set(RAN)) == ["fast", "slow"] and len(store.entries) == 2


def test_a_kept_approximate_kernel_runs_only_within_its_bound_on_this_call(kernels, monkeypatch):
    store = Store()
    auto.use_store(store)
    int8 = Kernel("int8", 10.0, error=0.03)
    backend = kernels(Kernel("exact", 30.0), int8)
    q, k, v = qkv()
    assert backend.kernel_call(q, k, v).label == "auto:int8"
    new_process(monkeypatch)
    assert registry.create("auto").kernel_call(q, k, v).label == "auto:int8"
    assert RAN == ["int8"]  # the probe of this call only
    new_process(monkeypatch)
    int8.error = 0.09  # this call's data puts it past its bound: everything is measured again
    backend = registry.create("auto")
    assert backend.kernel_call(q, k, v).label == "auto:exact" and "exact" in RAN
    (line,) = backend.take_choices()
    assert "kept" not in line and line.endswith("not used: int8 (error 0.090 > 0.05)"), line


def test_a_kept_decision_for_other_candidates_or_an_unreadable_store_measures(kernels, monkeypatch, caplog):
    store = Store()
    auto.use_store(store)
    backend = kernels(Kernel("fast", 20.0), Kernel("slow", 40.0))
    q, k, v = qkv()
    backend.kernel_call(q, k, v)
    new_process(monkeypatch)
    backend = kernels(Kernel("slow", 40.0), Kernel("other", 30.0))  # "fast" is gone: another key
    assert backend.kernel_call(q, k, v).label == "auto:other" and "slow" in RAN
    new_process(monkeypatch)
    auto.use_store(Store(fails=True))
    with caplog.at_level(logging.WARNING, logger="bigdit.attention.auto"):
        assert registry.create("auto").kernel_call(q, k, v).label == "auto:other"
    assert "other" in RAN and "the kept decisions could not be read (OSError: unreadable)" in caplog.text


def shipping(monkeypatch, timings: dict):
    """auto on a GPU of family sm90 (standing in for CUDA: a CPU's device has no family) whose shipped table holds
    `timings` for qkv()'s call."""
    monkeypatch.setattr(auto, "gpu_family", lambda device: "sm90")
    monkeypatch.setattr(auto, "SHIPPED", {"sm90": {"1x2x128x64 float32": timings}})


def test_a_shipped_decision_runs_on_a_first_run_without_measuring(kernels, monkeypatch):
    shipping(monkeypatch, {"fast": 20.0, "slow": 40.0, "sdpa": 100.0, "absent": 5.0})
    store = Store()
    auto.use_store(store)
    backend = kernels(Kernel("fast", 20.0), Kernel("slow", 40.0))
    q, k, v = qkv()
    call = backend.kernel_call(q, k, v)
    assert call.label == "auto:fast" and RAN == [] and not store.entries  # nothing timed, nothing kept as measured
    assert backend.take_choices() == ["1x2x128x64 float32: fast (shipped for sm90, not measured here); fast 20.00 ms, "
                                      "slow 40.00 ms, sdpa 100.00 ms"]  # "absent": not a kernel here
    assert torch.equal(call.run(), F.scaled_dot_product_attention(q, k, v))
    new_process(monkeypatch)
    assert kernels(Kernel("slow", 40.0)).kernel_call(q, k, v).label == "auto:slow" and RAN == []  # of those here


def test_a_shipped_decision_that_did_not_time_a_kernel_here_or_fails_its_bound_measures(kernels, monkeypatch):
    shipping(monkeypatch, {"fast": 20.0, "sdpa": 100.0})
    backend = kernels(Kernel("fast", 20.0), Kernel("other", 10.0))  # "other" was not timed where it shipped
    q, k, v = qkv()
    assert backend.kernel_call(q, k, v).label == "auto:other" and "fast" in RAN and "other" in RAN
    new_process(monkeypatch)
    shipping(monkeypatch, {"int8": 10.0, "exact": 30.0, "sdpa": 100.0})
    int8 = Kernel("int8", 10.0, error=0.03)
    assert kernels(Kernel("exact", 30.0), int8).kernel_call(q, k, v).label == "auto:int8" and RAN == ["int8"]  # probe
    new_process(monkeypatch)
    int8.error = 0.09  # past its bound on this call: measured
    backend = registry.create("auto")
    assert backend.kernel_call(q, k, v).label == "auto:exact" and "exact" in RAN
    assert "shipped" not in backend.take_choices()[0]


def test_the_shipped_table_reads_names_kernels_the_pack_has_and_keys_h3s_calls():
    assert auto.SHIPPED, auto.SHIPPED_FILE
    labels = {impl.label for impl in registry.create("auto").kernels}  # every kernel auto weighs
    for family, shapes in auto.SHIPPED.items():
        for shape, timings in shapes.items():
            assert set(timings) <= labels and all(ms > 0 for ms in timings.values()), (family, shape)
    dit = torch.empty(1, 56, 15787, 128, dtype=torch.bfloat16)  # H3's DiT at 864x480, and its VAE's two batches
    vae, tiles = torch.empty(1, 32, 1797, 64, dtype=torch.float16), torch.empty(14, 32, 1797, 64, dtype=torch.float16)
    keys = [auto.shipped_shape(t, t, "BHSD", None) for t in (dit, vae, tiles)]
    assert keys == ["1x56x16384x128 bfloat16", "1x32x2048x64 float16", "16x32x2048x64 float16"]
    assert all(key in auto.SHIPPED["sm90"] for key in keys)
    assert auto.shipped_shape(dit, dit, "BHSD", torch.zeros(1, 1, 15787, 15787, dtype=torch.bool)) is None
    assert auto.shipped_shape(vae, dit, "BHSD", None) == "1x32x2048x64 float16, keys 56x16384"
