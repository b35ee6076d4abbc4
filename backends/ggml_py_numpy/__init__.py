"""The reference backend: every op and every type in vectorised numpy.

It is registered through the `ggml_py.backends` entry point exactly as a third-party plugin would be, and uses only
the public interface of ggml_py. It is the fallback the scheduler puts last, and the reference the conformance kit
compares other backends against.
"""

from __future__ import annotations

import os
import weakref
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from ggml_py.formats.quants import dequantize
from ggml_py.ir import dtypes
from ggml_py.ir.tensor import PARAM, Tensor
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

from .kernels import KERNELS, bf16_to_f32, convert

__version__ = "0.1.0"


class NumpyBufferType(BufferType):
    name = "numpy"
    alignment = 64
    is_host = True

    def alloc_buffer(self, size: int) -> Buffer:
        return HostBuffer(self, aligned_host_array(size, self.alignment))

    def buffer_from_host(self, array: np.ndarray) -> Buffer | None:
        if not array.flags.c_contiguous:
            return None
        return HostBuffer(self, array.reshape(-1).view(np.uint8), owner=array)


def _view(hv: np.ndarray, t: Tensor, layout: tuple[tuple[int, ...], tuple[int, ...], int]) -> np.ndarray:
    """A numpy array over the buffer memory of t: typed for scalar types, raw rows (uint8) for quantized ones."""
    shape, strides, off = layout
    if t.dtype.is_quantized:
        rows = (*shape[:-1], t.dtype.row_size(shape[-1]))
        return np.ndarray(rows, np.uint8, buffer=hv, offset=off, strides=(*strides[:-1], 1))
    return np.ndarray(shape, t.dtype.np_dtype, buffer=hv, offset=off, strides=strides)


def _as_float(t: Tensor, a: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    if t.dtype.is_quantized:
        return dequantize(a, t.dtype).reshape(shape)
    if t.dtype is dtypes.BF16:
        return bf16_to_f32(a)
    if t.dtype is dtypes.F16:
        return a.astype(np.float32)
    return a


class _QuantizedRows:
    """A large weight left quantized: dequantized a block of rows at a time, per call, never kept whole."""

    BLOCK_BYTES = 16 << 20  # F32 bytes per block

    def __init__(self, t: Tensor, raw: np.ndarray, shape: tuple[int, ...]) -> None:
        self.t, self.raw, self.shape = t, raw, shape

    def rows(self, start: int, stop: int) -> np.ndarray:
        return _as_float(self.t, self.raw[..., start:stop, :], (*self.shape[:-2], stop - start, self.shape[-1]))

    def blocks(self) -> list[tuple[int, int]]:
        n = self.shape[-2]
        step = max(1, self.BLOCK_BYTES // (4 * self.shape[-1] * int(np.prod(self.shape[:-2], dtype=np.int64))))
        return [(r, min(n, r + step)) for r in range(0, n, step)]


class _Experts:
    """A large quantized expert tensor (E, M, K) indexed by expert: each one dequantized when the kernel asks."""

    def __init__(self, w: _QuantizedRows) -> None:
        self.w = w

    def __getitem__(self, e: int) -> np.ndarray:
        return _as_float(self.w.t, self.w.raw[e], self.w.shape[1:])


def _run_streamed(kernel: Any, n: Tensor, srcs: list, shape: tuple[int, ...]) -> np.ndarray:
    """MUL_MAT by blocks of the weight's rows (= blocks of output columns); GET_ROWS of the requested rows only;
    MUL_MAT_ID one expert at a time; any other op on such a weight (none in the models) dequantizes it for this call."""
    w = srcs[0]
    if n.op == "MUL_MAT" and isinstance(w, _QuantizedRows) and not any(isinstance(x, _QuantizedRows) for x in srcs[1:]):
        return np.concatenate([kernel(n, [w.rows(r0, r1), *srcs[1:]], shape) for r0, r1 in w.blocks()], axis=-1)
    if n.op == "GET_ROWS" and isinstance(w, _QuantizedRows) and len(w.shape) == 2:
        idx = np.asarray(srcs[1])
        flat = idx.reshape(-1).astype(np.intp)
        uniq, inv = np.unique(flat, return_inverse=True)
        rows = w.shape[0]
        if uniq.size and (uniq[0] < 0 or uniq[-1] >= rows):
            kernel(n, [np.empty((rows, 0), np.float32), idx], shape)  # raises the kernel's out-of-range error
        got = _as_float(w.t, w.raw[uniq], (uniq.size, w.shape[1]))
        return got[inv].reshape((*idx.shape, w.shape[1]))
    if n.op == "MUL_MAT_ID" and isinstance(w, _QuantizedRows):  # only the experts the ids name, one at a time
        return kernel(n, [_Experts(w), *srcs[1:]], shape)
    whole = [x.rows(0, x.shape[-2]) if isinstance(x, _QuantizedRows) else x for x in srcs]
    return kernel(n, whole, shape)


class _Step:
    """One node with its operands resolved: array views made once where no symbol is involved."""

    def __init__(self, backend: NumpyBackend, split: Split, node: Tensor) -> None:
        self.node = node
        self.kernel = KERNELS[node.op]  # type: ignore[index]
        self.tensors = [node, *node.src]
        self.hvs = []
        self.fixed: list[np.ndarray | None] = []
        self.backend = backend
        for t in self.tensors:
            if t is None:
                self.hvs.append(None)
                self.fixed.append(None)
                continue
            buf, _ = split.address(t)
            hv = buf.host_view()
            self.hvs.append(hv)
            self.fixed.append(None if t.is_symbolic else _view(hv, t, split.layout(t, {})))
        self.split = split

    def operand(self, i: int, bindings: Mapping[str, int]) -> tuple[np.ndarray, tuple[int, ...]]:
        t = self.tensors[i]
        assert t is not None
        layout = self.split.layout(t, bindings)
        a = self.fixed[i]
        if a is None:
            a = _view(self.hvs[i], t, layout)
        return a, layout[0]

    def __call__(self, bindings: Mapping[str, int]) -> None:
        n = self.node
        srcs: list[np.ndarray | None] = []
        for i, s in enumerate(n.src, start=1):
            if s is None:
                srcs.append(None)
                continue
            a, shape = self.operand(i, bindings)
            root = s.view_src if s.view_src is not None else s
            if root.flags & PARAM and s.dtype not in (dtypes.F32, dtypes.I32) and not s.is_symbolic:
                if self.backend.keeps_f32_copy(s):
                    srcs.append(self.backend.dequantized(s, a, shape))
                else:
                    srcs.append(_QuantizedRows(s, a, shape))
            else:
                srcs.append(_as_float(s, a, shape) if s.dtype is not dtypes.I32 else a)
        dst, shape = self.operand(0, bindings)
        if any(isinstance(x, _QuantizedRows) for x in srcs):
            out = _run_streamed(self.kernel, n, srcs, shape)
        else:
            out = self.kernel(n, srcs, shape)
        if n.op == "SET_ROWS":
            idx = srcs[2].astype(np.intp)  # type: ignore[union-attr]
            if idx.size and (idx.min() < 0 or idx.max() >= shape[0]):
                from ggml_py.errors import BackendError

                raise BackendError(f"SET_ROWS {n.name}: row index out of range 0..{shape[0] - 1}")
            dst[idx] = convert(out, n.dtype)
            return
        if n.op in ("CPY", "CONT"):
            out = out.reshape(shape)
        if n.dtype.is_quantized:
            dst[...] = convert(out, n.dtype).reshape(dst.shape)
        else:
            dst[...] = convert(np.asarray(out), n.dtype)


class NumpyBackend(Backend):
    name = "numpy"
    F32_COPY_LIMIT = 64 << 20

    def __init__(self, device: Device) -> None:
        self.device = device
        self.default_buffer_type = NumpyBufferType()
        # per weight (weakly keyed: an entry dies with its tensor, so a freed weight's address can't give stale data)
        self._dequant_cache: weakref.WeakKeyDictionary[Tensor, dict[tuple, np.ndarray]] = weakref.WeakKeyDictionary()

    def supports_op(self, node: Tensor) -> bool:
        return node.op in KERNELS

    def keeps_f32_copy(self, t: Tensor) -> bool:
        """Weights up to F32_COPY_LIMIT bytes as F32 are dequantized once and kept; larger ones (a 262k-token
        embedding used as the output head: 640 MiB as F32) are dequantized by blocks of rows at each use."""
        return t.dtype is not dtypes.F32 and int(t.numel()) * 4 <= self.F32_COPY_LIMIT

    def dequantized(self, t: Tensor, raw: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
        """Weights never change: dequantize each once and keep it."""
        cache = self._dequant_cache.setdefault(t.view_src if t.view_src is not None else t, {})
        key = (raw.__array_interface__["data"][0], raw.shape, raw.strides, t.dtype.name)
        hit = cache.get(key)
        if hit is None:
            hit = _as_float(t, raw, shape)
            cache[key] = hit
        return hit

    def weight_cache_bytes(self, weights: Sequence[Tensor]) -> int:
        """Every weight that is not F32, up to F32_COPY_LIMIT, is dequantized to an F32 copy on first use and kept."""
        return sum(int(t.numel()) * 4 for t in weights if self.keeps_f32_copy(t))

    def graph_plan_create(self, split: Split) -> NodePlan:
        return NodePlan(split.nodes, [_Step(self, split, n) for n in split.nodes])

    def graph_plan_compute(self, plan: NodePlan, bindings: Mapping[str, int]) -> None:
        with np.errstate(all="ignore"):  # inf/nan are results here, as in C
            super().graph_plan_compute(plan, bindings)


class NumpyRegistration(BackendRegistration):
    name = "numpy"
    version = __version__

    def devices(self) -> list[Device]:
        return [Device("cpu", "numpy reference (host memory)", n_threads=1, score=1,
                       caps={"host_buffer": True, "reference": True, "numpy": np.__version__})]

    def create(self, device: Device | None = None, **options: Any) -> Backend:
        dev = device or self.devices()[0]
        return NumpyBackend(Device(dev.name, dev.description, n_threads=int(options.get("n_threads") or
                                   os.cpu_count() or 1), score=dev.score, caps=dev.caps))


def register() -> BackendRegistration:
    """Entry point of the `ggml_py.backends` group."""
    return NumpyRegistration()
