"""The harness itself against stock ComfyUI: the tiny Wan graph runs, reproduces
exactly, errors surface as PromptError, and the bigdit pack imports."""
import shutil

import pytest
import torch

from comfy_harness import PromptError
from graphs import wan_t2v_graph

pytestmark = pytest.mark.integration


def test_bigdit_pack_imports(comfy):
    failures = comfy.import_failures()
    assert "bigdit" not in failures, f"bigdit failed to import: {failures['bigdit']}\n{comfy.log_text()[-6000:]}"
    modules = {info["python_module"] for info in comfy.object_info().values()}
    assert "custom_nodes.bigdit" in modules, "ComfyUI lists no node of the bigdit pack"


def test_test_nodes_loaded(comfy):
    assert "bigdit_testnodes" not in comfy.import_failures()
    assert "BigditZeroConditioning" in comfy.object_info()


@pytest.mark.parametrize("model", ["tiny_wan", "tiny_wan2"])
def test_baseline_graph(comfy, model, request):
    tiny = request.getfixturevalue(model)
    history = comfy.run(wan_t2v_graph(tiny["unet_name"], tiny["vae_name"]))
    (image,) = comfy.output_files(history, "save_image")
    assert image.is_file() and image.stat().st_size > 0
    latent = comfy.latent(history, "save_latent")
    assert latent.shape == (1, 16, 1, 8, 8)  # 64x64, 1 frame: 8x spatial compression
    assert torch.isfinite(latent).all() and latent.abs().sum() > 0


def test_runs_reproduce_exactly(comfy, tiny_wan):
    graph = wan_t2v_graph(tiny_wan["unet_name"], tiny_wan["vae_name"], seed=7)
    first, second = comfy.run(graph), comfy.run(graph)
    # --cache-none: the second run executed again and wrote a new file.
    files = [comfy.output_files(h, "save_latent", "latents") for h in (first, second)]
    assert files[0] != files[1]
    assert torch.equal(comfy.latent(first, "save_latent"), comfy.latent(second, "save_latent"))
    other = comfy.run(wan_t2v_graph(tiny_wan["unet_name"], tiny_wan["vae_name"], seed=8))
    assert not torch.equal(comfy.latent(first, "save_latent"), comfy.latent(other, "save_latent"))


def test_validation_error(comfy, tiny_wan):
    with pytest.raises(PromptError) as info:
        comfy.run(wan_t2v_graph("missing.safetensors", tiny_wan["vae_name"]))
    assert "unet" in info.value.node_errors
    assert "missing.safetensors" in info.value.message


def test_execution_error(comfy, tiny_wan):
    # A VAE file in diffusion_models/ passes validation and fails in UNETLoader.
    bogus = comfy.models_dir / "diffusion_models" / "not_a_unet.safetensors"
    shutil.copyfile(comfy.models_dir / "vae" / tiny_wan["vae_name"], bogus)
    try:
        with pytest.raises(PromptError) as info:
            comfy.run(wan_t2v_graph(bogus.name, tiny_wan["vae_name"]))
    finally:
        bogus.unlink()
    assert info.value.node_type == "UNETLoader"
    assert "unet" in info.value.node_errors
    assert "Could not detect model type" in info.value.message
