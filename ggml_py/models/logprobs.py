"""Log-probabilities of tokens under a model's distribution (the softmax of its raw logits, before any sampling
parameter), and the most likely alternatives: what OpenAI's `logprobs`, `top_logprobs` and `echo` report."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

MAX_TOP_LOGPROBS = 20  # alternatives a token may report (OpenAI's bound)


@dataclass(frozen=True)
class TokenLogprob:
    """A token, its log-probability, and the `top` most likely tokens of the same distribution (id, logprob),
    most likely first (ties: the lower id first)."""

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


def token_logprobs(logits: np.ndarray, tokens: np.ndarray, n_top: int) -> list[TokenLogprob]:
    """For each row of logits (k, n_vocab) and its token: the token's log-probability and the `n_top` best.

    The log-softmax is taken in float64 (a row's log-sum-exp once, then every value as logit - lse), so a token's
    logprob and the same token's value among the top ones are the same number: a client comparing them (lm-eval's
    "is greedy") sees equality exactly where the token is the most likely."""
    rows = np.asarray(logits, np.float32).reshape(len(tokens), -1).astype(np.float64)
    m = rows.max(axis=1, keepdims=True)
    lse = m + np.log(np.exp(rows - m).sum(axis=1, keepdims=True))
    tokens = np.asarray(tokens, np.int64)
    chosen = rows[np.arange(len(tokens)), tokens] - lse[:, 0]
    out = []
    if n_top > 0:
        k = min(n_top, rows.shape[1])
        part = np.argpartition(-rows, k - 1, axis=1)[:, :k]
        for i in range(len(tokens)):
            ids = part[i][np.lexsort((part[i], -rows[i, part[i]]))]  # by value, then id: a fixed order for ties
            top = tuple((int(t), float(rows[i, t] - lse[i, 0])) for t in ids)
            out.append(TokenLogprob(int(tokens[i]), float(chosen[i]), top))
    else:
        out = [TokenLogprob(int(t), float(v)) for t, v in zip(tokens, chosen)]
    return out
