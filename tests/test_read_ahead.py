"""loaders/read_ahead.py: what is read ahead (all a job's files where the RAM holds them with the copies the host
keeps, else none) and the reading itself (every byte of a file, in stripes; each file once; one log line)."""
import logging
import os
import sys
import time
from pathlib import Path

import pytest

from bigdit.loaders import read_ahead
from bigdit.loaders.read_ahead import HEADROOM, STRIPES, AheadFile, Reader, drop_cached, plan, read_file, stripes_for
from bigdit.units import GIB

sys.path.insert(0, str(Path(__file__).resolve().parent / "bench"))
from page_cache import cached_bytes  # noqa: E402


def files():
    return [AheadFile("encoder", 14 * GIB, held=True), AheadFile("dit", 20 * GIB), AheadFile("vae", 3 * GIB)]


def test_all_files_where_they_fit_with_the_held_copy_and_headroom():
    need = (14 + 20 + 3 + 14) * GIB + HEADROOM
    assert plan(files(), need) == (files(), "")
    chosen, why = plan(files(), need - 1)
    assert chosen == [] and why.startswith("the files need 55.00 GiB of RAM"), why


def test_nothing_where_the_room_is_unknown_or_nothing_is_named():
    assert plan(files(), None) == ([], "the system does not say how much RAM is free")
    assert plan([], 100 * GIB) == ([], "no model file named")


@pytest.mark.parametrize("size", [0, 1, 5 * 1024 * 1024 + 3, 16 * 1024 * 1024])
@pytest.mark.parametrize("stripes", [1, 4])
def test_read_file_reads_every_byte(tmp_path, size, stripes):
    path = tmp_path / "f.bin"
    path.write_bytes(bytes(range(256)) * (size // 256) + b"x" * (size % 256))
    assert read_file(str(path), stripes=stripes, chunk=1024 * 1024) == size


def sys_block(tmp_path, path, rotational, partition):
    """A /sys/dev/block whose entry for `path`'s device is a disk (or a partition of one, a link into the disk's
    folder as sysfs has it) with `queue/rotational` = `rotational`."""
    dev = os.stat(path).st_dev
    disk = tmp_path / "devices" / "sda"
    (disk / "queue").mkdir(parents=True)
    (disk / "queue" / "rotational").write_text(f"{rotational}\n")
    target = disk / "sda1" if partition else disk
    target.mkdir(exist_ok=True)
    root = tmp_path / "block"
    root.mkdir()
    (root / f"{os.major(dev)}:{os.minor(dev)}").symlink_to(target, target_is_directory=True)
    return str(root)


@pytest.mark.skipif(not hasattr(os, "major"), reason="device numbers are POSIX's")
@pytest.mark.parametrize("partition", [False, True])
def test_a_spinning_disk_is_read_by_one_reader_and_the_rest_in_stripes(tmp_path, partition):
    path = tmp_path / "f.bin"
    path.write_bytes(b"\0" * 10)
    assert stripes_for(str(path), 4, sys_block(tmp_path / "hdd", path, 1, partition)) == 1
    assert stripes_for(str(path), 4, sys_block(tmp_path / "ssd", path, 0, partition)) == 4
    assert stripes_for(str(path), 4, str(tmp_path / "no-sysfs")) == 4  # the system does not say
    assert stripes_for(str(tmp_path / "gone.bin")) == STRIPES


def test_the_reader_reads_each_file_once_and_says_so(tmp_path, caplog):
    paths = []
    for i, size in enumerate((3_000_000, 1_000_001)):
        paths.append(tmp_path / f"{i}.bin")
        paths[-1].write_bytes(b"\1" * size)
    ahead = [AheadFile(str(p), p.stat().st_size) for p in paths]
    log = logging.getLogger("test_read_ahead")
    reader = Reader(log, stripes=2)
    with caplog.at_level(logging.INFO, logger="test_read_ahead"):
        assert reader.submit(ahead, "job 1") == ahead
        assert reader.submit(ahead[:1], "job 2") == [] and reader.seen(ahead[0])
        deadline = time.monotonic() + 30
        while not caplog.records and time.monotonic() < deadline:
            time.sleep(0.05)
    (record,) = caplog.records
    assert record.getMessage().startswith("read-ahead for job 1: 2 files, 0.00 GiB in "), record.getMessage()


def test_a_missing_file_is_logged_and_the_rest_are_read(tmp_path, caplog):
    good = tmp_path / "good.bin"
    good.write_bytes(b"\2" * 4096)
    log = logging.getLogger("test_read_ahead_missing")
    reader = Reader(log)
    with caplog.at_level(logging.INFO, logger="test_read_ahead_missing"):
        reader.submit([AheadFile(str(tmp_path / "gone.bin"), 10), AheadFile(str(good), 4096)], "job")
        deadline = time.monotonic() + 30
        while len(caplog.records) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
    messages = [r.getMessage() for r in caplog.records]
    assert messages[0].startswith(f"read-ahead of {tmp_path / 'gone.bin'} stopped:"), messages
    assert messages[1].startswith("read-ahead for job: 2 files, 0.00 GiB in "), messages



def test_read_file_stops_at_the_chunk_after_it_is_told(tmp_path):
    path = tmp_path / "f.bin"
    path.write_bytes(b"\4" * (8 * 1024))
    checks = []

    def stopped():
        checks.append(1)
        return len(checks) > 3  # three chunks read, then stop
    assert read_file(str(path), stripes=1, chunk=1024, stopped=stopped) == 3 * 1024
    assert read_file(str(path), stripes=2, chunk=1024, stopped=lambda: True) == 0


def test_a_stopped_file_is_read_no_further_and_the_line_says_where_it_stopped(tmp_path, caplog):
    """A file stopped before the reader's turn comes to it is not read, a held one is not kept for release_held,
    the others are read, and the line names it."""
    other, held = tmp_path / "other.bin", tmp_path / "held.bin"
    other.write_bytes(b"\5" * 4096)
    held.write_bytes(b"\5" * 4096)
    log = logging.getLogger("test_read_ahead_stop")
    reader = Reader(log, stripes=1)
    reader.stop([str(held)])
    with caplog.at_level(logging.INFO, logger="test_read_ahead_stop"):
        reader.submit([AheadFile(str(held), 4096, held=True), AheadFile(str(other), 4096)], "job")
        deadline = time.monotonic() + 30
        while not caplog.records and time.monotonic() < deadline:
            time.sleep(0.05)
    (record,) = caplog.records
    message = record.getMessage()
    assert message.startswith("read-ahead for job: 2 files, 0.00 GiB in "), message
    assert message.endswith("; stopped as their loader read them: held.bin at 0.00 GiB"), message
    assert reader.release_held() == []


def test_cached_bytes_counts_a_files_pages_in_the_page_cache(tmp_path):
    path = tmp_path / "model.safetensors"
    path.write_bytes(os.urandom(3 * 4096 + 100))  # just written: every page in the cache (tmpfs or a disk's)
    assert cached_bytes(path) == path.stat().st_size
    (tmp_path / "empty").write_bytes(b"")
    assert cached_bytes(tmp_path / "empty") == 0
    assert cached_bytes(tmp_path / "gone") is None


@pytest.mark.skipif(not hasattr(os, "posix_fadvise"), reason="the system has no posix_fadvise (not Linux)")
def test_drop_cached_empties_a_files_pages_from_the_page_cache(tmp_path):
    path = tmp_path / "cached.bin"
    path.write_bytes(os.urandom(4 * 1024 * 1024))
    with open(path, "rb") as f:
        os.fsync(f.fileno())  # written pages are dirty until on disk, and the kernel drops only clean ones
    read_file(str(path), stripes=2)
    before = cached_bytes(path)
    assert drop_cached(str(path))
    after = cached_bytes(path)
    assert before == path.stat().st_size and after == 0, (before, after)  # every page, then none
    assert not drop_cached(str(tmp_path / "gone.bin"))


def test_release_held_drops_the_held_files_read_whole_once(tmp_path, monkeypatch):
    dropped = []
    monkeypatch.setattr(read_ahead, "drop_cached", lambda path: dropped.append(path) or True)
    paths = []
    for name in ("encoder", "dit"):
        paths.append(tmp_path / f"{name}.bin")
        paths[-1].write_bytes(b"\3" * 8192)
    encoder, dit = AheadFile(str(paths[0]), 8192, held=True), AheadFile(str(paths[1]), 8192)
    reader = Reader(logging.getLogger("test_read_ahead_release"), stripes=1)
    assert reader.release_held() == []  # nothing read yet
    reader.submit([encoder, dit], "job")
    deadline, released = time.monotonic() + 30, []
    while not released and time.monotonic() < deadline:  # the reader's thread reads the encoder first
        released = reader.release_held()
        time.sleep(0.01)
    assert released == [encoder] and dropped == [encoder.path]
    assert reader.release_held() == [] and dropped == [encoder.path]  # once


def trunk_file(path, blocks=12, width=64):
    """A safetensors file as a DiT's: an embedding, a refiner's numbered blocks, the trunk's blocks (more bytes,
    numbered 0 to blocks - 1, so that the file's order puts 10 before 2) and a head."""
    import safetensors.torch
    import torch
    tensors = {"embed.weight": torch.ones(width, width), "refiner.blocks.0.w": torch.ones(4, 4),
               "head.weight": torch.ones(width, 2)}
    for i in range(blocks):
        tensors[f"model.diffusion_model.blocks.{i}.attn.weight"] = torch.full((width, width), float(i))
        tensors[f"model.diffusion_model.blocks.{i}.ff.2.weight"] = torch.full((width, width), float(i))
    safetensors.torch.save_file(tensors, str(path))
    return tensors


def test_execution_groups_put_the_trunk_blocks_in_index_order_after_the_rest(tmp_path):
    import json
    import struct
    path = tmp_path / "dit.safetensors"
    tensors = trunk_file(path)
    trunk, groups = read_ahead.execution_groups(str(path))
    assert trunk == "model.diffusion_model.blocks" and len(groups) == 1 + 12
    raw = path.read_bytes()
    (length,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + length])

    def span(name):
        start, end = header[name]["data_offsets"]
        return 8 + length + start, end - start
    outside = sorted(span(n) for n in ("embed.weight", "refiner.blocks.0.w", "head.weight"))
    assert sum(n for _, n in groups[0]) == sum(n for _, n in outside)
    for i in range(12):  # block i's two tensors, contiguous in the file, one range
        names = [f"model.diffusion_model.blocks.{i}.attn.weight", f"model.diffusion_model.blocks.{i}.ff.2.weight"]
        assert sum(n for _, n in groups[1 + i]) == sum(tensors[n].numel() * 4 for n in names)
        assert {start for start, _ in groups[1 + i]} <= {start for start, _ in map(span, names)}
    (tmp_path / "plain.safetensors").write_bytes(struct.pack("<Q", 2) + b"{}")
    assert read_ahead.execution_groups(str(tmp_path / "plain.safetensors")) is None  # no trunk
    (tmp_path / "junk.bin").write_bytes(b"\xff" * 64)
    assert read_ahead.execution_groups(str(tmp_path / "junk.bin")) is None


def test_a_followed_file_is_read_in_block_order_within_its_window_skipping_what_the_model_reached(tmp_path,
                                                                                                  monkeypatch):
    """The model's position moves as the reader reads: the reader never reads a group past the window beyond the
    model's block, skips the blocks the model reached first, and reads the rest whole."""
    groups = [[(0, 100)]] + [[(100 + 100 * i, 100)] for i in range(10)]
    path = tmp_path / "model.bin"
    path.write_bytes(b"\1" * 1100)
    followed = read_ahead.Followed(str(path), groups, window=250)
    order = []
    real_open = open

    def opened(file, *args, **kwargs):  # each part's offset, in the order read, and the model's block then
        handle = real_open(file, *args, **kwargs)
        seek = handle.seek
        handle.seek = lambda offset, *a: (order.append((offset, followed.at)), seek(offset, *a))[1]
        return handle
    monkeypatch.setattr("builtins.open", opened)

    def model():  # blocks 0-3 reached slowly, then 4-6 at once (ahead of the reader), then the rest
        for at in (0, 1, 2, 3):
            time.sleep(0.05)
            followed.at = at
        time.sleep(0.05)
        followed.at = 6
        for at in (7, 8, 9):
            time.sleep(0.05)
            followed.at = at
    import threading
    thread = threading.Thread(target=model)
    thread.start()
    read, skipped = read_ahead.read_followed(followed, stripes=1, chunk=64, pause=0.001)
    thread.join()
    starts = [offset for offset, _ in order]
    assert starts == sorted(starts)  # in the groups' order
    for offset, at in order:  # `at` as the part was read: the model only moves on from the reader's decision
        assert offset // 100 - (at + 1) <= 2, (offset, at)  # the window's 250 bytes: 2 groups past the model's
    assert read == 100 * (11 - skipped) and skipped >= 1  # the groups it read, whole; block 6 reached first


def test_a_followed_file_skips_the_blocks_the_model_reached_and_waits_at_its_window(tmp_path, monkeypatch):
    groups = [[(0, 100)]] + [[(100 + 100 * i, 100)] for i in range(10)]
    path = tmp_path / "model.bin"
    path.write_bytes(b"\1" * 1100)
    followed = read_ahead.Followed(str(path), groups, window=250, at=4)
    waited = []
    monkeypatch.setattr(read_ahead.time, "sleep", lambda seconds: waited.append(seconds))
    read, skipped = read_ahead.read_followed(followed, stripes=1, chunk=64, stopped=lambda: bool(waited))
    # blocks 0-4 (and the tensors outside the trunk) reached: skipped; blocks 5 and 6 read (200 bytes of the
    # window's 250); block 7 would make 300: the reader waits there
    assert (read, skipped) == (200, 5) and waited


def test_a_followed_file_stops_when_unfollowed_and_says_what_it_read(tmp_path, caplog):
    path = tmp_path / "dit.safetensors"
    trunk_file(path)
    _, groups = read_ahead.execution_groups(str(path))
    log = logging.getLogger("test_read_ahead_follow")
    reader = Reader(log, stripes=2)
    followed = read_ahead.Followed(str(path), groups, window=1)  # one group ahead of the model at a time
    with caplog.at_level(logging.INFO, logger="test_read_ahead_follow"):
        reader.follow(followed, "a diffusion model's sampling")
        time.sleep(0.2)  # the model never moves: the reader holds at block 0's group
        reader.unfollow(str(path))
        deadline = time.monotonic() + 30
        while not caplog.records and time.monotonic() < deadline:
            time.sleep(0.05)
    (record,) = caplog.records
    message = record.getMessage()
    size = sum(n for _, n in groups[0]) + sum(n for _, n in groups[1])
    assert message.startswith(f"read-ahead for a diffusion model's sampling: dit.safetensors in its model's order, "
                              f"{size / GIB:.2f} GiB in "), message
    assert message.endswith("; 0 of its 12 blocks reached by the model first"), message


def test_a_followed_file_whose_model_never_moves_is_let_go_after_the_stall(tmp_path):
    groups = [[(0, 100)]] + [[(100 + 100 * i, 100)] for i in range(10)]
    path = tmp_path / "model.bin"
    path.write_bytes(b"\1" * 1100)
    followed = read_ahead.Followed(str(path), groups, window=150)
    start = time.monotonic()
    read, skipped = read_ahead.read_followed(followed, stripes=1, chunk=64, pause=0.001, stall=0.2)
    # group 0 and block 0 read (the group after the model's is always read), then the reader waited 0.2 s and left
    assert (read, skipped) == (200, 0) and 0.2 <= time.monotonic() - start < 10
