"""Online FP8 (emulated on CPU: the same quantize-dequantize arithmetic as the GPU path) and `auto`."""
import pytest
import torch
from torch import nn

from bigdit.quant import QuantConfig, get_method, quantize_layers
from bigdit.quant import auto
from bigdit.quant.auto import AutoSelector, preferred_formats
from bigdit.quant.fp8 import FP8, Fp8Method, quantize_rows
from bigdit.quant.linear import quantized_layer



def auto_selector(device, *, time_ms, measure=None):
    """An AutoSelector timed by `time_ms` (a test clock); `measure` True measures on CPU too."""
    selector = AutoSelector(device)
    selector.time_ms = time_ms
    if measure is not None:
        selector.measure = measure
    return selector

def rel_err(out, ref):
    return ((out.float() - ref.float()).norm() / ref.float().norm()).item()


def quantized(k, n, method, bias=True):
    torch.manual_seed(0)
    layer = nn.Linear(k, n, bias=bias).to(torch.bfloat16)
    replacements, report = quantize_layers(nn.Sequential(layer), QuantConfig(method=method))
    return layer, replacements.get("0"), report


def test_fp8_weights_are_per_channel():
    layer, q, _ = quantized(64, 32, Fp8Method())
    assert q.weight.dtype == FP8 and q.weight_scale.shape == (32, 1)
    # Each row uses the full E4M3 range: its absmax maps to 448.
    assert torch.allclose(q.weight.float().abs().amax(dim=1), torch.full((32,), 448.0))


def test_fp8_forward_close_to_fp32():
    layer, q, report = quantized(256, 128, Fp8Method())
    x = torch.randn(40, 256, dtype=torch.bfloat16)
    ref = nn.functional.linear(x.float(), layer.weight.float(), layer.bias.float())
    out = q(x)
    # E4M3 has 3 mantissa bits: ~2-4% relative error per product, averaging down in the sum.
    assert rel_err(out, ref) < 0.05
    assert report.summary_line() == "quantized 1/1 linear layers"


def test_per_token_scales_isolate_rows():
    """A huge token must not crush the precision of the others (per-token, not per-tensor, scales)."""
    x = torch.randn(4, 64)
    x[0] *= 1e4
    q, s = quantize_rows(x)
    back = q.float() * s
    assert rel_err(back[1:], x[1:]) < 0.05


def test_fp8_static_input_scale_and_per_tensor_weight_scale():
    """The checkpoint form: a per-tensor weight scale and a static input scale."""
    layer, q, _ = quantized(64, 32, Fp8Method(), bias=False)
    w = layer.weight.float()
    wscale = w.abs().amax() / 448
    q.weight.data = (w / wscale).to(FP8)
    q.weight_scale = nn.Parameter(wscale.reshape(()), requires_grad=False)
    x = torch.randn(8, 64, dtype=torch.bfloat16)
    q.input_scale = nn.Parameter((x.float().abs().amax() / 448).reshape(()), requires_grad=False)
    ref = nn.functional.linear(x.float(), w)
    assert rel_err(q(x), ref) < 0.06


def test_fp8_swiglu_input_act():
    _, q, _ = quantized(64, 32, Fp8Method())
    x = torch.randn(5, 128, dtype=torch.bfloat16)
    gate, up = x.chunk(2, dim=-1)
    assert rel_err(q(x, input_act="swiglu"), q(nn.functional.silu(gate) * up)) < 0.02


def test_fp8_skips_shapes_cublas_cannot_take():
    assert Fp8Method().skip_reason(100, 64) is not None
    assert Fp8Method().skip_reason(128, 64) is None


def test_auto_on_cpu_uses_table_without_timing():
    clock = ScriptedClock()
    selector = auto_selector(torch.device("cpu"), time_ms=clock)
    assert preferred_formats(torch.device("cpu")) == ("int8_convrot",)
    method, why = selector.select(256, 128, torch.bfloat16)
    assert method.name == "int8_convrot" and "table" in why
    assert clock.calls == 0
    method, why = selector.select(100, 128, torch.bfloat16)  # not divisible by the group size
    assert method is None and "no native format" in why


@pytest.mark.parametrize("capability, formats", [
    ((7, 5), ("int8_convrot",)), ((8, 6), ("int8_convrot",)),
    ((8, 9), ("float8_e4m3fn", "int8_convrot")),
    ((9, 0), ("float8_e4m3fn", "int8_convrot")), ((12, 0), ("float8_e4m3fn", "int8_convrot")),
    ((7, 0), ()),
])
def test_auto_never_considers_4bit_formats(monkeypatch, capability, formats):
    monkeypatch.setattr(auto, "cuda_capability", lambda device: capability)
    assert preferred_formats(torch.device("cuda")) == formats


class ScriptedClock:
    """Runs each timed call for real, keeps its output's dtype, and answers the next scripted time
    (the plain GEMM is timed first)."""

    def __init__(self, *ms):
        self.ms, self.calls, self.dtypes = list(ms), 0, []

    def __call__(self, fn):
        self.dtypes.append(fn().dtype)
        self.calls += 1
        return self.ms.pop(0)


def test_auto_measures_once_and_keeps_bf16_where_nothing_is_faster(monkeypatch):
    monkeypatch.setattr(auto, "_MEASURED", {})
    monkeypatch.setenv("BIGDIT_AUTO_ROWS", "32")
    fast = ScriptedClock(2.0, 1.0)
    selector = auto_selector(torch.device("cpu"), measure=True, time_ms=fast)
    method, why = selector.select(256, 128, torch.bfloat16)
    assert method.name == "int8_convrot"
    assert why == "auto: int8_convrot at bfloat16 (bfloat16 2.000 ms, int8_convrot 1.000 ms)"
    assert fast.calls == 2
    # a second selector (another load) reuses the measurement
    again = auto_selector(torch.device("cpu"), measure=True, time_ms=fast)
    assert again.select(256, 128, torch.bfloat16)[0].name == "int8_convrot" and fast.calls == 2
    slow = ScriptedClock(1.0, 3.0)
    method, why = auto_selector(torch.device("cpu"), measure=True, time_ms=slow).select(512, 128, torch.bfloat16)
    assert method is None and why.startswith("auto: bfloat16 fastest at 512->128")


def test_auto_measures_in_the_dtype_the_layer_computes_in(monkeypatch):
    """ComfyUI may compute a bf16 file in fp16: each compute dtype is its own measurement, whose inputs,
    reference weight and quantized layer are all in that dtype, and whose reason names it."""
    measured = {}
    monkeypatch.setattr(auto, "_MEASURED", measured)
    monkeypatch.setenv("BIGDIT_AUTO_ROWS", "32")
    built = []

    def observed_layer(method, weight, k, n, bias, compute_dtype, device, home):
        built.append((weight.dtype, compute_dtype))
        return quantized_layer(method, weight, k, n, bias, compute_dtype, device, home)

    monkeypatch.setattr(auto, "quantized_layer", observed_layer)
    clock = ScriptedClock(2.0, 1.0, 1.0, 3.0)
    selector = auto_selector(torch.device("cpu"), measure=True, time_ms=clock)
    method, why = selector.select(256, 128, torch.float16)
    assert method.name == "int8_convrot"
    assert why == "auto: int8_convrot at float16 (float16 2.000 ms, int8_convrot 1.000 ms)"
    assert clock.dtypes == [torch.float16, torch.float16] and built == [(torch.float16, torch.float16)]
    method, why = selector.select(256, 128, torch.bfloat16)  # not the fp16 measurement again
    assert method is None and why.startswith("auto: bfloat16 fastest at 256->128 (bfloat16 1.000 ms")
    assert clock.dtypes[2:] == [torch.bfloat16, torch.bfloat16] and built[1:] == [(torch.bfloat16, torch.bfloat16)]
    assert {key[1:4] for key in measured} == {(256, 128, torch.float16), (256, 128, torch.bfloat16)}
    assert selector.select(256, 128, torch.float16)[0].name == "int8_convrot" and clock.calls == 4
    # a dtype no GEMM computes in (an FP8 storage dtype) has nothing to measure: the table answers
    method, why = selector.select(256, 128, torch.float8_e4m3fn)
    assert method.name == "int8_convrot" and why == "auto: int8_convrot (table)" and clock.calls == 4


def test_auto_through_the_dispatcher_measures_in_the_models_dtype(monkeypatch):
    monkeypatch.setattr(auto, "_MEASURED", {})
    monkeypatch.setenv("BIGDIT_AUTO_ROWS", "32")
    clock = ScriptedClock(2.0, 1.0)
    model = nn.Sequential(nn.Linear(256, 256)).to(torch.float16)
    replacements, report = quantize_layers(model, QuantConfig(method=auto_selector(torch.device("cpu"), measure=True,
                                                                                   time_ms=clock)))
    assert replacements["0"].compute_dtype == torch.float16 and clock.dtypes == [torch.float16, torch.float16]
    assert report.records[0].reason.startswith("auto: int8_convrot at float16 (float16 2.000 ms")


def test_auto_through_the_dispatcher():
    model = nn.Sequential(nn.Linear(256, 256), nn.Linear(100, 256)).to(torch.bfloat16)
    replacements, report = quantize_layers(model, QuantConfig(method=get_method("auto", device="cpu")))
    assert set(replacements) == {"0"}
    assert report.summary_line() == "quantized 1/2 linear layers"


def test_unknown_method_lists_valid_ones():
    with pytest.raises(ValueError, match="int8_convrot"):
        get_method("int3")


def test_per_prefix_rules_pick_the_method_layer_by_layer():
    """QuantConfig.rules: the first matching pattern picks a layer's method (None keeps it); others get the
    default; each quantized layer's output matches its method's accuracy against fp32."""
    torch.manual_seed(0)
    model = nn.Module()
    model.blocks = nn.ModuleList([nn.Sequential(nn.Linear(256, 256), nn.Linear(256, 256)) for _ in range(2)])
    model.head = nn.Linear(256, 64)
    model.to(torch.bfloat16)
    config = QuantConfig(method=get_method("int8_convrot"),
                         rules=[("blocks.0.*", Fp8Method()), ("head", None), ("blocks.*.1", get_method("mxfp4"))])
    replacements, report = quantize_layers(model, config)
    got = {name: layer.method.name for name, layer in replacements.items()}
    assert got == {"blocks.0.0": "float8_e4m3fn", "blocks.0.1": "float8_e4m3fn", "blocks.1.0": "int8_convrot",
                   "blocks.1.1": "mxfp4"}
    assert "  head: kept by rule" in report.render().splitlines()
    x = torch.randn(7, 256, dtype=torch.bfloat16)
    for name, layer in replacements.items():
        plain = model.get_submodule(name)
        ref = nn.functional.linear(x.float(), plain.weight.float(), plain.bias.float())
        assert rel_err(layer(x), ref) < (0.15 if got[name] == "mxfp4" else 0.06), name
