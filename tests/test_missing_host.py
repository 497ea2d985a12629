"""A host whose source cannot be had (no shared/ beside the clone): left out with one line saying how to
provide it, or, with CI set, an error (tests/comfy_harness.py, tests/conftest.py)."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

import comfy_harness

TESTS = Path(__file__).resolve().parent
UPSTREAM = next(h for h in comfy_harness.HOSTS if h.version == "0.33.0")


@pytest.fixture
def no_shared(tmp_path, monkeypatch):
    """An empty cache and a shared folder without the upstream tarball; CI unset."""
    env = {"BIGDIT_CACHE": str(tmp_path / "cache"), "BIGDIT_SHARED": str(tmp_path / "shared")}
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    monkeypatch.delenv("CI", raising=False)
    return tmp_path


def run(args, env_extra=None):
    env = {**os.environ, **(env_extra or {})}
    return subprocess.run([sys.executable, *args], cwd=TESTS.parent, env=env, capture_output=True, text=True,
                          timeout=120)


def test_missing_names_the_tarball_and_how_to_provide_it(no_shared):
    reason = UPSTREAM.missing()
    assert str(no_shared / "shared" / "hosts" / "comfyui-0.33.0.tar.gz") in reason
    assert "BIGDIT_SHARED" in reason and "shared/" in reason


def test_a_tarball_or_an_unpacked_source_is_not_missing(no_shared):
    tarball = no_shared / "shared" / "hosts" / "comfyui-0.33.0.tar.gz"
    tarball.parent.mkdir(parents=True)
    tarball.write_bytes(b"")
    assert UPSTREAM.missing() is None
    tarball.unlink()
    UPSTREAM.comfyui.mkdir(parents=True)
    (UPSTREAM.comfyui / "comfyui_version.py").write_text('__version__ = "0.33.0"\n')
    assert UPSTREAM.missing() is None


def test_setup_skips_the_missing_host_outside_ci_and_fails_in_ci(no_shared):
    skipped = run(["tests/comfy_harness.py", "--only", "0.33.0"])
    assert skipped.returncode == 0 and skipped.stdout == ""
    assert skipped.stderr.startswith("skipping ComfyUI 0.33.0: ") and "BIGDIT_SHARED" in skipped.stderr
    failed = run(["tests/comfy_harness.py", "--only", "0.33.0"], {"CI": "true"})
    assert failed.returncode != 0 and "CI is set" in failed.stderr and "comfyui-0.33.0.tar.gz" in failed.stderr
    listed = run(["tests/comfy_harness.py", "--missing"])
    assert listed.stdout.splitlines() == [f"skipped host ComfyUI 0.33.0: {UPSTREAM.missing()}"]


def test_pytest_leaves_the_missing_host_out_and_says_so_once(no_shared):
    collect = ["-m", "pytest", "tests/integration/test_object_info_snapshot.py", "--collect-only", "-q"]
    outside_ci = run(collect)
    assert "[comfy-0.3.75]" in outside_ci.stdout and "[comfy-0.33.0]" not in outside_ci.stdout
    assert outside_ci.stdout.count("skipped host ComfyUI 0.33.0: ") == 1
    in_ci = run(collect, {"CI": "true"})
    assert "[comfy-0.3.75]" in in_ci.stdout and "[comfy-0.33.0]" in in_ci.stdout
    assert "skipped host" not in in_ci.stdout
    asked = run([*collect, "--host", "0.33.0"])
    assert "[comfy-0.33.0]" in asked.stdout and "skipped host" not in asked.stdout
