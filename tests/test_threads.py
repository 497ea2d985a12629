"""threads.py: the pack's background threads named for the OS."""
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from bigdit.threads import name_this_thread


def _os_name(tid: int) -> str:
    return Path(f"/proc/self/task/{tid}/comm").read_text().strip()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux shows thread names in /proc")
def test_a_thread_named_shows_its_name_cut_to_the_kernels_15_bytes_and_the_caller_keeps_its_own():
    own = _os_name(threading.get_native_id())
    with ThreadPoolExecutor(1, initializer=name_this_thread, initargs=("bigdit-a-very-long-name",)) as pool:
        assert pool.submit(lambda: _os_name(threading.get_native_id())).result() == "bigdit-a-very-l"
    assert _os_name(threading.get_native_id()) == own


def test_naming_never_fails_where_the_os_shows_no_names(monkeypatch):
    from bigdit import threads
    monkeypatch.setattr(threads, "_prctl", None)
    name_this_thread("bigdit-x")  # nothing to call: nothing happens
