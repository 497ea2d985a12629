"""The tuning store (quant/tuning.py) and what reads it: the INT8 Triton kernels' configs (quant/int8_triton.py),
the INT8 kernel choice (quant/kernel_select.py), and the run report of which kernel ran (quant/witness.py).

A GPU's identity (quant/tuning.py `device_key`, `gpu_family`) is the one thing set by hand here: no GPU exists on
the machines these run on. The shipped configs' numerics are checked in Triton's interpreter
(tests/int8_triton_interpreted.py `shipped_configs`, run by tests/test_int8_triton.py).
"""
import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from bigdit.quant import int8_triton as it
from bigdit.quant import kernel_select, tuning, witness
from bigdit.quant.kernel_select import KernelChooser

PACK_ROOT = Path(__file__).resolve().parent.parent
H100 = "NVIDIA H100 80GB HBM3 sm90"


@pytest.fixture
def store(tmp_path, monkeypatch):
    """A store file of its own, made current for the test (the process's store is put back after it)."""
    monkeypatch.setattr(tuning, "_current", tuning.current())
    path = tmp_path / "models" / tuning.FILE_NAME
    tuning.use(str(path))
    return path


@pytest.fixture
def on_h100(monkeypatch):
    """Every device reads as an H100 to the store and the shipped table."""
    monkeypatch.setattr(tuning, "device_key", lambda device: H100)
    monkeypatch.setattr(tuning, "gpu_family", lambda device: "sm90")


def untimed(*args, **kwargs):
    raise AssertionError("timed without being asked")


# -- the store ---------------------------------------------------------------------------------------------------

def test_a_put_writes_the_store_and_a_new_reader_sees_it(store):
    assert not store.exists() and tuning.current().get(H100, "k", "v1", "s") is None
    assert tuning.current().put(H100, "k", "v1", "s", {"choice": "triton"}) is None
    data = json.loads(store.read_text())
    assert data["layout"] == tuning.LAYOUT and data["version"] == tuning.VERSION
    assert tuning.TuningStore(str(store)).get(H100, "k", "v1", "s") == {"choice": "triton"}
    assert [p.name for p in store.parent.iterdir() if p.name != store.name + ".lock"] == [store.name]  # no leftovers


@pytest.mark.parametrize("content", [b"\x00\xffgarbage", b'{"layout": "bigdit-tuning", "version": 1, "entries": [',
                                     b'{"some": "other file"}', b'{"layout": "bigdit-tuning", "version": 99, "entries": {}}',
                                     b'{"layout": "bigdit-tuning", "version": 1, "entries": {"gpu": ["not", "a", "dict"]}}',
                                     b" " * (tuning.MAX_BYTES + 1)],
                         ids=["binary", "cut-short", "foreign", "other-version", "bad-entries", "too-large"])
def test_a_corrupt_foreign_or_other_version_file_is_ignored_then_rewritten(tmp_path, content):
    path = tmp_path / tuning.FILE_NAME
    path.write_bytes(content)
    store = tuning.TuningStore(str(path))
    assert store.entries == {} and store.problem
    assert store.get(H100, "k", "v1", "s") is None
    assert store.put(H100, "k", "v1", "s", 1) is None
    assert json.loads(path.read_text())["entries"] == {H100: {"k@v1": {"s": 1}}}
    assert tuning.TuningStore(str(path)).problem is None


def test_other_gpus_and_kernel_versions_are_not_used(store):
    current = tuning.current()
    current.put("NVIDIA A100-SXM4-80GB sm80", "k", "v1", "s", "a100's")
    current.put(H100, "k", "v1", "s", "old kernel's")
    assert current.get(H100, "k", "v2", "s") is None  # the kernel changed: its old tuning is not reused
    assert current.get("NVIDIA H200 sm90", "k", "v1", "s") is None  # another GPU of the family: its own tuning
    current.put(H100, "k", "v2", "s", "new kernel's")
    entries = json.loads(store.read_text())["entries"]
    assert entries[H100] == {"k@v2": {"s": "new kernel's"}}  # the old version's entries go with the new one
    assert entries["NVIDIA A100-SXM4-80GB sm80"] == {"k@v1": {"s": "a100's"}}  # other GPUs' stay


def test_a_failed_write_leaves_the_file_as_it_was(store, monkeypatch):
    tuning.current().put(H100, "k", "v1", "a", 1)
    before = store.read_bytes()

    def full_disk(src, dst):
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(tuning.os, "replace", full_disk)
    why = tuning.current().put(H100, "k", "v1", "b", 2)
    assert why is not None and "No space left" in why
    assert store.read_bytes() == before
    assert sorted(p.name for p in store.parent.iterdir()) == sorted([store.name, store.name + ".lock"])
    assert tuning.current().get(H100, "k", "v1", "b") == 2  # the process keeps what it found


def test_concurrent_servers_keep_each_others_entries(tmp_path):
    """Three processes put 15 entries each into one store at once: the file stays whole and holds all 45."""
    path = tmp_path / tuning.FILE_NAME
    script = textwrap.dedent(f"""
        import sys, types
        pkg = types.ModuleType("bigdit"); pkg.__path__ = [{str(PACK_ROOT)!r}]; sys.modules["bigdit"] = pkg
        from bigdit.quant import tuning
        for i in range(15):
            assert tuning.TuningStore({str(path)!r}).put("gpu", "k", "v1", f"{{sys.argv[1]}}-{{i}}", i) is None
    """)
    writers = [subprocess.Popen([sys.executable, "-c", script, str(n)]) for n in range(3)]
    assert [w.wait(timeout=120) for w in writers] == [0, 0, 0]
    shapes = json.loads(path.read_text())["entries"]["gpu"]["k@v1"]
    assert set(shapes) == {f"{n}-{i}" for n in range(3) for i in range(15)}


# -- the Triton kernels' configs -----------------------------------------------------------------------------------

H3_SHAPES = {"qkv": (5376, 21504), "out": (7168, 5376), "fc1": (5376, 28672), "fc2": (14336, 5376)}


def test_the_shipped_table_is_tuned_for_these_kernels():
    """quant/int8_triton_tuned.json names the kernel version it was tuned for: a changed kernel fails here until
    its configs are tuned again (BIGDIT_INT8_TUNE=1 on each GPU family) and the table's version updated."""
    version, families = it.SHIPPED
    assert version == it.KERNEL_VERSION, "the INT8 Triton kernels changed: re-tune quant/int8_triton_tuned.json"
    assert {"sm80", "sm86", "sm89", "sm90"} <= set(families)
    for family, kernels in families.items():
        assert set(kernels) == {"activation", "gemm_tma" if family == "sm90" else "gemm"}, family
        for m in (16384, 32768, 65536):  # the template's 15,000 rows, the benchmark's 32,700, both with CFG
            for name, (k, n) in H3_SHAPES.items():
                act = {"M_BUCKET": m, "K": k, "G": 256, "SWIGLU": name == "fc2", "ROTATE": True}
                assert it.fits("activation", kernels["activation"][it.shape_text("activation", act)], act)
                gemm = "gemm_tma" if family == "sm90" else "gemm"
                shape = {"M_BUCKET": m, "N": n, "K": k}
                assert it.fits(gemm, kernels[gemm][it.shape_text(gemm, shape)], shape)


def test_the_rules_give_hopper_the_h200s_winners_and_fit_each_gpus_shared_memory():
    """At H3's shapes on sm90 the rule's GEMM is the H200's autotuned winner (tests/bench/results/
    int8-triton-dev-nvidia-h200-2026-12-04-6.log); every tile's pipeline fits the shared memory it was given."""
    winner = {"BLOCK_M": 128, "BLOCK_N": 256, "BLOCK_K": 128, "GROUP_M": 16, "num_warps": 8, "num_stages": 4}
    for k, n in H3_SHAPES.values():
        assert it.gemm_rule({"M_BUCKET": 32768, "N": n, "K": k}, True, 232448) == winner
    for smem in (65536, 101376, 166912, 232448):
        for m, n, k in [(1, 16, 16), (64, 3072, 48), (512, 256, 5120), (32768, 21504, 5376), (4096, 128, 64)]:
            shape = {"M_BUCKET": m, "N": n, "K": k}
            config = it.gemm_rule(shape, False, smem)
            assert it.fits("gemm", config, shape), (shape, config)
            pipeline = (config["BLOCK_M"] + config["BLOCK_N"]) * config["BLOCK_K"] * config["num_stages"]
            assert pipeline <= smem - it.SMEM_MARGIN, (smem, shape, config)
    for k in (16, 64, 256, 1024, 5120, 5376, 14336, 16384, 20480):
        for g in (16, 64, 256):
            for rotate in (True, False):
                if k % g == 0:
                    shape = {"M_BUCKET": 8192, "K": k, "G": g, "SWIGLU": False, "ROTATE": rotate}
                    assert it.fits("activation", it.activation_rule(shape), shape), shape


def test_a_config_comes_from_the_store_then_the_shipped_table_then_the_rule(store, on_h100, monkeypatch):
    for module, name in ((it, "time_ms"), (it, "_search")):
        monkeypatch.setattr(module, name, untimed)
    cpu = torch.device("cpu")
    shape = {"M_BUCKET": 32768, "N": 21504, "K": 5376}
    text = it.shape_text("gemm_tma", shape)
    assert it.choose_config("gemm_tma", shape, cpu, lambda config: None) == (
        it.SHIPPED[1]["sm90"]["gemm_tma"][text], "shipped")
    odd = {"M_BUCKET": 512, "N": 1024, "K": 768}
    assert it.choose_config("gemm_tma", odd, cpu)[1] == "rule"
    mine = {"BLOCK_M": 64, "BLOCK_N": 128, "BLOCK_K": 64, "GROUP_M": 8, "num_warps": 4, "num_stages": 3}
    tuning.current().put(H100, "int8_triton.gemm_tma", it.KERNEL_VERSION, text, mine)
    assert it.choose_config("gemm_tma", shape, cpu) == (mine, "store")
    tuning.current().put(H100, "int8_triton.gemm_tma", it.KERNEL_VERSION, text, {"BLOCK_M": "x"})
    assert it.choose_config("gemm_tma", shape, cpu)[1] == "shipped"  # a stored config the kernel cannot take


def test_a_search_runs_only_when_asked_and_what_it_finds_is_kept(store, on_h100, monkeypatch):
    cpu = torch.device("cpu")
    shape = {"M_BUCKET": 8192, "K": 5120, "G": 256, "SWIGLU": False, "ROTATE": True}
    launched = []
    monkeypatch.setattr(it, "time_ms", untimed)
    assert it.choose_config("activation", shape, cpu, launched.append)[1] == "rule" and launched == []
    candidates = [it.activation_rule(shape)] + [c for c in it.search_candidates("activation", shape)
                                                if c != it.activation_rule(shape)]
    fastest = candidates[-1]
    monkeypatch.setattr(it, "time_ms", lambda fn, device, calls: (fn(), 1.0 if launched[-1] == fastest else 2.0)[1])
    monkeypatch.setenv(tuning.TUNE_ENV, "1")
    assert it.choose_config("activation", shape, cpu, launched.append) == (fastest, "search")
    assert all(config in launched for config in candidates)
    monkeypatch.delenv(tuning.TUNE_ENV)
    assert tuning.TuningStore(str(store)).get(H100, "int8_triton.activation", it.KERNEL_VERSION,
                                              it.shape_text("activation", shape)) == fastest


def test_a_gemm_config_this_gpu_cannot_run_gives_way_to_the_smallest_tiles(monkeypatch, caplog):
    """A shipped or rule config over an unmeasured card's shared memory: the smallest tiles run instead, from then
    on, said once; the Triton path stays on."""
    from triton.runtime.errors import OutOfResources
    monkeypatch.setattr(it, "_CHOSEN", {})
    shape, cpu, ran = {"M_BUCKET": 4096, "N": 2048, "K": 1024}, torch.device("cpu"), []

    def launch(config):
        if config["BLOCK_N"] > 64:
            raise OutOfResources(147456, 101376, "shared memory")
        ran.append(config)
    it._run(it.Launch("gemm", shape, cpu, launch))
    it._run(it.Launch("gemm", shape, cpu, launch))
    assert ran == [it.gemm_small(shape)] * 2 and it.fits("gemm", it.gemm_small(shape), shape)
    assert sum("does not run on this GPU" in r.message for r in caplog.records) == 1
    with pytest.raises(OutOfResources):  # the smallest tiles failing too is the kernels' failure
        it._run(it.Launch("gemm", {"M_BUCKET": 4096, "N": 2048, "K": 1024 + 16}, cpu,
                          lambda config: launch({"BLOCK_N": 128})))


# -- the kernel choice ---------------------------------------------------------------------------------------------

def chooser(version="v1"):
    return KernelChooser("int8_test", force_env="BIGDIT_TEST_UNSET", known=("kitchen", "triton"), version=version)


SHAPE = (32768, 5376, 21504, torch.bfloat16, None, ("kitchen", "triton", "dequant"))


def test_the_default_kernel_runs_without_timing(store, on_h100, monkeypatch):
    monkeypatch.setattr(kernel_select, "_time_ms", untimed)
    calls = []
    candidates = {"kitchen": lambda: calls.append("kitchen"), "triton": lambda: calls.append("triton")}
    assert chooser().choose(torch.device("cuda"), SHAPE, candidates, default="triton") == "triton"
    assert chooser().choose(torch.device("cpu"), SHAPE, candidates) == "kitchen"  # no default given: the first
    assert calls == []


def test_a_kept_measurement_overrides_the_default_and_tuning_measures_once(store, on_h100, monkeypatch):
    cuda = torch.device("cuda")
    candidates = {"kitchen": lambda: None, "triton": lambda: None}
    text = "|".join(map(str, SHAPE))
    tuning.current().put(H100, "int8_test.kernel", "v1", text, {"choice": "kitchen", "ms": {}})
    monkeypatch.setattr(kernel_select, "_time_ms", untimed)
    assert chooser().choose(cuda, SHAPE, candidates, default="triton") == "kitchen"
    assert chooser("v2").choose(cuda, SHAPE, candidates, default="triton") == "triton"  # another kernel version
    timed = []
    monkeypatch.setattr(kernel_select, "_time_ms", lambda fn, iters: timed.append(fn) or (1.0 if len(timed) % 2 else 3.0))
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    monkeypatch.setenv(tuning.TUNE_ENV, "1")
    tuned = chooser("v2")
    assert tuned.choose(cuda, SHAPE, candidates, default="triton") == "kitchen" and len(timed) == 4
    assert tuned.choose(cuda, SHAPE, candidates, default="triton") == "kitchen" and len(timed) == 4  # once a shape
    kept = tuning.TuningStore(str(store)).get(H100, "int8_test.kernel", "v2", text)
    assert kept["choice"] == "kitchen" and set(kept["ms"]) == {"kitchen", "triton"}


def test_a_traced_call_runs_the_kernel_an_eager_call_would(store, on_h100):
    """Under torch.compile the choice is made while tracing as in eager mode (the store read, nothing timed),
    with no graph break: a compiled function runs the stored choice, not the first candidate."""
    tuning.current().put(H100, "int8_test.kernel", "v1", "|".join(map(str, SHAPE)), {"choice": "triton", "ms": {}})
    chosen = chooser()
    candidates = {"kitchen": lambda x: x + 1, "triton": lambda x: x * 3}

    def forward(x):
        return candidates[chosen.choose(torch.device("cuda"), SHAPE, candidates, default="kitchen")](x)

    x = torch.ones(4)
    torch._dynamo.reset()
    explained = torch._dynamo.explain(forward)(x)
    assert explained.graph_break_count == 0, explained.break_reasons
    compiled = torch.compile(forward, backend="eager", fullgraph=True)
    assert torch.equal(compiled(x), x * 3)
    assert chosen.choices == {}  # a write while tracing would be a guard


# -- which kernel ran, and failures --------------------------------------------------------------------------------

def int8_call():
    torch.manual_seed(0)
    from bigdit.quant import compiled_ops
    from bigdit.quant.int8_convrot import Int8ConvRotMethod
    method = Int8ConvRotMethod(256)
    stored = method.quantize_weight(torch.randn(64, 256, dtype=torch.bfloat16))
    x = torch.randn(5, 256, dtype=torch.bfloat16)
    args = (x, stored["weight"], stored["weight_scale"], None, torch.bfloat16, True, 256, None)
    return args, compiled_ops


def test_a_transient_failure_is_retried_and_a_lasting_one_turns_triton_off(monkeypatch):
    args, ops = int8_call()
    kitchen = ops._kitchen_int8_linear  # counts itself, as the method's fallback does
    monkeypatch.setattr(it, "_failure", None)
    monkeypatch.setattr(it, "_warned", set())
    monkeypatch.setattr(witness, "TALLY", witness.KernelTally())
    run = witness.RunWitness({})
    failures = [torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"), None,
                RuntimeError("PassManager::run failed")]
    done = []

    def kernel(*a):
        failure = failures.pop(0)
        if failure is not None:
            raise failure
        done.append(1)
        return ops._kitchen(*a)  # the result of a kernel that ran, uncounted
    monkeypatch.setattr(it, "int8_linear", kernel)
    it.linear_or_kitchen(*args, kitchen=kitchen)
    assert it._failure is None  # out of memory: tried again
    first = run.take().render_kernels()
    assert first == ("ran int8: kitchen x1 calls; int8 triton failed x1 (OutOfMemoryError: CUDA out of memory. "
                     "Tried to allocate 2.00 GiB; tried again at each call)"), first
    it.linear_or_kitchen(*args, kitchen=kitchen)
    assert done == [1] and run.take().render_kernels() == "ran int8: triton x1 calls"
    it.linear_or_kitchen(*args, kitchen=kitchen)
    it.linear_or_kitchen(*args, kitchen=kitchen)  # off: kitchen, without trying
    assert it._failure == "RuntimeError: PassManager::run failed" and failures == []
    assert run.take().render_kernels() == ("ran int8: kitchen x2 calls; int8 triton failed x1 (RuntimeError: "
                                           "PassManager::run failed; off for the rest of this process)")
    it.linear_or_kitchen(*args, kitchen=kitchen)
    later = run.take().render_kernels()  # a later run still says why kitchen ran
    assert later == ("ran int8: kitchen x1 calls; int8 triton failed (RuntimeError: PassManager::run failed; off "
                     "for the rest of this process)"), later


def test_a_run_without_counted_kernels_reports_none(monkeypatch):
    monkeypatch.setattr(witness, "TALLY", witness.KernelTally())
    assert witness.RunWitness({}).take().render_kernels() is None


def test_a_kernels_first_launch_at_each_shape_is_timed_and_reported(monkeypatch):
    """The first launch at a shape (where Triton compiles what its cache lacks) is timed on the host and the run
    report says how long those launches took; later launches at the shape are not counted again."""
    monkeypatch.setattr(it, "_CHOSEN", {})
    monkeypatch.setattr(it, "_LAUNCHED", set())
    monkeypatch.setattr(witness, "TALLY", witness.KernelTally())
    ticks = iter([10.0, 12.5, 20.0, 20.25])  # two first launches: 2.5 s and 0.25 s
    monkeypatch.setattr(witness, "perf_counter", lambda: next(ticks))
    run, cpu = witness.RunWitness({}), torch.device("cpu")
    first, second = ({"M_BUCKET": 4096, "N": 2048, "K": k} for k in (1024, 2048))
    for shape in (first, first, second, first, second):
        it._run(it.Launch("gemm", shape, cpu, lambda config: witness.count_kernel(it.TALLY, "triton")))
    text = run.take().render_kernels()
    assert text == "ran int8: triton x5 calls (first launches at 2 shapes: 2.8 s, compiling what Triton's cache " \
                   "lacked)", text
    it._run(it.Launch("gemm", first, cpu, lambda config: witness.count_kernel(it.TALLY, "triton")))
    assert run.take().render_kernels() == "ran int8: triton x1 calls"  # no first launch in this run
    assert next(ticks, None) is None  # exactly the two first launches were timed


def test_kernel_entries_keep_a_devices_values_in_the_file_and_nothing_for_a_cpu(store, monkeypatch):
    """The view attention's auto is handed: keyed by a torch device, written to the store's file, read back by a
    later process; a device without a key (a CPU) keeps nothing."""
    monkeypatch.setattr(tuning, "device_key", lambda device: H100 if torch.device(device).type == "cuda" else None)
    entries = tuning.KernelEntries("attention.auto")
    entries.put(torch.device("cuda", 0), "v1", "BHSD q[1, 2, 3, 4]", {"label": "sdpa_cudnn", "timings": {}})
    entries.put(torch.device("cpu"), "v1", "BHSD q[1, 2, 3, 4]", {"label": "sdpa"})
    tuning.use(str(store))  # a later process reads the file
    assert entries.get(torch.device("cuda", 0), "v1", "BHSD q[1, 2, 3, 4]") == {"label": "sdpa_cudnn", "timings": {}}
    assert entries.get(torch.device("cpu"), "v1", "BHSD q[1, 2, 3, 4]") is None
    assert entries.get(torch.device("cuda", 0), "v2", "BHSD q[1, 2, 3, 4]") is None  # another version
    assert list(json.loads(store.read_text())["entries"]) == [H100]
