"""Reading a job's model files into the page cache before its loaders ask for them.

A cold job reads its files one stage after another (the text encoder, then the diffusion model in its first
sampler step, then the VAE), each by one reader and each while the disk would otherwise wait on compute in
between. A `Reader` reads the files a queued job names, in the order the job needs them, several stripes of a file
at once (one on a spinning disk: `stripes_for`), on a background thread: the loaders then find the pages in the
page cache.

Only where the RAM holds them all: `plan` reads nothing unless the files, a second copy of each file the host keeps
in its own memory once loaded (a text encoder), and HEADROOM fit in the room the system reports; a file whose pages
would push out what the job needs next is a loss, never a gain. Once the host holds such a file's copy, its pages
are a second copy that the reader and the loader both touched, which the kernel keeps before the read-ahead's
pages not yet used: `Reader.release_held` drops them (`drop_cached`). A file its loader starts reading itself is
read no further (`Reader.stop`): behind the loader the reader would read again what the loader consumed.

A diffusion model its sampler's first step pages in layer by layer can instead be followed (`Reader.follow`): its
file read in the order the model runs it (`execution_groups`: the tensors outside its trunk, then the trunk's blocks
by index), never more than a window ahead of the block the model is at, skipping the blocks the model reached first
(their loader read them, and comfy-aimdo drops the pages it read: a reader behind it reads them twice).
"""
from __future__ import annotations

import json
import logging
import os
import queue
import re
import struct
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from ..units import GIB, format_gib

HEADROOM = 4 * GIB  # besides the files: the process, its activations, the host's pinned buffers
STRIPES = 4  # readers per file: the GPU machine's disk read 1.79 GiB/s with four, 1.45 with one (whole_job's probe)
CHUNK = 16 * 1024 * 1024
SYS_BLOCK = "/sys/dev/block"  # Linux: a block device's folder by major:minor, its queue's `rotational` flag


@dataclass(frozen=True)
class AheadFile:
    path: str
    size: int
    held: bool = False  # the host keeps its own copy in RAM once loaded (a text encoder): its room counts twice


def plan(files: list[AheadFile], room: int | None) -> tuple[list[AheadFile], str]:
    """(the files to read ahead, in order, and why none where none): all of them where they fit in `room` bytes of
    RAM (see the module's docstring), else none."""
    if not files:
        return [], "no model file named"
    if room is None:
        return [], "the system does not say how much RAM is free"
    need = sum(f.size for f in files) + sum(f.size for f in files if f.held) + HEADROOM
    if need > room:
        return [], f"the files need {format_gib(need)} of RAM with their copies and headroom, {format_gib(room)} free"
    return list(files), ""


def stripes_for(path: str, stripes: int = STRIPES, sys_block: str = SYS_BLOCK) -> int:
    """`stripes`, or 1 where `path` lies on a spinning disk (its block device's, or for a partition its disk's,
    `queue/rotational` is 1): readers at several offsets of one file would have the disk's head seek between them.
    Where the system does not say (no such folder: another OS, a network or pooled file system), `stripes`."""
    try:
        dev = os.stat(path).st_dev
        base = os.path.join(sys_block, f"{os.major(dev)}:{os.minor(dev)}")
        for flag in (os.path.join(base, "queue", "rotational"), os.path.join(base, "..", "queue", "rotational")):
            if os.path.isfile(flag):
                with open(flag) as f:
                    return 1 if f.read().strip() == "1" else stripes
    except (OSError, ValueError, AttributeError):  # AttributeError: no os.major (Windows)
        pass
    return stripes


def read_span(path: str, start: int, length: int, chunk: int = CHUNK, stopped=lambda: False) -> int:
    """Read `length` bytes of `path` from `start`, `chunk` at a time, until `stopped()` says to stop (checked
    before each chunk) or the file ends; the bytes read."""
    done, buffer = 0, bytearray(chunk)
    with open(path, "rb", buffering=0) as f:
        f.seek(start)
        while done < length and not stopped():
            n = f.readinto(memoryview(buffer)[:min(chunk, length - done)])
            if not n:
                break
            done += n
    return done


def read_file(path: str, stripes: int = STRIPES, chunk: int = CHUNK, stopped=lambda: False) -> int:
    """Read `path` whole, `stripes` contiguous parts at once (read_span), until `stopped()` says to stop; the
    bytes read."""
    size = os.path.getsize(path)
    part = -(-size // stripes)
    with ThreadPoolExecutor(stripes) as pool:
        return sum(pool.map(lambda start: read_span(path, start, part, chunk, stopped), range(0, size, part or 1)))


def drop_cached(path: str) -> bool:
    """Ask the kernel to drop `path`'s pages from the page cache (POSIX_FADV_DONTNEED: clean pages no process maps;
    a mapped page stays). False where the system has no such call or the file cannot be opened."""
    if not hasattr(os, "posix_fadvise"):
        return False
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return False
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        return True
    except OSError:
        return False
    finally:
        os.close(fd)


MAX_HEADER = 100 * 1024 * 1024  # a safetensors header larger than this is not a model file's
STALL_S = 60.0  # a followed model at one block this long while the reader waits: its hooks do not fire
_NUMBERED = re.compile(r"^(.*?)\.(\d+)\.")  # "blocks.12.attn.qkv.weight" -> ("blocks", "12")


def _merged(ranges: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """(offset, length) ranges sorted, contiguous ones joined."""
    out: list[tuple[int, int]] = []
    for start, length in sorted(ranges):
        if out and out[-1][0] + out[-1][1] == start:
            out[-1] = (out[-1][0], out[-1][1] + length)
        else:
            out.append((start, length))
    return out


def execution_groups(path: str) -> tuple[str, list[list[tuple[int, int]]]] | None:
    """(the trunk's name, byte ranges by group) of a safetensors file: the trunk is its numbered module list with the
    most bytes (`<trunk>.<i>.`), group 0 the tensors outside it, then one group per trunk block by index, as a
    forward pass runs them; None where the file is no safetensors file or has no trunk numbered 0 to n-1."""
    try:
        with open(path, "rb") as f:
            (length,) = struct.unpack("<Q", f.read(8))
            if length > MAX_HEADER:
                return None
            header = json.loads(f.read(length))
    except (OSError, struct.error, ValueError):
        return None
    if not isinstance(header, dict):
        return None
    base, lists, outside = 8 + length, {}, []
    for name, info in header.items():
        offsets = info.get("data_offsets") if isinstance(info, dict) and name != "__metadata__" else None
        if not (isinstance(offsets, list) and len(offsets) == 2 and offsets[1] > offsets[0]):
            continue
        span = (base + offsets[0], offsets[1] - offsets[0])
        numbered = _NUMBERED.match(name)
        if numbered:
            lists.setdefault(numbered.group(1), {}).setdefault(int(numbered.group(2)), []).append(span)
        else:
            outside.append(span)
    if not lists:
        return None
    trunk = max(lists, key=lambda key: sum(n for spans in lists[key].values() for _, n in spans))
    blocks = lists.pop(trunk)
    if sorted(blocks) != list(range(len(blocks))):
        return None
    outside += [span for numbered in lists.values() for spans in numbered.values() for span in spans]
    return trunk, [_merged(outside)] + [_merged(blocks[i]) for i in range(len(blocks))]


@dataclass
class Followed:
    """A file read in its model's order: `groups` from execution_groups, read no more than `window` bytes beyond the
    group of the block the model is at, `at` (set by the host as each trunk block starts; -1 before the first)."""
    path: str
    groups: list
    window: int
    at: int = -1


def read_followed(f: Followed, stripes: int = STRIPES, chunk: int = CHUNK, stopped=lambda: False,
                  pause: float = 0.005, stall: float = STALL_S) -> tuple[int, int]:
    """Read `f`'s groups in order, each in `stripes` parallel parts (read_span), skipping the trunk blocks the model reached
    first, waiting while the next group would take it past the window; until `stopped()`, or the model stayed at
    one block for `stall` s while the reader waited (its blocks' hooks do not fire). (bytes read, blocks
    skipped)."""
    sizes = [sum(n for _, n in group) for group in f.groups]
    read = skipped = 0

    def too_far(index: int) -> bool:
        """Whether reading group `index` would put more than the window between it and the model's group (the
        group right after the model's is always read)."""
        at = f.at
        return index > at + 2 and sum(sizes[at + 2:index + 1]) > f.window

    with ThreadPoolExecutor(stripes) as pool:
        for index, group in enumerate(f.groups):
            waited_at, since = f.at, time.monotonic()
            while not stopped() and too_far(index):
                if f.at != waited_at:
                    waited_at, since = f.at, time.monotonic()
                elif time.monotonic() - since > stall:
                    return read, skipped
                time.sleep(pause)
            if stopped():
                break
            at = f.at  # group 0 is the tensors outside the trunk (the model's first reads), group i + 1 block i
            if (at >= 0) if index == 0 else (index - 1 <= at):
                skipped += index > 0
                continue
            step = max(chunk, -(-sizes[index] // stripes))  # about one part per reader
            parts = [(start + offset, min(step, length - offset)) for start, length in group
                     for offset in range(0, length, step)]
            read += sum(pool.map(lambda part: read_span(f.path, *part, chunk), parts))
    return read, skipped


class Reader:
    """Reads submitted files one after another on a daemon thread, each once per process; `log` gets one line per
    submission's end."""

    def __init__(self, log: logging.Logger, stripes: int = STRIPES):
        self.log, self.stripes = log, stripes
        self._queue: queue.Queue = queue.Queue()
        self._seen: set[str] = set()
        self._held_read: list[AheadFile] = []  # held files read whole, whose pages are not yet dropped
        self._stopped: set[str] = set()  # paths not to read (further): their loader reads them now
        self._unfollowed: set[str] = set()  # followed paths to read no further: their model's first call returned
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None

    def seen(self, f: AheadFile) -> bool:
        """Whether `f` was queued before."""
        return f.path in self._seen

    def submit(self, files: list[AheadFile], label: str) -> list[AheadFile]:
        """Queue the files not read or queued before; returns them."""
        with self._lock:
            new = [f for f in files if f.path not in self._seen]
            self._seen.update(f.path for f in new)
            if new:
                self._queue.put((new, label))
                if self._thread is None:
                    self._thread = threading.Thread(target=self._run, name="bigdit-read-ahead", daemon=True)
                    self._thread.start()
        return new

    def release_held(self) -> list[AheadFile]:
        """Drop the page cache of the held files read whole so far (the host holds their weights: call it once
        their loader has run); returns those dropped. Each file is dropped once."""
        with self._lock:
            held, self._held_read = self._held_read, []
        return [f for f in held if drop_cached(f.path)]

    def stop(self, paths) -> None:
        """Read no more of these files, from the next chunk on: their loader is reading them itself, and a reader
        behind it may read again what the loader consumed and let go of (host/read_ahead.py says when)."""
        with self._lock:
            self._stopped.update(paths)

    def follow(self, f: Followed, label: str) -> None:
        """Queue `f` (read_followed) behind what is queued, until `unfollow(f.path)`."""
        with self._lock:
            self._unfollowed.discard(f.path)
            self._queue.put((f, label))
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="bigdit-read-ahead", daemon=True)
                self._thread.start()

    def unfollow(self, path: str) -> None:
        """Read no more of a followed file, from its next chunk on."""
        with self._lock:
            self._unfollowed.add(path)

    def _follow(self, f: Followed, label: str) -> None:
        start = time.perf_counter()
        try:
            read, skipped = read_followed(f, stripes_for(f.path, self.stripes),
                                          stopped=lambda: f.path in self._unfollowed)
        except OSError as e:
            self.log.warning("read-ahead of %s in its model's order stopped: %s", f.path, e)
            return
        seconds = time.perf_counter() - start
        self.log.info("read-ahead for %s: %s in its model's order, %s in %.1f s (%.2f GiB/s); %d of its %d blocks "
                      "reached by the model first", label, os.path.basename(f.path), format_gib(read), seconds,
                      read / GIB / max(seconds, 1e-9), skipped, len(f.groups) - 1)

    def _run(self) -> None:
        while True:
            item, label = self._queue.get()
            if isinstance(item, Followed):
                self._follow(item, label)
                continue
            files = item
            start, total, cut = time.perf_counter(), 0, []
            for f in files:
                try:
                    read = read_file(f.path, stripes_for(f.path, self.stripes),
                                     stopped=lambda path=f.path: path in self._stopped)
                    total += read
                    if read < f.size:
                        cut.append(f"{os.path.basename(f.path)} at {format_gib(read)}")
                    elif f.held:
                        with self._lock:
                            self._held_read.append(f)
                except OSError as e:  # a file gone or unreadable: its loader says so; the rest are still read
                    self.log.warning("read-ahead of %s stopped: %s", f.path, e)
            seconds = time.perf_counter() - start
            stopped = f"; stopped as their loader read them: {', '.join(cut)}" if cut else ""
            self.log.info("read-ahead for %s: %d files, %s in %.1f s (%.2f GiB/s)%s", label, len(files),
                          format_gib(total), seconds, total / GIB / max(seconds, 1e-9), stopped)
