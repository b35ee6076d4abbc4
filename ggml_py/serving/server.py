"""An OpenAI-compatible HTTP server over the continuous-batching Engine, on starlette + uvicorn
(`pip install "ggml_py[server]"`; `ggml-py serve`, docs/serving.md). Its parts: request_params.py (a body into
GenParams), access.py (Host/Origin, API key, JSON-only routes), connections.py (head timeouts, the connection cap),
http_common.py (errors, limits, log lines).

    POST /v1/completions, /v1/chat/completions     (JSON, or server-sent events with "stream": true)
    POST /v1/embeddings                            (the model's pooled hidden states: models/embed.py)
    GET  /v1/models, /health, /metrics             (/metrics: Prometheus text; ?format=json for JSON)

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
from ggml_py.models.stage import Stage
from ggml_py.serving.access import ApiGuard, HostOriginGuard
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
from ggml_py.serving.options import ServeOptions
from ggml_py.serving.request_params import (
    chat_messages,
    embedding_format,
    embedding_inputs,
    gen_params,
    max_token_bytes,
    parse_json,
)


class _BodyRefused(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


class _Inbox:
    """A request's events, put by the worker thread (through the loop) and taken by its handler."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.items: deque[Event] = deque()
        self.ready = asyncio.Event()

    def put(self, ev: Event) -> None:  # the worker thread
        self.loop.call_soon_threadsafe(self._put, ev)

    def _put(self, ev: Event) -> None:
        self.items.append(ev)
        self.ready.set()

    async def get(self, timeout: float) -> Event | None:
        """The next event, or None after `timeout` seconds without one."""
        if not self.items:
            self.ready.clear()
            try:
                await asyncio.wait_for(self.ready.wait(), timeout)  # losing a wait() result loses nothing
            except asyncio.TimeoutError:
                pass
        return self.items.popleft() if self.items else None


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
            Route("/health", self.health, methods=["GET"]),
            Route("/v1/models", self.models, methods=["GET"]),
            Route("/metrics", self.metrics, methods=["GET"]),
            Route("/v1/completions", self.completions, methods=["POST"]),
            Route("/v1/chat/completions", self.chat_completions, methods=["POST"]),
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

    def _prompt_ids(self, body: dict[str, Any], chat: bool) -> list[int]:
        """The prompt's token ids (a pool thread: rendering and tokenizing take time in proportion to the text)."""
        m = self.model
        if chat:
            msgs = chat_messages(body)
            self._check_chars(sum(len(x["content"]) for x in msgs), "the messages' content", "messages")
            try:
                text = m.apply_chat_template(msgs, add_generation_prompt=True)
            except GgmlPyError as e:
                raise BadRequest(f"the chat template failed: {e}", "messages") from None
            bos = m.tokenizer.bos_token
            return m.tokenize(text, add_special=not (bos and text.startswith(bos)))
        p = body.get("prompt")
        if isinstance(p, list) and len(p) == 1 and isinstance(p[0], str | list):
            p = p[0]
        if isinstance(p, str):
            self._check_chars(len(p), "the prompt", "prompt")
            return m.tokenize(p)
        if isinstance(p, list) and p and all(isinstance(t, int) and not isinstance(t, bool) for t in p):
            return [int(t) for t in p]
        raise BadRequest("prompt must be a string or a list of token ids (one prompt per request)", "prompt")

    def _admit(self, raw: bytes, chat: bool, on_event: Callable[[Event], None]) -> tuple[Request, bool, bool]:
        """Parse, validate, tokenize and submit (a pool thread): the request, whether it streams, whether it wants
        a usage chunk."""
        body = parse_json(raw)
        stream = body.get("stream", False)
        if not isinstance(stream, bool):
            raise BadRequest("stream must be a boolean", "stream")
        so = body.get("stream_options") or {}
        include_usage = bool(isinstance(so, dict) and so.get("include_usage"))
        params = gen_params(body, self.default_max_tokens if chat else (self.default_max_tokens or 16),
                            self.model.n_vocab)
        ids = self._prompt_ids(body, chat)
        return self.engine.submit(ids, params, on_event), stream, include_usage

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
            req, stream, include_usage = await run_in_threadpool(self._admit, raw, chat, inbox.put)
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
        if stream:
            return StreamingResponse(self._sse(request, req, inbox, rid, chat, include_usage),
                                     media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        return await self._wait(request, req, inbox, rid, chat)

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

    async def _next(self, request: HTTPRequest, req: Request, inbox: _Inbox) -> Event | None:
        """The next event of req; None (and the request cancelled) when the client went away."""
        while True:
            ev = await inbox.get(POLL_DISCONNECT_S)
            if ev is not None:
                return ev
            if await request.is_disconnected():
                self.engine.cancel(req)
                return None

    async def _wait(self, request: HTTPRequest, req: Request, inbox: _Inbox, rid: str,
                    chat: bool) -> Response:
        async def watch() -> None:  # the body is read: the next message is the client's disconnect
            while (await request.receive())["type"] != "http.disconnect":
                pass
            self.engine.cancel(req)

        watcher = asyncio.ensure_future(watch())
        try:
            while True:
                ev = await inbox.get(POLL_DISCONNECT_S)
                if ev is not None and ev.kind == "done":
                    break
        except BaseException:
            self.engine.cancel(req)
            raise
        finally:
            watcher.cancel()
        if ev.finish_reason == "cancelled":
            return Response(status_code=499)
        if ev.finish_reason == "error":
            if ev.unavailable:  # not the request's fault: a pipeline stage was lost
                return error_response(503, ev.error or "generation failed", "server_unavailable")
            return error_response(500, ev.error or "generation failed", "server_error")
        c = req.result()
        usage = {"prompt_tokens": c.prompt_tokens, "completion_tokens": c.completion_tokens,
                 "total_tokens": c.prompt_tokens + c.completion_tokens}
        if chat:
            choice: dict[str, Any] = {"index": 0, "message": {"role": "assistant", "content": c.text},
                                      "logprobs": None, "finish_reason": c.finish_reason}
        else:
            choice = {"index": 0, "text": c.text, "logprobs": None, "finish_reason": c.finish_reason}
        return JSONResponse({"id": rid, "object": "chat.completion" if chat else "text_completion",
                             "created": int(time.time()), "model": self.model_name, "choices": [choice],
                             "usage": usage, "system_fingerprint": "ggml_py"})

    async def _sse(self, request: HTTPRequest, req: Request, inbox: _Inbox, rid: str, chat: bool,
                   include_usage: bool) -> AsyncIterator[str]:
        created = int(time.time())
        obj = "chat.completion.chunk" if chat else "text_completion"

        def chunk(delta: str | None, finish: str | None, role: bool = False) -> str:
            if chat:
                d: dict[str, Any] = {}
                if role:
                    d["role"] = "assistant"
                if delta is not None:
                    d["content"] = delta
                choice: dict[str, Any] = {"index": 0, "delta": d, "logprobs": None, "finish_reason": finish}
            else:
                choice = {"index": 0, "text": delta or "", "logprobs": None, "finish_reason": finish}
            out = {"id": rid, "object": obj, "created": created, "model": self.model_name, "choices": [choice],
                   "system_fingerprint": "ggml_py"}
            return f"data: {json.dumps(out)}\n\n"

        done = False
        try:
            if chat:
                yield chunk("", None, role=True)
            while True:
                ev = await self._next(request, req, inbox)
                if ev is None:
                    return
                if ev.kind == "token":
                    yield chunk(ev.text, None)
                    continue
                done = True
                if ev.finish_reason == "error":
                    err = {"error": {"message": ev.error or "generation failed",
                                     "type": "server_unavailable" if ev.unavailable else "server_error",
                                     "param": None, "code": None}}
                    yield f"data: {json.dumps(err)}\n\n"
                    return
                yield chunk(None if chat else "", ev.finish_reason)
                if include_usage:
                    c = req.result()
                    usage = {"prompt_tokens": c.prompt_tokens, "completion_tokens": c.completion_tokens,
                             "total_tokens": c.prompt_tokens + c.completion_tokens}
                    yield f"data: {json.dumps({'id': rid, 'object': obj, 'created': created, 'model': self.model_name, 'choices': [], 'usage': usage})}\n\n"  # noqa: E501
                yield "data: [DONE]\n\n"
                return
        finally:
            if not done:  # the client went away (the response was cancelled): free the sequence now
                self.engine.cancel(req)


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
          stages: Sequence[StageLike] | None = None, micro_batches: int | None = None) -> dict[str, Any]:
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
                    micro_batches=micro_batches)
    engine.start()
    srv = Server(model, engine, model_name=model_name, default_max_tokens=default_max_tokens, options=options,
                 host=host)
    srv.connections = lambda: list(guard.open)
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
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
