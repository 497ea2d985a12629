"""A format is its module: a throwaway format, one file of its own (tests/fixtures/new_format/int16_rows.py) and
one registry line (importing it, as quant/registry.py's last line imports the pack's formats), is quantized,
saved, loaded back and reported by the pack's own code, with no other edit."""
import importlib
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from bigdit.loaders import LayerBuilder, inspect_checkpoint
from bigdit.loaders.safetensors_writer import write_safetensors
from bigdit.loaders.saving import save_contents
from bigdit.quant import QuantConfig, QuantLinear, apply_replacements, get_method, quantize_layers
from bigdit.quant import registry
from bigdit.quant.registry import available_methods, marker_format_list, online_formats

FIXTURE = Path(__file__).resolve().parent / "fixtures" / "new_format"


@pytest.fixture
def int16_rows():
    """The format registered for one test, and taken out of the registry afterwards."""
    sys.path.insert(0, str(FIXTURE))
    try:
        module = importlib.import_module("int16_rows")  # the one registry line
        yield module.NAME
    finally:
        sys.path.remove(str(FIXTURE))
        sys.modules.pop("int16_rows", None)
        registry._FORMATS.pop("int16_rows", None)


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        gen = torch.Generator().manual_seed(0)
        self.up, self.down = nn.Linear(64, 128), nn.Linear(128, 64)
        with torch.no_grad():
            for layer in (self.up, self.down):
                layer.weight.copy_(torch.randn(layer.weight.shape, generator=gen) * 0.1)

    def forward(self, x):
        return self.down(torch.relu(self.up(x)))


def rel_err(out, ref):
    return ((out.float() - ref.float()).norm() / ref.float().norm()).item()


def test_a_format_from_one_file_is_quantized_saved_loaded_and_reported(int16_rows, tmp_path):
    assert int16_rows in available_methods() and int16_rows in online_formats()
    assert int16_rows in marker_format_list()  # the loader nodes' descriptions list it

    model, x = Model(), torch.randn(5, 64, generator=torch.Generator().manual_seed(1))
    reference = model(x)
    replacements, report = quantize_layers(model, QuantConfig(method=get_method(int16_rows)))
    assert report.summary_line() == "quantized 2/2 linear layers" and report.method_counts() == {int16_rows: 2}
    apply_replacements(model, replacements)
    out = model(x)
    assert rel_err(out, reference) < 1e-3  # 16-bit rows: the error is int16's rounding

    saved = save_contents(model.named_modules())
    assert saved.markers() == {"up": {"format": int16_rows}, "down": {"format": int16_rows}}
    path = tmp_path / "int16.safetensors"
    write_safetensors(path, saved.tensors, saved.metadata("test"))

    contents = inspect_checkpoint(path)
    assert {name: layer.format for name, layer in contents.layers.items()} == {"up": int16_rows, "down": int16_rows}
    loaded = Model()
    with contents.open() as source:
        builder = LayerBuilder(contents, source, torch.device("cpu"))
        builder.resolve_methods()
        state = contents.state_dict(source)
        built = {name: builder.build(name, state[f"{name}.weight"], layer.in_features, layer.out_features,
                                     state[f"{name}.bias"], torch.float32, torch.device("cpu"))
                 for name, layer in (("up", loaded.up), ("down", loaded.down))}
        load_report = builder.finish()
    assert all(isinstance(layer, QuantLinear) and layer.method.name == int16_rows for layer in built.values())
    apply_replacements(loaded, built)
    assert torch.equal(loaded(x), out)  # the same tensors: the same bits out
    assert load_report.method_counts() == {int16_rows: 2}
    assert f"{int16_rows} x2" in load_report.brief()[0]
