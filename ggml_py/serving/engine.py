"""Continuous batching: requests admitted, prefilled, decoded, finished and cancelled on one BatchDecoder.

A `Engine` runs the model on one worker thread (or, with `run_until_idle`, on the caller's). `submit` and
`cancel` are thread-safe and return at once; a bounded queue of waiting requests gives back-pressure
(`QueueFullError`). Each step of the worker:

1. frees the sequences of cancelled requests and admits waiting ones while a sequence slot is free; an admitted
   request starts after the whole blocks of its prompt the prefix cache holds (BatchDecoder.reuse_prefix);
2. builds one batch within the token budget `n_batch`: every decoding request's next token first, then chunks of
   the prompts being prefilled (oldest first) in what remains, so a long prompt never stalls the others' decoding;
3. runs one `BatchDecoder.decode` (one prepared plan whatever the mix) and samples, per request with its own
   sampler and seed, from the logits of the rows that need them (greedy rows take one vectorised argmax); a request
   whose prompt was just computed forks its other choices (`submit_choices`, OpenAI's n), which sample from the
   same row; prompt and token logprobs are taken from the same rows (echo, logprobs); a request
   with a grammar (`GenParams.grammar`, models/grammar.py) samples from its row with the tokens the grammar forbids
   at -inf, the masks computed on a thread of their own while the step runs;
4. streams each new token's text (UTF-8 safe deltas, `stop` strings held back until they cannot match) through the
   request's `on_event` callback, and finishes requests on EOS, `stop`, `max_tokens`, their context or a complete
   grammar.

Every sequence may use `n_ctx // n_parallel` positions (prompt + generated), so admitted requests never run out of
cells whatever the others do, and each request's tokens are those it would get alone, bit for bit on the SIMD
backend, with or without the prefix cache (docs/serving.md, "Deterministic" and "Sharing the cache").
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from ggml_py.errors import GgmlPyError, ModelError, UnavailableError
from ggml_py.models.batch import BatchDecoder, StageLike
from ggml_py.models.grammar import Constraint, GrammarError
from ggml_py.models.logprobs import TokenLogprob, token_logprobs
from ggml_py.models.sampling import Sampler
from ggml_py.serving.stop_strings import StopMatcher, check_stops

if TYPE_CHECKING:
    from ggml_py.models.model import Model

log = logging.getLogger("ggml_py.serve")


class QueueFullError(GgmlPyError):
    """Too many requests are waiting (back-pressure): try again later."""


class EngineClosedError(GgmlPyError):
    """The engine is draining or closed and takes no new requests."""


@dataclass
class GenParams:
    """What and how to generate for one request (sampling as `Sampler`; `seed` None = fresh entropy)."""

    max_tokens: int | None = 128  # None: until the end of the request's context
    temperature: float = 0.8
    top_k: int = 40
    top_p: float = 0.95
    min_p: float = 0.05
    repeat_penalty: float = 1.0
    repeat_last_n: int = 64
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    seed: int | None = None
    stop: Sequence[str] = ()
    stop_at_eos: bool = True
    logit_bias: Mapping[int, float] | None = None  # {token id: added to its logit}, before the penalties
    logprobs: int | None = None  # each generated token's logprob and this many alternatives (None: none)
    echo_logprobs: bool = False  # the prompt's tokens' logprobs too (with `logprobs` alternatives)
    # a generation that ends on an end-of-generation token reports that token's logprob last (not its text): the
    # completions API, as vLLM does (lm-eval reads a max_tokens 1 answer as the prompt and one token after it)
    eog_logprob: bool = False
    # an llguidance grammar (models/grammar.py: json_schema_grammar, lark_grammar, ...) every generated token obeys;
    # the request ends with "stop" when the grammar is complete
    grammar: str | None = None

    def sampler(self) -> Sampler:
        return Sampler(temperature=self.temperature, top_k=self.top_k, top_p=self.top_p, min_p=self.min_p,
                       repeat_penalty=self.repeat_penalty, repeat_last_n=self.repeat_last_n, seed=self.seed,
                       frequency_penalty=self.frequency_penalty, presence_penalty=self.presence_penalty,
                       logit_bias=self.logit_bias)


@dataclass
class Event:
    """What a request streams: a text delta with its token ("token"), then one "done" with the finish reason
    ("stop", "length", "cancelled" or "error")."""

    kind: str
    text: str = ""
    token: int | None = None
    logprobs: list[TokenLogprob] = field(default_factory=list)  # of the tokens since the last event (logprobs on)
    finish_reason: str | None = None
    error: str | None = None
    unavailable: bool = False  # the error was not the request's: a part of the runtime was lost (HTTP 503)


@dataclass
class Completion:
    """A finished request: its text, tokens, why it ended, and token counts."""

    id: str
    text: str
    tokens: list[int]
    finish_reason: str
    prompt_tokens: int
    error: str | None = None
    cached_tokens: int = 0  # prompt tokens not computed for it (the prefix cache's, or shared with its parent)
    logprobs: list[TokenLogprob] | None = None  # one per token (GenParams.logprobs), and the EOG's (eog_logprob)
    prompt_logprobs: list[TokenLogprob | None] | None = None  # one per prompt token, None for the first (echo)

    @property
    def completion_tokens(self) -> int:
        return len(self.tokens)


_ids = itertools.count(1)


@dataclass(frozen=True)
class _PromptLogprobs:
    """What a block of the prefix cache keeps for echo requests (Engine._keep_prompt_logprobs)."""

    n_top: int
    logprobs: tuple[TokenLogprob | None, ...]
    next_token: int


@dataclass
class _Rows:
    """The rows of a step's logits that belong to one request: `n` of them; `start` >= 0 when they are a prompt
    chunk's from that position (echo logprobs); `sample`: its next token is sampled from the last."""

    req: Request
    n: int
    start: int
    sample: bool


class Request:
    """One submitted request. Read its state only after `done` is set (or through its events)."""

    def __init__(self, prompt: Sequence[int], params: GenParams, on_event: Callable[[Event], None] | None,
                 decoder: Any, n_vocab: int | None = None) -> None:
        from ggml_py.models.stream_decoder import StreamDecoder

        self.id = f"req-{next(_ids)}"
        self.prompt = [int(t) for t in prompt]
        self.params = params
        self.sampler = params.sampler()
        self.constraint: Constraint | None = None  # its grammar's state (built here: the submitting thread's time)
        if params.grammar is not None:
            if decoder is None:
                raise GrammarError("constrained decoding needs the model's tokenizer")
            self.constraint = Constraint(decoder, params.grammar, n_vocab)
        self.on_event = on_event
        self.stream = StreamDecoder(decoder, special=False) if decoder is not None else None
        self.seq: int | None = None
        self.group = 0  # its micro-batch (Engine.n_groups)
        self.n_prefilled = 0
        self.n_cached = 0  # prompt tokens it did not compute: found in the prefix cache, or its parent's (a fork)
        self.n_annotated = 0  # its whole blocks whose prompt logprobs the prefix cache keeps (echo)
        self.limit = 0  # positions this request may use (set at admission)
        self.parent: Request | None = None  # the request whose prompt it forks from, once that one is prefilled
        self.children: list[Request] = []  # requests waiting to fork from this one (the other choices of n > 1)
        self.next_token: int | None = None  # sampled, not yet in the cache
        self.tokens: list[int] = []
        self.logprobs: list[TokenLogprob] = []  # of the generated tokens (params.logprobs set)
        self._lp_sent = 0  # of them, those an event has carried
        self.prompt_logprobs: list[TokenLogprob | None] = [None] if params.echo_logprobs else []
        self.text = ""
        self._pending = ""  # text held back while it may be the start of a stop string
        self.stops = StopMatcher(params.stop)  # built here, on the submitting thread: O(stop lengths)
        self.finish_reason: str | None = None
        self.error: str | None = None
        self.cancelled = False
        self.done = threading.Event()
        self.t_submit = time.perf_counter()
        self.t_first: float | None = None

    @property
    def greedy(self) -> bool:
        s = self.sampler
        return s.temperature == 0 and not s.logit_bias and (s.repeat_last_n == 0 or (
            s.repeat_penalty == 1.0 and s.frequency_penalty == 0.0 and s.presence_penalty == 0.0))

    def result(self, timeout: float | None = None) -> Completion:
        """Wait for the request to finish; its Completion."""
        if not self.done.wait(timeout):
            raise TimeoutError(f"request {self.id} did not finish within {timeout} s")
        lp = self.params.logprobs is not None
        return Completion(self.id, self.text, list(self.tokens), self.finish_reason or "error", len(self.prompt),
                          self.error, self.n_cached, list(self.logprobs) if lp else None,
                          list(self.prompt_logprobs) if self.params.echo_logprobs else None)

    def _emit(self, ev: Event) -> None:
        if self.logprobs:  # the tokens' logprobs travel with the first event after them
            ev.logprobs, self._lp_sent = self.logprobs[self._lp_sent:], len(self.logprobs)
        if self.on_event is not None:
            try:
                self.on_event(ev)
            except Exception:  # a consumer's bug must not stop the others' generation
                log.exception("on_event of %s raised", self.id)


class Engine:
    """Continuous batching of requests over `n_parallel` sequences of one model (see the module docstring).

    n_ctx: KV cells shared by all sequences (each may use n_ctx // n_parallel); max_queue: waiting requests beyond
    which `submit` raises QueueFullError; n_batch: tokens per step (decode tokens + prefill chunks).
    """

    def __init__(self, model: Model, n_parallel: int = 4, n_ctx: int | None = None, max_queue: int = 64,
                 n_batch: int = 128, kv_type: str | None = None, stages: Sequence[StageLike] | None = None,
                 micro_batches: int | None = None, prefix_cache: bool = True) -> None:
        if isinstance(max_queue, bool) or not isinstance(max_queue, int) or max_queue < 0:
            raise ModelError(f"max_queue must be a non-negative integer, got {max_queue!r}")
        if isinstance(n_parallel, bool) or not isinstance(n_parallel, int) or n_parallel < 1:
            raise ModelError(f"n_parallel must be a positive integer, got {n_parallel!r}")
        n_ctx = n_ctx or model.n_ctx * n_parallel
        if n_ctx < n_parallel * 2:
            raise ModelError(f"n_ctx {n_ctx} leaves fewer than 2 positions per sequence ({n_parallel} parallel)")
        n_batch = max(n_batch, n_parallel)
        self.model = model
        self.n_parallel = n_parallel
        self.n_ctx_seq = min(n_ctx // n_parallel, model.hparams.n_ctx_train)
        self.max_queue = max_queue
        # stages: e.g. a pipeline on a cluster (ggml_py/cluster/)
        self.decoder = BatchDecoder(model, n_ctx=n_ctx, n_seq_max=n_parallel, n_batch=n_batch, kv_type=kv_type,
                                    stages=stages, prefix_cache=prefix_cache)
        self.n_batch = n_batch
        # micro_batches > 1 (on a pipeline: P + 1 for P stages keeps every stage busy): the active requests are
        # split into that many groups whose steps follow each other through the stages, one step of each in flight
        # (each up to n_batch tokens). One by default: a decode step reads all weights whatever its rows, so on
        # memory-bound steps splitting gains nothing, and a cache rebuilt after a lost stage is exact only for steps
        # of as many rows as the rebuild's (issue 26; docs/cluster.md)
        if micro_batches is not None and (isinstance(micro_batches, bool) or not isinstance(micro_batches, int)
                                          or micro_batches < 1):
            raise ModelError(f"micro_batches must be a positive integer, got {micro_batches!r}")
        self.n_groups = micro_batches or 1
        self._inflight: deque[tuple[int, Any, list[Request], list[_Rows], int]] = deque()
        self._mask_pool: ThreadPoolExecutor | None = None
        self._mask_future: Future[None] | None = None
        self._tok = model.tokenizer_or_none
        self._cond = threading.Condition()
        self._queue: deque[Request] = deque()
        self._active: list[Request] = []
        self._closing = False
        self._drain = True
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        # counters (read by metrics())
        self.requests_total = 0
        self.requests_finished = 0
        self.requests_cancelled = 0
        self.requests_rejected = 0
        self.tokens_generated = 0
        self.tokens_prompt = 0  # prompt tokens computed
        self.tokens_prompt_cached = 0  # prompt tokens not computed (the prefix cache's, or a fork's parent's)
        self.requests_forked = 0
        self.t_start = time.perf_counter()
        self.busy_s = 0.0
        self._recent: deque[tuple[float, int]] = deque()  # (time, tokens generated) of recent steps

    # -- client side (any thread) ------------------------------------------------------------------------------------
    def submit(self, prompt: Sequence[int], params: GenParams | None = None,
               on_event: Callable[[Event], None] | None = None, _children: int = 0) -> Request:
        """Queue a request (prompt token ids); returns at once. Raises ModelError / SamplingError for a bad
        request, QueueFullError when `max_queue` requests are waiting, EngineClosedError when draining."""
        params = params or GenParams()
        mt = params.max_tokens
        if mt is not None and (isinstance(mt, bool) or not isinstance(mt, int) or mt < 0):
            raise ModelError(f"max_tokens must be a non-negative integer, got {mt!r}")
        check_stops(params.stop)
        ids = self.model.check_ids(prompt, n_past=0, check_ctx=False).tolist()
        if not ids:
            raise ModelError("the prompt is empty (no tokens)")
        if len(ids) >= self.n_ctx_seq:
            raise ModelError(f"the prompt has {len(ids)} tokens; a sequence holds at most {self.n_ctx_seq} "
                             f"(context {self.decoder.n_ctx} / {self.n_parallel} parallel), prompt and completion")
        req = Request(ids, params, on_event, self._tok, self.model.n_vocab)
        with self._cond:
            if self._closing:
                raise EngineClosedError("the server is shutting down")
            # a request the worker has not admitted yet into a free sequence is not waiting for one
            waiting = len(self._queue) - max(0, self.n_parallel - len(self._active))
            if waiting + _children >= self.max_queue:
                self.requests_rejected += 1
                raise QueueFullError(f"{waiting} requests are waiting (max_queue {self.max_queue})")
            self._queue.append(req)
            self.requests_total += 1
            self._cond.notify_all()
        return req

    def submit_choices(self, prompt: Sequence[int], params: Sequence[GenParams],
                       on_events: Sequence[Callable[[Event], None] | None]) -> list[Request]:
        """Several completions of one prompt (OpenAI's n), each with its own parameters (its seed): the first
        computes the prompt, the others fork from it once it has (sharing its cache cells: the prompt is computed
        once) and sample their first token from the same logits. Raises as `submit`."""
        first = self.submit(prompt, params[0], on_events[0], _children=len(params) - 1)
        for p, ev in zip(params[1:], on_events[1:]):
            child = Request(first.prompt, p, ev, self._tok, self.model.n_vocab)
            child.parent = first
            first.children.append(child)
        with self._cond:
            self.requests_total += len(first.children)
        return [first, *first.children]

    def cancel(self, req: Request) -> None:
        """Stop a request: its sequence is freed before the next step (at once when the worker is idle)."""
        with self._cond:
            if not req.done.is_set():
                req.cancelled = True
                self._cond.notify_all()

    # -- worker --------------------------------------------------------------------------------------------------------
    def start(self) -> None:
        """Run the engine on a worker thread of its own."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="ggml_py-engine", daemon=True)
            self._thread.start()

    def _loop(self) -> None:
        try:
            while True:
                with self._cond:
                    while not self._work_locked() and not self._closing:
                        self._cond.wait()
                    if self._closing and (not self._drain or not (self._queue or self._active)):
                        break
                self.step()
        except BaseException as e:  # a failed step: fail every request rather than hang them
            log.exception("the engine stopped")
            self._error = e
            with self._cond:
                self._closing = True
        finally:
            self._fail_all("the server stopped" if self._error is None else f"the server failed: {self._error}")

    def _work_locked(self) -> bool:
        return bool(self._queue or self._active or self._inflight)

    def run_until_idle(self) -> None:
        """Step on the calling thread until no request is waiting or running (offline batching)."""
        while True:
            with self._cond:
                if not self._work_locked():
                    return
            self.step()

    def step(self) -> bool:
        """One scheduling step (admit; a step for each micro-batch with none in flight; the oldest step's logits:
        sample, stream, finish); False when idle. With one micro-batch: one batched decode."""
        t0 = time.perf_counter()
        with self._cond:
            for r in [r for r in self._active if r.cancelled]:
                self._finish(r, "cancelled")
            for r in [r for r in self._queue if r.cancelled]:
                self._queue.remove(r)
                self._finish(r, "cancelled")
            while self._queue and len(self._active) < self.n_parallel and self.decoder.has_free_sequence:
                r = self._queue[0]
                # a request with choices to fork waits for a sequence for each (unless nothing else runs: then
                # those that find none when it forks run on their own)
                if self._active and self.n_parallel - len(self._active) < 1 + len(r.children):
                    break
                self._queue.popleft()
                if r.params.max_tokens == 0 and not r.params.echo_logprobs:  # nothing to compute
                    self._finish(r, "length")
                    continue
                r.seq = self.decoder.new_sequence()
                self._reuse_prefix(r)
                r.limit = self.n_ctx_seq
                sizes = [sum(q.group == g for q in self._active) for g in range(self.n_groups)]
                r.group = sizes.index(min(sizes))
                self._active.append(r)
            active = list(self._active)
            busy = {g for g, *_ in self._inflight}
        if not active and not self._inflight:
            return False
        masks = self._prepare_masks(active)  # while the step computes (llguidance releases the GIL)
        try:
            return self._step(t0, active, busy)
        finally:
            if masks is not None:
                masks.result()

    def _step(self, t0: float, active: list[Request], busy: set[int]) -> bool:
        for g in range(self.n_groups):  # a step for every micro-batch that has none in flight
            members = [r for r in active if r.group == g]
            if g in busy or not members:
                continue
            entries, outs, n_prompt = self._entries(members)
            try:
                if not entries:
                    raise ModelError("internal error: active requests but nothing to compute")
                pending = self.decoder.submit(entries)
            except BaseException as e:  # the step did not happen: its requests cannot go on
                self._fail_step(members, e)
                raise
            self._inflight.append((g, pending, members, outs, n_prompt))
        if not self._inflight:
            return False
        g, pending, members, outs, n_prompt = self._inflight.popleft()  # the oldest step's logits
        try:
            logits = pending.result()
        except BaseException as e:
            self._fail_step(members + [r for q in self._inflight for r in q[2]], e)
            self._inflight.clear()
            raise
        if self._mask_future is not None:  # the constraints' masks are ready before any of them is used
            self._mask_future.result()
        wanting, rows = self._split_rows(outs, logits)
        wanting, rows = self._fork_children(wanting, rows)
        ids = self._sample(wanting, rows)
        new = 0
        with self._cond:
            for i, (r, t) in enumerate(zip(wanting, ids)):
                if r.next_token is not None:
                    r.next_token = None
                if r.cancelled or r.done.is_set():
                    continue
                if isinstance(t, Exception):  # its sampler failed: that request ends, the others go on
                    self._fail(r, t)
                    continue
                try:
                    if r.params.max_tokens == 0:  # only the prompt's logprobs were wanted
                        self._finish(r, "length")
                        continue
                    if r.constraint is not None:
                        r.constraint.consume(t)
                    lp = r.params.logprobs
                    new += self._accept(r, t, None if lp is None else token_logprobs(rows[i], [t], lp)[0])
                except Exception as e:  # e.g. detokenizing its id: that request ends, the others go on
                    self._fail(r, e)
            self.tokens_prompt += n_prompt
            self.tokens_generated += new
            now = time.perf_counter()
            self.busy_s += now - t0
            self._recent.append((now, new))
            while self._recent and now - self._recent[0][0] > 10.0:
                self._recent.popleft()
        return True

    def _prepare_masks(self, active: list[Request]) -> Future[None] | None:
        """Start computing the next token's mask of every constrained request on the mask thread (made on first
        use: requests without a grammar pay nothing); the step's own thread waits for it before sampling."""
        self._mask_future = None
        cons = [r.constraint for r in active if r.constraint is not None]
        if not cons:
            return None
        if self._mask_pool is None:
            self._mask_pool = ThreadPoolExecutor(1, thread_name_prefix="ggml_py-grammar")

        def run() -> None:
            for c in cons:
                try:
                    c.prepare()
                except Exception:  # found again, and reported, when the request samples
                    pass

        self._mask_future = self._mask_pool.submit(run)
        return self._mask_future

    def _entries(self, members: list[Request]) -> tuple[list[tuple[int, Any, bool | str]], list[_Rows], int]:
        """One step's entries for these requests (decoding first, one token each, then prompt chunks, oldest first,
        within n_batch tokens and the decoder's n_out rows of logits), the rows of logits each request gets, and
        the step's prompt tokens."""
        entries: list[tuple[int, Any, bool | str]] = []
        outs: list[_Rows] = []
        budget, rows = self.n_batch, self.decoder.n_out
        for r in members:
            if r.next_token is not None:
                entries.append((r.seq, [r.next_token], True))
                outs.append(_Rows(r, 1, -1, True))
                budget -= 1
                rows -= 1
        n_prompt = 0
        for r in members:
            left = len(r.prompt) - r.n_prefilled
            if r.next_token is None and left > 0 and budget > 0 and rows > 0:
                echo = r.params.echo_logprobs
                k = min(left, budget, rows) if echo else min(left, budget)
                last = k == left
                entries.append((r.seq, r.prompt[r.n_prefilled:r.n_prefilled + k], "all" if echo else last))
                if echo or last:
                    outs.append(_Rows(r, k if echo else 1, r.n_prefilled if echo else -1, last))
                    rows -= k if echo else 1
                r.n_prefilled += k
                budget -= k
                n_prompt += k
        return entries, outs, n_prompt

    def _reuse_prefix(self, r: Request) -> None:
        """A new request's prompt starts where the prefix cache's whole blocks end. A request that wants its prompt's
        logprobs (echo) reuses only blocks that keep them (_keep_prompt_logprobs) for as many alternatives, whose
        last one's next token is its own."""
        usable = None
        if r.params.echo_logprobs:
            prefix, bs, want = self.decoder.prefix, self.decoder.cells.block, r.params.logprobs or 0

            def usable(digests: list[bytes]) -> int:
                assert prefix is not None
                for j, d in enumerate(digests):
                    kept = prefix.data.get(d)
                    if not (isinstance(kept, _PromptLogprobs) and kept.n_top >= want
                            and kept.next_token == r.prompt[(j + 1) * bs]):
                        return j
                return len(digests)

        r.n_prefilled = r.n_cached = self.decoder.reuse_prefix(r.seq, r.prompt, usable)
        self.tokens_prompt_cached += r.n_cached
        if r.params.echo_logprobs and r.n_cached:
            assert self.decoder.prefix is not None
            want = r.params.logprobs or 0
            for d in self.decoder.digests(r.seq):
                kept = self.decoder.prefix.data[d]
                r.prompt_logprobs += [x if x is None else TokenLogprob(x.token, x.logprob, x.top[:want])
                                      for x in kept.logprobs]
            r.n_annotated = r.n_cached // self.decoder.cells.block

    def _keep_prompt_logprobs(self, r: Request) -> None:
        """Keep the logprobs of an echo request's prompt with its whole blocks in the prefix cache: block j keeps
        those of tokens j*B+1 .. (j+1)*B (the predictions of its own B rows), and the token after it they end with,
        so that a later request with the same prompt start skips those tokens and still reports their logprobs."""
        bs = self.decoder.cells.block
        while True:
            j = r.n_annotated
            end = (j + 1) * bs + 1
            if len(r.prompt_logprobs) < end or end > len(r.prompt):
                return
            kept = _PromptLogprobs(r.params.logprobs or 0, tuple(r.prompt_logprobs[end - bs:end]), r.prompt[end - 1])
            self.decoder.annotate(r.seq, j, kept)
            r.n_annotated += 1

    def _fork_children(self, wanting: list[Request], rows: np.ndarray) -> tuple[list[Request], np.ndarray]:
        """Requests whose prompt was just computed fork their waiting choices, which sample from the same row."""
        if not any(r.children for r in wanting):
            return wanting, rows
        out, take = [], []
        with self._cond:
            for i, r in enumerate(wanting):
                out.append(r)
                take.append(i)
                if not r.children or r.tokens or r.done.is_set():
                    continue
                for child in r.children:
                    if len(self._active) < self.n_parallel and self.decoder.has_free_sequence:
                        child.seq = self.decoder.fork(r.seq)
                        child.n_prefilled = child.n_cached = len(r.prompt)
                        child.prompt_logprobs = list(r.prompt_logprobs)
                        child.limit, child.group = r.limit, r.group
                        self._active.append(child)
                        self.tokens_prompt_cached += child.n_cached
                        self.requests_forked += 1
                        out.append(child)
                        take.append(i)
                    else:  # no sequence for it now: it runs on its own (and finds the prompt's whole blocks cached)
                        child.parent = None
                        self._queue.appendleft(child)
                r.children = []
        return out, rows[np.asarray(take, np.int64)]

    def _split_rows(self, outs: list[_Rows], logits: np.ndarray) -> tuple[list[Request], np.ndarray]:
        """A step's rows of logits: the prompt tokens' logprobs recorded (echo), and the requests that sample a
        token with the row each samples from."""
        wanting, take = [], []
        at = 0
        for o in outs:
            r = o.req
            if o.start >= 0:  # a prompt chunk's rows: row i is the distribution of the prompt's token start + i + 1
                n_lp = min(o.n, len(r.prompt) - 1 - o.start)
                if n_lp > 0:
                    targets = np.asarray(r.prompt[o.start + 1:o.start + 1 + n_lp])
                    r.prompt_logprobs += token_logprobs(logits[at:at + n_lp], targets, r.params.logprobs or 0)
                    self._keep_prompt_logprobs(r)
            if o.sample:
                wanting.append(r)
                take.append(at + o.n - 1)
            at += o.n
        return wanting, logits[np.asarray(take, np.int64)]

    def _fail_step(self, reqs: list[Request], e: BaseException) -> None:
        with self._cond:
            for r in reqs:
                self._finish(r, "error", f"{type(e).__name__}: {e}", unavailable=isinstance(e, UnavailableError))

    def _sample(self, reqs: list[Request], logits: np.ndarray) -> list[int | Exception]:
        """Each request's next token, or the exception its sampler raised (that request alone fails)."""
        out: list[int | Exception] = [0] * len(reqs)
        greedy = [i for i, r in enumerate(reqs) if r.greedy and r.constraint is None]
        if greedy:
            best = logits[greedy].argmax(axis=1)
            for i, t in zip(greedy, best.tolist()):
                out[i] = int(t)
        for i, r in enumerate(reqs):
            if r.greedy and r.constraint is None:
                continue
            try:
                # a constrained request samples from its row with the tokens its grammar forbids at -inf
                x = logits[i] if r.constraint is None else r.constraint.apply(logits[i])
                out[i] = int(np.argmax(x)) if r.greedy else int(r.sampler.sample(x, r.prompt + r.tokens))
            except Exception as e:
                out[i] = e
        return out

    def _fail(self, r: Request, e: Exception) -> None:
        """End r alone with an error (under the lock): one log line, its message in its response."""
        msg = f"{type(e).__name__}: {e}"
        log.warning("request %s failed: %s", r.id, msg)
        self._finish(r, "error", msg)

    def _accept(self, r: Request, t: int, lp: TokenLogprob | None = None) -> int:
        """A sampled token for r (under the lock), with its logprob if r wants them: stream it, finish r if it ends
        here; 1 if the token counts."""
        p = r.params
        if r.t_first is None:
            r.t_first = time.perf_counter()
        if p.stop_at_eos and self._tok is not None and self._tok.is_eog(t):
            if lp is not None and p.eog_logprob:
                r.logprobs.append(lp)  # carried by the "done" event
            self._finish(r, "stop")
            return 0
        r.tokens.append(t)
        if lp is not None:
            r.logprobs.append(lp)
        delta = r.stream.push(t) if r.stream is not None else ""
        pos_next = len(r.prompt) + len(r.tokens)  # the position this token will take in the cache
        complete = r.constraint is not None and r.constraint.done  # its grammar takes no more tokens
        ends = complete or (p.max_tokens is not None and len(r.tokens) >= p.max_tokens) or pos_next >= r.limit
        if ends and r.stream is not None:
            delta += r.stream.flush()
        if self._text(r, delta, final=ends) or complete:
            self._finish(r, "stop")
        elif ends:
            self._finish(r, "length")
        else:
            r.next_token = t
        return 1

    def _text(self, r: Request, delta: str, final: bool) -> bool:
        """Add text to r and stream what is safe; True when a stop string was found (text cut before it). Linear in
        the text whatever the stop strings' lengths (stop_strings.py)."""
        if r.stops:
            start, held = r.stops.feed(delta)
            buf = r._pending + delta
            cut = len(buf) - (0 if final else held) if start is None else len(buf) + start
            out, r._pending = buf[:cut], ("" if start is not None else buf[cut:])
        else:
            start, out = None, delta
        if out:
            r.text += out
            r._emit(Event("token", out, r.tokens[-1]))
        return start is not None

    def _finish(self, r: Request, reason: str, error: str | None = None, unavailable: bool = False) -> None:
        """End r (under the lock): free its sequence, record, emit "done"."""
        if r.done.is_set():
            return
        for child in reversed(r.children):  # choices that never forked run on their own
            child.parent = None
            self._queue.appendleft(child)
        r.children = []
        if r.seq is not None:
            if r in self._active:
                self._active.remove(r)
            try:
                self.decoder.free_sequence(r.seq)
            except GgmlPyError:
                pass
            r.seq = None
        if r._pending and reason != "cancelled":
            r.text += r._pending
            r._emit(Event("token", r._pending, r.tokens[-1] if r.tokens else None))
            r._pending = ""
        r.finish_reason = reason
        r.error = error
        if reason == "cancelled":
            self.requests_cancelled += 1
        else:
            self.requests_finished += 1
        r.done.set()
        r._emit(Event("done", finish_reason=reason, error=error, unavailable=unavailable))

    def _fail_all(self, why: str) -> None:
        with self._cond:
            left = list(self._active) + list(self._queue)
            self._queue.clear()
            while left:
                r = left.pop(0)
                left += r.children  # choices that never forked end with it
                r.children = []
                self._finish(r, "error", why, unavailable=isinstance(self._error, UnavailableError))

    # -- state -------------------------------------------------------------------------------------------------------
    def metrics(self) -> dict[str, Any]:
        """Counters and gauges: queue length, active sequences, tokens, tok/s (last 10 s and overall busy time),
        plans prepared."""
        with self._cond:
            now = time.perf_counter()
            recent = list(self._recent)
            span = now - recent[0][0] if len(recent) > 1 else 0.0
            return {
                "queue_length": len(self._queue), "active_sequences": len(self._active),
                "n_parallel": self.n_parallel, "n_ctx": self.decoder.n_ctx, "n_ctx_per_sequence": self.n_ctx_seq,
                "requests_total": self.requests_total, "requests_finished": self.requests_finished,
                "requests_cancelled": self.requests_cancelled, "requests_rejected": self.requests_rejected,
                "tokens_generated": self.tokens_generated, "tokens_prompt": self.tokens_prompt,
                "tokens_prompt_cached": self.tokens_prompt_cached, "requests_forked": self.requests_forked,
                "prefix_cache_hit_rate": self.tokens_prompt_cached / max(1, self.tokens_prompt_cached
                                                                         + self.tokens_prompt),
                "kv_cells_cached": self.decoder.cells.n_cached,
                "tokens_per_second": sum(n for _, n in recent[1:]) / span if span > 0 else 0.0,
                "tokens_per_busy_second": self.tokens_generated / self.busy_s if self.busy_s else 0.0,
                "kv_cells_used": self.decoder.cells.n_held, "kv_cells_out_of_order": self.decoder.cells.out_of_order,
                "steps": self.decoder.steps,
                "plans_prepared": self.decoder.plans_prepared, "uptime_s": now - self.t_start,
            }

    def abort(self) -> None:
        """Stop taking requests and stop the worker after its current step; the requests still waiting or running
        end with an error ("the server stopped"). Returns at once; thread-safe."""
        with self._cond:
            self._closing = True
            self._drain = False
            self._cond.notify_all()

    def close(self, drain: bool = True, timeout: float | None = None) -> None:
        """Stop taking requests; with `drain` finish the waiting and running ones first (for at most `timeout`
        seconds, then `abort`), else fail them. Then stop the worker and free the decoder."""
        with self._cond:
            self._closing = True
            self._drain = self._drain and drain  # an abort is never undone
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join(timeout)
            if self._thread.is_alive():  # the drain ran out of time: what is left ends with an error
                self.abort()
                self._thread.join()  # at most the step under way
        elif drain:
            self.run_until_idle()
        self._fail_all("the server stopped")
        if self._mask_pool is not None:
            self._mask_pool.shutdown()
        self.decoder.close()

    @property
    def error(self) -> BaseException | None:
        return self._error


__all__ = ["Completion", "Event", "GenParams", "QueueFullError", "Request", "Engine", "EngineClosedError"]
