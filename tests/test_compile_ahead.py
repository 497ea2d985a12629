"""Triton kernels compiled ahead on a pool (quant/compile_ahead.py), and the INT8 calls that wait for none.

The compiles here are Triton's own, for a Hopper target on this CPU (no GPU needed to compile). What cannot run
without a GPU is the JIT's warm-up itself (it asks the CUDA driver for the device): `warm` stands in for it by doing
what Triton's JIT does under an active AsyncCompileMode (hand the compile to the mode, get a FutureKernel back).
"""
import threading
import time
import types

import pytest
import torch

triton = pytest.importorskip("triton")
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402
from triton.runtime import _async_compile  # noqa: E402

from bigdit.quant import compile_ahead, int8_triton as it, tuning, witness  # noqa: E402
from bigdit.quant.low_rank import LowRank  # noqa: E402

CUDA = torch.device("cuda", 0)
pytestmark = pytest.mark.skipif(compile_ahead.AsyncCompileMode is None, reason="this Triton has no AsyncCompileMode")


@pytest.fixture(autouse=True)
def on(monkeypatch):
    """Compiling ahead as on a CUDA device with nothing captured, on a pool of its own."""
    monkeypatch.delenv(compile_ahead.ENV, raising=False)
    monkeypatch.delenv(tuning.TUNE_ENV, raising=False)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    monkeypatch.setattr(compile_ahead, "_pool", None)
    monkeypatch.setattr(compile_ahead, "_async", None)
    monkeypatch.setattr(compile_ahead, "_cold", False)
    yield
    if compile_ahead._pool is not None:
        compile_ahead._pool.shutdown(wait=True)


def activation_source(k: int) -> ASTSource:
    """The INT8 activation kernel at width `k`, as a launch specializes it."""
    return ASTSource(
        fn=it._rotate_quantize_kernel,
        signature={"x_ptr": "*bf16", "h_ptr": "*fp32", "q_ptr": "*i8", "scale_ptr": "*fp32", "M": "i32",
                   "stride_x": "i32", "stride_q": "i32", "K": "constexpr", "G": "constexpr", "HG": "constexpr",
                   "SWIGLU": "constexpr", "ROTATE": "constexpr", "ROWS": "constexpr", "WIDTH": "constexpr",
                   "W1": "constexpr", "W2": "constexpr"},
        constexprs={"K": k, "G": 256, "HG": it.KRON, "SWIGLU": False, "ROTATE": True, "ROWS": 1, "WIDTH": k,
                    "W1": 0, "W2": 0})


def warm_up(key, compile_fn, seen: list, cache: dict | None = None):
    """What Triton 3.6's JIT does while a mode is active: a kernel its cache (`cache`) holds is returned, else the
    mode compiles it and the kernel goes into the cache when its result is asked for."""
    def warm():
        if cache is not None and key in cache:
            return cache[key]
        mode = _async_compile.active_mode.get()
        seen.append(mode)
        return mode.submit(key, compile_fn, lambda kernel: cache.__setitem__(key, kernel) if cache is not None else None)
    return warm


def test_a_kernel_still_compiling_is_not_ready_and_only_its_first_check_waits(tmp_path, monkeypatch):
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    go, seen = threading.Event(), []

    def compile_fn():  # a real compile, held until the test lets it go
        go.wait(60)
        return triton.compile(activation_source(1024), target=GPUTarget("cuda", 90, 32))

    cache = {}  # the JIT's cache, as Triton 3.6 fills it: when the pending kernel's result is asked for
    warm = warm_up("activation-1024", compile_fn, seen, cache)
    start = time.perf_counter()
    assert compile_ahead.ready(warm, CUDA) is False
    first = time.perf_counter() - start
    kernel = seen[0].future_kernels["activation-1024"]
    start = time.perf_counter()
    assert compile_ahead.ready(warm, CUDA) is False  # a later call sees it pending, without waiting
    assert seen[1] is seen[0] and len(seen[0].future_kernels) == 1  # one mode: the same compile, not a second
    assert compile_ahead.WAIT_S * 0.9 <= first and time.perf_counter() - start < compile_ahead.WAIT_S / 2
    assert _async_compile.active_mode.get() is None  # the mode never reached the caller's own launches
    start = time.perf_counter()  # another kernel compiling after that: its first check does not wait either
    assert compile_ahead.ready(warm_up("activation-2048", lambda: go.wait(60) and "compiled", seen), CUDA) is False
    assert time.perf_counter() - start < compile_ahead.WAIT_S / 2
    go.set()
    compiled = kernel.future.result(timeout=120)
    compile_ahead._launchers[kernel].result(timeout=60)  # its launcher's build on the pool, after the compile
    assert compiled.asm["ptx"] and "activation-1024" not in cache
    assert compile_ahead.ready(warm, CUDA) is True and cache["activation-1024"] is compiled  # put where launches look
    assert compile_ahead.ready(warm, CUDA) is True and len(seen) == 4  # from the cache: nothing submitted again
    assert any(path.is_dir() for path in tmp_path.iterdir())  # it landed in Triton's cache, where launches find it


def test_a_kernel_triton_loads_within_the_wait_is_ready_at_once():
    seen = []
    assert compile_ahead.ready(warm_up("quick", lambda: "compiled", seen), CUDA) is True
    assert seen[0] is not None


class Launchers:
    """Triton's driver where a GPU's is not: its launcher builds held until `go`, then recorded (or failing)."""

    def __init__(self, fails: bool = False):
        self.go, self.built, self.fails = threading.Event(), [], fails
        self.active = self

    def launcher_cls(self, src, metadata):
        self.go.wait(60)
        self.built.append((src, metadata, threading.current_thread().name))
        if self.fails:
            raise RuntimeError("no C compiler")


@pytest.mark.parametrize("fails", [False, True], ids=["built", "build fails"])
def test_a_compiled_kernel_is_ready_once_its_launcher_was_built_on_the_pool(fails, monkeypatch):
    """Triton 3.6 builds each launcher with the C compiler at a kernel's first launch: the pool builds it first,
    once per kernel; a build that fails leaves it to the launch (which raises its error, as in place)."""
    driver = Launchers(fails)
    monkeypatch.setattr(compile_ahead, "driver", driver)
    compiled, seen = types.SimpleNamespace(src="source", metadata="metadata"), []
    warm = warm_up("launcher", lambda: compiled, seen)
    assert compile_ahead.ready(warm, CUDA) is False  # compiled at once, its launcher still building
    kernel = seen[0].future_kernels["launcher"]
    assert kernel.future.done() and not driver.built
    driver.go.set()
    compile_ahead._launchers[kernel].result(timeout=60)
    assert compile_ahead.ready(warm, CUDA) is True and compile_ahead.ready(warm, CUDA) is True
    assert [(src, metadata) for src, metadata, _ in driver.built] == [("source", "metadata")]  # once
    assert driver.built[0][2].startswith("bigdit-triton-compile")


def test_a_failed_compile_a_refused_warm_up_and_a_compiled_kernel_count_as_ready():
    """The launch then compiles in place, or raises the compile's error as a launch in place would."""
    def broken():
        raise RuntimeError("no such target")
    assert compile_ahead.ready(warm_up("broken", broken, []), CUDA) is True

    def refused():
        raise ValueError("a warm-up Triton refuses")
    assert compile_ahead.ready(refused, CUDA) is True
    assert compile_ahead.ready(lambda: object(), CUDA) is True


@pytest.mark.parametrize("why", ["env", "tuning", "cpu", "capturing", "old triton"])
def test_where_compiling_ahead_is_off_nothing_is_warmed(why, monkeypatch):
    device = CUDA
    if why == "env":
        monkeypatch.setenv(compile_ahead.ENV, "0")
    elif why == "tuning":
        monkeypatch.setenv(tuning.TUNE_ENV, "1")
    elif why == "cpu":
        device = torch.device("cpu")
    elif why == "capturing":
        monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    else:
        monkeypatch.setattr(compile_ahead, "AsyncCompileMode", None)
    warmed = []
    assert compile_ahead.ready(lambda: warmed.append(1), device) is True and not warmed


# -- the INT8 calls ----------------------------------------------------------------------------------------------

def launches(ran: list, names=("activation", "gemm")):
    shapes = {"activation": {"M_BUCKET": 512, "K": 1024, "G": 256, "SWIGLU": False, "ROTATE": True},
              "gemm": {"M_BUCKET": 512, "N": 2048, "K": 1024}}
    return [it.Launch(name, shapes[name], torch.device("cpu"), lambda config, warmup=False, name=name: ran.append((name, warmup)))
            for name in names]


def test_a_call_whose_kernels_compile_launches_none_and_hands_every_compile_to_the_pool(monkeypatch):
    monkeypatch.setattr(it, "_LAUNCHED", set())
    monkeypatch.setattr(it, "_CHOSEN", {})
    asked, ran = [], []
    monkeypatch.setattr(compile_ahead, "ready", lambda warm, device: asked.append(warm) or False)
    with pytest.raises(it.Compiling, match="activation at .*gemm at"):
        it.run_when_compiled(*launches(ran))
    assert len(asked) == 2 and ran == []  # both compiles submitted, neither kernel launched
    monkeypatch.setattr(compile_ahead, "ready", lambda warm, device: asked.append(warm) or True)
    it.run_when_compiled(*launches(ran), None)
    assert ran == [("activation", False), ("gemm", False)] and len(asked) == 4
    it.run_when_compiled(*launches(ran))
    assert len(asked) == 4 and len(ran) == 4  # launched once: not asked again


def test_a_launch_warms_up_with_the_config_its_run_will_take(monkeypatch):
    monkeypatch.setattr(it, "_CHOSEN", {})
    got = []
    launch = it.Launch("gemm", {"M_BUCKET": 512, "N": 2048, "K": 1024}, torch.device("cpu"),
                       lambda config, warmup=False: got.append((config, warmup)))
    launch.warm()
    launch.run()
    assert got[0][1] is True and got[1][1] is False and got[0][0] == got[1][0]


def test_an_int8_call_while_its_kernels_compile_is_kitchens_and_turns_nothing_off(monkeypatch):
    monkeypatch.setattr(it, "_failure", None)
    monkeypatch.setattr(witness, "TALLY", witness.KernelTally())

    def compiling(*args):
        raise it.Compiling("gemm at (512, 2048, 1024)")
    monkeypatch.setattr(it, "int8_linear", compiling)
    x, w = torch.randn(4, 32), torch.zeros(8, 32, dtype=torch.int8)
    out = it.linear_or_kitchen(x, w, torch.ones(8, 1), None, torch.float32, True, 16, None,
                               kitchen=lambda *args: torch.full((4, 8), 7.0))
    assert torch.equal(out, torch.full((4, 8), 7.0)) and it._failure is None and not witness.TALLY.failures


# -- on the GPU: a kernel no test compiled before, in an empty Triton cache ---------------------------------------

@pytest.fixture
def cold_int8(tmp_path, monkeypatch):
    """An empty Triton cache, the INT8 Triton path not turned off by an earlier test, and a fresh tally."""
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(it, "_failure", None)
    monkeypatch.setattr(witness, "TALLY", witness.KernelTally())


def cold_layer(k: int, n: int):
    """An INT8 ConvRot layer `k` wide (the kernels' K is a constant: no other test compiles this one)."""
    from torch import nn
    from bigdit.quant import QuantConfig, quantize_layers
    from bigdit.quant.int8_convrot import Int8ConvRotMethod
    torch.manual_seed(0)
    layer = nn.Linear(k, n, bias=False).to("cuda", torch.bfloat16)
    return layer, quantize_layers(nn.Sequential(layer), QuantConfig(method=Int8ConvRotMethod(256)))[0]["0"]


def until(counted: str, call, seconds=240):
    """`call()` again until the tally counts an INT8 call of `counted`; its last result."""
    deadline = time.monotonic() + seconds
    while True:
        out = call()
        if witness.TALLY.calls["int8", counted]:
            return out
        assert time.monotonic() < deadline, dict(witness.TALLY.calls)
        time.sleep(0.05)


def rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_on_cuda_kitchen_computes_while_the_kernels_compile_then_the_compiled_kernels_run(cold_int8, monkeypatch):
    """The first call's kernels compile on the pool while kitchen computes it; once compiled, the Triton kernels
    compute the layer, their first launch a load (no compile), with the same result as launched in place."""
    if torch.cuda.get_device_capability() < (8, 0):
        pytest.skip("the Triton kernels are the default from sm80")
    layer, q = cold_layer(4864, 1536)
    x = torch.randn(777, 4864, device="cuda", dtype=torch.bfloat16)
    first = q(x)
    assert dict(witness.TALLY.calls) == {("int8", "kitchen"): 1}, dict(witness.TALLY.calls)
    out = until("triton", lambda: q(x))
    assert witness.TALLY.first_launches["int8"] == 2 and witness.TALLY.first_launch_s["int8"] < 0.5
    monkeypatch.setenv(compile_ahead.ENV, "0")
    assert torch.equal(out, q(x))
    ref = torch.nn.functional.linear(x.double(), layer.weight.double())
    assert rel(out, ref) <= 1.1 * rel(first, ref), (rel(out, ref), rel(first, ref))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_on_cuda_a_lora_layer_compiling_runs_kitchen_and_the_branch_not_the_gemm_without_it(cold_int8):
    """With a LoRA's part beside it, a layer whose fused kernels compile runs kitchen's GEMM and the addmm (the
    Triton GEMM without the LoRA is neither launched nor compiled), then the fused kernel."""
    if torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("the fused LoRA GEMM is measured on Hopper")
    layer, q = cold_layer(3328, 1280)
    x = torch.randn(600, 3328, device="cuda", dtype=torch.bfloat16)
    part = LowRank((None, None, None), torch.randn(48, 3328, device="cuda", dtype=torch.bfloat16) * 3328 ** -0.5,
                   None, torch.randn(1280, 48, device="cuda", dtype=torch.bfloat16) * 0.01, 0.5)
    ref = (torch.nn.functional.linear(x.double(), layer.weight.double())
           + 0.5 * (x.double() @ part.down.double().T) @ part.up.double().T)
    first = q.method.apply(q, x, None, low_rank=part)
    assert dict(witness.TALLY.calls) == {("int8", "kitchen"): 1}, dict(witness.TALLY.calls)
    assert not any(key[0] == "gemm_tma" for key in it._LAUNCHED if key[2][1:] == (1280, 3328))
    out = until("triton+lora", lambda: q.method.apply(q, x, None, low_rank=part))
    assert rel(first, ref) < 5e-2 and rel(out, ref) <= 1.1 * rel(first, ref), (rel(out, ref), rel(first, ref))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_on_cuda_swiglu_is_kitchens_while_its_kernel_compiles_then_the_kernels(tmp_path, monkeypatch):
    """The one-pass SwiGLU at a width no other test launches, in a process whose cache missed a kernel before (so no
    check waits): kitchen's eager activation while it compiles (the same roundings), then the kernel."""
    from bigdit.quant import swiglu
    from bigdit.quant.kitchen_api import apply_input_act
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(swiglu, "_failed", None)
    monkeypatch.setattr(compile_ahead, "_cold", True)  # as after a first miss: its one small compile may beat the wait
    launched = []
    real = swiglu._swiglu_kernel
    monkeypatch.setattr(swiglu, "_swiglu_kernel", type("Kernel", (), {
        "warmup": staticmethod(real.warmup),
        "__getitem__": lambda self, grid: (launched.append(grid), real[grid])[1]})())
    x = torch.randn(300, 2 * 3000 + 8, device="cuda", dtype=torch.bfloat16)[:, :6000]  # rows 6008 apart
    ref = apply_input_act(x, "swiglu")
    assert torch.equal(swiglu.activated(x, "swiglu"), ref) and launched == []
    deadline = time.monotonic() + 240
    while not launched:
        assert time.monotonic() < deadline
        time.sleep(0.05)
        out = swiglu.activated(x, "swiglu")
    assert out.shape == ref.shape and torch.allclose(out.float(), ref.float(), rtol=2 ** -6, atol=1e-38)  # 2 ulps
