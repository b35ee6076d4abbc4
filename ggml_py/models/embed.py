"""Embeddings: one vector per input, from a model's final hidden states after the output norm (before the head),
pooled per input as the GGUF says and L2-normalized; computed on ONE prepared plan, as the batched decoder's steps.

An `Embedder` owns a small KV cache of its own (`KVCells`: cell -> (sequence, position)) and one plan: the model's
step graph (blocks.py `build_step`) built with `embd=True` (it ends at the output norm) and three symbolic
dimensions, the step's tokens `n_tok` (bound `n_batch`), the cells attention reads `n_kv` and the rows it outputs
`n_out` (bound `n_batch`). A list of inputs runs as separate sequences side by side, in steps of at most `n_batch`
tokens (an input longer than that in chunks over several steps, its earlier chunks' keys and values kept in its
cells), the mask keeping the sequences apart; an input's cells are freed once its last token has been computed,
and the next input takes its place. Inputs longer than the embedder's context (`n_ctx` tokens) are refused.

Pooling (`{arch}.pooling_type`, llama.cpp's `enum llama_pooling_type` in llama.h: NONE 0, MEAN 1, CLS 2, LAST 3,
RANK 4; absent: MEAN, as `llama-embedding --pooling mean` on a causal LM): MEAN averages the input's rows, CLS takes
its first token's row, LAST its last token's. llama.cpp pools in the graph (MEAN as a product with a matrix of
1/n_tokens); here the rows come out of the plan and are pooled on the host, over the input's own rows alone, in an
order that depends on nothing else: so an input's vector is the same bit for bit whatever it is batched with (its
rows are: docs/serving.md, "Deterministic"), which a float32 product over the whole step's rows (or float32 sums
per step) could not promise.
NONE (one vector per token) and RANK (a classification head) are not supported.

Thread safety: one `embed` at a time per embedder (its sequences hold cells across steps), and each step takes the
model's lock, so embeddings interleave step by step with a BatchDecoder or a server engine on the same model.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from ggml_py.errors import ModelError
from ggml_py.ir import dtypes
from ggml_py.ir.symbolic import sym
from ggml_py.models.blocks import StepGraph
from ggml_py.models.kv_cache import KVCache, KVCells, cells_for
from ggml_py.models.memory import require_memory, step_buffer_bytes
from ggml_py.runtime.plan import prepare

if TYPE_CHECKING:
    from ggml_py.models.model import Model
    from ggml_py.runtime.plan import Plan

# llama.cpp's enum llama_pooling_type (include/llama.h); UNSPECIFIED (-1) is never written to a file
POOLING_TYPES = {0: "none", 1: "mean", 2: "cls", 3: "last", 4: "rank"}
SUPPORTED_POOLING = ("mean", "cls", "last")
DEFAULT_N_BATCH = 128  # tokens per step at most (the plan's bound on n_tok and n_out)
DEFAULT_N_SEQ_MAX = 16  # inputs side by side in one step at most


class EmbeddingCancelled(ModelError):
    """An embed call stopped between two steps because its `stop` event was set (its client went away)."""

# what `embed` takes: a text, token ids, or a list of either
EmbedInput = str | Sequence[int] | np.ndarray
EmbedInputs = EmbedInput | Sequence[EmbedInput]


def file_pooling(model: Model) -> str:
    """The pooling the model's GGUF asks for (`{arch}.pooling_type`), by name; "mean" when the key is absent.
    ModelError for a value that is not one of llama.cpp's."""
    arch = model.metadata.get("general.architecture", model.architecture)
    key = f"{arch}.pooling_type"
    v = model.metadata.get(key)
    if v is None:
        return "mean"
    if isinstance(v, bool) or not isinstance(v, int | np.integer) or int(v) not in POOLING_TYPES:
        raise ModelError(f"{model.path}: {key} must be one of llama.cpp's pooling types "
                         f"({', '.join(f'{k} {n.upper()}' for k, n in POOLING_TYPES.items())}), got {v!r}")
    return POOLING_TYPES[int(v)]


def _is_ids(x: Any) -> bool:
    """Whether x is one input of token ids (a 1-D integer array, or a non-empty sequence of integers)."""
    if isinstance(x, np.ndarray):
        return x.ndim == 1 and (x.size == 0 or np.issubdtype(x.dtype, np.integer))
    return (isinstance(x, Sequence) and not isinstance(x, str | bytes) and len(x) > 0
            and all(isinstance(t, int | np.integer) and not isinstance(t, bool) for t in x))


def split_inputs(inputs: Any) -> list[Any]:
    """`inputs` as a list of single inputs (each a text or token ids): a text or one list of token ids is one
    input, a list of texts and/or lists of ids is many."""
    if isinstance(inputs, str) or _is_ids(inputs):
        return [inputs]
    if isinstance(inputs, np.ndarray) and inputs.ndim == 2:
        return list(inputs)
    if isinstance(inputs, Sequence) and not isinstance(inputs, bytes):
        return list(inputs)
    raise ModelError(f"embed takes a text, a list of token ids, or a list of these; got {type(inputs).__name__}")


def l2_normalize(v: np.ndarray) -> np.ndarray:
    """Rows of v divided by their Euclidean norm (in float64; a zero row stays zero), as float32."""
    v64 = v.astype(np.float64)
    norm = np.sqrt(np.einsum("ij,ij->i", v64, v64))[:, None]
    return np.where(norm > 0, v64 / np.where(norm > 0, norm, 1.0), v64).astype(np.float32)


class Embedder:
    """Embeddings of a model's inputs on one prepared plan (see the module docstring).

    >>> emb = Embedder(model)                        # Model.embed makes one on first use
    >>> v = emb.embed(["a text", "another", [1, 2, 3]])   # (3, n_embd) float32, each row of norm 1

    n_ctx: tokens an input may have (and the cache's capacity; default the model's n_ctx); n_seq_max: inputs in one
    step at most; n_batch: tokens per step at most. The KV cache and the compute buffer are allocated when the plan
    is first prepared (first `embed`), and checked against the available memory when the embedder is made.
    """

    def __init__(self, model: Model, n_ctx: int | None = None, n_seq_max: int = DEFAULT_N_SEQ_MAX,
                 n_batch: int = DEFAULT_N_BATCH, kv_type: str | dtypes.DType | None = None) -> None:
        n_ctx = model.n_ctx if n_ctx is None else n_ctx
        for name, v in (("n_ctx", n_ctx), ("n_seq_max", n_seq_max), ("n_batch", n_batch)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ModelError(f"{name} must be a positive integer, got {v!r}")
        hp = model.hparams
        kv = model.cache.dtype if kv_type is None else dtypes.get(kv_type)
        self.model = model
        self.n_ctx = min(n_ctx, hp.n_ctx_train)  # positions the model was never trained on make no useful vectors
        self.n_seq_max = n_seq_max
        self.n_batch = n_batch
        self.n_embd = hp.n_embd
        self.pooling = file_pooling(model)
        self.n_cells = cells_for(self.n_ctx, n_seq_max)  # whole blocks for every sequence (kv_cache.cells_for)
        self.memory_parts = [
            (f"embeddings' KV cache ({self.n_cells} cells, {kv})", KVCache.nbytes_for(hp, self.n_cells, kv)),
            (f"embeddings' compute buffer (attention masks of {n_batch} x {self.n_cells})",
             step_buffer_bytes(hp, n_batch, self.n_cells, 0) + 4 * n_batch * hp.n_embd)]
        require_memory(self.memory_parts, "use a smaller n_ctx or n_batch for embeddings, or kv_type F16")
        self.cache = KVCache(hp, self.n_cells, kv)
        self.cells = KVCells(self.n_cells, n_seq_max, capacity=self.n_ctx)
        self._calls = threading.Lock()  # one embed at a time: its sequences hold cells from step to step
        self._graph: StepGraph | None = None
        self._plan: Plan | None = None
        self._closed = False
        self.plans_prepared = 0
        self.prepare_s = 0.0
        self.compute_s = 0.0
        self.steps = 0
        self.tokens = 0
        self.inputs = 0
        model._attach(self)  # closed with the model

    # -- inputs ------------------------------------------------------------------------------------------------------
    def resolve_pooling(self, pooling: str | None = None) -> str:
        """The pooling an embed call uses: `pooling` if given, else the file's; ModelError if it is unsupported."""
        mode = self.pooling if pooling is None else pooling
        if mode not in SUPPORTED_POOLING:
            why = ("one vector per token" if mode == "none" else "a reranker's classification head"
                   if mode == "rank" else "unknown")
            raise ModelError(f"pooling {mode!r} ({why}) is not supported; supported: "
                             f"{', '.join(SUPPORTED_POOLING)} (pass pooling=... to override the file's)")
        return mode

    def token_inputs(self, inputs: EmbedInputs) -> list[np.ndarray]:
        """Each input as int32 token ids (texts tokenized as the model asks: BOS/EOS added, control tokens
        parsed), checked: ModelError for an input without tokens, an id outside the vocabulary, or more tokens
        than `n_ctx`."""
        m = self.model
        out = []
        for i, x in enumerate(split_inputs(inputs)):
            if isinstance(x, str):
                ids = m.check_ids(m.tokenize(x), check_ctx=False)
            elif _is_ids(x) or (isinstance(x, Sequence) and not isinstance(x, bytes) and len(x) == 0):
                ids = m.check_ids(x, check_ctx=False)
            else:
                raise ModelError(f"input {i} is a {type(x).__name__}; an input is a text or a list of token ids")
            if ids.size == 0:
                raise ModelError(f"input {i} is empty (no tokens)")
            if ids.size > self.n_ctx:
                raise ModelError(f"input {i} has {ids.size} tokens, more than the {self.n_ctx} an embedding input "
                                 "may have (n_ctx)")
            out.append(ids)
        return out

    # -- embedding ---------------------------------------------------------------------------------------------------
    def embed(self, inputs: EmbedInputs, normalize: bool = True, pooling: str | None = None) -> np.ndarray:
        """(n_inputs, n_embd) float32: one vector per input (a text, or a list of token ids; or a list of these),
        pooled as the file says (or `pooling`: "mean", "cls", "last"), L2-normalized when `normalize`."""
        mode = self.resolve_pooling(pooling)
        return self._embed(self.token_inputs(inputs), normalize, mode)

    def embed_ids(self, ids: Sequence[Sequence[int] | np.ndarray], normalize: bool = True,
                  pooling: str | None = None, stop: threading.Event | None = None) -> np.ndarray:
        """embed() of inputs that are token ids (e.g. `token_inputs`'s: checked again, a few comparisons each).
        `stop`: set from another thread, the call raises EmbeddingCancelled before its next step."""
        mode = self.resolve_pooling(pooling)
        if any(isinstance(x, str) for x in ids):
            raise ModelError("embed_ids takes lists of token ids; embed takes texts")
        return self._embed(self.token_inputs(list(ids)), normalize, mode, stop)

    def _embed(self, ids: list[np.ndarray], normalize: bool, mode: str,
               stop: threading.Event | None = None) -> np.ndarray:
        if not ids:
            return np.zeros((0, self.n_embd), np.float32)
        with self._calls:
            try:
                vecs = self._run(ids, mode, stop)
            finally:
                self.cells.clear()  # the cache holds nothing between calls, also after a failed step
        return l2_normalize(vecs) if normalize else vecs

    def _run(self, ids: list[np.ndarray], mode: str, stop: threading.Event | None = None) -> np.ndarray:
        """Every input through the plan: admitted in order while a sequence is free and the cache can hold its
        whole input, each step the next chunk of every admitted input (in admission order) up to n_batch tokens,
        an input pooled and its cells freed once its last token is computed."""
        n = len(ids)
        lens = [int(a.size) for a in ids]
        out = np.zeros((n, self.n_embd), np.float32)
        # input -> MEAN: the sum of its rows so far, float64 (exact for float32 rows unless their exponents span
        # more than ~29 bits), added one row at a time in position order, so the same whatever chunks they came in
        # even then; CLS, LAST: its one row
        acc: dict[int, np.ndarray] = {}
        done = [0] * n  # tokens computed per input
        seq_of: dict[int, int] = {}
        free = list(range(self.n_seq_max))
        pending = deque(range(n))
        active: list[int] = []
        reserved = 0  # tokens the admitted inputs will hold in the cache when complete
        while pending or active:
            if stop is not None and stop.is_set():
                raise EmbeddingCancelled(f"the embedding of {n} inputs was cancelled")
            while pending and len(active) < self.n_seq_max and reserved + lens[pending[0]] <= self.n_ctx:
                i = pending.popleft()
                active.append(i)
                seq_of[i] = free.pop(0)
                reserved += lens[i]
                acc[i] = np.zeros(self.n_embd, np.float64 if mode == "mean" else np.float32)
            budget = self.n_batch
            parts = []  # (input, first position, tokens) of this step
            for i in active:
                if not budget:
                    break
                k = min(lens[i] - done[i], budget)
                parts.append((i, done[i], k))
                budget -= k
            toks = np.concatenate([ids[i][a:a + k] for i, a, k in parts])
            seqs = np.concatenate([np.full(k, seq_of[i], np.int32) for i, a, k in parts])
            pos = np.concatenate([np.arange(a, a + k, dtype=np.int32) for i, a, k in parts])
            starts = np.cumsum([0] + [k for _, _, k in parts])
            # the rows each input needs from this step: MEAN all of its own, CLS its first token's, LAST its last's
            want: list[tuple[int, int, int]] = []  # (input, its first row in the step, rows)
            for (i, a, k), r in zip(parts, starts):
                if mode == "mean":
                    want.append((i, int(r), k))
                elif mode == "cls" and a == 0:
                    want.append((i, int(r), 1))
                elif mode == "last" and a + k == lens[i]:
                    want.append((i, int(r) + k - 1, 1))
            out_rows = np.concatenate([np.arange(r, r + c, dtype=np.int32) for _, r, c in want]) if want \
                else np.zeros(0, np.int32)
            h = self._step(toks, seqs, pos, out_rows)
            o = 0
            for i, _, c in want:
                if mode == "mean":  # add.accumulate sums sequentially: the last row is acc + x0 + x1 + ...
                    acc[i] = np.add.accumulate(np.vstack([acc[i][None], h[o:o + c]]), axis=0, dtype=np.float64)[-1]
                else:
                    acc[i] = h[o]
                o += c
            for i, a, k in parts:
                done[i] = a + k
            for i in [i for i in active if done[i] == lens[i]]:
                # pooled over the input's own rows alone, in one fixed order: independent of its company
                out[i] = acc.pop(i) / lens[i] if mode == "mean" else acc.pop(i)
                self.cells.free(seq_of[i])
                free.append(seq_of.pop(i))
                free.sort()
                reserved -= lens[i]
                active.remove(i)
        self.inputs += n
        return out

    def _prepared(self) -> tuple[StepGraph, Plan]:
        if self._plan is None:
            m = self.model
            t0 = time.perf_counter()
            g = m.arch.build_step(m.hparams, m.weights, self.cache, sym("n_tok", self.n_batch),
                                  sym("n_kv", self.n_cells), n_out=sym("n_out", self.n_batch), embd=True)
            self._plan = prepare(g.logits, backends=m.backends)
            self._graph = g
            self.prepare_s += time.perf_counter() - t0
            self.plans_prepared += 1
        assert self._graph is not None
        return self._graph, self._plan

    def _step(self, toks: np.ndarray, seqs: np.ndarray, pos: np.ndarray, out_rows: np.ndarray) -> np.ndarray:
        """One step under the model's lock: the tokens written to new cells, the hidden rows `out_rows` read
        (n_out, n_embd); none read when out_rows is empty."""
        m = self.model
        with m._lock:
            m._check_open()
            if self._closed:
                raise ModelError("this embedder is closed")
            m._check_file()
            g, plan = self._prepared()
            cells = self.cells.alloc(seqs, pos)
            n_kv = self.cells.n_kv
            plan.set_input(g.tokens, toks)
            plan.set_input(g.pos, pos)
            plan.set_input(g.kv_idx, cells)
            if g.mask is not None:
                plan.set_input(g.mask, self.cells.mask(seqs, pos, n_kv))
            if g.mask_swa is not None:
                plan.set_input(g.mask_swa, self.cells.mask(seqs, pos, n_kv, g.n_swa))
            assert g.out_idx is not None
            # a step that needs no row (a long input's middle chunk under CLS or LAST) still outputs one
            plan.set_input(g.out_idx, out_rows if out_rows.size else np.array([toks.size - 1], np.int32))
            t0 = time.perf_counter()
            plan.compute(n_kv=n_kv)
            self.compute_s += time.perf_counter() - t0
            self.steps += 1
            self.tokens += int(toks.size)
            return plan.get_output(g.logits) if out_rows.size else np.zeros((0, self.n_embd), np.float32)

    # -- reports and life ----------------------------------------------------------------------------------------
    def stats(self) -> dict[str, Any]:
        return {"n_ctx": self.n_ctx, "n_seq_max": self.n_seq_max, "n_batch": self.n_batch, "pooling": self.pooling,
                "inputs": self.inputs, "steps": self.steps, "tokens": self.tokens, "compute_s": self.compute_s,
                "plans_prepared": self.plans_prepared, "prepare_s": self.prepare_s}

    def close(self) -> None:
        """Free the plan (the model's close() closes its embedders too). Takes only the model's lock, never the
        embed calls' (a call waiting for the model's lock would otherwise wait for this one, and this for it): a
        call in progress fails at its next step."""
        with self.model._lock:
            self._closed = True
            if self._plan is not None:
                self._plan.close()
                self._plan = None
            self.model._detach(self)

    def __enter__(self) -> Embedder:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
