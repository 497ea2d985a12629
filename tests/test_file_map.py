"""loaders/file_map.release_file_map: a model that keeps few of its file's tensors as they are (a loader with
assign=True, as upstream's dynamic VRAM loads) gets them copied, and the file's map goes away."""
import gc

import safetensors.torch
import torch
from torch import nn

from bigdit.loaders import inspect_checkpoint
from bigdit.loaders.file_map import release_file_map


def mapped(path) -> bool:
    with open("/proc/self/maps") as f:
        return str(path) in f.read()


def write(tmp_path):
    gen = torch.Generator().manual_seed(0)
    tensors = {"big.weight": torch.randn(512, 512, generator=gen), "norm.weight": torch.randn(64, generator=gen),
               "norm.bias": torch.randn(64, generator=gen)}
    path = tmp_path / "m.safetensors"
    safetensors.torch.save_file(tensors, str(path))
    return path, tensors


def load(path, keep_big: bool):
    """A module holding the file's tensors as they are (assign=True); the big weight only if keep_big,
    else it stands for a layer a quantizing loader replaced."""
    module = nn.Module()
    module.norm = nn.LayerNorm(64)
    if keep_big:
        module.big = nn.Linear(512, 512, bias=False)
    with inspect_checkpoint(path).open() as source:
        sd = {key: source(key) for key in ("big.weight", "norm.weight", "norm.bias")}
        module.load_state_dict(sd if keep_big else {k: v for k, v in sd.items() if k != "big.weight"},
                               assign=True)
    return module, sd


def test_a_model_that_keeps_little_of_its_file_lets_the_map_go(tmp_path):
    path, tensors = write(tmp_path)
    module, sd = load(path, keep_big=False)
    gc.collect()
    assert mapped(path)  # the norm's tensors hold the whole file's map
    copied = release_file_map(module, sd.values(), path.stat().st_size)
    assert copied == 2 * 64 * 4
    del sd
    gc.collect()
    assert not mapped(path)
    assert torch.equal(module.norm.weight, tensors["norm.weight"]) and torch.equal(module.norm.bias,
                                                                                  tensors["norm.bias"])
    assert isinstance(module.norm.weight, nn.Parameter)


def test_a_model_that_is_its_file_stays_mapped(tmp_path):
    path, tensors = write(tmp_path)
    module, sd = load(path, keep_big=True)
    assert release_file_map(module, sd.values(), path.stat().st_size) == 0
    del sd
    gc.collect()
    assert mapped(path) and torch.equal(module.big.weight, tensors["big.weight"])


def test_tensors_outside_the_file_are_left_alone(tmp_path):
    path, _ = write(tmp_path)
    module = nn.LayerNorm(64)  # loaded with copies (assign=False)
    with inspect_checkpoint(path).open() as source:
        sd = {"weight": source("norm.weight"), "bias": source("norm.bias")}
        module.load_state_dict(sd)
    before = module.weight.data_ptr()
    assert release_file_map(module, sd.values(), path.stat().st_size) == 0 and module.weight.data_ptr() == before
