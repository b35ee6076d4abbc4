"""Kernel-level plans on the simd backend, built directly on its ABI v2 table (no ggml_py scheduler): what
tests/test_simd_kernels.py uses to put exact layouts, symbols and bad descriptions in front of the C code.

A node is described as `(op, dst, [srcs], [int params], [float params])`: the op's name or ABI id; tensors as
`(type id, ne[4], nb[4], base address, byte offset[, const id])` in ggml order, where any ne, nb or offset may be an
affine `(c0, [(symbol index, coef), ...])`; the int and float params fill the op's schema parameters in order. As the
kernels see it, SET_ROWS's sources are (rows, indices): the destination the ABI also passes as src[0] is added here.
"""

from __future__ import annotations

from typing import Any

import ggml_py_simd
import numpy as np

from ggml_py.ir import schema
from ggml_py.runtime import native
from ggml_py.runtime.backend import aligned_host_array

OPS = schema.ABI_IDS
_NAMES = {v: k for k, v in OPS.items()}


class PlanError(Exception):
    """The plugin refused a plan or failed a compute."""


class Arena:
    """64-byte aligned host memory handing out aligned numpy views; one registered range."""

    def __init__(self, size: int = 32 << 20) -> None:
        self.mem = aligned_host_array(size)
        self.address = int(self.mem.ctypes.data)
        self.size = size
        self.off = 0

    @property
    def ranges(self) -> list[tuple[int, int]]:
        return [(self.address, self.size)]

    def _take(self, nbytes: int) -> int:
        off = (self.off + 63) & ~63
        if off + nbytes > self.size:
            raise MemoryError("arena full")
        self.off = off + nbytes
        return off

    def put(self, a: np.ndarray) -> np.ndarray:
        """A copy of `a` in the arena (C order)."""
        a = np.ascontiguousarray(a)
        off = self._take(max(a.nbytes, 1))
        v = np.ndarray(a.shape, a.dtype, buffer=self.mem, offset=off)
        v[...] = a
        return v

    def empty(self, shape, dtype) -> np.ndarray:
        dt = np.dtype(dtype)
        n = int(np.prod(shape)) * dt.itemsize
        off = self._take(max(n, 1))
        v = np.ndarray(tuple(shape), dt, buffer=self.mem, offset=off)
        v[...] = 0
        return v


def _affine(ac: Any, v: Any) -> bool:
    if isinstance(v, int):
        ac.c, ac.n_terms = v, 0
        return False
    c0, terms = v
    ac.c, ac.n_terms = c0, len(terms)
    for k, (s, c) in enumerate(terms):
        ac.sym[k], ac.coef[k] = s, c
    return bool(terms)


class Plan:
    """One simd plan over the described nodes; compute(syms) runs it."""

    def __init__(self, nodes: list[tuple], ranges: list[tuple[int, int]], sym_max: list[int] | tuple = (),
                 n_threads: int = 0, level: str | None = None) -> None:
        f = native.ffi()
        self.lib = ggml_py_simd.library()
        self._keep: list[Any] = []
        be = self.lib.plugin.backend
        ctx = be.init(n_threads, f"level={level}".encode() if level else b"")
        if ctx == f.NULL:
            raise PlanError(f"init refused level {level!r}")
        self.ctx = ctx
        self.n_nodes = len(nodes)
        cnodes = f.new("ggml_py_node[]", max(len(nodes), 1))
        ptrs = f.new("ggml_py_node *[]", max(len(nodes), 1))
        for i, desc in enumerate(nodes):
            self._node(cnodes[i], desc)
            ptrs[i] = cnodes + i
        g = f.new("ggml_py_graph *")
        g.n_nodes, g.nodes = len(nodes), ptrs
        smax = f.new("int64_t[]", list(sym_max) or [0])
        g.n_syms, g.sym_max = len(sym_max), smax
        rs = f.new("ggml_py_range[]", max(len(ranges), 1))
        for k, (base, size) in enumerate(ranges):
            rs[k].base, rs[k].size = f.cast("void *", base), size
        g.n_ranges, g.ranges = len(ranges), rs
        self._keep += [cnodes, ptrs, smax, rs]
        self.graph = g
        self.err = f.new("ggml_py_error *")
        out = f.new("void **")
        rc = be.graph_plan_create(ctx, g, out, self.err)
        if rc != 0:
            be.free(ctx)
            raise PlanError(f.string(self.err.message).decode())
        self.handle = out[0]
        self.n_threads = n_threads

    def _tensor(self, d: Any) -> Any:
        f = native.ffi()
        if d is None:
            return f.NULL
        t, ne, nb, base, off = d[:5]
        tc = f.new("ggml_py_tensor *")
        lay = f.new("ggml_py_symbolic_layout *")
        self._keep += [tc, lay]
        tc.type = t
        symbolic = False
        for k in range(4):
            symbolic |= _affine(lay.ne[k], ne[k])
            symbolic |= _affine(lay.nb[k], nb[k])
            tc.ne[k] = ne[k] if isinstance(ne[k], int) else 1
            tc.nb[k] = nb[k] if isinstance(nb[k], int) else 0
        symbolic |= _affine(lay.offset, off)
        lay.base = f.cast("void *", base)
        tc.data = f.cast("void *", base + (off if isinstance(off, int) else off[0]))
        if len(d) > 5 and d[5]:
            tc.flags, tc.id = native.const("GGML_PY_TENSOR_PARAM"), d[5]
        if symbolic:
            tc.sym = lay
            tc.flags |= native.const("GGML_PY_TENSOR_SYMBOLIC")
        return tc

    def _node(self, nc: Any, desc: tuple) -> None:
        op, dst, srcs = desc[0], desc[1], list(desc[2])
        ip, fp = list(desc[3]) if len(desc) > 3 else [], list(desc[4]) if len(desc) > 4 else []
        nc.op = OPS[op] if isinstance(op, str) else op
        name = _NAMES.get(nc.op)
        if name == "SET_ROWS":
            srcs = [dst, *srcs]
        nc.dst = self._tensor(dst)
        for j, s in enumerate(srcs):
            nc.src[j] = self._tensor(s)
        nc.n_src = len(srcs)
        if name is None:
            return
        for p in schema.OPS[name].params:
            slot = schema.OPS[name].slot(p.name)
            if p.is_float and fp:
                nc.params.f[slot] = fp.pop(0)
            elif not p.is_float and ip:
                nc.params.i[slot] = ip.pop(0)
            elif p.neutral is not None:  # added by a later ABI minor and not given: what the op computed before
                if p.is_float:
                    nc.params.f[slot] = p.neutral
                else:
                    nc.params.i[slot] = int(p.neutral)

    def compute(self, syms: list[int] | tuple = ()) -> None:
        f = native.ffi()
        vals = f.new("int64_t[]", list(syms) or [0])
        args = f.new("ggml_py_compute_args *")
        args.syms, args.err = vals, self.err
        if len(syms) != self.graph.n_syms:
            raise PlanError(f"expected {self.graph.n_syms} symbol values, got {len(syms)}")
        rc = self.lib.plugin.backend.graph_compute(self.ctx, self.handle, self.graph, args)
        if rc != 0:
            raise PlanError(f.string(self.err.message).decode())

    def __del__(self) -> None:
        if not hasattr(self, "handle"):
            return
        be = self.lib.plugin.backend
        be.graph_plan_free(self.ctx, self.handle)
        be.free(self.ctx)


def validate(desc: tuple) -> str:
    """'' if the backend's supports_op accepts the node (addresses ignored), else 'refused'."""
    lib = ggml_py_simd.library()
    p = Plan.__new__(Plan)
    p._keep = []
    f = native.ffi()
    nc = f.new("ggml_py_node *")
    p._node(nc, desc)
    ctx = lib.plugin.backend.init(1, b"")
    try:
        return "" if lib.plugin.backend.supports_op(ctx, nc) else "refused"
    finally:
        lib.plugin.backend.free(ctx)
