"""The per-layer decision reads the tree as it will run (overrides), the report counts only what a
pass did, and the run-time witness counts which quantized layers executed."""
import torch
from torch import nn

from bigdit.quant import QuantConfig, apply_replacements, quantize_layers
from bigdit.quant.quantize_pass import walk_modules
from bigdit.quant.int8_convrot import Int8ConvRotMethod
from bigdit.quant.linear_method import LinearMethod
from bigdit.quant.witness import RunWitness


def model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 64), nn.Sequential(nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 64))
                         ).to(torch.bfloat16)


def config(**kw):
    return QuantConfig(method=Int8ConvRotMethod(16), compute_device=torch.device("cpu"), **kw)


def test_walk_uses_an_override_and_its_children():
    m = model()
    stand_in = nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 64))
    names = {name: module for name, module in walk_modules(m, {"1": stand_in})}
    assert names["1"] is stand_in and names["1.0"] is stand_in[0] and names["1.1"] is stand_in[1]
    assert "1.2" not in names  # the replaced module's children are not part of the tree that runs
    assert [n for n, _ in walk_modules(m)] == [n for n, _ in m.named_modules()]


def test_pass_reads_the_override_not_the_live_module():
    """What a ComfyUI clone sees when another clone's quantized modules are live in the shared tree."""
    m = model()
    other_clone, _ = quantize_layers(m, config())
    originals = apply_replacements(m, other_clone)  # the live tree now holds another clone's layers
    # Read as is, every layer looks done: nothing to quantize (the defect this guards against).
    _, as_live = quantize_layers(m, config())
    assert as_live.summary_line() == "quantized 0/3 linear layers" and len(as_live.earlier) == 3
    # Read through the originals, the layers are quantized again, from the original weights.
    replacements, report = quantize_layers(m, config(overrides=originals))
    assert set(replacements) == set(originals) and report.summary_line() == "quantized 3/3 linear layers"
    x = torch.randn(3, 64, dtype=torch.bfloat16)
    for name in originals:
        assert torch.equal(replacements[name](x), other_clone[name](x)), name


def test_report_lists_earlier_layers_by_format_on_their_own_line():
    m = model()
    apply_replacements(m, quantize_layers(m, config(ignored=("1.2",)))[0])
    m[1][2].weight.data = m[1][2].weight.data.to(torch.float8_e4m3fn)  # as UNETLoader's fp8 weight_dtype leaves it
    replacements, report = quantize_layers(m, config())
    lines = report.render().splitlines()
    assert replacements == {}
    assert lines[0] == "quantized 0/3 linear layers"
    assert "already quantized, left alone: float8_e4m3fn x1, int8_convrot x2" in lines
    assert not any(line.startswith("formats:") for line in lines)


def test_witness_counts_quantlinear_runs_per_sampling():
    m = model()
    layers, _ = quantize_layers(m, config())
    apply_replacements(m, layers)
    witness = RunWitness(layers)
    x = torch.randn(2, 64, dtype=torch.bfloat16)
    m(x)
    m(x)
    count = witness.take()
    assert (count.ran, count.claimed, count.missing) == (3, 3, []) and count.render() == "ran 3/3 quantized layers"
    m[1](x)  # the next sampling runs only the inner block
    assert witness.take().missing == ["0"]
    witness.begin()
    assert witness.take().ran == 0


def test_witness_sees_a_layer_that_was_replaced_after_quantization():
    m = model()
    layers, _ = quantize_layers(m, config())
    apply_replacements(m, layers)
    apply_replacements(m, {"1.0": nn.Linear(64, 64).to(torch.bfloat16)})  # someone put a plain layer back
    witness = RunWitness(layers)
    m(torch.randn(2, 64, dtype=torch.bfloat16))
    count = witness.take()
    assert (count.ran, count.claimed, count.missing) == (2, 3, ["1.0"])


class PlainMethod(LinearMethod):
    """A method of plain torch ops, so that the whole forward compiles in one graph."""
    name = "plain"

    def quantize_weight(self, weight):
        return {"weight": weight.clone()}

    def apply(self, layer, x, input_act=None):
        return nn.functional.linear(x, layer.weight, layer.bias)


def test_counting_does_not_break_torch_compile():
    """The counter is no graph break and no guard (no recompile per call); compiled calls are not counted."""
    import torch._dynamo
    torch._dynamo.reset()
    m = model()
    layers, _ = quantize_layers(m, QuantConfig(method=PlainMethod()))
    apply_replacements(m, layers)
    witness = RunWitness(layers)
    compiled = torch.compile(m, backend="eager", fullgraph=True)
    x = torch.randn(2, 64, dtype=torch.bfloat16)
    expected = m(x)
    assert witness.take().ran == 3
    torch._dynamo.utils.counters.clear()
    for _ in range(3):
        assert torch.equal(compiled(x), expected)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 1
    assert witness.take().ran == 0
