"""The shapes of OpenAI's answers that carry more than text: log-probabilities (the chat API's `logprobs.content`
and the legacy completions API's `tokens` / `token_logprobs` / `top_logprobs` / `text_offset`) and usage."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ggml_py.models.logprobs import TokenLogprob


def token_bytes(tokenizer: Any, token: int) -> bytes:
    """The bytes a token stands for, control tokens' text included (a client sees which token it was)."""
    return bytes(tokenizer.token_to_piece(token, True))


def token_text(tokenizer: Any, token: int) -> str:
    """A token as a string (bytes that are not whole UTF-8 characters become U+FFFD, as OpenAI's strings do)."""
    return token_bytes(tokenizer, token).decode("utf-8", errors="replace")


def chat_logprobs(tokenizer: Any, lps: Sequence[TokenLogprob]) -> dict[str, Any]:
    """The chat API's `logprobs`: {"content": [{token, logprob, bytes, top_logprobs: [{token, logprob, bytes}]}]}."""
    def one(t: int, lp: float) -> dict[str, Any]:
        b = token_bytes(tokenizer, t)
        return {"token": b.decode("utf-8", errors="replace"), "logprob": lp, "bytes": list(b)}

    return {"content": [{**one(x.token, x.logprob), "top_logprobs": [one(t, v) for t, v in x.top]} for x in lps],
            "refusal": None}


def completion_logprobs(tokenizer: Any, lps: Sequence[TokenLogprob | None], tokens: Sequence[int],
                        offset: int) -> dict[str, Any]:
    """The legacy completions API's `logprobs` for `tokens` (their entries in `lps`: None for a token without a
    distribution, the first of an echoed prompt): the tokens' strings, their logprobs, the top alternatives as
    {string: logprob} (two ids of the same string keep the more likely one), and each token's offset in the text,
    the first at `offset`."""
    strings = [token_text(tokenizer, t) for t in tokens]
    offsets = []
    for s in strings:
        offsets.append(offset)
        offset += len(s)
    top: list[dict[str, float] | None] = []
    for x in lps:
        if x is None:
            top.append(None)
            continue
        d: dict[str, float] = {}
        for t, v in x.top:
            d.setdefault(token_text(tokenizer, t), v)  # most likely first: a later id of the same text is less
        top.append(d)
    return {"tokens": strings, "token_logprobs": [None if x is None else x.logprob for x in lps],
            "top_logprobs": top, "text_offset": offsets}


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int | None = None) -> dict[str, Any]:
    u: dict[str, Any] = {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                         "total_tokens": prompt_tokens + completion_tokens}
    if cached_tokens is not None:
        u["prompt_tokens_details"] = {"cached_tokens": cached_tokens}
    return u
