"""What the HTTP layer's parts share: the server extra's import guard, the limits that are constants, the error
body OpenAI clients expect, and rate-limited log lines about what clients do."""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Mapping

from ggml_py.errors import GgmlPyError

try:  # the optional extra: ggml_py[server]
    from starlette.responses import JSONResponse, Response
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


def error_response(status: int, message: str, etype: str, param: str | None = None,
           headers: Mapping[str, str] | None = None, code: str | None = None) -> Response:
    body = {"error": {"message": message, "type": etype, "param": param, "code": code}}
    return JSONResponse(body, status_code=status, headers=dict(headers) if headers else None)
