"""The streaming safetensors writer against safetensors' own reader and the pack's header reader."""
import json
import os

import pytest
import torch
from safetensors import safe_open

from bigdit.loaders import safetensors_writer
from bigdit.loaders.safetensors_header import read_header
from bigdit.loaders.safetensors_writer import encode_header, write_safetensors


def sample_tensors():
    gen = torch.Generator().manual_seed(0)
    base = torch.randn(5, 7, generator=gen)
    return [
        ("bf16", base.to(torch.bfloat16)),
        ("f16", base.to(torch.float16)),
        ("f32", base),
        ("f64", base.double()),
        ("fp8_e4m3", base.to(torch.float8_e4m3fn)),
        ("fp8_e5m2", base.to(torch.float8_e5m2)),
        ("fp8_e8m0", torch.tensor([1.0, 2.0, 0.25]).to(torch.float8_e8m0fnu)),  # MXFP8 block scales
        ("u8", torch.randint(0, 256, (3, 11), generator=gen, dtype=torch.uint8)),
        ("i8", torch.randint(-128, 128, (4, 3), generator=gen, dtype=torch.int8)),
        ("i32", torch.randint(-1000, 1000, (6,), generator=gen, dtype=torch.int32)),
        ("i64", torch.tensor([1, -2, 2 ** 40])),
        ("bool", torch.tensor([True, False, True])),
        ("scalar_f32", torch.tensor(3.5)),
        ("empty_1d", torch.empty(0, dtype=torch.bfloat16)),
        ("empty_2d", torch.empty(3, 0, dtype=torch.int8)),
        ("empty_fp8", torch.empty(0, 4, dtype=torch.float8_e4m3fn)),
        ("odd_size_u8", torch.arange(5, dtype=torch.uint8)),   # leaves the next tensor unaligned by 5 bytes
        ("after_odd_bf16", base[:1].to(torch.bfloat16)),
        ("transposed", base.t()),                              # not contiguous
        ("parameter", torch.nn.Parameter(base[:2].clone(), requires_grad=False)),
    ]


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    return torch.equal(a.contiguous().reshape(-1).view(torch.uint8), b.contiguous().reshape(-1).view(torch.uint8))


def test_round_trip_through_safetensors_reader(tmp_path):
    tensors = sample_tensors()
    path = tmp_path / "out.safetensors"
    metadata = {"note": "héllo", "json": json.dumps({"a": 1})}
    size = write_safetensors(path, tensors, metadata)
    assert size == path.stat().st_size
    with safe_open(str(path), "pt") as f:
        assert f.metadata() == metadata
        assert list(f.keys()) == sorted(name for name, _ in tensors)
        for name, tensor in tensors:
            assert same_bits(f.get_tensor(name), tensor.detach()), name
    # The pack's own strict header reader accepts it, with the data right behind the padded header.
    header = read_header(path)
    assert header.data_start % 64 == 0  # the data starts on a cache line
    assert [header.tensors[name].begin for name, _ in tensors] == sorted(header.tensors[n].begin for n, _ in tensors)


def test_matches_safetensors_save_file_contents(tmp_path):
    import safetensors.torch
    tensors = [(n, t.detach().contiguous()) for n, t in sample_tensors()]
    ours, theirs = tmp_path / "ours.safetensors", tmp_path / "theirs.safetensors"
    write_safetensors(ours, tensors)
    safetensors.torch.save_file(dict(tensors), str(theirs))
    a, b = safetensors.torch.load_file(str(ours)), safetensors.torch.load_file(str(theirs))
    assert a.keys() == b.keys()
    assert all(same_bits(a[k], b[k]) for k in a)


def test_tensors_are_written_in_order_one_at_a_time(tmp_path):
    tensors = sample_tensors()
    seen = []
    write_safetensors(tmp_path / "x.safetensors", tensors,
                      on_tensor=lambda name: seen.append((name, (tmp_path / "x.safetensors").exists())))
    assert [name for name, _ in seen] == [name for name, _ in tensors]
    assert not any(exists for _, exists in seen)  # the target appears only at the end


def test_large_tensor_is_written_in_slices(tmp_path, monkeypatch):
    monkeypatch.setattr(safetensors_writer, "_COPY_CHUNK", 40)  # 10 fp32 values per slice
    tensor = torch.arange(1003, dtype=torch.float32).reshape(17, 59)
    write_safetensors(tmp_path / "x.safetensors", [("t", tensor)])
    with safe_open(str(tmp_path / "x.safetensors"), "pt") as f:
        assert torch.equal(f.get_tensor("t"), tensor)


def test_refuses_to_overwrite_unless_asked(tmp_path):
    path = tmp_path / "x.safetensors"
    path.write_bytes(b"precious")
    with pytest.raises(FileExistsError, match="overwrite"):
        write_safetensors(path, [("a", torch.ones(2))])
    assert path.read_bytes() == b"precious"
    write_safetensors(path, [("a", torch.ones(2))], overwrite=True)
    with safe_open(str(path), "pt") as f:
        assert torch.equal(f.get_tensor("a"), torch.ones(2))


@pytest.mark.parametrize("error", [KeyboardInterrupt, RuntimeError])
def test_interrupt_leaves_no_file(tmp_path, error):
    path = tmp_path / "x.safetensors"
    old = tmp_path / "old.safetensors"
    old.write_bytes(b"old")

    def stop(name):
        if name == "f32":
            raise error("stopped")

    for target, overwrite in ((path, False), (old, True)):
        with pytest.raises(error):
            write_safetensors(target, sample_tensors(), on_tensor=stop, overwrite=overwrite)
    assert sorted(os.listdir(tmp_path)) == ["old.safetensors"]  # no partial file, no temp file
    assert old.read_bytes() == b"old"


def test_bad_input_is_refused_before_any_file_exists(tmp_path):
    path = tmp_path / "x.safetensors"
    with pytest.raises(ValueError, match="twice"):
        write_safetensors(path, [("a", torch.ones(1)), ("a", torch.ones(1))])
    with pytest.raises(ValueError, match="name"):
        write_safetensors(path, [("__metadata__", torch.ones(1))])
    with pytest.raises(TypeError, match="complex"):
        write_safetensors(path, [("c", torch.ones(2, dtype=torch.complex64))])
    with pytest.raises(TypeError, match="strings"):
        write_safetensors(path, [("a", torch.ones(1))], {"n": 1})
    with pytest.raises(TypeError, match="plain tensor"):
        write_safetensors(path, [("q", torch.ones(1).as_subclass(_Subclass))])
    assert os.listdir(tmp_path) == []


class _Subclass(torch.Tensor):
    pass


def test_header_is_padded_and_offsets_are_contiguous():
    raw = encode_header([("a", torch.ones(3, dtype=torch.uint8)), ("b", torch.ones(2, 2))], {"k": "v"})
    length = int.from_bytes(raw[:8], "little")
    assert len(raw) == 8 + length and len(raw) % 64 == 0
    header = json.loads(raw[8:])
    assert header["a"] == {"dtype": "U8", "shape": [3], "data_offsets": [0, 3]}
    assert header["b"] == {"dtype": "F32", "shape": [2, 2], "data_offsets": [3, 19]}
    assert header["__metadata__"] == {"k": "v"}
