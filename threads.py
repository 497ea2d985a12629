"""The pack's threads named for the OS (Linux: top, htop and /proc/<pid>/task/<tid>/comm show the name).

Python names its threads for itself only: every thread of a ComfyUI process shows as "python" there, the pack's
background readers and compilers among them. Elsewhere naming does nothing.
"""
from __future__ import annotations

import ctypes
import sys

_PR_SET_NAME = 15  # prctl's option: the calling thread's name, at most 15 bytes
_NAME_BYTES = 15

_prctl = None
if sys.platform.startswith("linux"):
    try:
        _prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):  # no C library to call (a static or unusual build)
        _prctl = None


def name_this_thread(name: str) -> None:
    """Give the calling thread `name` (its first 15 bytes) where the OS shows thread names; else nothing."""
    if _prctl is not None:
        _prctl(_PR_SET_NAME, ctypes.c_char_p(name.encode()[:_NAME_BYTES]), 0, 0, 0)
