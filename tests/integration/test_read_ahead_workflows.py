"""Read-ahead of a queued prompt's model files (host/read_ahead.py), on both hosts over HTTP.

On a server started with the pack's default (BIGDIT_READ_AHEAD unset: on), a prompt with a node of the pack (SetVAEKernels on a tiny Wan VAE,
decoded by VAEDecode) has the VAE file it names read ahead: the server's log says it was queued and read, its bytes
whole. The same file named again is not read again; a prompt with no node of the pack (the same decode without
SetVAEKernels) reads nothing ahead. On the session's server (BIGDIT_READ_AHEAD=0, as comfy_harness starts test
servers) nothing is read ahead. Each test names a VAE file of its own (a copy of the tiny VAE). A text encoder
read ahead has its page cache dropped as a diffusion model the pack loaded (or SetAttentionBackend changed) starts
sampling, once; the VAE of a prompt naming a diffusion model is read once that model's first call returned. A
LoRA behind an If/Else Switch that is off is not read.
"""
import re
import shutil
import time
import urllib.error

import pytest
import safetensors.torch
import torch

from comfy_harness import ComfyServer
from graphs import wan_t2v_graph

pytestmark = pytest.mark.integration

LATENT = (1, 16, 2, 8, 8)


def vae_copy(comfy, tiny_vae, name, server=None) -> str:
    shutil.copyfile(comfy.models_dir / "vae" / tiny_vae, (server or comfy).models_dir / "vae" / name)
    return name


@pytest.fixture(scope="module")
def reading(comfy, tmp_path_factory):
    """A server of the same host with the pack's default: the switch left out of its environment."""
    server = ComfyServer(tmp_path_factory.mktemp(f"read-ahead-{comfy.host.version}"), comfy.host,
                         env={"BIGDIT_READ_AHEAD": None})
    yield server
    server.stop()


def graph(vae_name, latent_name, with_pack: bool) -> dict:
    vae = ["kernels", 0] if with_pack else ["vae", 0]
    nodes = {"vae": {"class_type": "VAELoader", "inputs": {"vae_name": vae_name}},
             "latent": {"class_type": "LoadLatent", "inputs": {"latent": latent_name}},
             "decode": {"class_type": "VAEDecode", "inputs": {"samples": ["latent", 0], "vae": vae}},
             "save": {"class_type": "BigditSaveImages", "inputs": {"images": ["decode", 0], "name": vae_name}}}
    if with_pack:
        nodes["kernels"] = {"class_type": "SetVAEKernels", "inputs": {"vae": ["vae", 0], "attention": "auto",
                                                                      "linears": "pack", "weights": "resident"}}
    return nodes


def latent(comfy) -> str:
    folder = comfy.base_dir / "input"
    folder.mkdir(exist_ok=True)
    samples = torch.randn(LATENT, generator=torch.Generator().manual_seed(0))
    safetensors.torch.save_file({"latent_tensor": samples, "latent_format_version_0": torch.tensor([])},
                                str(folder / "read_ahead.latent"))
    return "read_ahead.latent"


def log_after(comfy, start: int, pattern: str, timeout: float = 30.0):
    """The first match of `pattern` in the server's log after `start`, waiting up to `timeout` s for it."""
    deadline = time.monotonic() + timeout
    while True:
        found = re.search(pattern, comfy.log_text()[start:])
        if found or time.monotonic() > deadline:
            return found
        time.sleep(0.1)


def test_a_prompt_with_a_pack_node_has_its_files_read_ahead_once(comfy, tiny_vae, reading):
    name = vae_copy(comfy, tiny_vae, "read_ahead_vae.safetensors", reading)
    size = (reading.models_dir / "vae" / name).stat().st_size
    start = len(reading.log_text())
    reading.run(graph(name, latent(reading), with_pack=True))
    queued = log_after(reading, start, r"\[BigDiT\] read-ahead: (\d+) files, ([\d.]+) GiB, queued: (.*)")
    assert queued and queued.group(1) == "1" and queued.group(3).strip() == name, reading.log_text()[start:][-3000:]
    read = log_after(reading, start, r"\[BigDiT\] read-ahead for a queued prompt: 1 files, ([\d.]+) GiB in")
    assert read and abs(float(read.group(1)) - size / 2 ** 30) < 0.01, reading.log_text()[start:][-3000:]
    again = len(reading.log_text())
    reading.run(graph(name, latent(reading), with_pack=True))
    time.sleep(1.0)
    assert "read-ahead" not in reading.log_text()[again:]  # read once per server


def job_loaders(comfy, tiny_vae, reading, prefix) -> tuple[dict, dict]:
    """(file names by models folder, a prompt's loaders of them: text encoder, diffusion model, a LoRA on it, VAE),
    each file a copy of the tiny VAE named after `prefix`."""
    names = {folder: f"{prefix}_{folder}.safetensors" for folder in ("text_encoders", "loras", "diffusion_models",
                                                                      "vae")}
    for folder, name in names.items():
        (reading.models_dir / folder).mkdir(parents=True, exist_ok=True)
        shutil.copyfile(comfy.models_dir / "vae" / tiny_vae, reading.models_dir / folder / name)
    return names, {
        "vae": {"class_type": "VAELoader", "inputs": {"vae_name": names["vae"]}},
        "dit": {"class_type": "UNETLoader", "inputs": {"unet_name": names["diffusion_models"],
                                                       "weight_dtype": "default"}},
        "lora": {"class_type": "LoraLoaderModelOnly", "inputs": {"model": ["dit", 0], "strength_model": 1.0,
                                                                 "lora_name": names["loras"]}},
        "clip": {"class_type": "CLIPLoader", "inputs": {"clip_name": names["text_encoders"],
                                                        "type": "stable_diffusion"}}}


def queued_files(reading, prompt, count: int):
    """Queue `prompt` (it has no output node: refused, after the handler ran); the files the read-ahead queued then,
    and those it deferred, once it read the queued ones."""
    start = len(reading.log_text())
    with pytest.raises(urllib.error.HTTPError):
        reading._request("/prompt", {"prompt": prompt})
    queued = log_after(reading, start, rf"\[BigDiT\] read-ahead: {count} files, [\d.]+ GiB, queued: ([^;\n]*)"
                                       r"(?:; after a diffusion model's first step: ([^\n]*))?\n")
    assert queued, reading.log_text()[start:][-3000:]
    assert log_after(reading, start, rf"\[BigDiT\] read-ahead for a queued prompt: {count} files")  # done
    return queued.group(1).strip().split(", "), (queued.group(2) or "").strip().split(", ")


def test_files_are_read_in_the_order_a_job_needs_them_whole(comfy, tiny_vae, reading):
    """Text encoder, LoRA, diffusion model, VAE, whatever the prompt's node order: with no node of the pack on the
    diffusion model (SetVAEKernels only), nothing is deferred to its first step, which the pack does not see."""
    names, prompt = job_loaders(comfy, tiny_vae, reading, "order")
    prompt["kernels"] = {"class_type": "SetVAEKernels", "inputs": {"vae": ["vae", 0], "attention": "auto",
                                                                   "linears": "pack", "weights": "resident"}}
    queued, deferred = queued_files(reading, prompt, 4)
    assert queued == [names[f] for f in ("text_encoders", "loras", "diffusion_models", "vae")] and deferred == [""]


@pytest.mark.parametrize("lightning", [False, True])
def test_a_lora_behind_a_switch_that_is_off_is_not_read(comfy, tiny_vae, reading, lightning):
    """The template's Lightning toggle: a Boolean primitive drives an If/Else Switch between the diffusion model and
    the LoRA loader on it. Off, the LoRA's file is not read ahead (the switch never evaluates that input); on, it
    is. SetAttentionBackend on the model: the VAE deferred to its first step."""
    names, prompt = job_loaders(comfy, tiny_vae, reading, f"switch_{lightning}")
    prompt.update({"toggle": {"class_type": "PrimitiveBoolean", "inputs": {"value": lightning}},
                   "switch": {"class_type": "ComfySwitchNode", "inputs": {"switch": ["toggle", 0],
                                                                          "on_false": ["dit", 0],
                                                                          "on_true": ["lora", 0]}},
                   "attention": {"class_type": "SetAttentionBackend", "inputs": {"model": ["switch", 0]}}})
    expected = ["text_encoders", "loras", "diffusion_models"] if lightning else ["text_encoders", "diffusion_models"]
    queued, deferred = queued_files(reading, prompt, len(expected))
    assert queued == [names[f] for f in expected] and deferred == [names["vae"]]


def test_a_prompt_without_a_pack_node_reads_nothing_ahead(comfy, tiny_vae, reading):
    name = vae_copy(comfy, tiny_vae, "no_read_ahead_vae.safetensors", reading)
    start = len(reading.log_text())
    reading.run(graph(name, latent(reading), with_pack=False))
    time.sleep(1.0)
    assert "read-ahead" not in reading.log_text()[start:]


def test_with_the_switch_off_nothing_is_read_ahead(comfy, tiny_vae):
    name = vae_copy(comfy, tiny_vae, "switch_off_vae.safetensors")
    start = len(comfy.log_text())
    comfy.run(graph(name, latent(comfy), with_pack=True))
    time.sleep(1.0)
    assert "read-ahead" not in comfy.log_text()[start:]


@pytest.mark.parametrize("pack_node", ["MixedCheckpointLoader", "SetAttentionBackend"])
def test_a_text_encoder_read_ahead_is_dropped_from_the_page_cache_when_sampling_starts(comfy, tiny_wan, reading,
                                                                                       pack_node):
    """The tiny Wan loaded by MixedCheckpointLoader, or by UNETLoader through SetAttentionBackend, and a
    text-encoder file named by a CLIPLoader that no output needs (so ComfyUI never loads it, but the prompt names
    it): read ahead as the prompt is queued, its pages dropped when a sampling starts, and once. The VAE is read
    once the diffusion model's first call returned."""
    for folder, name in (("diffusion_models", tiny_wan["unet_name"]), ("vae", tiny_wan["vae_name"])):
        (reading.models_dir / folder).mkdir(parents=True, exist_ok=True)
        shutil.copyfile(comfy.models_dir / folder / name, reading.models_dir / folder / name)
    (reading.models_dir / "text_encoders").mkdir(parents=True, exist_ok=True)
    encoder, vae = f"held_te_{pack_node}.safetensors", f"deferred_vae_{pack_node}.safetensors"
    shutil.copyfile(comfy.models_dir / "vae" / tiny_wan["vae_name"], reading.models_dir / "text_encoders" / encoder)
    shutil.copyfile(comfy.models_dir / "vae" / tiny_wan["vae_name"], reading.models_dir / "vae" / vae)
    if pack_node == "MixedCheckpointLoader":
        graph = wan_t2v_graph(None, vae, loader=("MixedCheckpointLoader", {"unet_name": tiny_wan["unet_name"]}))
    else:
        graph = wan_t2v_graph(tiny_wan["unet_name"], vae, model_chain=[
            ("SetAttentionBackend", {"backend": "sdpa", "dense_backend": "sdpa", "sol_tau": 1.0, "dense_steps": 0,
                                     "dense_layers": ""})])
    graph["te"] = {"class_type": "CLIPLoader", "inputs": {"clip_name": encoder, "type": "wan"}}
    start = len(reading.log_text())
    reading.run(graph)
    read = log_after(reading, start, r"\[BigDiT\] read-ahead for a queued prompt: \d files")
    assert read, reading.log_text()[start:][-3000:]
    assert re.search(rf"read-ahead: .*; after a diffusion model's first step: {re.escape(vae)}\n",
                     reading.log_text()[start:]), reading.log_text()[start:][-3000:]
    assert log_after(reading, start, r"\[BigDiT\] read-ahead for a diffusion model's first step: 1 files"), \
        reading.log_text()[start:][-3000:]
    graph["sampler"]["inputs"]["seed"] = 1  # a new job; its sampling drops the pages if the first one's (which may
    reading.run(graph)                       # start before the tiny files are read whole) did not
    log = reading.log_text()[start:]
    dropped = re.findall(r"\[BigDiT\] read-ahead: dropped the page cache of (.*) \(([\d.]+) GiB\)", log)
    names = [name for line, _ in dropped for name in line.split(", ")]  # with earlier tests' encoders, read before
    assert names.count(encoder) == 1, log[-3000:]
    again = len(reading.log_text())
    graph["sampler"]["inputs"]["seed"] = 2
    reading.run(graph)
    assert "dropped the page cache" not in reading.log_text()[again:]
