"""quant.quantize_pass.adopt_stored: the layers a live model holds as its file stored them quantized (upstream
ComfyUI's comfy-kitchen layers, as SetVAEKernels finds them in MiniMax-H3's video VAE) become the pack's layers of
their own format holding the very same tensors; every other layer stays as it is, and the model is unchanged."""
import types

import pytest
import torch
from torch import nn

from bigdit.quant import QuantLinear, get_method
from bigdit.quant.layer import KEEP, LOAD
from bigdit.quant.quantize_pass import adopt_stored

HOST = types.SimpleNamespace(layer_type=QuantLinear)  # the ModelHost part adopt_stored uses


class UpstreamLinear(nn.Module):
    """Upstream's mixed-precision Linear of a marker file: a comfy-kitchen QuantizedTensor weight and a bias."""

    def __init__(self, weight, bias):
        super().__init__()
        self.in_features, self.out_features = weight.shape[1], weight.shape[0]
        self.weight, self.bias = nn.Parameter(weight, requires_grad=False), nn.Parameter(bias, requires_grad=False)


def weights(out_features, in_features, seed):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(out_features, in_features, generator=gen) * in_features ** -0.5,
            0.02 * torch.randn(out_features, generator=gen))


def int8_layer(convrot: bool, seed: int) -> UpstreamLinear:
    from comfy_kitchen.tensor import QuantizedTensor
    from comfy_kitchen.tensor.int8 import TensorWiseINT8Layout
    weight, bias = weights(128, 256, seed)
    qdata, params = TensorWiseINT8Layout.quantize(weight, is_weight=True, per_channel=True, convrot=convrot,
                                                  convrot_groupsize=256, stochastic_rounding=0)
    return UpstreamLinear(QuantizedTensor(qdata, "TensorWiseINT8Layout", params), bias)


class VAELike(nn.Module):
    def __init__(self):
        super().__init__()
        self.convrot = int8_layer(True, 0)
        self.rows = int8_layer(False, 1)
        self.plain = nn.Linear(256, 128)
        self.fp8 = nn.Linear(256, 128).to(torch.float8_e4m3fn)  # a cast weight: no scales to share
        method = get_method("int8_convrot")
        self.pack = QuantLinear(method, 256, 128, method.quantize_weight(weights(128, 256, 2)[0]), None,
                                torch.float32)
        self.conv = nn.Conv2d(4, 4, 3)


def test_stored_layers_become_the_packs_holding_their_own_tensors():
    model = VAELike()
    before = dict(model.named_modules())
    replacements, report = adopt_stored(model, {}, HOST, "test")
    assert set(replacements) == {"convrot", "rows"}
    assert dict(model.named_modules()) == before  # nothing installed
    for name, layer in replacements.items():
        source = getattr(model, name)
        stored = source.weight.state_dict("weight")
        assert {k: t.data_ptr() for k, t in layer.stored_tensors().items()} == \
            {k: t.data_ptr() for k, t in stored.items()}, name  # the same tensors: nothing copied
        assert layer.bias.data_ptr() == source.bias.data_ptr()
    assert (replacements["convrot"].method.convrot, replacements["convrot"].method.group_size) == (True, 256)
    assert replacements["rows"].method.convrot is False
    records = {r.name: (r.action, r.reason) for r in report.records}
    assert records["convrot"] == records["rows"] == (LOAD, "int8_tensorwise from the checkpoint")
    assert records["plain"] == (KEEP, "not quantized in the checkpoint")
    assert records["fp8"] == (KEEP, "stored as a plain float8_e4m3fn weight")
    assert records["pack"] == (KEEP, "the pack's layer already")
    assert records["conv"] == (KEEP, "not Linear-like (Conv2d)")


@pytest.mark.parametrize("name", ["convrot", "rows"])
def test_an_adopted_layer_computes_what_its_stored_format_means(name):
    """comfy-kitchen's own INT8 linear on the stored tensors, with the layer's stored options (the rotation or
    none): equal; against the float weight, INT8's error."""
    import comfy_kitchen
    model = VAELike()
    layer = adopt_stored(model, {}, HOST, "test")[0][name]
    source = getattr(model, name)
    qdata, scale = (source.weight.state_dict("weight")[k] for k in ("weight", "weight_scale"))
    x = torch.randn(7, 256, generator=torch.Generator().manual_seed(3))
    convrot = name == "convrot"
    expected = comfy_kitchen.int8_linear(x, qdata, scale, source.bias, x.dtype, convrot=convrot,
                                         convrot_groupsize=256)
    assert torch.equal(layer(x), expected)
    exact = nn.functional.linear(x, weights(128, 256, 0 if convrot else 1)[0], source.bias)
    assert ((layer(x) - exact).norm() / exact.norm()).item() < 0.02  # measured 0.0098 and 0.0104
