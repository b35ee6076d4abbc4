"""Pipeline stages: a contiguous range of a model's blocks on one prepared plan, with the KV cache of those blocks.

A `BatchDecoder` (batch.py) keeps the books of a step (which sequences, positions and cache cells its tokens take,
which rows' logits are wanted) and hands every stage the same `StepMeta`, a few bytes a token. The first stage takes
the token ids, the others the hidden states (T, n_embd) of the stage before; the last returns the logits of the
wanted rows, the others their hidden states. Each stage masks attention from its own record of the cells (a mirror
of the decoder's, kept from the metas), so only hidden states and metadata ever cross between stages: a stage may
live in another process or on another machine (ggml_py/cluster/), where it prepares its plan once and computes it
every step like any local plan.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from ggml_py.errors import ModelError
from ggml_py.ir import dtypes
from ggml_py.ir.symbolic import sym
from ggml_py.models.blocks import StepGraph
from ggml_py.models.kv_cache import CopyRows, KVCache, KVCells, cells_for, copy_rows_graph
from ggml_py.models.memory import require_memory, step_buffer_bytes
from ggml_py.runtime.plan import prepare

if TYPE_CHECKING:
    from ggml_py.models.model import Model
    from ggml_py.runtime.plan import Plan


def _none() -> np.ndarray:
    return np.zeros(0, np.int32)


@dataclass(frozen=True)
class StepMeta:
    """What every stage needs for one step besides its input (all int32 arrays)."""

    seqs: np.ndarray  # (T,) the sequence of each token
    pos: np.ndarray  # (T,) its position
    cells: np.ndarray  # (T,) the cache cell it is written to
    out_rows: np.ndarray  # (n_out,) the rows whose logits are wanted (may be empty)
    # what changed in the cells since the previous step, applied in this order before it (KVCells):
    freed: tuple[int, ...] = ()  # sequences ended: they see no cell any more
    released: np.ndarray = field(default_factory=_none)  # cells freed (ended sequences', evicted, a failed step's)
    links: np.ndarray = field(default_factory=lambda: np.zeros((2, 0), np.int32))  # (sequence, cell) now shared
    copies: np.ndarray = field(default_factory=lambda: np.zeros((4, 0), np.int32))  # (src, dst cell, seq, pos):
    # K and V rows copied into a fork's own cells

    N_COUNTS = 6  # the counts a packed meta starts with

    @property
    def n_tokens(self) -> int:
        return int(self.seqs.size)

    def _parts(self) -> list[np.ndarray]:
        return [self.seqs, self.pos, self.cells, self.out_rows, np.array(self.freed, np.int32), self.released,
                self.links.ravel(), self.copies.ravel()]

    def nbytes(self) -> int:
        """The bytes this meta is made of (what crosses a stage boundary besides the hidden states)."""
        return sum(a.nbytes for a in self._parts())

    def pack(self) -> np.ndarray:
        """One int32 array (N_COUNTS counts, then every part): what a remote stage is sent, one buffer to
        serialize instead of eight."""
        counts = [self.n_tokens, self.out_rows.size, len(self.freed), self.released.size, self.links.shape[1],
                  self.copies.shape[1]]
        return np.concatenate([np.array(counts, np.int32), *self._parts()]).astype(np.int32, copy=False)

    @staticmethod
    def packed_size(counts: np.ndarray) -> int:
        """The int32 values of a packed meta, from its first N_COUNTS (the counts)."""
        n, o, f, r, lk, c = (int(v) for v in counts[:StepMeta.N_COUNTS])
        return StepMeta.N_COUNTS + 3 * n + o + f + r + 2 * lk + 4 * c

    @staticmethod
    def unpack(a: np.ndarray) -> StepMeta:
        n, o, f, r, lk, c = (int(v) for v in a[:StepMeta.N_COUNTS])
        parts = np.split(a[StepMeta.N_COUNTS:], np.cumsum([n, n, n, o, f, r, 2 * lk]))
        return StepMeta(parts[0], parts[1], parts[2], parts[3], tuple(parts[4].tolist()), parts[5],
                        parts[6].reshape(2, lk), parts[7].reshape(4, c))


PROMPT_LOGIT_ROWS = 32  # rows of logits a step may ask for beyond one per sequence (a prompt's log-probabilities)


def logit_rows(n_seq_max: int) -> int:
    """The rows of logits a step's plan holds at most: one per sequence, and PROMPT_LOGIT_ROWS for prompt tokens."""
    return n_seq_max + PROMPT_LOGIT_ROWS


def split_layers(n_layer: int, shares: Sequence[float]) -> list[range]:
    """Contiguous block ranges, one per stage, in proportion to `shares` (e.g. each node's free memory); every
    stage gets at least one block."""
    if not shares or len(shares) > n_layer or any(not s > 0 for s in shares):
        raise ModelError(f"cannot split {n_layer} blocks into stages with shares {list(shares)}: one positive share "
                         "per stage, at most one stage per block")
    total = float(sum(shares))
    bounds = [0]
    acc = 0.0
    for i, s in enumerate(shares[:-1]):
        acc += s
        left = len(shares) - 1 - i  # stages after this one, each needs a block
        bounds.append(min(max(round(n_layer * acc / total), bounds[-1] + 1), n_layer - left))
    bounds.append(n_layer)
    return [range(a, b) for a, b in zip(bounds, bounds[1:])]


def stage_weight_bytes(model: Model, layers: range) -> int:
    """The bytes of the weights a stage of `layers` reads: its blocks', the token embedding on the first stage, the
    output norm and head on the last (a tied head is the embedding: counted once)."""
    w, n_layer = model.weights, model.hparams.n_layer
    n = sum(t.nbytes for ly in w.layers[layers.start:layers.stop] for t in vars(ly).values() if t is not None)
    if layers.start == 0:
        n += w.tok_embd.nbytes
    if layers.stop == n_layer:
        n += w.output_norm.nbytes + (0 if w.tied and layers.start == 0 else w.output.nbytes)
    return n


def stage_memory_parts(model: Model, layers: range, n_ctx: int, n_seq_max: int, n_batch: int,
                       kv: dtypes.DType) -> list[tuple[str, int]]:
    """What a stage holds: its weights (mapped: resident once read, and read every step), the KV cache of its
    blocks, its compute buffer (attention masks of n_batch x its cells, the last stage's logits)."""
    hp = model.hparams
    last = layers.stop == hp.n_layer
    cells = cells_for(n_ctx, n_seq_max)
    return [(f"weights of blocks {layers.start}-{layers.stop - 1}", stage_weight_bytes(model, layers)),
            (f"KV cache of blocks {layers.start}-{layers.stop - 1} ({cells} cells, {kv})",
             KVCache.nbytes_for(hp, cells, kv) // hp.n_layer * len(layers)),
            (f"compute buffer (attention masks of {n_batch} x {cells})",
             step_buffer_bytes(hp, n_batch, cells, logit_rows(n_seq_max) if last else 0))]


def split_by_memory(need: Callable[[range], int], n_layer: int, budgets: Sequence[int]) -> list[range]:
    """Contiguous block ranges, one per budget, that keep the largest need(range) / budget as low as it can be (so
    each stage's share of the model follows its node's memory, embeddings and head included). A dynamic programme
    over (stages, blocks): a model has at most a few hundred blocks."""
    p = len(budgets)
    if not budgets or p > n_layer or any(not b > 0 for b in budgets):
        raise ModelError(f"cannot split {n_layer} blocks by memory budgets {list(budgets)}: one positive budget per "
                         "stage, at most one stage per block")
    inf = float("inf")
    # best[i][j]: the lowest worst ratio placing blocks [0, j) on the first i stages; cut[i][j]: where stage i-1 starts
    best = [[inf] * (n_layer + 1) for _ in range(p + 1)]
    cut = [[0] * (n_layer + 1) for _ in range(p + 1)]
    best[0][0] = 0.0
    for i in range(1, p + 1):
        for j in range(i, n_layer - (p - i) + 1):
            for k in range(i - 1, j):
                if best[i - 1][k] < inf:
                    r = max(best[i - 1][k], need(range(k, j)) / budgets[i - 1])
                    if r < best[i][j]:
                        best[i][j], cut[i][j] = r, k
    bounds = [n_layer]
    for i in range(p, 0, -1):
        bounds.append(cut[i][bounds[-1]])
    bounds.reverse()
    return [range(a, b) for a, b in zip(bounds, bounds[1:])]


class Stage:
    """Blocks `layers` of `model` on one prepared plan with at most `n_batch` tokens a step over `n_ctx` cells.

    `cells`: the decoder's own KVCells when the stage runs beside it (one local stage: nothing mirrored); None for a
    stage that keeps its own mirror from the metas (any stage of a pipeline). `count_weights`: its weights are part
    of what it checks against the available memory (or `memory_limit` bytes) before allocating anything."""

    def __init__(self, model: Model, layers: range, n_ctx: int, n_seq_max: int, n_batch: int,
                 kv_type: dtypes.DType | None = None, cells: KVCells | None = None, count_weights: bool = False,
                 memory_limit: int | None = None) -> None:
        hp = model.hparams
        if not (0 <= layers.start < layers.stop <= hp.n_layer and layers.step == 1):
            raise ModelError(f"stage layers {layers} are not a contiguous range of the model's {hp.n_layer} blocks")
        kv = model.cache.dtype if kv_type is None else kv_type
        self.model = model
        self.layers = layers
        self.first = layers.start == 0
        self.last = layers.stop == hp.n_layer
        self.n_ctx, self.n_seq_max, self.n_batch = n_ctx, n_seq_max, n_batch
        # its one plan holds masks of n_batch x n_ctx and (last stage) up to logit_rows(n_seq_max) rows of logits;
        # the weights are counted here only for a stage whose process loaded the model without counting them (a stage
        # host)
        parts = stage_memory_parts(model, layers, n_ctx, n_seq_max, n_batch, kv)
        self.memory_parts = parts if count_weights else parts[1:]
        require_memory(self.memory_parts, "use a smaller n_ctx or n_batch, kv_type F16, or more stages",
                       memory_limit)
        self.n_cells = cells_for(n_ctx, n_seq_max)  # n_ctx tokens in whole blocks (kv_cache.cells_for)
        self.cache = KVCache(hp, self.n_cells, kv)  # state tensors: only this stage's blocks are ever allocated
        self._mirror = cells is None
        self.cells = KVCells(self.n_cells, n_seq_max) if cells is None else cells
        self._graph: StepGraph | None = None
        self._plan: Plan | None = None
        self._copy: CopyRows | None = None
        self._copy_plan: Plan | None = None
        self.plans_prepared = 0
        self.prepare_s = 0.0
        self.compute_s = 0.0  # in the plan's compute
        self.step_s = 0.0  # in step() in all: the plan's compute, its inputs, the masks, the mirror of the cells
        self.steps = 0

    def _prepared(self) -> tuple[StepGraph, Plan]:
        if self._plan is None:
            m = self.model
            t0 = time.perf_counter()
            g = m.arch.build_step(m.hparams, m.weights, self.cache, sym("n_tok", self.n_batch),
                                  sym("n_kv", self.n_cells), n_out=sym("n_out", logit_rows(self.n_seq_max)),
                                  layers=self.layers)
            self._plan = prepare(g.logits, backends=m.backends)
            self._graph = g
            self.prepare_s += time.perf_counter() - t0
            self.plans_prepared += 1
        assert self._graph is not None
        return self._graph, self._plan

    def step(self, meta: StepMeta, x: np.ndarray) -> np.ndarray:
        """Compute one step: `x` is the token ids (first stage) or the hidden states (T, n_embd) of the stage before.
        Returns the logits of meta.out_rows (last stage) or this stage's hidden states (T, n_embd)."""
        t_step = time.perf_counter()
        g, plan = self._prepared()
        src, dst, cseq, cpos = meta.copies
        if self._mirror:  # the decoder's changes to the cells since the last step, in its order
            for s in meta.freed:
                self.cells.unlink(s)
            if meta.released.size:
                self.cells.release(meta.released)
            self.cells.see(meta.links[0], meta.links[1])
        n = meta.n_tokens
        try:
            if self._mirror:
                self.cells.occupy(dst, cseq, cpos)
            if src.size:
                self._copy_rows(src, dst)
            if self._mirror:
                self.cells.occupy(meta.cells, meta.seqs, meta.pos)
            n_kv = self.cells.n_kv
            if self.first:
                assert g.tokens is not None
                plan.set_input(g.tokens, x)
            else:
                assert g.hidden is not None
                plan.set_input(g.hidden, x)
            plan.set_input(g.pos, meta.pos)
            plan.set_input(g.kv_idx, meta.cells)
            if g.mask is not None:
                plan.set_input(g.mask, self.cells.mask(meta.seqs, meta.pos, n_kv))
            if g.mask_swa is not None:
                plan.set_input(g.mask_swa, self.cells.mask(meta.seqs, meta.pos, n_kv, g.n_swa))
            if self.last:
                assert g.out_idx is not None
                plan.set_input(g.out_idx, meta.out_rows if meta.out_rows.size else np.array([n - 1], np.int32))
            t0 = time.perf_counter()
            plan.compute(n_kv=n_kv)
            self.compute_s += time.perf_counter() - t0
            if self.last and not meta.out_rows.size:
                out = np.zeros((0, self.model.n_vocab), np.float32)
            else:
                out = plan.get_output(g.logits)
        except BaseException:
            if self._mirror:  # the step did not happen here (the decoder sends its copies again)
                self.cells.release(np.concatenate([dst, meta.cells]))
            raise
        self.steps += 1
        self.step_s += time.perf_counter() - t_step
        return out

    def _copy_rows(self, src: np.ndarray, dst: np.ndarray) -> None:
        """Copy the K and V rows of cells `src` into cells `dst` in every layer of this stage (a fork's cells), on
        a plan of its own prepared once."""
        if self._copy is None:
            n = sym("n_copy", self.n_cells)
            self._copy = copy_rows_graph(self.cache, self.layers, n)
            self._copy_plan = prepare(self._copy.outputs, backends=self.model.backends)
        plan = self._copy_plan
        plan.set_input(self._copy.src, src)
        plan.set_input(self._copy.dst, dst)
        plan.compute()

    def reset(self) -> None:
        """Forget every sequence: a new decoder starts on this stage with an empty cache."""
        if self._mirror:
            self.cells.clear()

    def recover(self) -> bool:
        """A local stage has nothing to start again after a failed step (its plan and cache are in this process)."""
        return False

    def close(self) -> None:
        for p in (self._plan, self._copy_plan):
            if p is not None:
                p.close()
        self._plan = self._copy_plan = None
