"""LoRA and QuantizeModelINT8 in either order, in a real ComfyUI."""
import pytest
import torch
from safetensors.torch import save_file

from graphs import chain_id, wan_t2v_graph

pytestmark = pytest.mark.integration

TARGETS = {"blocks.0.ffn.0": (512, 256), "blocks.1.self_attn.q": (256, 256)}


@pytest.fixture(scope="module")
def lora_name(comfy):
    gen = torch.Generator().manual_seed(3)
    tensors = {}
    for module, (out_f, in_f) in TARGETS.items():
        tensors[f"diffusion_model.{module}.lora_up.weight"] = torch.randn(out_f, 4, generator=gen) * 0.3
        tensors[f"diffusion_model.{module}.lora_down.weight"] = torch.randn(4, in_f, generator=gen) * 0.3
    path = comfy.models_dir / "loras" / "tiny_wan2_lora.safetensors"
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path))
    return path.name


def lora(name):
    return ("LoraLoaderModelOnly", {"lora_name": name, "strength_model": 1.0})


QUANTIZE = ("QuantizeModelINT8", {"group_size": "16", "ignored_layers": ""})


def rel(a, b):
    return ((a - b).norm() / b.norm()).item()


def latent(comfy, tiny, chain):
    history = comfy.run(wan_t2v_graph(tiny["unet_name"], tiny["vae_name"], model_chain=chain))
    return history, comfy.latent(history, "save_latent")


def test_lora_after_quantization_applies(comfy, tiny_wan2, lora_name, request):
    if comfy.host.features()["kitchen_weights"]:
        # Owned elsewhere: on kitchen weights ComfyUI's patcher finds no set_weight on the layer.
        request.applymarker(pytest.mark.xfail(strict=True, reason=(
            "known defect: a LoRA after QuantizeModelINT8 is silently dropped where the quantized layers keep "
            "ComfyUI's class with a comfy-kitchen QuantizedTensor weight")))
    _, plain = latent(comfy, tiny_wan2, [])
    _, with_lora = latent(comfy, tiny_wan2, [lora(lora_name)])
    _, quantized = latent(comfy, tiny_wan2, [QUANTIZE])
    _, quantized_then_lora = latent(comfy, tiny_wan2, [QUANTIZE, lora(lora_name)])
    # The LoRA is applied, neither lost nor corrupted: adding it to the quantized
    # model moves the result most of the way to the original model with the LoRA.
    quantization_noise = rel(quantized, plain)
    assert rel(with_lora, plain) > 0.05
    assert rel(quantized_then_lora, with_lora) < rel(quantized, with_lora)
    # measured 1.5x on CPU (the LoRA's two layers requantized with fresh scales); a lost LoRA is 50x
    assert rel(quantized_then_lora, with_lora) < 2 * quantization_noise


def test_lora_before_quantization_keeps_patched_layers(comfy, tiny_wan2, lora_name):
    _, with_lora = latent(comfy, tiny_wan2, [lora(lora_name)])
    history, lora_then_quantized = latent(comfy, tiny_wan2, [lora(lora_name), QUANTIZE])
    report = history["outputs"][chain_id(1)]["text"][0]
    for module in TARGETS:
        assert f"{module}: has weight patches" in report
    assert rel(lora_then_quantized, with_lora) < 0.05
