"""LoadH3Quantized's quantize-once cache (host/cache.py, loaders/quant_cache.py) in a real ComfyUI (issues 32 and 38).

One server per host, with the cache in a folder of its own (a `bigdit_cache` entry of the extra_model_paths.yaml
it starts with) limited to LIMIT (BIGDIT_QUANT_CACHE_GIB), loads a copy of the tiny Wan (2 blocks, dim 256; a copy, since tests change it)
with int8_convrot:
- the second load is a hit: its report says so and has no "quantized while loading" line (the first has, from the
  builder's count of the layers it quantized), its layers, formats and kept reasons are the first load's, and 2
  euler steps give the first load's latent bit for bit (on CPU the same tensors give the same bits);
- a cache file cut short, one the cache did not write (the source itself) and one written for other options, each at
  the entry's name, are rebuilt, the report saying why, and sample the first latent;
- the source rewritten with other data but its name, size, header and modification time (as `cp -p` keeps them)
  misses, and keeps the first entry, which hits again once the file is back;
- a second server with another BIGDIT_* knob, sharing the folder, misses naming the knob, then the two alternate, each
  hitting its own entry, neither file written again; its first use of the folder removes a crashed write's temporary
  file, not a live one's;
- a copy of the pack with a planted INT8 routine (another server) misses, naming the pack's code, and samples its own
  weights; the first server still hits its entry;
- the limit: the folder holds the entry, copies of it under other entries' names used longer ago (as many as fit
  with one more file), and files that are not the cache's (one named like an entry with no key, a large sparse
  one); a load with other options then evicts the copies least recently used first and nothing else, and the
  folder stays under the limit;
- a folder that cannot be made (a file in its place) and a low disk (a 64 MiB tmpfs mounted over the folder, where
  this user may mount one, filled with the cache's files to the limit) fall back to loading without the cache, the
  low disk before anything is evicted: the report names the folder and the error, and the model samples the first
  load's latent.
With `auto` (on CPU: INT8 ConvRot, then full precision), the entry carries its layers' first-call checks: a hit checks
the same layers (their sketches from the entry) and samples the miss's latent bit for bit; on a copy of the tiny Wan
with one layer whose real activations carry outliers INT8 cannot hold, that layer falls back to full precision on the
miss and again on a hit, the fallback is kept beside the entry, and the next load (a hit, or a miss that writes the
entry again) takes it at load, unchecked, with the same latent.
In the host's Python, through host/loading.py's load_checkpoint: a hit whose file is replaced between its check and its
load, and one whose load fails with an unexpected error, are rebuilt with the weights of a load without the cache; an
interrupt is not swallowed.
Under upstream's dynamic VRAM, with its real loader and patcher on the CPU (as tests/integration/test_file_backed.py
runs them), through host/loading.py's load_checkpoint: a miss's quantized weights are paged from the cache file it
wrote (no scratch file; the process memory they held is freed), a hit's weights all from the cache file, each tensor's file slice holding its bytes, and
both sample the latent of the same load without file paging; a host that computes in another dtype (--bf16-unet)
finds the file stale and rebuilds it. There too, the folder: BIGDIT_QUANT_CACHE, else extra_model_paths.yaml's
`bigdit_cache`, else models/bigdit_cache.
"""
import json
import os
import re
import shutil
import subprocess
from contextlib import contextmanager

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from comfy_harness import PACK_ROOT, ComfyServer
from graphs import node_report, wan_t2v_graph
from test_file_backed import run_probe

from bigdit.loaders.entry_checks import fallbacks_path
from bigdit.loaders.quant_cache import MEMO_NAME
from bigdit.loaders.safetensors_header import DTYPE_SIZES, read_header

pytestmark = pytest.mark.integration

MIB = 2 ** 20
LIMIT = 16 * MIB   # the tiny Wan's cache file is about 3 MiB
SOURCE = "cache_wan.safetensors"
INPUTS = {"unet_name": SOURCE, "quantization": "int8_convrot", "offload": "none", "group_size": "256",
          "ignored_layers": ""}
OTHER = {**INPUTS, "group_size": "64"}  # another entry of the same size
LABEL = "quantize-once cache"


class Cached:
    def __init__(self, server, folder, source, vae):
        self.server, self.folder, self.source, self.vae = server, folder, source, vae

    def entries(self) -> list[str]:
        return sorted(str(p) for p in self.folder.glob("*.safetensors"))

    def clear(self):
        shutil.rmtree(self.folder, ignore_errors=True)

    def load(self, inputs=INPUTS) -> tuple[str, str]:
        """(the loader's on-node report, its full report) of a graph that only loads."""
        history = self.server.run({"unet": {"class_type": "LoadH3Quantized", "inputs": dict(inputs)},
                                   "show": {"class_type": "PreviewAny", "inputs": {"source": ["unet", 1]}}})
        full = node_report(history, "unet")
        return history["outputs"]["unet"]["text"][0], full

    def sample(self, inputs=INPUTS) -> tuple[torch.Tensor, str]:
        history = self.server.run(wan_t2v_graph(None, self.vae, loader=("LoadH3Quantized", dict(inputs))))
        return self.server.latent(history, "save_latent"), node_report(history, "unet")

    def sample_run(self, inputs) -> tuple[torch.Tensor, str, str]:
        """(the latent, the loader's report, the `last run:` line its sampling logged)."""
        start = len(self.server.log_text())
        latent, report = self.sample(inputs)
        (line,) = re.findall(r"last run: (ran \d+/\d+ quantized layers.*)", self.server.log_text()[start:])
        return latent, report, line


@pytest.fixture(scope="module")
def cached(comfy, tiny_wan2, tmp_path_factory):
    base = tmp_path_factory.mktemp("comfy_quant_cache")
    folder = base / "quant_cache"
    paths = base / "extra_model_paths.yaml"
    paths.write_text(f"bigdit:\n  base_path: {base}\n  bigdit_cache: quant_cache\n")
    server = ComfyServer(base, comfy.host, extra_args=["--extra-model-paths-config", str(paths)],
                         env={"BIGDIT_QUANT_CACHE_GIB": str(LIMIT / 2 ** 30)})
    source = server.models_dir / "diffusion_models" / SOURCE
    shutil.copy(tiny_wan2["path"], source)
    (server.models_dir / "vae" / tiny_wan2["vae_name"]).symlink_to(comfy.models_dir / "vae" / tiny_wan2["vae_name"])
    yield Cached(server, folder, source, tiny_wan2["vae_name"])
    server.stop()


@pytest.fixture(scope="module")
def first(cached):
    """The latent and report of the first load through an empty cache."""
    cached.clear()
    return cached.sample()


def layers_part(report: str) -> list[str]:
    """The report's lines about the layers: counts, weights, formats, and each kept layer with its reason."""
    lines = report.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("kept in original precision"))
    end = next(i for i in range(start + 1, len(lines) + 1) if i == len(lines) or not lines[i].startswith("  "))
    return lines[:3] + lines[start:end]


def test_the_second_load_is_a_hit_and_samples_the_same(cached, first):
    first_latent, first_report = first
    (entry,) = cached.entries()
    assert f"{LABEL}: miss (no cache file yet); wrote {entry}" in first_report, first_report
    assert "quantized while loading: " in first_report
    latent, report = cached.sample()
    assert f"{LABEL}: hit, loaded {entry} as stored" in report and "nothing was quantized" in report, report
    assert "quantized while loading" not in report and "quantizing while loading took" not in report, report
    assert layers_part(report) == layers_part(first_report), (report, first_report)
    assert torch.equal(latent, first_latent)
    short, _ = cached.load()
    assert short.splitlines()[1].endswith("; cache hit"), short
    assert cached.entries() == [entry]


def test_a_file_cut_short_foreign_or_of_another_key_is_rebuilt_with_the_right_weights(cached, first):
    first_latent, _ = first
    cached.load()
    (entry,) = cached.entries()
    size = os.path.getsize(entry)

    def rebuilt(why):
        latent, report = cached.sample()
        assert f"{LABEL}: miss ({why}" in report and f"; wrote {entry}" in report, report
        assert os.path.getsize(entry) == size and torch.equal(latent, first_latent)
        assert f"{LABEL}: hit" in cached.load()[1]

    with open(entry, "r+b") as f:
        f.truncate(size - 1000)
    rebuilt("the cache file is damaged or cut short (truncated file")
    shutil.copy(cached.source, entry)
    rebuilt("the file there was not written by the cache")
    cached.load(OTHER)
    (other,) = [path for path in cached.entries() if path != entry]
    shutil.copy(other, entry)
    rebuilt("the file there was written for another key (the load's inputs)")


@contextmanager
def other_data(path):
    """`path` with its first block's FFN weights negated, its size, header and modification time kept (as `cp -p` of
    a fine-tune of the same layout keeps them); put back the same way after."""
    raw, stat = path.read_bytes(), path.stat()
    header = read_header(path)
    (info,) = [info for name, info in header.tensors.items() if name.endswith("blocks.0.ffn.0.weight")]
    width = DTYPE_SIZES[info.dtype]
    changed = bytearray(raw)
    start = header.data_start + info.begin
    torch.frombuffer(changed, dtype=torch.uint8)[start + width - 1:start + info.nbytes:width] ^= 0x80  # sign bits

    def put(data):
        tmp = path.with_suffix(".tmp")
        tmp.write_bytes(data)
        os.utime(tmp, ns=(stat.st_atime_ns, stat.st_mtime_ns))
        os.replace(tmp, path)

    put(changed)
    try:
        yield
    finally:
        put(raw)


def test_a_source_with_other_data_misses_and_the_entries_of_both_stay(cached, first):
    """The source's data is in the key: the same name, size, header and modification time with other bytes misses;
    each version of the file keeps its entry (nothing rewritten), and the first hits again once it is back."""
    first_latent, _ = first
    cached.clear()
    cached.load()
    (entry,) = cached.entries()
    before = os.stat(entry).st_ino
    with other_data(cached.source):
        latent, report = cached.sample()
    (other,) = [path for path in cached.entries() if path != entry]
    assert f"{LABEL}: miss (no cache file yet); wrote {other}" in report, report
    assert not torch.equal(latent, first_latent)
    latent, report = cached.sample()
    assert f"{LABEL}: hit, loaded {entry}" in report and torch.equal(latent, first_latent), report
    assert os.stat(entry).st_ino == before and os.path.exists(other)


def test_servers_with_different_keys_alternate_on_one_folder_without_rewriting_each_others_entry(
        cached, first, comfy, tmp_path):
    """A second server with another BIGDIT_* knob (BIGDIT_AUTO_ROWS) shares the folder (BIGDIT_QUANT_CACHE) and
    loads the same data from its own copy of the file: a miss that names the knob, then each server hits its own
    entry, in turn, and neither file is written again. Its first use of the folder removes the temporary file a
    crashed write left there, not a live write's."""
    first_latent, _ = first
    cached.clear()
    cached.load()
    (ours,) = cached.entries()
    crashed = cached.folder / f".{os.path.basename(ours)}.0123abcd.partial"
    writing = cached.folder / f".{os.path.basename(ours)}.4567cdef.partial"
    for partial in (crashed, writing):
        partial.write_bytes(b"x")
    os.utime(crashed, (1, 1))
    other = ComfyServer(tmp_path, comfy.host, env={"BIGDIT_QUANT_CACHE": str(cached.folder),
                                                   "BIGDIT_QUANT_CACHE_GIB": str(LIMIT / 2 ** 30),
                                                   "BIGDIT_AUTO_ROWS": "4096"})
    try:
        shutil.copy(cached.source, other.models_dir / "diffusion_models" / SOURCE)
        (other.models_dir / "vae" / cached.vae).symlink_to(cached.server.models_dir / "vae" / cached.vae)
        theirs_cached = Cached(other, cached.folder, other.models_dir / "diffusion_models" / SOURCE, cached.vae)
        latent, report = theirs_cached.sample()
        (theirs,) = [path for path in cached.entries() if path != ours]
        assert (f"{LABEL}: miss (no cache file for this key yet; the folder's 1 file(s) of this source differ in: a "
                f"BIGDIT_* environment variable); wrote {theirs}") in report, report
        assert torch.equal(latent, first_latent)  # the knob is auto's: int8_convrot's bytes do not depend on it
        assert not crashed.exists() and writing.exists()
        files = {path: os.stat(path).st_ino for path in (ours, theirs)}
        for server, entry in ((cached, ours), (theirs_cached, theirs), (cached, ours), (theirs_cached, theirs)):
            latent, report = server.sample()
            assert f"{LABEL}: hit, loaded {entry} as stored" in report and "wrote" not in report, report
            assert torch.equal(latent, first_latent)
        assert {path: os.stat(path).st_ino for path in (ours, theirs)} == files
    finally:
        other.stop()
        writing.unlink(missing_ok=True)


PLANTED = '''

# planted by tests/integration/test_quant_cache_workflows.py: another INT8 routine, its weights scaled
_planted_quantize_weight = Int8ConvRotMethod.quantize_weight


def _scaled(self, weight):
    tensors = _planted_quantize_weight(self, weight)
    tensors["weight_scale"] = tensors["weight_scale"] * 2
    return tensors


Int8ConvRotMethod.quantize_weight = _scaled
'''


def test_a_changed_quantization_routine_misses(cached, first, comfy, tmp_path):
    """A version of the pack whose INT8 routine quantizes otherwise (planted in a copy of the pack), sharing the folder
    and the model file: a miss naming the pack's code, its own entry, and its own weights; the first server still
    hits its entry with the first latent."""
    first_latent, _ = first
    cached.clear()
    cached.load()
    (ours,) = cached.entries()
    pack = tmp_path / "planted_pack"
    shutil.copytree(PACK_ROOT, pack, ignore=shutil.ignore_patterns("tests", ".git", "__pycache__"))
    with open(pack / "quant" / "int8_convrot.py", "a") as f:
        f.write(PLANTED)
    (tmp_path / "custom_nodes").mkdir()
    (tmp_path / "custom_nodes" / "bigdit").symlink_to(pack, target_is_directory=True)  # in place of the pack
    planted = ComfyServer(tmp_path, comfy.host, env={"BIGDIT_QUANT_CACHE": str(cached.folder),
                                                     "BIGDIT_QUANT_CACHE_GIB": str(LIMIT / 2 ** 30)})
    try:
        (planted.models_dir / "diffusion_models" / SOURCE).symlink_to(cached.source)
        (planted.models_dir / "vae" / cached.vae).symlink_to(cached.server.models_dir / "vae" / cached.vae)
        theirs_cached = Cached(planted, cached.folder, cached.source, cached.vae)
        latent, report = theirs_cached.sample()
        (theirs,) = [path for path in cached.entries() if path != ours]
        assert (f"{LABEL}: miss (no cache file for this key yet; the folder's 1 file(s) of this source differ in: the "
                f"pack's quantizing code); wrote {theirs}") in report, report
        assert not torch.equal(latent, first_latent)
        again, report = theirs_cached.sample()
        assert f"{LABEL}: hit, loaded {theirs}" in report and torch.equal(again, latent), report
    finally:
        planted.stop()
    latent, report = cached.sample()
    assert f"{LABEL}: hit, loaded {ours}" in report and torch.equal(latent, first_latent), report


def test_the_least_recently_used_files_go_past_the_limit(cached, first):
    cached.clear()
    cached.load()
    (entry,) = cached.entries()
    size = os.path.getsize(entry)
    assert 3 * size <= LIMIT, "the tiny Wan's cache file grew: raise LIMIT"
    # the cache's files, used 1000 s ago and later, as many as fit beside the entry with no room for one more
    copies = [cached.folder / f"copy{i}-{i:020x}.safetensors" for i in range(LIMIT // size - 1)]
    for i, path in enumerate(copies):
        shutil.copy(entry, path)
        os.utime(path, (os.path.getmtime(entry) - 1000 + i,) * 2)
    junk = [cached.folder / f"nokey-{'0' * 20}.safetensors", cached.folder / "large.bin"]
    shutil.copy(cached.source, junk[0])
    with open(junk[1], "wb") as f:
        f.truncate(4 * LIMIT)  # sparse: counted by nobody, as the cache is not its owner
    assert f"{LABEL}: hit" in cached.load()[1]  # the entry is now the most recently used
    _, report = cached.load(OTHER)
    (new,) = [p for p in cached.entries() if p not in {entry, *map(str, copies), str(junk[0])}]
    gone = [path for path in copies if not path.exists()]
    assert gone and gone == copies[:len(gone)], (gone, copies)  # the least recently used, in order
    assert f"wrote {new}" in report and f"evicted the {len(gone)} least recently used file(s)" in report, report
    assert os.path.exists(entry) and all(path.exists() for path in junk)
    assert sum(os.path.getsize(p) for p in cached.entries() if p != str(junk[0])) <= LIMIT


def test_a_folder_that_cannot_be_made_falls_back(cached, first, tmp_path):
    aside = tmp_path / "aside"
    cached.folder.rename(aside)
    cached.folder.write_text("a file where the cache folder should be")
    try:
        _, report = cached.load()
    finally:
        cached.folder.unlink()
        aside.rename(cached.folder)
    assert f"{LABEL}: miss (no cache file yet); not written to {cached.folder} (FileExistsError" in report, report
    assert report.startswith("quantized ") and "quantized while loading: " in report


def test_a_low_disk_fails_the_write_before_anything_is_evicted(cached, first, tmp_path):
    """A small filesystem (a 64 MiB tmpfs mounted over the folder, where this user may mount one) holding the cache's
    files up to its limit, so that a write must evict: the room check (the file and a margin of at least 256 MiB)
    fails first, nothing is evicted or left behind, and the model samples the first load's latent."""
    first_latent, _ = first
    cached.clear()
    cached.load(OTHER)
    (made,) = cached.entries()
    entry = tmp_path / "entry.safetensors"
    shutil.copy(made, entry)
    cached.clear()
    cached.folder.mkdir()
    try:
        mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64m", "tmpfs", str(cached.folder)],
                                 capture_output=True, text=True)
        failed = mounted.returncode and mounted.stderr.strip()
    except OSError as exc:  # no mount command
        failed = str(exc)
    if failed:
        pytest.skip(f"a full disk needs a small filesystem, and mounting a tmpfs failed (it needs root): {failed}")
    try:
        copies = [f"copy{i}-{i:020x}.safetensors" for i in range(LIMIT // entry.stat().st_size)]
        for name in copies:
            shutil.copy(entry, cached.folder / name)
        latent, report = cached.sample()
        left = set(os.listdir(cached.folder)) - {MEMO_NAME}
    finally:
        subprocess.run(["umount", "-l", str(cached.folder)], check=True)
    assert f"not written to {cached.folder} (not enough disk space: " in report, report
    assert "more once the cache's evictions are done); nothing was evicted); loaded as without the cache" in report, \
        report
    assert left == set(copies)  # nothing evicted, nothing left behind
    assert torch.equal(latent, first_latent)


def test_a_format_no_marker_stores_is_not_cached(cached):
    cached.clear()
    _, report = cached.load({**INPUTS, "quantization": "mxfp4"})
    assert f"{LABEL}: miss (no cache file yet); not written: cannot save " in report and "MXFP4" in report, report
    assert "mxfp4 x" in report.splitlines()[2] and cached.entries() == []


DYNAMIC = r"""
from bigdit.host.cache import settings
from bigdit.host.loading import load_checkpoint
from bigdit.quant.linear import QuantLinear

out = {"folders": [], "models_dir": folder_paths.models_dir}
for env in ({}, {"BIGDIT_QUANT_CACHE_GIB": "0.5"}, {"BIGDIT_QUANT_CACHE": "/x/env"}):
    os.environ.update(env)
    if env.get("BIGDIT_QUANT_CACHE_GIB"):
        folder_paths.add_model_folder_path("bigdit_cache", "/x/extra")  # as extra_model_paths.yaml adds it
    found, why = settings()
    out["folders"].append([found.folder, found.limit])
for value in ("0", "-1", "lots", "nan"):
    os.environ["BIGDIT_QUANT_CACHE_GIB"] = value
    out["folders"].append(settings()[1])

# the patcher ComfyUI makes for a GPU under dynamic VRAM, retargeted to the CPU
comfy.model_patcher.CoreModelPatcher = lambda model, load_device, offload_device: on_cpu_dynamic(model)
cache, temp = tempfile.mkdtemp(), tempfile.mkdtemp()
folder_paths.set_temp_directory(temp)
folder_paths.add_model_folder_path("diffusion_models", os.path.dirname(model_path))
os.environ["BIGDIT_QUANT_CACHE"] = cache


def loaded(pages_from_files, limit):
    os.environ["BIGDIT_QUANT_CACHE_GIB"] = limit
    comfy.memory_management.aimdo_enabled = pages_from_files  # as main.py sets it on a GPU
    try:
        return load_checkpoint("LoadH3Quantized", "diffusion_models", os.path.basename(model_path),
                               quantization="int8_convrot", offload_input="none", cached=True).result
    finally:
        comfy.memory_management.aimdo_enabled = False  # sampling here runs the CPU path


def file_of(tensor):
    info = tensor.untyped_storage()._comfy_tensor_file_slice
    fd = info.file_ref if isinstance(info.file_ref, int) else info.file_ref.fileno()
    same = os.pread(fd, info.size, info.offset) == tensor.contiguous().view(torch.uint8).numpy().tobytes()
    stat = os.fstat(fd)
    return (stat.st_dev, stat.st_ino), same and info.size == tensor.numel() * tensor.element_size()


def files(patcher):
    # paged tensor -> (which file, its slice holds its bytes)
    out = {}
    for key, (module, name) in paged_tensors(patcher.model).items():
        tensor = module._parameters[name]
        if hasattr(tensor.untyped_storage(), "_comfy_tensor_file_slice"):
            out[key] = (isinstance(module, QuantLinear),) + file_of(tensor)
        else:
            out[key] = (isinstance(module, QuantLinear), None, False)
    return out


def identity(path):
    stat = os.stat(path)
    return stat.st_dev, stat.st_ino


import bigdit.host.file_backed as file_backed
rebound, real_rebind = [], file_backed._rebind


def recording(tensors, mapped):  # the tensors a rebinding lets go of: the process memory they held
    rebound.extend(weakref.ref(module._parameters[name]) for module, name in tensors.values())
    real_rebind(tensors, mapped)


reference, _ = loaded(False, "0")
file_backed._rebind = recording
miss, miss_report = loaded(True, "1")
file_backed._rebind = real_rebind
gc.collect()
out["rebound"], out["freed"] = len(rebound), sum(ref() is None for ref in rebound)
(entry,) = [os.path.join(cache, name) for name in os.listdir(cache) if name.endswith(".safetensors")]
hit, hit_report = loaded(True, "1")
out["miss_report"], out["hit_report"], out["temp_left"] = miss_report, hit_report, os.listdir(temp)
where = {identity(entry): "cache", identity(model_path): "source"}
for name, patcher in (("miss", miss), ("hit", hit)):
    found = files(patcher)
    out[name] = {key: [quantized, where.get(file), same] for key, (quantized, file, same) in found.items()}
out["latents"] = [all(torch.equal(a, b) for a, b in zip(sample(patcher), want)) for want in [sample(reference)]
                  for patcher in (miss, hit)]
# the host computes in another dtype (--bf16-unet): the file's layers were quantized for fp32
from comfy.cli_args import args
args.bf16_unet = True
out["bf16_report"] = loaded(True, "1")[1]
from safetensors import safe_open
with safe_open(entry, "pt") as f:
    out["bf16_written_for"] = json.loads(f.metadata()["bigdit_cache_compute_dtypes"])
print(json.dumps(out))
"""


@pytest.mark.host_feature("dynamic_vram")
def test_dynamic_vram_pages_a_miss_and_a_hit_from_the_cache_file(comfy, tiny_wan2):
    out = run_probe(comfy, DYNAMIC, tiny_wan2["path"], "wan", 4096)
    miss, hit = out["miss"], out["hit"]
    detail = json.dumps(out, indent=1)[:6000]
    assert out["temp_left"] == [] and "scratch" not in out["miss_report"] + out["hit_report"], detail
    assert out["rebound"] == sum(q for q, _, _ in miss.values()) and out["freed"] == out["rebound"], detail
    assert "ComfyUI pages the " in out["miss_report"] and "of quantized weights from the cache file" in \
        out["miss_report"], detail
    assert f"{LABEL}: hit" in out["hit_report"], detail
    # a miss: the quantized layers' tensors from the cache file, those kept as stored from the source; a hit:
    # everything from the cache file; each slice holds the tensor's bytes
    assert any(q for q, _, _ in miss.values()) and set(miss) == set(hit), detail
    assert all(where == "cache" and same for q, where, same in miss.values() if q), detail
    assert all(where in ("cache", "source") and same for _, where, same in miss.values()), detail
    assert all(where == "cache" and same for _, where, same in hit.values()), detail
    assert out["latents"] == [True, True], detail
    assert f"{LABEL}: miss (stale: the model computes in ['torch.bfloat16'] here, the file was written for " \
           "['torch.float32']); wrote" in out["bf16_report"], detail
    assert out["bf16_written_for"] == ["torch.bfloat16"], detail
    gib = 2 ** 30
    assert out["folders"] == [[out["models_dir"] + "/bigdit_cache", 100 * gib], ["/x/extra", gib // 2],
                              ["/x/env", gib // 2], "BIGDIT_QUANT_CACHE_GIB=0",
                              *(f"BIGDIT_QUANT_CACHE_GIB={v!r} is not a number of GiB" for v in ("-1", "lots", "nan"))]


HIT_PROBE = r"""
import json, os, shutil, sys, tempfile, types
pack_root, model_path = sys.argv[1], sys.argv[2]
sys.path.insert(0, os.getcwd())
from comfy.cli_args import args
args.cpu = True
import torch
import comfy.model_management
import folder_paths
pkg = types.ModuleType("bigdit"); pkg.__path__ = [pack_root]; sys.modules["bigdit"] = pkg
import bigdit.host.cache as host_cache
from bigdit.host.loading import load_checkpoint
from bigdit.loaders.quant_cache import entry_key

cache, models = tempfile.mkdtemp(), tempfile.mkdtemp()
model_path = shutil.copy(model_path, models)  # a copy of its own: touched below
folder_paths.add_model_folder_path("diffusion_models", models)
os.environ["BIGDIT_QUANT_CACHE"] = cache


def loaded(group, limit="1"):
    os.environ["BIGDIT_QUANT_CACHE_GIB"] = limit
    return load_checkpoint("LoadH3Quantized", "diffusion_models", os.path.basename(model_path),
                           quantization="int8_convrot", group_size=group, offload_input="none", cached=True).result


def weights(patcher):
    return {k: v.detach().reshape(-1).contiguous().view(torch.uint8)
            for k, v in patcher.model.diffusion_model.state_dict().items()}


def same(patcher):
    found = weights(patcher)
    return found.keys() == reference.keys() and all(torch.equal(found[k], reference[k]) for k in found)


def entry(group):
    (path,) = [os.path.join(cache, name) for name in os.listdir(cache)
               if (entry_key(os.path.join(cache, name)) or {}).get("options", {}).get("group_size") == group]
    return path


reference = weights(loaded("256", "0")[0])  # without the cache
out = {"first": loaded("256")[1]}
loaded("64")
ours, theirs = entry(256), entry(64)
real_load = host_cache.load


def hit_loads(action):
    # the hit's load of its entry, with `action` first (the pipeline reads the file by path from here on)
    def load(path, *rest):
        if path == ours:
            action()
        return real_load(path, *rest)
    host_cache.load = load
    try:
        patcher, report = loaded("256")
    finally:
        host_cache.load = real_load
    return [same(patcher), report]


aside = shutil.copy(theirs, cache + ".aside")
out["replaced"] = hit_loads(lambda: os.replace(aside, ours))  # another server's file renamed over it, after the check
out["hit_after_replaced"] = hit_loads(lambda: None)


def fails():
    raise RuntimeError("planted failure")


out["failed"] = hit_loads(fails)


def interrupted():
    raise comfy.model_management.InterruptProcessingException()


try:
    hit_loads(interrupted)
    out["interrupt"] = "swallowed"
except comfy.model_management.InterruptProcessingException:
    out["interrupt"] = "raised"


def touching(path, *rest):  # a miss's load, during which another program writes the source
    loaded = real_load(path, *rest)
    if path == model_path:
        os.utime(model_path)
    return loaded


host_cache.load = touching
out["changed"] = loaded("16")[1]
out["entries"] = sorted(entry_key(os.path.join(cache, n))["options"]["group_size"] for n in os.listdir(cache)
                        if n.endswith(".safetensors"))
print(json.dumps(out))
"""


def test_a_hit_replaced_while_checked_or_failing_rebuilds_with_the_right_weights(comfy, tiny_wan2):
    """Through host/loading.py's load_checkpoint in the host's Python, an entry whose hit meets, between its check and
    its load, another server's file renamed over it, then one whose load raises an error of no expected kind: each is
    rebuilt, the report saying why, with the weights of a load without the cache, bit for bit; a user's interrupt
    during a hit is the host's, not a reason to rebuild; a miss whose source is written while it loads writes no
    entry."""
    result = subprocess.run([str(comfy.host.python), "-c", HIT_PROBE, str(PACK_ROOT), str(tiny_wan2["path"])],
                            cwd=comfy.host.comfyui, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-6000:]
    out = json.loads(result.stdout.strip().splitlines()[-1])
    assert f"{LABEL}: miss (no cache file yet); wrote" in out["first"], out["first"]
    same, report = out["replaced"]
    assert same and f"{LABEL}: miss (the cache file was replaced while it was checked and loaded); wrote" in report, \
        report
    same, report = out["hit_after_replaced"]
    assert same and f"{LABEL}: hit" in report, report
    same, report = out["failed"]
    assert same and (f"{LABEL}: miss (the cache file does not load (RuntimeError: planted failure)); wrote"
                     in report), report
    assert out["interrupt"] == "raised"
    # the source written while a miss loaded it: its weights may be of either version, so no entry is written
    assert (f"{LABEL}: miss (no cache file for this key yet; the folder's 2 file(s) of this source differ in: the "
            "load's inputs); not written: the source file changed while it loaded") in out["changed"], out["changed"]
    assert out["entries"] == [64, 256]


def test_an_already_quantized_file_is_neither_written_nor_hashed(cached, comfy, tiny_wan2):
    """The tiny Wan with its block linears stored as INT8 ConvRot markers (the layout of Comfy-Org's INT8 files),
    loaded with `int8_convrot`: its plain linears stay as the file keeps them, nothing is quantized at load, so no
    entry is written and the file's data is never hashed."""
    from checkpoint_files import write_markers
    markers = {f"blocks.{b}.{name}": {"format": "int8_tensorwise", "convrot": True, "convrot_groupsize": 256}
               for b in range(2) for name in ("self_attn.q", "self_attn.k", "self_attn.v", "self_attn.o",
                                              "cross_attn.q", "cross_attn.k", "cross_attn.v", "cross_attn.o",
                                              "ffn.0", "ffn.2")}
    name = "cache_wan_int8.safetensors"
    write_markers(tiny_wan2["path"], cached.server.models_dir / "diffusion_models" / name, markers)
    cached.clear()
    _, report = cached.load({**INPUTS, "unet_name": name})
    assert (f"{LABEL}: miss (no cache file yet); not written: nothing was quantized or converted, the file loads "
            "as it is") in report, report
    assert cached.entries() == []
    memo = cached.folder / MEMO_NAME
    assert not memo.exists() or name not in memo.read_text()


def test_a_load_that_quantizes_a_small_share_is_neither_written_nor_hashed(cached):
    """The bf16 tiny Wan with its blocks kept (`ignored_layers`): only the few plain linears outside them are
    quantized, well under half of the weights (host/cache.py WORTH_CACHING), so no entry of the whole model is
    written and the file's data is never hashed."""
    cached.clear()
    _, report = cached.load({**INPUTS, "ignored_layers": "blocks.*"})
    assert f"{LABEL}: miss (no cache file yet); not written: the layers quantized or converted at load held" in report, \
        report
    assert "quantizing them again costs less than a cache file of the whole model" in report
    assert cached.entries() == []
    memo = cached.folder / MEMO_NAME
    assert not memo.exists() or SOURCE not in memo.read_text()


# ---- auto's first-call checks, carried by the entry ----------------------------------------------------------------

AUTO = {**INPUTS, "quantization": "auto"}
OUTLIER_SOURCE, OUTLIER_LAYER = "cache_wan_outliers.safetensors", "blocks.0.ffn.2"
MASSIVE = 1e5


def checks_written(report: str, entry: str) -> int:
    """How many layers' checks the miss that wrote `entry` put into it."""
    found = re.search(re.escape(f"; wrote {entry} (") + r"[^)]*\) for the next load, with the first-call checks of "
                      r"(\d+) layer\(s\) \(([\d.]+) MiB of sketches\)", report)
    assert found, report
    return int(found[1])


def test_a_hit_checks_the_layers_auto_chose_as_the_miss_did_and_samples_the_same(cached):
    cached.clear()
    latent, report, line = cached.sample_run(AUTO)
    (entry,) = cached.entries()
    checked = checks_written(report, entry)
    quantized = int(re.match(r"quantized (\d+)/", report)[1])
    assert checked == quantized, report  # every layer auto quantized
    assert re.match(rf"ran {quantized}/{quantized} quantized layers; auto's formats on real input: {checked} "
                    r"checked \(bound 0.08\), error up to 0\.0\d+(;|$)", line) and "fell back" not in line, line
    # the entry's sketches are the layers' companions, never the model's: ComfyUI loads it with no stray key
    with safe_open(entry, "pt") as f:
        sketches = [key for key in f.keys() if key.endswith(".bigdit_check_sketch")]
        assert len(sketches) == checked and json.loads(f.metadata()["bigdit_cache_checks"]).keys() == {
            key[:-len(".bigdit_check_sketch")] for key in sketches}
    hit_latent, hit_report, hit_line = cached.sample_run(AUTO)
    assert (f"{LABEL}: hit, loaded {entry} as stored" in hit_report
            and f"; the first-call checks of {checked} layer(s) from its sketches" in hit_report), hit_report
    assert hit_line == line  # the same errors, to the last digit
    assert torch.equal(hit_latent, latent)
    assert not os.path.exists(fallbacks_path(entry))  # no check took a fallback


@pytest.fixture(scope="module")
def outliers(cached):
    """A copy of the tiny Wan in which 4 of blocks.0.ffn.2's input channels carry 1e5 for every token (ffn.0's bias
    there, which GELU passes) and its weights there are 1e-5 times the others', so that the other channels still
    make its output (tests/test_real_error.py's outlier layer): INT8 ConvRot's per-token scale crushes them."""
    from checkpoint_files import load
    tensors, metadata = load(cached.source)
    (bias,) = [k for k in tensors if k.endswith("blocks.0.ffn.0.bias")]
    (weight,) = [k for k in tensors if k.endswith(f"{OUTLIER_LAYER}.weight")]
    tensors[bias][:4] = MASSIVE
    tensors[weight][:, :4] /= MASSIVE
    save_file(tensors, cached.server.models_dir / "diffusion_models" / OUTLIER_SOURCE, metadata)
    return {**AUTO, "unet_name": OUTLIER_SOURCE}


def test_an_outlier_layer_falls_back_on_the_miss_and_on_the_hit_and_the_next_loads_take_it_kept(cached, outliers):
    cached.clear()
    latent, report, line = cached.sample_run(outliers)
    (entry,) = cached.entries()
    checked = checks_written(report, entry)
    fell_back = re.compile(rf"; 1 fell back: {OUTLIER_LAYER}: int8_convrot (\d+\.\d+) -> full precision "
                           r"(0\.00\d+)(;|$)")
    found = fell_back.search(line)
    assert found and float(found[1]) > 0.08 and f"auto's formats on real input: {checked} checked" in line, line
    kept_at = fallbacks_path(entry)
    with open(kept_at) as f:
        kept = json.load(f)
    assert list(kept) == [OUTLIER_LAYER] and kept[OUTLIER_LAYER]["runs"] == "full precision", kept
    assert kept[OUTLIER_LAYER]["error"] == pytest.approx(float(found[1]), abs=1e-4)
    # a hit checks the layer again from the entry's sketch and takes the same fallback, built from the source
    os.unlink(kept_at)
    hit_latent, hit_report, hit_line = cached.sample_run(outliers)
    assert f"{LABEL}: hit, loaded {entry} as stored" in hit_report, hit_report
    assert hit_line == line and torch.equal(hit_latent, latent), (hit_line, line)
    with open(kept_at) as f:
        assert json.load(f) == kept
    # the next load takes the kept fallback at load: the layer is not checked again
    taken = (f"1 layer(s) compute with the fallback an earlier load's first-call check took, unchecked "
             f"({OUTLIER_LAYER}: int8_convrot -> full precision; kept in {os.path.basename(kept_at)})")
    kept_latent, kept_report, kept_line = cached.sample_run(outliers)
    assert f"{LABEL}: hit, loaded {entry}" in kept_report and taken in kept_report, kept_report
    assert f"auto's formats on real input: {checked - 1} checked" in kept_line and "fell back" not in kept_line, \
        kept_line
    assert torch.equal(kept_latent, latent)
    # so does a miss that writes the entry again (here: it was cut short)
    with open(entry, "r+b") as f:
        f.truncate(os.path.getsize(entry) - 1000)
    again_latent, again_report, again_line = cached.sample_run(outliers)
    assert f"{LABEL}: miss (the cache file is damaged or cut short" in again_report and taken in again_report, \
        again_report
    assert "fell back" not in again_line and torch.equal(again_latent, latent), again_line
    # an entry evicted takes its kept fallbacks with it: copies of it used later fill the folder, and another entry
    # of the same size evicts the least recently used, the entry
    size = os.path.getsize(entry)
    for i in range(LIMIT // size - 1):
        shutil.copy(entry, cached.folder / f"copy{i}-{i:020x}.safetensors")
    os.utime(entry, (os.path.getmtime(entry) - 1000,) * 2)
    _, report = cached.load({**outliers, "group_size": "64"})
    assert "evicted the " in report and not os.path.exists(entry) and not os.path.exists(kept_at), report
