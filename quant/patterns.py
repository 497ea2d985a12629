"""`ignored_layers` parsing: fnmatch patterns on module names."""
from __future__ import annotations

import fnmatch
import re


# Hand-written lists are a few short patterns. The bounds keep a hostile one cheap: fnmatch's
# translation is quadratic in a pattern's length (each unclosed "[" scans the rest).
MAX_PATTERNS = 64
MAX_PATTERN_CHARS = 128


def parse_patterns(text: str | None) -> tuple[str, ...]:
    """Split a comma- or newline-separated pattern list; blanks are dropped. ValueError past the bounds."""
    if not text:
        return ()
    if len(text) > MAX_PATTERNS * (MAX_PATTERN_CHARS + 1):
        raise ValueError(f"ignored_layers: {len(text)} characters, over the bound of {MAX_PATTERNS} patterns "
                         f"of {MAX_PATTERN_CHARS} characters")
    patterns = tuple(p.strip() for p in re.split(r"[,\n]", text) if p.strip())
    if len(patterns) > MAX_PATTERNS:
        raise ValueError(f"ignored_layers: {len(patterns)} patterns, more than {MAX_PATTERNS}")
    long = [p for p in patterns if len(p) > MAX_PATTERN_CHARS]
    if long:
        raise ValueError(f"ignored_layers: a pattern of {len(long[0])} characters ({long[0][:40]!r}...), longer "
                         f"than {MAX_PATTERN_CHARS}")
    return patterns


def first_match(name: str, patterns: tuple[str, ...]) -> str | None:
    """The first pattern that matches `name`, or None."""
    for pattern in patterns:
        if fnmatch.fnmatchcase(name, pattern):
            return pattern
    return None
