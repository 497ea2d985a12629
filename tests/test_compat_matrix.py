"""tests/compat_matrix.py: cells from a JUnit report, a missing feature is an error."""
import pytest

import compat_matrix

CASES = """<testsuites><testsuite>
<testcase classname="tests.integration.test_mxfp4_workflow" name="test_mxfp4_latent[comfy-0.3.75]"/>
<testcase classname="tests.integration.test_mxfp4_workflow" name="test_mxfp4_ignored[comfy-0.33.0]"><failure message="x"/></testcase>
<testcase classname="tests.integration.test_without_kitchen" name="test_starts[comfy-0.3.75]"/>
<testcase classname="tests.integration.test_without_kitchen" name="test_starts[comfy-0.33.0]"><skipped message="ComfyUI 0.33.0 itself does not start without comfy-kitchen"/></testcase>
<testcase classname="tests.integration.test_checkpoint_loader_workflows" name="test_convert_to_quant_file[comfy-0.3.75-fp8]"/>
<testcase classname="tests.integration.test_checkpoint_loader_workflows" name="test_convert_to_quant_file[comfy-0.33.0-fp8]"/>
<testcase classname="tests.test_packaging" name="test_unit"/>
</testsuite></testsuites>"""


def test_cells_count_passes_failures_and_skip_reasons(tmp_path, monkeypatch):
    report = tmp_path / "suite.xml"
    report.write_text(CASES)
    monkeypatch.setattr(compat_matrix, "FEATURES", [
        ("MXFP4", ["test_mxfp4_workflow::"]),
        ("No kitchen", ["test_without_kitchen::"]),
        ("FP8 markers", ["test_checkpoint_loader_workflows::test_convert_to_quant_file[fp8"]),
    ])
    lines = compat_matrix.table([report]).splitlines()
    assert lines[0] == "| Feature | ComfyUI 0.3.75 | ComfyUI 0.33.0 |"
    assert lines[2] == "| MXFP4 | pass 1 | FAIL 1 |"
    assert lines[3] == "| No kitchen | pass 1 | skipped: ComfyUI 0.33.0 itself does not start without comfy-kitchen |"
    assert lines[4] == "| FP8 markers | pass 1 | pass 1 |"


def test_a_feature_no_test_ran_for_is_an_error(tmp_path, monkeypatch):
    report = tmp_path / "suite.xml"
    report.write_text(CASES)
    monkeypatch.setattr(compat_matrix, "FEATURES", [("Gone", ["test_renamed::"])])
    with pytest.raises(SystemExit, match="no test of 'Gone'"):
        compat_matrix.table([report])
