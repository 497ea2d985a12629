"""`ignored_layers` patterns: parsed in bounded time, hostile lists refused with a clear error."""
import time

import pytest

from bigdit.quant.patterns import MAX_PATTERN_CHARS, MAX_PATTERNS, first_match, parse_patterns


def test_patterns_split_and_match():
    assert parse_patterns(" a.*, b\n\nc ,") == ("a.*", "b", "c")
    assert first_match("blocks.0.ffn.0", ("head.*", "blocks.*.ffn.?")) == "blocks.*.ffn.?"


@pytest.mark.parametrize("text, words", [
    ("[" * 40_000, "40000 characters, over the bound of 64 patterns of 128 characters"),
    ("[" * (MAX_PATTERN_CHARS + 1), f"a pattern of {MAX_PATTERN_CHARS + 1} characters"),
    (",".join(["a"] * (MAX_PATTERNS + 1)), f"{MAX_PATTERNS + 1} patterns, more than {MAX_PATTERNS}"),
])
def test_hostile_pattern_lists_are_refused_fast(text, words):
    start = time.perf_counter()
    with pytest.raises(ValueError, match=f"ignored_layers: .*{words}"):
        parse_patterns(text)
    assert time.perf_counter() - start < 0.1


def test_longest_allowed_patterns_match_fast():
    """The worst case within the bounds (unclosed brackets translate in quadratic time) stays cheap."""
    patterns = parse_patterns("\n".join(f"{i:03d}" + "[" * (MAX_PATTERN_CHARS - 3) for i in range(MAX_PATTERNS)))
    assert len(set(patterns)) == MAX_PATTERNS
    names = [f"blocks.{i}.ffn.0" for i in range(400)]
    start = time.perf_counter()
    assert not any(first_match(name, patterns) for name in names)
    assert time.perf_counter() - start < 1.0
