"""loaders/load.py, the one load pipeline, and how often it calls back into the host (nodes/ in ComfyUI).

The walk of LoadH3Quantized's `quantization` input, from the node to the quantized layer, is the call stack
at the moment the layer is made. Here a stub host stands where host/building.py stands in ComfyUI; the
stack is read when `quantized_layer` runs and every step from a core frame into a host frame is counted."""
import traceback
from pathlib import Path

import torch
from safetensors.torch import save_file
from torch import nn

from bigdit.loaders import build as build_module
from bigdit.loaders.load import LoadOptions, load
from bigdit.quant.linear import QuantLinear

PACK_ROOT = Path(__file__).resolve().parent.parent
HOST_FILE = Path(__file__).resolve()
SHAPES = {"blocks.0.ffn.0": (256, 128), "blocks.0.ffn.2": (128, 256)}


class StubHost:
    """The Host protocol as host/building.ComfyHost implements it, on a plain torch model."""
    layer_type = QuantLinear

    def __init__(self):
        self.calls = []

    def check(self):
        self.calls.append("check")

    def progress(self, total):
        self.calls.append("progress")
        return lambda: None

    def file_slices(self, path):
        self.calls.append("file_slices")
        return None

    def namespace(self, contents):
        self.calls.append("namespace")
        return contents

    def build(self, contents, builder, state_dict):
        self.calls.append("build")
        model = nn.ModuleDict({name.replace(".", "_"): nn.Linear(n_in, n_out) for name, (n_out, n_in) in SHAPES.items()})
        for name, (n_out, n_in) in SHAPES.items():
            built = builder.build(name, state_dict[f"{name}.weight"], n_in, n_out, state_dict[f"{name}.bias"],
                                  torch.bfloat16, None)
            if built is not None:
                model[name.replace(".", "_")] = built
        builder.finish()
        return model, model


def side(filename: str) -> str | None:
    """"core" for the pack outside host/, nodes/ and tests/, "host" for this stub (host/ in ComfyUI), else None."""
    path = Path(filename).resolve()
    if not path.is_file():  # frozen modules
        return None
    if path == HOST_FILE:
        return "host"
    if PACK_ROOT in path.parents and path.relative_to(PACK_ROOT).parts[0] not in ("host", "nodes", "tests"):
        return "core"
    return None


def test_the_walk_to_a_quantized_layer_crosses_back_to_the_host_once(tmp_path, monkeypatch):
    gen = torch.Generator().manual_seed(0)
    tensors = {}
    for name, (n_out, n_in) in SHAPES.items():
        tensors[f"{name}.weight"] = (torch.randn(n_out, n_in, generator=gen) / 16).to(torch.bfloat16)
        tensors[f"{name}.bias"] = torch.zeros(n_out, dtype=torch.bfloat16)
    save_file(tensors, tmp_path / "model.safetensors")

    stacks = []
    real = build_module.quantized_layer

    def recording(*args, **kwargs):
        stacks.append([side(frame.filename) for frame in traceback.extract_stack()[:-1]])  # not this wrapper
        return real(*args, **kwargs)

    monkeypatch.setattr(build_module, "quantized_layer", recording)
    host = StubHost()
    options = LoadOptions("LoadH3Quantized", quantization="int8_convrot", group_size=64)
    model, report = load(str(tmp_path / "model.safetensors"), options, torch.device("cpu"), host)
    assert len(stacks) == len(SHAPES) and report.records[0].format == "int8_convrot"
    for stack in stacks:
        sides = [s for s in stack if s is not None]
        back_to_host = sum(1 for a, b in zip(sides, sides[1:]) if (a, b) == ("core", "host"))
        assert back_to_host == 1
    # the only calls back are the Host protocol's methods
    assert set(host.calls) <= {"check", "progress", "file_slices", "namespace", "build"} and host.calls.count("build") == 1
