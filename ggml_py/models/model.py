"""A loaded language model: the KV cache, the prepared plans, and eval / generate on top of them.

Graph reuse (the point of ggml_py): a forward step over T new tokens is built, scheduled, allocated and lowered once
per T and kept; the position, the cache rows to write, the mask and the KV length (`n_kv`, a symbolic dimension)
are inputs. The decode loop therefore computes one prepared plan for every position, and a prompt is evaluated in
batches of power-of-two sizes (at most `MAX_BATCH`), each size prepared once. With `graph_reuse=False` every step
builds and prepares its graph from scratch (with a concrete KV length), as llama.cpp does, for comparison.
"""

from __future__ import annotations

import logging
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np

from ggml_py.errors import ModelError, PlanError
from ggml_py.ir import dtypes
from ggml_py.ir.graph import Graph
from ggml_py.ir.schema import VIEW_OPS
from ggml_py.ir.symbolic import sym
from ggml_py.ir.tensor import PARAM
from ggml_py.models.architecture import Architecture
from ggml_py.models.blocks import TOP_CANDIDATES, StepGraph
from ggml_py.models.hparams import HParams
from ggml_py.models.kv_cache import KVCache
from ggml_py.models.memory import require_memory, step_buffer_bytes
from ggml_py.models.weights import Weights
from ggml_py.runtime.placement import place_static
from ggml_py.runtime.plan import Plan, prepare
from ggml_py.runtime.schedule import root

log = logging.getLogger("ggml_py.models")

MAX_BATCH = 128  # largest prompt batch; prompts are cut into power-of-two batches up to this size


class Token(NamedTuple):
    """One generated token: its id and the text it completes (may be "" while a UTF-8 character is incomplete)."""

    id: int
    text: str


@dataclass
class _Prepared:
    graph: StepGraph
    plan: Plan
    # a one-token plan's inputs and outputs as arrays over its memory (Plan.input_array / output_array), its causal
    # mask zeroed once (a one-token step sees every cached row): a decode step writes two integers and copies its
    # outputs with no per-call checks. False when they are not in host memory; None until the first step.
    one_token: _OneTokenIO | bool | None = None


class _OneTokenIO(NamedTuple):
    tokens: np.ndarray
    pos: np.ndarray
    kv_idx: np.ndarray
    logits: np.ndarray
    top_ids: np.ndarray | None
    top_logits: np.ndarray | None


def batch_sizes(n: int, max_batch: int = MAX_BATCH) -> list[int]:
    """Cut n tokens into batches: as many `max_batch` as fit, then the binary decomposition of the rest.

    Every size is a power of two (for a power-of-two `max_batch`), so a handful of prepared plans serve every prompt.
    """
    out = [max_batch] * (n // max_batch)
    rest = n % max_batch
    bit = 1 << max(rest.bit_length() - 1, 0)
    while rest:
        if rest & bit:
            out.append(bit)
            rest -= bit
        bit >>= 1
    return out


class _Progress:
    """A minimal progress bar on stderr (only shown when weights are copied)."""

    def __init__(self, total: int, label: str) -> None:
        self.total, self.label, self.done, self.last = max(total, 1), label, 0, -1

    def add(self, n: int) -> None:
        self.done += n
        pct = int(100 * self.done / self.total)
        if pct != self.last:
            self.last = pct
            bar = "#" * (pct // 4)
            sys.stderr.write(f"\r{self.label} [{bar:<25}] {pct:3d}%")
            if pct >= 100:
                sys.stderr.write("\n")
            sys.stderr.flush()


class Model:
    """A GGUF language model ready to run. Create it with `ggml_py.load_model`."""

    def __init__(self, gguf: Any, arch: Architecture, hparams: HParams, weights: Weights, backends: list[Any],
                 n_ctx: int, kv_type: dtypes.DType, graph_reuse: bool = True, tokenizer: Any = None,
                 tokenizer_error: Exception | None = None, progress: bool = True, check_memory: bool = True) -> None:
        self.gguf = gguf
        self.path: str = gguf.path
        self.metadata: dict[str, Any] = gguf.metadata
        self.architecture: str = arch.name
        self.arch = arch
        self.hparams = hparams
        self.weights = weights
        self.backends = backends
        self.n_ctx = n_ctx
        self.n_vocab = hparams.n_vocab
        self.graph_reuse = graph_reuse
        if tokenizer is not None and tokenizer.n_vocab != hparams.n_vocab:
            # as llama.cpp (check_tensor_dims): more rows than tokens would let sampling pick ids nothing can
            # decode, fewer would leave tokens without an embedding
            raise ModelError(f"{self.path}: the tokenizer has {tokenizer.n_vocab} tokens but 'token_embd.weight' has "
                             f"{hparams.n_vocab} rows; they must be equal")
        copy_weights = self._must_copy_weights()
        self._require_memory(kv_type, copy_weights, check_memory)
        self.cache = KVCache(hparams, n_ctx, kv_type)
        self._tokenizer = tokenizer
        self._tokenizer_error = tokenizer_error
        self._n_kv_sym = sym("n_kv", n_ctx)
        self._plans: dict[tuple[int, bool], _Prepared] = {}
        self.n_past = 0  # cache rows in use (= position of the next token)
        self.plans_prepared = 0
        self.plans_reused = 0
        self.prepare_s = 0.0
        self._zeros = np.zeros((1, n_ctx), np.float32)
        self._closed = False
        # One lock serialises every call that touches the cache or the plans (eval, each generate step, reset,
        # close); `_owner` is the generate iterator the cache belongs to, so an overtaken iterator raises.
        self._lock = threading.RLock()
        self._owner: object | None = None
        self._decoders: list[Any] = []  # batch decoders and embedders on this model (closed with it)
        self._embedder: Any = None  # the Embedder of `embed`, made on first use
        self._profiling = False  # start_profiling(): every step plan, also those prepared later, is timed
        self.weights_copied = copy_weights
        self._check_file()
        if copy_weights:
            self._copy_weights(progress)
        self.reset_timings()

    # -- set-up --------------------------------------------------------------------------------------------------
    def _must_copy_weights(self) -> bool:
        """Weights are wrapped zero-copy by the first plan where the preferred backend can wrap host memory; where it
        cannot, they are copied into its memory at load (the scheduler then runs their ops there)."""
        bt = self.backends[0].default_buffer_type
        return not (bt.is_host and bt.buffer_from_host(np.zeros(64, np.uint8)) is not None)

    def _require_memory(self, kv_type: dtypes.DType, copy_weights: bool, check: bool = True) -> None:
        """Refuse, before allocating anything, a model whose weights (read every token, so they must all be
        resident), the preferred backend's caches of them, a host copy of them, the KV cache and the compute buffers
        of its step plans exceed MemAvailable. The parts are kept in `memory_parts`."""
        hp, b = self.hparams, self.backends[0]
        ws = self.weights.all()
        size = sum(t.nbytes for t in ws)
        parts = [("weights mapped from the file", size), (f"{b.name}'s weight caches", b.weight_cache_bytes(ws))]
        if copy_weights and b.default_buffer_type.is_host:
            parts.append((f"weights copied into {b.name}", size))
        parts.append((f"KV cache ({hp.n_layer} layers x {self.n_ctx} positions, {kv_type})",
                      KVCache.nbytes_for(hp, self.n_ctx, kv_type)))
        # generate() prepares, once each, a plan per prompt batch size (MAX_BATCH, ..., 2; the head on the last row)
        # and the one-token plan; each holds masks of n_tokens x n_ctx. Without graph reuse one plan lives at a time.
        sizes = [n for n in batch_sizes(2 * MAX_BATCH - 1) if n <= self.n_ctx]
        bufs = [step_buffer_bytes(hp, n, self.n_ctx, 1) for n in sizes]
        parts.append((f"compute buffers ({len(sizes)} step plans, attention masks of {sum(sizes)} x {self.n_ctx})"
                      if self.graph_reuse else "compute buffer (one step plan at a time)",
                      sum(bufs) if self.graph_reuse else max(bufs)))
        self.memory_parts: list[tuple[str, int]] = parts
        f16 = "kv_type F16, " if kv_type is not dtypes.F16 else ""
        if check:
            require_memory(parts, f"use a smaller n_ctx, {f16}another backend or a smaller model")

    def _copy_weights(self, progress: bool) -> None:
        """Copy the weights into the preferred backend's memory, once, with a progress bar: those of the nodes it
        computes in a one-token step (a device claiming a few ops gets only their weights; any other weight a plan
        needs there is placed when the plan is prepared)."""
        b = self.backends[0]
        bt = b.default_buffer_type
        g = self.arch.build_step(self.hparams, self.weights, self.cache, 1, self._n_kv_sym, last_only=False)
        used = {id(root(s)) for n in Graph(g.outputs()).nodes if n.op not in VIEW_OPS and b.supports_op(n)
                for s in n.src if s is not None and root(s).flags & PARAM}
        ws = [t for t in self.weights.all() if t.flags & PARAM and id(t) in used]
        bar = _Progress(sum(t.nbytes for t in ws), f"loading weights into {self.backends[0].name}") \
            if progress else None
        for t in ws:
            place_static(t, bt)
            if bar:
                bar.add(t.nbytes)

    def _check_open(self) -> None:
        if self._closed:
            raise ModelError(f"{self.path}: the model is closed")

    def _check_file(self) -> None:
        """A weights file that shrank on disk would kill the process with SIGBUS at the first read of a page past
        its new end: refuse to run instead (one fstat; weights copied into a backend no longer read the file)."""
        if not self.weights_copied:
            self.gguf.check_size()

    @property
    def tokenizer(self) -> Any:
        self._check_open()
        if self._tokenizer is None:
            raise ModelError(f"{self.path}: no usable tokenizer: {self._tokenizer_error}")
        return self._tokenizer

    @property
    def tokenizer_or_none(self) -> Any:
        """The tokenizer, or None for a model without a usable one (token ids in and out only)."""
        return self._tokenizer

    @property
    def backend_names(self) -> list[str]:
        return [b.name for b in self.backends]

    # -- tokens --------------------------------------------------------------------------------------------------
    def tokenize(self, text: str, add_special: bool = True, parse_special: bool = True) -> list[int]:
        """Token ids of `text`: BOS/EOS added as the model asks when `add_special`, control tokens parsed when
        `parse_special`."""
        return self.tokenizer.encode(text, add_special=add_special, parse_special=parse_special)

    def detokenize(self, ids: Sequence[int], special: bool = True) -> str:
        return self.tokenizer.decode(self.check_ids(ids, check_ctx=False).tolist(), special=special)

    def apply_chat_template(self, messages: Sequence[dict[str, Any]], add_generation_prompt: bool = True) -> str:
        return self.tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt)

    # -- evaluation ------------------------------------------------------------------------------------------------
    def reset(self) -> None:
        """Forget the cached tokens: the next eval starts at position 0 (cache rows are overwritten, not cleared).
        A generate iterator running on this model is overtaken (its next step raises ModelError)."""
        with self._lock:
            self._check_open()
            self._owner = None
            self.n_past = 0

    def reset_timings(self) -> None:
        self._t = {"prefill_tokens": 0, "prefill_s": 0.0, "prefill_compute_s": 0.0, "prefill_prepare_s": 0.0,
                   "decode_tokens": 0, "decode_s": 0.0, "decode_compute_s": 0.0, "decode_prepare_s": 0.0,
                   "sample_s": 0.0, "generate_s": 0.0, "generated_tokens": 0}

    def check_ids(self, ids: Any, n_past: int | None = None, check_ctx: bool = True) -> np.ndarray:
        """`ids` as an int32 array, refused with ModelError when they are not token ids of this model or (with
        `check_ctx`) do not fit its context after `n_past` positions."""
        self._check_open()
        if isinstance(ids, str | bytes):
            raise ModelError("token ids must be a sequence of integers, got a string (use tokenize)")
        arr = np.asarray(ids)
        if arr.ndim != 1 or (arr.size and not np.issubdtype(arr.dtype, np.integer)):
            raise ModelError(f"token ids must be a 1-D sequence of integers, got {arr.dtype} of shape {arr.shape}")
        if arr.size and (arr.min() < 0 or arr.max() >= self.n_vocab):
            bad = int(arr[(arr < 0) | (arr >= self.n_vocab)][0])
            raise ModelError(f"token id {bad} is out of range [0, {self.n_vocab})")
        n_past = self.n_past if n_past is None else n_past
        if check_ctx and n_past + arr.size > self.n_ctx:
            raise ModelError(f"{arr.size} tokens after {n_past} cached ones exceed the context of "
                             f"{self.n_ctx} tokens (n_ctx)")
        return arr.astype(np.int32)

    def eval(self, ids: Sequence[int] | np.ndarray, last_only: bool = False) -> np.ndarray:
        """Append tokens to the KV cache and return their logits, (n_tokens, n_vocab) float32.

        With `last_only`, only the last token's logits are computed and returned, (1, n_vocab): the output head
        then runs on one row (what a prompt needs before generation).
        """
        with self._lock:
            arr = self.check_ids(ids)
            if arr.size == 0:
                return np.zeros((0, self.n_vocab), np.float32)
            self._check_file()
            self._owner = None  # the cache moves on: a running generate iterator is overtaken
            return self._forward(arr, last_only=last_only, kind="prefill" if arr.size > 1 else "decode")

    def _forward(self, ids: np.ndarray, last_only: bool, kind: str, read: str = "logits") -> Any:
        """Steps over `ids` in batches; the logits of every row, or of the last only (`last_only`); with
        read="top" (last_only) the last row's candidates (ids, logits) instead of its logits."""
        t0 = time.perf_counter()
        prepare0 = self.prepare_s
        compute = 0.0
        outs = []
        sizes = batch_sizes(ids.size)
        start = 0
        for i, n in enumerate(sizes):
            # when only the last row matters, every batch computes the head for its last row alone
            wanted = not last_only or i == len(sizes) - 1
            out, c = self._step(ids[start:start + n], last=last_only, read=read if wanted else None)
            compute += c
            if wanted:
                outs.append(out)
            start += n
        out = outs[0] if len(outs) == 1 else np.concatenate(outs, axis=0)
        dt = time.perf_counter() - t0
        self._t[f"{kind}_tokens"] += int(ids.size)
        self._t[f"{kind}_s"] += dt
        self._t[f"{kind}_compute_s"] += compute
        self._t[f"{kind}_prepare_s"] += self.prepare_s - prepare0  # plans prepared during these steps
        return out

    def _get(self, n: int, last: bool, n_kv: int) -> tuple[_Prepared, bool]:
        key = (n, last and n > 1)
        if self.graph_reuse:
            p = self._plans.get(key)
            if p is not None:
                self.plans_reused += 1
                return p, False
        t0 = time.perf_counter()
        g = self.arch.build_step(self.hparams, self.weights, self.cache, n,
                                 self._n_kv_sym if self.graph_reuse else n_kv, last_only=key[1])
        p = _Prepared(g, prepare(g.outputs(), backends=self.backends))
        self.prepare_s += time.perf_counter() - t0
        self.plans_prepared += 1
        if self.graph_reuse:
            self._plans[key] = p
            if self._profiling:
                p.plan.start_profiling()
        return p, True

    def _step(self, ids: np.ndarray, last: bool, read: str | None = "logits") -> tuple[Any, float]:
        """One forward step over len(ids) tokens at positions n_past..: write inputs, compute, read the logits (or,
        read="top", the step's candidates (ids, logits); None: nothing)."""
        n = ids.size
        p0 = self.n_past
        n_kv = p0 + n
        prep, _ = self._get(n, last, n_kv)
        g, plan = prep.graph, prep.plan
        try:
            io = self._one_token_io(prep) if n == 1 and self.graph_reuse else False
            if io:
                io.tokens[0] = ids[0]
                io.pos[0] = io.kv_idx[0] = p0
                if g.mask_swa is not None:  # a sliding window's mask changes with the position
                    for mask, values in g.masks(np.array([p0]), n_kv, self._zeros):
                        if mask is g.mask_swa:
                            plan.set_input(mask, values)
            else:
                pos = np.arange(p0, n_kv, dtype=np.int32)
                plan.set_input(g.tokens, ids)
                plan.set_input(g.pos, pos)
                plan.set_input(g.kv_idx, pos)  # cache row = position (one sequence)
                for mask, values in g.masks(pos, n_kv, self._zeros):  # causal, and sliding-window if any slides
                    plan.set_input(mask, values)
            t0 = time.perf_counter()
            if self.graph_reuse:
                plan.compute(n_kv=n_kv)
            else:
                plan.compute()
            compute = time.perf_counter() - t0
            if io and read == "top" and io.top_ids is not None:
                logits: Any = (io.top_ids.copy(), io.top_logits.copy())
            elif io and read:
                logits = io.logits.copy()
            elif read == "top":
                logits = (plan.get_output(g.top_ids), plan.get_output(g.top_logits))
            else:
                logits = plan.get_output(g.logits) if read else None
        finally:
            if prep is not self._plans.get((n, last and n > 1)):  # a throw-away plan (graph_reuse=False)
                plan.close()
        self.n_past = n_kv
        return logits, compute

    def _one_token_io(self, prep: _Prepared) -> _OneTokenIO | bool:
        if prep.one_token is None:
            g, plan = prep.graph, prep.plan
            try:
                out = [None if t is None else plan.output_array(t) for t in (g.logits, g.top_ids, g.top_logits)]
                io = _OneTokenIO(*(plan.input_array(t) for t in (g.tokens, g.pos, g.kv_idx)), *out)
                if g.mask is not None:
                    plan.input_array(g.mask, n_kv=self.n_ctx)[...] = 0.0
            except PlanError:
                prep.one_token = False
            else:
                prep.one_token = io
        return prep.one_token

    # -- generation ------------------------------------------------------------------------------------------------
    def generate(self, prompt: str | Sequence[int], max_tokens: int = 128, *, temperature: float = 0.8,
                 top_k: int = 40, top_p: float = 0.95, min_p: float = 0.05, repeat_penalty: float = 1.0,
                 repeat_last_n: int = 64, seed: int | None = None, stop_at_eos: bool = True,
                 add_special: bool = True, json_schema: dict[str, Any] | bool | None = None,
                 grammar: str | None = None) -> Iterator[Token]:
        """Tokens generated after `prompt` (text or ids), as an iterator of `Token(id, text)`.

        The cache is reset first: the prompt starts at position 0. temperature 0 is greedy. Generation ends after
        `max_tokens`, at an end-of-generation token when `stop_at_eos` (not yielded), or when the context is full.
        `json_schema` (a JSON schema; True: any JSON object) or `grammar` (a Lark grammar, llguidance's dialect)
        constrain every token (models/grammar.py, needs `ggml_py[structured]`); generation then also ends when the
        grammar is complete. Bad arguments, a grammar that does not compile and a prompt longer than the context
        raise at once (ModelError / ValueError).
        """
        from ggml_py.models.sampling import Sampler

        if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 0:
            raise ModelError(f"max_tokens must be a non-negative integer, got {max_tokens!r}")
        ids = self.tokenize(prompt, add_special=add_special) if isinstance(prompt, str) else prompt
        arr = self.check_ids(ids, check_ctx=False)
        if not arr.size:
            raise ModelError("the prompt is empty (no tokens)")
        if arr.size > self.n_ctx:
            raise ModelError(f"the prompt has {arr.size} tokens, more than the context of {self.n_ctx} (n_ctx)")
        sampler = Sampler(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p,
                          repeat_penalty=repeat_penalty, repeat_last_n=repeat_last_n, seed=seed)
        constraint = None
        if json_schema is not None or grammar is not None:
            from ggml_py.models.grammar import Constraint, GrammarError, json_schema_grammar, lark_grammar

            if json_schema is not None and grammar is not None:
                raise GrammarError("give json_schema or grammar, not both")
            g = lark_grammar(grammar) if grammar is not None else json_schema_grammar(
                None if json_schema is True else json_schema)
            constraint = Constraint(self.tokenizer, g, self.n_vocab)
        self.prompt_tokens = arr.tolist()
        return self._generate(arr, max_tokens, sampler, stop_at_eos, constraint)

    def _step_as(self, owner: object) -> None:
        """Checks before each step of a generate iterator (called under the lock)."""
        self._check_open()
        if self._owner is not owner:
            raise ModelError("this generate() iterator was overtaken by another call on the model (generate, eval "
                             "or reset) and cannot continue on a cache that is no longer its own; start a new one")
        self._check_file()

    def _generate(self, ids: np.ndarray, max_tokens: int, sampler: Any, stop_at_eos: bool,
                  constraint: Any = None) -> Iterator[Token]:
        from ggml_py.models.stream_decoder import StreamDecoder

        owner = object()
        with self._lock:  # the cache is reset, and the iterator takes it over, when iteration starts
            self._check_open()
            self._owner = owner
            self.n_past = 0
            self.reset_timings()
        t_start = time.perf_counter()
        tok = self._tokenizer
        decoder = StreamDecoder(tok, special=False) if tok is not None else None
        history = [int(i) for i in ids]
        self.generated_tokens: list[int] = []
        try:
            if max_tokens == 0:
                return
            # a sampler that looks at the best few tokens only reads the step's candidates, not the whole logits
            top = constraint is None and sampler.needs_only_top(min(TOP_CANDIDATES, self.n_vocab))
            read = "top" if top else "logits"
            with self._lock:
                self._step_as(owner)
                logits = self._forward(ids, last_only=True, kind="prefill", read=read)
            for i in range(max_tokens):
                t0 = time.perf_counter()
                if read == "top":
                    t = int(sampler.sample_candidates(*logits))
                elif constraint is not None:  # the tokens the grammar forbids at -inf
                    t = int(sampler.sample(constraint.apply(logits[-1]), history))
                    constraint.consume(t)
                else:
                    t = int(sampler.sample(logits[-1], history))
                self._t["sample_s"] += time.perf_counter() - t0
                if stop_at_eos and tok is not None and tok.is_eog(t):
                    break
                history.append(t)
                self.generated_tokens.append(t)
                self._t["generated_tokens"] += 1
                text = decoder.push(t) if decoder is not None else ""
                if i == max_tokens - 1 or self.n_past >= self.n_ctx or (constraint is not None and constraint.done):
                    if decoder is not None:
                        text += decoder.flush()
                    yield Token(t, text)
                    break
                yield Token(t, text)
                with self._lock:
                    self._step_as(owner)
                    logits = self._forward(np.array([t], np.int32), last_only=True, kind="decode", read=read)
        finally:
            self._t["generate_s"] += time.perf_counter() - t_start

    # -- embeddings ------------------------------------------------------------------------------------------------
    def embed(self, inputs: Any, normalize: bool = True, pooling: str | None = None) -> np.ndarray:
        """(n_inputs, n_embd) float32: one vector per input (a text or a list of token ids; or a list of these),
        the final hidden states after the output norm pooled as the file's `{arch}.pooling_type` says (mean when
        absent; `pooling` "mean", "cls" or "last" overrides it), L2-normalized when `normalize`. Runs on one plan
        prepared on the first call (embed.py `Embedder`, with this model's n_ctx as the longest input); a list of
        inputs is computed side by side. The model's own cache and generate iterators are not touched."""
        from ggml_py.models.embed import Embedder

        with self._lock:
            self._check_open()
            if self._embedder is None or self._embedder._closed:
                self._embedder = Embedder(self)
            emb = self._embedder
        return emb.embed(inputs, normalize=normalize, pooling=pooling)

    # -- many sequences: a BatchDecoder (batch.py) attaches itself, and is closed with the model ------------------
    def _attach(self, dec: Any) -> None:
        with self._lock:
            self._check_open()
            self._decoders.append(dec)

    def _detach(self, dec: Any) -> None:
        with self._lock:
            if dec in self._decoders:
                self._decoders.remove(dec)

    # -- reports ---------------------------------------------------------------------------------------------------
    @property
    def timings(self) -> dict[str, Any]:
        """Since the last generate / reset_timings: tokens, seconds, tok/s of prefill and decode, and
        host_overhead_frac = share of a prepared decode step's time spent outside plan.compute (inputs, outputs,
        Python). decode_s is wall time and includes any plan prepared during the steps (decode_prepare_s: with graph
        reuse only the first decode step's; without, every step's), which the overhead leaves out."""
        t = dict(self._t)
        t["prefill_tok_s"] = t["prefill_tokens"] / t["prefill_s"] if t["prefill_s"] else 0.0
        t["decode_tok_s"] = t["decode_tokens"] / t["decode_s"] if t["decode_s"] else 0.0
        for kind, key in (("decode", "host_overhead_frac"), ("prefill", "prefill_host_overhead_frac")):
            prepared_step_s = t[f"{kind}_s"] - t[f"{kind}_prepare_s"]
            t[key] = 1.0 - t[f"{kind}_compute_s"] / prepared_step_s if prepared_step_s > 0 else 0.0
        # the whole loop as a user sees it: decode steps + sampling + detokenization
        t["generate_tok_s"] = t["generated_tokens"] / t["generate_s"] if t["generate_s"] else 0.0
        t["plans_prepared"] = self.plans_prepared
        t["plans_reused"] = self.plans_reused
        t["prepare_s"] = self.prepare_s
        return t

    def info(self) -> dict[str, Any]:
        hp = self.hparams
        return {"path": self.path, "architecture": self.architecture, "n_ctx": self.n_ctx,
                "n_ctx_train": hp.n_ctx_train, "n_vocab": hp.n_vocab, "n_embd": hp.n_embd, "n_layer": hp.n_layer,
                "n_head": hp.n_head, "n_head_kv": hp.n_head_kv, "n_ff": hp.n_ff, "kv_type": self.cache.dtype.name,
                "kv_cache_bytes": self.cache.nbytes, "backends": self.backend_names, "graph_reuse": self.graph_reuse,
                "tied_output": self.weights.tied, "weights_copied": self.weights_copied,
                "plans": self._plan_summaries()}

    def start_profiling(self) -> None:
        """Time every step from now on (ggml-py generate --profile): per step plan, the time per backend, per
        split and per op, as Plan.profile_report() gives it; profile_report() reads it."""
        with self._lock:
            self._profiling = True
            for p in self._plans.values():
                p.plan.start_profiling()

    def profile_report(self) -> list[dict[str, Any]]:
        """Per step plan computed since start_profiling() (tokens per step, last_only): its profile_report() and
        how its nodes are split between backends (`nodes`: backend -> op -> count)."""
        with self._lock:
            if not self._profiling:
                raise ModelError("profile_report() without start_profiling()")
            summaries = {(d["tokens"], d["last_only"]): d for d in self._plan_summaries()}
            reports = [(key, p.plan.profile_report()) for key, p in sorted(self._plans.items())]
            return [{**summaries[key], **r} for key, r in reports if r["computes"]]

    def _plan_summaries(self) -> list[dict[str, Any]]:
        """Each prepared plan (one per step shape): its tokens per step, splits, and how many nodes of each op every
        backend runs (the node assignment, e.g. to see which ops a plugin left to numpy)."""
        out = []
        for (n, last), prep in sorted(self._plans.items()):
            by_backend: dict[str, dict[str, int]] = {}
            for a in prep.plan.assignment():
                ops = by_backend.setdefault(a["backend"], {})
                ops[a["op"]] = ops.get(a["op"], 0) + 1
            out.append({"tokens": n, "last_only": last, "splits": len(prep.plan.runs), "nodes": by_backend,
                        "warnings": list(prep.plan.warnings)})
        return out

    def close(self) -> None:
        """Free the plans; every later call raises ModelError (a generate running in another thread stops at its
        next step). Waits for a step in progress."""
        with self._lock:
            self._closed = True
            self._owner = None
            for p in self._plans.values():
                p.plan.close()
            self._plans.clear()
            for d in list(self._decoders):
                d.close()
            self.gguf.close()

    def __enter__(self) -> Model:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return (f"<Model {self.architecture} {self.hparams.n_layer} layers, n_ctx {self.n_ctx}, "
                f"backends {','.join(self.backend_names)}>")
