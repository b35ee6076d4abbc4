"""Process-wide counters of preparation work, so tests and benchmarks can prove what a step did not do."""

from __future__ import annotations

import threading
from collections import Counter

_lock = threading.Lock()
_counts: Counter[str] = Counter()


def bump(name: str, n: int = 1) -> None:
    with _lock:
        _counts[name] += n


def snapshot() -> dict[str, int]:
    """Current values: graphs_built, plans_prepared, buffers_allocated, plan_computes, ..."""
    with _lock:
        return dict(_counts)
