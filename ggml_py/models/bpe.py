"""Byte-level BPE of one word in Python, with llama.cpp's rules: the exact path for words the HF tokenizers
library would merge differently (characters without a token; see tokenizer.py)."""

from __future__ import annotations

from collections.abc import Mapping


def bpe_word(word: str, token_to_id: Mapping[str, int], ranks: Mapping[tuple[str, str], int], ignore_merges: bool,
             out: list[int]) -> None:
    """Append the ids of `word` (byte-to-unicode mapped) to `out`: the lowest-ranked adjacent pair merged first,
    leftmost on ties; a symbol without a token becomes its bytes' one-byte tokens, where they exist."""
    tti = token_to_id
    if ignore_merges and word in tti:
        out.append(tti[word])
        return
    syms = list(word)
    while len(syms) > 1:
        best, best_i = None, -1
        for i in range(len(syms) - 1):
            r = ranks.get((syms[i], syms[i + 1]))
            if r is not None and (best is None or r < best):
                best, best_i = r, i
        if best is None:
            break
        syms[best_i : best_i + 2] = [syms[best_i] + syms[best_i + 1]]
    for sym in syms:
        tid = tti.get(sym)
        if tid is not None:
            out.append(tid)
            continue
        for b in sym.encode("utf-8"):  # llama.cpp: each byte of the symbol as a one-byte token, if any
            tid = tti.get(chr(b) if b < 0x80 else chr(0xDC00 + b))
            if tid is not None:
                out.append(tid)
