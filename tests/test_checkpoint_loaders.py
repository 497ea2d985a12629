"""Checkpoint inspection (loaders/) and layer-by-layer building, on CPU, against the plain layers.

A small Wan-shaped model (same layer names as ComfyUI's WanModel) is saved in
bf16; quantized files are written from it in every format and marker form, then
built back layer by layer through LayerBuilder, the code the ComfyUI loaders
run inside `_load_from_state_dict`. Each layer's output is compared with the
bf16 layer's in fp32.
"""
import base64
import json
import logging
import re
import time
import tracemalloc
from dataclasses import replace

import pytest
import torch
from safetensors import SafetensorError, safe_open
from torch import nn

from bad_checkpoints import BAD_FILES, many_markers_file, write_raw
from checkpoint_files import (CONVERTER_MODES, converter_dequantized, edit_checkpoint, load, marker_tensor, save,
                              write_converted, write_kitchen, write_markers, write_nvfp4_awq, write_quanto,
                              write_quanto_reference, write_scaled_fp8)

from bigdit.loaders import CheckpointError, LayerBuilder, inspect_checkpoint
from bigdit.loaders.safetensors_header import HeaderReader, read_header
from bigdit.quant import QuantConfig, QuantLinear, apply_replacements, get_method, quantize_layers

# (out, in) of the Linear layers, named as in ComfyUI's WanModel (dim 128, ffn 256).
LINEARS = {
    "blocks.0.self_attn.q": (128, 128),
    "blocks.0.self_attn.o": (128, 128),
    "blocks.0.cross_attn.k": (128, 128),
    "blocks.0.ffn.0": (256, 128),
    "blocks.0.ffn.2": (128, 256),
    "time_projection.1": (768, 128),
    "head.head": (64, 128),
}

# Bound on each format's layer output error against the fp32 product of the
# bf16 weights, Gaussian inputs and weights, relative L2 (measured on CPU:
# 0.0096, 0.0094, 0.037, 0.098, 0.028, 0.0071).
TOLERANCE = {
    "int8_convrot": 0.02,       # W8A8 with rotation
    "int8_tensorwise": 0.02,    # W8A8, per-channel weights, per-token activations
    "float8_e4m3fn": 0.06,      # W8A8 E4M3: 3 mantissa bits each side
    "nvfp4": 0.15,              # weight-only E2M1 (dequantized on CPU)
    "mxfp8": 0.05,              # weight-only E4M3 with power-of-two block scales
    "quanto_qint8": 0.015,      # weight-only per-channel int8
}

MIXED = {
    "blocks.0.self_attn.q": {"format": "int8_tensorwise", "convrot": True, "convrot_groupsize": 64},
    "blocks.0.self_attn.o": {"format": "int8_tensorwise"},
    "blocks.0.cross_attn.k": {"format": "float8_e4m3fn"},
    "blocks.0.ffn.0": {"format": "nvfp4"},
    "blocks.0.ffn.2": {"format": "mxfp8"},
}
EXPECTED_METHOD = {"blocks.0.self_attn.q": "int8_convrot", "blocks.0.self_attn.o": "int8_tensorwise",
                   "blocks.0.cross_attn.k": "float8_e4m3fn", "blocks.0.ffn.0": "nvfp4", "blocks.0.ffn.2": "mxfp8"}


class WanShaped(nn.Module):
    """Plain Linear layers at the names of LINEARS (nested modules built from the dots)."""

    def __init__(self, linears=LINEARS):
        super().__init__()
        for name, (n_out, n_in) in linears.items():
            parent = self
            *path, leaf = name.split(".")
            for part in path:
                if not hasattr(parent, part):
                    parent.add_module(part, nn.Module())
                parent = getattr(parent, part)
            parent.add_module(leaf, nn.Linear(n_in, n_out))


def plain_state_dict(seed=0):
    gen = torch.Generator().manual_seed(seed)
    sd = {}
    for name, (n_out, n_in) in LINEARS.items():
        sd[f"{name}.weight"] = (torch.randn(n_out, n_in, generator=gen) * n_in ** -0.5).to(torch.bfloat16)
        sd[f"{name}.bias"] = (torch.randn(n_out, generator=gen) * 0.02).to(torch.bfloat16)
    sd["blocks.0.norm3.weight"] = torch.ones(128, dtype=torch.bfloat16)
    sd["blocks.0.modulation"] = torch.randn(1, 6, 128, generator=gen).to(torch.bfloat16)
    sd["patch_embedding.weight"] = torch.randn(128, 16, 1, 2, 2, generator=gen)  # fp32 on purpose
    return sd


@pytest.fixture(scope="module")
def plain_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("ckpt") / "wan_bf16.safetensors"
    save(plain_state_dict(), path)
    return path


def build(path, compute_dtype=torch.float32, linears=LINEARS, device="cpu", **builder_kw):
    """Load `path` into a WanShaped model the way the ComfyUI loaders do: inspect, then one Linear at a time."""
    contents = inspect_checkpoint(path)
    model = WanShaped(linears).to(device)
    with contents.open() as source:
        builder = LayerBuilder(contents, source, torch.device(device), **builder_kw)
        builder.resolve_methods()
        sd = contents.state_dict(source)
        built = {}
        for name, module in model.named_modules():
            if isinstance(module, nn.Linear):
                weight, bias = sd.get(f"{name}.weight"), sd.get(f"{name}.bias")
                layer = builder.build(name, weight, module.in_features, module.out_features, bias, compute_dtype,
                                      torch.device(device))
                if layer is None:
                    with torch.no_grad():
                        module.weight.copy_(weight)
                        module.bias.copy_(bias)
                else:
                    built[name] = layer
        report = builder.finish()
    apply_replacements(model, built)
    return model, report, contents


def rel_err(out, ref):
    return ((out.float() - ref.float()).norm() / ref.float().norm()).item()


def reference_output(name, x, sd=None):
    sd = sd or plain_state_dict()
    return nn.functional.linear(x.float(), sd[f"{name}.weight"].float(), sd[f"{name}.bias"].float())


def layer_input(name, seed=1):
    return torch.randn(2, 9, LINEARS[name][1], generator=torch.Generator().manual_seed(seed))


# ---- good files ---------------------------------------------------------------

@pytest.mark.parametrize("form", ["tensor", "header", "both"])
def test_mixed_markers_dispatch_each_layer(plain_file, tmp_path, form):
    path = write_markers(plain_file, tmp_path / f"mixed_{form}.safetensors", MIXED, form=form)
    model, report, contents = build(path)
    assert contents.kind == "ComfyUI per-layer markers"
    for name, expected in EXPECTED_METHOD.items():
        layer = model.get_submodule(name)
        assert isinstance(layer, QuantLinear) and layer.method.name == expected, name
        x = layer_input(name)
        out = layer(x)
        assert out.dtype == torch.float32 and out.shape == (2, 9, LINEARS[name][0])
        assert rel_err(out, reference_output(name, x)) < TOLERANCE[expected], name
    for name in ("time_projection.1", "head.head"):
        assert type(model.get_submodule(name)) is nn.Linear
    lines = report.render().splitlines()
    assert lines[0] == "quantized 5/7 linear layers"
    assert "float8_e4m3fn x1, int8_convrot x1, int8_tensorwise x1, mxfp8 x1, nvfp4 x1" in report.render()
    assert any(line.startswith("nvfp4 layers on cpu: dequantized before each matmul x1") for line in lines)


def test_int8_flags_under_params_and_bf16_compute(plain_file, tmp_path):
    marker = {"format": "int8_tensorwise", "params": {"convrot": True, "convrot_groupsize": 16}}
    path = write_markers(plain_file, tmp_path / "params.safetensors", {"blocks.0.ffn.2": marker}, form="header")
    model, _, contents = build(path, compute_dtype=torch.bfloat16)
    assert contents.layers["blocks.0.ffn.2"].options == {"convrot": True, "convrot_groupsize": 16}
    layer = model.get_submodule("blocks.0.ffn.2")
    assert layer.method.describe() == "int8_convrot(g=16)"
    x = layer_input("blocks.0.ffn.2").to(torch.bfloat16)
    out = layer(x)
    assert out.dtype == torch.bfloat16
    assert rel_err(out, reference_output("blocks.0.ffn.2", x)) < TOLERANCE["int8_convrot"]


def test_fp8_per_tensor_scale_and_static_input_scale(plain_file, tmp_path):
    marker = {"format": "float8_e4m3fn"}
    path = write_markers(plain_file, tmp_path / "fp8.safetensors", {"blocks.0.ffn.0": marker}, per_tensor_fp8=True)
    x = layer_input("blocks.0.ffn.0")
    path = edit_checkpoint(path, tmp_path / "fp8_static.safetensors",
                           {"blocks.0.ffn.0.input_scale": (x.abs().amax() / 448).reshape(())})
    model, _, contents = build(path)
    layer = model.get_submodule("blocks.0.ffn.0")
    assert layer.weight_scale.shape == () and layer.input_scale.dtype == torch.float32
    assert rel_err(layer(x), reference_output("blocks.0.ffn.0", x)) < TOLERANCE["float8_e4m3fn"]


def test_nvfp4_and_mxfp8_pad_odd_shapes(tmp_path):
    linears = {"proj": (40, 100)}
    sd = {"proj.weight": torch.randn(40, 100).to(torch.bfloat16), "proj.bias": torch.zeros(40, dtype=torch.bfloat16)}
    save(sd, tmp_path / "odd.safetensors")
    for fmt, storage in (("nvfp4", [48, 56]), ("mxfp8", [64, 128])):
        path = write_markers(tmp_path / "odd.safetensors", tmp_path / f"odd_{fmt}.safetensors", {"proj": {"format": fmt}})
        contents = inspect_checkpoint(path)
        assert list(contents.layers["proj"].storage_shape) == storage
        model, _, _ = build(path, linears=linears)
        x = torch.randn(5, 100)
        ref = nn.functional.linear(x, sd["proj.weight"].float())
        out = model.proj(x)
        assert out.shape == (5, 40) and rel_err(out, ref) < TOLERANCE[fmt], fmt


def test_nvfp4_requantized_to_fastest_native_format(plain_file, tmp_path):
    path = write_markers(plain_file, tmp_path / "nvfp4.safetensors", {"blocks.0.ffn.2": {"format": "nvfp4"}})
    model, report, _ = build(path, conversions={"nvfp4": "requantize"})
    layer = model.get_submodule("blocks.0.ffn.2")
    # On CPU the fastest native format is INT8 ConvRot, at the largest group size dividing 256.
    assert layer.method.describe() == "int8_convrot(g=256)" and layer.weight.dtype == torch.int8
    assert "nvfp4 layers on cpu: re-quantized at load to int8_convrot(g=256) x1" in report.render()
    x = layer_input("blocks.0.ffn.2")
    # NVFP4's own error plus INT8's.
    assert rel_err(layer(x), reference_output("blocks.0.ffn.2", x)) < TOLERANCE["nvfp4"] + TOLERANCE["int8_convrot"]


INT8_CONVROT = {"format": "int8_tensorwise", "convrot": True, "convrot_groupsize": 64}


@pytest.fixture
def fp8_native(monkeypatch):
    """This device's native formats as on sm89+ (FP8, then INT8 ConvRot), for the decisions that ask for them: the
    conversion then runs on the CPU, FP8 emulated there with the same arithmetic."""
    from bigdit.quant import auto

    def native(device, in_features, out_features):
        return [get_method("float8_e4m3fn"), get_method("int8_convrot", group_size=64)]
    monkeypatch.setattr(auto, "fastest_native_methods", native)


def test_int8_layers_requantized_to_the_fastest_native_format(plain_file, tmp_path, fp8_native):
    """`int8` requantize: an INT8 marker layer is dequantized (its rotation undone) and quantized to the device's
    fastest native format other than INT8, on the builder's device, one layer at a time; the report says so."""
    path = write_markers(plain_file, tmp_path / "int8.safetensors", {"blocks.0.ffn.2": INT8_CONVROT})
    model, report, _ = build(path, conversions={"int8_tensorwise": "requantize"})
    layer = model.get_submodule("blocks.0.ffn.2")
    assert layer.method.name == "float8_e4m3fn" and layer.weight.dtype == torch.float8_e4m3fn
    assert ("int8_tensorwise layers on cpu: re-quantized at load to float8_e4m3fn (per-channel weights, per-token "
            "activations) x1") in report.render()
    (record,) = [r for r in report.records if r.name == "blocks.0.ffn.2"]
    assert record.action == "convert" and record.reason.startswith(
        "int8_tensorwise in the checkpoint, re-quantized at load to float8_e4m3fn")
    x = layer_input("blocks.0.ffn.2")
    # INT8's error plus FP8's on top of it
    assert rel_err(layer(x), reference_output("blocks.0.ffn.2", x)) < TOLERANCE["int8_convrot"] + \
        TOLERANCE["float8_e4m3fn"]


@pytest.mark.parametrize("mode", ["keep", "auto", None])
def test_int8_layers_stay_int8_where_no_conversion_is_asked_or_measured(plain_file, tmp_path, fp8_native, mode):
    """`keep`, no mode, and `auto` off CUDA (no faster native format to compare) load INT8 as stored; auto's
    report says so."""
    path = write_markers(plain_file, tmp_path / "int8.safetensors", {"blocks.0.ffn.2": INT8_CONVROT})
    model, report, _ = build(path, conversions={} if mode is None else {"int8_tensorwise": mode})
    layer = model.get_submodule("blocks.0.ffn.2")
    assert layer.method.name == "int8_convrot" and layer.weight.dtype == torch.int8
    assert "re-quantized" not in report.render()
    if mode == "auto":
        assert "int8_tensorwise layers on cpu: kept as INT8: no faster native format on this device x1" in \
            report.render(), report.render()


class StubContext:
    """decision.StoredContext as a CUDA device would answer it, the kept measurement's verdict scripted."""
    device = torch.device("cuda")

    def __init__(self, faster):
        self.faster, self.asked = faster, []

    def fastest_native(self, layer):
        return [get_method("float8_e4m3fn"), get_method("int8_convrot")]

    def faster_native(self, layer, stored):
        self.asked.append((layer.shape, stored.name, stored.convrot, stored.group_size))
        return self.faster


def test_int8_auto_converts_only_where_a_kept_measurement_says_it_pays():
    from bigdit.quant.layer import Layer
    from bigdit.quant.registry import format_spec
    spec = format_spec("int8_tensorwise")
    layer = Layer("blocks.0.ffn.0", 5376, 28672, torch.int8, torch.bfloat16, "int8_tensorwise",
                  {"convrot": True, "convrot_groupsize": 256})
    fp8 = get_method("float8_e4m3fn")
    pays = StubContext((fp8, "a stored measurement says float8_e4m3fn pays on this GPU",
                        "int8_convrot 1.000 ms, float8_e4m3fn 0.800 ms a call"))
    conversion = spec.stored_decision(layer, "auto", pays)
    assert conversion.method is fp8 and conversion.path == (
        "re-quantized at load to float8_e4m3fn (per-channel weights, per-token activations): a stored measurement "
        "says float8_e4m3fn pays on this GPU")
    assert "int8_convrot 1.000 ms" in conversion.reason and "int8_convrot 1.000 ms" in conversion.brief
    # the stored format's own method is what was measured: the marker's rotation and group
    assert pays.asked == [((28672, 5376), "int8_convrot", True, 256)]
    unmeasured = spec.stored_decision(layer, "auto", StubContext(
        (None, "no stored measurement says float8_e4m3fn pays on this GPU", "BIGDIT_INT8_TUNE=1 measures it")))
    assert unmeasured.method is None
    assert unmeasured.path == "kept as INT8: no stored measurement says float8_e4m3fn pays on this GPU"
    assert spec.stored_decision(layer, "keep", pays).method is None


def test_int8_auto_pays_by_time_saved_over_a_job_and_error():
    """A kept measurement converts where the calls of one job save more than the conversion costs."""
    from bigdit.quant import auto
    int8, fp8 = get_method("int8_tensorwise", convrot=True, convrot_groupsize=64), get_method("float8_e4m3fn")

    def verdict(stored_ms, target_ms, error=0.03, convert_ms=10.0):
        return auto._pays({"stored_ms": stored_ms, "target_ms": target_ms, "target_error": error,
                           "convert_ms": convert_ms}, int8, fp8)

    assert auto.JOB_CALLS == 8
    pays, numbers = verdict(3.0, 1.0)  # 8 calls save 16 ms > 10 ms
    assert pays and numbers.startswith("int8_convrot 3.000 ms, float8_e4m3fn 1.000 ms a call, error on random data 0.0300")
    pays, numbers = verdict(2.0, 1.0)  # 8 ms saved < 10 ms of conversion
    assert not pays and numbers.endswith("8 calls save 8.0 ms")
    assert not verdict(1.0, 2.0)[0]  # slower
    pays, numbers = verdict(3.0, 1.0, error=0.06)  # the probe's error is told, not judged (quant/real_error.py)
    assert pays and "error on random data 0.0600" in numbers


def test_int8_auto_measurement_times_both_layers_and_the_conversion(monkeypatch):
    """auto._measure_conversion, run only where tuning is asked: each layer's call (the clock scripted, INT8
    first) and its error against fp32, and the conversion's time."""
    from bigdit.quant import auto
    int8, fp8 = get_method("int8_tensorwise", convrot=True, convrot_groupsize=64), get_method("float8_e4m3fn")
    times = [2.0, 1.0]
    monkeypatch.setattr(auto, "_time_ms", lambda fn, iters: (fn(), times.pop(0))[1])
    measured = auto._measure_conversion(torch.device("cpu"), 256, 128, torch.bfloat16, 64, int8, fp8)
    assert (measured["stored_ms"], measured["target_ms"]) == (2.0, 1.0) and measured["convert_ms"] > 0
    assert 0.01 < measured["target_error"] < TOLERANCE["int8_tensorwise"] + TOLERANCE["float8_e4m3fn"]


@pytest.fixture
def no_timing(monkeypatch):
    """Every timer the pack has raises: a test under it fails if anything is measured."""
    from bigdit import hardware
    from bigdit.quant import auto, int8_triton, kernel_select

    def timed(*args, **kwargs):
        raise AssertionError("a kernel was timed")
    for module, name in ((hardware, "time_ms"), (kernel_select, "_time_ms"), (auto, "_time_ms"),
                         (int8_triton, "time_ms"), (auto, "_measure_conversion"), (int8_triton, "_search")):
        monkeypatch.setattr(module, name, timed)


def test_a_load_with_int8_auto_times_nothing(plain_file, tmp_path, fp8_native, no_timing, monkeypatch):
    """A load of an INT8 marker file with `int8` auto, through the builder, and the same layers decided for a GPU
    whose fastest native format is FP8: nothing is timed, every layer is kept as stored."""
    from bigdit.quant import tuning
    from bigdit.quant.decision import QuantConfig, decide
    from bigdit.quant.layer import LOAD, Layer
    monkeypatch.setattr(tuning, "_current", tuning.current())  # tuning.use below: put back after the test
    path = write_markers(plain_file, tmp_path / "int8.safetensors",
                         {name: INT8_CONVROT for name in ("blocks.0.ffn.2", "blocks.0.ffn.0", "blocks.0.self_attn.q")})
    model, report, _ = build(path, conversions={"int8_tensorwise": "auto"})
    assert report.method_counts() == {"int8_convrot": 3}
    config = QuantConfig(method=None, compute_device=torch.device("cuda"), conversions={"int8_tensorwise": "auto"})
    tuning.use(str(tmp_path / "tuning.json"))
    layer = decide(config, Layer("blocks.0.ffn.0", 128, 256, torch.int8, torch.bfloat16, "int8_tensorwise",
                                 {"convrot": True, "convrot_groupsize": 64}), None, loading=True)
    assert layer.action == LOAD and layer.method.name == "int8_convrot", layer.reason
    assert layer.path == "kept as INT8: no stored measurement says float8_e4m3fn pays on this GPU"
    assert not (tmp_path / "tuning.json").exists()  # nothing measured, nothing written


def test_int8_auto_follows_what_tuning_kept(tmp_path, fp8_native, monkeypatch):
    """With BIGDIT_INT8_TUNE=1 the first decision measures (scripted here) and keeps the numbers on disk; a later
    process's load reads them and converts (or keeps) without timing anything; another GPU's entry is not used."""
    from bigdit.quant import auto, tuning
    from bigdit.quant.decision import QuantConfig, decide
    from bigdit.quant.layer import CONVERT, LOAD, Layer
    store = str(tmp_path / "tuning.json")
    monkeypatch.setattr(tuning, "_current", tuning.current())  # tuning.use below: put back after the test
    monkeypatch.setattr(tuning, "device_key", lambda device: "NVIDIA H100 80GB HBM3 sm90")  # the GPU's identity
    config = QuantConfig(method=None, compute_device=torch.device("cuda"), conversions={"int8_tensorwise": "auto"})

    def layer(name, k, n):
        return Layer(name, k, n, torch.int8, torch.bfloat16, "int8_tensorwise", {"convrot": True, "convrot_groupsize": 64})

    numbers = {(128, 256): (3.0, 1.0), (256, 128): (1.2, 1.1)}  # pays; saves 0.8 ms over a job, not the 10 ms
    measured = []

    def measure(device, k, n, dtype, rows, stored, target):
        measured.append((k, n))
        return {"stored_ms": numbers[k, n][0], "target_ms": numbers[k, n][1], "target_error": 0.03, "convert_ms": 10.0}
    monkeypatch.setattr(auto, "_measure_conversion", measure)
    monkeypatch.setenv(tuning.TUNE_ENV, "1")
    tuning.use(store)
    assert decide(config, layer("a", 128, 256), None, loading=True).action == CONVERT
    assert decide(config, layer("b", 256, 128), None, loading=True).action == LOAD
    assert measured == [(128, 256), (256, 128)]

    monkeypatch.delenv(tuning.TUNE_ENV)
    monkeypatch.setattr(auto, "_measure_conversion", lambda *args: pytest.fail("measured again"))
    tuning.use(store)  # as the next load reads it
    converted = decide(config, layer("a", 128, 256), None, loading=True)
    assert converted.action == CONVERT and converted.method.name == "float8_e4m3fn"
    assert converted.path.endswith(": a stored measurement says float8_e4m3fn pays on this GPU")
    assert "int8_convrot 3.000 ms, float8_e4m3fn 1.000 ms a call" in converted.reason
    kept = decide(config, layer("b", 256, 128), None, loading=True)
    assert kept.action == LOAD and kept.path == "kept as INT8: a stored measurement says float8_e4m3fn does not pay on " \
        "this GPU" and "8 calls save 0.8 ms" in kept.reason
    monkeypatch.setattr(tuning, "device_key", lambda device: "NVIDIA H200 sm90")  # another GPU: its own tuning
    other = decide(config, layer("a", 128, 256), None, loading=True)
    assert other.action == LOAD and "no stored measurement" in other.path


def test_state_dict_stands_in_for_quantized_weights(plain_file, tmp_path):
    path = write_markers(plain_file, tmp_path / "mixed.safetensors", MIXED)
    contents = inspect_checkpoint(path)
    with contents.open() as source:
        sd = contents.state_dict(source)
    assert not any(k.endswith(("comfy_quant", "weight_scale", "weight_scale_2")) for k in sd)
    proxy = sd["blocks.0.ffn.0.weight"]    # nvfp4: stored [256, 64] uint8, logical [256, 128]
    assert proxy.shape == (256, 128) and proxy.dtype == torch.bfloat16 and proxy.stride() == (0, 0)
    assert torch.equal(sd["head.head.weight"], plain_state_dict()["head.head.weight"])
    assert sd["blocks.0.ffn.0.bias"].dtype == torch.bfloat16


@pytest.mark.parametrize("writer", ["own", "optimum-quanto+mmgp"])
def test_quanto_qint8(plain_file, tmp_path, writer):
    prefixes = ["blocks.0.self_attn.q", "blocks.0.ffn.0", "blocks.0.ffn.2"]
    write = write_quanto if writer == "own" else write_quanto_reference
    path = write(plain_file, tmp_path / "quanto.safetensors", prefixes)
    model, report, contents = build(path)
    assert contents.kind == "Quanto qint8"
    assert sorted(contents.layers) == sorted(prefixes)
    for name in prefixes:
        assert contents.layers[name].tensors == {"weight": f"{name}.weight._data", "weight_scale": f"{name}.weight._scale"}
        layer = model.get_submodule(name)
        assert layer.method.name == "quanto_qint8" and layer.weight.dtype == torch.int8
        x = layer_input(name)
        assert rel_err(layer(x), reference_output(name, x)) < TOLERANCE["quanto_qint8"], name
    text = report.render()
    assert text.splitlines()[0] == "quantized 3/7 linear layers"
    assert "resident-memory format, not a speed format" in text


def test_quanto_prefixes_map_to_model_names(plain_file, tmp_path):
    sd = {f"language_model.{k}": v for k, v in plain_state_dict().items()}
    save(sd, tmp_path / "prefixed.safetensors")
    path = write_quanto(tmp_path / "prefixed.safetensors", tmp_path / "quanto.safetensors",
                        ["language_model.blocks.0.ffn.0"])
    contents = inspect_checkpoint(path).renamed([("language_model.", "")])
    assert list(contents.layers) == ["blocks.0.ffn.0"]
    assert contents.plain_keys["head.head.weight"] == "language_model.head.head.weight"


def test_online_quantization_while_building(plain_file):
    config = QuantConfig(method=get_method("int8_convrot", group_size=64), ignored=("head.*", "time_projection.*"))
    model, report, contents = build(plain_file, online=config)
    assert contents.kind == "plain"
    quantized = {n for n, m in model.named_modules() if isinstance(m, QuantLinear)}
    assert quantized == {"blocks.0.self_attn.q", "blocks.0.self_attn.o", "blocks.0.cross_attn.k",
                         "blocks.0.ffn.0", "blocks.0.ffn.2"}
    reasons = {r.name: r.reason for r in report.kept}
    assert reasons["head.head"] == "ignored (matches 'head.*')"
    x = layer_input("blocks.0.ffn.2")
    assert rel_err(model.get_submodule("blocks.0.ffn.2")(x), reference_output("blocks.0.ffn.2", x)) < 0.02


def test_online_layers_are_decided_from_the_header_before_building(plain_file):
    """LoadH3Quantized's per-layer choice is made from the file's header when the builder is made;
    building a layer (inside ComfyUI's state-dict callback) only carries it out."""
    method = get_method("int8_convrot", group_size=64)

    class Recording:  # a selector, as auto is
        def __init__(self):
            self.calls = []

        def select(self, in_features, out_features, dtype):
            self.calls.append((in_features, out_features))
            return method, "chosen from the header"

    selector = Recording()
    contents = inspect_checkpoint(plain_file)
    with contents.open() as source:
        builder = LayerBuilder(contents, source, torch.device("cpu"), online=QuantConfig(method=selector,
                                                                                     ignored=("head.*",)))
        expected = sorted((n_in, n_out) for name, (n_out, n_in) in LINEARS.items() if name != "head.head")
        assert sorted(selector.calls) == expected
        sd = contents.state_dict(source)
        for name, (n_out, n_in) in LINEARS.items():  # computing in the file's dtype, as the contents assumed
            builder.build(name, sd[f"{name}.weight"], n_in, n_out, sd[f"{name}.bias"], torch.bfloat16, None)
        report = builder.finish()
    assert len(selector.calls) == len(expected)
    assert {r.name: r.reason for r in report.records} == {
        name: "ignored (matches 'head.*')" if name == "head.head" else "chosen from the header" for name in LINEARS}


def test_a_layer_is_decided_once_from_the_header_in_the_files_dtype(plain_file):
    """ComfyUI may compute a bf16 file in fp16: each plain layer is decided once, from the header, the selector
    measuring in the file's dtype; a layer then built in another compute dtype keeps that decision (its record
    gives the header's reason) and computes in the dtype ComfyUI gives it."""
    int8, fp8 = get_method("int8_convrot", group_size=64), get_method("float8_e4m3fn")

    class ByDtype:  # a selector whose choice depends on the dtype, as auto's measurement may
        def __init__(self):
            self.dtypes = []

        def select(self, in_features, out_features, dtype):
            self.dtypes.append(dtype)
            return (fp8, "fp8 for float16") if dtype == torch.float16 else (int8, "int8 for bfloat16")

    selector = ByDtype()
    contents = inspect_checkpoint(plain_file)
    with contents.open() as source:
        builder = LayerBuilder(contents, source, torch.device("cpu"), online=QuantConfig(method=selector))
        assert set(selector.dtypes) == {torch.bfloat16}
        planned = len(selector.dtypes)
        sd = contents.state_dict(source)
        built = builder.build("blocks.0.ffn.0", sd["blocks.0.ffn.0.weight"], 128, 256, None, torch.float16, None)
        same = builder.build("blocks.0.ffn.2", sd["blocks.0.ffn.2.weight"], 256, 128, None, torch.bfloat16, None)
    assert len(selector.dtypes) == planned  # nothing decided again
    assert built.method.name == "int8_convrot" and built.compute_dtype == torch.float16
    assert same.method.name == "int8_convrot"
    assert [r.reason for r in builder.report.records] == ["int8 for bfloat16", "int8 for bfloat16"]


def test_online_layer_the_header_does_not_name_is_decided_from_its_tensor(plain_file):
    """A key ComfyUI renamed or split on its way to the model (diffusers files, HunyuanVideo) is decided from
    the tensor that arrives, by the same rules."""
    config = QuantConfig(method=get_method("int8_convrot", group_size=64), ignored=("*.kept",))
    contents = inspect_checkpoint(plain_file)
    weight = (torch.randn(128, 128, generator=torch.Generator().manual_seed(3)) / 16).to(torch.bfloat16)
    with contents.open() as source:
        builder = LayerBuilder(contents, source, torch.device("cpu"), online=config)
        assert "converted.q" not in builder.layers
        built = builder.build("converted.q", weight, 128, 128, None, torch.float32, None)
        kept = builder.build("converted.kept", weight, 128, 128, None, torch.float32, None)
    assert built.method.name == "int8_convrot" and kept is None
    assert [r.reason for r in builder.report.records] == ["int8_convrot(g=64)", "ignored (matches '*.kept')"]


def test_marker_layers_stay_serialized_under_online_quantization(plain_file, tmp_path):
    path = write_markers(plain_file, tmp_path / "one.safetensors", {"blocks.0.ffn.0": {"format": "mxfp8"}})
    config = QuantConfig(method=get_method("int8_convrot", group_size=64), ignored=("head.*", "time_projection.*"))
    model, report, _ = build(path, online=config)
    assert model.get_submodule("blocks.0.ffn.0").method.name == "mxfp8"
    assert model.get_submodule("blocks.0.ffn.2").method.name == "int8_convrot"
    assert report.summary_line() == "quantized 5/7 linear layers"


# ---- ComfyUI scaled_fp8 files -------------------------------------------------

def test_scaled_fp8_file_loads_as_fp8_layers(plain_file, tmp_path):
    """Every Linear of the file as the pack's FP8 layer, dequantizing to exactly weight * scale_weight."""
    path = write_scaled_fp8(plain_file, tmp_path / "wan_fp8_scaled.safetensors")
    sd, _ = load(path)
    model, report, contents = build(path)
    assert contents.kind == "ComfyUI scaled_fp8" and set(contents.layers) == set(LINEARS)
    assert not any(k == "scaled_fp8" or k.endswith((".scale_weight", ".scale_input")) for k in contents.plain_keys)
    assert report.summary_line() == f"quantized {len(LINEARS)}/{len(LINEARS)} linear layers"
    assert report.method_counts() == {"float8_e4m3fn": len(LINEARS)}
    assert f"ComfyUI scaled_fp8; quantized layers in the file: float8_e4m3fn x{len(LINEARS)}" in report.render()
    for name in LINEARS:
        layer = model.get_submodule(name)
        assert layer.weight_scale.shape == () and layer.weight_scale.dtype == torch.float32
        assert not hasattr(layer, "input_scale") or layer.input_scale is None
        expected = sd[f"{name}.weight"].float() * sd[f"{name}.scale_weight"]
        assert torch.equal(layer.method.dequantize(layer), expected)
        x = layer_input(name)
        assert rel_err(layer(x), reference_output(name, x)) < TOLERANCE["float8_e4m3fn"]


@pytest.mark.parametrize("scale_input", [1.0, 0.02])
def test_scaled_fp8_scale_input(plain_file, tmp_path, scale_input):
    """1.0 is the writers' placeholder (dropped, as upstream does: activations scaled per token); any other
    value is the layer's static activation scale."""
    path = write_scaled_fp8(plain_file, tmp_path / "scaled.safetensors", ["blocks.0.ffn.0"], scale_input=scale_input)
    model, report, contents = build(path)
    layer = model.get_submodule("blocks.0.ffn.0")
    placeholder = "scale_input 1.0 (a writer's placeholder) on 1 layer(s) ignored"
    if scale_input == 1.0:
        assert "input_scale" not in contents.layers["blocks.0.ffn.0"].tensors
        assert placeholder in report.render()
    else:
        assert layer.input_scale.item() == pytest.approx(scale_input) and placeholder not in report.render()
    assert "blocks.0.ffn.0.scale_input" not in contents.plain_keys
    x = layer_input("blocks.0.ffn.0") * 0.5  # within the static scale's range (0.02 x 448)
    assert rel_err(layer(x), reference_output("blocks.0.ffn.0", x)) < TOLERANCE["float8_e4m3fn"]


def test_scaled_fp8_full_precision_flag_is_reported(plain_file, tmp_path):
    path = write_scaled_fp8(plain_file, tmp_path / "scaled.safetensors", ["blocks.0.ffn.0"], full_precision=True)
    _, report, _ = build(path)
    assert "scaled_fp8: the file asks for full-precision matmuls" in report.render()


def test_scaled_fp8_layers_stay_fp8_under_online_quantization(plain_file, tmp_path):
    """LoadH3Quantized's path: the file's FP8 layers load as stored, its plain layers are quantized."""
    path = write_scaled_fp8(plain_file, tmp_path / "scaled.safetensors", ["blocks.0.ffn.0", "blocks.0.ffn.2"])
    config = QuantConfig(method=get_method("int8_convrot", group_size=64), ignored=("head.*", "time_projection.*"))
    model, report, _ = build(path, online=config)
    assert model.get_submodule("blocks.0.ffn.0").method.name == "float8_e4m3fn"
    assert model.get_submodule("blocks.0.ffn.2").method.name == "float8_e4m3fn"
    assert model.get_submodule("blocks.0.self_attn.q").method.name == "int8_convrot"
    assert report.summary_line() == "quantized 5/7 linear layers"
    assert report.method_counts() == {"float8_e4m3fn": 2, "int8_convrot": 3}


# ---- bad files: each error names the file and the layer -----------------------

def _int8_file(plain_file, tmp_path, layers=("blocks.0.ffn.0",)):
    return write_markers(plain_file, tmp_path / "int8.safetensors",
                         {name: {"format": "int8_tensorwise", "convrot": True, "convrot_groupsize": 64}
                          for name in layers})


def _quanto_file(plain_file, tmp_path):
    return write_quanto(plain_file, tmp_path / "quanto.safetensors", ["blocks.0.ffn.0", "blocks.0.ffn.2"])


@pytest.mark.parametrize("case", list(BAD_FILES))
def test_bad_file_is_refused_naming_file_and_layer(plain_file, tmp_path, case):
    writer, words, layer = BAD_FILES[case]
    path = writer(plain_file, tmp_path, tmp_path / "bad.safetensors")
    with pytest.raises(CheckpointError) as info:
        inspect_checkpoint(path)
    message = str(info.value)
    assert message.startswith("bad.safetensors: "), message
    assert words in message and layer in message, message


@pytest.mark.parametrize("encoding, dtype", [("F8_E4M3", torch.float8_e4m3fn), ("F8_E8M0", torch.float8_e8m0fnu)])
def test_an_8bit_scales_range_from_its_codes_is_its_decoded_range(tmp_path, encoding, dtype):
    """Block scales' extremes are read from the bytes in place (a text encoder holds about 2 GB of them): where no code
    is NaN or negative, the same values as decoding every scale; otherwise the decode decides (None)."""
    from bigdit.loaders.layers import _ordered_range
    torch.manual_seed(0)
    below = 0x7F if encoding == "F8_E4M3" else 0xFF
    cases = {"random": torch.randint(0, below, (64, 48)), "every code": torch.arange(below),
             "one code": torch.full((5, 3), 0x38), "NaN": torch.tensor([0x10, below]),
             "sign bit": torch.tensor([0x38, 0xB8])}  # E4M3FN: -1.0; E8M0 has no sign: 2^57
    for name, codes in cases.items():
        codes = codes.to(torch.uint8)
        path = tmp_path / f"{name}.safetensors"
        save({"s": codes.view(dtype)}, path)
        with HeaderReader(read_header(path)) as read:
            got = _ordered_range(read, "s", encoding)
        values = codes.view(dtype).float()
        if name == "NaN" or (name == "sign bit" and encoding == "F8_E4M3"):
            assert got is None, name
        else:
            assert got == (float(values.min()), float(values.max())), name


def test_unconsumed_marker_abandons_the_load(plain_file, tmp_path):
    sd, _ = load(_int8_file(plain_file, tmp_path))
    # A marked layer the model does not have (e.g. a checkpoint of a deeper model).
    extra = {f"blocks.9.ffn.0.{k[len('blocks.0.ffn.0.'):]}": v for k, v in sd.items() if k.startswith("blocks.0.ffn.0.")
             and not k.endswith("bias")}
    path = edit_checkpoint(tmp_path / "int8.safetensors", tmp_path / "bad.safetensors", extra)
    with pytest.raises(CheckpointError, match=r"bad.safetensors: unconsumed markers.*blocks\.9\.ffn\.0"):
        build(path)


def test_layer_that_does_not_fit_the_model(plain_file, tmp_path):
    path = _int8_file(plain_file, tmp_path)
    linears = {**LINEARS, "blocks.0.ffn.0": (512, 128)}
    with pytest.raises(CheckpointError, match=r"int8.safetensors: shape mismatch: .*does not fit a Linear of "
                                              r"128->512.*blocks\.0\.ffn\.0"):
        build(path, linears=linears)


def test_mapping_collision(plain_file, tmp_path):
    sd = {**{f"a.{k}": v for k, v in plain_state_dict().items()}, **{f"b.{k}": v for k, v in plain_state_dict().items()}}
    save(sd, tmp_path / "two.safetensors")
    path = write_quanto(tmp_path / "two.safetensors", tmp_path / "bad.safetensors", ["a.blocks.0.ffn.0", "b.blocks.0.ffn.0"])
    contents = inspect_checkpoint(path)
    with pytest.raises(CheckpointError, match=r"bad.safetensors: mapping collision.*'a.blocks.0.ffn.0' and "
                                              r"'b.blocks.0.ffn.0' both become 'blocks.0.ffn.0.weight'"):
        contents.renamed([("a.", ""), ("b.", "")])


def test_oversized_header_and_garbage(tmp_path):
    path = tmp_path / "huge.safetensors"
    path.write_bytes((10 ** 12).to_bytes(8, "little") + b"{}")
    with pytest.raises(CheckpointError, match="huge.safetensors: oversized header"):
        inspect_checkpoint(path)
    path.write_bytes((2).to_bytes(8, "little") + b"[]")
    with pytest.raises(CheckpointError, match="not a JSON object"):
        inspect_checkpoint(path)


# {tensor: data_offsets} of U8 tensors, the data section's size, and the words refusing it must say (None: it
# loads), each as safetensors' own reader decides.
DATA_LAYOUTS = {
    "back to back": ({"a": (0, 4), "b": (4, 8)}, 8, None),
    "listed out of order": ({"b": (4, 8), "a": (0, 4)}, 8, None),
    "empty tensors at the seams": ({"e": (0, 0), "a": (0, 4), "f": (4, 4), "b": (4, 8), "g": (8, 8)}, 8, None),
    "no tensors": ({}, 0, None),
    "overlap": ({"a": (0, 4), "b": (2, 6)}, 6, "invalid offset for tensor 'b': its data_offsets [2, 6] start "
                                                "inside tensor 'a' ([0, 4])"),
    "the same bytes twice": ({"a": (0, 4), "b": (0, 4)}, 4, "start inside tensor 'a'"),
    "empty tensor inside another": ({"a": (0, 4), "e": (2, 2), "b": (4, 8)}, 8, "invalid offset for tensor 'e'"),
    "gap": ({"a": (0, 4), "b": (6, 10)}, 10, "invalid offset for tensor 'b': its data_offsets [6, 10] leave a gap "
                                              "of 2 bytes after tensor 'a' ([0, 4])"),
    "gap first": ({"a": (2, 6)}, 6, "invalid offset for tensor 'a': its data_offsets [2, 6] leave the data "
                                    "section's first 2 bytes to no tensor"),
    "bytes after the last tensor": ({"a": (0, 4)}, 6, "incomplete metadata, file not fully covered: the data "
                                                      "section's last 2 bytes, after tensor 'a' ([0, 4]), belong"),
    "bytes and no tensors": ({}, 2, "the data section's last 2 bytes belong to no tensor"),
}


@pytest.mark.parametrize("layout", list(DATA_LAYOUTS))
def test_data_section_is_refused_where_safetensors_refuses_it(tmp_path, layout):
    offsets, size, words = DATA_LAYOUTS[layout]
    header = {name: {"dtype": "U8", "shape": [end - begin], "data_offsets": [begin, end]}
              for name, (begin, end) in offsets.items()}
    path = write_raw(tmp_path / "layout.safetensors", json.dumps(header).encode(), bytes(range(size)))
    try:
        with safe_open(str(path), "pt") as f:
            theirs = {key: f.get_tensor(key) for key in f.keys()}
    except SafetensorError as exc:
        theirs = str(exc)
    if words is None:
        assert isinstance(theirs, dict), theirs
        checked = read_header(path)
        assert set(checked.tensors) == set(theirs)
        with HeaderReader(checked) as read:
            assert all(torch.equal(read(key), theirs[key]) for key in theirs)
        return
    assert isinstance(theirs, str), f"safetensors loads {layout!r}"
    with pytest.raises(CheckpointError) as info:
        read_header(path)
    message = str(info.value)
    assert message.startswith("layout.safetensors: ") and words in message, message
    named = re.search(r"tensor `(.+?)`", theirs)
    assert named is None or f"'{named.group(1)}'" in message, (theirs, message)


def test_error_lists_at_most_five_layers(plain_file, tmp_path):
    names = list(LINEARS)
    path = _int8_file(plain_file, tmp_path, layers=names)
    markers = {f"{n}.comfy_quant": marker_tensor({"format": "int4_mystery"}) for n in names}
    bad = edit_checkpoint(path, tmp_path / "bad.safetensors", markers)
    with pytest.raises(CheckpointError) as info:
        inspect_checkpoint(bad)
    layers = info.value.layers
    assert sorted(layers) == sorted(names)
    assert str(info.value).endswith(f"(layers: {', '.join(layers[:5])} and 2 more)")


def test_quanto_map_must_be_base64_json(plain_file, tmp_path):
    path = edit_checkpoint(_quanto_file(plain_file, tmp_path), tmp_path / "bad.safetensors",
                           metadata={"quantization_map_base64": base64.b64encode(b"not json").decode()})
    with pytest.raises(CheckpointError, match="bad.safetensors: quantization_map_base64 is not base64-encoded JSON"):
        inspect_checkpoint(path)


# ---- 4-bit formats and NVFP4 with AWQ scales, written by comfy-kitchen itself -------------

KITCHEN_4BIT = {"convrot_w4a4": {"format": "convrot_w4a4", "convrot_groupsize": 64},
                "asym_w4a8_int8": {"format": "asym_w4a8_int8", "group_size": 16, "convrot_groupsize": 64}}
# Layer output error against the fp32 product of the bf16 weights (relative L2), kitchen's activation
# quantization included (measured on CPU: W4A4 0.167-0.176, int4 activations; W4A8 0.072-0.074).
TOLERANCE_4BIT = {"convrot_w4a4": 0.25, "asym_w4a8_int8": 0.1}
FOUR_BIT_LAYERS = ("blocks.0.self_attn.q", "blocks.0.ffn.0", "blocks.0.ffn.2")


@pytest.mark.parametrize("fmt", list(KITCHEN_4BIT))
@pytest.mark.parametrize("form", ["tensor", "header"])
def test_kitchen_4bit_files_compute_as_upstream_runs_them(plain_file, tmp_path, fmt, form):
    """Bit-identical to F.linear on the QuantizedTensor kitchen wrote (what upstream ComfyUI's Linear runs:
    kitchen's linear quantizes the activations too), and near the bf16 layer."""
    layers = dict.fromkeys(FOUR_BIT_LAYERS, KITCHEN_4BIT[fmt])
    path, written = write_kitchen(plain_file, tmp_path / f"{fmt}.safetensors", layers, form=form)
    model, report, contents = build(path, compute_dtype=torch.bfloat16)
    assert report.summary_line() == f"quantized 3/{len(LINEARS)} linear layers"
    sd = plain_state_dict()
    for name in FOUR_BIT_LAYERS:
        layer = model.get_submodule(name)
        assert isinstance(layer, QuantLinear) and layer.method.name == fmt, name
        x = layer_input(name).to(torch.bfloat16)
        out = layer(x)
        host = nn.functional.linear(x, written[name], sd[f"{name}.bias"])
        assert out.dtype == torch.bfloat16 and torch.equal(out, host), name
        assert rel_err(out, reference_output(name, x)) < TOLERANCE_4BIT[fmt], name
        # its weight alone: the layer dequantizes as kitchen does (LoRA and re-quantizing start from it)
        assert torch.equal(layer.method.dequantize(layer), written[name].dequantize()), name


def test_w4a8_asymmetric_file_applies_its_zero_points(plain_file, tmp_path):
    """kitchen's asymmetric W4A8 adds weight_correction [K/G, N]: passed to kitchen, which applies it."""
    from comfy_kitchen.tensor import QuantizedTensor, get_layout_class
    name = "blocks.0.ffn.2"
    sd, _ = load(plain_file)
    weight = sd.pop(f"{name}.weight")
    qdata, params = get_layout_class("AsymW4A8Int8Layout").quantize(weight, symmetric=False, codebook=False,
                                                                     convrot_groupsize=64)
    assert params.correction is not None and params.correction.shape == (256 // 16, 128)
    qt = QuantizedTensor(qdata, "AsymW4A8Int8Layout", params)
    sd.update(qt.state_dict(f"{name}.weight"))
    sd[f"{name}.comfy_quant"] = marker_tensor({"format": "asym_w4a8_int8", "group_size": 16, "convrot_groupsize": 64})
    save(sd, tmp_path / "asym.safetensors")
    model, _, _ = build(tmp_path / "asym.safetensors", compute_dtype=torch.bfloat16)
    layer = model.get_submodule(name)
    assert set(layer.stored_tensors()) == {"weight", "weight_s_rel", "weight_s_channel", "weight_correction"}
    x = layer_input(name).to(torch.bfloat16)
    assert torch.equal(layer(x), nn.functional.linear(x, qt, sd[f"{name}.bias"]))
    assert rel_err(layer(x), reference_output(name, x)) < TOLERANCE_4BIT["asym_w4a8_int8"]


def test_nvfp4_awq_pre_quant_scale_multiplies_the_input(plain_file, tmp_path):
    """A text encoder's NVFP4 AWQ layers (ModelOpt's export): the input times pre_quant_scale, then the NVFP4
    weight (of the weight divided by that scale), as upstream's Linear computes; the product is the bf16 layer's."""
    layers = ["blocks.0.ffn.0", "blocks.0.ffn.2"]
    scales = write_nvfp4_awq(plain_file, tmp_path / "awq.safetensors", layers)
    model, report, contents = build(tmp_path / "awq.safetensors")
    assert report.summary_line() == f"quantized 2/{len(LINEARS)} linear layers"
    sd, _ = load(tmp_path / "awq.safetensors")
    for name in layers:
        assert contents.layers[name].tensors["pre_quant_scale"] == f"{name}.pre_quant_scale"
        layer = model.get_submodule(name)
        assert layer.pre_quant_scale.dtype == torch.bfloat16 and torch.equal(layer.pre_quant_scale, scales[name])
        x = layer_input(name)
        # upstream (not native on CPU): input * scale in the input's dtype, then the dequantized weight
        unscaled = layer.method.dequantize(layer).float()
        host = nn.functional.linear(x * scales[name].float(), unscaled, sd[f"{name}.bias"].float())
        assert torch.allclose(layer(x), host, rtol=0, atol=1e-6), name
        # measured 0.102-0.104 (AWQ-like scales exp(N(0, 0.3)) on random weights)
        assert rel_err(layer(x), reference_output(name, x)) < TOLERANCE["nvfp4"], name
        # a fused input activation comes first, then the smoothing (upstream: linear(act(x)))
        act = nn.functional.gelu(x, approximate="tanh")
        assert torch.allclose(layer(x, input_act="gelu_tanh"), layer(act), rtol=0, atol=1e-6)


def test_nvfp4_awq_requantized_folds_the_scale_into_the_weight(plain_file, tmp_path):
    name = "blocks.0.ffn.2"
    write_nvfp4_awq(plain_file, tmp_path / "awq.safetensors", [name])
    model, _, _ = build(tmp_path / "awq.safetensors", conversions={"nvfp4": "requantize"})
    layer = model.get_submodule(name)
    assert layer.method.describe() == "int8_convrot(g=256)" and not hasattr(layer, "pre_quant_scale")
    x = layer_input(name)
    assert rel_err(layer(x), reference_output(name, x)) < TOLERANCE["nvfp4"] + TOLERANCE["int8_convrot"]


class UpstreamNvfp4Linear(nn.Module):
    """Upstream ComfyUI's mixed-precision Linear as the quantization pass meets it: a comfy-kitchen NVFP4
    QuantizedTensor weight, its bias and AWQ's pre_quant_scale as parameters (comfy/ops.py)."""

    def __init__(self, weight, bias, pre_quant_scale):
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.bias = nn.Parameter(bias, requires_grad=False)
        self.pre_quant_scale = nn.Parameter(pre_quant_scale, requires_grad=False)


def test_nvfp4_awq_converts_alike_on_every_path(plain_file, tmp_path):
    """One dequantize-then-quantize routine (quant/linear.py's requantized_layer) for an NVFP4 layer with AWQ's
    pre_quant_scale: converted while loading (loaders/build.py), by the quantization pass from the loaded layer
    and from upstream's own layer (quant/quantize_pass.py), and by requantized_layer itself, the same tensors bit
    for bit; the scale folded into the weight, so the INT8 layer computes what the NVFP4 layer with its scale did."""
    from comfy_kitchen.tensor import QuantizedTensor, get_layout_class
    from bigdit.quant.linear import requantized_layer
    name, cpu = "blocks.0.ffn.2", torch.device("cpu")
    path = tmp_path / "awq.safetensors"
    scale = write_nvfp4_awq(plain_file, path, [name])[name]
    at_load = build(path, conversions={"nvfp4": "requantize"})[0].get_submodule(name)
    loaded = build(path)[0]
    stored = loaded.get_submodule(name)
    target = at_load.method
    assert target.describe() == "int8_convrot(g=256)" and "pre_quant_scale" in stored.stored_tensors()
    by_routine = requantized_layer(stored, target, cpu, cpu)
    config = QuantConfig(method=None, conversions={"nvfp4": "requantize"}, compute_device=cpu)
    by_pass = quantize_layers(loaded, config)[0][name]
    # upstream's layer holds the same NVFP4 weight (kitchen's quantization is deterministic) and scale
    sd = plain_state_dict()
    qdata, params = get_layout_class("TensorCoreNVFP4Layout").quantize(sd[f"{name}.weight"].float() / scale.float())
    upstream = UpstreamNvfp4Linear(QuantizedTensor(qdata, "TensorCoreNVFP4Layout", params), sd[f"{name}.bias"].float(),
                                   scale)
    by_pass_upstream = quantize_layers(nn.ModuleDict({"layer": upstream}), config)[0]["layer"]
    expected = at_load.stored_tensors()
    assert set(expected) == {"weight", "weight_scale"}
    for layer in (by_routine, by_pass, by_pass_upstream):
        assert layer.method.describe() == target.describe()
        got = layer.stored_tensors()
        assert set(got) == set(expected) and all(torch.equal(got[k], expected[k]) for k in expected)
    for layer in (by_routine, by_pass):
        assert torch.equal(layer.bias, at_load.bias)
    # measured 0.0097: the INT8 re-quantization's own error (0.29 without the scale folded in)
    x = layer_input(name)
    assert rel_err(at_load(x), stored(x)) < TOLERANCE["int8_convrot"]


def test_unknown_marker_keys_are_named_in_one_warning(plain_file, tmp_path, caplog):
    """Writers add keys (convert_to_quant's "orig_dtype"): loaded, and named once per file with their layers."""
    markers = {"blocks.0.self_attn.o": {"format": "int8_tensorwise", "orig_dtype": "bfloat16"},
               "blocks.0.ffn.0": {"format": "float8_e4m3fn", "orig_dtype": "bfloat16", "per_row": True},
               "blocks.0.ffn.2": {"format": "int8_tensorwise", "params": {"convrot": False, "note": 1}}}
    path = write_markers(plain_file, tmp_path / "keys.safetensors", markers)
    with caplog.at_level("WARNING"):
        contents = inspect_checkpoint(path)
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1, warnings
    assert warnings[0].startswith("[BigDiT] keys.safetensors: marker key(s) the loader does not read, so they "
                                  "change nothing: "), warnings[0]
    assert "'params.note' (layer: blocks.0.ffn.2)" in warnings[0], warnings[0]
    assert ("'orig_dtype' (layers: blocks.0.self_attn.o, blocks.0.ffn.0)" in warnings[0]
            or "'orig_dtype' (layers: blocks.0.ffn.0, blocks.0.self_attn.o)" in warnings[0]), warnings[0]
    assert warnings[0][len("[BigDiT] "):] in contents.describe()
    assert {name: layer.format for name, layer in contents.layers.items()} == {
        name: marker["format"] for name, marker in markers.items()}


def test_known_keys_in_both_places_give_no_warning(plain_file, tmp_path, caplog):
    marker = {"format": "int8_tensorwise", "params": {"convrot": True, "convrot_groupsize": 64}, "per_row": True}
    path = write_markers(plain_file, tmp_path / "ok.safetensors", {"blocks.0.ffn.0": marker})
    with caplog.at_level("WARNING"):
        contents = inspect_checkpoint(path)
    assert not [r for r in caplog.records if r.levelno == logging.WARNING]
    assert contents.layers["blocks.0.ffn.0"].options == {"convrot": True, "convrot_groupsize": 64}


# ---- files written by a real converter: convert_to_quant 1.3.4 ------------------

# Layer output error against the fp32 product of the file's own weights as the converter dequantizes
# them (ConvRot undone with its Hadamard matrix, NVFP4 through its PyTorch decoder) and the file's bias
# (its ConvRot calibration adjusts biases), relative L2. Measured on CPU: INT8 0.0064-0.0073 (only the
# activations are quantized), FP8 0.026 (E4M3 activations), NVFP4 0 (weight-only, dequantized per call).
CONVERTED_TOLERANCE = {"int8_row_convrot": 0.012, "int8_row": 0.012, "int8_tensor": 0.012, "fp8": 0.04,
                       "nvfp4": 1e-5}


@pytest.fixture(scope="module")
def converted(plain_file, tmp_path_factory):
    """{mode: path} of the plain file converted by convert_to_quant in every mode of CONVERTER_MODES."""
    folder = tmp_path_factory.mktemp("converted")
    files = {folder / f"{mode}.safetensors": mode for mode in CONVERTER_MODES}
    write_converted(plain_file, files)
    return {mode: path for path, mode in files.items()}


@pytest.mark.parametrize("mode, methods", [
    # ConvRot 256 where the input width allows, else the converter's fallback to 64
    ("int8_row_convrot", {n: f"int8_convrot(g={256 if n_in % 256 == 0 else 64})"
                          for n, (_, n_in) in LINEARS.items()}),
    ("int8_row", dict.fromkeys(LINEARS, "int8_tensorwise")),
    ("int8_tensor", dict.fromkeys(LINEARS, "int8_tensorwise")),
    ("fp8", dict.fromkeys(LINEARS, "float8_e4m3fn")),
    ("nvfp4", dict.fromkeys(LINEARS, "nvfp4")),
])
def test_convert_to_quant_files_load(converted, mode, methods):
    """Its markers are in both forms, the tensors' carrying extra keys ("per_row", "orig_dtype"): merged."""
    path = converted[mode]
    model, report, contents = build(path)
    assert contents.kind == "ComfyUI per-layer markers"
    assert {layer.source for layer in contents.layers.values()} == {"both forms"}
    assert report.summary_line() == f"quantized {len(LINEARS)}/{len(LINEARS)} linear layers"
    sd, _ = load(path)
    for name, method in methods.items():
        layer = model.get_submodule(name)
        assert layer.method.describe().split(" ")[0] == method, name
        x = layer_input(name)
        reference = nn.functional.linear(x, converter_dequantized(sd, name), sd[f"{name}.bias"].float())
        assert rel_err(layer(x), reference) < CONVERTED_TOLERANCE[mode], name


# ---- scales: legitimate layouts load, impossible values are refused (tests/bad_checkpoints.py) -----

@pytest.mark.parametrize("layout", ["[N, 1]", "[N]", "scalar", "F64"])
def test_int8_scale_layouts(plain_file, tmp_path, layout):
    name = "blocks.0.ffn.0"
    path = write_markers(plain_file, tmp_path / "int8.safetensors", {name: {"format": "int8_tensorwise"}})
    sd, _ = load(path)
    weight, scale = plain_state_dict()[f"{name}.weight"].float(), sd[f"{name}.weight_scale"]
    if layout == "scalar":
        scale = weight.abs().amax() / 127
        changed = {f"{name}.weight": torch.round(weight / scale).to(torch.int8), f"{name}.weight_scale": scale}
    else:
        changed = {f"{name}.weight_scale": {"[N, 1]": scale, "[N]": scale.reshape(-1), "F64": scale.double()}[layout]}
    model, _, _ = build(edit_checkpoint(path, tmp_path / "layout.safetensors", changed))
    x = layer_input(name)
    assert rel_err(model.get_submodule(name)(x), reference_output(name, x)) < TOLERANCE["int8_tensorwise"]


def test_large_scale_with_small_values_is_judged_by_the_values(plain_file, tmp_path):
    """The cheap bound 128 x max(scale) fails; the stored values' real max decides (here within float16)."""
    name = "blocks.0.ffn.0"
    path = write_markers(plain_file, tmp_path / "int8.safetensors", {name: {"format": "int8_tensorwise"}})
    rows, cols = LINEARS[name]
    edited = edit_checkpoint(path, tmp_path / "big.safetensors", {
        f"{name}.weight": torch.ones(rows, cols, dtype=torch.int8), f"{name}.weight_scale": torch.tensor(1000.0)})
    assert inspect_checkpoint(edited).layers[name].format == "int8_tensorwise"
    edited = edit_checkpoint(path, tmp_path / "bigger.safetensors", {
        f"{name}.weight": torch.full((rows, cols), 100, dtype=torch.int8), f"{name}.weight_scale": torch.tensor(1000.0)})
    with pytest.raises(CheckpointError, match=r"bigger.safetensors: int8_tensorwise weight_scale too large .* "
                                              r"reaches 1e\+05, beyond float16's range"):
        inspect_checkpoint(edited)


def test_quanto_activation_quantization_from_the_real_writer(plain_file, tmp_path):
    """optimum-quanto with activations=qint8: the error is the reason, naming the layers."""
    prefixes = ["blocks.0.ffn.0", "blocks.0.ffn.2"]
    path = write_quanto_reference(plain_file, tmp_path / "bad.safetensors", prefixes, activations="qint8")
    with pytest.raises(CheckpointError) as info:
        inspect_checkpoint(path)
    message = str(info.value)
    assert message.startswith("bad.safetensors: activation quantization is not supported: Quanto layers with "
                              "activations 'qint8'"), message
    assert "prefix-set" not in message and all(p in message for p in prefixes), message


# ---- bounded work on hostile files ---------------------------------------------

@pytest.mark.parametrize("form", ["tensor", "header"])
def test_inspection_of_24000_markers_is_fast(tmp_path, form):
    """Linear work: measured 1.2-1.8 s of CPU for the tensor form (24,000 markers, 72,000 tensors, a third
    of it parsing the 5 MB header JSON) on a loaded 2-core machine whose Python runs at about half a
    desktop's speed; the quadratic scan this replaces took 38 s. The bound is CPU time, for slow CI."""
    path = many_markers_file(tmp_path / "many.safetensors", 24000, form)
    start = time.process_time()
    contents = inspect_checkpoint(path)
    seconds = time.process_time() - start
    assert len(contents.layers) == 24000
    assert seconds < 4.0, seconds


def test_long_inspection_calls_the_check_and_stops_when_it_raises(tmp_path):
    path = many_markers_file(tmp_path / "many.safetensors", 3000)
    calls = []

    def check():
        calls.append(1)
        if len(calls) == 20:
            raise KeyboardInterrupt("stop")

    with pytest.raises(KeyboardInterrupt):
        inspect_checkpoint(path, check)
    assert len(calls) == 20
    calls.clear()
    inspect_checkpoint(path, lambda: calls.append(1))
    assert len(calls) >= 3 * 3000 // 256   # markers, layers and scales, one call per 256 each


def test_oversized_marker_is_refused_before_it_is_read(plain_file, tmp_path):
    from bad_checkpoints import bad_oversized_marker
    path = bad_oversized_marker(plain_file, tmp_path, tmp_path / "bad.safetensors")
    tracemalloc.start()
    start = time.perf_counter()
    with pytest.raises(CheckpointError, match="bad.safetensors: oversized marker: blocks.0.ffn.0.comfy_quant holds "
                                              r"\d+ bytes, over the 4096-byte bound"):
        inspect_checkpoint(path)
    seconds, (_, peak) = time.perf_counter() - start, tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert peak < 2 * 1024 * 1024, peak     # the 10 MB marker is never copied
    assert seconds < 1.0, seconds


@pytest.mark.parametrize("device, group, backend", [("cuda", 64, "eager"), ("cuda", 256, None), ("cpu", 64, None)])
def test_w4a8_runs_kitchens_eager_backend_where_its_cuda_kernel_cannot(device, group, backend):
    """comfy-kitchen's CUDA W4A8 GEMM rotates in groups of 256 only (it raises for 64, seen on the H200): a layer
    of another ConvRot group runs kitchen's eager backend on CUDA; kitchen picks its kernel everywhere else."""
    method = get_method("asym_w4a8_int8", group_size=group)
    assert method.kitchen_backend(torch.device(device)) == backend
