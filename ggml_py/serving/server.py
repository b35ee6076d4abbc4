"""An OpenAI-compatible HTTP server over the continuous-batching Engine, on starlette + uvicorn
(`pip install "ggml_py[server]"`; `ggml-py serve`, docs/serving.md). Its parts: request_params.py (a body into
GenParams), access.py (Host/Origin, API key, JSON-only routes), connections.py (head timeouts, the connection cap),
http_common.py (errors, limits, log lines).

    POST /v1/completions, /v1/chat/completions     (JSON, or server-sent events with "stream": true)
    POST /v1/embeddings                            (the model's pooled hidden states: models/embed.py)
    GET  /v1/models, /health, /metrics             (/metrics: Prometheus text; ?format=json for JSON)
    GET  /                                         a chat page over the chat API (chat_page.py)

The model runs on the engine's one worker thread; the event loop only moves bytes and events. Everything that costs
time in proportion to a request (parsing its JSON, rendering the chat template, tokenizing, submitting) runs in a
thread of starlette's pool, so `/health` answers while a big prompt is tokenized. Request handlers then wait on their
request's events (handed from the worker to the event loop with call_soon_threadsafe).

Answers: bad JSON or parameters 400 with an OpenAI-style error body; a body over `max_body_bytes` 413 (before it is
read); a full queue 503 with Retry-After; a client that goes away (mid-stream or while waiting) cancels its request,
which frees its sequence before the next step. The limits and the access policy (`ServeOptions`, docs/serving.md
"Limits and security"): bodies, prompts, request heads that do not arrive, connections, the drain on shutdown, an API
key, JSON-only API routes, Host and Origin checks. Shutdown (Ctrl-C / SIGTERM): uvicorn stops accepting connections
and the open requests finish for at most `drain_timeout` seconds; then what is left is cancelled. A second signal
stops at once.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import functools
import json
import math
import os
import signal
import socket
import threading
import time
import uuid
from collections import deque
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import ClientDisconnect
from starlette.requests import Request as HTTPRequest
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route

from ggml_py.errors import GgmlPyError, ModelError
from ggml_py.models.batch import StageLike
from ggml_py.models.embed import Embedder, EmbeddingCancelled
from ggml_py.models.grammar import GrammarError, compile_grammar
from ggml_py.models.logprobs import TokenLogprob
from ggml_py.models.stage import Stage
from ggml_py.serving.access import ApiGuard, HostOriginGuard
from ggml_py.serving.chat_page import ChatPage
from ggml_py.serving.connections import LISTEN_BACKLOG, ConnectionGuard, fit_connections, guarded_h11_protocol
from ggml_py.serving.engine import Engine, EngineClosedError, Event, QueueFullError, Request
from ggml_py.serving.http_common import (
    MAX_HEADER_BYTES,
    POLL_DISCONNECT_S,
    RETRY_AFTER_S,
    BadRequest,
    error_response,
    log,
    notes,
    require_server_extra,
)
from ggml_py.serving.openai_format import chat_logprobs, completion_logprobs, usage
from ggml_py.serving.options import ServeOptions
from ggml_py.serving.request_params import (
    chat_messages,
    echo,
    embedding_format,
    embedding_inputs,
    gen_params,
    max_token_bytes,
    n_choices,
    parse_json,
)
from ggml_py.serving.tool_calls import ToolPlan, parse_answer, render_history, response_so_far, tool_plan

MAX_PROMPTS = 64  # prompts in one /v1/completions request
MAX_CHOICES = 64  # completions in one request (prompts x n)


class _BodyRefused(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


class _Inbox:
    """The events of a request's choices (choice index, event), put by the worker thread (through the loop) and
    taken by its handler."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.items: deque[tuple[int, Event]] = deque()
        self.ready = asyncio.Event()

    def put(self, i: int, ev: Event) -> None:  # the worker thread
        self.loop.call_soon_threadsafe(self._put, (i, ev))

    def _put(self, item: tuple[int, Event]) -> None:
        self.items.append(item)
        self.ready.set()

    async def get(self, timeout: float) -> tuple[int, Event] | None:
        """The next event, or None after `timeout` seconds without one."""
        if not self.items:
            self.ready.clear()
            try:
                await asyncio.wait_for(self.ready.wait(), timeout)  # losing a wait() result loses nothing
            except asyncio.TimeoutError:
                pass
        return self.items.popleft() if self.items else None


@dataclass
class _Job:
    """One HTTP request's choices: a request to the engine per prompt and per `n`, in choice order."""

    chat: bool
    stream: bool
    include_usage: bool
    echo: bool  # completions: the prompt before each completion
    prompts: list[tuple[list[int], str | None]]  # token ids, and the text given (None: given as ids)
    logprobs: int | None
    tools: ToolPlan | None = None  # chat: the answers are tool calls or text in the generic format (tool_calls.py)
    reqs: list[Request] = field(default_factory=list)
    prompt_of: list[int] = field(default_factory=list)  # each choice's prompt

    def prompt_ids(self, i: int) -> list[int]:
        return self.prompts[self.prompt_of[i]][0]

    def echo_text(self, i: int) -> str:
        """Choice i's prompt as text (completions with echo or logprobs: _admit detokenized the token prompts)."""
        text = self.prompts[self.prompt_of[i]][1]
        assert text is not None
        return text

    def usage(self) -> dict[str, Any]:
        """Each prompt counted once (and the tokens of it found in the prefix cache), every choice's completion
        tokens."""
        done = [r.result(0) for r in self.reqs]
        first = [c for i, c in enumerate(done) if i == 0 or self.prompt_of[i] != self.prompt_of[i - 1]]
        return usage(sum(len(ids) for ids, _ in self.prompts), sum(c.completion_tokens for c in done),
                     sum(c.cached_tokens for c in first))


def _is_id(t: Any) -> bool:
    return isinstance(t, int) and not isinstance(t, bool)


class Server:
    """The ASGI app (`.app`) around a model and its engine."""

    def __init__(self, model: Any, engine: Engine, model_name: str | None = None,
                 default_max_tokens: int | None = None, options: ServeOptions | None = None,
                 host: str = "127.0.0.1") -> None:
        require_server_extra()
        self.model = model
        self.engine = engine
        self.options = options = options or ServeOptions()
        self.model_name = model_name or os.path.splitext(os.path.basename(model.path))[0]
        self.default_max_tokens = default_max_tokens
        self.created = int(time.time())
        tok = model.tokenizer_or_none
        self.max_prompt_chars = options.max_prompt_chars or (
            engine.n_ctx_seq * max_token_bytes(tok) if tok is not None else None)
        self.loop: asyncio.AbstractEventLoop | None = None
        self.connections: Callable[[], list[Any]] = list  # the open connections' protocols (serve() sets it)
        self.drain_deadline: float | None = None  # time.monotonic() by which the requests are cut on shutdown
        self.cut_reason: str | None = None  # why the requests left were cut, if they were
        self._drain_timer: asyncio.TimerHandle | None = None
        # embeddings run on an Embedder of their own (its KV cache and plan made on the first request), with
        # inputs as long as a sequence's context and steps as large as the engine's, so that a step of either holds
        # the model's lock for as long; only where the model's blocks run in this process (not on a pipeline)
        self._embedder: Embedder | None = None
        self._embedder_lock = threading.Lock()
        self.embeddings_local = all(isinstance(st, Stage) for st in engine.decoder.stages)
        middleware = [Middleware(HostOriginGuard, bound_host=host, allowed_hosts=options.allowed_hosts,
                                 cors_origins=options.cors_origins)]
        if options.cors_origins:
            middleware.append(Middleware(CORSMiddleware, allow_origins=list(options.cors_origins),
                                         allow_methods=["GET", "POST"],
                                         allow_headers=["Authorization", "Content-Type"]))
        middleware.append(Middleware(ApiGuard, api_key=options.api_key))
        self.app = Starlette(routes=[
            Route("/", ChatPage().respond, methods=["GET"]),
            Route("/health", self.health, methods=["GET"]),
            Route("/v1/models", self.models, methods=["GET"]),
            Route("/metrics", self.metrics, methods=["GET"]),
            Route("/v1/completions", self.completions, methods=["POST"]),
            Route("/v1/chat/completions", self.chat_completions, methods=["POST"]),
            Route("/tokenize", self.tokenize, methods=["POST"]),
            Route("/detokenize", self.detokenize, methods=["POST"]),
            Route("/tokenizer_info", self.tokenizer_info, methods=["GET"]),
            Route("/v1/embeddings", self.embeddings, methods=["POST"]),
        ], middleware=middleware, lifespan=self._lifespan)

    @contextlib.asynccontextmanager
    async def _lifespan(self, app: Any) -> AsyncIterator[None]:
        self.loop = loop = asyncio.get_running_loop()
        loop.set_exception_handler(_loop_exception_handler)
        yield
        # uvicorn has waited for the open connections: drain what is left (within the drain's deadline) and stop
        left = self.options.drain_timeout if self.drain_deadline is None else self.drain_deadline - time.monotonic()
        await loop.run_in_executor(None, functools.partial(self.engine.close, timeout=max(0.0, left)))

    # -- shutdown --------------------------------------------------------------------------------------------------
    def begin_drain(self) -> None:
        """The first Ctrl-C / SIGTERM (any thread, a signal handler): the open requests get `drain_timeout` seconds,
        then `cut`."""
        if self.drain_deadline is not None:
            return
        self.drain_deadline = time.monotonic() + self.options.drain_timeout
        if self.loop is not None:
            self.loop.call_soon_threadsafe(self._arm_drain_timer)

    def _arm_drain_timer(self) -> None:
        assert self.loop is not None
        self._drain_timer = self.loop.call_later(
            self.options.drain_timeout, self.cut, f"the drain timeout ({self.options.drain_timeout:g} s) has passed")

    def cut(self, why: str) -> None:
        """End everything now (on the loop's thread): the engine stops after its step and fails what is left, and
        every connection is closed (handlers waiting for a body or blocked on a client that does not read return)."""
        if self._drain_timer is not None:
            self._drain_timer.cancel()
            self._drain_timer = None
        self.cut_reason = self.cut_reason or why
        m = self.engine.metrics()
        conns = self.connections()
        n_req = m["active_sequences"] + m["queue_length"]
        if n_req or conns:
            log.warning("ggml-py serve: %s: cancelling %d requests, closing %d connections", why, n_req, len(conns))
        self.engine.abort()
        for c in conns:
            transport = getattr(c, "transport", None)
            if transport is not None and not transport.is_closing():
                transport.close()

    # -- endpoints -------------------------------------------------------------------------------------------------
    async def health(self, request: HTTPRequest) -> Response:
        if self.engine.error is not None:
            return JSONResponse({"status": "error", "error": str(self.engine.error)}, status_code=500)
        return JSONResponse({"status": "ok"})

    async def models(self, request: HTTPRequest) -> Response:
        return JSONResponse({"object": "list", "data": [
            {"id": self.model_name, "object": "model", "created": self.created, "owned_by": "ggml_py",
             "meta": {"architecture": self.model.architecture, "n_ctx": self.engine.decoder.n_ctx,
                      "n_parallel": self.engine.n_parallel, "n_vocab": self.model.n_vocab}}]})

    async def metrics(self, request: HTTPRequest) -> Response:
        m = self.engine.metrics()
        if request.query_params.get("format") == "json":
            return JSONResponse(m)
        lines = []
        counters = ("requests_", "tokens_generated", "tokens_prompt", "steps")
        for k, v in m.items():
            lines.append(f"# TYPE ggml_py_{k} {'counter' if k.startswith(counters) else 'gauge'}")
            lines.append(f"ggml_py_{k} {float(v)}")
        return PlainTextResponse("\n".join(lines) + "\n", media_type="text/plain; version=0.0.4")

    # -- the tokenizer (vLLM's routes and shapes; llama-server's field names accepted too) -----------------------
    async def _json_body(self, request: HTTPRequest) -> dict[str, Any] | Response:
        try:
            return parse_json(await self._read_body(request))
        except _BodyRefused as e:
            return error_response(e.status, str(e), "invalid_request_error", headers={"Connection": "close"})
        except BadRequest as e:
            return error_response(400, str(e), "invalid_request_error", e.param)
        except ClientDisconnect:
            return Response(status_code=499)

    async def tokenize(self, request: HTTPRequest) -> Response:
        """{"prompt": text, "add_special_tokens": bool (default true)} (or llama-server's "content", "add_special")
        -> {"tokens": [...], "count": n, "max_model_len": a sequence's context}."""
        body = await self._json_body(request)
        if isinstance(body, Response):
            return body
        text = body.get("prompt", body.get("content"))
        special = body.get("add_special_tokens", body.get("add_special", True))
        if not isinstance(text, str) or not isinstance(special, bool):
            return error_response(400, "tokenize takes a string \"prompt\" and a boolean \"add_special_tokens\"",
                                  "invalid_request_error", "prompt")
        ids = await run_in_threadpool(self.model.tokenize, text, special)
        return JSONResponse({"tokens": ids, "count": len(ids), "max_model_len": self.engine.n_ctx_seq})

    async def detokenize(self, request: HTTPRequest) -> Response:
        """{"tokens": [...]} -> {"prompt": text} (and llama-server's "content")."""
        body = await self._json_body(request)
        if isinstance(body, Response):
            return body
        ids = body.get("tokens")
        if not isinstance(ids, list) or not all(_is_id(t) and 0 <= t < self.model.n_vocab for t in ids):
            return error_response(400, f"detokenize takes \"tokens\": a list of token ids in [0, "
                                  f"{self.model.n_vocab})", "invalid_request_error", "tokens")
        text = await run_in_threadpool(self.model.detokenize, ids)
        return JSONResponse({"prompt": text, "content": text})

    async def tokenizer_info(self, request: HTTPRequest) -> Response:
        """The special tokens and the chat template (what a client needs to tokenize as the server does)."""
        tok = self.model.tokenizer_or_none
        if tok is None:
            return error_response(404, "this model has no tokenizer", "invalid_request_error")

        def name(i: int | None) -> str | None:
            return None if i is None else tok.token_to_piece(i, True).decode("utf-8", errors="replace")

        return JSONResponse({"tokenizer_class": "ggml_py", "bos_token": name(tok.bos_id),
                             "eos_token": name(tok.eot_id if tok.eot_id is not None else tok.eos_id),
                             "pad_token": name(tok.pad_id), "add_bos_token": tok.add_bos,
                             "chat_template": tok.chat_template, "model_max_length": self.engine.n_ctx_seq,
                             "vocab_size": tok.n_vocab})

    # -- generation endpoints --------------------------------------------------------------------------------------
    async def completions(self, request: HTTPRequest) -> Response:
        return await self._generate(request, chat=False)

    async def chat_completions(self, request: HTTPRequest) -> Response:
        return await self._generate(request, chat=True)

    def _check_chars(self, n: int, what: str, param: str) -> None:
        cap = self.max_prompt_chars
        if cap is not None and n > cap:
            raise BadRequest(f"{what} has {n} characters; a sequence's context ({self.engine.n_ctx_seq} tokens) "
                             f"holds at most {cap}", param)

    def _prompts(self, body: dict[str, Any], chat: bool, tools: ToolPlan | None = None
                 ) -> list[tuple[list[int], str | None]]:
        """The prompts' token ids, each with its text when it was given as text (a pool thread: rendering and
        tokenizing take time in proportion to the text). Completions take a string, a list of token ids, or a
        list of either (each its own prompt)."""
        m = self.model
        if chat:
            msgs = render_history(chat_messages(body), tools)
            self._check_chars(sum(len(x["content"]) for x in msgs), "the messages' content", "messages")
            try:
                text = m.apply_chat_template(msgs, add_generation_prompt=True)
            except GgmlPyError as e:
                raise BadRequest(f"the chat template failed: {e}", "messages") from None
            bos = m.tokenizer.bos_token
            return [(m.tokenize(text, add_special=not (bos and text.startswith(bos))), text)]
        p = body.get("prompt")
        if isinstance(p, str) or (isinstance(p, list) and p and all(_is_id(t) for t in p)):
            p = [p]
        if not isinstance(p, list) or not p or len(p) > MAX_PROMPTS:
            raise BadRequest(f"prompt must be a string, a list of token ids, or a list of 1 to {MAX_PROMPTS} of "
                             "either", "prompt")
        out: list[tuple[list[int], str | None]] = []
        for i, q in enumerate(p):
            if isinstance(q, str):
                self._check_chars(len(q), "the prompt" if len(p) == 1 else f"prompt[{i}]", "prompt")
                out.append((m.tokenize(q), q))
            elif isinstance(q, list) and q and all(_is_id(t) for t in q):
                out.append(([int(t) for t in q], None))
            else:
                raise BadRequest(f"prompt[{i}] must be a string or a non-empty list of token ids", "prompt")
        return out

    def _admit(self, raw: bytes, chat: bool, put: Callable[[int, Event], None]) -> _Job:
        """Parse, validate, tokenize and submit every choice (a pool thread). A choice that cannot be submitted
        cancels those that were."""
        body = parse_json(raw)
        stream = False if body.get("stream") is None else body["stream"]  # null: unset, as OpenAI's
        if not isinstance(stream, bool):
            raise BadRequest("stream must be a boolean", "stream")
        so = body.get("stream_options") or {}
        include_usage = bool(isinstance(so, dict) and so.get("include_usage"))
        params = gen_params(body, self.default_max_tokens if chat else (self.default_max_tokens or 16),
                            self.model.n_vocab, chat=chat)
        n = n_choices(body)
        tools = tool_plan(body) if chat else None
        if tools is not None:
            if params.grammar is not None:
                raise BadRequest("tools and response_format (or grammar) cannot both constrain the answer: send one, "
                                 "or tool_choice \"none\"", "tools")
            params = replace(params, grammar=tools.grammar())
            self._check_grammar(params.grammar, "tools")
        elif params.grammar is not None:
            self._check_grammar(params.grammar, "grammar" if body.get("grammar") is not None else "response_format")
        prompts = self._prompts(body, chat, tools)
        if len(prompts) * n > MAX_CHOICES:
            raise BadRequest(f"{len(prompts)} prompts x n={n} ask for {len(prompts) * n} completions; at most "
                             f"{MAX_CHOICES} in one request", "n")
        job = _Job(chat, stream, include_usage, not chat and echo(body), prompts, params.logprobs, tools)
        if not chat and (job.echo or job.logprobs is not None):  # the text echoed or offset from: here, in the pool
            job.prompts = [(ids, text if text is not None else self.model.detokenize(ids)) for ids, text in prompts]
        try:
            for k, (ids, _) in enumerate(prompts):
                # choice i: the seed's i-th successor; the choices of one prompt share its computation (a fork)
                ps = [replace(params, seed=None if params.seed is None else params.seed + i) for i in range(n)]
                evs = [functools.partial(put, len(job.reqs) + i) for i in range(n)]
                job.reqs += self.engine.submit_choices(ids, ps, evs) if n > 1 else [
                    self.engine.submit(ids, ps[0], evs[0])]
                job.prompt_of += [k] * n
        except BaseException:
            for r in job.reqs:
                self.engine.cancel(r)
            raise
        return job

    def _check_grammar(self, grammar: str, param: str) -> None:
        """A 400 naming the problem when a request's grammar (or JSON schema) does not compile for the model (the
        first one builds llguidance's view of the tokenizer: ~0.3 s for 49k tokens, once)."""
        tok = self.model.tokenizer_or_none
        if tok is None:
            raise BadRequest("constrained output needs the model's tokenizer, and this model has none", param)
        try:
            compile_grammar(tok, grammar, self.model.n_vocab)
        except GrammarError as e:
            raise BadRequest(f"{param}: {e}", param) from None

    async def _read_body(self, request: HTTPRequest) -> bytes:
        """The request body, at most `max_body_bytes` (413 from its Content-Length, or once more has streamed in:
        nothing beyond is read), within `body_timeout` seconds (408)."""
        limit = self.options.max_body_bytes
        declared = request.headers.get("content-length")
        if declared is not None and declared.strip().isdigit() and int(declared) > limit:
            raise _BodyRefused(413, f"the request body has {int(declared)} bytes; at most {limit} are accepted")
        buf = bytearray()

        async def read() -> None:
            async for chunk in request.stream():
                buf.extend(chunk)
                if len(buf) > limit:
                    raise _BodyRefused(413, f"the request body has more than {limit} bytes; at most {limit} are "
                                       "accepted")

        try:
            await asyncio.wait_for(read(), self.options.body_timeout)
        except asyncio.TimeoutError:
            raise _BodyRefused(408, f"the request body did not arrive within {self.options.body_timeout:g} s") \
                from None
        return bytes(buf)

    async def _body(self, request: HTTPRequest) -> bytes | Response:
        """The request body, or the response that refuses it (413, 408) or notes that its client went away."""
        try:
            return await self._read_body(request)
        except _BodyRefused as e:  # the rest of the body is not read: the connection closes after the answer
            return error_response(e.status, str(e), "invalid_request_error", headers={"Connection": "close"},
                          code="request_too_large" if e.status == 413 else "request_timeout")
        except ClientDisconnect:
            client = request.client
            notes("disconnect-body", f"a client ({client.host}:{client.port}) went away before its request body "
                  "had arrived" if client else "a client went away before its request body had arrived")
            return Response(status_code=499)

    async def _generate(self, request: HTTPRequest, chat: bool) -> Response:
        raw = await self._body(request)
        if isinstance(raw, Response):
            return raw
        inbox = _Inbox(asyncio.get_running_loop())
        try:
            job = await run_in_threadpool(self._admit, raw, chat, inbox.put)
        except BadRequest as e:
            return error_response(400, str(e), "invalid_request_error", e.param)
        except QueueFullError as e:
            return error_response(503, f"the server is busy: {e}; retry later", "server_busy",
                          headers={"Retry-After": str(RETRY_AFTER_S)})
        except EngineClosedError as e:
            return error_response(503, str(e), "server_shutting_down", headers={"Retry-After": str(RETRY_AFTER_S)})
        except (ModelError, ValueError) as e:  # a bad prompt (ids, length), sampling parameters
            return error_response(400, str(e), "invalid_request_error")
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        if job.stream:
            return StreamingResponse(self._sse(request, job, inbox, rid), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        return await self._wait(request, job, inbox, rid)

    def _cancel(self, job: _Job) -> None:
        for r in job.reqs:
            self.engine.cancel(r)

    # -- embeddings ------------------------------------------------------------------------------------------------
    async def embeddings(self, request: HTTPRequest) -> Response:
        raw = await self._body(request)
        if isinstance(raw, Response):
            return raw
        stop = threading.Event()

        async def watch() -> None:  # the body is read: the next message is the client's disconnect
            while (await request.receive())["type"] != "http.disconnect":
                pass
            stop.set()  # the embedding stops before its next step: the model's time goes to those still waiting

        watcher = asyncio.ensure_future(watch())
        try:  # parsing, tokenizing, every step and the answer's JSON in a pool thread: never on the event loop
            out = await run_in_threadpool(self._embed, raw, stop)
        except EmbeddingCancelled:
            notes("disconnect-embed", "a client went away during its embeddings request: stopped")
            return Response(status_code=499)
        except BadRequest as e:
            return error_response(400, str(e), "invalid_request_error", e.param)
        except (GgmlPyError, ValueError) as e:  # not the request's: the model closed, memory, non-finite values
            log.warning("ggml-py serve: an embeddings request failed: %s", e)
            return error_response(500, f"embedding failed: {e}", "server_error")
        finally:
            watcher.cancel()
        return Response(out, media_type="application/json")

    def embedder(self) -> Embedder:
        """The server's Embedder, made on first use (its memory checked then; its plan prepared at its first
        step)."""
        with self._embedder_lock:
            if self._embedder is None:
                self._embedder = Embedder(self.model, n_ctx=self.engine.n_ctx_seq, n_batch=self.engine.n_batch)
            return self._embedder

    def _embed(self, raw: bytes, stop: threading.Event | None = None) -> bytes:
        """An embeddings request (a pool thread): parsed, checked, tokenized, computed, its answer's JSON (2048
        vectors of 4096 floats take 4.3 s to write here, of 576 floats 0.75 s: not on the event loop)."""
        body = parse_json(raw)
        if not self.embeddings_local:
            raise BadRequest("embeddings are not available when the model's blocks run as pipeline stages "
                             "(--cluster)")
        m = self.model
        fmt = embedding_format(body, m.hparams.n_embd)
        items = embedding_inputs(body, self.options.max_embedding_inputs)
        for i, it in enumerate(items):
            if isinstance(it, str):
                self._check_chars(len(it), f"input[{i}]", "input")
        emb = self.embedder()
        try:
            mode = emb.resolve_pooling()
            ids = emb.token_inputs(items)
        except ModelError as e:  # an id outside the vocabulary, an input too long, a pooling the model asks for
            raise BadRequest(str(e), "input") from None
        vecs = emb.embed_ids(ids, normalize=True, pooling=mode, stop=stop)
        data = []
        for i, v in enumerate(vecs):
            # base64: the float32 values' little-endian bytes, as OpenAI's (and its client's decoder) have them
            e: Any = base64.b64encode(v.astype("<f4").tobytes()).decode("ascii") if fmt == "base64" else v.tolist()
            data.append({"object": "embedding", "index": i, "embedding": e})
        n = sum(int(a.size) for a in ids)
        out = {"object": "list", "data": data, "model": self.model_name,
               "usage": {"prompt_tokens": n, "total_tokens": n}}
        return json.dumps(out, ensure_ascii=False, allow_nan=False, separators=(",", ":")).encode("utf-8")

    async def _wait(self, request: HTTPRequest, job: _Job, inbox: _Inbox, rid: str) -> Response:
        async def watch() -> None:  # the body is read: the next message is the client's disconnect
            while (await request.receive())["type"] != "http.disconnect":
                pass
            self._cancel(job)

        watcher = asyncio.ensure_future(watch())
        ends: dict[int, Event] = {}
        try:
            while len(ends) < len(job.reqs):
                item = await inbox.get(POLL_DISCONNECT_S)
                if item is not None and item[1].kind == "done":
                    ends[item[0]] = item[1]
                    if item[1].finish_reason in ("error", "cancelled"):
                        break  # the answer is an error: the other choices are not needed
        except BaseException:
            self._cancel(job)
            raise
        finally:
            watcher.cancel()
        for ev in ends.values():
            if ev.finish_reason in ("error", "cancelled"):
                self._cancel(job)
                if ev.finish_reason == "cancelled":
                    return Response(status_code=499)
                if ev.unavailable:  # not the request's fault: a pipeline stage was lost
                    return error_response(503, ev.error or "generation failed", "server_unavailable")
                return error_response(500, ev.error or "generation failed", "server_error")
        tok = self.model.tokenizer_or_none
        choices = []
        for i, req in enumerate(job.reqs):
            c = req.result()
            if job.chat:
                msg, finish = _message(job, c.text, c.finish_reason)
                choices.append({"index": i, "message": msg,
                                "logprobs": None if c.logprobs is None else chat_logprobs(tok, c.logprobs),
                                "finish_reason": finish})
                continue
            head = job.echo_text(i) if job.echo else ""
            lp = None
            if c.logprobs is not None:
                pre = job.prompt_ids(i) if job.echo else []
                ids = pre + [x.token for x in c.logprobs]  # the generated tokens, and the EOG that ended them
                lp = completion_logprobs(tok, (c.prompt_logprobs or []) + c.logprobs, ids,
                                         0 if job.echo else len(job.echo_text(i)))
            choices.append({"index": i, "text": head + c.text, "logprobs": lp, "finish_reason": c.finish_reason})
        return JSONResponse({"id": rid, "object": "chat.completion" if job.chat else "text_completion",
                             "created": int(time.time()), "model": self.model_name, "choices": choices,
                             "usage": job.usage(), "system_fingerprint": "ggml_py"})

    async def _sse(self, request: HTTPRequest, job: _Job, inbox: _Inbox, rid: str) -> AsyncIterator[str]:
        created = int(time.time())
        chat = job.chat
        obj = "chat.completion.chunk" if chat else "text_completion"
        tok = self.model.tokenizer_or_none
        # completions' text offsets (logprobs): from the prompt's end, or 0 when the prompt is echoed
        offsets = [0 if job.echo or chat or job.logprobs is None else len(job.echo_text(i))
                   for i in range(len(job.reqs))]

        def chunk(i: int, delta: str | None, finish: str | None, lps: list[TokenLogprob | None] | None = None,
                  ids: list[int] | None = None, role: bool = False, calls: list[dict[str, Any]] | None = None) -> str:
            want = job.logprobs is not None
            if chat:
                d: dict[str, Any] = {}
                if role:
                    d["role"] = "assistant"
                if delta is not None:
                    d["content"] = delta
                if calls:
                    d["tool_calls"] = calls
                lp = chat_logprobs(tok, [x for x in lps or [] if x is not None]) if want and lps else None
                choice: dict[str, Any] = {"index": i, "delta": d, "logprobs": lp, "finish_reason": finish}
            else:
                lp = None
                if want and lps:
                    lp = completion_logprobs(tok, lps, ids or [x.token for x in lps if x is not None], offsets[i])
                    offsets[i] += sum(len(t) for t in lp["tokens"])
                choice = {"index": i, "text": delta or "", "logprobs": lp, "finish_reason": finish}
            out = {"id": rid, "object": obj, "created": created, "model": self.model_name, "choices": [choice],
                   "system_fingerprint": "ggml_py"}
            return f"data: {json.dumps(out)}\n\n"

        n_done = 0
        started: set[int] = set()
        texts = [""] * len(job.reqs)  # tools: each choice's answer so far, and the content of it streamed
        sent = [""] * len(job.reqs)
        try:
            if chat:
                for i in range(len(job.reqs)):
                    yield chunk(i, "", None, role=True)
            while n_done < len(job.reqs):
                item = await self._next(request, job, inbox)
                if item is None:
                    return
                i, ev = item
                if job.echo and i not in started:  # the prompt first (its logprobs are known once it is computed)
                    started.add(i)
                    c = job.reqs[i]
                    yield chunk(i, job.echo_text(i), None, c.prompt_logprobs, job.prompt_ids(i))
                if ev.kind == "token":
                    if job.tools is None:
                        yield chunk(i, ev.text, None, list(ev.logprobs))
                        continue
                    # a text answer streams its text as it comes; tool calls come whole once complete
                    texts[i] += ev.text
                    so_far = response_so_far(texts[i])
                    delta = so_far[len(sent[i]):] if so_far is not None and so_far.startswith(sent[i]) else ""
                    sent[i] += delta
                    if delta or ev.logprobs:
                        yield chunk(i, delta or None, None, list(ev.logprobs))
                    continue
                n_done += 1
                if ev.finish_reason in ("error", "cancelled"):
                    err = {"error": {"message": ev.error or "generation failed",
                                     "type": "server_unavailable" if ev.unavailable else "server_error",
                                     "param": None, "code": None}}
                    yield f"data: {json.dumps(err)}\n\n"
                    n_done = -1
                    return
                finish = ev.finish_reason
                if job.tools is not None:  # the answer is complete: its calls, or the rest of its content
                    msg, finish = _message(job, job.reqs[i].text, finish)
                    calls = [{"index": k, **c} for k, c in enumerate(msg.get("tool_calls", []))]
                    content = msg["content"]
                    if content is not None and sent[i] and content.startswith(sent[i]):
                        content = content[len(sent[i]):] or None
                    if content is not None or calls:
                        yield chunk(i, content, None, calls=calls)
                yield chunk(i, None if chat else "", finish, list(ev.logprobs))
            if job.include_usage:
                yield f"data: {json.dumps({'id': rid, 'object': obj, 'created': created, 'model': self.model_name, 'choices': [], 'usage': job.usage()})}\n\n"  # noqa: E501
            yield "data: [DONE]\n\n"
        finally:
            if n_done < len(job.reqs):  # the client went away (the response was cancelled), or a choice failed
                self._cancel(job)

    async def _next(self, request: HTTPRequest, job: _Job, inbox: _Inbox) -> tuple[int, Event] | None:
        """The next event of a job's choices; None (and the job cancelled) when the client went away."""
        while True:
            item = await inbox.get(POLL_DISCONNECT_S)
            if item is not None:
                return item
            if await request.is_disconnected():
                self._cancel(job)
                return None


def _message(job: _Job, text: str, finish: str) -> tuple[dict[str, Any], str]:
    """A chat answer's message and finish_reason: with tools, the generic format parsed into content or tool_calls
    (finish_reason "tool_calls")."""
    if job.tools is None:
        return {"role": "assistant", "content": text}, finish
    content, calls = parse_answer(text)
    if not calls:
        return {"role": "assistant", "content": content}, finish
    return {"role": "assistant", "content": None, "tool_calls": calls}, "tool_calls" if finish == "stop" else finish


def _loop_exception_handler(loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
    """Out of file descriptors while accepting: one line (asyncio retries the accept a second later), not a
    traceback per connection."""
    exc = context.get("exception")
    if isinstance(exc, OSError) and "accept" in str(context.get("message", "")):
        notes("accept", f"cannot accept a connection: {exc.strerror or exc} (lower --max-connections or raise "
              "the open-file limit, ulimit -n)")
        return
    loop.default_exception_handler(context)


def serve(model: Any, host: str = "127.0.0.1", port: int = 8080, n_parallel: int = 4, n_ctx: int | None = None,
          max_queue: int = 64, n_batch: int = 128, model_name: str | None = None,
          default_max_tokens: int | None = None, log: Callable[[str], None] | None = None,
          log_level: str = "warning", options: ServeOptions | None = None,
          stages: Sequence[StageLike] | None = None, micro_batches: int | None = None,
          prefix_cache: bool = True) -> dict[str, Any]:
    """Run the server until Ctrl-C / SIGTERM (then drain for at most `options.drain_timeout` seconds, and return the
    final metrics, with "shutdown": "drained", "cut" or "forced" and "signal"). A second signal stops at once.
    Port 0 picks a free one; the address is logged ("listening on http://HOST:PORT"). `stages`: the model's blocks
    elsewhere, e.g. a pipeline on a Ray cluster (ggml_py/cluster/), made for the same n_ctx, n_parallel, n_batch;
    `micro_batches`: see Engine."""
    require_server_extra()
    import uvicorn

    options = options or ServeOptions()
    state: dict[str, Any] = {"shutdown": "drained", "signal": None}

    class _UvicornServer(uvicorn.Server):
        """uvicorn's graceful shutdown on the first SIGINT / SIGTERM, bounded by the drain timeout; a second one
        stops at once. The signal is not re-raised afterwards (recent uvicorn does, which would kill the process
        before the engine has stopped and the command has reported)."""

        @contextlib.contextmanager
        def capture_signals(self) -> Iterator[None]:
            if threading.current_thread() is not threading.main_thread():
                yield
                return
            old = {sig: signal.signal(sig, self.handle_exit) for sig in (signal.SIGINT, signal.SIGTERM)}
            try:
                yield
            finally:
                for sig, h in old.items():
                    signal.signal(sig, h)

        async def startup(self, sockets: list[socket.socket] | None = None) -> None:
            await super().startup(sockets)
            # asyncio listened with the accept batch (config.backlog, which it also takes as the most connections
            # accepted per wakeup); the kernel's queue of connections not accepted yet can be long: a full one drops
            # new connections' SYNs, and their clients retry a second later
            for sk in sockets or []:
                sk.listen(LISTEN_BACKLOG)

        def handle_exit(self, sig: int, frame: Any) -> None:
            if not self.should_exit:
                self.should_exit = True
                state["signal"] = signal.Signals(sig).name
                srv.begin_drain()
                return
            state["shutdown"], state["signal"] = "forced", signal.Signals(sig).name
            if srv.loop is None:
                self.force_exit = True
                engine.abort()
                return
            # cut now: the open requests end and every connection closes, so uvicorn's wait ends at its next poll
            # and the lifespan's shutdown finds the engine stopped. Should a task still hang, uvicorn stops waiting
            # a second later (force_exit also skips the lifespan's shutdown, which then logs its cancellation).
            srv.loop.call_soon_threadsafe(srv.cut, f"{signal.Signals(sig).name} again")
            srv.loop.call_soon_threadsafe(srv.loop.call_later, 1.0, setattr, self, "force_exit", True)

    n_conn, batch, fd_note = fit_connections(options.max_connections)
    guard = ConnectionGuard(n_conn, options.header_timeout)
    engine = Engine(model, n_parallel=n_parallel, n_ctx=n_ctx, max_queue=max_queue, n_batch=n_batch, stages=stages,
                    micro_batches=micro_batches, prefix_cache=prefix_cache)
    engine.start()
    srv = Server(model, engine, model_name=model_name, default_max_tokens=default_max_tokens, options=options,
                 host=host)
    srv.connections = lambda: list(guard.open)
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # proto IPPROTO_TCP, not 0: asyncio sets TCP_NODELAY only on accepted sockets of that proto, and without it
    # Nagle held each response's body behind its head until the client's delayed ACK (40 ms per request after a
    # connection's first: lm-eval's 288 /tokenize calls on one keep-alive connection took 13 s)
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        engine.close(drain=False)
        raise GgmlPyError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None
    real_port = sock.getsockname()[1]
    # uvicorn's own settings: the h11 protocol (subclassed: the guard above), the idle keep-alive timeout, the head
    # size, the backlog (asyncio's accept batch; the kernel's queue is set after startup), and the graceful
    # shutdown's bound (a backstop: the drain's own timer cuts the requests at drain_timeout)
    config = uvicorn.Config(srv.app, log_level=log_level, lifespan="on", access_log=False, loop="asyncio",
                            http=guarded_h11_protocol(guard), ws="none", proxy_headers=False,
                            timeout_keep_alive=options.keep_alive_timeout, backlog=batch,
                            h11_max_incomplete_event_size=MAX_HEADER_BYTES,
                            timeout_graceful_shutdown=math.ceil(options.drain_timeout) + 5)
    # listening before the address is logged: a client that reads the log and connects at once is queued until
    # uvicorn accepts, not refused (a bound socket that does not listen yet refuses connections)
    sock.listen(LISTEN_BACKLOG)
    server = _UvicornServer(config)
    try:
        if log:
            log(f"ggml-py serve: {srv.model_name} ({model.architecture}), {n_parallel} parallel sequences, "
                f"{engine.decoder.n_ctx} KV cells ({engine.n_ctx_seq} per sequence), queue {max_queue}")
            if fd_note:
                log(f"ggml-py serve: {fd_note}")
            log(f"ggml-py serve: listening on http://{host}:{real_port}")
        server.run(sockets=[sock])
    finally:
        forced = state["shutdown"] == "forced"
        engine.close(drain=not forced, timeout=0 if forced else options.drain_timeout)
        sock.close()
    if not forced and srv.cut_reason is not None:
        state["shutdown"] = "cut"
    return {**engine.metrics(), **state}
