"""Test setup: import the pack's core as package `bigdit` without running the
pack's ComfyUI entry point (which needs ComfyUI)."""
import sys
import types
from pathlib import Path

PACK_ROOT = Path(__file__).resolve().parent.parent

if "bigdit" not in sys.modules:
    _pkg = types.ModuleType("bigdit")
    _pkg.__path__ = [str(PACK_ROOT)]
    sys.modules["bigdit"] = _pkg
