"""`ignored_layers` parsing: fnmatch patterns on module names."""
from __future__ import annotations

import fnmatch
import re


def parse_patterns(text: str | None) -> tuple[str, ...]:
    """Split a comma- or newline-separated pattern list; blanks are dropped."""
    if not text:
        return ()
    return tuple(p.strip() for p in re.split(r"[,\n]", text) if p.strip())


def first_match(name: str, patterns: tuple[str, ...]) -> str | None:
    """The first pattern that matches `name`, or None."""
    for pattern in patterns:
        if fnmatch.fnmatchcase(name, pattern):
            return pattern
    return None
