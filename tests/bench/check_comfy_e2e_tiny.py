"""tests/bench/comfy_e2e.py --tiny end to end: a real ComfyUI 0.3.75 per configuration, on CPU, with a tiny Wan.

Not part of the CI suite (its name is no test_*.py: it starts two ComfyUI servers and takes 40 s of CPU or
more); run it after changing the benchmark:

    python -m pytest tests/bench/check_comfy_e2e_tiny.py -q
"""
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parent / "comfy_e2e.py"

pytestmark = pytest.mark.integration


def test_tiny_run_measures_compares_and_records(tmp_path):
    out = tmp_path / "e2e.json"
    cmd = [sys.executable, str(BENCH), "--tiny", "--work", str(tmp_path / "w"),
           "--out", str(out), "--configs", "comfy_resident,pack_auto_sol,pack_auto_fp8attn",
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

    assert list(data)[-1] == "summary"
    assert data["summary"]["sol_speedup"] == pytest.approx(ref["step_s"] / sol["step_s"])
    assert data["summary"]["dense_speedup"] is None  # no dense configuration of the pack ran
    assert "===== tiny_wan long" in out.with_suffix(".log").read_text()
    assert not list((tmp_path / "w").rglob("*.safetensors"))  # the model file is deleted after its runs
