"""A 4-bit layer where comfy-kitchen's CUDA ConvRot kernel refuses its rotation group (quant/kitchen_layout.py
`on_kitchen`): kitchen 0.2.31's weight rotation takes groups of 256 only and raises for any other ("convrot rotate
kernel only supports group_size 256", upstream's pinned kitchen on an H100); the layer's quantization and
dequantization then run on kitchen's eager backend, a torch rotation by the group's Hadamard matrix on the same
device, learned from the first refusal (a feature, not a version).

On a CPU the refusing kernel is a stand-in for kitchen's CUDA backend, registered with kitchen's own registry first in
its priority: for a rotation group other than 256 it raises kitchen's own refusal, for 256 it hands the call to the
eager backend. Against kitchen's eager reference (the layout's own quantize and dequantize under
`use_backend("eager")`), the stored bytes and the dequantized weight are equal exactly; the refusal is met once per
layout and group; any other error is raised, nothing learned. Runs on the kitchen of each venv (0.40's and upstream's
0.2.31)."""
import re
import types
from pathlib import Path

import pytest
import torch

from bigdit.quant import get_method, kitchen_layout
from bigdit.quant.kitchen_api import refuses_rotation_group
from bigdit.quant.linear import quantized_layer

comfy_kitchen = pytest.importorskip("comfy_kitchen")
from comfy_kitchen.constraints import FunctionConstraints  # noqa: E402
from comfy_kitchen.registry import registry  # noqa: E402

CPU = torch.device("cpu")
OPERATIONS = ("quantize_w4a8_int8_weight", "dequantize_w4a8_int8_weight")
REFUSAL = "convrot rotate kernel only supports group_size 256"   # kitchen 0.2.31's, verbatim


def test_the_refusal_is_told_by_kitchens_own_messages():
    library = sorted((Path(comfy_kitchen.__file__).parent / "backends" / "cuda").glob("_C*"))
    messages = {m.decode() for path in library for m in re.findall(rb"convrot \w+ kernel only supports group_size[^\x00]*",
                                                                    path.read_bytes())}
    if library:  # this kitchen's CUDA library: each of its group refusals is told as one
        assert REFUSAL in messages, messages
        assert all(refuses_rotation_group(RuntimeError(m)) for m in messages), messages
    assert refuses_rotation_group(RuntimeError(REFUSAL))
    assert not refuses_rotation_group(RuntimeError("CUDA error: out of memory"))
    assert not refuses_rotation_group(RuntimeError("INT4 ConvRot quantization requires K divisible by group_size"))
    assert not refuses_rotation_group(ValueError(REFUSAL))


@pytest.fixture
def cuda_kernel(monkeypatch):
    """The stand-in for kitchen's CUDA backend (see the module's docstring); yields the list of its calls
    (operation, rotation group) and `error`, what it raises for another group (kitchen's refusal by default)."""
    calls, state = [], {"error": RuntimeError(REFUSAL)}

    def kernel(name):
        def run(**kwargs):
            calls.append((name, kwargs["convrot_groupsize"]))
            if kwargs["convrot_groupsize"] != 256:
                raise state["error"]
            return registry.get_implementation(name, backend="eager")(**kwargs)
        return run

    previous = list(registry._priority)
    registry.register("refusing_cuda", types.SimpleNamespace(**{name: kernel(name) for name in OPERATIONS}),
                      {name: FunctionConstraints() for name in OPERATIONS})
    registry.enable("refusing_cuda")  # disabled by the test before
    registry.set_priority(["refusing_cuda", *previous])
    monkeypatch.setattr(kitchen_layout, "_REFUSED_GROUPS", set())
    try:
        yield types.SimpleNamespace(calls=calls, state=state)
    finally:
        registry.set_priority(previous)
        registry.disable("refusing_cuda")


def eager_reference(method, weight):
    with comfy_kitchen.use_backend("eager"):
        qdata, params = method.layout_class().quantize(weight, group_size=method.group_size,
                                                       convrot_groupsize=method.convrot_groupsize)
        return qdata, params, method.layout_class().dequantize(qdata, params)


def as_bytes(t):
    return t.contiguous().view(torch.uint8)


@pytest.mark.parametrize("group", [16, 64, 256])
def test_w4a8_where_kitchens_cuda_kernel_refuses_the_group_is_kitchens_eager_reference(cuda_kernel, group):
    gen = torch.Generator().manual_seed(0)
    weights = [(torch.randn(96, 512, generator=gen) * 512 ** -0.5).to(torch.bfloat16) for _ in range(2)]
    method = get_method("asym_w4a8_int8", group_size=group)
    assert method.rotation_group() == group
    layers = [quantized_layer(method, w, 512, 96, None, torch.bfloat16, CPU, CPU) for w in weights]
    for layer, weight in zip(layers, weights):
        qdata, params, dequantized = eager_reference(method, weight)
        stored = layer.stored_tensors()
        expected = {"weight": qdata, "weight_s_rel": params.scale, "weight_s_channel": params.s_channel,
                    "weight_codebook": params.codebook, "weight_correction": params.correction}
        expected = {role: t for role, t in expected.items() if t is not None}
        assert stored.keys() == expected.keys()
        assert all(torch.equal(as_bytes(stored[k]), as_bytes(expected[k])) for k in stored), group
        mine = method.dequantize(layer)
        assert torch.equal(mine, dequantized), group
        error = ((mine.float() - weight.float()).norm() / weight.float().norm()).item()
        assert error < 0.15, error  # 4-bit weights: 0.1 measured
    refused = group != 256
    # refused: met once, at the first layer's quantization; everything after runs eager at once
    assert cuda_kernel.calls == ([("quantize_w4a8_int8_weight", group)] if refused else
                                 [("quantize_w4a8_int8_weight", 256)] * 2 + [("dequantize_w4a8_int8_weight", 256)] * 2)
    assert kitchen_layout._REFUSED_GROUPS == ({("AsymW4A8Int8Layout", group)} if refused else set())


def test_another_kernel_error_is_raised_and_nothing_is_learned(cuda_kernel):
    cuda_kernel.state["error"] = RuntimeError("CUDA error: an illegal memory access was encountered")
    method = get_method("asym_w4a8_int8", group_size=64)
    with pytest.raises(RuntimeError, match="illegal memory access"):
        method.quantize_weight(torch.randn(32, 128))
    assert kitchen_layout._REFUSED_GROUPS == set()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("group", [16, 64, 256])
def test_w4a8_quantizes_and_runs_on_cuda_for_every_rotation_group(group):
    """On the GPU's kitchen (0.2.31 refuses groups other than 256 in its CUDA rotation, 0.2.40 may not): a W4A8
    layer of each rotation group quantizes, dequantizes near its weight and runs near the bf16 layer; where kitchen's
    kernel refused, the layer is kitchen's eager reference on the same GPU, bit for bit."""
    device = torch.device("cuda")
    gen = torch.Generator().manual_seed(0)
    weight = (torch.randn(256, 1024, generator=gen) * 1024 ** -0.5).to(device, torch.bfloat16)
    x = torch.randn(64, 1024, generator=gen).to(device, torch.bfloat16)
    method = get_method("asym_w4a8_int8", group_size=group)
    layer = quantized_layer(method, weight, 1024, 256, None, torch.bfloat16, device, device)
    dequantized = method.dequantize(layer).float()
    assert ((dequantized - weight.float()).norm() / weight.float().norm()).item() < 0.15, group
    reference = torch.nn.functional.linear(x.float(), weight.float())
    out = layer(x).float()
    assert ((out - reference).norm() / reference.norm()).item() < 0.15, group
    if ("AsymW4A8Int8Layout", group) in kitchen_layout._REFUSED_GROUPS:
        qdata, params, eager = eager_reference(method, weight)
        assert torch.equal(as_bytes(layer.stored_tensors()["weight"]), as_bytes(qdata)) and torch.equal(
            method.dequantize(layer), eager), group
