"""The short reports a node shows (1-3 lines) against the full ones, and a plan before any run."""
from bigdit.offload.plan import plan_placement
import torch

from bigdit.quant import get_method
from bigdit.quant.layer import KEEP, QUANTIZE, Layer
from bigdit.quant.report import GIB, QuantReport
from offload_helpers import h3_shape


def record(name, action, method, reason, before, after, stored=None):
    layer = Layer(name, 64, 64, torch.bfloat16, stored=stored).decided(action, method, reason)
    layer.bytes_before, layer.bytes_after = before, after
    return layer


def report() -> QuantReport:
    int8 = get_method("int8_convrot")
    records = [record("a", QUANTIZE, int8, "", 2 * GIB, GIB), record("b", QUANTIZE, int8, "", 2 * GIB, GIB),
               record("c", KEEP, None, "", 2 * GIB, GIB, stored="float8_e4m3fn"),
               record("head", KEEP, None, "ignored (matches 'head*')", GIB, GIB)]
    return QuantReport("test", records, notes=["checkpoint x.safetensors: plain"],
                       headline_notes=["nvfp4 layers on cpu: dequantized before each matmul x1"])


def test_brief_is_two_lines_with_formats_saving_kept_and_headline_notes():
    assert report().brief() == [
        "quantized 2/4 linear layers: int8_convrot x2; already quantized: float8_e4m3fn x1",
        "weights: 7 GiB -> 4 GiB (saved 3 GiB); 1 kept in original precision; "
        "nvfp4 layers on cpu: dequantized before each matmul x1",
    ]


def test_full_report_holds_what_the_brief_leaves_out():
    lines = report().render().splitlines()
    assert lines[0] == "quantized 2/4 linear layers"
    assert "checkpoint x.safetensors: plain" in lines  # a note only the full report shows
    assert "nvfp4 layers on cpu: dequantized before each matmul x1" in lines
    assert lines[-2:] == ["kept in original precision (1):", "  head: ignored (matches 'head*')"]


def test_plan_before_a_run_claims_no_activations():
    before = plan_placement([GIB] * 4, GIB, 0, capacity_bytes=8 * GIB, reserve_bytes=0, workspace_bytes=0)
    assert before.summary_line() == "resident 4/4 blocks, streaming 0; peak before activations 5.0 GiB of 8.0 GiB"
    assert "activations" not in before.render().replace("peak before activations", "")
    shape = h3_shape(1000)
    during = plan_placement([GIB] * 4, GIB, 50 * 1024 ** 2, 8 * GIB, 0, workspace_bytes=0, shape=shape)
    assert during.summary_line().startswith("resident 4/4 blocks, streaming 0; estimated peak 5.0 GiB")
    assert "activations 50.00 MiB" in during.render()
