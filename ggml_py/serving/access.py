"""The access policy, as ASGI middleware: the Host header and the Origin of browser requests (cross-site requests
blocked by default), an API key (Bearer, compared in constant time), JSON-only API routes."""

from __future__ import annotations

import hmac
import ipaddress
from typing import Any
from urllib.parse import urlsplit

from starlette.datastructures import Headers

from ggml_py.serving.http_common import (
    LOCAL_HOSTS,
    error_response,
)


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


class HostOriginGuard:
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
            await error_response(403, f"the Host header {host_header!r} is not one of this server's names (see "
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
                await error_response(403, f"cross-origin requests from {origin!r} are not allowed (see --cors-origins)",
                             "invalid_request_error", code="origin_not_allowed")(scope, receive, send)
                return
        await self.app(scope, receive, send)


class ApiGuard:
    """The API routes: a bearer key when one is set (constant-time comparison; 401), and JSON request bodies only
    (415), so that a browser's "simple" cross-origin POST (text/plain, a form) cannot start a generation."""

    PROTECTED = ("/v1/", "/metrics", "/tokenize", "/detokenize", "/tokenizer_info")

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
                await error_response(401, msg, "invalid_request_error", code="invalid_api_key",
                             headers={"WWW-Authenticate": "Bearer"})(scope, receive, send)
                return
        if scope["method"] == "POST":
            ctype = headers.get("content-type", "").split(";")[0].strip().lower()
            if ctype != "application/json":
                await error_response(415, f"the request body must be JSON (Content-Type: application/json), not "
                             f"{ctype or 'unspecified'!r}", "invalid_request_error",
                             code="unsupported_media_type")(scope, receive, send)
                return
        await self.app(scope, receive, send)
