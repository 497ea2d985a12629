"""The pack's one logger helper: every line the pack logs starts with PREFIX, so a user can find them all."""
from __future__ import annotations

import logging

PREFIX = "[BigDiT] "


class _Prefixed(logging.LoggerAdapter):
    def process(self, msg, kwargs):
        return PREFIX + str(msg), kwargs


def pack_logger(name: str) -> logging.LoggerAdapter:
    """`logging.getLogger(name)` whose messages start with PREFIX (records keep the module's logger name)."""
    return _Prefixed(logging.getLogger(name), {})
