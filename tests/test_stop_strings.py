"""Stop strings as text streams (ggml_py/serving/stop_strings.py): the same cuts and held-back text as a plain search
of the whole text, in time linear in the text whatever the stop strings' lengths, and the documented caps."""

from __future__ import annotations

import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ggml_py.errors import ModelError
from ggml_py.serving.stop_strings import MAX_STOP_CHARS, MAX_STOPS, StopMatcher, check_stops


def _naive(pieces: list[str], stops: list[str]) -> tuple[int | None, list[int]]:
    """The piece at which the first stop string is complete and where it starts in the whole text (earliest start
    among those complete then), and after each earlier piece the longest tail that is a proper prefix of a stop."""
    text, held = "", []
    for p in pieces:
        text += p
        found = [text.find(s) for s in stops if s and s in text]
        if found:
            return min(found), held
        held.append(max((k for s in stops if s for k in range(1, len(s)) if text.endswith(s[:k])), default=0))
    return None, held


@settings(max_examples=400, deadline=None)
@given(st.lists(st.text("ab", max_size=5), max_size=6), st.lists(st.text("abc", max_size=6), max_size=4))
def test_streaming_matches_a_search_of_the_whole_text(pieces, stops):
    want_start, want_held = _naive(pieces, stops)
    m = StopMatcher(stops)
    fed = 0
    for i, p in enumerate(pieces):
        start, held = m.feed(p)
        fed += len(p)
        if start is not None:
            assert want_start is not None and fed + start == want_start, (pieces, stops)
            assert i == len(want_held)
            return
        assert held == want_held[i], (pieces, stops, i)
    assert want_start is None


def test_cost_does_not_grow_with_the_stop_strings_length():
    """16 stop strings of 4096 characters that keep almost matching: 2,000 pieces of text in well under a second
    (the old search took O(length^2) per piece: ~15 s per token for one 1 MB stop string)."""
    stops = ["x" * (MAX_STOP_CHARS - 1) + str(i % 10) for i in range(MAX_STOPS)]
    m = StopMatcher(stops)
    t0 = time.perf_counter()
    for _ in range(3000):
        start, held = m.feed("xx")
        assert start is None
    assert held == MAX_STOP_CHARS - 1
    assert m.feed("7")[0] == -MAX_STOP_CHARS
    assert time.perf_counter() - t0 < 1.0


@pytest.mark.parametrize("stops, why", [
    ("END", "list of strings"), ([1], "list of strings"), (["a"] * (MAX_STOPS + 1), f"at most {MAX_STOPS}"),
    (["x" * (MAX_STOP_CHARS + 1)], f"at most {MAX_STOP_CHARS}"), (["x" * 2**20], "1048576 characters"),
])
def test_caps_and_types_are_checked(stops, why):
    with pytest.raises(ModelError, match=why):
        check_stops(stops)
