"""The backend interface: buffer types, buffers, devices, backends and their registration.

These are ggml's concepts (ggml-backend.h) as Python ABCs. A backend package implements them and exposes a
`BackendRegistration` through the `ggml_py.backends` entry-point group; the core never imports a backend.
See docs/backend-interface.md.
"""

from __future__ import annotations

import ctypes
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ggml_py.errors import BackendError, GgmlPyError
from ggml_py.ir.symbolic import Dim, Sym, evaluate
from ggml_py.ir.tensor import Tensor
from ggml_py.runtime.threads import pool_threads


class ComputeCancelled(BackendError):
    """A compute stopped by `Plan.cancel` (or a backend's graph_plan_cancel) before it finished."""


class BufferType(ABC):
    """A kind of memory a backend can compute on (host RAM, device memory, ...)."""

    name: str = "?"
    alignment: int = 64
    max_size: int = 1 << 62
    is_host: bool = True

    def alloc_size(self, tensor: Tensor) -> int:
        """Bytes a tensor needs in this buffer type (at the upper bound of its symbolic dims)."""
        return tensor.nbytes

    @abstractmethod
    def alloc_buffer(self, size: int) -> Buffer:
        """A new zeroed buffer of at least `size` bytes."""

    def buffer_from_host(self, array: np.ndarray) -> Buffer | None:
        """Wrap existing host memory (e.g. an mmap'd weight) without copying, or None if this type cannot."""
        return None

    def __repr__(self) -> str:
        return f"<BufferType {self.name}>"


class Buffer(ABC):
    """A block of memory of one buffer type. Offsets are bytes from the buffer's start."""

    buffer_type: BufferType
    size: int

    @property
    def base(self) -> int:
        """Host address of byte 0 (host buffers), or an opaque handle."""
        raise NotImplementedError

    def host_view(self) -> np.ndarray:
        """The whole buffer as a uint8 numpy array over the same memory (host buffers only)."""
        raise NotImplementedError(f"{type(self).__name__} is not host memory")

    def init_tensor(self, tensor: Tensor, offset: int) -> None:
        """Called once when a tensor is placed at `offset` (a hook for backends that need per-tensor setup)."""

    @abstractmethod
    def set_tensor(self, offset: int, data: bytes | memoryview | np.ndarray) -> None:
        """Copy host bytes into the buffer at `offset`."""

    @abstractmethod
    def get_tensor(self, offset: int, size: int) -> np.ndarray:
        """A host copy (uint8) of `size` bytes at `offset`."""

    def memset(self, offset: int, value: int, size: int) -> None:
        self.set_tensor(offset, np.full(size, value, dtype=np.uint8))

    def clear(self, value: int = 0) -> None:
        self.memset(0, value, self.size)

    def copy_tensor(self, src: Buffer, src_offset: int, dst_offset: int, size: int) -> bool:
        """Copy from another buffer directly if possible; False lets the caller go through host memory."""
        return False

    def free(self) -> None:
        """Release the memory now (it is also released when the object is collected)."""

    def _check(self, offset: int, size: int) -> None:
        if offset < 0 or size < 0 or offset + size > self.size:
            from ggml_py.errors import BackendError

            raise BackendError(f"access of {size} bytes at offset {offset} is outside a buffer of {self.size} bytes")


class HostBuffer(Buffer):
    """A host buffer over a numpy uint8 array: owned, or wrapping memory it does not own (zero-copy)."""

    def __init__(self, buffer_type: BufferType, array: np.ndarray, owner: Any = None) -> None:
        if array.dtype != np.uint8 or array.ndim != 1:
            array = array.reshape(-1).view(np.uint8)
        self.buffer_type = buffer_type
        self.size = array.nbytes
        self._array = array
        self._owner = owner  # keeps wrapped memory (an mmap, a native allocation) alive

    @property
    def base(self) -> int:
        return int(self._array.__array_interface__["data"][0])

    def host_view(self) -> np.ndarray:
        return self._array

    def set_tensor(self, offset: int, data: bytes | memoryview | np.ndarray) -> None:
        src = np.frombuffer(data, dtype=np.uint8) if not isinstance(data, np.ndarray) else data.reshape(-1).view(
            np.uint8)
        self._check(offset, src.nbytes)
        self._array[offset: offset + src.nbytes] = src

    def get_tensor(self, offset: int, size: int) -> np.ndarray:
        self._check(offset, size)
        return self._array[offset: offset + size].copy()

    def memset(self, offset: int, value: int, size: int) -> None:
        self._check(offset, size)
        self._array[offset: offset + size] = value

    def copy_tensor(self, src: Buffer, src_offset: int, dst_offset: int, size: int) -> bool:
        if not src.buffer_type.is_host:
            return False
        src._check(src_offset, size)
        self._check(dst_offset, size)
        self._array[dst_offset: dst_offset + size] = src.host_view()[src_offset: src_offset + size]
        return True

    def free(self) -> None:
        self._array = np.zeros(0, dtype=np.uint8)
        self._owner = None
        self.size = 0


def host_array_address(a: np.ndarray) -> int:
    return int(a.__array_interface__["data"][0])


def aligned_host_array(size: int, alignment: int = 64) -> np.ndarray:
    """A zeroed uint8 array of `size` bytes whose first byte is `alignment`-aligned."""
    raw = np.zeros(size + alignment, dtype=np.uint8)
    shift = (-host_array_address(raw)) % alignment
    return raw[shift: shift + size]


@dataclass
class Device:
    """What a backend runs on. `score` 0 means it cannot run on this machine."""

    name: str
    description: str = ""
    memory_total: int = 0
    memory_free: int = 0
    n_threads: int = 1
    score: int = 1
    caps: dict[str, Any] = field(default_factory=dict)


@dataclass
class Split:
    """A run of consecutive nodes that one backend computes, as handed to `Backend.graph_plan_create`."""

    backend: Backend
    nodes: list[Tensor]
    symbols: tuple[Sym, ...]
    locations: Mapping[int, tuple[Buffer, int]]  # root tensor id -> (buffer, byte offset)

    def address(self, t: Tensor) -> tuple[Buffer, Dim]:
        """Buffer and byte offset of `t`'s first element (views resolved to their root)."""
        root = t.view_src if t.view_src is not None else t
        buf, off = self.locations[root.id]
        return buf, off + t.view_offs if t.view_src is not None else off

    def layout(self, t: Tensor, bindings: Mapping[str, int]) -> tuple[tuple[int, ...], tuple[int, ...], int]:
        """Concrete (shape, byte strides, byte offset) of `t` for the given symbol values."""
        _, off = self.address(t)
        return (tuple(evaluate(d, bindings) for d in t.shape), tuple(evaluate(s, bindings) for s in t.strides),
                evaluate(off, bindings))


class NodePlan:
    """A Python backend's lowered split as one callable per node, which `Backend.graph_plan_compute` runs in order.

    A backend whose graph_plan_create returns one gets, without code of its own, what native plugins get from the
    ABI: an exception in a node reaches the user as a BackendError naming the backend, the op and the node (the
    original exception as its cause); `Plan.profile` and `ggml-py generate --profile` see the time of every node;
    `Plan.cancel` stops a compute between two nodes."""

    def __init__(self, nodes: Sequence[Tensor], steps: Sequence[Callable[[Mapping[str, int]], None]]) -> None:
        if len(nodes) != len(steps):
            raise ValueError(f"{len(nodes)} nodes but {len(steps)} steps")
        self.nodes, self.steps = list(nodes), list(steps)
        self.node_seconds: list[float] | None = None  # accumulated per node while profiling
        self._cancel = threading.Event()

    def run(self, backend: str, bindings: Mapping[str, int]) -> None:
        self._cancel.clear()  # a cancel reaches the compute running when it is asked, not a later one
        secs = self.node_seconds
        n = len(self.nodes)
        for i, (node, step) in enumerate(zip(self.nodes, self.steps)):
            if self._cancel.is_set():
                raise ComputeCancelled(f"backend {backend!r}: compute cancelled before node {i + 1} of {n}")
            t0 = time.perf_counter() if secs is not None else 0.0
            try:
                step(bindings)
            except GgmlPyError:
                raise
            except Exception as e:
                raise BackendError(f"backend {backend!r} failed in {node.op} (node {node.name!r}, {i + 1} of {n}): "
                                   f"{type(e).__name__}: {e}") from e
            if secs is not None:
                secs[i] += time.perf_counter() - t0


class Backend(ABC):
    """Evaluates graph splits. Subclasses implement supports_op and the plan methods (a Python backend may return
    a NodePlan from graph_plan_create and leave the rest to this class)."""

    name: str = "?"
    device: Device
    default_buffer_type: BufferType

    @abstractmethod
    def supports_op(self, node: Tensor) -> bool:
        """True if this backend can compute `node` (op, types, layouts)."""

    def supports_buffer_type(self, buffer_type: BufferType) -> bool:
        """True if kernels can read tensors living in `buffer_type` directly."""
        return buffer_type is self.default_buffer_type or (buffer_type.is_host and self.default_buffer_type.is_host)

    @abstractmethod
    def graph_plan_create(self, split: Split) -> Any:
        """Lower a split once into this backend's own executable form."""

    def graph_plan_compute(self, plan: Any, bindings: Mapping[str, int]) -> None:
        """Run a lowered split with the given symbol values. Called every step: keep it cheap. The default runs a
        NodePlan; a backend with a plan of another kind overrides this."""
        if not isinstance(plan, NodePlan):
            raise NotImplementedError(f"{type(self).__name__}.graph_plan_compute for a {type(plan).__name__}")
        with pool_threads(self.n_threads):  # the backend's thread budget, also for the BLAS its steps call
            plan.run(self.name, bindings)

    def graph_plan_free(self, plan: Any) -> None:
        """Release what graph_plan_create made."""

    # The three hooks Plan.profile and Plan.cancel use; the defaults serve a NodePlan (native plugins: the ABI's).
    def graph_plan_profile(self, plan: Any, on: bool) -> None:
        """Start (zeroing) or stop accumulating per-node wall time."""
        if isinstance(plan, NodePlan):
            plan.node_seconds = [0.0] * len(plan.nodes) if on else None

    def graph_plan_node_seconds(self, plan: Any) -> list[float] | None:
        """Per-node seconds accumulated since profiling started (split.nodes order), or None when not timed."""
        secs = plan.node_seconds if isinstance(plan, NodePlan) else None
        return list(secs) if secs is not None else None

    def graph_plan_cancel(self, plan: Any) -> None:
        """Ask a compute of `plan` running in another thread to stop soon (ComputeCancelled); no effect when the
        backend cannot stop one (the compute then ends normally)."""
        if isinstance(plan, NodePlan):
            plan._cancel.set()

    def graph_compute(self, split: Split, bindings: Mapping[str, int]) -> None:
        plan = self.graph_plan_create(split)
        try:
            self.graph_plan_compute(plan, bindings)
        finally:
            self.graph_plan_free(plan)

    def synchronize(self) -> None:
        """Wait for queued work (synchronous backends need not override)."""

    # Asynchronous execution (optional). A backend whose work runs on a queue of its own (a device) sets is_async
    # and implements the four methods below; Plan.compute then enqueues its splits and the host copies into its
    # memory, and waits on events only where a result is needed, so the host computes other backends' splits while
    # the queue works. The rules (what memory stays untouched until when) are the C ABI's (docs/backend-interface.md).
    is_async: bool = False

    def graph_plan_compute_async(self, plan: Any, bindings: Mapping[str, int]) -> None:
        """Enqueue a compute of `plan` and return (errors surface at event_synchronize)."""
        self.graph_plan_compute(plan, bindings)

    def set_tensor_async(self, buffer: Buffer, offset: int, data: np.ndarray) -> None:
        """Enqueue a copy of host bytes `data` (kept untouched until a later event is synchronized) into `buffer`."""
        buffer.set_tensor(offset, data)

    def event_record(self) -> Any:
        """A marker after everything enqueued so far."""
        return None

    def event_synchronize(self, event: Any) -> float | None:
        """Wait until the queue has passed `event`; the time.monotonic() at which it did (None: unknown). Raises
        BackendError for a failure of queued work before the event."""
        return None

    def weight_cache_bytes(self, weights: Sequence[Tensor]) -> int:
        """Bytes of memory this backend will add for its own copies of `weights` (converted or repacked forms it
        caches), beyond the weights themselves; used to refuse a model that would not fit before loading it."""
        return 0

    @property
    def n_threads(self) -> int:
        return self.device.n_threads

    def set_n_threads(self, n: int) -> None:
        self.device.n_threads = int(n)

    def __repr__(self) -> str:
        return f"<Backend {self.name}>"


class BackendRegistration(ABC):
    """What a `ggml_py.backends` entry point returns: the backend's name, version, devices and a factory."""

    name: str
    version: str = "0"

    @abstractmethod
    def devices(self) -> Sequence[Device]:
        """The devices this backend can use here (score 0: present but unusable)."""

    @abstractmethod
    def create(self, device: Device | None = None, **options: Any) -> Backend:
        """A backend instance on `device` (default: the best one). Options such as n_threads are backend-specific."""


def ctypes_view(address: int, size: int) -> np.ndarray:
    """A uint8 numpy array over raw host memory (the caller keeps the memory alive)."""
    if size == 0:
        return np.zeros(0, dtype=np.uint8)
    return np.ctypeslib.as_array((ctypes.c_uint8 * size).from_address(address))
