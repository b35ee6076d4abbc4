"""The KV cache (one K and one V tensor per layer) and the attention masks over it.

A `Model`'s own cache holds one sequence: row r of every layer's cache holds position r. A cache shared by several
sequences (`KVCells`, used by the batched decoder in batch.py) keeps, per row ("cell"), which sequence and which
position it holds; cells are taken from the lowest free ones and freed when their sequence ends, and the attention
mask is built on the host from sequence membership and causality (`KVCells.mask`). One sequence is the special case
where cell r holds position r of sequence 0 (`causal_mask`).

Sliding-window layers keep all rows too and mask the ones outside their window: the window is in the mask's values,
an input, so one prepared plan serves every position (llama.cpp instead keeps a smaller ring-buffer cache for those
layers).
"""

from __future__ import annotations

import numpy as np

from ggml_py.errors import ModelError
from ggml_py.ir import dtypes
from ggml_py.ir.dtypes import DType
from ggml_py.ir.tensor import state
from ggml_py.models.hparams import HParams


class KVCache:
    """One K and one V tensor per layer: (n_ctx, n_head_kv * head_dim) rows, persistent STATE tensors shared by
    every plan."""

    def __init__(self, hp: HParams, n_ctx: int, kv_type: DType) -> None:
        if kv_type not in (dtypes.F16, dtypes.F32):
            raise ModelError(f"KV cache type {kv_type} is not supported (supported: F16, F32)")
        self.n_ctx = n_ctx
        self.dtype = kv_type
        self.k = [state((n_ctx, hp.n_head_kv * hp.head_dim), kv_type, name=f"cache_k.{i}")
                  for i in range(hp.n_layer)]
        self.v = [state((n_ctx, hp.n_head_kv * hp.head_dim_v), kv_type, name=f"cache_v.{i}")
                  for i in range(hp.n_layer)]

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in (*self.k, *self.v))

    @staticmethod
    def nbytes_for(hp: HParams, n_ctx: int, kv_type: DType) -> int:
        """What a cache for these parameters will allocate (before making one)."""
        return hp.n_layer * n_ctx * hp.n_head_kv * (hp.head_dim + hp.head_dim_v) * kv_type.type_size


def causal_mask(pos: np.ndarray, n_kv: int, window: int = 0) -> np.ndarray:
    """(T, n_kv) F32: 0 where cache row j holds a position the query at pos[i] may see, else -inf.

    Causal: j <= pos[i]. With a sliding window of `window` > 0 also pos[i] - j < window (llama.cpp's standard SWA:
    a key `window` or more positions back is masked).
    """
    j = np.arange(n_kv)[None, :]
    p = pos[:, None]
    ok = j <= p
    if window > 0:
        ok &= p - j < window
    return np.where(ok, np.float32(0), np.float32(-np.inf)).astype(np.float32)


BLOCK = 32  # cells a shared cache hands a sequence at a time


def cells_for(n_ctx: int, n_seq_max: int, block: int = BLOCK) -> int:
    """The cells of a cache shared by up to `n_seq_max` sequences holding `n_ctx` tokens in all: one block more
    per sequence (each leaves at most its last block part-empty), so that every sequence's tokens fit in whole
    blocks of its own, in ascending order, however full the cache (KVCells; docs/serving.md, determinism)."""
    return (-(-n_ctx // block) + n_seq_max) * block


class CacheFullError(ModelError):
    """The KV cache has no free cells for the tokens asked for."""


class KVCells:
    """Which sequence and position each cell (row) of a shared KV cache holds.

    `seq[c]` is the sequence id in cell c (-1: free), `pos[c]` its position. Every token of a step gets a cell
    (`alloc`); the cells a step's attention reads are the first `n_kv` (one past the highest used cell), and the
    mask of a query lets it see exactly the cells of its own sequence at positions <= its own (and, with a sliding
    window, within the window). All of it is numpy over the whole batch: the host work per step does not grow with
    the number of sequences.

    Cells are handed out by blocks of `block` cells reserved for one sequence (as paged attention does), so that
    sequences decoding side by side do not interleave their cells: attention skips a tile of keys that are all
    masked, and with interleaved cells no tile would be. A sequence's next block is the lowest free one above its
    last, so its positions lie in ascending cell order, each block starting at a multiple of `block`: the order in
    which attention sums a query's keys is then the same wherever the sequence's cells lie (docs/serving.md). When
    no block is free above, a lower one is used, and when no whole block is free, any free cell (`out_of_order`
    counts both).
    """

    def __init__(self, n_cells: int, n_seq_max: int, block: int = BLOCK, capacity: int | None = None) -> None:
        if n_cells < 1 or n_seq_max < 1:
            raise ModelError(f"a KV cache needs n_ctx >= 1 and n_seq_max >= 1, got {n_cells} and {n_seq_max}")
        self.n_cells = n_cells
        # tokens it holds at most (n_ctx): fewer than its cells when these are padded to whole blocks (cells_for)
        self.capacity = n_cells if capacity is None else min(capacity, n_cells)
        self.n_seq_max = n_seq_max
        self.block = block
        self.seq = np.full(n_cells, -1, np.int32)
        self.pos = np.full(n_cells, -1, np.int32)
        self.owner = np.full(-(-n_cells // block), -1, np.int32)  # the sequence a block is reserved for (-1: none)
        self._cell_block = np.arange(n_cells) // block
        self.n_used = 0
        self.n_kv = 0  # one past the highest used cell
        # times a sequence's cells could not follow its positions in ascending, block-aligned order (the cache was
        # too full): its attention may then sum in another order than alone
        self.out_of_order = 0

    @property
    def n_free(self) -> int:
        return self.capacity - self.n_used

    def alloc(self, seq_ids: np.ndarray, positions: np.ndarray) -> np.ndarray:
        """Cells for tokens (seq_ids[i], positions[i]): each sequence's in its own blocks (the lowest free cells of
        the blocks it holds, then of the lowest free blocks), else the lowest free ones; CacheFullError when too
        few cells are free."""
        n = len(seq_ids)
        if n > self.n_free:
            raise CacheFullError(f"the KV cache is full: {n} new tokens, {self.n_free} of {self.capacity} free "
                                 f"(n_ctx); finish or cancel a sequence, or use a larger context")
        seq_ids = np.asarray(seq_ids, np.int32)
        cells = np.empty(n, np.int32)
        for s in np.unique(seq_ids):
            where = np.flatnonzero(seq_ids == s)
            cells[where] = got = self._cells_of(int(s), where.size)
            self.seq[got] = s
        self.pos[cells] = positions
        self.n_used += n
        if n:
            self.n_kv = max(self.n_kv, int(cells.max()) + 1)
        return cells

    def occupy(self, cells: np.ndarray, seq_ids: np.ndarray, positions: np.ndarray) -> None:
        """Record that `cells` now hold tokens (seq_ids[i], positions[i]): a mirror of another KVCells, kept from the
        cells that one allocated (a pipeline stage's record). ModelError if a cell is taken (the mirror diverged)."""
        if cells.size and (self.seq[cells] >= 0).any():
            raise ModelError(f"cells {cells[self.seq[cells] >= 0][:8].tolist()} are already taken in this record of "
                             "the KV cache: it no longer mirrors the decoder's")
        self.seq[cells] = seq_ids
        self.pos[cells] = positions
        self.n_used += int(cells.size)
        if cells.size:
            self.n_kv = max(self.n_kv, int(cells.max()) + 1)

    def _cells_of(self, s: int, k: int) -> np.ndarray:
        free = self.seq < 0
        own = np.flatnonzero(free & (self.owner[self._cell_block] == s))[:k]
        if own.size == k:
            return own
        out = [own]
        need = k - own.size
        # new blocks above the sequence's last one, so that its positions stay in ascending cell order (attention
        # then sums its keys in the same order wherever they lie: docs/serving.md, determinism); below it only
        # when nothing above is free (counted)
        held = np.flatnonzero(self.owner == s)
        last = int(held[-1]) if held.size else -1
        unowned = np.flatnonzero(self.owner < 0)
        for b in np.concatenate([unowned[unowned > last], unowned[unowned < last]]):
            if not need:
                break
            lo = b * self.block
            got = lo + np.flatnonzero(free[lo: lo + self.block])[:need]
            if got.size:
                if got[0] != lo or b < last:
                    self.out_of_order += 1
                self.owner[b] = s
                out.append(got)
                need -= got.size
        if need:  # no block left: any free cell
            rest = np.flatnonzero(free)
            out.append(rest[~np.isin(rest, np.concatenate(out))][:need])
            self.out_of_order += 1
        return np.concatenate(out).astype(np.int32)

    def free(self, seq_id: int) -> int:
        """Free every cell of a sequence (and its blocks); returns how many."""
        cells = self.seq == seq_id
        n = int(np.count_nonzero(cells))
        self.owner[self.owner == seq_id] = -1
        if n:
            self.seq[cells] = -1
            self.pos[cells] = -1
            self.n_used -= n
            used = np.flatnonzero(self.seq >= 0)
            self.n_kv = int(used[-1]) + 1 if used.size else 0
        return n

    def release(self, cells: np.ndarray) -> None:
        """Free the given cells (a step that failed gives back the cells it took; their blocks stay reserved)."""
        cells = cells[self.seq[cells] >= 0]
        self.seq[cells] = -1
        self.pos[cells] = -1
        self.n_used -= int(cells.size)
        used = np.flatnonzero(self.seq >= 0)
        self.n_kv = int(used[-1]) + 1 if used.size else 0

    def clear(self) -> None:
        self.seq.fill(-1)
        self.pos.fill(-1)
        self.owner.fill(-1)
        self.n_used = self.n_kv = 0

    def mask(self, seq_ids: np.ndarray, positions: np.ndarray, n_kv: int, window: int = 0,
             out: np.ndarray | None = None) -> np.ndarray:
        """(T, n_kv) F32: 0 where query i (sequence seq_ids[i] at positions[i]) may see cell j, else -inf."""
        cs, cp = self.seq[None, :n_kv], self.pos[None, :n_kv]
        p = positions[:, None]
        ok = (cs == seq_ids[:, None]) & (cp <= p)
        if window > 0:
            ok &= p - cp < window
        if out is None:
            out = np.empty(ok.shape, np.float32)
        out.fill(-np.inf)
        out[ok] = 0.0
        return out
