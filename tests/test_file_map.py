"""loaders/file_map: a consumed tensor's pages of the file's map go back (FileMap.release, the process's
mapped file pages measured in /proc/self/status), and a model that keeps few of its file's tensors as they
are (a loader with assign=True, as upstream's dynamic VRAM loads) gets them copied, and the file's map goes
away (release_file_map)."""
import gc

import safetensors.torch
import torch
from torch import nn

from bigdit.loaders import inspect_checkpoint
from bigdit.loaders.host_memory import PAGE
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
    return module, sd, source.file_map


def test_a_model_that_keeps_little_of_its_file_lets_the_map_go(tmp_path):
    path, tensors = write(tmp_path)
    module, sd, file_map = load(path, keep_big=False)
    gc.collect()
    assert mapped(path)  # the norm's tensors hold the whole file's map
    copied = release_file_map(module, file_map, path.stat().st_size)
    assert copied == 2 * 64 * 4
    del sd
    gc.collect()
    assert not mapped(path)
    assert torch.equal(module.norm.weight, tensors["norm.weight"]) and torch.equal(module.norm.bias,
                                                                                  tensors["norm.bias"])
    assert isinstance(module.norm.weight, nn.Parameter)


def test_a_model_that_is_its_file_stays_mapped(tmp_path):
    path, tensors = write(tmp_path)
    module, sd, file_map = load(path, keep_big=True)
    assert release_file_map(module, file_map, path.stat().st_size) == 0
    del sd
    gc.collect()
    assert mapped(path) and torch.equal(module.big.weight, tensors["big.weight"])


def test_marked_tensors_carry_their_offset_in_the_file(tmp_path):
    """With a host that pages from files, each tensor handed out is marked once with its byte offset in the
    file (its storage, so views keep it): the bytes there are the tensor's."""
    path, tensors = write(tmp_path)
    marks = []
    raw = path.read_bytes()
    with inspect_checkpoint(path).open(lambda t, offset: marks.append((t.untyped_storage(), offset))) as source:
        for key, want in tensors.items():
            got = source(key)
            storage, offset = marks[-1]
            assert got.untyped_storage().data_ptr() == storage.data_ptr() and got.storage_offset() == 0
            assert raw[offset:offset + storage.nbytes()] == want.numpy().tobytes()
    assert len(marks) == len(tensors)


def test_a_model_the_host_pages_from_its_file_keeps_the_map_and_gives_its_pages_back(tmp_path):
    path, tensors = write(tmp_path)
    module, sd, file_map = load(path, keep_big=True)
    weight = module.big.weight
    assert torch.equal(weight, tensors["big.weight"])  # read: its pages are resident
    assert release_file_map(module, file_map, path.stat().st_size, paged_from_file=True) == 0  # none copied
    assert module.big.weight is weight and file_map.holds(weight)  # the same tensor, still the file's
    assert file_map.released_bytes >= 512 * 512 * 4 - 2 * PAGE  # the big weight's whole pages went back
    released = file_map.released_bytes
    file_map.release(weight)  # released again (a loader releases what it consumed, then the model's at the end)
    assert file_map.released_bytes == released  # the report counts the file's pages once
    del sd
    gc.collect()
    assert mapped(path) and torch.equal(module.big.weight, tensors["big.weight"])  # faulted in again


def test_tensors_outside_the_file_are_left_alone(tmp_path):
    path, _ = write(tmp_path)
    module = nn.LayerNorm(64)  # loaded with copies (assign=False)
    with inspect_checkpoint(path).open() as source:
        sd = {"weight": source("norm.weight"), "bias": source("norm.bias")}
        module.load_state_dict(sd)
    before = module.weight.data_ptr()
    assert release_file_map(module, source.file_map, path.stat().st_size) == 0 and module.weight.data_ptr() == before


def mapped_file_bytes() -> int:
    with open("/proc/self/status") as f:
        fields = dict(line.split(":", 1) for line in f if ":" in line)
    return int(fields["RssFile"].split()[0]) * 1024


def test_a_consumed_tensor_gives_its_pages_of_the_file_back(tmp_path):
    """Reading a 64 MiB tensor of the file maps its pages into the process; released, they are no longer
    the process's (RssFile drops by at least 60 MiB), and it and its neighbour still read the same."""
    gen = torch.Generator().manual_seed(0)
    tensors = {"a": torch.randn(4096, 4096, generator=gen), "b": torch.randn(3, 1000, generator=gen)}
    path = tmp_path / "pages.safetensors"
    safetensors.torch.save_file(tensors, str(path))
    with inspect_checkpoint(path).open() as source:
        a, b = source("a"), source("b")
        before = mapped_file_bytes()
        assert torch.equal(a, tensors["a"]) and torch.equal(b, tensors["b"])  # reads every page
        read = mapped_file_bytes()
        assert read - before > 60 * 2 ** 20
        source.file_map.release(a, tensors["b"])  # a tensor outside the file is left alone
        assert read - mapped_file_bytes() > 60 * 2 ** 20
        assert source.file_map.released_bytes >= 64 * 2 ** 20 - 2 * PAGE
        assert torch.equal(b, tensors["b"]) and torch.equal(tensors["b"], b.clone())
        assert torch.equal(a, tensors["a"])  # faulted in again from the file


def test_the_builder_gives_back_each_weight_it_quantized(tmp_path):
    """LayerBuilder quantizing four 16 MiB bf16 weights (FP8, on the CPU) leaves none of their pages of the
    file with the process, and says how much it gave back; the layers equal those built from copies."""
    from bigdit.loaders import LayerBuilder
    from bigdit.quant.decision import QuantConfig
    from bigdit.quant.registry import get_method

    gen = torch.Generator().manual_seed(0)
    tensors = {f"l{i}.weight": torch.randn(4096, 2048, generator=gen).bfloat16() for i in range(4)}
    path = tmp_path / "plain.safetensors"
    safetensors.torch.save_file(tensors, str(path))
    contents = inspect_checkpoint(path)
    method = get_method("float8_e4m3fn")
    with contents.open() as source:
        builder = LayerBuilder(contents, source, torch.device("cpu"), online=QuantConfig(method=method))
        sd = contents.state_dict(source)
        before = mapped_file_bytes()
        built = {key: builder.build(key[:-len(".weight")], weight, 2048, 4096, None, torch.float32, None)
                 for key, weight in sd.items()}
        assert mapped_file_bytes() - before < 4 * 2 ** 20  # of 64 MiB read
        assert source.file_map.released_bytes >= 64 * 2 ** 20 - 8 * PAGE
    for key, layer in built.items():
        expected = method.quantize_weight(tensors[key])
        assert torch.equal(layer.weight.view(torch.uint8), expected["weight"].view(torch.uint8))
        assert torch.equal(layer.weight_scale, expected["weight_scale"])
