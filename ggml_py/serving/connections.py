"""Connections, below starlette: a request head that does not arrive in time closes its connection, and beyond a
cap the connection that has waited longest for its head is closed (uvicorn times out nothing but idle keep-alives),
so slow or silent clients cannot crowd out the others nor exhaust the process's file descriptors."""

from __future__ import annotations

import asyncio
from typing import Any

from ggml_py.serving.http_common import (
    notes,
)


class ConnectionGuard:
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


def guarded_h11_protocol(guard: ConnectionGuard) -> type:
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
