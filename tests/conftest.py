"""Test setup: import the pack's core as package `bigdit` without running the
pack's ComfyUI entry point (which needs ComfyUI), and session fixtures for the
integration tests that drive a real ComfyUI server."""
import sys
import types
from pathlib import Path

import pytest

from comfy_harness import COMFYUI_VERSION, ComfyServer, ensure_comfyui
from tiny_models import make_tiny_wan, make_tiny_wan_vae

PACK_ROOT = Path(__file__).resolve().parent.parent

if "bigdit" not in sys.modules:
    _pkg = types.ModuleType("bigdit")
    _pkg.__path__ = [str(PACK_ROOT)]
    sys.modules["bigdit"] = _pkg


# ---- integration fixtures: a real ComfyUI server and tiny Wan models --------

@pytest.fixture(scope="session")
def comfy(tmp_path_factory):
    """One headless ComfyUI for the whole session (see tests/comfy_harness.py)."""
    try:
        comfyui = ensure_comfyui()
    except Exception as e:  # never skip: a missing ComfyUI must fail the run
        pytest.fail(f"ComfyUI {COMFYUI_VERSION} could not be obtained ({e}); run `bash .ci/setup_env.sh` "
                    f"or point BIGDIT_COMFYUI at an unpacked ComfyUI {COMFYUI_VERSION}", pytrace=False)
    server = ComfyServer(tmp_path_factory.mktemp("comfy"), comfyui)
    yield server
    server.stop()


@pytest.fixture(scope="session")
def tiny_vae(comfy):
    path = make_tiny_wan_vae(comfy.models_dir / "vae" / "tiny_wan_vae.safetensors", comfyui=comfy.comfyui)
    return path.name


def _tiny_unet(comfy, tiny_vae, name, **shape):
    path = make_tiny_wan(comfy.models_dir / "diffusion_models" / name, comfyui=comfy.comfyui, **shape)
    return {"unet_name": name, "vae_name": tiny_vae, "path": path}


@pytest.fixture(scope="session")
def tiny_wan(comfy, tiny_vae):
    """1 block, dim 128, 1 head: {"unet_name", "vae_name", "path"}."""
    return _tiny_unet(comfy, tiny_vae, "tiny_wan.safetensors")


@pytest.fixture(scope="session")
def tiny_wan2(comfy, tiny_vae):
    """2 blocks, dim 256, 2 heads (ComfyUI fixes head dim at 128), ffn 512."""
    return _tiny_unet(comfy, tiny_vae, "tiny_wan2.safetensors", num_layers=2, num_heads=2, dim=256, ffn_dim=512)
