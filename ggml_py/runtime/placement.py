"""Where weights and states live: persistent memory per buffer type, made once and shared by every plan."""

from __future__ import annotations

import numpy as np

from ggml_py import counters
from ggml_py.errors import PlanError
from ggml_py.ir.tensor import PARAM, Tensor
from ggml_py.runtime.backend import Buffer, BufferType
from ggml_py.sysmem import available_memory, mib


def check_host_alloc(bt: BufferType, size: int, what: str) -> None:
    """Refuse a host allocation larger than the memory the kernel says is available (a clear PlanError rather
    than a backend's bad_alloc or the OOM killer)."""
    avail = available_memory() if bt.is_host else None
    if avail is not None and size > avail:
        raise PlanError(f"{what} needs {mib(size)} in {bt.name}, more than the {mib(avail)} of available memory")


def place_static(t: Tensor, bt: BufferType) -> tuple[Buffer, int]:
    """Persistent memory of a weight or state in buffer type `bt`, made once and shared by every plan (a model may
    call it at load to copy its weights into a backend's memory before any plan exists)."""
    placed = t._static.get(bt.name)
    if placed is not None:
        return placed
    if t.flags & PARAM:
        if t.data is None:
            raise PlanError(f"weight {t.name!r} has no data")
        buf = bt.buffer_from_host(t.data) if bt.is_host else None
        if buf is None:
            buf = bt.alloc_buffer(max(t.nbytes, 1))
            counters.bump("buffers_allocated")
            buf.set_tensor(0, np.ascontiguousarray(t.data).reshape(-1).view(np.uint8))
    else:
        check_host_alloc(bt, t.nbytes, f"state {t.name!r}")
        buf = bt.alloc_buffer(max(t.nbytes, 1))  # zeroed by contract
        counters.bump("buffers_allocated")
    buf.init_tensor(t, 0)
    t._static[bt.name] = (buf, 0)
    return buf, 0
