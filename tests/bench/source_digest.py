"""What knowing a source file by its data costs the quantize-once cache (loaders/quant_cache.py), on a CPU.

Times, on FILE (make one: `head -c 4G /dev/urandom > FILE`), a whole-file sha256 and blake2b on one thread, the
cache's `file_digest` (sha256 of 16 MiB chunks on up to 8 threads, no more than the CPUs) with 1 thread and
with all, each from the page
cache and with the file's pages dropped first (posix_fadvise, this file only), a sampled digest (64 slices of
1 MiB spread over the file), and what a load pays once the digest is remembered (`source_digest` with its memo).

    python tests/bench/source_digest.py FILE
"""
import hashlib
import json
import os
import sys
import tempfile
import time

import _pack  # noqa: F401 - imports the pack as `bigdit`
from bigdit.loaders import quant_cache

SLICE = 2 ** 20
SAMPLES = 64


def drop_pages(path):
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def whole(path, algorithm):
    digest = hashlib.new(algorithm)
    with open(path, "rb", buffering=0) as f:
        while chunk := f.read(16 * 2 ** 20):
            digest.update(chunk)
    return digest.hexdigest()


def sampled(path):
    size = os.path.getsize(path)
    digest = hashlib.sha256(size.to_bytes(8, "little"))
    with open(path, "rb", buffering=0) as f:
        for i in range(SAMPLES):
            f.seek((size - SLICE) * i // (SAMPLES - 1))
            digest.update(f.read(SLICE))
    return digest.hexdigest()


def timed(fn, path, cold):
    if cold:
        drop_pages(path)
    start = time.perf_counter()
    fn(path)
    return round(time.perf_counter() - start, 3)


def main(path):
    size = os.path.getsize(path)
    threads = quant_cache.DIGEST_THREADS
    used = min(threads, os.cpu_count() or 1)  # file_digest's threads

    def file_digest(n):
        def run(p):
            quant_cache.DIGEST_THREADS = n
            try:
                return quant_cache.file_digest(p)
            finally:
                quant_cache.DIGEST_THREADS = threads
        return run

    runs = {"sha256, 1 thread": lambda p: whole(p, "sha256"), "blake2b, 1 thread": lambda p: whole(p, "blake2b"),
            "file_digest, 1 thread": file_digest(1), f"file_digest, {used} threads": file_digest(threads),
            f"sampled, {SAMPLES} x 1 MiB": sampled}
    out = {"file_gib": round(size / 2 ** 30, 2), "cpus": os.cpu_count(), "seconds": {}}
    timed(runs["sha256, 1 thread"], path, False)  # into the page cache
    for name, fn in runs.items():
        out["seconds"][name] = {"page cache": timed(fn, path, False), "cold": timed(fn, path, True)}
    with tempfile.TemporaryDirectory() as folder:
        os.utime(path, (time.time() - 10, time.time() - 10))  # settled: the memo keeps it
        memo = quant_cache.DigestMemo(folder)
        quant_cache.source_digest(path, memo)
        start = time.perf_counter()
        quant_cache.source_digest(path, memo)
        out["seconds"]["remembered (stat + memo)"] = round(time.perf_counter() - start, 4)
    for name, times in out["seconds"].items():
        if isinstance(times, dict):
            times["GB/s (page cache)"] = round(size / 1e9 / max(times["page cache"], 1e-9), 2)
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main(sys.argv[1])
