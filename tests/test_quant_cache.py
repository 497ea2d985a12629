"""The quantize-once cache's pure parts (loaders/quant_cache.py) on real files: the key and the entry's name, which
files are trusted for a key, which files count as the cache's, and eviction least recently used first.

Cache files here are what the cache writes: a quantized model (tests/test_saving.py's) through save_contents and
the streaming writer, with the key in its metadata. The integration tests
(tests/integration/test_quant_cache_workflows.py) drive the same through LoadH3Quantized in a real ComfyUI; on a GPU (marked `gpu`), a file written from what a load
quantized there loads back the same layers."""
import json
import os
import shutil

import pytest
import torch
from safetensors.torch import save_file

from checkpoint_files import save
from test_checkpoint_loaders import LINEARS, build, layer_input, plain_state_dict
from test_saving import quantized_model

from bigdit.loaders import inspect_checkpoint, quant_cache
from bigdit.loaders.errors import CheckpointError
from bigdit.loaders.load import online_config
from bigdit.loaders.quant_cache import (KEY_METADATA, Entry, cache_key, check_entry, entry_name, evictions,
                                        header_digest, is_entry, key_text, scan)
from bigdit.loaders.safetensors_writer import write_safetensors
from bigdit.loaders.saving import save_contents
from bigdit.quant.linear import QuantLinear
from bigdit.quant.linear_method import LinearMethod
from bigdit.quant.quantize_pass import online_method

OPTIONS = {"quantization": "int8_convrot", "group_size": 64, "ignored_layers": "", "fit_gib": 0.0,
           "conversions": [["int8", "auto"]]}
ENVIRONMENT = {"device": "cpu", "torch": "2.x", "comfy_kitchen": "0.2"}


@pytest.fixture
def source(tmp_path):
    path = tmp_path / "models" / "my model.safetensors"
    path.parent.mkdir()
    save_file({"a.weight": quantized_model().head.head.weight.detach().contiguous()}, path)
    return str(path)


def key_of(source, options=OPTIONS, environment=ENVIRONMENT, pack="1.0"):
    return cache_key(source, options, environment, pack)


def write_entry(folder, key, name=None):
    """A cache file for `key` in `folder`, as host/cache.py writes one; its path."""
    contents = save_contents(quantized_model().named_modules())
    path = os.path.join(folder, name or entry_name(key))
    write_safetensors(path, contents.tensors, {**contents.metadata("test"), KEY_METADATA: key_text(key)})
    return path


def test_key_and_name(source, tmp_path):
    key = key_of(source)
    assert key == key_of(source) and json.loads(key_text(key)) == key
    assert key["source"]["path"] == os.path.realpath(source) and key["source"]["size"] == os.path.getsize(source)
    name = entry_name(key)
    assert name.startswith("my_model-") and name.endswith(".safetensors") and quant_cache._NAME.fullmatch(name)
    # the name holds the path and the options; the rest of the key is checked against the file's metadata
    assert entry_name(key_of(source, environment={**ENVIRONMENT, "device": "cuda"}, pack="2.0")) == name
    assert entry_name(key_of(source, options={**OPTIONS, "group_size": 256})) != name
    link = tmp_path / "link.safetensors"
    link.symlink_to(source)
    assert key_of(str(link)) == key  # the real path
    os.utime(source, ns=(0, 10 ** 18))
    assert key_of(source)["source"] != key["source"] and entry_name(key_of(source)) == name
    long = tmp_path / ("x" * 200 + "\u00e9.safetensors")
    shutil.copy(source, long)
    assert len(entry_name(key_of(str(long)))) == 64 + 1 + 20 + len(".safetensors")


def test_header_digest_refuses_what_is_no_safetensors(tmp_path):
    path = tmp_path / "x.safetensors"
    path.write_bytes(b"\xff" * 8 + b"{}")
    with pytest.raises(CheckpointError, match="not a safetensors file"):
        header_digest(str(path))
    path.write_bytes(b"abc")
    with pytest.raises(CheckpointError):
        header_digest(str(path))


def test_a_file_is_trusted_only_for_its_own_key(source, tmp_path):
    folder = str(tmp_path / "cache")
    os.makedirs(folder)
    key = key_of(source)
    path = write_entry(folder, key)
    header, why = check_entry(path, key)
    assert header is not None and why == "" and is_entry(path)
    assert check_entry(os.path.join(folder, "missing.safetensors"), key) == (None, "no cache file yet")
    stale = {"the source file changed": key_of(source) | {"source": {**key["source"], "mtime_ns": 1}},
             "the pack's version changed": key_of(source, pack="1.1"),
             "the device or torch/comfy-kitchen changed": key_of(source, environment={**ENVIRONMENT, "torch": "3"})}
    for reason, other in stale.items():
        assert check_entry(path, other) == (None, f"stale: {reason}")
    assert check_entry(path, key_of(source, options={**OPTIONS, "fit_gib": 1.0}))[1] == \
        "the file there was written for another source file or other options"
    # cut short: the header's sizes against the file's
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) - 100)
    header, why = check_entry(path, key)
    assert header is None and why.startswith("the cache file is damaged or cut short (truncated file")
    # a file the cache did not write, at the entry's name
    shutil.copy(source, path)
    assert check_entry(path, key) == (None, "the file there was not written by the cache") and not is_entry(path)
    save_file({"a": quantized_model().head.head.weight.detach().contiguous()}, path,
              metadata={KEY_METADATA: "not json"})
    assert check_entry(path, key)[1] == "the file there was not written by the cache"


def test_only_the_caches_own_files_count_and_the_least_recently_used_go_first(source, tmp_path):
    folder = tmp_path / "cache"
    folder.mkdir()
    names = [entry_name(key_of(source, options={**OPTIONS, "group_size": g})) for g in (16, 64, 256)]
    paths = [write_entry(str(folder), key_of(source, options={**OPTIONS, "group_size": g}), name)
             for g, name in zip((16, 64, 256), names)]
    for age, path in zip((300, 100, 200), paths):  # used 300, 100 and 200 s ago
        os.utime(path, (1e9 - age, 1e9 - age))
    # what is not the cache's: a file named like an entry without a key, other files, a folder, a link to an entry
    junk = folder / f"junk-{'0' * 20}.safetensors"
    save_file({"a": quantized_model().head.head.weight.detach().contiguous()}, junk)
    (folder / "notes.txt").write_text("mine")
    (folder / f"sub-{'1' * 20}.safetensors").mkdir()
    (folder / f"link-{'2' * 20}.safetensors").symlink_to(paths[0])
    old_partial = folder / f".{names[0]}.0123abcd.partial"
    new_partial = folder / f".{names[1]}.0123abcd.partial"
    for partial in (old_partial, new_partial):
        partial.write_bytes(b"x")
    os.utime(old_partial, (1, 1))
    entries, partials = scan(str(folder))
    assert sorted(e.path for e in entries) == sorted(paths) and partials == [str(old_partial)]
    size = entries[0].size
    assert all(e.size == size == os.path.getsize(e.path) for e in entries)
    by_path = {e.path: e for e in entries}
    # room for 3 files: nothing goes; for 3 with one arriving: the least recently used (paths[0])
    assert evictions(entries, 0, 3 * size) == []
    assert evictions(entries, size, 3 * size) == [by_path[paths[0]]]
    assert evictions(entries, 2 * size, 3 * size) == [by_path[paths[0]], by_path[paths[2]]]
    # the file being replaced goes anyway: it is not counted, and not evicted
    assert evictions(entries, size, 3 * size, replacing=paths[0]) == []
    assert evictions(entries, size, 2 * size, replacing=paths[2]) == [by_path[paths[0]]]
    assert evictions(entries, 4 * size, 3 * size) == list(sorted(entries, key=lambda e: e.used))
    assert evictions([], size, 0) == []


def test_a_scan_looks_at_a_bounded_number_of_entries(source, tmp_path, monkeypatch):
    folder = tmp_path / "cache"
    folder.mkdir()
    for i in range(6):
        (folder / f"junk{i}").write_text("x")
    write_entry(str(folder), key_of(source))
    monkeypatch.setattr(quant_cache, "MAX_ENTRIES", 3)
    seen = []
    real = quant_cache.is_entry
    monkeypatch.setattr(quant_cache, "is_entry", lambda path: seen.append(path) or real(path))
    scan(str(folder))
    assert len(seen) <= 3
    assert scan(str(tmp_path / "absent")) == ([], [])


def test_entry_ordering_is_by_use_then_path():
    a, b, c = Entry("b", 1, 5.0), Entry("a", 1, 5.0), Entry("c", 1, 1.0)
    assert evictions([a, b, c], 1, 1) == [c, b, a]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("quantization", ["auto", "int8_convrot", "float8_e4m3fn", "asym_w4a8_int8"])
def test_a_cache_file_loads_back_the_same_layers_on_cuda(tmp_path, quantization):
    """What a load quantized on this GPU (auto: its measured choice per shape), written as the cache writes it and
    loaded as a hit loads it (as stored, nothing converted): the same layer types, methods and stored bytes, and the
    same outputs bit for bit."""
    device = torch.device("cuda")
    source = tmp_path / "wan_bf16.safetensors"
    save(plain_state_dict(), source)
    contents = inspect_checkpoint(source)
    method = online_method(quantization, 64, device)
    if isinstance(method, LinearMethod) and method.missing():
        pytest.skip(f"{quantization} needs {method.missing()}")
    first, first_report, _ = build(source, compute_dtype=torch.bfloat16, device="cuda",
                                   online=online_config(method, device, contents, ""))
    assert first_report.quantized, first_report.render()
    key = key_of(str(source), options={**OPTIONS, "quantization": quantization},
                 environment={"device": "cuda", "capability": list(torch.cuda.get_device_capability())})
    path = tmp_path / "cache" / entry_name(key)
    path.parent.mkdir()
    written = save_contents(first.named_modules())
    write_safetensors(path, written.tensors, {**written.metadata("test"), KEY_METADATA: key_text(key)})
    assert check_entry(str(path), key)[0] is not None
    hit, hit_report, _ = build(path, compute_dtype=torch.bfloat16, device="cuda")
    assert {r.name: r.format for r in hit_report.quantized} == {r.name: r.format for r in first_report.quantized}
    for name in LINEARS:
        ours, theirs = first.get_submodule(name), hit.get_submodule(name)
        assert type(ours) is type(theirs), name
        if isinstance(ours, QuantLinear):
            assert ours.method.describe() == theirs.method.describe() and theirs.weight.is_cuda, name
            mine, loaded = ours.stored_tensors(), theirs.stored_tensors()
            assert mine.keys() == loaded.keys(), name
            assert all(torch.equal(mine[k].view(torch.uint8), loaded[k].view(torch.uint8)) for k in mine), name
        x = layer_input(name).to("cuda", torch.bfloat16 if isinstance(ours, QuantLinear) else ours.weight.dtype)
        assert torch.equal(ours(x), theirs(x)), name
