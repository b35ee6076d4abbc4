"""toy: a small ggml_py backend in pure Python, using only ggml_py's public backend interface.

It computes ADD, MUL (with ggml's broadcasting), SCALE and SILU on F32 tensors of any layout and any symbolic
shape, on host memory of its own buffer type. Every other node is declined by `supports_op`, and the scheduler hands
it to the next backend in the list (numpy).

The four pieces every backend has:
  ToyBufferType      the memory it computes on (host RAM here, so numpy can read it too)
  ToyBackend         supports_op + graph_plan_create (lower a split once: a NodePlan) + graph_plan_compute (run it)
  ToyRegistration    what the `ggml_py.backends` entry point returns: name, version, devices, a factory
  register()         the entry point itself (see pyproject.toml)
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from ggml_py.ir import dtypes
from ggml_py.ir.tensor import Tensor
from ggml_py.runtime.backend import (
    Backend,
    BackendRegistration,
    Buffer,
    BufferType,
    Device,
    HostBuffer,
    NodePlan,
    Split,
    aligned_host_array,
)

__version__ = "0.1.0"

Kernel = Callable[[Tensor, list[np.ndarray]], np.ndarray]


def _tile(b: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    """ggml's broadcast of a binary op's second operand: each dim of b divides the one of the result."""
    b = b.reshape((1,) * (len(shape) - b.ndim) + b.shape)
    return np.tile(b, tuple(s // d for s, d in zip(shape, b.shape)))


def _silu(x: np.ndarray) -> np.ndarray:
    return (x / (1.0 + np.exp(-x.astype(np.float64)))).astype(np.float32)


KERNELS: dict[str, Kernel] = {
    "ADD": lambda n, s: s[0] + _tile(s[1], s[0].shape),
    "MUL": lambda n, s: s[0] * _tile(s[1], s[0].shape),
    "SCALE": lambda n, s: s[0] * np.float32(n.params["s"]) + np.float32(n.params["b"]),
    "SILU": lambda n, s: _silu(s[0]),
}


class ToyBufferType(BufferType):
    name = "toy"
    alignment = 64
    is_host = True

    def alloc_buffer(self, size: int) -> Buffer:
        return HostBuffer(self, aligned_host_array(size, self.alignment))  # zeroed, as the interface requires


def _array(split: Split, t: Tensor, bindings: Mapping[str, int]) -> np.ndarray:
    """A float32 numpy view of t in its buffer for the current symbol values."""
    buf, _ = split.address(t)
    shape, strides, offset = split.layout(t, bindings)
    return np.ndarray(shape, np.float32, buffer=buf.host_view(), offset=offset, strides=strides)


def _step(split: Split, node: Tensor) -> Callable[[Mapping[str, int]], None]:
    """The callable that computes `node` at every compute, its kernel picked once."""
    kernel = KERNELS[node.op]  # type: ignore[index]

    def run(bindings: Mapping[str, int]) -> None:
        srcs = [_array(split, s, bindings) for s in node.src if s is not None]
        _array(split, node, bindings)[...] = kernel(node, srcs)

    return run


class ToyBackend(Backend):
    name = "toy"

    def __init__(self, device: Device) -> None:
        self.device = device
        self.default_buffer_type = ToyBufferType()

    def supports_op(self, node: Tensor) -> bool:
        return node.op in KERNELS and all(t.dtype is dtypes.F32 for t in (node, *node.src) if t is not None)

    def graph_plan_create(self, split: Split) -> NodePlan:
        # a NodePlan: the runtime then names the node a kernel failed in, times nodes, and can cancel between them
        return NodePlan(split.nodes, [_step(split, n) for n in split.nodes])

    def graph_plan_compute(self, plan: NodePlan, bindings: Mapping[str, int]) -> None:
        with np.errstate(all="ignore"):  # inf / nan are results, as in C
            plan.run(self.name, bindings)


class ToyRegistration(BackendRegistration):
    name = "toy"
    version = __version__

    def devices(self) -> list[Device]:
        return [Device("cpu", "toy: numpy kernels for ADD, MUL, SCALE, SILU (F32)", n_threads=1, score=5,
                       caps={"host_buffer": True})]

    def create(self, device: Device | None = None, **options: Any) -> Backend:
        dev = device or self.devices()[0]
        return ToyBackend(Device(dev.name, dev.description, n_threads=int(options.get("n_threads") or 1),
                                 score=dev.score, caps=dict(dev.caps)))


def register() -> BackendRegistration:
    """The `ggml_py.backends` entry point (pyproject.toml: toy = "ggml_py_toy:register")."""
    return ToyRegistration()
