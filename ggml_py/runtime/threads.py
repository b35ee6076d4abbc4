"""The thread budget of Python backends: their BLAS and OpenMP pools held to the backend's n_threads.

numpy's BLAS (OpenBLAS) starts one thread per core and keeps them spinning for a while after each call. A Python
backend that calls it between two splits of a native backend therefore competes with that backend's threads for the
same cores (a numpy plugin beside simd on 2 cores: 1.7 tok/s, 8.7 with OPENBLAS_NUM_THREADS=1). The runtime holds
those pools to the backend's n_threads while it computes a NodePlan (threadpoolctl; about 8 us a compute)."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import Any

_lock = threading.Lock()
_controller: Any = None


def _pools() -> Any:
    global _controller
    with _lock:
        if _controller is None:
            from threadpoolctl import ThreadpoolController

            _controller = ThreadpoolController()  # finds the BLAS / OpenMP libraries loaded now, once
        return _controller


@contextlib.contextmanager
def pool_threads(n: int) -> Iterator[None]:
    """BLAS and OpenMP pools limited to `n` threads inside the block."""
    with _pools().limit(limits=max(1, int(n))):
        yield
