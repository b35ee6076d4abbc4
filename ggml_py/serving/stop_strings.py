"""Stop strings found in generated text as it streams, in time linear in the text.

Each stop string gets a Knuth-Morris-Pratt automaton, built once when the request is made (O(length), on the
submitting thread). Every piece of text then advances each automaton by its characters: O(characters x stops) per
step on the engine thread, whatever the stop strings' lengths. An automaton's state is the longest prefix of its stop
string that ends the text so far, so the same states say how much text must be held back (it may yet become a stop
string) and where a completed stop string starts.
"""

from __future__ import annotations

from collections.abc import Sequence

from ggml_py.errors import ModelError

MAX_STOPS = 16  # stop strings per request (OpenAI allows 4)
MAX_STOP_CHARS = 4096  # characters per stop string


def check_stops(stops: object) -> list[str]:
    """The request's stop strings, or ModelError saying what is wrong (type, count, length)."""
    if isinstance(stops, str) or not isinstance(stops, Sequence) or any(not isinstance(s, str) for s in stops):
        raise ModelError("stop must be a list of strings")
    if len(stops) > MAX_STOPS:
        raise ModelError(f"stop has {len(stops)} strings; at most {MAX_STOPS} are allowed")
    for s in stops:
        if len(s) > MAX_STOP_CHARS:
            raise ModelError(f"a stop string has {len(s)} characters; at most {MAX_STOP_CHARS} are allowed")
    return list(stops)


def _prefix_function(s: str) -> list[int]:
    """pi[i]: the length of the longest proper prefix of s[:i + 1] that is also its suffix."""
    pi = [0] * len(s)
    k = 0
    for i in range(1, len(s)):
        while k and s[i] != s[k]:
            k = pi[k - 1]
        if s[i] == s[k]:
            k += 1
        pi[i] = k
    return pi


class StopMatcher:
    """Feed text as it arrives; learn where the first stop string starts, and how much text to hold back."""

    def __init__(self, stops: Sequence[str]) -> None:
        self.stops = [s for s in stops if s]
        self._pi = [_prefix_function(s) for s in self.stops]
        self._state = [0] * len(self.stops)

    def __bool__(self) -> bool:
        return bool(self.stops)

    def feed(self, text: str) -> tuple[int | None, int]:
        """Advance over `text`. Returns (start, held): `start` is where, counted back from the end of `text`, the
        earliest stop string completed inside `text` begins (a negative offset into `text`, possibly reaching into
        text fed before), or None; `held` is how many characters at the end of all text fed so far may still be the
        start of a stop string."""
        best: int | None = None  # the earliest start, as an offset from the end of `text` (negative)
        n = len(text)
        for j, (s, pi) in enumerate(zip(self.stops, self._pi)):
            k, m = self._state[j], len(s)
            for i, c in enumerate(text):
                while k and c != s[k]:
                    k = pi[k - 1]
                if c == s[k]:
                    k += 1
                if k == m:
                    start = i + 1 - m - n
                    if best is None or start < best:
                        best = start
                    break  # the first occurrence of s is its earliest
            self._state[j] = k
        return best, max(self._state, default=0)
