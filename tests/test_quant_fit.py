"""quant/fit.py: a load's Linear weights fitted into the bytes asked for (LoadH3Quantized's fit_gib), and the
loader's use of it (loaders/build.py), on the CPU with comfy-kitchen's quantizers."""
import pytest
import torch
from safetensors.torch import save_file

from bigdit.loaders import inspect_checkpoint
from bigdit.loaders.build import LayerBuilder
from bigdit.loaders.load import LoadOptions, load
from bigdit.quant import get_method
from bigdit.quant.fit import fit_layers, quantized_bytes
from bigdit.quant.layer import KEEP, QUANTIZE, Layer
from bigdit.quant.registry import fit_formats

pytest.importorskip("comfy_kitchen")

W4A8, W4A4 = fit_formats()  # W4A8 first: its activations are INT8


def fit_layer(name, in_features, out_features, method):
    """A bf16 layer decided for `method` (None: kept), as the fit meets it."""
    layer = Layer(name, in_features, out_features, torch.bfloat16)
    return layer.decided(KEEP if method is None else QUANTIZE, method, "")


def stored(method, out_features, in_features):
    weight = torch.randn(out_features, in_features, generator=torch.Generator().manual_seed(1), dtype=torch.bfloat16)
    return sum(t.numel() * t.element_size() for t in method.quantize_weight(weight).values())


@pytest.mark.parametrize("fmt", ["float8_e4m3fn", "int8_convrot", W4A8, W4A4])
def test_quantized_bytes_are_what_quantizing_stores(fmt):
    # the meta device where the format quantizes there, else two small CPU probes (W4A8's codebook is constant)
    method = get_method(fmt, group_size=64)
    for out_features, in_features in [(48, 256), (200, 512)]:
        assert quantized_bytes(method, in_features, out_features) == stored(method, out_features, in_features)


def test_fit_moves_the_largest_layers_first_until_the_weights_fit():
    int8 = get_method("int8_convrot", group_size=64)
    targets = [get_method(name, group_size=64) for name in fit_formats()]
    layers = {"big": fit_layer("big", 512, 256, int8), "mid": fit_layer("mid", 256, 256, int8),
              "small": fit_layer("small", 256, 64, int8), "kept": fit_layer("kept", 256, 64, None)}
    eight = {n: quantized_bytes(int8, l.in_features, l.out_features) for n, l in layers.items() if l.method}
    four = quantized_bytes(targets[0], 512, 256)
    total = sum(eight.values()) + layers["kept"].plain_bytes
    layers = list(layers.values())

    nothing = fit_layers(layers, total, targets)
    assert nothing.moved == {} and nothing.before == nothing.after == total and "moved" not in nothing.note()

    one = fit_layers(layers, total - (eight["big"] - four), targets)  # exactly what moving "big" saves
    assert list(one.moved) == ["big"] and one.moved["big"].name == W4A8
    assert one.after == total - eight["big"] + four <= one.budget
    assert f"moved 1 to {W4A8} (largest first)" in one.note()

    none_left = fit_layers(layers, 1, targets)  # unreachable: every quantized layer moves, the kept one stays
    assert set(none_left.moved) == {"big", "mid", "small"} and none_left.after > 1
    assert "over, in layers kept as they are or in 4-bit already" in none_left.note()


def test_fit_takes_the_next_format_where_the_first_refuses_the_shape():
    int8 = get_method("int8_convrot", group_size=16)
    targets = [get_method(name, group_size=256) for name in fit_formats()]
    width = 96  # not a multiple of 256: the 4-bit ConvRot formats at group 256 refuse it
    refusals = [t.skip_reason(width, 64) for t in targets]
    assert all(refusals), refusals
    fit = fit_layers([fit_layer("odd", width, 64, int8)], 1, targets)
    assert fit.moved == {} and fit.after == fit.before  # nothing takes it: it keeps its format


def _file(tmp_path):
    gen = torch.Generator().manual_seed(0)
    tensors = {f"blocks.{i}.{n}.weight": torch.randn(o, 256, generator=gen, dtype=torch.bfloat16)
               for i in range(2) for n, o in (("ffn", 512), ("attn", 256))}
    path = tmp_path / "m.safetensors"
    save_file(tensors, str(path))
    return str(path)


def test_the_loader_builds_the_moved_layers_in_the_fit_format(tmp_path):
    contents = inspect_checkpoint(_file(tmp_path))
    int8 = get_method("int8_convrot", group_size=256)
    from bigdit.loaders.load import online_config
    config = online_config(int8, torch.device("cpu"), contents, "")
    eight = quantized_bytes(int8, 256, 512)
    four = quantized_bytes(get_method(W4A8, group_size=256), 256, 512)
    full = 2 * eight + 2 * quantized_bytes(int8, 256, 256)
    config.fit_bytes = full - 2 * (eight - four)  # both ffn layers (the largest) must move
    config.fit_targets = tuple(get_method(name, group_size=256) for name in fit_formats())
    with contents.open() as source:
        builder = LayerBuilder(contents, source, torch.device("cpu"), online=config)
        built = {}
        for name, weight in [(k[:-len(".weight")], source(k)) for k in contents.plain_keys]:
            layer = builder.build(name, weight, weight.shape[1], weight.shape[0], None, torch.bfloat16, None)
            built[name] = layer.method.name
    assert built == {"blocks.0.ffn": W4A8, "blocks.1.ffn": W4A8, "blocks.0.attn": "int8_convrot",
                     "blocks.1.attn": "int8_convrot"}
    assert any(note.startswith("fit into ") and f"moved 2 to {W4A8}" in note for note in builder.report.notes)


@pytest.mark.parametrize("fit_gib, quantization, message", [
    (float("nan"), "int8_convrot", "fit_gib must be a finite number of GiB"),
    (-1.0, "int8_convrot", "fit_gib must be a finite number of GiB"),
    (1.0, "none", "it needs a quantization"),
])
def test_fit_gib_that_makes_no_sense_is_refused_before_loading(tmp_path, fit_gib, quantization, message):
    options = LoadOptions("LoadH3Quantized", quantization=quantization, fit_gib=fit_gib)
    with pytest.raises(ValueError, match=message):
        load(_file(tmp_path), options, torch.device("cpu"), host=None)
