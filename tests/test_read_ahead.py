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
    if sys.platform.startswith("linux"):  # the reader, waiting for the next files, shows as itself in top and /proc
        names = {(task / "comm").read_text().strip() for task in Path("/proc/self/task").iterdir()}
        assert read_ahead.THREAD_NAME in names, names


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
