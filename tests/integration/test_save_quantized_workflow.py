"""SaveQuantizedModel in a real ComfyUI: the saved file loads back and samples like the model that was saved.

The tiny Wan model (2 blocks, dim 256) is quantized (QuantizeModelINT8, or
LoadH3Quantized while loading), sampled, and saved; the saved file is then
loaded by MixedCheckpointLoader and sampled with the same seed. On CPU the
same tensors give the same latent bit for bit, so that is what is asserted.
Where the host's own UNETLoader reads `int8_tensorwise` markers (upstream
ComfyUI), the file must also load through it and match the in-memory model;
where it does not (0.3.75), it must fail loudly rather than load int8 codes as
weights.
"""
import json
import re

import pytest
import torch
from safetensors import safe_open

from checkpoint_files import write_lora
from comfy_harness import PromptError
from graphs import node_report, rel_l2, wan_t2v_graph

pytestmark = pytest.mark.integration

QUANTIZE = ("QuantizeModelINT8", {"group_size": "256", "ignored_layers": ""})
LORA_TARGETS = {"blocks.0.ffn.0": (512, 256), "head.head": (64, 256)}  # one quantized layer, one kept plain
# Relative L2 distance of a latent from the bf16 model's (measured on CPU: FP8 0.004; the loaders' tests bound it
# at 0.05), for the one comparison that is not bit for bit: ComfyUI 0.3.75's own FP8 path dequantizes weights and
# keeps activations in full precision, where the pack quantizes activations per token.
FP8_TOLERANCE = 0.05


def host_reads_int8_markers(comfy) -> bool:
    """Whether the host's UNETLoader reads `int8_tensorwise` comfy_quant markers natively.

    Feature-detected from the host's source (no import of ComfyUI into the test
    process): `int8_tensorwise` among `comfy.quant_ops.QUANT_ALGOS`, and
    `comfy_quant` tensors read by `comfy.utils`.
    """
    quant_ops = (comfy.comfyui / "comfy" / "quant_ops.py").read_text()
    utils = (comfy.comfyui / "comfy" / "utils.py").read_text()
    return bool(re.search(r'["\']int8_tensorwise["\']\s*\]?\s*[:=]', quant_ops)) and ".comfy_quant" in utils



def sample(comfy, tiny, chain=(), loader=None):
    graph = wan_t2v_graph(tiny["unet_name"], tiny["vae_name"], model_chain=chain, loader=loader)
    return comfy.latent(comfy.run(graph), "save_latent")


def save_graph(loader, chain=(), filename="x.safetensors", overwrite=False):
    graph = {"unet": {"class_type": loader[0], "inputs": dict(loader[1])}}
    model = "unet"
    for i, (class_type, inputs) in enumerate(chain):
        graph[f"m{i}"] = {"class_type": class_type, "inputs": {**inputs, "model": [model, 0]}}
        model = f"m{i}"
    graph["save"] = {"class_type": "SaveQuantizedModel",
                     "inputs": {"model": [model, 0], "filename": filename, "overwrite": overwrite}}
    return graph


def save(comfy, loader, chain=(), filename="x.safetensors", overwrite=False) -> str:
    history = comfy.run(save_graph(loader, chain, filename, overwrite))
    return node_report(history, "save")


def unet_loader(name):
    return ("UNETLoader", {"unet_name": name, "weight_dtype": "default"})


def unet(tiny):
    return unet_loader(tiny["unet_name"])


def h3(tiny, quantization):
    return ("LoadH3Quantized", {"unet_name": tiny["unet_name"], "quantization": quantization, "offload": "none"})


def mixed(name):
    return ("MixedCheckpointLoader", {"unet_name": name})


def tensors(path):
    with safe_open(str(path), "pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}, f.metadata()


@pytest.fixture(scope="module")
def int8_file(comfy, tiny_wan2):
    """UNETLoader -> QuantizeModelINT8 -> SaveQuantizedModel, and the in-memory model's latent."""
    name = "saved/wan2_int8.safetensors"
    text = save(comfy, unet(tiny_wan2), [QUANTIZE], filename=name)
    return {"name": name, "path": comfy.models_dir / "diffusion_models" / name, "text": text,
            "latent": sample(comfy, tiny_wan2, [QUANTIZE])}


def test_int8_save_reports_and_keeps_every_tensor(comfy, tiny_wan2, int8_file):
    text = int8_file["text"]
    assert text.startswith(f"saved models/diffusion_models/{int8_file['name']} (")
    saved, meta = tensors(int8_file["path"])
    source, _ = tensors(tiny_wan2["path"])
    markers = json.loads(meta["_quantization_metadata"])["layers"]
    assert f"quantized layers: {len(markers)} (int8_tensorwise (convrot, group 256) x{len(markers)})" in text
    assert markers and all(m == {"format": "int8_tensorwise", "convrot": True, "convrot_groupsize": 256}
                           for m in markers.values())
    for layer, marker in markers.items():
        assert json.loads(saved[f"{layer}.comfy_quant"].numpy().tobytes()) == marker
        assert saved[f"{layer}.weight"].dtype == torch.int8
        assert saved[f"{layer}.weight_scale"].shape == (saved[f"{layer}.weight"].shape[0], 1)
    # Every key of the source file is there; what was not quantized holds the source's values exactly.
    assert set(source) <= set(saved)
    for key, value in source.items():
        if key.rsplit(".", 1)[0] not in markers or key.endswith(".bias"):
            assert torch.equal(saved[key].float(), value.float()), key
    assert meta["bigdit_saved_by"] == "SaveQuantizedModel" and meta["bigdit_version"]
    assert not list(int8_file["path"].parent.glob(".*partial"))


def test_int8_file_loads_through_mixed_loader_bit_identical(comfy, tiny_wan2, int8_file):
    latent = sample(comfy, tiny_wan2, loader=mixed(int8_file["name"]))
    assert torch.equal(latent, int8_file["latent"]), rel_l2(latent, int8_file["latent"])


def test_int8_file_through_the_hosts_own_unet_loader(comfy, tiny_wan2, int8_file):
    if not host_reads_int8_markers(comfy):
        pytest.skip("host lacks native int8_tensorwise markers")
    latent = sample(comfy, tiny_wan2, loader=unet_loader(int8_file["name"]))
    # upstream's own INT8 layers, not the pack's: the same tensors, another float order (measured 8e-8)
    assert rel_l2(latent, int8_file["latent"]) < 1e-4, rel_l2(latent, int8_file["latent"])


def test_int8_file_fails_loudly_where_the_host_lacks_int8_markers(comfy, tiny_wan2, int8_file):
    if host_reads_int8_markers(comfy):
        pytest.skip("host has native int8_tensorwise markers (the round trip above runs instead)")
    # ComfyUI 0.3.75 reads the header form and has no int8_tensorwise: an error, never int8 codes taken for weights.
    with pytest.raises(PromptError, match="int8_tensorwise"):
        sample(comfy, tiny_wan2, loader=unet_loader(int8_file["name"]))


FOUR_BIT_MARKERS = {"convrot_w4a4": {"format": "convrot_w4a4", "convrot_groupsize": 256},
                    "asym_w4a8_int8": {"format": "asym_w4a8_int8", "group_size": 16, "convrot_groupsize": 256}}


@pytest.mark.parametrize("quantization", ["int8_convrot", "float8_e4m3fn", *FOUR_BIT_MARKERS])
def test_quantized_while_loading_saves_and_loads_bit_identical(comfy, tiny_wan2, quantization):
    name = f"saved/wan2_h3_{quantization}.safetensors"
    text = save(comfy, h3(tiny_wan2, quantization), filename=name)
    assert "other tensors, as they were" in text
    in_memory = sample(comfy, tiny_wan2, loader=h3(tiny_wan2, quantization))
    latent = sample(comfy, tiny_wan2, loader=mixed(name))
    assert torch.equal(latent, in_memory), rel_l2(latent, in_memory)
    if quantization in FOUR_BIT_MARKERS:
        saved, meta = tensors(comfy.models_dir / "diffusion_models" / name)
        markers = json.loads(meta["_quantization_metadata"])["layers"]
        assert markers and all(m == FOUR_BIT_MARKERS[quantization] for m in markers.values()), markers
        if comfy.host.lacks("four_bit_markers") is None:
            # upstream's plain UNETLoader reads the markers: its own layers, the same kitchen linear
            native = sample(comfy, tiny_wan2, loader=unet_loader(name))
            assert rel_l2(native, in_memory) < 1e-4, rel_l2(native, in_memory)
    if quantization == "float8_e4m3fn":
        # FP8 markers are what ComfyUI 0.3.75 reads natively (header form): its own loader takes the file too.
        bf16 = sample(comfy, tiny_wan2)
        native = sample(comfy, tiny_wan2, loader=unet_loader(name))
        assert 0 < rel_l2(native, bf16) < FP8_TOLERANCE


def test_quantize_model_w4a8_saves_upstreams_markers(comfy, tiny_wan2):
    """QuantizeModelINT8 with quantization asym_w4a8_int8 (comfy-kitchen's quantizer, layer by layer): the saved
    file samples the in-memory model's latent through MixedCheckpointLoader, and through upstream's own
    UNETLoader where the host reads the format."""
    chain = [("QuantizeModelINT8", {"group_size": "256", "ignored_layers": "", "quantization": "asym_w4a8_int8"})]
    name = "saved/wan2_w4a8.safetensors"
    text = save(comfy, unet(tiny_wan2), chain, filename=name)
    assert "(asym_w4a8_int8 x" in text, text
    in_memory = sample(comfy, tiny_wan2, chain)
    assert 1e-4 < rel_l2(in_memory, sample(comfy, tiny_wan2)) < 0.05
    assert torch.equal(sample(comfy, tiny_wan2, loader=mixed(name)), in_memory)
    if comfy.host.lacks("four_bit_markers") is None:
        native = sample(comfy, tiny_wan2, loader=unet_loader(name))
        assert rel_l2(native, in_memory) < 1e-4, rel_l2(native, in_memory)


@pytest.fixture(scope="module")
def lora_name(comfy):
    return write_lora(comfy.models_dir / "loras" / "save_test_lora.safetensors", LORA_TARGETS, seed=5)


def test_a_lora_sampled_on_a_clone_is_not_saved(comfy, tiny_wan2, lora_name):
    """A LoRA clone that sampled (so its patches are written into the shared layers) leaves the saved file
    as the model without it."""
    name = "saved/wan2_h3_after_lora.safetensors"
    graph = wan_t2v_graph(None, tiny_wan2["vae_name"], loader=h3(tiny_wan2, "int8_convrot"),
                          model_chain=[("LoraLoaderModelOnly", {"lora_name": lora_name, "strength_model": 1.0})])
    graph["after"] = {"class_type": "BigditModelAfter", "inputs": {"model": ["unet", 0], "after": ["sampler", 0]}}
    graph["save"] = {"class_type": "SaveQuantizedModel",
                     "inputs": {"model": ["after", 0], "filename": name, "overwrite": False}}
    with_lora = comfy.latent(comfy.run(graph), "save_latent")
    without = sample(comfy, tiny_wan2, loader=h3(tiny_wan2, "int8_convrot"))
    assert rel_l2(with_lora, without) > 0.01  # the LoRA did change the sampling
    latent = sample(comfy, tiny_wan2, loader=mixed(name))
    assert torch.equal(latent, without), rel_l2(latent, without)


def test_a_model_with_pending_lora_patches_is_refused(comfy, tiny_wan2, lora_name):
    chain = [("LoraLoaderModelOnly", {"lora_name": lora_name, "strength_model": 1.0}), QUANTIZE]
    with pytest.raises(PromptError, match="weight patches") as info:
        save(comfy, unet(tiny_wan2), chain, filename="saved/lora.safetensors")
    assert "head.head.weight" in info.value.message
    assert not (comfy.models_dir / "diffusion_models" / "saved" / "lora.safetensors").exists()


def test_plain_model_is_refused(comfy, tiny_wan2):
    with pytest.raises(PromptError, match="no quantized layers"):
        save(comfy, unet(tiny_wan2), filename="saved/plain.safetensors")
    assert not (comfy.models_dir / "diffusion_models" / "saved" / "plain.safetensors").exists()


def test_existing_file_is_kept_unless_overwrite(comfy, tiny_wan2):
    name = "saved/overwrite.safetensors"
    path = comfy.models_dir / "diffusion_models" / name
    save(comfy, unet(tiny_wan2), [QUANTIZE], filename=name)
    first = path.read_bytes()
    path.write_bytes(first[:100])  # stands for any file already there
    with pytest.raises(PromptError, match="already exists; set overwrite"):
        save(comfy, unet(tiny_wan2), [QUANTIZE], filename=name)
    assert path.read_bytes() == first[:100]
    save(comfy, unet(tiny_wan2), [QUANTIZE], filename=name, overwrite=True)
    assert path.read_bytes() == first
    assert not list(path.parent.glob(".*partial"))


@pytest.mark.parametrize("filename, message", [
    ("../escape.safetensors", "not allowed"),
    ("saved/../../escape.safetensors", "not allowed"),
    ("/models/escape.safetensors", "relative"),
    ("C:/escape.safetensors", "relative"),
    ("model.ckpt", "must end in .safetensors"),
    (".hidden.safetensors", "not allowed"),
    ("", "empty"),
])
def test_bad_filenames_are_refused(comfy, tiny_wan2, filename, message):
    before = sorted(comfy.models_dir.rglob("*"))
    with pytest.raises(PromptError, match=message):
        save(comfy, unet(tiny_wan2), [QUANTIZE], filename=filename)
    assert sorted(comfy.models_dir.rglob("*")) == before
