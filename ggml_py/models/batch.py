"""Batched decoding: many sequences in one KV cache, advanced together on ONE prepared plan.

A `BatchDecoder` owns a KV cache of `n_ctx` cells shared by up to `n_seq_max` sequences (`KVCells`: cell ->
(sequence, position)). A step (`decode`) takes any mix of sequences, each with one or more new tokens (a decoding
sequence's next token, a chunk of a new sequence's prompt), up to `n_batch` tokens in all, and returns the logits of
the last token of the entries that ask for them. Everything that changes between steps is an input of the plan:

    tokens, pos, kv_idx (the cells the step's K/V rows are written to with SET_ROWS)   (T,) I32
    kq_mask (and kq_mask_swa with sliding-window layers)                               (T, n_kv) F32
    out_idx (the rows whose logits are wanted; GET_ROWS before the last layer's FFN)   (n_out,) I32

with T, n_kv and n_out symbolic dimensions bound at compute time, so sequences join and leave, and prompts are
prefilled in chunks beside other sequences' decoding, without ever preparing another plan. The mask, built on the
host from the cells' sequences and positions, keeps sequences apart: a query sees the cells of its own sequence at
positions up to its own (within the window on sliding layers). Host work per step is numpy over the whole batch.

The model's own single-sequence plans (`Model.eval` / `generate`) are untouched: they keep their own cache and their
power-of-two token counts (row r = position r is the one-sequence case of the same cells).
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from ggml_py.errors import ModelError
from ggml_py.ir import dtypes
from ggml_py.models.kv_cache import KVCells, cells_for
from ggml_py.models.prefix_cache import ROOT, PrefixIndex, block_digest
from ggml_py.models.stage import Stage, StepMeta, logit_rows

if TYPE_CHECKING:
    from ggml_py.models.model import Model

DEFAULT_N_BATCH = 128  # tokens per step at most (the plan's bound on T)
RECOVERIES_PER_STEP = 2  # a step is tried again at most this often after its stages restarted what they lost


class StageLike(Protocol):
    """What the decoder asks of a stage: a local `Stage`, or one in another process (ggml_py/cluster/)."""

    def step(self, meta: StepMeta, x: np.ndarray) -> np.ndarray: ...

    def reset(self) -> None: ...

    def recover(self) -> bool: ...

    def close(self) -> None: ...


@dataclass
class _Step:
    """A step from its submission to its result: the arrays it was given and what became of it."""

    seq_list: list[int]
    lens: list[int]
    toks: list[list[int]]
    ids: np.ndarray
    seqs: np.ndarray
    pos: np.ndarray
    out_rows: np.ndarray
    cells: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int32))
    handle: Any = None  # the pipeline's, while in flight
    logits: np.ndarray | None = None
    error: BaseException | None = None

    @staticmethod
    def empty(n_vocab: int) -> _Step:
        z = np.zeros(0, np.int32)
        return _Step([], [], [], z, z, z, z, logits=np.zeros((0, n_vocab), np.float32))


class PendingStep:
    """A submitted step (BatchDecoder.submit): `result()` waits for its logits (or raises its error)."""

    def __init__(self, decoder: BatchDecoder, step: _Step) -> None:
        self._decoder, self._step = decoder, step

    def result(self) -> np.ndarray:
        return self._decoder._result(self._step)


class BatchDecoder:
    """Up to `n_seq_max` sequences in a cache of `n_ctx` cells, decoded together on one prepared plan.

    >>> dec = BatchDecoder(model, n_seq_max=4)
    >>> a, b = dec.new_sequence(), dec.new_sequence()
    >>> logits = dec.decode([(a, prompt_a, True), (b, prompt_b, True)])   # (2, n_vocab): last token of each
    >>> logits = dec.decode([(a, [next_a], True), (b, [next_b], True)])
    >>> dec.free_sequence(a)

    Thread safety: every call takes the model's lock (one step at a time per model).
    """

    def __init__(self, model: Model, n_ctx: int | None = None, n_seq_max: int = 8, n_batch: int = DEFAULT_N_BATCH,
                 kv_type: str | dtypes.DType | None = None, stages: Sequence[StageLike] | None = None,
                 prefix_cache: bool = True) -> None:
        for name, v in (("n_seq_max", n_seq_max), ("n_batch", n_batch)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ModelError(f"{name} must be a positive integer, got {v!r}")
        n_ctx = model.n_ctx if n_ctx is None else n_ctx
        if isinstance(n_ctx, bool) or not isinstance(n_ctx, int) or n_ctx < 1:
            raise ModelError(f"n_ctx must be a positive integer, got {n_ctx!r}")
        kv = model.cache.dtype if kv_type is None else dtypes.get(kv_type)
        self.model = model
        self.n_ctx = n_ctx
        self.n_seq_max = n_seq_max
        self.n_batch = n_batch
        self.n_out = logit_rows(n_seq_max)  # rows of logits a step may ask for
        self.cells = KVCells(cells_for(n_ctx, n_seq_max), n_seq_max, capacity=n_ctx)
        # whole blocks of computed tokens, kept after their sequences end and found again by later prompts
        self.prefix = PrefixIndex(self.cells.block) if prefix_cache else None
        # the blocks run as one local stage beside the decoder (sharing its cells), or as the given pipeline stages,
        # each with its own record of the cells kept from the step metas (stage.py)
        self._own_stages = stages is None  # given stages are the caller's to close; this decoder starts them afresh
        for st in stages or ():
            for name, need in (("n_ctx", n_ctx), ("n_seq_max", n_seq_max), ("n_batch", n_batch)):
                have = getattr(st, name, None)
                if have is not None and have < need:
                    raise ModelError(f"a stage was made for {name}={have}, less than this decoder's {need}: make "
                                     "the stages (start_pipeline) and the decoder or engine with the same numbers")
        for st in stages or ():
            st.reset()
        self.stages: list[StageLike] = list(stages) if stages is not None else [
            Stage(model, range(model.hparams.n_layer), n_ctx, n_seq_max, n_batch, kv, cells=self.cells)]
        self._free_ids = list(range(n_seq_max))
        self._next_pos: dict[int, int] = {}  # sequence id -> its next position (= tokens it holds)
        self._tokens: dict[int, list[int]] = {}  # sequence id -> its tokens (replayed when a stage is rebuilt)
        self._digests: dict[int, list[bytes]] = {}  # sequence id -> the digests of its whole blocks (prefix_cache.py)
        self._unindexed: set[int] = set()  # sequences whose later blocks are not indexed (cells out of order)
        # what changed in the cells since the last step, for the stages' records (StepMeta): sequences ended, cells
        # freed, cells now shared (sequence, cell), K/V rows to copy (src, dst, sequence, position)
        self._freed: list[int] = []
        self._released = np.zeros(0, np.int32)
        self._links: list[np.ndarray] = []
        self._copies: list[np.ndarray] = []
        self.steps = 0
        self.tokens = 0
        self.step_s = 0.0
        self.recoveries = 0  # lost stages started again (and every KV rebuilt) during a step
        self._stale = False
        self._inflight: deque[_Step] = deque()  # steps submitted to a pipeline, not collected yet, in order
        self._ended: list[int] = []  # ended sequences whose ids a step in flight still has
        self._broken: BaseException | None = None  # a step failed and the stages could not be recovered
        self._closed = False
        model._attach(self)

    # -- sequences -------------------------------------------------------------------------------------------------
    @property
    def n_active(self) -> int:
        return len(self._next_pos)

    @property
    def has_free_sequence(self) -> bool:
        """Whether new_sequence() has an id to give (an ended sequence's id comes back once no step in flight has
        it)."""
        return bool(self._free_ids)

    @property
    def pipeline(self) -> Any:
        """The stage that takes steps in flight (a pipeline of P stages: `n_stages`), or None."""
        return self._async_stage()

    def new_sequence(self) -> int:
        """A new, empty sequence's id (ModelError when n_seq_max are active)."""
        with self.model._lock:
            if not self._free_ids:
                raise ModelError(f"all {self.n_seq_max} sequences are in use (n_seq_max); free one first")
            s = self._free_ids.pop(0)
            self._next_pos[s] = 0
            self._tokens[s] = []
            self._digests[s] = []
            return s

    def reuse_prefix(self, seq_id: int, prompt: Sequence[int],
                     usable: Callable[[list[bytes]], int] | None = None) -> int:
        """Let an empty sequence start with the longest prefix of `prompt` the prefix cache holds (whole blocks, at
        least the last token left to compute; `usable(digests)` may keep fewer: PrefixIndex.lookup); returns the
        tokens it now holds, which its steps skip."""
        with self.model._lock:
            if self._next_pos.get(seq_id) != 0:
                raise ModelError(f"sequence {seq_id} is not an empty active sequence")
            if self.prefix is None:
                return 0
            blocks, digests = self.prefix.lookup(prompt, usable)
            if not blocks:
                return 0
            self._links.append(self._linked(seq_id, self.cells.link(seq_id, np.array(blocks))))
            self.cells.touch(seq_id)
            n = len(blocks) * self.cells.block
            self._next_pos[seq_id] = n
            self._tokens[seq_id] = [int(t) for t in prompt[:n]]
            self._digests[seq_id] = digests
            return n

    def fork(self, parent: int) -> int:
        """A new sequence holding the same tokens as `parent`: it shares the parent's whole blocks, and gets a copy
        of the rest (the part-filled last block) before its next step; from there on the two go their own ways."""
        with self.model._lock:
            if parent not in self._next_pos:
                raise ModelError(f"sequence {parent} is not active")
            if any(parent in q.seq_list for q in self._inflight):
                raise ModelError(f"sequence {parent} is in a step in flight: collect its result first")
            child = self.new_sequence()
            linked, src, dst = self.cells.fork(parent, child)
            self._drain_evicted()
            self._links.append(self._linked(child, linked))
            if src.size:
                self._copies.append(np.stack([src, dst, np.full(src.size, child, np.int32), self.cells.pos[dst]]))
            self._next_pos[child] = self._next_pos[parent]
            self._tokens[child] = list(self._tokens[parent])
            self._digests[child] = list(self._digests[parent])
            if parent in self._unindexed:
                self._unindexed.add(child)
            return child

    def digests(self, seq_id: int) -> list[bytes]:
        """The digests of the sequence's whole blocks the prefix cache indexes (prefix_cache.py)."""
        return list(self._digests.get(seq_id, []))

    def annotate(self, seq_id: int, k: int, data: Any) -> bool:
        """Keep `data` with the sequence's k-th whole block in the prefix cache (PrefixIndex.annotate); False when
        that block is not indexed."""
        with self.model._lock:
            digests = self._digests.get(seq_id, [])
            return self.prefix is not None and k < len(digests) and self.prefix.annotate(digests[k], data)

    @staticmethod
    def _linked(seq_id: int, cells: np.ndarray) -> np.ndarray:
        return np.stack([np.full(cells.size, seq_id, np.int32), cells.astype(np.int32)])

    def free_sequence(self, seq_id: int) -> None:
        """End a sequence: the cells no other sequence sees are free for others at once (but those of blocks the
        prefix cache keeps, until they are needed)."""
        with self.model._lock:
            if seq_id not in self._next_pos:
                raise ModelError(f"sequence {seq_id} is not active")
            self._released = np.concatenate([self._released, self.cells.free(seq_id)])
            self._freed.append(seq_id)
            del self._next_pos[seq_id]
            del self._tokens[seq_id]
            del self._digests[seq_id]
            self._unindexed.discard(seq_id)
            self._ended.append(seq_id)
            self._reuse_ids()

    def _reuse_ids(self) -> None:
        """Ended sequences' ids become free once no step in flight has them."""
        busy = {s for q in self._inflight for s in q.seq_list}
        back = [s for s in self._ended if s not in busy]
        if back:
            self._ended = [s for s in self._ended if s in busy]
            self._free_ids = sorted(self._free_ids + back)

    def seq_len(self, seq_id: int) -> int:
        """Tokens the sequence holds (= position of its next token)."""
        return self._next_pos[seq_id]

    # -- a step ----------------------------------------------------------------------------------------------------
    def decode(self, entries: Sequence[tuple[int, Sequence[int] | np.ndarray, bool | str]]) -> np.ndarray:
        """One step over entries (seq_id, new token ids, want_logits): every entry's tokens are appended to its
        sequence; returns (rows, n_vocab) float32 in entry order: the logits of the last token of each entry whose
        want_logits is True, of every token of each entry whose want_logits is "all" (at most `n_out` rows in
        all). A sequence may appear once per step."""
        return self.submit(entries).result()

    def submit(self, entries: Sequence[tuple[int, Sequence[int] | np.ndarray, bool | str]]) -> PendingStep:
        """Start a step (as decode) and return at once: `result()` of what it returns waits for the logits. On a
        pipeline (a stage with `submit`, ggml_py/cluster/) several steps may be in flight, each on other sequences,
        so that the stages work on them at the same time (micro-batches); on local stages the step is computed
        here. Results are collected in the order the steps were submitted; a sequence in a step in flight cannot be
        in another until that one's result is collected."""
        t_step = time.perf_counter()
        m = self.model
        with m._lock:
            m._check_open()
            if self._closed:
                raise ModelError("this batch decoder is closed")
            if self._broken is not None:
                raise ModelError(f"this batch decoder's stages failed: {self._broken}")
            m._check_file()
            if not entries:
                return PendingStep(self, _Step.empty(m.n_vocab))
            st = self._prepare(entries)
            stage = self._async_stage()
            if stage is None or self._stale:
                if self._inflight:  # a rebuild happens only with nothing in flight
                    self._collect(self._inflight[-1])
                if self._stale:  # a rebuild failed half way: the stages' caches are not the sequences' yet
                    self._rebuild()
                st.logits = self._run(st)
            else:
                st.cells = self._alloc(st)  # CacheFullError when the cache is full
                try:
                    st.handle = stage.submit(self._meta(st, st.cells), st.ids)
                except BaseException:
                    self.cells.release(st.cells)
                    raise
                self._sent()
                self._commit(st)  # the sequences' positions move on now: the next step of each follows this one
                self._inflight.append(st)
            self.step_s += time.perf_counter() - t_step
            return PendingStep(self, st)

    def _prepare(self, entries: Sequence[tuple[int, Sequence[int] | np.ndarray, bool | str]]) -> _Step:
        """A step's arrays, checked: each token's sequence and position, the rows whose logits are wanted."""
        m = self.model
        seq_list = [int(e[0]) for e in entries]
        if len(set(seq_list)) != len(seq_list):
            raise ModelError("a sequence appears twice in one step")
        for s in seq_list:
            if s not in self._next_pos:
                raise ModelError(f"sequence {s} is not active (new_sequence() first)")
            if any(s in q.seq_list for q in self._inflight):
                raise ModelError(f"sequence {s} is in a step in flight: collect its result first")
        toks = [np.asarray(e[1]) for e in entries]
        lens = np.array([t.size for t in toks], np.int64)
        if lens.min() < 1:
            raise ModelError("every entry of a step needs at least one token")
        n = int(lens.sum())
        if n > self.n_batch:
            raise ModelError(f"{n} tokens in one step exceed the batch size {self.n_batch} (n_batch)")
        ids = m.check_ids(np.concatenate(toks), n_past=0, check_ctx=False)
        seqs = np.repeat(np.array(seq_list, np.int32), lens)
        ends = np.cumsum(lens)
        starts = np.array([self._next_pos[s] for s in seq_list], np.int64)
        pos = (np.repeat(starts - (ends - lens), lens) + np.arange(n)).astype(np.int32)
        # rows whose logits are wanted: an entry's last token (want True), or all its tokens (want "all": the
        # distributions of a prompt's tokens, for their log-probabilities)
        rows = [np.arange(e - k, e) if w == "all" else np.array([e - 1]) if w else np.zeros(0, np.int64)
                for (_, _, w), e, k in zip(entries, ends.tolist(), lens.tolist())]
        out_rows = np.concatenate(rows).astype(np.int32)
        if out_rows.size > self.n_out:
            raise ModelError(f"{out_rows.size} rows of logits in one step exceed the plan's {self.n_out} (n_out)")
        return _Step(seq_list, lens.tolist(), [t.tolist() for t in toks], ids, seqs, pos, out_rows)

    def _run(self, st: _Step) -> np.ndarray:
        """Compute a step now, through every stage; a stage lost on the way is started again, the caches rebuilt,
        and the step tried once more (RECOVERIES_PER_STEP)."""
        for attempt in range(RECOVERIES_PER_STEP + 1):
            cells = self._alloc(st)  # CacheFullError when the cache is full
            try:
                x = self._run_stages(self._meta(st, cells), st.ids)
                break
            except BaseException as e:
                # the step did not happen: its cells are free again, and the stages' records are told (so are
                # the sequences freed before it: a stage the step did not reach has not seen them)
                self.cells.release(cells)
                self._released = np.concatenate([self._released, cells])
                if isinstance(e, Exception) and attempt < RECOVERIES_PER_STEP and self._recover():
                    continue  # a lost stage was started again and every KV rebuilt: the same step once more
                raise
        st.cells = cells
        self._sent()
        self._commit(st)
        self._count(st)
        return x

    def _alloc(self, st: _Step) -> np.ndarray:
        cells = self.cells.alloc(st.seqs, st.pos)
        self._drain_evicted()
        return cells

    def _drain_evicted(self) -> None:
        """Blocks the cells evicted to make room: out of the index, their cells freed in the stages' records."""
        blocks, cells = self.cells.take_evicted()
        if self.prefix is not None:
            for b in blocks:
                self.prefix.forget(b)
        if cells.size:
            self._released = np.concatenate([self._released, cells])

    def _meta(self, st: _Step, cells: np.ndarray) -> StepMeta:
        """A step's metadata with what changed in the cells since the last step."""
        links = np.concatenate(self._links, axis=1) if self._links else np.zeros((2, 0), np.int32)
        copies = np.concatenate(self._copies, axis=1) if self._copies else np.zeros((4, 0), np.int32)
        return StepMeta(st.seqs, st.pos, cells, st.out_rows, tuple(self._freed), self._released, links, copies)

    def _sent(self) -> None:
        """Every stage has applied the changes to the cells (a step went through)."""
        self._freed.clear()
        self._released = np.zeros(0, np.int32)
        self._links.clear()
        self._copies.clear()

    def _commit(self, st: _Step) -> None:
        for s, k, t in zip(st.seq_list, st.lens, st.toks):
            self._next_pos[s] += k
            self._tokens[s].extend(t)
            if self.prefix is not None:
                self._index_blocks(s)

    def _index_blocks(self, s: int) -> None:
        """Index the sequence's blocks that are whole now; one whose cells do not hold their positions in order ends
        the indexing of that sequence (its later blocks would not follow a run of indexed ones)."""
        assert self.prefix is not None
        bs, digests, toks = self.cells.block, self._digests[s], self._tokens[s]
        while s not in self._unindexed and (len(digests) + 1) * bs <= len(toks):
            k = len(digests)
            b = self._block_of(s, k)
            if b is None:
                self._unindexed.add(s)
                return
            d = block_digest(digests[-1] if digests else ROOT, toks[k * bs:(k + 1) * bs])
            digests.append(d)
            if not self.cells.cached[b] and self.prefix.add(d, b):
                self.cells.cached[b] = True

    def _block_of(self, s: int, k: int) -> int | None:
        """The block holding positions [k * block, (k + 1) * block) of sequence s, each at its offset, above the
        block of the positions before; None when its cells are not laid out so."""
        bs, cells = self.cells.block, self.cells
        lo = k * bs
        mine = np.flatnonzero(cells.member[:, s])
        p = cells.pos[mine]
        at = mine[(p >= lo) & (p < lo + bs)]
        if at.size != bs:
            return None
        b = int(at[0]) // bs
        if not np.array_equal(cells.pos[b * bs:(b + 1) * bs], np.arange(lo, lo + bs)):
            return None
        if k and not bool((mine[p == lo - 1] < b * bs).all()):
            return None
        return b

    def _count(self, st: _Step) -> None:
        self.steps += 1
        self.tokens += int(st.seqs.size)

    def _async_stage(self) -> Any:
        """The one stage that can take steps in flight (a pipeline), or None."""
        if len(self.stages) == 1 and hasattr(self.stages[0], "submit"):
            return self.stages[0]
        return None

    def _result(self, st: _Step) -> np.ndarray:
        with self.model._lock:
            if st.logits is None and st.error is None:
                self._collect(st)
            if st.error is not None:
                raise st.error
            assert st.logits is not None
            return st.logits

    def _collect(self, st: _Step) -> None:
        """Collect the steps in flight up to `st`, in order. When one failed, every step in flight is collected,
        those that failed are undone (cells, positions, tokens), and if the stages can start again what they lost
        the caches are rebuilt and the failed steps computed again; else the decoder stays failed."""
        stage = self._async_stage()
        while self._inflight and st.logits is None and st.error is None:
            q = self._inflight[0]
            t0 = time.perf_counter()
            try:
                q.logits = stage.collect(q.handle)
            except Exception as e:
                q.error = e
                self._fail_inflight()
                return
            self._inflight.popleft()
            self._reuse_ids()
            self._count(q)
            self.step_s += time.perf_counter() - t0

    def _fail_inflight(self) -> None:
        stage = self._async_stage()
        failed = []
        for q in self._inflight:
            if q.error is None:
                try:
                    q.logits = stage.collect(q.handle)
                    self._count(q)
                except Exception as e:
                    q.error = e
            if q.error is not None:
                failed.append(q)
        self._inflight.clear()
        self._reuse_ids()
        for q in reversed(failed):  # undone: the cells still theirs, the positions and tokens of live sequences
            mine = (self.cells.seq[q.cells] == q.seqs) & (self.cells.pos[q.cells] == q.pos)
            self.cells.release(q.cells[mine])
            for s, k in zip(q.seq_list, q.lens):
                if s in self._next_pos and self._next_pos[s] >= k:
                    self._next_pos[s] -= k
                    del self._tokens[s][-k:]
        try:
            recovered = self._recover()
        except Exception as e:
            recovered, failed[0].error = False, e
        if not recovered:
            self._broken = failed[0].error
            return
        for q in failed:  # computed again, in order, on the rebuilt caches
            if any(s not in self._next_pos for s in q.seq_list):
                q.error = ModelError("a sequence of this step ended while the step was being recovered")
                continue
            q.error = None
            try:
                q.logits = self._run(q)
            except Exception as e:
                q.error = self._broken = e
                return

    def _run_stages(self, meta: StepMeta, ids: np.ndarray) -> np.ndarray:
        x = ids
        for st in self.stages:
            x = st.step(meta, x)
        return x

    def _recover(self) -> bool:
        """After a failed step: let each stage start again what it lost (a pipeline re-places a dead stage); if one
        did, rebuild every stage's cache. False when no stage had anything to start again."""
        if not any([st.recover() for st in self.stages]):
            return False
        self._stale = True
        self._rebuild()
        self.recoveries += 1
        return True

    def _rebuild(self) -> None:
        """Every stage forgets its cache and the tokens of every active sequence are computed again, into the same
        cells (steps of n_batch tokens in position order, no logits): the KV of a new stage is rebuilt and the
        others' is as it was. Until it succeeds, no step runs on the stale caches (`_stale`)."""
        for st in self.stages:
            st.reset()
        self.cells.evict_unseen()  # blocks only the prefix cache holds have no tokens to compute them from
        self._drain_evicted()
        self._sent()
        # each cell once, as a token of the first sequence that sees it; every sequence's view of the cells (shared
        # blocks included) sent with the first step
        done = np.zeros(self.cells.n_cells, bool)
        parts: list[list[np.ndarray]] = [[], [], [], []]  # seqs, pos, cells, ids
        for s in sorted(self._next_pos):
            cells = np.flatnonzero(self.cells.member[:, s] & ~done).astype(np.int32)
            done[cells] = True
            cells = cells[np.argsort(self.cells.pos[cells], kind="stable")]
            pos = self.cells.pos[cells]
            for part, a in zip(parts, (np.full(cells.size, s, np.int32), pos, cells,
                                       np.asarray(self._tokens[s], np.int32)[pos])):
                part.append(a)
        seqs, pos, cells, ids = (np.concatenate(p) if p else np.zeros(0, np.int32) for p in parts)
        seen, by = np.nonzero(self.cells.member)
        links = np.stack([by, seen]).astype(np.int32)
        none = np.zeros(0, np.int32)
        for a in range(0, seqs.size, self.n_batch):
            sl = slice(a, a + self.n_batch)
            self._run_stages(StepMeta(seqs[sl], pos[sl], cells[sl], none, links=links if a == 0 else
                                      np.zeros((2, 0), np.int32)), ids[sl])
        self._stale = False

    def stats(self) -> dict[str, Any]:
        local = self._local_stages()
        return {"n_ctx": self.n_ctx, "n_seq_max": self.n_seq_max, "n_batch": self.n_batch,
                "active_sequences": self.n_active, "cells_used": self.cells.n_held,
                "cells_cached": self.cells.n_cached, "n_kv": self.cells.n_kv,
                "cells_out_of_order": self.cells.out_of_order,
                "steps": self.steps, "tokens": self.tokens, "step_s": self.step_s, "stages": len(self.stages),
                "compute_s": sum(st.compute_s for st in local),
                "plans_prepared": sum(st.plans_prepared for st in local),
                "prepare_s": sum(st.prepare_s for st in local)}

    def _local_stages(self) -> list[Stage]:
        return [st for st in self.stages if isinstance(st, Stage)]

    @property
    def memory_parts(self) -> list[tuple[str, int]]:
        """What the local stages hold (their KV caches and compute buffers), as checked against MemAvailable."""
        return [p for st in self._local_stages() for p in st.memory_parts]

    @property
    def plans_prepared(self) -> int:
        return sum(st.plans_prepared for st in self._local_stages())

    @property
    def compute_s(self) -> float:
        return sum(st.compute_s for st in self._local_stages())

    def close(self) -> None:
        """Free the plan of the decoder's own stage (the model's close() closes its decoders too); stages given to it
        are the caller's to close."""
        with self.model._lock:
            if self._inflight:  # collected (their errors dropped): the stages are done with them
                self._collect(self._inflight[-1])
            self._closed = True
            if self._own_stages:
                for st in self.stages:
                    st.close()
            self.model._detach(self)

    def __enter__(self) -> BatchDecoder:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
