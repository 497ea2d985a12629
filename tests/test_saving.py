"""Saving a quantized model (loaders/saving.py + the streaming writer), read back by the pack's loaders, on CPU.

A Wan-shaped model gets one format per layer (INT8 ConvRot, INT8 tensorwise,
FP8, NVFP4, MXFP8, two plain layers), in both representations a model can hold
them: QuantLinear modules, and ComfyUI's own Linear with a comfy-kitchen
QuantizedTensor weight (what upstream ComfyUI loads marker files into). The saved file goes
through inspect_checkpoint and LayerBuilder, the code MixedCheckpointLoader
runs; the same tensors loaded must give bit-identical layer outputs.
"""
import json
import tomllib

import pytest
import torch
from safetensors import safe_open
from torch import nn

from test_checkpoint_loaders import LINEARS, WanShaped, build, layer_input, plain_state_dict

from bigdit.host.layers import ComfyQuantLinear
from bigdit.loaders import inspect_checkpoint
from bigdit.loaders.saving import SaveError, pack_version, save_contents
from bigdit.loaders.safetensors_writer import write_safetensors
from bigdit.quant import QuantConfig, QuantLinear, apply_replacements, get_method, quantize_layers

METHODS = {
    "blocks.0.self_attn.q": ("int8_convrot", {"group_size": 64}),
    "blocks.0.self_attn.o": ("int8_tensorwise", {}),
    "blocks.0.cross_attn.k": ("float8_e4m3fn", {}),
    "blocks.0.ffn.0": ("nvfp4", {}),
    "blocks.0.ffn.2": ("mxfp8", {}),
}
MARKERS = {
    "blocks.0.self_attn.q": {"format": "int8_tensorwise", "convrot": True, "convrot_groupsize": 64},
    "blocks.0.self_attn.o": {"format": "int8_tensorwise"},
    "blocks.0.cross_attn.k": {"format": "float8_e4m3fn"},
    "blocks.0.ffn.0": {"format": "nvfp4"},
    "blocks.0.ffn.2": {"format": "mxfp8"},
}
PLAIN = ("time_projection.1", "head.head")


def quantized_model(methods=METHODS):
    """WanShaped with fp32 weights, each layer of `methods` quantized into a QuantLinear, the rest plain."""
    model = WanShaped()
    model.load_state_dict({k: v.float() for k, v in plain_state_dict().items() if k.rsplit(".", 1)[0] in LINEARS})
    model.register_buffer("freqs", torch.arange(4.0))                      # persistent: saved
    model.register_buffer("scratch", torch.zeros(3), persistent=False)     # not in state_dict: not saved
    rules = [(name, get_method(fmt, **kw)) for name, (fmt, kw) in methods.items()]
    config = QuantConfig(method=get_method("int8_convrot", group_size=64), rules=rules,
                         ignored=PLAIN, compute_device=torch.device("cpu"))
    replacements, _ = quantize_layers(model, config, layer_type=ComfyQuantLinear)
    apply_replacements(model, replacements)
    return model


def kitchen_model(model):
    """The same layers as upstream ComfyUI's own Linear holds them after loading a marker file natively:
    a QuantizedTensor weight."""
    from comfy_kitchen.tensor import QuantizedTensor, TensorCoreFP8Layout
    from comfy_kitchen.tensor.int8 import TensorWiseINT8Layout
    replacements = {}
    for name, module in model.named_modules():
        if not isinstance(module, QuantLinear):
            continue
        tensors = module.stored_tensors()
        method = module.method
        if method.name.startswith("int8"):
            params = TensorWiseINT8Layout.Params(
                scale=tensors["weight_scale"], orig_dtype=module.compute_dtype, orig_shape=tuple(tensors["weight"].shape),
                is_weight=True, convrot=method.convrot, convrot_groupsize=method.group_size)
            weight = QuantizedTensor(tensors["weight"], "TensorWiseINT8Layout", params)
        elif method.name == "float8_e4m3fn":
            params = TensorCoreFP8Layout.Params(scale=tensors["weight_scale"], orig_dtype=module.compute_dtype,
                                                orig_shape=tuple(tensors["weight"].shape))
            weight = QuantizedTensor(tensors["weight"], "TensorCoreFP8Layout", params)
        else:
            weight = method.kitchen_tensor(tensors, module)
        linear = nn.Linear(module.in_features, module.out_features)
        linear.weight = nn.Parameter(weight, requires_grad=False)
        linear.bias = module.bias
        replacements[name] = linear
    apply_replacements(model, replacements)
    return model


def save(model, path):
    contents = save_contents(model.named_modules())
    write_safetensors(path, contents.tensors, contents.metadata("test"))
    return contents


def test_saved_file_loads_back_bit_identical(tmp_path):
    model = quantized_model()
    path = tmp_path / "saved.safetensors"
    contents = save(model, path)
    assert contents.markers() == MARKERS
    # The contents holds the model's own tensors (the writer reads them one by one): no copy of the model.
    own = {t.data_ptr() for t in model.state_dict(keep_vars=True).values()}
    assert all(t.data_ptr() in own for key, t in contents.tensors if not key.endswith(".comfy_quant"))
    loaded, report, checkpoint = build(path, layer_type=ComfyQuantLinear)
    assert checkpoint.kind == "ComfyUI per-layer markers"
    assert {name: layer.format for name, layer in checkpoint.layers.items()} == \
        {name: marker["format"] for name, marker in MARKERS.items()}
    for name in LINEARS:
        x = layer_input(name)
        ours, theirs = model.get_submodule(name), loaded.get_submodule(name)
        assert type(ours) is type(theirs), name
        if isinstance(ours, QuantLinear):
            assert ours.method.describe() == theirs.method.describe(), name
            assert ours.stored_tensors().keys() == theirs.stored_tensors().keys(), name
        assert torch.equal(ours(x), theirs(x)), name  # the same tensors: the same bits out


def test_markers_in_both_forms_and_metadata(tmp_path):
    path = tmp_path / "saved.safetensors"
    save(quantized_model(), path)
    with safe_open(str(path), "pt") as f:
        meta = f.metadata()
        for name, marker in MARKERS.items():
            assert json.loads(f.get_tensor(f"{name}.comfy_quant").numpy().tobytes()) == marker
        keys = set(f.keys())
    assert json.loads(meta["_quantization_metadata"]) == {"format_version": "1.0", "layers": MARKERS}
    assert meta["bigdit_version"] == pack_version() and meta["bigdit_saved_by"] == "test"
    assert json.loads(meta["bigdit_formats"]) == {
        "float8_e4m3fn": 1, "int8_tensorwise": 1, "int8_tensorwise (convrot, group 64)": 1, "mxfp8": 1, "nvfp4": 1}
    assert json.loads(meta["bigdit_plain_dtypes"]) == {"F32": 5}  # 2 plain Linears x (weight, bias) + freqs
    # Every state_dict key of the plain model is there (quantized layers under the same .weight/.bias),
    # plus each format's companions; the non-persistent buffer is not.
    assert set(WanShaped().state_dict()) | {"freqs"} <= keys
    assert "scratch" not in keys
    assert {k for k in keys if k.endswith(("weight_scale", "weight_scale_2"))} == {
        *(f"{n}.weight_scale" for n in MARKERS), "blocks.0.ffn.0.weight_scale_2"}


FOUR_BIT = {"convrot_w4a4": ({"group_size": 64}, {"format": "convrot_w4a4", "convrot_groupsize": 64}),
            "asym_w4a8_int8": ({"group_size": 64}, {"format": "asym_w4a8_int8", "group_size": 16,
                                                    "convrot_groupsize": 64})}


@pytest.mark.parametrize("fmt", list(FOUR_BIT))
def test_4bit_layers_save_upstreams_markers_and_load_back(tmp_path, fmt):
    """Quantized online by kitchen's quantizer (the format's method), saved as upstream ComfyUI's markers and
    kitchen's tensor names, loaded back bit-identical; upstream's own Linear (a QuantizedTensor weight) saves
    the same tensors."""
    options, marker = FOUR_BIT[fmt]
    methods = {name: (fmt, options) for name in ("blocks.0.self_attn.q", "blocks.0.ffn.0", "blocks.0.ffn.2")}
    model = quantized_model(methods)
    contents = save(model, tmp_path / "saved.safetensors")
    assert {name: contents.markers()[name] for name in methods} == dict.fromkeys(methods, marker)
    loaded, _, _ = build(tmp_path / "saved.safetensors")
    for name in methods:
        x = layer_input(name)
        assert torch.equal(model.get_submodule(name)(x), loaded.get_submodule(name)(x)), name
    kitchen = save(kitchen_model(quantized_model(methods)), tmp_path / "kitchen.safetensors")
    assert kitchen.markers() == contents.markers()
    assert [key for key, _ in kitchen.tensors] == [key for key, _ in contents.tensors]
    assert all(torch.equal(a, b) for (_, a), (_, b) in zip(kitchen.tensors, contents.tensors))


def test_kitchen_weights_save_the_same_file(tmp_path):
    """ComfyUI's Linear with a QuantizedTensor weight writes what the QuantLinear writes, byte for byte."""
    save(quantized_model(), tmp_path / "module.safetensors")
    save(kitchen_model(quantized_model()), tmp_path / "kitchen.safetensors")
    a, b = inspect_checkpoint(tmp_path / "module.safetensors"), inspect_checkpoint(tmp_path / "kitchen.safetensors")
    assert a.header.tensors.keys() == b.header.tensors.keys()
    assert a.header.metadata["_quantization_metadata"] == b.header.metadata["_quantization_metadata"]
    with safe_open(str(tmp_path / "module.safetensors"), "pt") as fa, \
            safe_open(str(tmp_path / "kitchen.safetensors"), "pt") as fb:
        for key in fa.keys():
            ta, tb = fa.get_tensor(key), fb.get_tensor(key)
            assert ta.dtype == tb.dtype and ta.shape == tb.shape, key
            assert torch.equal(ta.reshape(-1).view(torch.uint8), tb.reshape(-1).view(torch.uint8)), key


def test_formats_without_a_marker_format_are_refused(tmp_path):
    methods = {**METHODS, "blocks.0.ffn.2": ("mxfp4", {"min_output_dim": 0}), "head.head": ("quanto_qint8", {})}
    model = quantized_model(methods)
    model.head.head = QuantLinear(get_method("quanto_qint8"), 128, 64,
                                  get_method("quanto_qint8").quantize_weight(torch.randn(64, 128)), None, torch.float32)
    with pytest.raises(SaveError) as info:
        save_contents(model.named_modules())
    message = str(info.value)
    assert "MXFP4" in message and "nothing was written" in message
    assert info.value.layers == ("blocks.0.ffn.2", "head.head")


def test_a_lora_written_into_a_layer_is_refused_and_gone_once_removed():
    model = quantized_model()
    layer = model.get_submodule("blocks.0.self_attn.q")
    original = layer.stored_tensors()
    backup = layer.weight
    layer.set_weight(layer.convert_weight(torch.empty(0)) + 0.01)   # as ComfyUI writes a LoRA in
    with pytest.raises(SaveError, match="weight patch") as info:
        save_contents(model.named_modules())
    assert info.value.layers == ("blocks.0.self_attn.q",)
    layer.weight = backup                                            # as ComfyUI restores the weight
    contents = save_contents(model.named_modules())
    saved = dict(contents.tensors)
    assert saved["blocks.0.self_attn.q.weight"] is original["weight"]
    assert saved["blocks.0.self_attn.q.weight_scale"] is original["weight_scale"]


def test_pack_version_is_pyprojects():
    from pathlib import Path
    project = tomllib.loads((Path(__file__).parent.parent / "pyproject.toml").read_text())["project"]
    assert pack_version() == project["version"]
