"""Read-ahead of a queued prompt's model files (host/read_ahead.py), on both hosts over HTTP.

A prompt with a node of the pack (SetVAEKernels on a tiny Wan VAE, decoded by VAEDecode) has the VAE file it
names read ahead: the server's log says it was queued and read, its bytes whole. The same file named again is not
read again; a prompt with no node of the pack (the same decode without SetVAEKernels) reads nothing ahead. Each
test names a VAE file of its own (a copy of the tiny VAE), so what other tests of the session read does not count.
"""
import re
import shutil
import time

import pytest
import safetensors.torch
import torch

pytestmark = pytest.mark.integration

LATENT = (1, 16, 2, 8, 8)


def vae_copy(comfy, tiny_vae, name) -> str:
    folder = comfy.models_dir / "vae"
    shutil.copyfile(folder / tiny_vae, folder / name)
    return name


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


def test_a_prompt_with_a_pack_node_has_its_files_read_ahead_once(comfy, tiny_vae):
    name = vae_copy(comfy, tiny_vae, "read_ahead_vae.safetensors")
    size = (comfy.models_dir / "vae" / name).stat().st_size
    start = len(comfy.log_text())
    comfy.run(graph(name, latent(comfy), with_pack=True))
    queued = log_after(comfy, start, r"\[BigDiT\] read-ahead: (\d+) files, ([\d.]+) GiB, queued: (.*)")
    assert queued and queued.group(1) == "1" and queued.group(3).strip() == name, comfy.log_text()[start:][-3000:]
    read = log_after(comfy, start, r"\[BigDiT\] read-ahead for a queued prompt: 1 files, ([\d.]+) GiB in")
    assert read and abs(float(read.group(1)) - size / 2 ** 30) < 0.01, comfy.log_text()[start:][-3000:]
    again = len(comfy.log_text())
    comfy.run(graph(name, latent(comfy), with_pack=True))
    time.sleep(1.0)
    assert "read-ahead" not in comfy.log_text()[again:]  # read once per server


def test_a_prompt_without_a_pack_node_reads_nothing_ahead(comfy, tiny_vae):
    name = vae_copy(comfy, tiny_vae, "no_read_ahead_vae.safetensors")
    start = len(comfy.log_text())
    comfy.run(graph(name, latent(comfy), with_pack=False))
    time.sleep(1.0)
    assert "read-ahead" not in comfy.log_text()[start:]
