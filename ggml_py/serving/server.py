"""An OpenAI-compatible HTTP server over the continuous-batching Engine, on starlette + uvicorn
(`pip install "ggml_py[server]"`; `ggml-py serve`, docs/serving.md).

    POST /v1/completions, /v1/chat/completions     (JSON, or server-sent events with "stream": true)
    GET  /v1/models, /health, /metrics             (/metrics: Prometheus text; ?format=json for JSON)

The model runs on the engine's one worker thread; request handlers only queue work and wait on their request's
events (handed from the worker to the event loop with call_soon_threadsafe). Bad JSON or parameters: 400 with an
OpenAI-style error body; a full queue: 503 with Retry-After; a client that goes away (mid-stream or while waiting)
cancels its request, which frees its sequence before the next step. Shutdown (Ctrl-C / SIGTERM): uvicorn stops
accepting connections and waits for the open ones, then the engine drains and stops.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import os
import signal
import threading
import time
import uuid
from collections import deque
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

from ggml_py.errors import GgmlPyError, ModelError
from ggml_py.serving.engine import Engine, EngineClosedError, Event, GenParams, QueueFullError, Request

try:  # the optional extra: ggml_py[server]
    from starlette.applications import Starlette
    from starlette.requests import Request as HTTPRequest
    from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
    from starlette.routing import Route
except ImportError as e:  # pragma: no cover - depends on the environment
    _IMPORT_ERROR: ImportError | None = e
else:
    _IMPORT_ERROR = None

RETRY_AFTER_S = 1
POLL_DISCONNECT_S = 0.25


def require_server_extra() -> None:
    if _IMPORT_ERROR is not None:
        raise GgmlPyError(f"the server needs the optional dependencies: pip install \"ggml_py[server]\" "
                          f"({_IMPORT_ERROR})")


class BadRequest(GgmlPyError):
    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


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


def _error(status: int, message: str, etype: str, param: str | None = None,
           headers: dict[str, str] | None = None) -> Response:
    body = {"error": {"message": message, "type": etype, "param": param, "code": None}}
    return JSONResponse(body, status_code=status, headers=headers)


# -- parameters ----------------------------------------------------------------------------------------------------
def _num(body: dict[str, Any], name: str, default: float, lo: float, hi: float) -> float:
    v = body.get(name)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v) or not lo <= v <= hi:
        raise BadRequest(f"{name} must be a number in [{lo}, {hi}], got {v!r}", name)
    return float(v)


def _int(body: dict[str, Any], name: str, default: int | None, lo: int, hi: int | None = None) -> int | None:
    v = body.get(name)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, int) or v < lo or (hi is not None and v > hi):
        rng = f">= {lo}" if hi is None else f"in [{lo}, {hi}]"
        raise BadRequest(f"{name} must be an integer {rng}, got {v!r}", name)
    return v


def gen_params(body: dict[str, Any], default_max_tokens: int | None) -> GenParams:
    """Sampling and stopping from an OpenAI request body (+ llama.cpp's top_k, min_p, repeat_penalty extensions).
    Unset values take ggml_py's sampler defaults (as llama-server does), not OpenAI's temperature 1."""
    d = GenParams()
    n = _int(body, "n", 1, 1, 1)
    assert n == 1
    mt = body.get("max_completion_tokens", body.get("max_tokens"))
    max_tokens = _int({"max_tokens": mt}, "max_tokens", default_max_tokens, 0)
    stop = body.get("stop")
    if stop is None:
        stops: list[str] = []
    elif isinstance(stop, str):
        stops = [stop]
    elif isinstance(stop, list) and len(stop) <= 4 and all(isinstance(s, str) for s in stop):
        stops = list(stop)
    else:
        raise BadRequest("stop must be a string or a list of at most 4 strings", "stop")
    seed = _int(body, "seed", None, 0, 2**63 - 1)
    if body.get("logprobs") not in (None, False, 0) or body.get("echo") or body.get("best_of") not in (None, 1):
        name = "logprobs" if body.get("logprobs") not in (None, False, 0) else \
            "echo" if body.get("echo") else "best_of"
        raise BadRequest(f"{name} is not supported", name)
    return GenParams(
        max_tokens=max_tokens, temperature=_num(body, "temperature", d.temperature, 0.0, 2.0),
        top_p=_num(body, "top_p", d.top_p, 0.0, 1.0) or 1.0, top_k=int(_int(body, "top_k", d.top_k, 0) or 0),
        min_p=_num(body, "min_p", d.min_p, 0.0, 1.0), repeat_penalty=_num(body, "repeat_penalty", 1.0, 1e-6, 1e6),
        frequency_penalty=_num(body, "frequency_penalty", 0.0, -2.0, 2.0),
        presence_penalty=_num(body, "presence_penalty", 0.0, -2.0, 2.0), seed=seed, stop=stops,
        stop_at_eos=not body.get("ignore_eos", False))


def _content(m: dict[str, Any], i: int) -> str:
    c = m.get("content")
    if c is None:
        return ""
    if isinstance(c, str):
        return c
    if isinstance(c, list):  # content parts: text only
        out = []
        for p in c:
            if not isinstance(p, dict) or p.get("type") != "text" or not isinstance(p.get("text"), str):
                raise BadRequest(f"messages[{i}].content: only text parts are supported", "messages")
            out.append(p["text"])
        return "".join(out)
    raise BadRequest(f"messages[{i}].content must be a string or a list of text parts", "messages")


def chat_messages(body: dict[str, Any]) -> list[dict[str, str]]:
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise BadRequest("messages must be a non-empty list", "messages")
    out = []
    for i, m in enumerate(msgs):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise BadRequest(f"messages[{i}] must be an object with a role", "messages")
        if m["role"] not in ("system", "developer", "user", "assistant", "tool"):
            raise BadRequest(f"messages[{i}].role {m['role']!r} is not one of system, user, assistant", "messages")
        role = "system" if m["role"] == "developer" else m["role"]
        out.append({"role": role, "content": _content(m, i)})
    return out


# -- the app -------------------------------------------------------------------------------------------------------
class Server:
    """The ASGI app (`.app`) around a model and its engine."""

    def __init__(self, model: Any, engine: Engine, model_name: str | None = None,
                 default_max_tokens: int | None = None) -> None:
        require_server_extra()
        self.model = model
        self.engine = engine
        self.model_name = model_name or os.path.splitext(os.path.basename(model.path))[0]
        self.default_max_tokens = default_max_tokens
        self.created = int(time.time())
        self.app = Starlette(routes=[
            Route("/health", self.health, methods=["GET"]),
            Route("/v1/models", self.models, methods=["GET"]),
            Route("/metrics", self.metrics, methods=["GET"]),
            Route("/v1/completions", self.completions, methods=["POST"]),
            Route("/v1/chat/completions", self.chat_completions, methods=["POST"]),
        ], lifespan=self._lifespan)

    @contextlib.asynccontextmanager
    async def _lifespan(self, app: Any) -> AsyncIterator[None]:
        yield
        # uvicorn has waited for the open connections: drain what is left and stop the worker
        await asyncio.get_running_loop().run_in_executor(None, self.engine.close)

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

    def _prompt_ids(self, body: dict[str, Any], chat: bool) -> list[int]:
        m = self.model
        if chat:
            msgs = chat_messages(body)
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
            return m.tokenize(p)
        if isinstance(p, list) and p and all(isinstance(t, int) and not isinstance(t, bool) for t in p):
            return [int(t) for t in p]
        raise BadRequest("prompt must be a string or a list of token ids (one prompt per request)", "prompt")

    async def _generate(self, request: HTTPRequest, chat: bool) -> Response:
        try:
            raw = await request.body()
            try:
                body = json.loads(raw)
            except (json.JSONDecodeError, UnicodeDecodeError) as e:
                raise BadRequest(f"the request body is not valid JSON: {e}") from None
            if not isinstance(body, dict):
                raise BadRequest("the request body must be a JSON object")
            stream = body.get("stream", False)
            if not isinstance(stream, bool):
                raise BadRequest("stream must be a boolean", "stream")
            so = body.get("stream_options") or {}
            include_usage = bool(isinstance(so, dict) and so.get("include_usage"))
            params = gen_params(body, self.default_max_tokens if chat else (self.default_max_tokens or 16))
            ids = self._prompt_ids(body, chat)
            inbox = _Inbox(asyncio.get_running_loop())
            req = self.engine.submit(ids, params, inbox.put)
        except BadRequest as e:
            return _error(400, str(e), "invalid_request_error", e.param)
        except QueueFullError as e:
            return _error(503, f"the server is busy: {e}; retry later", "server_busy",
                          headers={"Retry-After": str(RETRY_AFTER_S)})
        except EngineClosedError as e:
            return _error(503, str(e), "server_shutting_down", headers={"Retry-After": str(RETRY_AFTER_S)})
        except (ModelError, ValueError) as e:  # a bad prompt (ids, length), sampling parameters
            return _error(400, str(e), "invalid_request_error")
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        if stream:
            return StreamingResponse(self._sse(request, req, inbox, rid, chat, include_usage),
                                     media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        return await self._wait(request, req, inbox, rid, chat)

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
            return _error(500, ev.error or "generation failed", "server_error")
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
                    err = {"error": {"message": ev.error or "generation failed", "type": "server_error",
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


def serve(model: Any, host: str = "127.0.0.1", port: int = 8080, n_parallel: int = 4, n_ctx: int | None = None,
          max_queue: int = 64, n_batch: int = 128, model_name: str | None = None,
          default_max_tokens: int | None = None, log: Callable[[str], None] | None = None,
          log_level: str = "warning") -> dict[str, Any]:
    """Run the server until Ctrl-C / SIGTERM (then drain and return the final metrics). Port 0 picks a free one;
    the address is logged ("listening on http://HOST:PORT")."""
    require_server_extra()
    import socket

    import uvicorn

    class _UvicornServer(uvicorn.Server):
        """uvicorn's graceful shutdown on SIGINT / SIGTERM, without re-raising the signal afterwards (recent uvicorn
        does, which would kill the process before the engine has drained and the command has reported)."""

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

    engine = Engine(model, n_parallel=n_parallel, n_ctx=n_ctx, max_queue=max_queue, n_batch=n_batch)
    engine.start()
    srv = Server(model, engine, model_name=model_name, default_max_tokens=default_max_tokens)
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
    config = uvicorn.Config(srv.app, log_level=log_level, timeout_graceful_shutdown=None, lifespan="on",
                            access_log=False)
    # listening before the address is logged: a client that reads the log and connects at once is queued until
    # uvicorn accepts, not refused (a bound socket that does not listen yet refuses connections)
    sock.listen(config.backlog)
    server = _UvicornServer(config)
    try:
        if log:
            log(f"ggml-py serve: {srv.model_name} ({model.architecture}), {n_parallel} parallel sequences, "
                f"{engine.decoder.n_ctx} KV cells ({engine.n_ctx_seq} per sequence), queue {max_queue}")
            log(f"ggml-py serve: listening on http://{host}:{real_port}")
        server.run(sockets=[sock])
    finally:
        engine.close()
        sock.close()
    return engine.metrics()
