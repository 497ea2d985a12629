"""The first-call checks a quantize-once cache file carries (loaders/entry_checks.py), on CPU.

A miss is tests/test_real_error.py's load of a one-layer bf16 file through LayerBuilder, with `auto` as it chooses on
an sm89+ GPU (FP8, then INT8 ConvRot, then full precision), written as host/cache.py writes its file: the model's
tensors (save_contents), the pending checks' sketches and their metadata. A hit is that file loaded as stored, given
its checks again from the source file (attach_checks). The integration tests (tests/integration/
test_quant_cache_workflows.py) drive the same through LoadH3Quantized in a real ComfyUI.
"""
import json
from types import SimpleNamespace

import pytest
import torch

from test_real_error import (ERROR_BOUND, FP8, INT8, K, N, activations, count_calls, int8_converted_by_auto,  # noqa: F401
                             int8_file, load, plain_file, reference, rel_err, sm89_auto)

from bigdit.loaders import CheckpointContents, inspect_checkpoint
from bigdit.loaders.entry_checks import (CHECKS_METADATA, attach_checks, check_tensors, described_checks,
                                         fallbacks_path, keep_fallbacks, read_kept, take_kept)
from bigdit.loaders.errors import CheckpointError
from bigdit.loaders.safetensors_writer import write_safetensors
from bigdit.loaders.saving import save_contents
from bigdit.quant import QuantConfig, real_error
from bigdit.quant.real_error import OutputSketch, SKETCH_DIM


def write_entry(model, path):
    """The model written as the cache writes a miss's: its tensors, then its pending checks' sketches."""
    contents = save_contents(model.named_modules())
    checks, described = check_tensors({"proj": model.proj})
    write_safetensors(path, contents.tensors + checks,
                      {**contents.metadata("test"), **({CHECKS_METADATA: json.dumps(described)} if described else {})})
    return checks, described


def hit(entry, source, selector=None):
    """The cache file loaded as stored, its checks attached again from `source`; (model, how many)."""
    model, _ = load(entry)
    contents = inspect_checkpoint(entry)
    with contents.open() as held:
        count = attach_checks({"proj": model.proj}, held, described_checks(contents.header),
                              inspect_checkpoint(source), selector)
    return model, count


@pytest.fixture
def built(monkeypatch):
    """The formats of the layers the fallbacks quantize (their calls of quantized_layer), in order."""
    formats, original = [], real_error.quantized_layer

    def counted(method, *args, **kwargs):
        formats.append(method.name)
        return original(method, *args, **kwargs)
    monkeypatch.setattr(real_error, "quantized_layer", counted)
    return formats


def test_a_hit_checks_an_outlier_layer_as_the_miss_did_and_falls_back_the_same(tmp_path, sm89_auto, built,
                                                                                 monkeypatch):
    source, weight, bias = plain_file(tmp_path, outliers=True)
    miss, _ = load(source, online=QuantConfig(method=sm89_auto))
    entry = tmp_path / "entry.safetensors"
    checks, described = write_entry(miss, entry)
    assert described == {"proj": {"format": FP8, "fallbacks": [INT8, "full precision"]}}
    assert [(key, tensor.shape, tensor.dtype) for key, tensor in checks] == [
        ("proj.bigdit_check_sketch", (SKETCH_DIM, K), torch.bfloat16),
        ("proj.bigdit_check_sketch_bias", (SKETCH_DIM,), torch.float32)]
    assert sum(t.numel() * t.element_size() for _, t in checks) == 128 * K + 4 * SKETCH_DIM
    # the loaders claim the sketches as the layer's: never a tensor of the model's state dict
    contents = inspect_checkpoint(entry)
    assert set(contents.plain_keys) == {"proj.bias"} and set(contents.layers) == {"proj"}
    with contents.open() as held:
        assert not any("check" in key for key in contents.state_dict(held))

    x = activations(outliers=True)
    miss_out = miss.proj(x)
    assert miss.proj.real_error.runs == "full precision" and built == [INT8]
    opened, real_open = [], CheckpointContents.open
    monkeypatch.setattr(CheckpointContents, "open", lambda self, *a: opened.append(real_open(self, *a)) or opened[-1])
    model, count = hit(entry, source, sm89_auto)
    assert count == 1 and model.proj.method.name == FP8
    assert built == [INT8]  # attaching reads no fallback: each is built once its check rejects
    out = model.proj(x)
    outcome = model.proj.real_error
    assert (outcome.format, outcome.runs) == (FP8, "full precision") and built == [INT8, INT8]
    assert outcome.error == miss.proj.real_error.error and outcome.tried == miss.proj.real_error.tried
    assert torch.equal(out, miss_out) and rel_err(out, reference(x, weight, bias)) < 0.01
    # full precision computes from the hit's map of the source file, as the miss from its own: no copy
    route = model.proj.real_check.route
    assert opened[-1].path == str(source) and opened[-1].file_map.holds(route.weight)
    assert torch.equal(route.weight, weight)


def test_a_well_behaved_layer_is_accepted_on_the_hit_with_the_misses_output(tmp_path, sm89_auto, built):
    source, _, _ = plain_file(tmp_path, outliers=True)
    miss, _ = load(source, online=QuantConfig(method=sm89_auto))
    entry = tmp_path / "entry.safetensors"
    write_entry(miss, entry)
    model, _ = hit(entry, source, sm89_auto)
    x = activations(outliers=False)
    miss_out, out = miss.proj(x), model.proj(x)
    assert torch.equal(out, miss_out)
    assert model.proj.real_error.runs is None and model.proj.real_error.error == miss.proj.real_error.error < 0.05
    assert model.proj.real_check is None and built == []  # accepted: the check is gone, nothing was built


def test_a_fallback_taken_is_kept_and_the_next_load_takes_it_unchecked(tmp_path, sm89_auto, monkeypatch):
    source, weight, bias = plain_file(tmp_path, outliers=True)
    miss, _ = load(source, online=QuantConfig(method=sm89_auto))
    entry = tmp_path / "entry.safetensors"
    write_entry(miss, entry)
    kept_at = fallbacks_path(str(entry))
    assert kept_at == str(tmp_path / "entry.fallbacks.json")
    keep_fallbacks({"proj": miss.proj}, kept_at)
    x = activations(outliers=True)
    miss_out = miss.proj(x)
    kept = read_kept(kept_at)
    assert list(kept) == ["proj"] and kept["proj"]["runs"] == "full precision"
    assert kept["proj"]["error"] == miss.proj.real_error.error > ERROR_BOUND
    # the next load (a hit) builds the fallback at load; its first call is not checked
    model, _ = hit(entry, source, sm89_auto)
    assert take_kept({"proj": model.proj}, kept, torch.device("cpu")) == [("proj", kept["proj"])]
    assert torch.equal(model.proj.real_check.route.weight, weight)
    checked = count_calls(monkeypatch, OutputSketch, "error")
    out = model.proj(x)
    assert checked == [] and model.proj.real_error is None and torch.equal(out, miss_out)
    # a layer whose check is already done, or that has no such fallback, is left as it is
    assert take_kept({"proj": model.proj}, kept, torch.device("cpu")) == []
    other, _ = hit(entry, source, sm89_auto)
    assert take_kept({"proj": other.proj}, {"proj": {"runs": "nvfp4"}}, torch.device("cpu")) == []
    assert other.proj.real_check.pending


def test_a_kept_file_that_cannot_be_read_checks_again(tmp_path):
    path = tmp_path / "entry.fallbacks.json"
    assert read_kept(str(path)) == {}
    path.write_text("{not json")
    assert read_kept(str(path)) == {}
    path.write_text(json.dumps({"proj": {"runs": 3}, "ok": {"runs": "full precision"}}))
    assert read_kept(str(path)) == {"ok": {"runs": "full precision"}}


def test_a_conversion_falls_back_to_the_sources_stored_layer_on_the_hit(tmp_path, int8_converted_by_auto, monkeypatch):
    monkeypatch.setattr(real_error, "ERROR_BOUND", 0.02)   # FP8 0.037 over it, the stored INT8 0.012 within
    source = int8_file(tmp_path, outliers=False, convrot=True)
    miss, _ = load(source, conversions={"int8_tensorwise": "auto"})
    entry = tmp_path / "entry.safetensors"
    _, described = write_entry(miss, entry)
    assert described == {"proj": {"format": FP8, "fallbacks": [f"{INT8} as stored",
                                                                f"{INT8} dequantized, full precision"]}}
    x = activations(outliers=False)
    miss_out = miss.proj(x)
    model, _ = hit(entry, source)
    out = model.proj(x)
    assert model.proj.real_error.runs == f"{INT8} as stored" == miss.proj.real_error.runs
    assert torch.equal(out, miss_out)


def test_a_check_that_cannot_be_made_again_fails_the_hit_naming_the_file_and_layer(tmp_path, sm89_auto):
    source, _, _ = plain_file(tmp_path, outliers=True)
    miss, _ = load(source, online=QuantConfig(method=sm89_auto))
    entry = tmp_path / "entry.safetensors"
    checks, described = write_entry(miss, entry)
    model, _ = load(entry)
    contents = inspect_checkpoint(entry)
    with contents.open() as held:
        for said, problem in (({"proj": {"format": FP8, "fallbacks": ["full precision"]}},
                               "its fallbacks were full precision and are int8_convrot, full precision now"),
                              ({"proj": {"format": INT8, "fallbacks": []}}, "not a int8_convrot layer of the model"),
                              ({"other": described["proj"]}, "not a float8_e4m3fn layer")):
            with pytest.raises(CheckpointError, match=problem) as caught:
                attach_checks({"proj": model.proj}, held, said, inspect_checkpoint(source), sm89_auto)
            assert str(caught.value).startswith(f"{entry.name}: ") and f"(layer: {list(said)[0]})" in str(caught.value)
        with pytest.raises(CheckpointError, match="metadata is not a map of layers to checks"):
            described_checks(SimpleNamespace(path=str(entry), metadata={CHECKS_METADATA: "[1]"}))
    assert model.proj.real_check is None  # nothing attached
    # no auto (the load's quantization is another): its choice cannot be checked again
    with contents.open() as held, pytest.raises(CheckpointError, match="are none now"):
        attach_checks({"proj": model.proj}, held, described, inspect_checkpoint(source), None)
