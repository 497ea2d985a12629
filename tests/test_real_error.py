"""auto's choices checked on the model's own data (quant/real_error.py), on CPU.

A one-layer bf16 file is loaded through LayerBuilder as the loaders load it, with `auto` as it chooses on an sm89+
GPU (FP8 first, then INT8 ConvRot; FP8's arithmetic emulated in fp32 on CPU, INT8 through comfy-kitchen's eager
backend). Its layer's first call is checked against the fp32 product of the file's weight.

The outlier layer is one FP8 cannot hold: 4 of its 512 input channels carry activations 1e5 times the others'
(a per-token FP8 scale then pushes the others below E4M3's normal range) and weights 1e-5 times the others', so
that the small activations still make most of the output (measured: FP8 0.13, INT8 ConvRot over 10, against 0.037
and 0.012 on Gaussian activations).
"""
import pytest
import torch
from torch import nn

from checkpoint_files import save, write_markers

from bigdit.loaders import LayerBuilder, inspect_checkpoint
from bigdit.quant import QuantConfig, QuantLinear, apply_replacements, auto, real_error
from bigdit.quant.auto import AutoSelector
from bigdit.quant.real_error import ERROR_BOUND, OutputSketch, sample_rows, watch_auto_choice
from bigdit.quant.registry import format_spec, get_method
from bigdit.quant.witness import RunWitness

FP8, INT8 = "float8_e4m3fn", "int8_convrot"
K, N = 512, 256
OUTLIERS = 4        # input channels that carry the massive activations
MASSIVE = 1e5       # their size against the others'
ROWS = 300


def weights(outliers: bool, seed=0, k=K, n=N):
    gen = torch.Generator().manual_seed(seed)
    weight = torch.randn(n, k, generator=gen) * k ** -0.5
    if outliers:
        weight[:, :OUTLIERS] /= MASSIVE
    return weight.to(torch.bfloat16), (torch.randn(n, generator=gen) * 0.02).to(torch.bfloat16)


def activations(outliers: bool, seed=1, rows=ROWS, k=K):
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(seed))
    if outliers:
        x[:, :OUTLIERS] = MASSIVE
    return x.to(torch.bfloat16)


def reference(x, weight, bias):
    return nn.functional.linear(x.float(), weight.float(), bias.float())


def rel_err(out, ref):
    return ((out.float() - ref.float()).norm() / ref.float().norm()).item()


@pytest.fixture
def sm89_auto(monkeypatch):
    """auto as it chooses on an sm89+ GPU, from its table (no timing): FP8 first, INT8 ConvRot next."""
    monkeypatch.setattr(auto, "cuda_capability", lambda device: (8, 9))
    selector = AutoSelector(torch.device("cuda"))
    selector.measure = False
    assert selector.order == (FP8, INT8)
    return selector


class Model(nn.Module):
    def __init__(self, k=K, n=N):
        super().__init__()
        self.proj = nn.Linear(k, n, device="meta")


def load(path, device="cpu", **builder_kw):
    """The file's model built layer by layer as the loaders build it (tests/test_checkpoint_loaders.py), in bf16,
    on `device`; (model, the file's map)."""
    contents = inspect_checkpoint(path)
    n, k = contents.header.tensors["proj.weight"].shape
    model, device = Model(k, n), torch.device(device)
    with contents.open() as source:
        builder = LayerBuilder(contents, source, device, **builder_kw)
        builder.resolve_methods()
        sd = contents.state_dict(source)
        built = builder.build("proj", sd["proj.weight"], k, n, sd["proj.bias"], torch.bfloat16, device)
        builder.finish()
    apply_replacements(model, {"proj": built})
    return model, source.file_map


def plain_file(tmp_path, outliers: bool, k=K, n=N):
    weight, bias = weights(outliers, k=k, n=n)
    path = tmp_path / f"plain_{outliers}_{k}x{n}.safetensors"
    save({"proj.weight": weight, "proj.bias": bias}, path)
    return path, weight, bias


def count_calls(monkeypatch, cls, name):
    calls = []
    original = getattr(cls, name)

    def counted(*args, **kwargs):
        calls.append(name)
        return original(*args, **kwargs)
    monkeypatch.setattr(cls, name, counted)
    return calls


# ---- the bound, on the layer's real weight and its first real input ----------------------------------------------

def test_auto_keeps_fp8_where_the_real_activations_are_well_behaved(tmp_path, sm89_auto, monkeypatch):
    path, weight, bias = plain_file(tmp_path, outliers=True)
    model, _ = load(path, online=QuantConfig(method=sm89_auto))
    layer = model.proj
    assert layer.method.name == FP8 and layer.real_check is not None
    applied = count_calls(monkeypatch, type(layer.method), "apply")
    x = activations(outliers=False)
    out = layer(x)
    outcome = layer.real_error
    assert outcome.format == FP8 and outcome.runs is None and outcome.tried == ()
    assert (outcome.sampled, outcome.rows) == (256, ROWS)
    error = rel_err(out, reference(x, weight, bias))
    assert error < 0.05 and outcome.error == pytest.approx(error, rel=0.15)  # FP8's own error, seen by the sketch
    # the check ran the layer's kernel once (the call's own) and then went away: later calls are the layer's
    assert applied == ["apply"] and layer.real_check is None
    assert torch.equal(layer(x), out)


def test_auto_rejects_fp8_where_the_real_activations_carry_outliers_it_cannot_hold(tmp_path, sm89_auto, monkeypatch):
    path, weight, bias = plain_file(tmp_path, outliers=True)
    model, file_map = load(path, online=QuantConfig(method=sm89_auto))
    layer = model.proj
    x = activations(outliers=True)
    ref = reference(x, weight, bias)
    fp8_alone = QuantLinear(layer.method, K, N, layer.stored_tensors(), layer.bias, torch.bfloat16)(x)
    assert rel_err(fp8_alone, ref) > 0.1  # what the layer would compute unchecked
    checked = count_calls(monkeypatch, OutputSketch, "error")
    out = layer(x)
    outcome = layer.real_error
    assert outcome.format == FP8 and outcome.error > ERROR_BOUND
    assert outcome.error == pytest.approx(rel_err(fp8_alone, ref), rel=0.15)
    # the next format in auto's order is tried first, and fails too; full precision holds
    assert [label for label, _ in outcome.tried] == [INT8, "full precision"] and outcome.runs == "full precision"
    assert outcome.tried[0][1] > ERROR_BOUND and outcome.tried[1][1] < 0.01
    assert rel_err(out, ref) < 0.01  # bf16 rounding of the product and its output
    # the fallback computes from the file's weight, in the file's map: no copy of it is held
    route = layer.real_check.route
    assert file_map.holds(route.weight) and route.weight.dtype == torch.bfloat16
    # once: later calls take the fallback without checking again; the layer's own tensors stay as they were
    checks = len(checked)
    assert torch.equal(layer(x), out) and len(checked) == checks == 3
    assert layer.method.name == FP8 and layer.weight.dtype == torch.float8_e4m3fn


def test_the_next_format_is_taken_where_it_holds(tmp_path, sm89_auto, monkeypatch):
    """With a bound between FP8's and INT8 ConvRot's errors on Gaussian data, FP8 falls back to INT8 ConvRot,
    quantized from the file's weight, which then computes exactly as a layer auto quantized to it."""
    monkeypatch.setattr(real_error, "ERROR_BOUND", 0.02)   # FP8 0.037, INT8 ConvRot 0.012 here
    path, weight, bias = plain_file(tmp_path, outliers=False)
    model, _ = load(path, online=QuantConfig(method=sm89_auto))
    x = activations(outliers=False)
    out = model.proj(x)
    outcome = model.proj.real_error
    assert outcome.runs == INT8 and [label for label, _ in outcome.tried] == [INT8]
    assert outcome.error > 0.02 > outcome.tried[0][1]
    int8_model, _ = load(path, online=QuantConfig(method=get_method(INT8)))
    assert int8_model.proj.real_check is None  # a method the user named is not auto's: not checked
    assert torch.equal(out, int8_model.proj(x))
    assert rel_err(out, reference(x, weight, bias)) < 0.02


# ---- conversions of stored INT8 layers (int8: auto) ----------------------------------------------------------------

@pytest.fixture
def int8_converted_by_auto(monkeypatch):
    """int8: auto converts stored INT8 layers to FP8, as where it measured FP8 faster on the GPU (scripted)."""
    fp8 = get_method(FP8)
    spec = format_spec("int8_tensorwise")
    monkeypatch.setattr(type(spec), "stored_decision", lambda self, layer, mode, context: layer.conversion(
        fp8 if mode == "auto" else None, "scripted: FP8 measured faster"))


def int8_file(tmp_path, outliers: bool, convrot: bool):
    path, weight, bias = plain_file(tmp_path, outliers)
    marker = {"format": "int8_tensorwise", **({"convrot": True, "convrot_groupsize": 256} if convrot else {})}
    return write_markers(path, tmp_path / f"int8_{outliers}.safetensors", {"proj": marker})


def test_int8_conversion_falls_back_to_the_stored_layer(tmp_path, int8_converted_by_auto, monkeypatch):
    monkeypatch.setattr(real_error, "ERROR_BOUND", 0.02)   # FP8 0.037 over it, the stored INT8 0.012 within
    path = int8_file(tmp_path, outliers=False, convrot=True)
    model, file_map = load(path, conversions={"int8_tensorwise": "auto"})
    layer = model.proj
    assert layer.method.name == FP8 and layer.real_check is not None
    x = activations(outliers=False)
    out = layer(x)
    outcome = layer.real_error
    assert outcome.runs == f"{INT8} as stored" and outcome.error > 0.02 > outcome.tried[0][1]
    stored, _ = load(path, conversions={"int8_tensorwise": "keep"})
    assert stored.proj.real_check is None  # loaded as stored: nothing converted, nothing checked
    assert torch.equal(out, stored.proj(x))  # the file's own layer, bit for bit
    assert file_map.holds(layer.real_check.route.weight)  # read from the file's map, not copied


def test_a_conversion_dequantizes_the_stored_weight_once(tmp_path, int8_converted_by_auto, monkeypatch):
    """The converted layer and its first-call check's reference come from one dequantization of the stored weight
    (requantized_layer hands it to the check): none is made again."""
    spec_method = type(get_method("int8_tensorwise"))
    calls, original = [], spec_method.dequantize
    monkeypatch.setattr(spec_method, "dequantize", lambda self, *a, **k: calls.append(1) or original(self, *a, **k))
    model, _ = load(int8_file(tmp_path, outliers=False, convrot=True), conversions={"int8_tensorwise": "auto"})
    assert model.proj.method.name == FP8 and model.proj.real_check is not None
    assert len(calls) == 1, calls


def test_int8_conversion_rejected_on_outliers_runs_the_stored_weight_in_full_precision(tmp_path,
                                                                                        int8_converted_by_auto):
    """Stored without the rotation, the outlier channels' tiny weights are INT8 zeros: the output is all the small
    activations' doing, which FP8's per-token scale pushes below its normal range and INT8's rounds to zero."""
    path = int8_file(tmp_path, outliers=True, convrot=False)
    model, _ = load(path, conversions={"int8_tensorwise": "auto"})
    layer = model.proj
    _, bias = weights(outliers=True)
    stored, _ = load(path)
    dequantized = stored.proj.dequantized(dtype=torch.float32)   # the reference: the weight FP8 was made from
    x = activations(outliers=True)
    out = layer(x)
    outcome = layer.real_error
    assert outcome.error > ERROR_BOUND and outcome.tried[0][0] == "int8_tensorwise as stored"
    assert outcome.tried[0][1] > ERROR_BOUND   # INT8's own activations cannot hold them either
    assert outcome.runs == "int8_tensorwise dequantized, full precision"
    assert rel_err(out, reference(x, dequantized, bias)) < 0.01


# ---- when the check runs ----------------------------------------------------------------------------------------

def test_no_check_while_compiling(tmp_path, sm89_auto):
    path, weight, bias = plain_file(tmp_path, outliers=True)
    model, _ = load(path, online=QuantConfig(method=sm89_auto))
    layer = model.proj
    x = activations(outliers=True)
    torch._dynamo.reset()
    compiled = torch.compile(layer, backend="eager")(x)
    assert layer.real_error is None and layer.real_check.route is None  # traced: no check, no fallback
    assert rel_err(compiled, reference(x, weight, bias)) > 0.1       # the layer as built
    out = layer(x)  # the first eager call checks
    assert layer.real_error.runs == "full precision" and rel_err(out, reference(x, weight, bias)) < 0.01
    torch._dynamo.reset()
    assert torch.equal(torch.compile(layer, backend="eager")(x), out)  # the fallback, traced
    torch._dynamo.reset()


def test_a_lora_written_into_the_layer_defers_the_check_and_keeps_its_weights(tmp_path, sm89_auto):
    path, weight, bias = plain_file(tmp_path, outliers=True)
    model, _ = load(path, online=QuantConfig(method=sm89_auto))
    layer = model.proj
    x = activations(outliers=True)
    delta = torch.randn(N, K, generator=torch.Generator().manual_seed(5)) * 1e-3
    layer.write_patched((weight.float() + delta).to(torch.bfloat16))
    patched = layer(x)
    assert layer.real_error is None and layer.real_check.route is None  # its output carries the LoRA: not compared
    layer.restore_unpatched()
    layer(x)
    assert layer.real_error.runs == "full precision"
    # a LoRA written in after the fallback: the layer computes with its own (patched) weights, LoRA included
    layer.write_patched((weight.float() + delta).to(torch.bfloat16))
    assert torch.equal(layer(x), patched)


def test_only_layers_auto_chose_and_whose_weight_is_in_the_map_are_checked(tmp_path, sm89_auto):
    path, weight, bias = plain_file(tmp_path, outliers=False)
    model, _ = load(path, online=QuantConfig(method=get_method(FP8)))
    assert model.proj.real_check is None
    fp8 = sm89_auto.methods[FP8]
    assert sm89_auto.fallbacks(fp8, K, N) == [sm89_auto.methods[INT8]]
    assert sm89_auto.fallbacks(sm89_auto.methods[INT8], K, N) == []
    assert sm89_auto.fallbacks(get_method(FP8), K, N) is None   # not the selector's own: a rule's or the fit's
    layer = QuantLinear(fp8, K, N, fp8.quantize_weight(weight), bias, torch.bfloat16)
    assert not watch_auto_choice(layer, "proj", sm89_auto, weight, None, bias)   # not re-readable: not held
    assert layer.real_check is None


# ---- the estimate, and the report -------------------------------------------------------------------------------

@pytest.mark.parametrize("fmt, outliers", [(FP8, False), (FP8, True), (INT8, False)])
def test_the_sketch_estimates_the_error_on_the_sampled_rows(fmt, outliers):
    weight, bias = weights(outliers)
    x = activations(outliers, rows=1000)
    method = get_method(fmt)
    out = QuantLinear(method, K, N, method.quantize_weight(weight), bias, torch.bfloat16)(x)
    rows = sample_rows(1000, torch.device("cpu"))
    assert len(rows) == 256 and len(set(rows.tolist())) == 256 and rows[0] < 4 and rows[-1] > 995
    exact = rel_err(out[rows], reference(x[rows], weight, bias))
    assert OutputSketch(weight, bias).error(x[rows], out[rows]) == pytest.approx(exact, rel=0.1)
    assert len(sample_rows(100, torch.device("cpu"))) == 100


def test_the_run_report_gives_the_checks(tmp_path, sm89_auto):
    path, _, _ = plain_file(tmp_path, outliers=True)
    model, _ = load(path, online=QuantConfig(method=sm89_auto))
    witness = RunWitness({"proj": model.proj})
    model.proj(activations(outliers=True))
    line = witness.take().render()
    outcome = model.proj.real_error
    assert line.startswith(f"ran 1/1 quantized layers; auto's formats on real input: 1 checked (bound {ERROR_BOUND:g}), "
                           f"error up to {outcome.error:.4f}; 1 fell back: proj: {FP8} {outcome.error:.4f} -> "
                           f"{INT8} ")
    assert line.endswith(f"-> full precision {outcome.tried[-1][1]:.4f}")
    model.proj(activations(outliers=True))
    assert witness.take().render() == "ran 1/1 quantized layers"   # said once


# ---- on the GPU's own FP8 kernels -------------------------------------------------------------------------------

def fp8_gpu() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 9)


H3_ROWS, H3_WIDTH = 32_700, 5120   # H3's tokens per call, its attention's width


@pytest.mark.gpu
@pytest.mark.skipif(not fp8_gpu(), reason="needs a CUDA GPU with FP8 GEMMs (sm89+)")
def test_on_the_gpu_at_the_rows_h3_runs(tmp_path):
    """auto as it chooses on this GPU (its table: FP8), the layer on the GPU, at H3's rows and width: well-behaved
    activations keep FP8 and the check adds a few ms to that one call; outliers fall back to bf16 within 0.01."""
    selector = AutoSelector(torch.device("cuda"))
    selector.measure = False
    path, weight, bias = plain_file(tmp_path, outliers=True, k=H3_WIDTH, n=H3_WIDTH)
    ref = lambda x: reference(x, weight.cuda(), bias.cuda())
    calm = activations(outliers=False, rows=H3_ROWS, k=H3_WIDTH).cuda()
    wild = activations(outliers=True, rows=H3_ROWS, k=H3_WIDTH).cuda()

    def layer():
        return load(path, device="cuda", online=QuantConfig(method=selector))[0].proj

    warm = layer()
    assert warm.method.name == FP8
    warm(calm)  # the FP8 kernels compiled, the projection drawn

    def timed(fn):
        torch.cuda.synchronize()
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record()
        out = fn()
        end.record()
        torch.cuda.synchronize()
        return out, start.elapsed_time(end)

    kept = layer()
    out, checked_ms = timed(lambda: kept(calm))
    _, plain_ms = min((timed(lambda: kept(calm)) for _ in range(3)), key=lambda r: r[1])
    assert kept.real_error.runs is None and kept.real_check is None
    assert kept.real_error.error == pytest.approx(rel_err(out, ref(calm)), rel=0.15) and kept.real_error.error < 0.05
    print(f"first call {checked_ms:.2f} ms (checked), then {plain_ms:.2f} ms")
    assert checked_ms - plain_ms < 10

    rejected = layer()
    out = rejected(wild)
    assert rejected.real_error.error > ERROR_BOUND and rejected.real_error.runs == "full precision"
    assert rel_err(out, ref(wild)) < 0.01 and rel_err(rejected(wild), ref(wild)) < 0.01


@pytest.mark.gpu
@pytest.mark.skipif(not fp8_gpu(), reason="needs a CUDA GPU with FP8 GEMMs (sm89+)")
def test_no_check_while_a_cuda_graph_captures(tmp_path):
    selector = AutoSelector(torch.device("cuda"))
    selector.measure = False
    path, weight, bias = plain_file(tmp_path, outliers=True)
    x = activations(outliers=True).cuda()
    load(path, device="cuda", online=QuantConfig(method=selector))[0].proj(x)  # kernels compiled outside the capture
    layer = load(path, device="cuda", online=QuantConfig(method=selector))[0].proj
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = layer(x)
    graph.replay()
    torch.cuda.synchronize()
    assert layer.real_error is None and layer.real_check.route is None  # captured as built
    assert rel_err(captured, reference(x, weight.cuda(), bias.cuda())) > 0.1
    assert rel_err(layer(x), reference(x, weight.cuda(), bias.cuda())) < 0.01   # the first eager call checks
