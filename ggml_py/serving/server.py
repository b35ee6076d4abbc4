"""An OpenAI-compatible HTTP server over the continuous-batching Engine, on starlette + uvicorn
(`pip install "ggml_py[server]"`; `ggml-py serve`, docs/serving.md).

    POST /v1/completions, /v1/chat/completions     (JSON, or server-sent events with "stream": true)
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
import contextlib
import functools
import hmac
import ipaddress
import json
import logging
import math
import os
import signal
import socket
import threading
import time
import uuid
from collections import deque
from collections.abc import AsyncIterator, Callable, Iterator, Mapping
from typing import Any
from urllib.parse import urlsplit

from ggml_py.errors import GgmlPyError, ModelError
from ggml_py.serving.engine import Engine, EngineClosedError, Event, GenParams, QueueFullError, Request
from ggml_py.serving.options import ServeOptions

try:  # the optional extra: ggml_py[server]
    from starlette.applications import Starlette
    from starlette.concurrency import run_in_threadpool
    from starlette.datastructures import Headers
    from starlette.middleware import Middleware
    from starlette.middleware.cors import CORSMiddleware
    from starlette.requests import ClientDisconnect
    from starlette.requests import Request as HTTPRequest
    from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
    from starlette.routing import Route
except ImportError as e:  # pragma: no cover - depends on the environment
    _IMPORT_ERROR: ImportError | None = e
else:
    _IMPORT_ERROR = None

log = logging.getLogger("ggml_py.serve")

RETRY_AFTER_S = 1
POLL_DISCONNECT_S = 0.25
MAX_HEADER_BYTES = 16 * 1024  # a request head larger than this is refused by h11 (400)
LOCAL_HOSTS = ("localhost", "127.0.0.1", "::1")


def require_server_extra() -> None:
    if _IMPORT_ERROR is not None:
        raise GgmlPyError(f"the server needs the optional dependencies: pip install \"ggml_py[server]\" "
                          f"({_IMPORT_ERROR})")


class BadRequest(GgmlPyError):
    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class _BodyRefused(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


class _Notes:
    """Log lines about what clients do (disconnects, timeouts, evictions): the first of a kind at once, then at most
    one per `interval` seconds with the count of those not logged, so a flood of them cannot flood the log."""

    def __init__(self, interval: float = 10.0) -> None:
        self.interval = interval
        self._last: dict[str, float] = {}
        self._skipped: dict[str, int] = {}

    def __call__(self, kind: str, message: str) -> None:
        now = time.monotonic()
        if now - self._last.get(kind, -math.inf) < self.interval:
            self._skipped[kind] = self._skipped.get(kind, 0) + 1
            return
        n = self._skipped.pop(kind, 0)
        self._last[kind] = now
        log.warning("ggml-py serve: %s%s", message, f" (and {n} more like it)" if n else "")


notes = _Notes()


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
           headers: Mapping[str, str] | None = None, code: str | None = None) -> Response:
    body = {"error": {"message": message, "type": etype, "param": param, "code": code}}
    return JSONResponse(body, status_code=status, headers=dict(headers) if headers else None)


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


def _logit_bias(body: dict[str, Any], n_vocab: int | None) -> dict[int, float] | None:
    """OpenAI's logit_bias: {"token id": bias in [-100, 100]} (JSON keys are strings of decimal digits)."""
    lb = body.get("logit_bias")
    if lb is None:
        return None
    if not isinstance(lb, dict):
        raise BadRequest("logit_bias must be an object mapping token ids to numbers in [-100, 100]", "logit_bias")
    out: dict[int, float] = {}
    for k, v in lb.items():
        if not (isinstance(k, str) and k.isascii() and k.isdigit()) or (n_vocab is not None and int(k) >= n_vocab):
            raise BadRequest(f"logit_bias: {k!r} is not a token id in [0, {n_vocab})", "logit_bias")
        if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v) or not -100 <= v <= 100:
            raise BadRequest(f"logit_bias[{k}] must be a number in [-100, 100], got {v!r}", "logit_bias")
        out[int(k)] = float(v)
    return out or None


def _refuse_unsupported(body: dict[str, Any]) -> None:
    """What the server does not do yet is refused (400), never silently ignored."""
    if body.get("logprobs") not in (None, False, 0) or body.get("echo") or body.get("best_of") not in (None, 1):
        name = "logprobs" if body.get("logprobs") not in (None, False, 0) else \
            "echo" if body.get("echo") else "best_of"
        raise BadRequest(f"{name} is not supported", name)
    rf = body.get("response_format")
    if rf is not None and rf != {"type": "text"}:
        raise BadRequest("response_format is not supported (only {\"type\": \"text\"}, the default): structured "
                         "output (json_object, json_schema) is not implemented", "response_format")
    for name in ("tools", "functions"):
        if body.get(name) not in (None, []):
            raise BadRequest(f"{name} is not supported: tool and function calling are not implemented", name)
    for name in ("tool_choice", "function_call"):
        if body.get(name) not in (None, "none"):
            raise BadRequest(f"{name} is not supported: tool and function calling are not implemented", name)


def gen_params(body: dict[str, Any], default_max_tokens: int | None, n_vocab: int | None = None) -> GenParams:
    """Sampling and stopping from an OpenAI request body (+ llama.cpp's top_k, min_p, repeat_penalty extensions).
    Unset values take ggml_py's sampler defaults (as llama-server does), not OpenAI's temperature 1. `top_p` 0 is
    greedy (only the most likely token is kept); `logit_bias` ids are checked against `n_vocab`."""
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
    _refuse_unsupported(body)
    temperature = _num(body, "temperature", d.temperature, 0.0, 2.0)
    top_p = _num(body, "top_p", d.top_p, 0.0, 1.0)
    if top_p == 0.0:  # the smallest set reaching probability 0: the most likely token alone
        temperature, top_p = 0.0, 1.0
    return GenParams(
        max_tokens=max_tokens, temperature=temperature, top_p=top_p, top_k=int(_int(body, "top_k", d.top_k, 0) or 0),
        min_p=_num(body, "min_p", d.min_p, 0.0, 1.0), repeat_penalty=_num(body, "repeat_penalty", 1.0, 1e-6, 1e6),
        frequency_penalty=_num(body, "frequency_penalty", 0.0, -2.0, 2.0),
        presence_penalty=_num(body, "presence_penalty", 0.0, -2.0, 2.0), seed=seed, stop=stops,
        stop_at_eos=not body.get("ignore_eos", False), logit_bias=_logit_bias(body, n_vocab))


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


def _parse_json(raw: bytes) -> dict[str, Any]:
    try:
        body = json.loads(raw)
    except RecursionError:
        notes("deep-json", "a request body nested too deeply was refused (400)")
        raise BadRequest("the request body is nested too deeply") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise BadRequest(f"the request body is not valid JSON: {e}") from None
    if not isinstance(body, dict):
        raise BadRequest("the request body must be a JSON object")
    return body


def max_token_bytes(tokenizer: Any) -> int:
    """The bytes of the longest token's text (special tokens' included): no token stands for more of a prompt."""
    return max((len(tokenizer.token_to_piece(i)) for i in range(tokenizer.n_vocab)), default=1) or 1


# -- the access policy (ASGI middleware) ---------------------------------------------------------------------------
def _split_host(value: str) -> tuple[str, int | None]:
    """A Host header's (or netloc's) host name, lower case and without brackets, and its port (None: absent)."""
    v = value.strip().lower()
    if v.startswith("["):
        end = v.find("]")
        host, rest = (v[1:end], v[end + 1:]) if end > 0 else (v, "")
        port = rest[1:] if rest.startswith(":") else ""
    elif v.count(":") == 1:
        host, _, port = v.partition(":")
    else:
        host, port = v, ""
    return host.rstrip("."), (int(port) if port.isdigit() and len(port) <= 5 else None)


def _is_ip(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


class _HostOriginGuard:
    """Blocks what a web page on another site could make a browser send: a Host header that is not this server's
    (DNS rebinding) and an Origin that is not the server's own origin (cross-site requests) unless it is one of the
    CORS origins. Both 403 with an OpenAI-style body."""

    def __init__(self, app: Any, bound_host: str, allowed_hosts: tuple[str, ...], cors_origins: tuple[str, ...]):
        self.app = app
        bound = _split_host(bound_host)[0] if bound_host else ""
        self.any_ip = bound in ("", "0.0.0.0", "::")  # bound to every address: any address is the server's
        names = {h.lower().rstrip(".") for h in allowed_hosts}
        self.any_host = "*" in names
        self.suffixes = tuple(h[1:] for h in names if h.startswith("*."))
        self.hosts = frozenset({*LOCAL_HOSTS, *(h for h in names if not h.startswith("*")), bound} - {""})
        self.any_origin = "*" in cors_origins
        self.origins = frozenset(o.lower().rstrip("/") for o in cors_origins)

    def host_ok(self, host: str) -> bool:
        if self.any_host or host in self.hosts or (self.suffixes and host.endswith(self.suffixes)):
            return True
        return self.any_ip and _is_ip(host)

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = Headers(scope=scope)
        host_header = headers.get("host", "")
        host, port = _split_host(host_header)
        if not self.host_ok(host):
            await _error(403, f"the Host header {host_header!r} is not one of this server's names (see "
                         "--allowed-hosts)", "invalid_request_error", code="host_not_allowed")(scope, receive, send)
            return
        origin = headers.get("origin")
        if origin is not None and not self.any_origin and origin.lower().rstrip("/") not in self.origins:
            default = 443 if scope.get("scheme") == "https" else 80
            try:
                o = urlsplit(origin)
                same = (o.scheme in ("http", "https") and o.hostname is not None and
                        (o.hostname.rstrip("."), o.port or (443 if o.scheme == "https" else 80)) ==
                        (host, port or default))
            except ValueError:
                same = False
            if not same:
                await _error(403, f"cross-origin requests from {origin!r} are not allowed (see --cors-origins)",
                             "invalid_request_error", code="origin_not_allowed")(scope, receive, send)
                return
        await self.app(scope, receive, send)


class _ApiGuard:
    """The API routes: a bearer key when one is set (constant-time comparison; 401), and JSON request bodies only
    (415), so that a browser's "simple" cross-origin POST (text/plain, a form) cannot start a generation."""

    PROTECTED = ("/v1/", "/metrics")

    def __init__(self, app: Any, api_key: str | None) -> None:
        self.app = app
        self.key = api_key.encode() if api_key else None

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        path = scope.get("path", "")
        if scope["type"] != "http" or not path.startswith(self.PROTECTED):
            await self.app(scope, receive, send)
            return
        headers = Headers(scope=scope)
        if self.key is not None:
            scheme, _, token = headers.get("authorization", "").partition(" ")
            if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), self.key):
                msg = "Incorrect API key provided." if token else "Missing bearer authentication in header."
                await _error(401, msg, "invalid_request_error", code="invalid_api_key",
                             headers={"WWW-Authenticate": "Bearer"})(scope, receive, send)
                return
        if scope["method"] == "POST":
            ctype = headers.get("content-type", "").split(";")[0].strip().lower()
            if ctype != "application/json":
                await _error(415, f"the request body must be JSON (Content-Type: application/json), not "
                             f"{ctype or 'unspecified'!r}", "invalid_request_error",
                             code="unsupported_media_type")(scope, receive, send)
                return
        await self.app(scope, receive, send)


# -- the app -------------------------------------------------------------------------------------------------------
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
        middleware = [Middleware(_HostOriginGuard, bound_host=host, allowed_hosts=options.allowed_hosts,
                                 cors_origins=options.cors_origins)]
        if options.cors_origins:
            middleware.append(Middleware(CORSMiddleware, allow_origins=list(options.cors_origins),
                                         allow_methods=["GET", "POST"],
                                         allow_headers=["Authorization", "Content-Type"]))
        middleware.append(Middleware(_ApiGuard, api_key=options.api_key))
        self.app = Starlette(routes=[
            Route("/health", self.health, methods=["GET"]),
            Route("/v1/models", self.models, methods=["GET"]),
            Route("/metrics", self.metrics, methods=["GET"]),
            Route("/v1/completions", self.completions, methods=["POST"]),
            Route("/v1/chat/completions", self.chat_completions, methods=["POST"]),
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
        body = _parse_json(raw)
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

    async def _generate(self, request: HTTPRequest, chat: bool) -> Response:
        try:
            raw = await self._read_body(request)
        except _BodyRefused as e:  # the rest of the body is not read: the connection closes after the answer
            return _error(e.status, str(e), "invalid_request_error", headers={"Connection": "close"},
                          code="request_too_large" if e.status == 413 else "request_timeout")
        except ClientDisconnect:
            client = request.client
            notes("disconnect-body", f"a client ({client.host}:{client.port}) went away before its request body "
                  "had arrived" if client else "a client went away before its request body had arrived")
            return Response(status_code=499)
        inbox = _Inbox(asyncio.get_running_loop())
        try:
            req, stream, include_usage = await run_in_threadpool(self._admit, raw, chat, inbox.put)
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


def _loop_exception_handler(loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
    """Out of file descriptors while accepting: one line (asyncio retries the accept a second later), not a
    traceback per connection."""
    exc = context.get("exception")
    if isinstance(exc, OSError) and "accept" in str(context.get("message", "")):
        notes("accept", f"cannot accept a connection: {exc.strerror or exc} (lower --max-connections or raise "
              "the open-file limit, ulimit -n)")
        return
    loop.default_exception_handler(context)


# -- connections ---------------------------------------------------------------------------------------------------
class _ConnectionGuard:
    """Which connections are open and which wait for a request head (oldest first). A head that has not arrived
    `header_timeout` seconds after the connection opened (or after its previous response) closes the connection;
    beyond `max_connections` open connections, the one that has waited longest for its head is closed (when all are
    busy with requests, the new connection is), so connections that send nothing cannot crowd out the ones that do,
    nor exhaust the process's file descriptors."""

    def __init__(self, max_connections: int, header_timeout: float) -> None:
        self.max_connections = max_connections
        self.header_timeout = header_timeout
        self.open: set[Any] = set()
        self.waiting: dict[Any, None] = {}  # insertion order: the oldest wait first
        self.timed_out = 0
        self.evicted = 0

    def opened(self, proto: Any) -> bool:
        """A new connection; False when it must be closed at once (every other connection is busy)."""
        self.open.add(proto)
        if len(self.open) <= self.max_connections:
            return True
        victim = next(iter(self.waiting), None)
        if victim is None:
            notes("conn-full", f"{len(self.open) - 1} connections are busy (--max-connections "
                  f"{self.max_connections}): closed a new one")
            return False
        self.evicted += 1
        notes("conn-evict", f"{len(self.open) - 1} connections are open (--max-connections {self.max_connections}): "
              "closed the one that had waited longest for its request head")
        victim.close_waiting()
        return True


def _guarded_h11_protocol(guard: _ConnectionGuard) -> type:
    """uvicorn's h11 protocol plus the guard: uvicorn times out idle keep-alive connections but nothing else times
    out a request head that never completes (nor counts connections but to refuse requests, which is what a flood
    of idle connections wants), so this subclass does."""
    import h11
    from uvicorn.protocols.http.h11_impl import H11Protocol

    class GuardedH11Protocol(H11Protocol):
        _head_timer: asyncio.TimerHandle | None = None

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            if not guard.opened(self):
                transport.close()
                return
            self._await_head()

        def _await_head(self) -> None:
            guard.waiting[self] = None
            self._head_timer = self.loop.call_later(guard.header_timeout, self._head_late)

        def _head_done(self) -> None:
            if self._head_timer is not None:
                self._head_timer.cancel()
                self._head_timer = None
            guard.waiting.pop(self, None)

        def _head_late(self) -> None:
            self._head_timer = None
            guard.timed_out += 1
            notes("head-timeout", f"closed a connection whose request head had not arrived within "
                  f"{guard.header_timeout:g} s")
            self.close_waiting()

        def close_waiting(self) -> None:
            self._head_done()
            if not self.transport.is_closing():
                self.transport.close()

        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            if self._head_timer is not None and self.conn.their_state is not h11.IDLE:
                self._head_done()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if (self._head_timer is None and not self.transport.is_closing()
                    and self.conn.their_state is h11.IDLE and self in guard.open):
                self._await_head()  # keep-alive: the next head must arrive in time too

        def connection_lost(self, exc: Exception | None) -> None:
            self._head_done()
            guard.open.discard(self)
            super().connection_lost(exc)

    return GuardedH11Protocol


LISTEN_BACKLOG = 2048  # connections the kernel queues until they are accepted (uvicorn's default backlog)
FD_BASE = 64  # descriptors the process needs besides its connections (model file, pipes, the listening socket)


def fit_connections(max_connections: int) -> tuple[int, int, str | None]:
    """(connections, accept batch, a note or None) that fit the open-file limit, raising the soft limit toward the
    hard one when needed. asyncio accepts up to `backlog` connections per wakeup, and a few batches are accepted
    before the guard sees them, so the limit must hold the connections plus four batches plus FD_BASE."""
    try:
        import resource
    except ImportError:  # pragma: no cover - not POSIX
        return max_connections, 128, None
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    inf = resource.RLIM_INFINITY
    want = max_connections + FD_BASE + 4 * 128
    if soft != inf and soft < want:
        try:
            new = want if hard == inf else min(want, hard)
            resource.setrlimit(resource.RLIMIT_NOFILE, (new, hard))
            soft = new
        except (ValueError, OSError):
            pass
    if soft == inf or soft >= want:
        return max_connections, 128, None
    batch = max(8, min(128, soft // 16))
    fit = max(1, min(max_connections, soft - FD_BASE - 4 * batch))
    return fit, batch, (f"the open-file limit is {soft} (ulimit -n): at most {fit} connections "
                        f"(--max-connections {max_connections})" if fit < max_connections else None)


def serve(model: Any, host: str = "127.0.0.1", port: int = 8080, n_parallel: int = 4, n_ctx: int | None = None,
          max_queue: int = 64, n_batch: int = 128, model_name: str | None = None,
          default_max_tokens: int | None = None, log: Callable[[str], None] | None = None,
          log_level: str = "warning", options: ServeOptions | None = None) -> dict[str, Any]:
    """Run the server until Ctrl-C / SIGTERM (then drain for at most `options.drain_timeout` seconds, and return the
    final metrics, with "shutdown": "drained", "cut" or "forced" and "signal"). A second signal stops at once.
    Port 0 picks a free one; the address is logged ("listening on http://HOST:PORT")."""
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
    guard = _ConnectionGuard(n_conn, options.header_timeout)
    engine = Engine(model, n_parallel=n_parallel, n_ctx=n_ctx, max_queue=max_queue, n_batch=n_batch)
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
                            http=_guarded_h11_protocol(guard), ws="none", proxy_headers=False,
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
