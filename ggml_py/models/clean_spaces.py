"""llama.cpp's detokenizer clean-up of spaces around punctuation and English contractions (for a vocabulary whose
pre-tokenizer asks for it)."""

from __future__ import annotations


def clean_up_spaces(data: bytes) -> bytes:
    """llama.cpp's detokenizer clean-up: drop the space before ``?!.,``, around a lone ``'``, and before
    ``'s 'm 're 've``."""
    if not data:
        return data
    # 1: " ?" " !" " ." " ," lose the space
    out = bytearray(data[:1])
    for i in range(1, len(data)):
        c = data[i]
        if data[i - 1] == 0x20 and c in b"?!.,":
            out.pop()
        out.append(c)
    # 2: " ' " becomes "'"
    src = bytes(out)
    out = bytearray(src[:1])
    skip_prev_space = False  # the char before i was a swallowed space: it no longer counts as a space
    i = 1
    while i < len(src):
        c = src[i]
        prev_is_space = src[i - 1] == 0x20 and not skip_prev_space
        skip_prev_space = False
        if c == 0x27 and i + 1 < len(src) and prev_is_space and src[i + 1] == 0x20:
            out.pop()
            out.append(c)
            i += 2
            skip_prev_space = True
            continue
        out.append(c)
        i += 1
    # 3: " 's" " 'm" " 're" " 've" lose the space
    src = bytes(out)
    out = bytearray(src[:1])
    n = len(src)
    for i in range(1, n):
        c = src[i]
        if src[i - 1] == 0x20 and c == 0x27 and i + 1 < n:
            x1 = src[i + 1]
            if x1 in b"sm" or (i + 2 < n and src[i + 1 : i + 3] in (b"re", b"ve")):
                out.pop()
        out.append(c)
    return bytes(out)
