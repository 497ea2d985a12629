"""host/options.py: the nodes' option values and old spellings; loaders/load.py: prefix rules, the online config,
progress."""
import logging

import pytest
import torch
from safetensors.torch import save_file

from bigdit.loaders import inspect_checkpoint
from bigdit.loaders.load import online_config, online_method, parse_prefix_rules, progress_total
from bigdit.host.options import OFFLOAD_MODES, QUANTIZATIONS, load_conversions
from bigdit.quant import registry
from bigdit.quant.descriptor import QuantFormat
from bigdit.quant.keep import keep_patterns


def test_old_spellings_read_as_todays_and_are_logged(caplog):
    with caplog.at_level(logging.INFO, logger="bigdit.host.options"):
        assert QUANTIZATIONS.read("fp8_e4m3fn", "LoadH3Quantized") == "float8_e4m3fn"
        assert OFFLOAD_MODES.read("layerwise") == "auto"
        assert QUANTIZATIONS.read("mxfp4", "LoadH3Quantized") == "mxfp4"
    assert [r.getMessage() for r in caplog.records] == [
        "[BigDiT] LoadH3Quantized: quantization 'fp8_e4m3fn' is read as 'float8_e4m3fn'",
        "[BigDiT] offload 'layerwise' is read as 'auto': they always ran alike (stream what does not fit)"]


def test_unknown_values_are_named_with_the_choices():
    assert QUANTIZATIONS.problem("fp8_e4m3fn") is None and OFFLOAD_MODES.problem("layerwise") is None
    assert OFFLOAD_MODES.problem("all") == "offload mode must be one of auto, none, got 'all'"
    assert QUANTIZATIONS.problem("int4") == ("quantization must be one of auto, int8_convrot, float8_e4m3fn, "
                                             "mxfp4, convrot_w4a4, asym_w4a8_int8, none, got 'int4'")
    with pytest.raises(ValueError, match="offload mode must be one of auto, none, got 'all'"):
        OFFLOAD_MODES.read("all")


@pytest.fixture
def int4_stored():
    """A throwaway stored format with conversion modes, registered for one test."""
    @registry.register_format
    class Int4Stored(QuantFormat):
        name = "int4_stored"
        conversion_modes = ("keep", "requantize")
        conversion_option = "int4"
        conversion_tooltip = "INT4 layers. keep, or requantize to this GPU's fastest native format."
        conversion_rank = 2
    try:
        yield Int4Stored
    finally:
        registry._FORMATS.pop("int4_stored")


def test_the_loaders_conversion_inputs_are_the_registrys(int4_stored):
    """The loader nodes build their conversion inputs from the registry (nodes/loader_nodes.py): every format that
    declares one, in its rank; LoadH3Quantized leaves out a format its quantizing load converts by itself."""
    assert [spec.conversion_option for spec in registry.loader_conversions()] == ["nvfp4", "int8", "int4"]
    assert [spec.conversion_option for spec in registry.loader_conversions(quantizing=True)] == ["int8", "int4"]
    assert load_conversions({}) == (("nvfp4", "auto"), ("int8", "auto"), ("int4", "keep"))
    assert load_conversions({"nvfp4": "requantize", "int4": "requantize"}) == (
        ("nvfp4", "requantize"), ("int8", "auto"), ("int4", "requantize"))
    assert load_conversions({"int8": "keep"}, quantizing=True) == (
        ("nvfp4", "requantize"), ("int8", "keep"), ("int4", "keep"))


def test_prefix_rules():
    assert parse_prefix_rules("text_model. -> \n\n  a.b -> c.  \n") == [("text_model.", ""), ("a.b", "c.")]
    assert parse_prefix_rules("") == [] and parse_prefix_rules(None) == []
    for bad in ("no arrow", " -> new"):
        with pytest.raises(ValueError, match="rename_prefixes: expected 'old -> new'"):
            parse_prefix_rules(bad)


def test_online_config_keeps_the_architecture_layers_then_the_users(tmp_path):
    """A Wan-shaped file: its head and time projection kept by default, before the user's patterns."""
    tensors = {name: torch.zeros(4, 4) for name in
               ("head.head.weight", "time_projection.1.weight", "blocks.0.ffn.0.weight")}
    tensors["blocks.0.ffn.0.bias"] = torch.zeros(4)
    save_file(tensors, tmp_path / "wan.safetensors")
    contents = inspect_checkpoint(tmp_path / "wan.safetensors")
    assert progress_total(contents) == 3  # the three matrices, not the bias
    assert online_config(None, torch.device("cpu"), contents, "blocks.*") is None
    config = online_config(online_method("int8_convrot", 64, torch.device("cpu")), torch.device("cpu"), contents,
                           "blocks.*")
    assert config.ignored == ("head.*", "time_projection.*", "blocks.*")
    assert config.ignored == keep_patterns(["head.head", "time_projection.1"], "blocks.*")
    with pytest.raises(ValueError, match="unknown quantization method 'int4'; valid: .*int8_convrot"):
        online_method("int4", 64, torch.device("cpu"))
