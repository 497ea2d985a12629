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
"""
from __future__ import annotations

import logging
import os
import queue
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from ..threads import name_this_thread
from ..units import GIB, format_gib

HEADROOM = 4 * GIB  # besides the files: the process, its activations, the host's pinned buffers
STRIPES = 4  # readers per file: the GPU machine's disk read 1.79 GiB/s with four, 1.45 with one (whole_job's probe)
CHUNK = 16 * 1024 * 1024
SYS_BLOCK = "/sys/dev/block"  # Linux: a block device's folder by major:minor, its queue's `rotational` flag
THREAD_NAME = "bigdit-ahead"  # the reader's and its stripes' threads, as the OS shows them


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


def read_file(path: str, stripes: int = STRIPES, chunk: int = CHUNK, stopped=lambda: False) -> int:
    """Read `path` whole, `stripes` contiguous parts at once, until `stopped()` says to stop (checked before each
    chunk); the bytes read."""
    size = os.path.getsize(path)
    part = -(-size // stripes)

    def read_part(start: int) -> int:
        done, buffer = 0, bytearray(chunk)
        with open(path, "rb", buffering=0) as f:
            f.seek(start)
            while done < part and not stopped():
                n = f.readinto(memoryview(buffer)[:min(chunk, part - done)])
                if not n:
                    break
                done += n
        return done

    with ThreadPoolExecutor(stripes, initializer=name_this_thread, initargs=(THREAD_NAME,)) as pool:
        return sum(pool.map(read_part, range(0, size, part or 1)))


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


class Reader:
    """Reads submitted files one after another on a daemon thread, each once per process; `log` gets one line per
    submission's end."""

    def __init__(self, log: logging.Logger, stripes: int = STRIPES):
        self.log, self.stripes = log, stripes
        self._queue: queue.Queue = queue.Queue()
        self._seen: set[str] = set()
        self._held_read: list[AheadFile] = []  # held files read whole, whose pages are not yet dropped
        self._stopped: set[str] = set()  # paths not to read (further): their loader reads them now
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

    def _run(self) -> None:
        name_this_thread(THREAD_NAME)
        while True:
            files, label = self._queue.get()
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
