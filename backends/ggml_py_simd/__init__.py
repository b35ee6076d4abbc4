"""The SIMD backend: C++ kernels (scalar / AVX2 / AVX-512, chosen at run time) behind ggml_py's backend interface.

Registered through the `ggml_py.backends` entry point like any plugin, using only ggml_py's public interface.
`graph_plan_create` lowers a split once into a flat node list (numpy-order shapes and strides reversed into ggml
order, symbolic dims as affine expressions) that the compiled module `_simd` validates and keeps; every
`graph_plan_compute` is then one C call with the GIL released, on a persistent thread pool. See docs/simd.md.

Environment: `GGML_PY_SIMD=scalar|avx2|avx512` forces a level (an error if the CPU lacks it);
`GGML_PY_SIMD_THREADS` overrides the default thread count (the number of physical cores).
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from ggml_py import dtypes
from ggml_py.backend import Backend, BackendRegistration, Buffer, BufferType, Device, HostBuffer, Split
from ggml_py.errors import BackendError, PlanError
from ggml_py.symbolic import Expr
from ggml_py.tensor import PARAM, Tensor

__version__ = "0.1.0"

try:
    from . import _simd
except ImportError as _e:  # pragma: no cover - the extension is not built
    _simd = None
    _IMPORT_ERROR: Exception | None = _e
else:
    _IMPORT_ERROR = None

# ggml op name -> C op code (the kit's op set; DUP is CONT's alias in ggml)
OPS: dict[str, int] = dict(_simd.OPS) if _simd is not None else {}


def _require() -> Any:
    if _simd is None:
        raise BackendError(f"the simd backend's compiled module is not available: {_IMPORT_ERROR}")
    return _simd


def _apply_env_level() -> None:
    want = os.environ.get("GGML_PY_SIMD", "").strip().lower()
    if not want:
        return
    try:
        _require().set_level(want)
    except ValueError as e:
        raise BackendError(f"GGML_PY_SIMD={want}: {e}") from None


def level() -> str:
    """The active SIMD level (plans built from now on use it)."""
    return _require().level()


def set_level(name: str) -> None:
    """Select the SIMD level for plans built afterwards; BackendError if the CPU lacks it."""
    try:
        _require().set_level(name)
    except ValueError as e:
        raise BackendError(str(e)) from None


def levels() -> list[str]:
    """The levels this CPU supports, lowest first."""
    return list(_require().levels())


# ---------------------------------------------------------------------------------------------------------------
# memory

class SimdBuffer(HostBuffer):
    """Host memory the kernels compute on: a 64-byte aligned `_simd.Buffer`, or wrapped host memory (zero-copy)."""

    def __init__(self, buffer_type: BufferType, native: Any) -> None:
        arr = np.asarray(native)  # a uint8 view over the native memory; keeps `native` alive
        super().__init__(buffer_type, arr, owner=native)
        self.native = native


class SimdBufferType(BufferType):
    name = "simd"
    alignment = 64
    is_host = True

    def alloc_buffer(self, size: int) -> Buffer:
        return SimdBuffer(self, _require().Buffer(max(int(size), 1)))

    def buffer_from_host(self, array: np.ndarray) -> Buffer | None:
        if not isinstance(array, np.ndarray) or not array.flags.c_contiguous:
            return None
        try:
            hv = _require().HostView(array)
        except (BufferError, TypeError, ValueError):
            return None
        return SimdBuffer(self, hv)


# ---------------------------------------------------------------------------------------------------------------
# lowering: ggml_py tensors -> the C plan's node descriptions

_F32, _F16, _BF16, _I32, _I64 = dtypes.F32, dtypes.F16, dtypes.BF16, dtypes.I32, dtypes.I64


class _Syms:
    def __init__(self, symbols: Sequence[Any]) -> None:
        self.names = [s.name for s in symbols]
        self.max = [int(s.max) for s in symbols]
        self.index = {n: i for i, n in enumerate(self.names)}

    def value(self, d: Any) -> Any:
        """An int, or (c0, [(symbol index, coef), ...]) for an affine expression."""
        if isinstance(d, Expr):
            if d.is_const:
                return int(d.const)
            terms = []
            for s, c in d.terms:
                if s.name not in self.index:  # a symbol the split was not told about
                    self.index[s.name] = len(self.names)
                    self.names.append(s.name)
                    self.max.append(int(s.max))
                terms.append((self.index[s.name], int(c)))
            return (int(d.const), terms)
        return int(d)


def _pad_ggml(shape: Sequence[Any], strides: Sequence[Any], syms: _Syms, elem: int) -> tuple[list, list]:
    ne = [syms.value(d) for d in reversed(tuple(shape))]
    nb = [syms.value(s) for s in reversed(tuple(strides))]
    if not ne:
        ne, nb = [1], [elem]
    while len(ne) < 4:
        last_ne, last_nb = ne[-1], nb[-1]
        nb.append(last_ne * last_nb if isinstance(last_ne, int) and isinstance(last_nb, int) else 0)
        ne.append(1)
    return ne, nb


def _tensor_desc(t: Tensor, syms: _Syms, address: tuple[int, Any] | None) -> tuple:
    """(type id, ne[4], nb[4], base, offset, const id) in ggml order. address: (base, byte offset) or None
    (validation). The const id (unique per weight, 0 otherwise) lets the module repack a weight once."""
    ne, nb = _pad_ggml(t.shape, t.strides, syms, t.dtype.type_size)
    base, off = address if address is not None else (0, 0)
    root = t.view_src if t.view_src is not None else t
    const_id = root.id + 1 if root.flags & PARAM else 0
    return (t.dtype.ggml_id, ne, nb, int(base), syms.value(off), const_id)


def _describe(node: Tensor, syms: _Syms, addr) -> tuple:
    """The C node description of `node`; addr(t) gives (base, offset) of a tensor or None."""
    op = node.op
    p = node.params
    ip: list[int] = []
    fp: list[float] = []
    s = node.src
    if op == "CPY":
        srcs = [s[0]]
    elif op == "SET_ROWS":
        srcs = [s[1], s[2]]
    elif op in ("SOFT_MAX",):
        srcs = [s[0], s[1] if len(s) > 1 else None]
        fp = [float(p.get("scale", 1.0)), float(p.get("max_bias", 0.0))]
    elif op == "FLASH_ATTN_EXT":
        srcs = [s[0], s[1], s[2], s[3] if len(s) > 3 else None]
        fp = [float(p.get("scale", 1.0)), float(p.get("max_bias", 0.0)), float(p.get("softcap", 0.0))]
    else:
        srcs = list(s)
    if op == "SCALE":
        fp = [float(p["s"]), float(p.get("b", 0.0))]
    elif op == "CLAMP":
        fp = [float(p["min"]), float(p["max"])]
    elif op in ("NORM", "RMS_NORM"):
        fp = [float(p["eps"])]
    elif op == "ROPE":
        ip = [int(p["n_dims"]), int(p.get("mode", 0))]
        fp = [float(p.get("freq_base", 10000.0)), float(p.get("freq_scale", 1.0))]
    elif op == "DIAG_MASK_INF":
        ip = [int(p["n_past"])]
    elif op == "CONCAT":
        ip = [node.ndim - 1 - int(p["axis"])]
    elif op in ("SWIGLU", "GEGLU"):
        ip = [int(p.get("swapped", 0))]
    while srcs and srcs[-1] is None:
        srcs.pop()
    dst = _tensor_desc(node, syms, addr(node))
    sd = [None if x is None else _tensor_desc(x, syms, addr(x)) for x in srcs]
    return (OPS[op], dst, sd, ip, fp)


_SUPPORTED = frozenset({
    "GET_ROWS", "SET_ROWS", "ADD", "SUB", "MUL", "DIV", "SCALE", "SQR", "SQRT", "NEG", "ABS", "EXP", "LOG", "SILU",
    "GELU", "RELU", "TANH", "SIGMOID", "SWIGLU", "GEGLU", "NORM", "RMS_NORM", "MUL_MAT", "SOFT_MAX", "ROPE",
    "DIAG_MASK_INF", "FLASH_ATTN_EXT", "CPY", "CONT", "CONCAT", "SUM_ROWS", "MEAN", "ARGMAX", "REPEAT", "CLAMP", "PAD",
})  # fmt: skip


class SimdPlan:
    """A lowered split: the C plan plus what keeps its memory alive."""

    def __init__(self, native: Any, sym_names: list[str], buffers: list[Buffer], n_nodes: int) -> None:
        self.native = native
        self.sym_names = sym_names
        self.buffers = buffers  # the C plan holds raw addresses into these
        self.n_nodes = n_nodes

    def __repr__(self) -> str:
        return (f"<SimdPlan {self.n_nodes} nodes, level {self.native.level}, {self.native.n_threads} threads, "
                f"symbols {self.sym_names}>")


class SimdBackend(Backend):
    name = "simd"

    def __init__(self, device: Device, level: str | None = None) -> None:
        self.device = device
        self.default_buffer_type = SimdBufferType()
        self.level = level  # None: the module's current level when a plan is created

    def supports_op(self, node: Tensor) -> bool:
        if node.op not in _SUPPORTED:
            return False
        syms = _Syms(())
        try:
            d = _describe(node, syms, lambda t: None)
        except (KeyError, TypeError, ValueError):
            return False
        return _require().validate(d, syms.max) == ""

    def weight_cache_bytes(self, weights: Sequence[Tensor]) -> int:
        """The interleaved copies made for matrix-vector products (Q4_1, Q8_0, Q4_K, Q6_K matrices, at AVX2 and up):
        an upper bound, as a matrix only used by GET_ROWS (an untied embedding) is never repacked."""
        simd = _require()
        return sum(simd.repacked_nbytes(t.dtype.ggml_id, t.shape[1], t.shape[0], self.level)
                   for t in weights if t.ndim == 2)

    def graph_plan_create(self, split: Split) -> SimdPlan:
        simd = _require()
        syms = _Syms(split.symbols)
        buffers: dict[int, Buffer] = {}

        def addr(t: Tensor) -> tuple[int, Any]:
            buf, off = split.address(t)
            if not buf.buffer_type.is_host:
                raise PlanError(f"simd: tensor {t.name!r} lives in non-host buffer type {buf.buffer_type.name}")
            buffers[id(buf)] = buf
            return int(buf.base), off

        descs = [_describe(n, syms, addr) for n in split.nodes]
        ranges = [(int(b.base), int(b.size)) for b in buffers.values()]
        lvl = self.level
        try:
            native = simd.Plan(descs, ranges, syms.max, self.n_threads, lvl)
        except simd.PlanError as e:
            raise PlanError(f"simd: {e}") from None
        except ValueError as e:
            raise PlanError(f"simd: {e}") from None
        return SimdPlan(native, syms.names, list(buffers.values()), len(descs))

    def graph_plan_compute(self, plan: SimdPlan, bindings: Mapping[str, int]) -> None:
        nat = plan.native
        if nat.n_threads != self.device.n_threads:
            nat.n_threads = self.device.n_threads
        try:
            nat.compute([int(bindings[n]) for n in plan.sym_names] if plan.sym_names else [])
        except KeyError as e:
            raise BackendError(f"simd: symbol {e} is not bound") from None
        except _simd.PlanError as e:
            raise BackendError(f"simd: {e}") from None

    def graph_plan_free(self, plan: SimdPlan) -> None:
        plan.native = None
        plan.buffers = []


def _device() -> Device:
    simd = _require()
    feats = simd.cpu_features()
    lvl = simd.level()
    threads = int(os.environ.get("GGML_PY_SIMD_THREADS", "0") or 0) or simd.physical_cores()
    return Device("cpu", f"SIMD kernels ({lvl}) on {feats.get('brand') or 'CPU'}", n_threads=threads, score=10,
                  caps={"level": lvl, "levels": simd.levels(), "host_buffer": True,
                        "features": [k for k, v in feats.items() if v is True]})


class SimdRegistration(BackendRegistration):
    name = "simd"
    version = __version__

    def devices(self) -> list[Device]:
        return [_device()]

    def create(self, device: Device | None = None, **options: Any) -> Backend:
        dev = device or self.devices()[0]
        n = int(options.get("n_threads") or 0) or dev.n_threads
        lvl = options.get("level")
        if lvl is not None:
            lvl = str(lvl).lower()
            missing = _require().level_missing(lvl)
            if missing:
                raise BackendError(f"simd level {lvl!r} is not supported by this CPU (missing: {missing})")
        return SimdBackend(Device(dev.name, dev.description, n_threads=n, score=dev.score, caps=dev.caps), lvl)


def register() -> BackendRegistration:
    """Entry point of the `ggml_py.backends` group."""
    _require()
    _apply_env_level()
    return SimdRegistration()
