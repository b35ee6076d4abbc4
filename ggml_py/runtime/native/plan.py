"""A split lowered once (node array at fixed addresses) and computed by one C call; the abort callback that
serves Ctrl-C and cancel."""

from __future__ import annotations

import threading
import weakref
from typing import TYPE_CHECKING, Any

from ggml_py.errors import BackendError
from ggml_py.ir import schema
from ggml_py.ir.symbolic import Expr, upper
from ggml_py.ir.tensor import Tensor
from ggml_py.runtime.backend import Split
from ggml_py.runtime.native.abi import STATUS, const, ffi
from ggml_py.runtime.native.lowering import ggml_layout, upper_layout, write_affine, write_node, write_tensor

if TYPE_CHECKING:
    from ggml_py.runtime.native.backend import NativeBackend
    from ggml_py.runtime.native.library import NativeLibrary


class _ComputeState:
    """What the abort callback of one compute consults: a cancel request, or the exception a signal handler raised
    inside the callback (Ctrl-C), to re-raise once the plugin has returned."""

    def __init__(self) -> None:
        self.cancelled = False
        self.exc: BaseException | None = None


current_compute = threading.local()


def _abort_error(exc_type: type, exc: BaseException, tb: Any) -> int:
    state = getattr(current_compute, "state", None)
    if state is not None:
        state.exc = exc
    return 1


def make_abort_callback() -> Any:
    @ffi().callback("int32_t(void *)", onerror=_abort_error)
    def poll(data: Any) -> int:
        # Python runs pending signal handlers here (on the main thread): a KeyboardInterrupt lands in _abort_error
        return 1 if ffi().from_handle(data).cancelled else 0

    return poll


_abort_cb: Any = None


class NativePlan:
    """A split lowered once: tensors, nodes, the graph and the compute arguments, at fixed addresses until freed."""

    def __init__(self, backend: NativeBackend, split: Split) -> None:
        global _abort_cb
        f = ffi()
        self.backend = backend
        self.nodes_py = list(split.nodes)
        symbols = list(split.symbols)
        index = {s.name: i for i, s in enumerate(symbols)}
        keep: list[Any] = []  # every cffi object the C side points into
        tensors: dict[int, Any] = {}
        ranges: dict[int, tuple[int, int]] = {}

        def tensor_of(t: Tensor) -> Any:
            tc = tensors.get(t.id)
            if tc is not None:
                return tc
            buf, off = split.address(t)
            base = int(buf.base)
            ranges[id(buf)] = (base, int(buf.size))
            tc = f.new("ggml_py_tensor *")
            symbolic = t.is_symbolic or isinstance(off, Expr)
            write_tensor(tc, t, *upper_layout(t), data=base + upper(off))
            name = f.new("char[]", t.name.encode("utf-8", "replace"))
            tc.name = name
            keep.extend((tc, name))
            if symbolic:
                lay = f.new("ggml_py_symbolic_layout *")
                shape, strides = ggml_layout(t.shape, t.strides, t.dtype.type_size)
                for k in range(schema.MAX_DIMS):
                    write_affine(lay.ne[k], shape[k], index, t.name)
                    write_affine(lay.nb[k], strides[k], index, t.name)
                write_affine(lay.offset, off, index, t.name)
                lay.base = f.cast("void *", base)
                tc.sym = lay
                tc.flags |= const("GGML_PY_TENSOR_SYMBOLIC")
                keep.append(lay)
            tensors[t.id] = tc
            return tc

        self.n = len(self.nodes_py)
        nodes = f.new("ggml_py_node[]", max(self.n, 1))
        node_ptrs = f.new("ggml_py_node *[]", max(self.n, 1))
        for i, n in enumerate(self.nodes_py):
            write_node(nodes[i], n, tensor_of)
            node_ptrs[i] = nodes + i
        g = f.new("ggml_py_graph *")
        g.n_nodes = self.n
        g.nodes = node_ptrs
        g.n_syms = len(symbols)
        sym_max = f.new("int64_t[]", [int(s.max) for s in symbols] or [0])
        names = [f.new("char[]", s.name.encode()) for s in symbols]
        sym_names = f.new("char *[]", names or [f.NULL])
        g.sym_max = sym_max
        g.sym_names = sym_names
        rs = f.new("ggml_py_range[]", max(len(ranges), 1))
        for k, (base, size) in enumerate(ranges.values()):
            rs[k].base = f.cast("void *", base)
            rs[k].size = size
        g.n_ranges = len(ranges)
        g.ranges = rs
        keep.extend((nodes, node_ptrs, sym_max, names, sym_names, rs))
        self.graph = g
        self.symbol_names = [s.name for s in symbols]
        self.syms = f.new("int64_t[]", max(len(symbols), 1))
        self.err = f.new("ggml_py_error *")
        self.state = _ComputeState()
        self._handle = f.new_handle(self.state)
        if _abort_cb is None:
            _abort_cb = make_abort_callback()
        args = f.new("ggml_py_compute_args *")
        args.syms = self.syms
        args.abort_callback = _abort_cb
        args.abort_data = self._handle
        args.err = self.err
        self.args = args
        # an asynchronous compute (ABI 2.2) runs on the plugin's queue, where no abort callback may be called
        args_async = f.new("ggml_py_compute_args *")
        args_async.syms = self.syms
        args_async.err = self.err
        self.args_async = args_async
        self.node_seconds: Any = None
        self._keep = keep
        self.handle = f.NULL
        self._compute = backend.library.plugin.backend.graph_compute
        create = backend.library.fn("backend.graph_plan_create")
        if create is not None:
            out = f.new("void **")
            self.err.node = -1
            self.err.message[0] = b"\0"
            with backend.lock:
                rc = int(create(backend._ctx, g, out, self.err))
            if rc != 0:
                raise BackendError(f"{backend.library.where()} cannot prepare a split of {self.n} nodes "
                                   f"({', '.join(sorted({n.op or '' for n in self.nodes_py}))}): "
                                   f"{self._message()} (status {rc} {STATUS.get(rc, '?')})")
            self.handle = out[0]
        self._finalizer = weakref.finalize(self, free_plan, backend.library, backend._ctx_holder, self.handle,
                                           backend.lock)

    def _message(self) -> str:
        msg = ffi().string(self.err.message).decode("utf-8", "replace").strip() or "no message"
        i = int(self.err.node)
        if 0 <= i < self.n:
            n = self.nodes_py[i]
            return f"{n.op} (node {n.name!r}, {i + 1} of {self.n}): {msg}"
        return msg

    def set_profiling(self, on: bool) -> None:
        self.node_seconds = ffi().new("double[]", max(self.n, 1)) if on else None
        self.args.node_seconds = self.args_async.node_seconds = self.node_seconds if on else ffi().NULL

    def free(self) -> None:
        self._finalizer()


def free_plan(lib: NativeLibrary, ctx_holder: list[Any], handle: Any, lock: Any) -> None:
    fn = lib.fn("backend.graph_plan_free")
    if handle != ffi().NULL and fn is not None:
        with lock:
            if ctx_holder[0] is not None:
                fn(ctx_holder[0], handle)
