"""The quantize-once cache's pure parts (loaders/quant_cache.py) on real files: the key (the source's data, the pack's
quantizing code, the BIGDIT_* knobs), the entry's name, which files are trusted for a key, an entry held open while it
loads, which files count as the cache's, the temporary files of writes, and the plan of a write (its room on the disk,
eviction least recently used first).

Cache files here are what the cache writes: a quantized model (tests/test_saving.py's) through save_contents and
the streaming writer, with the key in its metadata. The integration tests
(tests/integration/test_quant_cache_workflows.py) drive the same through LoadH3Quantized in a real ComfyUI; on a GPU
(marked `gpu`), a file written from what a load quantized there loads back the same layers."""
import hashlib
import json
import os
import re
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
from bigdit.loaders.quant_cache import (KEY_METADATA, NOT_KEYED, PACK_ROOT, QUANTIZING_CODE, DigestMemo, Entry,
                                        OpenEntry, Partial, Source, cache_key, check_entry, code_digest, entry_name,
                                        evictions, file_digest, is_entry, key_text, knobs, may_hit, missing_reason, plan_write,
                                        remove_stale_partials, room_margin, scan, source_digest)
from bigdit.loaders.safetensors_header import read_header
from bigdit.loaders.safetensors_writer import write_safetensors
from bigdit.loaders.saving import save_contents
from bigdit.quant.linear import QuantLinear
from bigdit.quant.linear_method import LinearMethod
from bigdit.quant.quantize_pass import online_method
from bigdit.units import MIB

OPTIONS = {"quantization": "int8_convrot", "group_size": 64, "ignored_layers": "", "fit_gib": 0.0,
           "conversions": [["int8", "auto"]]}
ENVIRONMENT = {"device": "cpu", "comfyui": "0.3.75", "torch": "2.x", "triton": "3.x", "comfy_kitchen": "0.2"}
CODE = "c0de"
GIB = 2 ** 30


@pytest.fixture
def source(tmp_path):
    path = tmp_path / "models" / "my model.safetensors"
    path.parent.mkdir()
    save_file({"a.weight": quantized_model().head.head.weight.detach().contiguous()}, path)
    return str(path)


def key_of(source, options=OPTIONS, environment=ENVIRONMENT, code=CODE, environ=None, memo=None):
    return cache_key(source_digest(source, memo), options, environment, code, environ={} if environ is None else environ)


def write_entry(folder, source, key, name=None):
    """A cache file for `key` in `folder`, as host/cache.py writes one; its path."""
    contents = save_contents(quantized_model().named_modules())
    path = os.path.join(folder, name or entry_name(source, key))
    write_safetensors(path, contents.tensors, {**contents.metadata("test"), KEY_METADATA: key_text(key)})
    return path


def other_data(source, dst):
    """A copy of `source` at `dst` with one byte of its data changed: the same name, size, header and (cp -p)
    modification time."""
    raw = bytearray(open(source, "rb").read())
    raw[-1] ^= 0xFF
    with open(dst, "wb") as f:
        f.write(raw)
    shutil.copystat(source, dst)


def test_the_key_holds_the_sources_data_and_the_name_the_whole_key(source, tmp_path):
    key = key_of(source)
    assert key == key_of(source) and json.loads(key_text(key)) == key
    data = open(source, "rb").read()
    chunks = [hashlib.sha256(data[i:i + quant_cache.DIGEST_CHUNK]).digest()
              for i in range(0, len(data), quant_cache.DIGEST_CHUNK)]
    expected = hashlib.sha256(len(data).to_bytes(8, "little") + b"".join(chunks)).hexdigest()
    found = source_digest(source)
    assert key["source"] == {"size": len(data), "sha256": expected} == {"size": found.size, "sha256": found.sha256}
    assert found.version == quant_cache.file_version(source)
    name = entry_name(source, key)
    assert re.fullmatch(r"my_model-[0-9a-f]{20}\.safetensors", name) and quant_cache._NAME.fullmatch(name)
    # every part of the key is in the name: loads with different keys never share (or rewrite) one file
    others = [key_of(source, environment={**ENVIRONMENT, "torch": "3"}), key_of(source, code="other"),
              key_of(source, options={**OPTIONS, "group_size": 256}), key_of(source, environ={"BIGDIT_X": "1"})]
    assert len({name, *(entry_name(source, other) for other in others)}) == 5
    # the data, not the path: a link, or the same bytes elsewhere, is the same source
    link = tmp_path / "link.safetensors"
    link.symlink_to(source)
    copy = tmp_path / "elsewhere.safetensors"
    shutil.copy(source, copy)
    assert key_of(str(link)) == key_of(str(copy)) == key and entry_name(str(link), key) == name
    os.utime(source, ns=(0, 10 ** 18))
    assert key_of(source) == key  # touched, not changed
    long = tmp_path / ("x" * 200 + "\u00e9.safetensors")
    shutil.copy(source, long)
    assert len(entry_name(str(long), key_of(str(long)))) == 64 + 1 + 20 + len(".safetensors")


def test_a_copy_with_other_data_misses_though_its_name_size_header_and_time_are_the_same(source, tmp_path):
    key = key_of(source)
    folder = tmp_path / "cache"
    folder.mkdir()
    path = write_entry(str(folder), source, key)
    tuned = tmp_path / "tuned" / os.path.basename(source)
    tuned.parent.mkdir()
    other_data(source, tuned)
    stat, tuned_stat = os.stat(source), os.stat(tuned)
    assert (stat.st_size, stat.st_mtime_ns) == (tuned_stat.st_size, tuned_stat.st_mtime_ns)
    assert read_header(source).tensors == read_header(str(tuned)).tensors
    other = key_of(str(tuned))
    assert other["source"] != key["source"] and {k: v for k, v in other.items() if k != "source"} == \
        {k: v for k, v in key.items() if k != "source"}
    assert entry_name(str(tuned), other) != os.path.basename(path)
    assert check_entry(path, other) == (None, "the file there was written for another key (the source file's data)")
    # the same with the file rewritten in place, its modification time put back
    other_data(source, tmp_path / "scratch")
    shutil.copyfile(tmp_path / "scratch", source)
    os.utime(source, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    assert key_of(source)["source"] == other["source"]


def test_a_files_digest_is_remembered_for_that_version_of_the_file_only(source, tmp_path, monkeypatch):
    monkeypatch.setattr(quant_cache, "MEMO_SETTLE_S", -1.0)  # the file was just written: remember it anyway
    memo = DigestMemo(str(tmp_path / "cache"))
    found = source_digest(source, memo)
    assert found == source_digest(source) and os.path.isfile(memo.path)
    assert memo.get(found.version) == found.sha256
    memo.put(found.version, "remembered")  # what a load reads instead of the file
    assert source_digest(source, memo) == Source(found.version, found.size, "remembered")
    # a write of other bytes in place, its times put back: its change time tells it from the remembered version
    stat = os.stat(source)
    other_data(source, tmp_path / "scratch")
    shutil.copyfile(tmp_path / "scratch", source)
    os.utime(source, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    rewritten = source_digest(source, memo)
    assert rewritten.version != found.version and rewritten.sha256 == source_digest(str(tmp_path / "scratch")).sha256
    assert rewritten.sha256 != found.sha256
    # a memo that cannot be read is no memo
    with open(memo.path, "w") as f:
        f.write("[not a memo")
    assert source_digest(source, memo) == rewritten
    # bounded: the least recently used are forgotten
    monkeypatch.setattr(quant_cache, "MAX_MEMO", 3)
    for i in range(5):
        memo.put(f"v{i}", f"d{i}")
    assert [memo.get(f"v{i}") for i in range(5)] == [None, None, "d2", "d3", "d4"]


def test_a_file_is_read_before_its_load_only_where_an_entry_can_stand_for_it(source, tmp_path, monkeypatch):
    """may_hit: the memo knows this version of the file, or an entry of the folder was written from a file of its
    size; elsewhere the load is a miss whatever the file holds, and its digest waits for the load."""
    monkeypatch.setattr(quant_cache, "MEMO_SETTLE_S", -1.0)
    memo = DigestMemo(str(tmp_path / "cache"))
    version = quant_cache.file_version(source)
    size = os.path.getsize(source)
    assert not may_hit(version, memo, [])
    assert not may_hit(version, memo, [Entry("e", 1, 0.0, {"source": {"size": size + 1}}), Entry("f", 1, 0.0,
                                                                                                  {"source": []})])
    assert may_hit(version, memo, [Entry("e", 1, 0.0, {"source": {"size": size, "sha256": "another file's"}})])
    source_digest(source, memo)
    assert may_hit(version, memo, [])


def test_a_file_changed_while_it_is_read_has_no_digest(source, monkeypatch):
    real = os.pread

    def growing(fd, n, offset):
        with open(source, "ab") as f:
            f.write(b"x")
        return real(fd, n, offset)

    monkeypatch.setattr(os, "pread", growing)
    with pytest.raises(CheckpointError, match="the file changed while it was read"):
        file_digest(source)


def test_the_pack_code_that_quantizes_is_in_the_key(source, tmp_path):
    """A changed quantization routine misses: the digest of the pack's quantizing code, planted in a copy."""
    copies = []
    for name in ("same", "planted"):
        root = tmp_path / name
        for part in QUANTIZING_CODE:
            (shutil.copytree if (PACK_ROOT / part).is_dir() else shutil.copy)(PACK_ROOT / part, root / part)
        copies.append(str(root))
    assert code_digest(copies[0]) == code_digest() != code_digest(parts=QUANTIZING_CODE[:-1])
    routine = tmp_path / "planted" / "quant" / "int8_convrot.py"
    routine.write_text(routine.read_text() + "\n_PLANTED = 'another rounding'\n")
    planted = code_digest(copies[1])  # once per process and pack: planted before it is first asked
    assert planted != code_digest()
    folder = tmp_path / "cache"
    folder.mkdir()
    key = key_of(source, code=code_digest())
    path = write_entry(str(folder), source, key)
    other = key_of(source, code=planted)
    assert entry_name(source, other) != os.path.basename(path)  # not found at its name: a miss
    entries, _ = scan(str(folder))
    assert missing_reason(entries, other) == \
        "no cache file for this key yet; the folder's 1 file(s) of this source differ in: the pack's quantizing code"
    assert check_entry(path, other)[1] == "the file there was written for another key (the pack's quantizing code)"


def test_every_bigdit_knob_is_in_the_key_but_those_that_cannot_change_a_file(source):
    key = key_of(source, environ={"PATH": "/bin"})
    assert key["knobs"] == {}
    for knob in ("BIGDIT_AUTO_ROWS", "BIGDIT_INT8_MAX_ROWS", "BIGDIT_A_KNOB_NOBODY_LISTED"):
        changed = key_of(source, environ={knob: "4096"})
        assert changed["knobs"] == {knob: "4096"} and entry_name(source, changed) != entry_name(source, key)
        assert missing_reason([Entry("e", 1, 0.0, key)], changed).endswith("a BIGDIT_* environment variable")
    assert key_of(source, environ={name: "1" for name in NOT_KEYED}) == key
    assert knobs({"BIGDIT_B": "2", "BIGDIT_A": "1", "OTHER": "x"}) == {"BIGDIT_A": "1", "BIGDIT_B": "2"}


def _sources(parts):
    for part in parts:
        for path in sorted((PACK_ROOT / part).rglob("*.py")) if (PACK_ROOT / part).is_dir() else [PACK_ROOT / part]:
            yield path.relative_to(PACK_ROOT).as_posix(), path.read_text()


def test_the_knobs_left_out_of_the_key_are_read_only_where_they_cannot_change_a_file():
    """The key takes every BIGDIT_* variable but NOT_KEYED, so a new knob is in it without anyone listing it: the
    pack's modules that decide the bytes read no NOT_KEYED knob and no environment variable of another prefix, and
    each NOT_KEYED knob is read somewhere (a stale entry would hide nothing, but says what is not true)."""
    pack = [p.relative_to(PACK_ROOT).as_posix() for p in PACK_ROOT.iterdir()
            if p.name not in ("tests", ".git", ".ci") and (p.is_dir() or p.suffix == ".py")]
    names = {path: set(re.findall(r"\bBIGDIT_[A-Z0-9_]+", text)) for path, text in _sources(pack)}
    quantizing = {path for path, _ in _sources(QUANTIZING_CODE)} - {"loaders/quant_cache.py"}
    assert names.get("quant/auto.py", set()) & {"BIGDIT_AUTO_ROWS"}, "auto's knob moved: look for it"
    for path in quantizing:
        assert not names[path] & set(NOT_KEYED), (path, names[path] & set(NOT_KEYED))
    for knob in NOT_KEYED:
        assert any(knob in found for path, found in names.items() if path != "loaders/quant_cache.py"), knob
    reads = re.compile(r"(?:environ\.get|getenv|environ\[|environ\.setdefault)\(?\s*[\"']([A-Za-z0-9_]+)[\"']")
    for path, text in _sources(QUANTIZING_CODE):
        assert all(name.startswith("BIGDIT_") for name in reads.findall(text)), (path, reads.findall(text))


def test_a_file_is_trusted_only_for_its_own_key(source, tmp_path):
    folder = str(tmp_path / "cache")
    os.makedirs(folder)
    key = key_of(source)
    path = write_entry(folder, source, key)
    header, why = check_entry(path, key)
    assert header is not None and why == "" and is_entry(path)
    for other, part in ((key_of(source, environment={**ENVIRONMENT, "torch": "3"}),
                         "the device, ComfyUI, torch, Triton or comfy-kitchen"),
                        (key_of(source, options={**OPTIONS, "fit_gib": 1.0}), "the load's inputs")):
        assert check_entry(path, other) == (None, f"the file there was written for another key ({part})")
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


def test_an_entry_held_open_tells_whether_its_path_still_names_it(source, tmp_path):
    folder = str(tmp_path / "cache")
    os.makedirs(folder)
    key = key_of(source)
    path = write_entry(folder, source, key)
    with OpenEntry(path) as opened:
        assert opened.same()
        os.utime(path)  # touched (a hit elsewhere): the same file
        assert opened.same()
        other = write_entry(folder, source, key_of(source, code="other"))
        os.replace(other, path)  # as another server's write lands: a new file renamed over it
        assert not opened.same()
    with OpenEntry(path) as opened:
        os.unlink(path)
        assert not opened.same()
    with pytest.raises(FileNotFoundError):
        OpenEntry(path)


def test_only_the_caches_own_files_count_and_the_least_recently_used_go_first(source, tmp_path):
    folder = tmp_path / "cache"
    folder.mkdir()
    keys = [key_of(source, options={**OPTIONS, "group_size": g}) for g in (16, 64, 256)]
    paths = [write_entry(str(folder), source, key) for key in keys]
    for age, path in zip((300, 100, 200), paths):  # used 300, 100 and 200 s ago
        os.utime(path, (1e9 - age, 1e9 - age))
    # what is not the cache's: a file named like an entry without a key, other files, a folder, a link to an entry
    junk = folder / f"junk-{'0' * 20}.safetensors"
    save_file({"a": quantized_model().head.head.weight.detach().contiguous()}, junk)
    (folder / "notes.txt").write_text("mine")
    (folder / f"sub-{'1' * 20}.safetensors").mkdir()
    (folder / f"link-{'2' * 20}.safetensors").symlink_to(paths[0])
    names = [os.path.basename(p) for p in paths]
    crashed = folder / f".{names[0]}.0123abcd.partial"
    writing = folder / f".{names[1]}.0123abcd.partial"
    crashed.write_bytes(b"x" * 10)
    writing.write_bytes(b"x" * 20)
    os.utime(crashed, (1, 1))
    entries, partials = scan(str(folder))
    assert sorted(e.path for e in entries) == sorted(paths) and {e.path: e.key for e in entries} == dict(zip(paths, keys))
    assert sorted(partials, key=lambda p: p.path) == sorted([Partial(str(crashed), 10, True),
                                                             Partial(str(writing), 20, False)], key=lambda p: p.path)
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
    # a crash's temporary file is removed, a live write's kept
    assert remove_stale_partials(partials) == [Partial(str(writing), 20, False)]
    assert not crashed.exists() and writing.exists()


def test_a_write_counts_live_writes_and_checks_its_room_before_it_evicts():
    entries = [Entry(f"e{i}", 10 * GIB, float(i)) for i in range(3)]
    writing = [Partial(".w.partial", 5 * GIB, False)]
    # the limit counts the live write: one more entry goes
    assert plan_write(entries, [], 10 * GIB, 30 * GIB, 100 * GIB) == (entries[:1], "")
    assert plan_write(entries, writing, 10 * GIB, 30 * GIB, 100 * GIB) == (entries[:2], "")
    # the room: the file and its margin, with what the evictions the limit needs free
    margin = room_margin(10 * GIB)
    assert margin == GIB // 2 and room_margin(MIB) == 256 * MIB
    assert plan_write(entries, [], 10 * GIB, 30 * GIB, margin) == (entries[:1], "")  # 10 GiB freed by evicting
    evicted, why = plan_write(entries, [], 10 * GIB, 30 * GIB, margin - 1)
    assert evicted == [] and why == ("not enough disk space: 10.00 GiB and a margin of 0.50 GiB needed, 0.50 GiB "
                                     "free (10.00 GiB more once the cache's evictions are done); nothing was evicted")
    evicted, why = plan_write(entries, [], 10 * GIB, 100 * GIB, 10 * GIB)  # nothing to evict, no room
    assert evicted == [] and why.startswith("not enough disk space") and "once" not in why
    # the file at the entry's name (damaged, or another's) goes anyway: its bytes count as room
    assert plan_write(entries, [], 10 * GIB, 100 * GIB, margin, replacing="e1") == ([], "")


def test_a_scan_looks_at_a_bounded_number_of_entries(source, tmp_path, monkeypatch):
    folder = tmp_path / "cache"
    folder.mkdir()
    for i in range(6):
        (folder / f"junk{i}").write_text("x")
    write_entry(str(folder), source, key_of(source))
    monkeypatch.setattr(quant_cache, "MAX_ENTRIES", 3)
    seen = []
    real = quant_cache.entry_key
    monkeypatch.setattr(quant_cache, "entry_key", lambda path: seen.append(path) or real(path))
    scan(str(folder))
    assert len(seen) <= 3
    assert scan(str(tmp_path / "absent")) == ([], [])


def test_entry_ordering_is_by_use_then_path():
    a, b, c = Entry("b", 1, 5.0), Entry("a", 1, 5.0), Entry("c", 1, 1.0)
    assert evictions([a, b, c], 1, 1) == [c, b, a]


def test_the_digest_is_the_same_on_any_number_of_threads(tmp_path, monkeypatch):
    """file_digest reads a file in DIGEST_CHUNK slices, on several threads, to the same digest as on one."""
    path = tmp_path / "big.bin"
    path.write_bytes(os.urandom(5 * 1024 + 7))
    monkeypatch.setattr(quant_cache, "DIGEST_CHUNK", 1024)
    many = file_digest(str(path))[0]
    monkeypatch.setattr(quant_cache, "DIGEST_THREADS", 1)
    assert file_digest(str(path))[0] == many
    empty = tmp_path / "empty.bin"
    empty.write_bytes(b"")
    assert file_digest(str(empty))[0] == hashlib.sha256(bytes(8)).hexdigest()


# auto quantizes a layer only where a format beats the plain GEMM on this GPU (at BIGDIT_AUTO_ROWS rows), and rightly
# keeps the 128-wide layers of LINEARS: it is asked for an FFN of a large model instead
AUTO_LINEARS = {"blocks.0.ffn.0": (16384, 4096), "blocks.0.ffn.2": (4096, 16384)}


def state_dict_of(linears, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return {key: value for name, (n_out, n_in) in linears.items() for key, value in (
        (f"{name}.weight", (torch.randn(n_out, n_in, generator=gen) * n_in ** -0.5).to(torch.bfloat16)),
        (f"{name}.bias", (torch.randn(n_out, generator=gen) * 0.02).to(torch.bfloat16)))}


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("quantization", ["auto", "int8_convrot", "float8_e4m3fn", "asym_w4a8_int8"])
def test_a_cache_file_loads_back_the_same_layers_on_cuda(tmp_path, quantization):
    """What a load quantized on this GPU (auto: its measured choice per shape), written as the cache writes it and
    loaded as a hit loads it (as stored, nothing converted): the same layer types, methods and stored bytes, and the
    same outputs bit for bit."""
    device = torch.device("cuda")
    linears = AUTO_LINEARS if quantization == "auto" else LINEARS
    source = tmp_path / "wan_bf16.safetensors"
    save(plain_state_dict() if linears is LINEARS else state_dict_of(linears), source)
    contents = inspect_checkpoint(source)
    method = online_method(quantization, 64, device)
    if isinstance(method, LinearMethod) and method.missing():
        pytest.skip(f"{quantization} needs {method.missing()}")
    first, first_report, _ = build(source, compute_dtype=torch.bfloat16, device="cuda", linears=linears,
                                   online=online_config(method, device, contents, ""))
    assert first_report.quantized, first_report.render()
    key = key_of(str(source), options={**OPTIONS, "quantization": quantization},
                 environment={"device": "cuda", "capability": list(torch.cuda.get_device_capability())})
    path = tmp_path / "cache" / entry_name(str(source), key)
    path.parent.mkdir()
    written = save_contents(first.named_modules())
    write_safetensors(path, written.tensors, {**written.metadata("test"), KEY_METADATA: key_text(key)})
    assert check_entry(str(path), key)[0] is not None
    hit, hit_report, _ = build(path, compute_dtype=torch.bfloat16, device="cuda", linears=linears)
    assert {r.name: r.format for r in hit_report.quantized} == {r.name: r.format for r in first_report.quantized}
    for name, (_, n_in) in linears.items():
        ours, theirs = first.get_submodule(name), hit.get_submodule(name)
        assert type(ours) is type(theirs), name
        if isinstance(ours, QuantLinear):
            assert ours.method.describe() == theirs.method.describe() and theirs.weight.is_cuda, name
            mine, loaded = ours.stored_tensors(), theirs.stored_tensors()
            assert mine.keys() == loaded.keys(), name
            assert all(torch.equal(mine[k].view(torch.uint8), loaded[k].view(torch.uint8)) for k in mine), name
        x = (layer_input(name) if linears is LINEARS else torch.randn(2, 9, n_in, generator=torch.Generator()
                                                                      .manual_seed(1)))
        x = x.to("cuda", torch.bfloat16 if isinstance(ours, QuantLinear) else ours.weight.dtype)
        assert torch.equal(ours(x), theirs(x)), name
