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

from dataclasses import dataclass

import numpy as np

from ggml_py.errors import ModelError
from ggml_py.ir import dtypes, ops
from ggml_py.ir.dtypes import DType
from ggml_py.ir.symbolic import Dim
from ggml_py.ir.tensor import Tensor, input, state
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


@dataclass
class CopyRows:
    """A graph copying K and V rows between cells in every layer of `layers`: inputs src, dst (n,) I32."""

    src: Tensor
    dst: Tensor
    outputs: list[Tensor]


def copy_rows_graph(cache: KVCache, layers: range, n: Dim) -> CopyRows:
    """The rows of cells src written into cells dst, K and V of every layer in `layers` (a fork's own copy of the
    cells it cannot share: KVCells.fork). F16 rows pass through F32 and back, which is exact."""
    src = input((n,), dtypes.I32, name="copy_src")
    dst = input((n,), dtypes.I32, name="copy_dst")
    outs = [ops.set_rows(t, ops.get_rows(t, src), dst) for il in layers for t in (cache.k[il], cache.v[il])]
    return CopyRows(src, dst, outs)


BLOCK = 32  # cells a shared cache hands a sequence at a time


def cells_for(n_ctx: int, n_seq_max: int, block: int = BLOCK) -> int:
    """The cells of a cache shared by up to `n_seq_max` sequences holding `n_ctx` tokens in all: one block more
    per sequence (each leaves at most its last block part-empty), so that every sequence's tokens fit in whole
    blocks of its own, in ascending order, however full the cache (KVCells; docs/serving.md, determinism)."""
    return (-(-n_ctx // block) + n_seq_max) * block


class CacheFullError(ModelError):
    """The KV cache has no free cells for the tokens asked for."""


class KVCells:
    """Which positions each cell (row) of a shared KV cache holds, and which sequences see it.

    `pos[c]` is the position in cell c (-1: free), `seq[c]` the live sequence that wrote it (-1: none), and
    `member[c, s]` whether sequence s sees it: its own cells, and the blocks it shares with others (a prefix it
    was forked from or found in the prefix cache). Every token of a step gets a cell (`alloc`); the cells a step's
    attention reads are the first `n_kv` (one past the highest used cell), and the mask of a query lets it see
    exactly the cells its sequence sees at positions <= its own (and, with a sliding window, within the window).
    All of it is numpy over the whole batch: the host work per step does not grow with the number of sequences.

    Cells are handed out by blocks of `block` cells reserved for one sequence (as paged attention does), so that
    sequences decoding side by side do not interleave their cells: attention skips a tile of keys that are all
    masked, and with interleaved cells no tile would be. A sequence's next block is the lowest free one above the
    highest it sees, so its positions lie in ascending cell order, each block starting at a multiple of `block`:
    the order in which attention sums a query's keys is then the same wherever the sequence's cells lie
    (docs/serving.md). When no block is free above, a lower one is used, and when no whole block is free, any free
    cell (`out_of_order` counts both).

    Blocks shared between sequences are whole blocks of `block` positions (a fork's part-filled last block is
    copied: `fork`). A full block whose tokens the prefix cache knows (`cached`) outlives its sequences: it is
    kept until its cells are needed (`evictable`, least recently used first), and a new sequence whose prompt
    starts with its tokens sees it instead of computing them again (`link`).

    A pipeline stage keeps a mirror of the decoder's cells (stage.py): it applies the same changes the decoder
    made, told by the step's metadata (`unlink`, `release`, `link`, `occupy`), and decides nothing itself.
    """

    def __init__(self, n_cells: int, n_seq_max: int, block: int = BLOCK, capacity: int | None = None) -> None:
        if n_cells < 1 or n_seq_max < 1:
            raise ModelError(f"a KV cache needs n_ctx >= 1 and n_seq_max >= 1, got {n_cells} and {n_seq_max}")
        self.n_cells = n_cells
        # tokens it holds at most (n_ctx): fewer than its cells when these are padded to whole blocks (cells_for)
        self.capacity = n_cells if capacity is None else min(capacity, n_cells)
        self.n_seq_max = n_seq_max
        self.block = block
        n_blocks = -(-n_cells // block)
        self.seq = np.full(n_cells, -1, np.int32)
        self.pos = np.full(n_cells, -1, np.int32)
        self.member = np.zeros((n_cells, n_seq_max), bool)
        self.owner = np.full(n_blocks, -1, np.int32)  # the sequence a block is reserved for (-1: none)
        self.cached = np.zeros(n_blocks, bool)  # the prefix cache knows its tokens: kept after its sequences end
        self.last_used = np.zeros(n_blocks, np.int64)  # when a sequence last saw it (a counter): eviction order
        self._clock = 0
        self._cell_block = np.arange(n_cells) // block
        self.evicted: list[int] = []  # blocks evicted since the owner of this record last took them
        self.n_used = 0  # cells holding a position (a sequence's, or kept by the prefix cache)
        self.n_kv = 0  # one past the highest used cell
        # times a sequence's cells could not follow its positions in ascending, block-aligned order (the cache was
        # too full): its attention may then sum in another order than alone
        self.out_of_order = 0

    @property
    def n_cached(self) -> int:
        """Cells only the prefix cache holds (evicted when cells are needed)."""
        return int(self.evictable().size) * self.block

    @property
    def n_held(self) -> int:
        """Cells a sequence sees."""
        return self.n_used - self.n_cached

    @property
    def n_free(self) -> int:
        return self.capacity - self.n_used + self.n_cached

    def evictable(self) -> np.ndarray:
        """Cached blocks no sequence sees, least recently used first."""
        seen = np.bincount(self._cell_block, self.member.any(axis=1), minlength=self.owner.size) > 0
        b = np.flatnonzero(self.cached & ~seen & (self.owner < 0))
        return b[np.argsort(self.last_used[b], kind="stable")]

    # -- the decoder's decisions ---------------------------------------------------------------------------------
    def alloc(self, seq_ids: np.ndarray, positions: np.ndarray) -> np.ndarray:
        """Cells for tokens (seq_ids[i], positions[i]): each sequence's in its own blocks (the lowest free cells of
        the blocks it holds, then of the lowest free blocks above the highest it sees), else the lowest free ones;
        cached blocks no sequence sees are evicted when nothing else is free (`evicted`); CacheFullError when too
        few cells are free."""
        n = len(seq_ids)
        if n > self.capacity - self.n_used and n > self.n_free:  # (the cached cells counted only when needed)
            raise CacheFullError(f"the KV cache is full: {n} new tokens, {self.n_free} of {self.capacity} free "
                                 f"(n_ctx); finish or cancel a sequence, or use a larger context")
        seq_ids = np.asarray(seq_ids, np.int32)
        positions = np.asarray(positions, np.int32)
        cells = np.empty(n, np.int32)
        for s in np.unique(seq_ids):
            where = np.flatnonzero(seq_ids == s)
            cells[where] = got = self._cells_of(int(s), where.size)
            self.pos[got] = positions[where]  # taken: the next sequence's cells are others
        self.seq[cells] = seq_ids
        self.member[cells, seq_ids] = True
        self.n_used += n
        if n:
            self.n_kv = max(self.n_kv, int(cells.max()) + 1)
        return cells

    def _cells_of(self, s: int, k: int) -> np.ndarray:
        free = self.pos < 0
        own = np.flatnonzero(free & (self.owner[self._cell_block] == s))[:k]
        if own.size == k:
            return own
        out = [own]
        need = k - own.size
        # new blocks above the highest block the sequence sees, so that its positions stay in ascending cell order
        # (attention then sums its keys in the same order wherever they lie: docs/serving.md, determinism); below
        # only when nothing above is free (counted); a cached block no one sees only when no free block is left
        seen = self._cell_block[np.flatnonzero(self.member[:, s])]
        last = int(seen.max()) if seen.size else -1
        unowned = np.flatnonzero((self.owner < 0) & ~self.cached)
        old = self.evictable() if self.cached.any() else unowned[:0]
        order = [unowned[unowned > last], old[old > last], unowned[unowned < last], old[old < last]]
        for b in np.concatenate(order):
            if not need:
                break
            if self.cached[b]:
                self._evict(int(b))
            lo = int(b) * self.block
            got = lo + np.flatnonzero(self.pos[lo: lo + self.block] < 0)[:need]
            if got.size:
                if got[0] != lo or b < last:
                    self.out_of_order += 1
                self.owner[b] = s
                out.append(got)
                need -= got.size
        if need:  # no block left: any free cell
            rest = np.flatnonzero(self.pos < 0)
            out.append(rest[~np.isin(rest, np.concatenate(out))][:need])
            self.out_of_order += 1
        return np.concatenate(out).astype(np.int32)

    def _evict(self, b: int) -> None:
        self.cached[b] = False
        self.evicted.append(b)
        lo = b * self.block
        self.release(np.arange(lo, min(lo + self.block, self.n_cells), dtype=np.int32))

    def evict_unseen(self) -> None:
        """Evict every cached block no sequence sees."""
        for b in self.evictable():
            self._evict(int(b))

    def take_evicted(self) -> tuple[list[int], np.ndarray]:
        """The blocks evicted since the last call, and their cells (which a mirror must release)."""
        blocks, self.evicted = self.evicted, []
        cells = [np.arange(b * self.block, min((b + 1) * self.block, self.n_cells), dtype=np.int32) for b in blocks]
        return blocks, np.concatenate(cells) if cells else np.zeros(0, np.int32)

    def free(self, seq_id: int) -> np.ndarray:
        """End a sequence: it sees no cell any more; the cells no other sequence sees are free, except those of
        cached blocks (kept for the prefix cache). Returns the cells freed."""
        self.touch(seq_id)
        self.unlink(seq_id)
        gone = np.flatnonzero((self.pos >= 0) & ~self.member.any(axis=1) & ~self.cached[self._cell_block])
        self.release(gone.astype(np.int32))
        return gone.astype(np.int32)

    def link(self, seq_id: int, blocks: np.ndarray) -> np.ndarray:
        """Let a sequence see whole blocks (a shared prefix); returns their cells."""
        cells = (np.asarray(blocks, np.int64)[:, None] * self.block + np.arange(self.block)).ravel()
        cells = cells[cells < self.n_cells].astype(np.int32)
        self.see(np.full(cells.size, seq_id, np.int32), cells)
        return cells

    def fork(self, parent: int, child: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The child sees every cell the parent sees: whole blocks are shared; the cells of blocks the parent holds
        in part (its last, or cells placed out of order) are copied into cells of the child's own. Returns the cells
        shared, and the copies (source cells, destination cells): their K and V rows must be copied before the
        child's next step."""
        mine = np.flatnonzero(self.member[:, parent])
        blocks, counts = np.unique(self._cell_block[mine], return_counts=True)
        whole = blocks[(counts == self.block) & (blocks * self.block + self.block <= self.n_cells)]
        linked = self.link(child, whole)
        src = mine[~np.isin(self._cell_block[mine], whole)].astype(np.int32)
        src = src[np.argsort(self.pos[src], kind="stable")]
        if not src.size:
            return linked, src, src
        dst = self._cells_of(child, src.size)
        self.occupy(dst, np.full(src.size, child, np.int32), self.pos[src])
        return linked, src, dst

    def touch(self, seq_id: int) -> None:
        """The blocks a sequence sees were just used: eviction keeps the recently used longer, and of one
        sequence's blocks the later positions go first (an earlier block is the prefix of more prompts)."""
        cells = np.flatnonzero(self.member[:, seq_id])
        blocks, first = np.unique(self._cell_block[cells], return_index=True)
        order = blocks[np.argsort(-self.pos[cells[first]], kind="stable")]  # the latest positions first
        self.last_used[order] = self._clock + np.arange(order.size)
        self._clock += order.size

    # -- changes a mirror applies as told --------------------------------------------------------------------------
    def occupy(self, cells: np.ndarray, seq_ids: np.ndarray, positions: np.ndarray) -> None:
        """Record that `cells` now hold tokens (seq_ids[i], positions[i]), seen by their sequences. ModelError if a
        cell is taken (a mirror that diverged from its decoder)."""
        if cells.size and (self.pos[cells] >= 0).any():
            raise ModelError(f"cells {cells[self.pos[cells] >= 0][:8].tolist()} are already taken in this record of "
                             "the KV cache: it no longer mirrors the decoder's")
        self.seq[cells] = seq_ids
        self.pos[cells] = positions
        self.member[cells, seq_ids] = True
        self.n_used += int(cells.size)
        if cells.size:
            self.n_kv = max(self.n_kv, int(cells.max()) + 1)

    def see(self, seq_ids: np.ndarray, cells: np.ndarray) -> None:
        """Sequences seq_ids[i] now also see cells[i] (shared blocks)."""
        self.member[cells, seq_ids] = True

    def unlink(self, seq_id: int) -> None:
        """A sequence sees nothing any more (its cells stay until released)."""
        self.member[:, seq_id] = False
        self.seq[self.seq == seq_id] = -1
        self.owner[self.owner == seq_id] = -1

    def release(self, cells: np.ndarray) -> None:
        """Free the given cells (a step that failed gives back the cells it took; their blocks stay reserved)."""
        cells = cells[self.pos[cells] >= 0]
        self.seq[cells] = -1
        self.pos[cells] = -1
        self.member[cells] = False
        self.n_used -= int(cells.size)
        used = np.flatnonzero(self.pos >= 0)
        self.n_kv = int(used[-1]) + 1 if used.size else 0

    def clear(self) -> None:
        self.seq.fill(-1)
        self.pos.fill(-1)
        self.member.fill(False)
        self.owner.fill(-1)
        self.cached.fill(False)
        self.evicted.clear()
        self.n_used = self.n_kv = 0

    def mask(self, seq_ids: np.ndarray, positions: np.ndarray, n_kv: int, window: int = 0,
             out: np.ndarray | None = None) -> np.ndarray:
        """(T, n_kv) F32: 0 where query i (sequence seq_ids[i] at positions[i]) may see cell j, else -inf."""
        cp = self.pos[None, :n_kv]
        p = positions[:, None]
        ok = self.member[:n_kv, seq_ids].T & (cp <= p) & (cp >= 0)
        if window > 0:
            ok &= p - cp < window
        if out is None:
            out = np.empty(ok.shape, np.float32)
        out.fill(-np.inf)
        out[ok] = 0.0
        return out
