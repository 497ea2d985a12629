"""The pack's layers, attention router and streamer under torch.compile (as ComfyUI's TorchCompileModel runs
them): no graph breaks, no recompiles per call, the eager numbers.

CPU tests run comfy-kitchen's eager backend. `aot_eager` runs the traced graph through AOT autograd without
generating code, so the compiled result must equal eager bit for bit. GPU tests compile with inductor and
fullgraph=True (any break fails them) against eager within a stated tolerance.
"""
import importlib

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from bigdit.attention import Constraints, Router, auto as attention_auto, registry
from bigdit.host.attention import install
from bigdit.attention.base import Backend, Impl
from bigdit.attention.kernels import Sdpa
from bigdit.quant import QuantConfig, apply_replacements, quantize_layers
from bigdit.hardware import cuda_capability
from bigdit.quant import compiled_ops
from bigdit.quant.registry import get_method
from offload_helpers import TracingStreamer

# every format that quantizes a bf16 layer on CPU
FORMATS = ["int8_convrot", "int8_tensorwise", "float8_e4m3fn", "quanto_qint8", "nvfp4", "mxfp8", "mxfp4"]


def mlp(fmt, device="cpu", dim=128, hidden=256):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(dim, hidden), nn.GELU(), nn.Linear(hidden, dim)).to(device, torch.bfloat16)
    options = {"group_size": 64} if fmt == "int8_convrot" else {}
    replacements, _ = quantize_layers(model, QuantConfig(method=get_method(fmt, **options)))
    apply_replacements(model, replacements)
    assert replacements  # mxfp4 keeps layers below its minimum output dim
    return model


def compile_counters():
    from torch._dynamo.utils import counters
    torch._dynamo.reset()
    counters.clear()
    return counters


@pytest.mark.parametrize("fmt", FORMATS)
def test_quantized_layers_trace_without_graph_breaks(fmt):
    model = mlp(fmt)
    x = torch.randn(2, 16, 128, dtype=torch.bfloat16)
    torch._dynamo.reset()
    explained = torch._dynamo.explain(model)(x)
    assert explained.graph_break_count == 0, [b.reason for b in explained.break_reasons]
    assert explained.graph_count == 1


@pytest.mark.parametrize("fmt", ["int8_convrot", "int8_tensorwise", "float8_e4m3fn"])
def test_compiled_quantized_layers_equal_eager(fmt):
    model = mlp(fmt)
    x = torch.randn(2, 16, 128, dtype=torch.bfloat16)
    eager = model(x)
    counters = compile_counters()
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
    for _ in range(3):
        out = compiled(x)
    assert torch.equal(out, eager)
    assert counters["stats"]["unique_graphs"] == 1  # the witness and the kernel chooser guard nothing per call


@pytest.mark.parametrize("fmt", ["int8_convrot", "float8_e4m3fn"])
def test_a_model_compiled_before_any_eager_call_compiles_once(fmt):
    # As under ComfyUI's TorchCompileModel: the first call is traced. The kernel chooser records a choice only
    # outside tracing (a dict written while tracing is a guard, and the next call compiled everything again:
    # 157 s for Wan 14B's second step on the H200).
    from bigdit.quant.int8_convrot import _chooser
    _chooser.choices.clear()
    model = mlp(fmt)
    x = torch.randn(2, 16, 128, dtype=torch.bfloat16)
    counters = compile_counters()
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
    outs = [compiled(x) for _ in range(3)]
    assert counters["stats"]["unique_graphs"] == 1 and not counters["recompiles"], dict(counters["recompiles"])
    assert all(torch.equal(out, outs[0]) for out in outs)
    assert torch.equal(outs[0], model(x))


def test_router_imports_its_kernels_before_any_call(monkeypatch):
    # an import while dynamo traces the first call is a graph break (`_import` runs eagerly)
    from bigdit.attention import base
    monkeypatch.setattr(base, "LOADED", {})
    router = Router("flash", dense_backend="sage")
    wanted = {(impl.module, impl.attr, impl.package) for impl in registry.create("flash").kernels}
    assert wanted <= set(base.LOADED), (wanted, set(base.LOADED))
    assert any(key[0] == "sageattention" for key in base.LOADED), set(base.LOADED)
    options = {}
    install(options, router)
    q, k, v = (torch.randn(1, 64, 2 * 64, dtype=torch.bfloat16) for _ in range(3))
    torch._dynamo.reset()
    explained = torch._dynamo.explain(comfy_attention)(options, q, k, v, 2)
    assert explained.graph_break_count == 0, [b.reason for b in explained.break_reasons]


@pytest.mark.parametrize("convrot,group,act", [(True, 64, None), (True, 256, "gelu_tanh"), (False, 256, "swiglu")])
@pytest.mark.parametrize("bias", [True, False])
def test_int8_linear_op_equals_kitchen_bit_for_bit(convrot, group, act, bias):
    import comfy_kitchen as ck
    method = get_method("int8_convrot", group_size=group) if convrot else get_method("int8_tensorwise")
    torch.manual_seed(1)
    weight = torch.randn(96, 256, dtype=torch.bfloat16) * 0.06
    stored = method.quantize_weight(weight)
    b = torch.randn(96, dtype=torch.bfloat16) if bias else None
    x = torch.randn(40, 512 if act == "swiglu" else 256, dtype=torch.bfloat16)
    direct = ck.int8_linear(x, stored["weight"], stored["weight_scale"], b, torch.bfloat16, convrot=convrot,
                            convrot_groupsize=group, input_act=act)
    op = torch.ops.bigdit.int8_linear(x, stored["weight"], stored["weight_scale"], b, torch.bfloat16, convrot,
                                      group, act)
    assert torch.equal(op, direct)
    # the fake the compiler plans with agrees with the real output
    torch.library.opcheck(torch.ops.bigdit.int8_linear.default,
                          (x, stored["weight"], stored["weight_scale"], b, torch.bfloat16, convrot, group, act),
                          test_utils=("test_schema", "test_faketensor"))


def comfy_attention(options, q, k, v, heads):
    """What ComfyUI's optimized_attention does with an installed override."""
    return options["optimized_attention_override"](None, q, k, v, heads=heads, transformer_options=options)


def test_router_sdpa_compiles_without_breaks_or_recompiles():
    options = {}
    router = Router("sdpa")
    install(options, router)
    q, k, v = (torch.randn(1, 16, 2 * 64) for _ in range(3))
    eager = comfy_attention(options, q, k, v, 2)
    assert router.stats.take_run()["calls"] == {"sdpa": 1}

    torch._dynamo.reset()
    explained = torch._dynamo.explain(comfy_attention)(options, q, k, v, 2)
    assert explained.graph_break_count == 0, [b.reason for b in explained.break_reasons]

    counters = compile_counters()
    compiled = torch.compile(comfy_attention, backend="aot_eager", fullgraph=True)
    for _ in range(4):
        out = compiled(options, q, k, v, 2)
    assert torch.equal(out, eager)
    # before: a stats counter mutated per call made dynamo recompile at every call
    assert counters["stats"]["unique_graphs"] == 1
    # counts are not kept under compile (the node says so), and eager counting still works after it
    assert router.stats.take_run()["calls"] == {}
    comfy_attention(options, q, k, v, 2)
    assert router.stats.take_run()["calls"] == {"sdpa": 1}


class ExtensionKernel(Impl):
    """Stands in for an optional GPU kernel on CPU: exact attention behind Python that dynamo cannot trace
    (an import, as the real kernels' lazy imports and pybind calls are)."""

    label = "extension_kernel"
    constraints = Constraints(devices=None)

    def _run(self, q, k, v, layout, mask, scale):
        importlib.import_module("math")
        qh, kh, vh = (t if layout == "BHSD" else t.transpose(1, 2) for t in (q, k, v))
        out = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask, scale=scale)
        return out if layout == "BHSD" else out.transpose(1, 2)  # a strided view, as FA and Sage return


@pytest.mark.parametrize("chosen", ["backend", "auto"])
def test_router_runs_an_untraceable_kernel_as_one_opaque_op(chosen, monkeypatch):
    options = {}
    if chosen == "backend":
        router = Router("flash", dense_backend="sdpa")
        router.backend = Backend("flash", [ExtensionKernel()])
    else:  # auto's decision between it and SDPA, measured eagerly first
        monkeypatch.setattr(attention_auto, "_DECISIONS", {})
        monkeypatch.setattr(registry, "dense_kernels", lambda: [Sdpa(), ExtensionKernel()])
        router = Router("auto")
    install(options, router)
    q, k, v = (torch.randn(1, 16, 2 * 64) for _ in range(3))
    eager = comfy_attention(options, q, k, v, 2)
    assert set(router.stats.take_run()["calls"]) <= {"flash:extension_kernel", "auto:extension_kernel", "auto:sdpa"}

    torch._dynamo.reset()
    explained = torch._dynamo.explain(comfy_attention)(options, q, k, v, 2)
    assert explained.graph_break_count == 0, [b.reason for b in explained.break_reasons]
    counters = compile_counters()
    compiled = torch.compile(comfy_attention, backend="aot_eager", fullgraph=True)
    for _ in range(3):
        out = compiled(options, q, k, v, 2)
    assert counters["stats"]["unique_graphs"] == 1
    torch.testing.assert_close(out, eager, rtol=0, atol=1e-6)
    ops = [str(node.target) for g in explained.graphs for node in g.graph.nodes if node.op == "call_function"]
    opaque = chosen == "backend" or [d.label for d in attention_auto._DECISIONS.values()] == ["extension_kernel"]
    assert any("bigdit.attention" in op for op in ops) == opaque, ops  # the kernel is one node of the graph


SIGMAS = torch.tensor([1.0, 0.75, 0.5, 0.25, 0.0])


def graph_ops(explained) -> list[str]:
    """The call_function targets of every traced graph, torch.cond's branch graphs included."""
    return [str(node.target) for g in explained.graphs for m in g.modules() if isinstance(m, torch.fx.GraphModule)
            for node in m.graph.nodes if node.op == "call_function"]


@pytest.mark.kitchen_feature("sol_attn")
@pytest.mark.parametrize("schedule", [{}, {"dense_layers": "1"}, {"dense_steps": 2},
                                      {"dense_steps": 2, "dense_layers": "0"}])
def test_router_sol_and_its_schedule_compile_as_one_graph(schedule):
    """Sol is one opaque op; its cross-attention calls fall back to the dense backend (warned while tracing, no
    break); the dense steps are a branch inside the graph, so one graph serves every step, equal to eager."""
    router = Router("sol", dense_backend="sdpa", sol_tau=2.0, sol_min_tokens=0, **schedule)
    options = {}
    install(options, router)
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 256, 2 * 128, generator=g) for _ in range(3))
    text = torch.randn(1, 64, 2 * 128, generator=g)

    def forward(options, x):  # three blocks of self- and cross-attention, as a DiT's forward
        router.begin_forward()
        for _ in range(3):
            x = comfy_attention(options, x, k, v, 2) + comfy_attention(options, x, text, text, 2)
        return x

    steps = [dict(options, sigmas=SIGMAS[s:s + 1], sample_sigmas=SIGMAS) for s in range(4)]
    eager = [forward(o, q) for o in steps]
    calls = router.stats.take_run()["calls"]
    assert calls["sol"] > 0 and calls["sdpa"] > 0

    torch._dynamo.reset()
    explained = torch._dynamo.explain(forward)(steps[0], q)
    assert explained.graph_break_count == 0, [b.reason for b in explained.break_reasons]
    ops = graph_ops(explained)
    assert any("bigdit.sol_attention" in op for op in ops), ops
    assert any("cond" in op for op in ops) == ("dense_steps" in schedule), ops

    counters = compile_counters()
    compiled = torch.compile(forward, backend="aot_eager", fullgraph=True)
    outs = [compiled(o, q) for o in steps * 2]
    assert counters["stats"]["unique_graphs"] == 1 and not counters["recompiles"]
    assert all(torch.equal(out, ref) for out, ref in zip(outs, eager * 2))


@pytest.mark.kitchen_feature("sol_attn")
@pytest.mark.parametrize("masked", [False, True])
def test_sol_op_equals_kitchen_bit_for_bit(masked):
    import comfy_kitchen as ck
    g = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(1, 256, 2, 128, generator=g) for _ in range(3))
    key_bias = torch.zeros(1, 1, 1, 256)
    key_bias[..., 200:] = float("-inf")
    key_bias = key_bias if masked else None
    sinks = [0, 4] if masked else [0, 0]  # masked keys 200-255 in sink blocks 3-4 (64 tokens each)
    direct = ck.sol_attn(q, k, v, tau=1.0, scale=None, sink_blocks=sinks, sink_q=[0, 0], key_bias=key_bias)
    args = (q, k, v, 1.0, None, sinks, [0, 0], key_bias)
    assert torch.equal(torch.ops.bigdit.sol_attention(*args), direct)
    torch.library.opcheck(torch.ops.bigdit.sol_attention.default, args, test_utils=("test_schema", "test_faketensor"))


class Blocks(nn.Module):
    def __init__(self, n=4, dim=64):
        super().__init__()
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(dim, dim), nn.GELU()) for _ in range(n))

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return x


def test_streamer_hooks_run_eagerly_and_blocks_compile():
    """The hooks (side-stream copies, parameter swaps) are torch.compiler.disable'd: one break per block,
    the blocks' compute compiled, the swapped tensors guarded by their metadata only (no recompiles)."""
    torch.manual_seed(0)
    model = Blocks().eval()
    x = torch.randn(8, 64)
    with torch.no_grad():
        eager = model(x)
        trace = []
        with TracingStreamer(model.blocks, "cpu", [1, 2, 3], trace=trace) as streamer:
            counters = compile_counters()
            compiled = torch.compile(model, backend="aot_eager")
            outs = [compiled(x) for _ in range(2)]
            graphs = counters["stats"]["unique_graphs"]
            outs += [compiled(x) for _ in range(3)]
            assert counters["stats"]["unique_graphs"] == graphs  # no recompile after the first forwards
            assert not counters["recompiles"]
            assert streamer.stats.forwards == 5 and streamer.stats.loads == 15 and streamer.stats.late == 0
    assert all(torch.equal(out, eager) for out in outs)
    assert ("swap_in", 3) in trace and ("release", 3) in trace
    assert all(p.device.type == "cpu" for p in model.parameters())


# --- GPU (run on the H200 by the lead) ---------------------------------------------------------------------
def rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


@pytest.mark.parametrize("fmt", ["int8_convrot", "float8_e4m3fn"])
@pytest.mark.parametrize("act", [None, "swiglu"])
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_fullgraph_inductor_quantized_layer_on_cuda(fmt, act):
    if fmt == "float8_e4m3fn" and torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("FP8 GEMMs need sm89+")
    torch.manual_seed(0)
    k, n = 1024, 2048
    layer = nn.Linear(k, n, device="cuda", dtype=torch.bfloat16)
    options = {"group_size": 256} if fmt == "int8_convrot" else {}
    replacements, _ = quantize_layers(nn.Sequential(layer), QuantConfig(method=get_method(fmt, **options)))
    q = replacements["0"]
    x = torch.randn(3, 700, 2 * k if act == "swiglu" else k, device="cuda", dtype=torch.bfloat16)
    eager = q(x, input_act=act)
    compile_counters()
    compiled = torch.compile(q, backend="inductor", fullgraph=True)
    out = compiled(x, input_act=act)
    assert out.shape == eager.shape and out.dtype == eager.dtype
    # the quantized GEMM is the same kernel; inductor may fuse what surrounds it (bias, casts) differently
    assert rel(out, eager) < 1e-2
    assert cuda_capability(x.device) == torch.cuda.get_device_capability()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_fullgraph_router_sdpa_on_cuda():
    options = {}
    install(options, Router("sdpa"))
    q, k, v = (torch.randn(1, 1024, 8 * 64, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    eager = comfy_attention(options, q, k, v, 8)
    compile_counters()
    out = torch.compile(comfy_attention, backend="inductor", fullgraph=True)(options, q, k, v, 8)
    assert rel(out, eager) < 1e-2


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("backend", ["flash", "sage", "kitchen_int8", "fa3_fp8", "auto"])
def test_fullgraph_router_optional_kernels_on_cuda(backend):
    """The optional kernels run as one opaque op: fullgraph=True compiles (any break fails it)."""
    options = {}
    router = Router(backend, dense_backend="sdpa")
    install(options, router)
    q, k, v = (torch.randn(1, 2048, 8 * 128, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    eager = comfy_attention(options, q, k, v, 8)
    calls = router.stats.take_run()["calls"]
    if list(calls) == ["sdpa"]:
        pytest.skip(f"{backend} does not run here (ran {calls})")
    compile_counters()
    out = torch.compile(comfy_attention, backend="inductor", fullgraph=True)(options, q, k, v, 8)
    assert rel(out, eager) < 1e-2  # the same kernel, compiled around


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("schedule", [{}, {"dense_steps": 1, "dense_layers": "1"}])
def test_fullgraph_router_sol_on_cuda(schedule):
    """Sol's CUDA kernel as one opaque op, its dense steps a branch of the graph: fullgraph=True compiles."""
    router = Router("sol", dense_backend="sdpa", sol_tau=1.0, sol_min_tokens=0, **schedule)
    options = {}
    install(options, router)
    q, k, v = (torch.randn(1, 4096, 8 * 128, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    sigmas = SIGMAS.cuda()

    def forward(options, x):
        router.begin_forward()
        return comfy_attention(options, comfy_attention(options, x, k, v, 8), k, v, 8)

    steps = [dict(options, sigmas=sigmas[s:s + 1], sample_sigmas=sigmas) for s in range(3)]
    eager = [forward(o, q) for o in steps]
    if "sol" not in router.stats.take_run()["calls"]:
        pytest.skip("comfy-kitchen's Sol kernel does not run here")
    compile_counters()
    compiled = torch.compile(forward, backend="inductor", fullgraph=True)
    for out, ref in zip([compiled(o, q) for o in steps], eager):
        assert rel(out, ref) < 1e-2  # the same kernels, compiled around


def test_bench_compiled_configs_put_comfys_torch_compile_before_the_sampler():
    import sys
    from pathlib import Path
    sys.path.insert(0, str(Path(__file__).resolve().parent / "bench"))
    import comfy_e2e
    import e2e_models
    configs = comfy_e2e.make_configs("fa3_fp8")
    for name, twin in [("pack_auto_compiled", "pack_auto"), ("comfy_fp8_fast_compiled", "comfy_fp8_fast")]:
        config = configs[name]
        assert (config.loader, config.family, config.capped) == (configs[twin].loader, configs[twin].family, True)
        graph = comfy_e2e.sampling_graph(config, e2e_models.TINY_WAN, "m.safetensors",
                                         e2e_models.TINY_WAN.length("long"), 3, 0, "p")
        assert graph["m0"] == {"class_type": "TorchCompileModel",
                               "inputs": {"backend": "inductor", "model": ["unet", 0]}}
        assert graph["timer"]["inputs"]["model"] == ["m0", 0]
        # TorchCompileModel's inputs on ComfyUI 0.3.75 and 0.33.0: model, and backend of these two
        info = {node["class_type"]: {"input": {"required": {}}} for node in graph.values()}
        info["TorchCompileModel"] = {"input": {"required": {"model": ["MODEL", {}],
                                                            "backend": [["inductor", "cudagraphs"], {}]}}}
        assert comfy_e2e.unoffered_choice(graph, info) is None
    sage = comfy_e2e.sampling_graph(configs["pack_auto_sage_compiled"], e2e_models.TINY_WAN, "m.safetensors",
                                    e2e_models.TINY_WAN.length("long"), 3, 0, "p")
    # SetAttentionBackend first, then ComfyUI's compile of the model it patched, then the sampler
    assert sage["m0"]["class_type"] == "SetAttentionBackend" and sage["m0"]["inputs"]["backend"] == "sage"
    assert sage["m1"] == {"class_type": "TorchCompileModel", "inputs": {"backend": "inductor", "model": ["m0", 0]}}
    assert sage["timer"]["inputs"]["model"] == ["m1", 0]
