"""The prefix cache's index: which block of the KV cache holds which run of tokens.

A block of BLOCK positions is known by a digest chained over every token from the start of its sequence (the
digest of the block before it, then its own token ids), so equal digests mean equal tokens at equal positions: a new
sequence whose prompt starts with the same tokens sees those blocks instead of computing them again (KVCells.link).
Only whole blocks are indexed, and only blocks whose cells hold their positions in order (block-aligned, above the
block before): a sequence that reuses them then has its keys laid out as if it had computed them itself, so its
attention sums in the same order and its tokens are the same with the cache on or off (docs/serving.md).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

ROOT = b""  # the digest before a sequence's first block


def block_digest(before: bytes, tokens: Sequence[int]) -> bytes:
    """The digest of a block of `tokens` that follows the block whose digest is `before`."""
    return hashlib.blake2b(before + np.asarray(tokens, np.int32).tobytes(), digest_size=16).digest()


class PrefixIndex:
    """Digest -> the cache block holding those tokens, and back; hit counters for /metrics."""

    def __init__(self, block: int) -> None:
        self.block = block
        self._by_digest: dict[bytes, int] = {}
        self._digest_of: dict[int, bytes] = {}
        # what the engine knows about an indexed block beyond its K and V (its prompt logprobs): by digest, since
        # equal tokens at equal positions give equal values (determinism) whichever sequence computed them
        self.data: dict[bytes, Any] = {}
        self.tokens_looked_up = 0  # prompt tokens that could have been found (whole blocks, all but the last token)
        self.tokens_found = 0

    def __len__(self) -> int:
        return len(self._by_digest)

    def add(self, digest: bytes, block: int) -> bool:
        """Index a block; False when the same tokens are already indexed (in another block: this one is not)."""
        if digest in self._by_digest:
            return False
        self._by_digest[digest] = block
        self._digest_of[block] = digest
        return True

    def annotate(self, digest: bytes, data: Any) -> bool:
        """Keep `data` with an indexed block; False when no block has these tokens."""
        if digest not in self._by_digest:
            return False
        self.data[digest] = data
        return True

    def forget(self, block: int) -> None:
        d = self._digest_of.pop(block, None)
        if d is not None:
            del self._by_digest[d]
            self.data.pop(d, None)

    def clear(self) -> None:
        self._by_digest.clear()
        self._digest_of.clear()
        self.data.clear()

    def lookup(self, tokens: Sequence[int],
               usable: Callable[[list[bytes]], int] | None = None) -> tuple[list[int], list[bytes]]:
        """The blocks holding the longest indexed prefix of `tokens` (whole blocks, leaving at least the last token
        to compute: its logits are wanted), and their digests; `usable(digests)` may keep fewer (the first n)."""
        n = (len(tokens) - 1) // self.block
        blocks: list[int] = []
        digests: list[bytes] = []
        d = ROOT
        for k in range(n):
            d = block_digest(d, tokens[k * self.block:(k + 1) * self.block])
            b = self._by_digest.get(d)
            if b is None:
                break
            blocks.append(b)
            digests.append(d)
        if usable is not None and blocks:
            n_use = usable(digests)
            blocks, digests = blocks[:n_use], digests[:n_use]
        self.tokens_looked_up += n * self.block
        self.tokens_found += len(blocks) * self.block
        return blocks, digests
