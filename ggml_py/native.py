"""Native backends: plugins speaking the C ABI v2 of `ggml_py/include/ggml_py/backend_abi.h`, driven with cffi.

A plugin is a table of C functions (`ggml_py_plugin`). A shared library exports it through
`ggml_py_plugin_abi_version()` and `ggml_py_plugin_init()`; an extension module already loaded in-process (the
built-in SIMD backend) hands over its address (`load_table`). Either way this module checks the ABI version before
reading anything else, and wraps the table as an ordinary `Backend` / `BufferType` / `BackendRegistration`. Each
split is lowered once into a node array that stays at a fixed address with the plan; symbolic dimensions travel as
affine expressions the plugin binds itself, so a compute is one C call with the symbol values and nothing else.

Ways in (see docs/writing-a-backend.md):
- `ggml_py.native.load(path)` -> BackendRegistration; `ggml_py.native.backend(path)` -> Backend;
  `ggml_py.native.register(path)` adds it to the registry in-process;
- an entry point of group `ggml_py.backends` whose object is a path (str / os.PathLike) or a callable returning one;
- `GGML_PY_BACKEND_PATH`: os.pathsep-separated library paths (or directories of libraries); the backend's name is
  the one the library's init reports.
"""

from __future__ import annotations

import os
import re
import threading
import weakref
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from . import schema
from .backend import Backend, BackendRegistration, Buffer, BufferType, Device, HostBuffer, Split
from .errors import BackendError
from .symbolic import Expr, upper
from .tensor import INPUT, OUTPUT, PARAM, STATE, Tensor

SYMBOLS = ("ggml_py_plugin_abi_version", "ggml_py_plugin_init")
PATH_ENV = "GGML_PY_BACKEND_PATH"
LIBRARY_SUFFIXES = (".so", ".dylib", ".dll")

# Function pointers a plugin must provide, as "struct.field".
REQUIRED_FUNCTIONS = ("buffer_type.alloc_buffer", "buffer.free_buffer", "backend.init", "backend.free",
                      "backend.supports_op", "backend.graph_compute")
NON_HOST_FUNCTIONS = ("buffer.set_tensor", "buffer.get_tensor", "buffer.memset_tensor")

_STATUS = {0: "OK", 1: "FAILED", 2: "UNSUPPORTED", 3: "NO_MEMORY", 4: "ABORTED"}
_CDEF_BEGIN = "/* GGML_PY_CDEF_BEGIN */"
_CDEF_END = "/* GGML_PY_CDEF_END */"


def get_include() -> str:
    """The folder to put on a native plugin's include path: it holds ggml_py/backend_abi.h."""
    return str(schema.header_path().parents[1])


# -- the cffi declarations: read from the header itself ---------------------------------------------------------------
def strip_comments(text: str) -> str:
    """C text without comments and blank lines (line structure otherwise kept)."""
    text = re.sub(r"/\*.*?\*/", "", text, flags=re.S)
    text = re.sub(r"//[^\n]*", "", text)
    return "\n".join(line.rstrip() for line in text.splitlines() if line.strip()) + "\n"


def cdef_from_header(header_text: str) -> str:
    """The cffi declarations of a backend_abi.h: its CDEF region without comments."""
    try:
        region = header_text.split(_CDEF_BEGIN, 1)[1].split(_CDEF_END, 1)[0]
    except IndexError:
        raise BackendError(f"header has no {_CDEF_BEGIN} ... {_CDEF_END} region") from None
    return strip_comments(region)


_ffi_lock = threading.Lock()
_ffi_obj: Any = None
_consts: dict[str, int] = {}


def ffi() -> Any:
    """The shared cffi.FFI holding the ABI's declarations (parsed from the installed header)."""
    global _ffi_obj
    with _ffi_lock:
        if _ffi_obj is None:
            import cffi

            cdef = cdef_from_header(schema.header_path().read_text())
            f = cffi.FFI()
            f.cdef(cdef)
            _consts.update((k, int(v)) for k, v in re.findall(r"^#define (GGML_PY_\w+) (\d+)", cdef, flags=re.M))
            _ffi_obj = f
        return _ffi_obj


def const(name: str) -> int:
    """An integer #define of the header (GGML_PY_...)."""
    ffi()
    return _consts[name]


def abi_version() -> tuple[int, int]:
    """(major, minor) of the ABI this ggml_py speaks."""
    return const("GGML_PY_ABI_MAJOR"), const("GGML_PY_ABI_MINOR")


def _version_str(v: int) -> str:
    return f"{v >> 16}.{v & 0xFFFF}" if v >= 1 << 16 else str(v)


def check_version(version: int, where: str) -> None:
    """Refuse a plugin this ggml_py cannot run, saying what to rebuild or upgrade."""
    major, minor = abi_version()
    ours = f"{major}.{minor}"
    if version >> 16 == major and version & 0xFFFF <= minor:
        return
    if version >> 16 == major:
        raise BackendError(f"{where}: plugin built against ggml_py backend ABI {_version_str(version)}, newer than "
                           f"this ggml_py's {ours}: upgrade ggml_py")
    raise BackendError(f"{where}: plugin built for ggml_py backend ABI version {_version_str(version)}, but this "
                       f"ggml_py speaks {ours} (any {major}.x up to {ours}); rebuild it against the header in "
                       "ggml_py.get_include() (`ggml-py config --include`)")


# -- the library ------------------------------------------------------------------------------------------------------
class NativeLibrary:
    """One plugin table, checked against this ggml_py's ABI."""

    def __init__(self, plugin: Any, where: str, path: str, keepalive: Any = None) -> None:
        f = ffi()
        self.path = path
        self._where = where
        self._keepalive = keepalive  # the dlopen'd library or the extension module that owns the table
        if plugin == f.NULL:
            raise BackendError(f"{where}: ggml_py_plugin_init() returned NULL")
        check_version(int(plugin.abi_version), where)
        size = int(plugin.struct_size)
        v2_0 = f.offsetof("ggml_py_plugin", "buffer_from_host_ptr")  # every 2.0 field precedes this one
        if size < v2_0 or size > f.sizeof("ggml_py_plugin"):
            raise BackendError(f"{where}: ggml_py_plugin is {size} bytes in the plugin, which ABI "
                               f"{_version_str(int(plugin.abi_version))} does not allow (2.0: {v2_0}, this ggml_py: "
                               f"{f.sizeof('ggml_py_plugin')}); it was built against another backend_abi.h")
        self.struct_size = size
        self.plugin = plugin
        self.name = self._string(plugin.name, "name")
        if not re.fullmatch(r"[a-z0-9_]+", self.name):
            raise BackendError(f"{where}: backend name {self.name!r} must match [a-z0-9_]+")
        self.version = self._string(plugin.version, "version", "0")
        self.description = self._string(plugin.description, "description", "")
        self.abi_version = _version_str(int(plugin.abi_version))
        self.score = int(plugin.score)
        self.default_threads = max(1, int(plugin.n_threads))
        self.is_host = bool(plugin.buffer_type.is_host)
        need = REQUIRED_FUNCTIONS + (() if self.is_host else NON_HOST_FUNCTIONS)
        null = [fn for fn in need if self.fn(fn) is None]
        if null:
            raise BackendError(f"{where} (backend {self.name!r}): required plugin function(s) {', '.join(null)} "
                               "are NULL")
        self.buffer_type = NativeBufferType(self)
        self._registration: NativeRegistration | None = None

    @classmethod
    def open(cls, path: str | os.PathLike[str]) -> NativeLibrary:
        """dlopen a plugin library and read its table."""
        f = ffi()
        spath = os.fspath(path)
        if not os.path.exists(spath):
            raise BackendError(f"native backend library {spath} does not exist")
        try:
            lib = f.dlopen(os.path.abspath(spath))
        except OSError as e:
            raise BackendError(f"cannot load native backend library {spath}: {e}") from e
        missing = [s for s in SYMBOLS if not hasattr(lib, s)]
        if missing:
            raise BackendError(f"{spath} is not a ggml_py backend plugin: missing symbol(s) {', '.join(missing)} "
                               "(see ggml_py/backend_abi.h in ggml_py.get_include())")
        check_version(int(lib.ggml_py_plugin_abi_version()), spath)  # before reading any struct
        return cls(lib.ggml_py_plugin_init(), spath, spath, keepalive=lib)

    def fn(self, dotted: str) -> Any:
        """A function pointer of the table, or None when NULL or past the plugin's struct_size."""
        f = ffi()
        parts = dotted.split(".")
        field = dict(f.typeof("ggml_py_plugin").fields)[parts[0]]
        if field.offset + f.sizeof(field.type) > self.struct_size:
            return None
        obj = self.plugin
        for p in parts:
            obj = getattr(obj, p)
        return None if obj == f.NULL else obj

    def _string(self, ptr: Any, what: str, default: str | None = None) -> str:
        if ptr == ffi().NULL:
            if default is None:
                raise BackendError(f"{self._where}: the plugin's {what} is NULL")
            return default
        return ffi().string(ptr).decode("utf-8", "replace")

    @property
    def registration(self) -> NativeRegistration:
        if self._registration is None:
            self._registration = NativeRegistration(self)
        return self._registration

    def where(self) -> str:
        return f"native backend {self.name!r} ({self.path})"

    def __repr__(self) -> str:
        return f"<NativeLibrary {self.name} {self.version} ABI {self.abi_version} {self.path}>"


# -- buffers -----------------------------------------------------------------------------------------------------------
class NativeHostBuffer(HostBuffer):
    """Host memory of a plugin buffer; numpy reads it directly. Freed by the plugin when the last view dies."""


class NativeDeviceBuffer(Buffer):
    """Memory of a non-host plugin buffer type: reached only through the plugin's copy functions."""

    def __init__(self, buffer_type: NativeBufferType, cbuf: Any, size: int) -> None:
        self.buffer_type = buffer_type
        self.size = size
        self._cbuf = cbuf
        self._lib = buffer_type.library
        self._finalizer = weakref.finalize(self, _free_buffer, self._lib, cbuf)

    @property
    def base(self) -> int:
        return int(ffi().cast("uintptr_t", self._cbuf.base))

    def _call(self, what: str, rc: int) -> None:
        if rc != 0:
            raise BackendError(f"{self._lib.where()}: buffer {what} failed (status {rc} {_STATUS.get(rc, '?')})")

    def set_tensor(self, offset: int, data: bytes | memoryview | np.ndarray) -> None:
        src = np.ascontiguousarray(np.frombuffer(data, np.uint8) if not isinstance(data, np.ndarray) else
                                   data.reshape(-1).view(np.uint8))
        self._check(offset, src.nbytes)
        self._call("set_tensor", self._lib.plugin.buffer.set_tensor(self._cbuf, offset, ffi().from_buffer(src),
                                                                    src.nbytes))

    def get_tensor(self, offset: int, size: int) -> np.ndarray:
        self._check(offset, size)
        out = np.empty(size, np.uint8)
        self._call("get_tensor", self._lib.plugin.buffer.get_tensor(self._cbuf, offset, ffi().from_buffer(out), size))
        return out

    def memset(self, offset: int, value: int, size: int) -> None:
        self._check(offset, size)
        self._call("memset_tensor", self._lib.plugin.buffer.memset_tensor(self._cbuf, offset, value, size))

    def free(self) -> None:
        self._finalizer()
        self.size = 0


def _free_buffer(lib: NativeLibrary, cbuf: Any) -> None:
    lib.plugin.buffer.free_buffer(cbuf)


class NativeBufferType(BufferType):
    """The plugin's buffer type; allocations go through its alloc_buffer."""

    def __init__(self, library: NativeLibrary) -> None:
        bt = library.plugin.buffer_type
        self.library = library
        self.name = library._string(bt.name, "buffer type name", library.name)
        self.alignment = max(1, int(bt.alignment))
        if self.alignment & (self.alignment - 1):
            raise BackendError(f"{library.path}: buffer type alignment {self.alignment} is not a power of two")
        self.max_size = int(bt.max_size) or (1 << 62)
        self.is_host = bool(bt.is_host)

    def alloc_size(self, tensor: Tensor) -> int:
        fn = self.library.fn("buffer_type.get_alloc_size")
        if fn is None:
            return tensor.nbytes
        tc = ffi().new("ggml_py_tensor *")
        _write_tensor(tc, tensor, *_upper_layout(tensor), data=0)
        return max(int(fn(tc)), tensor.nbytes)

    def alloc_buffer(self, size: int) -> Buffer:
        f = ffi()
        lib = self.library
        size = max(int(size), 1)
        cbuf = f.new("ggml_py_buffer *")
        rc = int(lib.plugin.buffer_type.alloc_buffer(size, cbuf))
        if rc != 0 or cbuf.base == f.NULL:
            raise BackendError(f"{lib.where()}: alloc_buffer({size}) failed (status {rc} {_STATUS.get(rc, '?')})")
        if int(cbuf.size) < size:
            _free_buffer(lib, cbuf)
            raise BackendError(f"{lib.where()}: alloc_buffer({size}) returned only {int(cbuf.size)} bytes")
        if not self.is_host:
            buf: Buffer = NativeDeviceBuffer(self, cbuf, size)
            buf.clear()
            return buf
        addr = int(f.cast("uintptr_t", cbuf.base))
        if addr % self.alignment:
            _free_buffer(lib, cbuf)
            raise BackendError(f"{lib.where()}: alloc_buffer returned an address not aligned to {self.alignment}")
        # The memory is released (free_buffer) when the last numpy view over it is gone, never before.
        owner = f.gc(f.cast("uint8_t *", cbuf.base), lambda _ptr, lib=lib, cbuf=cbuf: _free_buffer(lib, cbuf))
        array = np.frombuffer(f.buffer(owner, size), dtype=np.uint8)
        array[:] = 0  # zeroed by contract; do not trust it for states
        return NativeHostBuffer(self, array, owner=owner)

    def buffer_from_host(self, array: np.ndarray) -> Buffer | None:
        """Existing host memory (a weight, maybe mapped from a file) as a buffer of this type, without copying (ABI
        2.1 `buffer_from_host_ptr`); None, and the caller copies, when the plugin cannot."""
        fn = self.library.fn("buffer_from_host_ptr")
        if fn is None or not self.is_host or not isinstance(array, np.ndarray) or not array.flags.c_contiguous:
            return None
        f = ffi()
        raw = array.reshape(-1).view(np.uint8)
        cbuf = f.new("ggml_py_buffer *")
        if int(fn(f.cast("void *", int(raw.ctypes.data)), raw.nbytes, cbuf)) != 0:
            return None
        # the plugin's free_buffer (not of the memory itself) runs when the buffer's last user is gone
        owner = (array, weakref.finalize(cbuf, _free_buffer, self.library, cbuf), cbuf)
        return NativeHostBuffer(self, raw, owner=owner)


# -- lowering ----------------------------------------------------------------------------------------------------------
def _flags(t: Tensor) -> int:
    root = t.view_src if t.view_src is not None else t
    return (t.flags | root.flags) & (INPUT | OUTPUT | PARAM | STATE)


def _ggml_layout(shape: Sequence[Any], strides: Sequence[Any], itemsize: int) -> tuple[list[Any], list[Any]]:
    """ne/nb (ints or affine expressions) in ggml order: numpy order reversed, padded to MAX_DIMS with dims of 1
    whose stride continues the last one (a 0-d tensor is one element)."""
    ne, nb = list(reversed(shape)) or [1], list(reversed(strides)) or [itemsize]
    while len(ne) < schema.MAX_DIMS:
        try:
            nb.append(nb[-1] * ne[-1])
        except ValueError:  # two symbolic dims (e.g. a mask (n_tok, n_kv)): any stride serves a dim of size 1
            nb.append(upper(nb[-1]) * upper(ne[-1]))
        ne.append(1)
    return ne, nb


def _write_layout(tc: Any, shape: Sequence[int], strides: Sequence[int], itemsize: int) -> None:
    ne, nb = _ggml_layout(shape, strides, itemsize)
    for k in range(schema.MAX_DIMS):
        tc.ne[k] = ne[k]
        tc.nb[k] = nb[k]


def _upper_layout(t: Tensor) -> tuple[tuple[int, ...], tuple[int, ...]]:
    return tuple(upper(d) for d in t.shape), tuple(upper(s) for s in t.strides)


def _write_tensor(tc: Any, t: Tensor, shape: Sequence[int], strides: Sequence[int], data: int) -> None:
    root = t.view_src if t.view_src is not None else t
    tc.type = t.dtype.ggml_id
    tc.flags = _flags(t)
    tc.id = root.id + 1
    _write_layout(tc, shape, strides, t.dtype.type_size)
    tc.data = ffi().cast("void *", data)


def _write_affine(ac: Any, value: Any, index: Mapping[str, int], what: str) -> None:
    e = Expr.of(value)
    if len(e.terms) > const("GGML_PY_MAX_TERMS"):
        raise BackendError(f"{what}: {e} has more symbolic terms than the C ABI carries")
    ac.c = e.const
    ac.n_terms = len(e.terms)
    for k, (s, c) in enumerate(e.terms):
        ac.sym[k] = index[s.name]
        ac.coef[k] = c


def _write_params(nc: Any, n: Tensor) -> None:
    for slot, is_float, value in schema.get(n.op).encode(n.params, n.ndim):
        if isinstance(value, Expr):
            raise BackendError(f"{n.op} ({n.name}): op param {value} is symbolic, which the C ABI cannot carry")
        if is_float:
            nc.params.f[slot] = value
        else:
            nc.params.i[slot] = int(value)


def _write_node(nc: Any, n: Tensor, tensor_of: Callable[[Tensor], Any]) -> None:
    nc.op = schema.ABI_IDS[n.op or ""]
    nc.dst = tensor_of(n)
    last = 0
    for j, s in enumerate(n.src):
        if s is not None:
            nc.src[j] = tensor_of(s)
            last = j + 1
    nc.n_src = last
    _write_params(nc, n)


class _ComputeState:
    """What the abort callback of one compute consults: a cancel request, or the exception a signal handler raised
    inside the callback (Ctrl-C), to re-raise once the plugin has returned."""

    def __init__(self) -> None:
        self.cancelled = False
        self.exc: BaseException | None = None


_current = threading.local()


def _abort_error(exc_type: type, exc: BaseException, tb: Any) -> int:
    state = getattr(_current, "state", None)
    if state is not None:
        state.exc = exc
    return 1


def _make_abort_callback() -> Any:
    @ffi().callback("int32_t(void *)", onerror=_abort_error)
    def poll(data: Any) -> int:
        # Python runs pending signal handlers here (on the main thread): a KeyboardInterrupt lands in _abort_error
        return 1 if ffi().from_handle(data).cancelled else 0

    return poll


_abort_cb: Any = None


class _NativePlan:
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
            _write_tensor(tc, t, *_upper_layout(t), data=base + upper(off))
            name = f.new("char[]", t.name.encode("utf-8", "replace"))
            tc.name = name
            keep.extend((tc, name))
            if symbolic:
                lay = f.new("ggml_py_symbolic_layout *")
                shape, strides = _ggml_layout(t.shape, t.strides, t.dtype.type_size)
                for k in range(schema.MAX_DIMS):
                    _write_affine(lay.ne[k], shape[k], index, t.name)
                    _write_affine(lay.nb[k], strides[k], index, t.name)
                _write_affine(lay.offset, off, index, t.name)
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
            _write_node(nodes[i], n, tensor_of)
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
            _abort_cb = _make_abort_callback()
        args = f.new("ggml_py_compute_args *")
        args.syms = self.syms
        args.abort_callback = _abort_cb
        args.abort_data = self._handle
        args.err = self.err
        self.args = args
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
                                   f"{self._message()} (status {rc} {_STATUS.get(rc, '?')})")
            self.handle = out[0]
        self._finalizer = weakref.finalize(self, _free_plan, backend.library, backend._ctx_holder, self.handle,
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
        self.args.node_seconds = self.node_seconds if on else ffi().NULL

    def free(self) -> None:
        self._finalizer()


def _free_plan(lib: NativeLibrary, ctx_holder: list[Any], handle: Any, lock: Any) -> None:
    fn = lib.fn("backend.graph_plan_free")
    if handle != ffi().NULL and fn is not None:
        with lock:
            if ctx_holder[0] is not None:
                fn(ctx_holder[0], handle)


def _free_backend(lib: NativeLibrary, ctx_holder: list[Any], lock: Any) -> None:
    with lock:
        ctx, ctx_holder[0] = ctx_holder[0], None
        if ctx is not None:
            lib.plugin.backend.free(ctx)


class ComputeCancelled(BackendError):
    """A compute stopped by `NativeBackend.cancel` (or a plan's cancel) before it finished."""


class NativeBackend(Backend):
    """A ggml_py Backend whose kernels are a plugin's."""

    def __init__(self, library: NativeLibrary, device: Device, options: Mapping[str, Any] | None = None) -> None:
        f = ffi()
        if library.score <= 0:
            raise BackendError(f"{library.where()} reports score {library.score}: it cannot run on this machine")
        self.library = library
        self.name = library.name
        self.device = device
        self.default_buffer_type = library.buffer_type
        opts = ";".join(f"{k}={v}" for k, v in (options or {}).items() if v is not None)
        ctx = library.plugin.backend.init(int(device.n_threads), opts.encode())
        if ctx == f.NULL:
            raise BackendError(f"{library.where()}: backend init(n_threads={device.n_threads}, options={opts!r}) "
                               "returned NULL (an option it does not accept?)")
        self._ctx = ctx
        # plans hold the holder, so a plan freed after its backend never calls into a freed context
        self._ctx_holder: list[Any] = [ctx]
        # the ABI promises one call at a time per context; plans sharing this backend may compute from two threads
        self.lock = threading.RLock()  # re-entrant: a GC-run plan finalizer may free while this thread holds it
        self._finalizer = weakref.finalize(self, _free_backend, library, self._ctx_holder, self.lock)

    def supports_op(self, node: Tensor) -> bool:
        if node.op not in schema.ABI_IDS or len(node.src) > 4:
            return False
        f = ffi()
        keep: list[Any] = []

        def tensor_of(t: Tensor) -> Any:
            tc = f.new("ggml_py_tensor *")
            _write_tensor(tc, t, *_upper_layout(t), data=0)
            if t.is_symbolic:
                tc.flags |= const("GGML_PY_TENSOR_SYMBOLIC")
            keep.append(tc)
            return tc

        nc = f.new("ggml_py_node *")
        try:
            _write_node(nc, node, tensor_of)
        except BackendError:
            return False
        with self.lock:
            return bool(self.library.plugin.backend.supports_op(self._ctx, nc))

    def graph_plan_create(self, split: Split) -> _NativePlan:
        return _NativePlan(self, split)

    def graph_plan_compute(self, plan: _NativePlan, bindings: Mapping[str, int]) -> None:
        syms = plan.syms
        for k, name in enumerate(plan.symbol_names):
            syms[k] = bindings[name]
        err = plan.err
        err.node = -1
        err.message[0] = b"\0"
        state = plan.state
        state.cancelled = False
        state.exc = None
        with self.lock:
            if self._ctx_holder[0] is None:
                raise BackendError(f"{self.library.where()}: this backend was closed; prepare the graph again")
            outer = getattr(_current, "state", None)  # a signal handler may compute while this thread computes
            _current.state = state
            try:
                rc = int(plan._compute(self._ctx, plan.handle, plan.graph, plan.args))
            finally:
                _current.state = outer
        if rc == 0:
            return
        if state.exc is not None:  # Ctrl-C (or another signal handler's exception) during the compute
            raise state.exc
        if rc == 4 and state.cancelled:
            raise ComputeCancelled(f"{self.library.where()}: compute cancelled")
        what = plan._message() if int(err.node) >= 0 else (
            f"a split of {plan.n} nodes ({', '.join(sorted({n.op or '' for n in plan.nodes_py}))}): "
            f"{plan._message()}")
        raise BackendError(f"{self.library.where()} failed in {what} (status {rc} {_STATUS.get(rc, '?')})")

    def graph_plan_free(self, plan: _NativePlan) -> None:
        plan.free()

    def graph_plan_profile(self, plan: _NativePlan, on: bool) -> None:
        """Start (zeroing) or stop accumulating per-node wall time in the plugin."""
        plan.set_profiling(on)

    def graph_plan_node_seconds(self, plan: _NativePlan) -> list[float] | None:
        """Per-node seconds accumulated since profiling started, or None when it is off."""
        if plan.node_seconds is None:
            return None
        return [float(plan.node_seconds[i]) for i in range(plan.n)]

    def graph_plan_cancel(self, plan: _NativePlan) -> None:
        """Ask a compute of `plan` running in another thread to stop at the plugin's next poll."""
        plan.state.cancelled = True

    def synchronize(self) -> None:
        fn = self.library.fn("backend.synchronize")
        if fn is not None:
            with self.lock:
                fn(self._ctx)

    def set_n_threads(self, n: int) -> None:
        super().set_n_threads(n)
        fn = self.library.fn("backend.set_n_threads")
        if fn is not None:
            with self.lock:
                fn(self._ctx, int(n))

    def close(self) -> None:
        """Free the plugin's backend context now (plans made by this backend must not be computed afterwards)."""
        self._finalizer()


class NativeRegistration(BackendRegistration):
    """The registration of a plugin: one device, backends created through the plugin's init."""

    backend_class: type[NativeBackend] = NativeBackend

    def __init__(self, library: NativeLibrary) -> None:
        self.library = library
        self.name = library.name
        self.version = library.version

    def device_caps(self) -> dict[str, Any]:
        lib = self.library
        return {"native": True, "library": lib.path, "abi_version": lib.abi_version,
                "buffer_type": lib.buffer_type.name, "host_buffer": lib.is_host}

    def devices(self) -> list[Device]:
        lib = self.library
        p = lib.plugin
        return [Device("native", lib.description or f"native plugin {lib.name}", memory_total=int(p.memory_total),
                       memory_free=int(p.memory_free), n_threads=lib.default_threads, score=lib.score,
                       caps=self.device_caps())]

    def create(self, device: Device | None = None, **options: Any) -> Backend:
        """A backend; n_threads sets its thread count, every other option goes to the plugin's init as key=value."""
        dev = device or self.devices()[0]
        n = options.pop("n_threads", None) or dev.n_threads
        return self.backend_class(self.library, Device(dev.name, dev.description, dev.memory_total, dev.memory_free,
                                                       n_threads=int(n), score=dev.score, caps=dict(dev.caps)),
                                  options)


# -- loading and discovery ---------------------------------------------------------------------------------------------
_libraries: dict[str, NativeLibrary] = {}
_libraries_lock = threading.Lock()


def load_library(path: str | os.PathLike[str]) -> NativeLibrary:
    """Open and check a plugin library (once per real path)."""
    key = os.path.realpath(os.fspath(path))
    with _libraries_lock:
        lib = _libraries.get(key)
        if lib is None:
            lib = NativeLibrary.open(path)
            _libraries[key] = lib
        return lib


def load_table(address: int, owner: Any, where: str) -> NativeLibrary:
    """The plugin table at `address` inside an already loaded extension module `owner` (kept alive with it)."""
    f = ffi()
    key = f"table:{where}:{address}"
    with _libraries_lock:
        lib = _libraries.get(key)
        if lib is None:
            lib = NativeLibrary(f.cast("const ggml_py_plugin *", address), where, where, keepalive=owner)
            _libraries[key] = lib
        return lib


def load(path: str | os.PathLike[str]) -> NativeRegistration:
    """The BackendRegistration of the plugin library at `path`."""
    return load_library(path).registration


def backend(path: str | os.PathLike[str], **options: Any) -> Backend:
    """A new Backend from the plugin library at `path` (options such as n_threads go to its init)."""
    return load(path).create(**options)


def register(path: str | os.PathLike[str], name: str | None = None) -> str:
    """Add the plugin at `path` to `ggml_py.registry` in-process; returns the name it is registered under."""
    from .registry import registry

    reg = load(path)
    registry.register(name or reg.name, reg, source=f"native library {os.fspath(path)}")
    return name or reg.name


def library_paths(value: str) -> list[str]:
    """The libraries a GGML_PY_BACKEND_PATH value names: files as given, directories expanded to their libraries."""
    out: list[str] = []
    for entry in value.split(os.pathsep):
        entry = entry.strip()
        if not entry:
            continue
        p = Path(entry).expanduser()
        if p.is_dir():
            out.extend(str(c) for c in sorted(p.iterdir()) if c.suffix in LIBRARY_SUFFIXES and c.is_file())
        else:
            out.append(str(p))
    return out


def _guess_name(path: str) -> str:
    stem = Path(path).name.split(".")[0]
    stem = stem[3:] if stem.startswith("lib") else stem
    return re.sub(r"[^a-z0-9_]", "_", stem.lower()) or "native"


def discover_path_backends(value: str | None = None) -> list[tuple[str, str, Callable[[], BackendRegistration]]]:
    """(name, source, loader) for every library in GGML_PY_BACKEND_PATH (or `value`).

    The name is the one the library's init reports; a library that cannot be loaded is listed under its file name
    with a loader that re-raises the error (so `ggml-py backends` shows it and asking for it explains why).
    """
    value = os.environ.get(PATH_ENV, "") if value is None else value
    found = []
    for path in library_paths(value):
        source = f"{PATH_ENV} {path}"
        try:
            lib = load_library(path)
        except Exception as e:
            err = e

            def fail(err: BaseException = err) -> BackendRegistration:
                raise err

            found.append((_guess_name(path), source, fail))
            continue
        found.append((lib.name, source, lambda lib=lib: lib.registration))
    return found


def resolve_entry_point_object(obj: Any) -> Any:
    """An entry point's object: a path (str / PathLike) becomes the registration of that library."""
    if isinstance(obj, (str, os.PathLike)):
        return load(obj)
    return obj


__all__ = ["ComputeCancelled", "NativeBackend", "NativeBufferType", "NativeLibrary", "NativeRegistration",
           "abi_version", "backend", "cdef_from_header", "check_version", "discover_path_backends", "get_include",
           "library_paths", "load", "load_library", "load_table", "register", "resolve_entry_point_object"]
