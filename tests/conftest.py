"""Test setup: import the pack's core as package `bigdit` without running the
pack's ComfyUI entry point (which needs ComfyUI), and session fixtures for the
integration tests that drive a real ComfyUI server.

Every test that uses `comfy` (directly or through `tiny_wan`, `tiny_vae`, ...)
runs once per host of tests/comfy_harness.py's HOSTS, with the host in its id
(`test_x[comfy-0.3.75]`, `test_x[comfy-0.33.0]`); `--host VERSION` (repeatable)
picks hosts. A host whose source cannot be had here (comfy_harness `Host.missing()`,
e.g. no shared/ beside the clone) is left out, and the run's summary says so in one
line; with `CI` set, or named by `--host`, it fails the tests instead. A test that needs a host feature says so with
`@pytest.mark.host_feature("minimax_h3", ...)` (names: comfy_harness.FEATURES)
and is skipped on a host that lacks it, with the reason "ComfyUI <v> lacks ...";
inside a test, `if reason := comfy.host.lacks(...): pytest.skip(reason)`.
Unit tests run in each host's venv (.ci/run); one that needs a comfy-kitchen API
that the venv's (pinned) comfy-kitchen may lack says
`@pytest.mark.kitchen_feature("sol_attn")` and is skipped where it is missing.
"""
import sys
import types
from importlib.metadata import version
from pathlib import Path

import pytest

from comfy_harness import HOSTS, ComfyServer, in_ci
from tiny_models import H3_TEXT_DIM, make_tiny_h3, make_tiny_wan, make_tiny_wan_vae

PACK_ROOT = Path(__file__).resolve().parent.parent

if "bigdit" not in sys.modules:
    _pkg = types.ModuleType("bigdit")
    _pkg.__path__ = [str(PACK_ROOT)]
    sys.modules["bigdit"] = _pkg


def pytest_addoption(parser):
    parser.addoption("--host", action="append", choices=[h.version for h in HOSTS], metavar="VERSION",
                     help=f"run the integration tests on this ComfyUI host only (repeatable; "
                          f"default: all of {', '.join(h.version for h in HOSTS)})")


def pytest_configure(config):
    config.addinivalue_line("markers", "host_feature(*names): needs these host features (comfy_harness.FEATURES); "
                                       "skipped on a host that lacks one")
    config.addinivalue_line("markers", "kitchen_feature(*names): needs these comfy_kitchen attributes; "
                                       "skipped where this venv's comfy-kitchen lacks one")


LEFT_OUT_HOSTS = pytest.StashKey[dict]()


def hosts_to_test(config):
    """(hosts to test, {version: why it is left out}): those --host names, else every host but those missing
    outside CI."""
    chosen = config.getoption("host")
    if chosen:
        return [h for h in HOSTS if h.version in chosen], {}
    left_out = {} if in_ci() else {h.version: reason for h in HOSTS if (reason := h.missing())}
    return [h for h in HOSTS if h.version not in left_out], left_out


def pytest_terminal_summary(terminalreporter, config):
    for version, reason in config.stash.get(LEFT_OUT_HOSTS, {}).items():
        terminalreporter.write_line(f"skipped host ComfyUI {version}: {reason}", yellow=True)


def pytest_generate_tests(metafunc):
    if "comfy" in metafunc.fixturenames:
        hosts, metafunc.config.stash[LEFT_OUT_HOSTS] = hosts_to_test(metafunc.config)
        metafunc.parametrize("comfy", hosts, indirect=True, scope="session",
                             ids=[f"comfy-{h.version}" for h in hosts])


def pytest_runtest_setup(item):
    needed = [name for mark in item.iter_markers("kitchen_feature") for name in mark.args]
    if needed:
        import comfy_kitchen
        missing = [name for name in needed if not hasattr(comfy_kitchen, name)]
        if missing:
            pytest.skip(f"comfy-kitchen {version('comfy-kitchen')} lacks {', '.join(missing)}")
    marks = list(item.iter_markers("host_feature"))
    if not marks:
        return
    host = getattr(item, "callspec", None) and item.callspec.params.get("comfy")
    if host is None:
        raise pytest.UsageError(f"{item.nodeid}: host_feature needs a test that uses the comfy fixture")
    reason = host.lacks(*(name for mark in marks for name in mark.args))
    if reason:
        pytest.skip(reason)


@pytest.fixture(autouse=True)
def triton_launches_compile_in_place(request, monkeypatch):
    """A GPU test launches the kernel it tests: Triton compiles it at its launch, never on a pool while another
    computes the call (tests/test_compile_ahead.py turns that back on where it tests it; off CUDA it is off)."""
    if request.node.get_closest_marker("gpu"):
        monkeypatch.setenv("BIGDIT_TRITON_COMPILE_AHEAD", "0")


# ---- integration fixtures: a real ComfyUI server and tiny Wan and H3 models --

@pytest.fixture(scope="session")
def comfy(request, tmp_path_factory):
    """One headless ComfyUI per host for the whole session (see tests/comfy_harness.py)."""
    host = request.param
    try:
        host.check()
    except Exception as e:  # never skip a host that was asked for: it must fail the run
        how = host.missing() or "run `bash .ci/setup_env.sh`"
        pytest.fail(f"ComfyUI {host.version} is not set up ({e}); {how}, or choose hosts with --host", pytrace=False)
    server = ComfyServer(tmp_path_factory.mktemp(f"comfy-{host.version}"), host)
    yield server
    server.stop()


@pytest.fixture(scope="session")
def tiny_vae(comfy):
    path = make_tiny_wan_vae(comfy.models_dir / "vae" / "tiny_wan_vae.safetensors", host=comfy.host)
    return path.name


def _tiny_unet(comfy, tiny_vae, name, **shape):
    path = make_tiny_wan(comfy.models_dir / "diffusion_models" / name, host=comfy.host, **shape)
    return {"unet_name": name, "vae_name": tiny_vae, "path": path}


@pytest.fixture(scope="session")
def tiny_wan(comfy, tiny_vae):
    """1 block, dim 128, 1 head: {"unet_name", "vae_name", "path"}."""
    return _tiny_unet(comfy, tiny_vae, "tiny_wan.safetensors")


@pytest.fixture(scope="session")
def tiny_wan2(comfy, tiny_vae):
    """2 blocks, dim 256, 2 heads (ComfyUI fixes head dim at 128), ffn 512."""
    return _tiny_unet(comfy, tiny_vae, "tiny_wan2.safetensors", num_layers=2, num_heads=2, dim=256, ffn_dim=512)


@pytest.fixture(scope="session")
def tiny_h3(comfy):
    """MiniMax-H3 from upstream's own class: 2 blocks, 1 refiner block, hidden 256, 2 heads x 128,
    ffn 512, text_dim 512 (tests/tiny_models.py): {"unet_name", "path", "text_dim"}. Needs a host
    with MiniMax-H3 (mark the test host_feature("minimax_h3"))."""
    if reason := comfy.host.lacks("minimax_h3"):
        pytest.skip(reason)
    name = "tiny_h3.safetensors"
    path = make_tiny_h3(comfy.models_dir / "diffusion_models" / name, host=comfy.host)
    return {"unet_name": name, "path": path, "text_dim": H3_TEXT_DIM}
