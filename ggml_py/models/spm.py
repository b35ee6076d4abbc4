"""SentencePiece-style BPE (GGUF tokenizer model "llama"): adjacent symbols merged highest score first, as llama.cpp's
llm_tokenizer_spm does; symbols that never became tokens fall back to byte tokens."""

from __future__ import annotations

import heapq
from collections.abc import Callable, Mapping, Sequence


def spm_encode(text: str, token_to_id: Mapping[str, int], scores: Sequence[float], byte_token: Callable[[int], int],
               out: list[int]) -> None:
    """Append the ids of `text` (spaces already U+2581) to `out`: one symbol per character to start with, the
    adjacent pair whose merged text is the best-scored token merged first (leftmost on ties)."""
    n = len(text)
    if n == 0:
        return
    tti = token_to_id
    start = list(range(n))
    size = [1] * n
    nxt = list(range(1, n + 1))
    nxt[-1] = -1
    prv = list(range(-1, n - 1))
    heap: list[tuple[float, int, int, int]] = []
    rev_merge: dict[str, tuple[int, int]] = {}

    def add_bigram(left: int, right: int) -> None:
        if left < 0 or right < 0:
            return
        s = text[start[left] : start[left] + size[left] + size[right]]
        tid = tti.get(s)
        if tid is None:
            return
        heapq.heappush(heap, (-scores[tid], left, right, size[left] + size[right]))
        rev_merge[s] = (left, right)

    for i in range(1, n):
        add_bigram(i - 1, i)
    while heap:
        _, left, right, total = heapq.heappop(heap)
        if size[left] == 0 or size[right] == 0 or size[left] + size[right] != total:
            continue
        size[left] = total
        size[right] = 0
        nxt[left] = nxt[right]
        if nxt[right] >= 0:
            prv[nxt[right]] = left
        add_bigram(prv[left], left)
        add_bigram(left, nxt[left])

    def resegment(i: int) -> None:
        s = text[start[i] : start[i] + size[i]]
        tid = tti.get(s)
        if tid is not None:
            out.append(tid)
            return
        pair = rev_merge.get(s)
        if pair is None:
            out.extend(byte_token(b) for b in s.encode("utf-8", "surrogateescape"))
            return
        resegment(pair[0])
        resegment(pair[1])

    i = 0
    while i != -1:
        resegment(i)
        i = nxt[i]
