"""tests/bench/comfy_e2e.py --tiny end to end: a real ComfyUI per configuration, on CPU, with a tiny Wan
(0.3.75 with the test venv's python; upstream 0.33.0 with its own venv, for its marker files and flags).

Not part of the CI suite (its name is no test_*.py: it starts several ComfyUI servers and takes minutes of
CPU); run it after changing the benchmark:

    python -m pytest tests/bench/check_comfy_e2e_tiny.py -q
"""
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parent / "comfy_e2e.py"
sys.path.insert(0, str(BENCH.parents[1]))
from comfy_harness import HOSTS  # noqa: E402

pytestmark = pytest.mark.integration


def test_tiny_run_measures_compares_and_records(tmp_path):
    out = tmp_path / "e2e.json"
    cmd = [sys.executable, str(BENCH), "--tiny", "--work", str(tmp_path / "w"),
           "--out", str(out), "--configs", "comfy_resident,pack_auto_sol,pack_auto_fp8attn,comfy_int8_marker",
           "--fp8-attention-backend", "no_such_backend"]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    data = json.loads(out.read_text())
    by = {r["config"]: r for r in data["results"]}
    ref, sol, fp8 = by["comfy_resident"], by["pack_auto_sol"], by["pack_auto_fp8attn"]

    assert ref["status"] == "ok" and sol["status"] == "ok", (ref.get("error"), sol.get("error"))
    for rec in (ref, sol):
        assert rec["calls_per_step"] == [1, 1]  # cfg 1: one model call per step, 2 steps
        assert rec["step_s"] == rec["step_seconds"][1] > 0
        assert 0 < rec["loader_s"] <= rec["load_s"] < rec["wall_s"]
        assert rec["latent_shape"] == [1, 16, 3, 8, 12]  # 96x64x9: 3 latent frames of 8x12
    assert ref["rel_l2"] == 0.0 and ref["vs_resident"] == 1.0 and not ref["capped"]
    # host memory against the weights (issue 19): the quantized model is the smaller, the ratios are of each one's
    for rec in (ref, sol):
        assert rec["host_rss_peak_over_weights"] == pytest.approx(rec["host_rss_peak_gib"] / rec["weights_gib"])
        assert rec["host_rss_sampling_over_weights"] == pytest.approx(rec["host_rss_sampling_gib"] / rec["weights_gib"])
    assert sol["weights_gib"] < ref["weights_gib"]
    # the pack quantized the model (24 of 26 layers: the head and the time projection stay), so the latent moved
    assert re.search(r"quantized 24/26 linear layers", sol["pack_reports"]["unet"])
    assert sol["pack_reports"]["m0"].startswith("attention: backend sol, tau 1")
    # 72 tokens: Sol hands every call to the dense backend, and the log says what ran
    assert any(line.startswith("[BigDiT] Set Attention Backend (backend sol") and "ran auto:sdpa" in line
               for line in sol["log_lines"])
    assert 0 < sol["rel_l2"] < 0.05 and sol["cosine"] > 0.999 and sol["capped"]
    assert sol["cap_applied"] is False  # no CUDA here: vram_cap says so and runs ComfyUI as is
    assert any("emulated card is not applied" in line for line in sol["log_lines"])
    # a backend the pack does not offer is skipped, named, and costs no server start
    assert fp8["status"] == "skipped" and "does not offer 'no_such_backend'" in fp8["error"]
    assert "server_start_s" not in fp8
    # a configuration this host cannot run (0.3.75 has no comfy-kitchen markers) is skipped before its file is made
    marker = by["comfy_int8_marker"]
    assert marker["status"] == "skipped" and "lacks kitchen_markers" in marker["error"]
    assert list(data["models"]) == ["tiny_wan"]
    assert data["environment"]["host_features"] == {"dynamic_vram": False, "kitchen_markers": False}

    assert list(data)[-1] == "summary"
    assert data["summary"]["sol_speedup"] == pytest.approx(ref["step_s"] / sol["step_s"])
    assert data["summary"]["dense_speedup"] is None  # no dense configuration of the pack ran
    assert "===== tiny_wan long" in out.with_suffix(".log").read_text()
    assert not list((tmp_path / "w").rglob("*.safetensors"))  # the model file is deleted after its runs


def test_tiny_upstream_runs_its_marker_files_and_dynamic_vram_flag(tmp_path):
    host = next(h for h in HOSTS if h.version == "0.33.0")
    host.check()
    out = tmp_path / "e2e.json"
    cmd = [str(host.python), str(BENCH), "--tiny", "--comfyui", str(host.comfyui), "--work", str(tmp_path / "w"),
           "--out", str(out), "--configs", "comfy_resident,comfy_capped_static,comfy_int8_marker,comfy_fp8_marker"]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    data = json.loads(out.read_text())
    assert data["environment"]["host_features"] == {"dynamic_vram": True, "kitchen_markers": True}
    by = {r["config"]: r for r in data["results"]}
    assert all(r["status"] == "ok" for r in by.values()), {n: r.get("error") for n, r in by.items()}
    # the flag reached the server, and on CPU it changes nothing: the same latent as the reference
    assert by["comfy_capped_static"]["comfy_args"] == ["--disable-dynamic-vram"]
    assert by["comfy_capped_static"]["rel_l2"] == 0.0
    # one model file per format, each the reference's weights: 20 block linears quantized, the rest as they were
    for fmt in ("int8_convrot", "fp8"):
        assert data["models"][f"tiny_wan:{fmt}"]["quantized_layers"] == 20
    # upstream's own quantized layers ran: close to the bf16 latent, not equal to it
    for name, bound in (("comfy_int8_marker", 0.05), ("comfy_fp8_marker", 0.1)):
        assert 0 < by[name]["rel_l2"] < bound and by[name]["cosine"] > 0.99, (name, by[name]["rel_l2"])
    log = out.with_suffix(".log").read_text()
    assert "Dynamic vram disabled with argument" in log
    assert not list((tmp_path / "w").rglob("*.safetensors"))
