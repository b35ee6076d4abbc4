"""Perplexity of a model on a text, chunk by chunk, as llama-perplexity evaluates it (tools/perplexity/perplexity.cpp
of llama.cpp):

- the whole text is tokenized once, BOS added as the model's tokenizer adds it, special tokens not parsed (text is
  text: a "<|im_end|>" in it is not a control token), and cut into chunks of n_ctx tokens (n_tokens // n_ctx of
  them; the rest is not used);
- each chunk is evaluated from an empty KV cache, its first token replaced by BOS when the model adds BOS (so every
  chunk starts as a document does);
- only the second half of each chunk is scored: the logits at positions first = n_ctx // 2 .. n_ctx - 2 predict the
  tokens first + 1 .. n_ctx - 1, so every scored token has at least n_ctx / 2 tokens of context.

The statistics are in perplexity_stats.py, the base file of the KL divergence in kld_base.py.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from ggml_py.errors import ModelError
from ggml_py.models.perplexity_stats import log_softmax

MIN_CTX = 4  # a chunk must score at least one position after its first half


def tokenize_text(model: Any, text: str) -> list[int]:
    """The text's tokens as llama-perplexity takes them: BOS as the model adds it, control tokens not parsed. A model
    whose tokenizer appends EOS is refused, as llama-perplexity refuses it (the EOS would be scored as text)."""
    tok = model.tokenizer
    if tok.add_eos:
        raise ModelError(f"{model.path}: its tokenizer appends EOS to every text (tokenizer.ggml.add_eos_token); "
                         f"perplexity needs one that does not, as llama-perplexity does")
    return model.tokenize(text, add_special=True, parse_special=False)


@dataclass(frozen=True)
class Chunks:
    """A text's tokens cut into chunks: `tokens` (n_chunks, n_ctx) as tokenized; `bos` the id that replaces each
    chunk's first token (None when the model adds no BOS)."""

    tokens: np.ndarray
    bos: int | None

    @property
    def n_chunks(self) -> int:
        return int(self.tokens.shape[0])

    @property
    def n_ctx(self) -> int:
        return int(self.tokens.shape[1])

    @property
    def first(self) -> int:
        """The first position whose logits are scored: positions before it are context only."""
        return self.n_ctx // 2

    @property
    def n_scored(self) -> int:
        return self.n_ctx - 1 - self.first

    def model_input(self, i: int) -> np.ndarray:
        """The ids evaluated for chunk i: its tokens with the first replaced by BOS when the model adds one."""
        ids = self.tokens[i].copy()
        if self.bos is not None:
            ids[0] = self.bos
        return ids

    def targets(self, i: int) -> np.ndarray:
        """The tokens the scored positions of chunk i predict."""
        return self.tokens[i, self.first + 1:]


def make_chunks(tokens: Sequence[int] | np.ndarray, n_ctx: int, max_chunks: int | None = None,
                bos: int | None = None) -> Chunks:
    """Cut `tokens` into n_tokens // n_ctx chunks of n_ctx (at most `max_chunks`). ModelError when n_ctx is below
    MIN_CTX or the text is shorter than one chunk (the message says how many tokens are needed)."""
    if n_ctx < MIN_CTX:
        raise ModelError(f"the context (-c) must be at least {MIN_CTX} tokens to score half of each chunk, "
                         f"got {n_ctx}")
    if max_chunks is not None and max_chunks < 1:
        raise ModelError(f"--chunks must be at least 1, got {max_chunks}")
    arr = np.asarray(tokens, np.int32)
    n = arr.size // n_ctx
    if n == 0:
        raise ModelError(f"the text has {arr.size} tokens; one chunk of -c {n_ctx} needs {n_ctx} "
                         f"(use a longer text or a smaller -c)")
    if max_chunks is not None:
        n = min(n, max_chunks)
    return Chunks(arr[:n * n_ctx].reshape(n, n_ctx), bos)


@dataclass
class ScoredChunk:
    """One evaluated chunk: the log-probabilities (n_scored, n_vocab) float64 of its scored positions, the tokens
    they predict, and the most likely token at each."""

    index: int
    logprobs: np.ndarray
    targets: np.ndarray
    top: np.ndarray


def evaluate_chunks(model: Any, chunks: Chunks) -> Iterator[ScoredChunk]:
    """Evaluate each chunk from an empty KV cache (model.reset()) and yield its scored positions."""
    if model.n_ctx < chunks.n_ctx:
        raise ModelError(f"the model was loaded with a context of {model.n_ctx} tokens, smaller than the chunks' "
                         f"{chunks.n_ctx}")
    first = chunks.first
    for i in range(chunks.n_chunks):
        model.reset()
        logits = model.eval(chunks.model_input(i))[first:chunks.n_ctx - 1]
        yield ScoredChunk(i, log_softmax(logits), chunks.targets(i), logits.argmax(axis=1))
    model.reset()
