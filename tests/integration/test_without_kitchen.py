"""A real ComfyUI whose Python cannot import comfy-kitchen (comfy_harness.NO_KITCHEN_SHIM on PYTHONPATH).

The server starts and lists the pack's nodes; a node that would build quantized
layers fails when it loads, with one message naming the package and the nodes
affected (never a bare ModuleNotFoundError in the KSampler); a plain load runs
without it; the server keeps serving. Only on hosts that start without
comfy-kitchen: upstream 0.33.0's own attention module imports it, so there
the server cannot start and the tests are skipped, saying so.
"""
import os
import re

import pytest
import torch

from checkpoint_files import write_markers
from comfy_harness import TESTS_DIR, ComfyServer, PromptError
from graphs import wan_t2v_graph

pytestmark = pytest.mark.integration

# On PYTHONPATH, makes `import comfy_kitchen` fail as if it were not installed.
NO_KITCHEN_SHIM = TESTS_DIR / "fixtures" / "without_kitchen"


@pytest.fixture(scope="module")
def bare(comfy, tiny_wan, tmp_path_factory):
    """The server, with the tiny Wan, its VAE and an FP8 marker file of it."""
    pythonpath = os.pathsep.join(filter(None, [str(NO_KITCHEN_SHIM), os.environ.get("PYTHONPATH")]))
    folder = tmp_path_factory.mktemp("comfy_without_kitchen")
    try:
        server = ComfyServer(folder, comfy.host, env={"PYTHONPATH": pythonpath})
    except RuntimeError:
        log = (folder / "comfyui.log").read_text(errors="replace")
        # ComfyUI's own import of it, before any custom node loads: this host cannot run without it.
        if re.search(r"\nModuleNotFoundError: No module named 'comfy_kitchen'\s*$", log) and "custom_nodes" not in log:
            pytest.skip(f"ComfyUI {comfy.host.version} itself does not start without comfy-kitchen")
        raise
    for sub, name in (("diffusion_models", tiny_wan["unet_name"]), ("vae", tiny_wan["vae_name"])):
        (server.models_dir / sub / name).symlink_to(comfy.models_dir / sub / name)
    write_markers(tiny_wan["path"], server.models_dir / "diffusion_models" / "fp8.safetensors",
                  {"blocks.0.ffn.0": {"format": "float8_e4m3fn"}})
    yield server
    server.stop()


def baseline(server, tiny_wan):
    return server.latent(server.run(wan_t2v_graph(tiny_wan["unet_name"], tiny_wan["vae_name"])), "save_latent")


def test_the_server_starts_with_the_pack(bare):
    assert "bigdit" not in bare.import_failures()
    assert {"MixedCheckpointLoader", "LoadH3Quantized", "QuantizeModelINT8"} <= set(bare.object_info())


@pytest.mark.parametrize("case", ["marker file", "online fp8", "QuantizeModelINT8"])
def test_quantized_loads_fail_at_load_naming_the_package(bare, tiny_wan, case):
    if case == "marker file":
        node, graph = "MixedCheckpointLoader", wan_t2v_graph(None, tiny_wan["vae_name"], loader=(
            "MixedCheckpointLoader", {"unet_name": "fp8.safetensors"}))
    elif case == "online fp8":
        node, graph = "LoadH3Quantized", wan_t2v_graph(None, tiny_wan["vae_name"], loader=(
            "LoadH3Quantized", {"unet_name": tiny_wan["unet_name"], "quantization": "float8_e4m3fn",
                                "offload": "none"}))
    else:
        node, graph = "QuantizeModelINT8", wan_t2v_graph(tiny_wan["unet_name"], tiny_wan["vae_name"], model_chain=[
            ("QuantizeModelINT8", {"group_size": "64", "ignored_layers": ""})])
    with pytest.raises(PromptError) as info:
        bare.run(graph)
    message = info.value.message
    assert info.value.node_type == node, message
    assert (f"KitchenMissing: {node} needs the package comfy-kitchen, which cannot be imported "
            "(No module named 'comfy_kitchen')") in message, message
    assert all(name in message for name in ("QuantizeModelINT8", "MixedCheckpointLoader", "LoadH3Quantized",
                                            "QuantizedCLIPLoader")), message


def test_plain_loads_run_and_the_server_keeps_serving(bare, tiny_wan):
    """LoadH3Quantized with quantization none on a plain file builds no quantized layer: it runs as
    UNETLoader does."""
    reference = baseline(bare, tiny_wan)
    history = bare.run(wan_t2v_graph(None, tiny_wan["vae_name"], loader=(
        "LoadH3Quantized", {"unet_name": tiny_wan["unet_name"], "quantization": "none", "offload": "none"})))
    assert torch.equal(bare.latent(history, "save_latent"), reference)
    assert bare.alive() and torch.equal(baseline(bare, tiny_wan), reference)
