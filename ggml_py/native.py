"""Native backends: shared libraries speaking the C ABI of `csrc/include/ggml_py/backend_abi.h`, loaded with cffi.

A library exports `ggml_py_plugin_abi_version()` and `ggml_py_plugin_init()`; this module opens it in cffi's ABI
mode (no compiler needed), checks the version before reading any struct, and wraps the plugin as an ordinary
`Backend` / `BufferType` / `BackendRegistration`. Each split is lowered once into an array of node descriptors that
stays alive with the plan; a compute patches only the fields that depend on symbolic dimensions and makes one C call.

Ways in (see docs/writing-a-backend.md):
- `ggml_py.native.load(path)` -> BackendRegistration; `ggml_py.native.backend(path)` -> Backend;
  `ggml_py.native.register(path)` adds it to the registry in-process;
- an entry point of group `ggml_py.backends` whose object is a path (str / os.PathLike) or a callable returning one;
- `GGML_PY_BACKEND_PATH`: os.pathsep-separated library paths (or directories of libraries); the backend's name is
  the one the library's init reports.

`python -m ggml_py.native cdef HEADER` prints the cffi declarations of a header (to refresh `CDEF` below).
"""

from __future__ import annotations

import os
import re
import sys
import threading
import weakref
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from .backend import Backend, BackendRegistration, Buffer, BufferType, Device, HostBuffer, Split
from .errors import BackendError
from .symbolic import Expr, upper
from .tensor import INPUT, OUTPUT, PARAM, STATE, Tensor

ABI_VERSION = 1
SYMBOLS = ("ggml_py_plugin_abi_version", "ggml_py_plugin_init")
PATH_ENV = "GGML_PY_BACKEND_PATH"
LIBRARY_SUFFIXES = (".so", ".dylib", ".dll")

# The declarations between GGML_PY_CDEF_BEGIN and GGML_PY_CDEF_END of backend_abi.h, comments removed.
# tests/test_native_plugin.py checks that they agree with the header.
CDEF = r"""
#define GGML_PY_ABI_VERSION 1
#define GGML_PY_MAX_DIMS 4
#define GGML_PY_MAX_SRC 4
#define GGML_PY_MAX_OP_PARAMS 16
#define GGML_PY_ERROR_MAX 256
enum ggml_py_status {
    GGML_PY_OK = 0,
    GGML_PY_ERR_FAILED = 1,
    GGML_PY_ERR_UNSUPPORTED = 2,
    GGML_PY_ERR_NO_MEMORY = 3
};
enum ggml_py_type {
    GGML_PY_TYPE_F32 = 0,
    GGML_PY_TYPE_F16 = 1,
    GGML_PY_TYPE_Q4_0 = 2,
    GGML_PY_TYPE_Q4_1 = 3,
    GGML_PY_TYPE_Q5_0 = 6,
    GGML_PY_TYPE_Q5_1 = 7,
    GGML_PY_TYPE_Q8_0 = 8,
    GGML_PY_TYPE_Q8_1 = 9,
    GGML_PY_TYPE_Q2_K = 10,
    GGML_PY_TYPE_Q3_K = 11,
    GGML_PY_TYPE_Q4_K = 12,
    GGML_PY_TYPE_Q5_K = 13,
    GGML_PY_TYPE_Q6_K = 14,
    GGML_PY_TYPE_Q8_K = 15,
    GGML_PY_TYPE_IQ4_NL = 20,
    GGML_PY_TYPE_IQ4_XS = 23,
    GGML_PY_TYPE_I8 = 24,
    GGML_PY_TYPE_I16 = 25,
    GGML_PY_TYPE_I32 = 26,
    GGML_PY_TYPE_I64 = 27,
    GGML_PY_TYPE_BF16 = 30
};
enum ggml_py_op {
    GGML_PY_OP_NONE = 0,
    GGML_PY_OP_ADD = 1,
    GGML_PY_OP_SUB = 2,
    GGML_PY_OP_MUL = 3,
    GGML_PY_OP_DIV = 4,
    GGML_PY_OP_SCALE = 5,
    GGML_PY_OP_SQR = 6,
    GGML_PY_OP_SQRT = 7,
    GGML_PY_OP_NEG = 8,
    GGML_PY_OP_ABS = 9,
    GGML_PY_OP_EXP = 10,
    GGML_PY_OP_LOG = 11,
    GGML_PY_OP_SILU = 12,
    GGML_PY_OP_GELU = 13,
    GGML_PY_OP_RELU = 14,
    GGML_PY_OP_TANH = 15,
    GGML_PY_OP_SIGMOID = 16,
    GGML_PY_OP_CLAMP = 17,
    GGML_PY_OP_SWIGLU = 18,
    GGML_PY_OP_GEGLU = 19,
    GGML_PY_OP_NORM = 20,
    GGML_PY_OP_RMS_NORM = 21,
    GGML_PY_OP_SUM_ROWS = 22,
    GGML_PY_OP_MEAN = 23,
    GGML_PY_OP_ARGMAX = 24,
    GGML_PY_OP_MUL_MAT = 25,
    GGML_PY_OP_SOFT_MAX = 26,
    GGML_PY_OP_DIAG_MASK_INF = 27,
    GGML_PY_OP_ROPE = 28,
    GGML_PY_OP_FLASH_ATTN_EXT = 29,
    GGML_PY_OP_GET_ROWS = 30,
    GGML_PY_OP_SET_ROWS = 31,
    GGML_PY_OP_CPY = 32,
    GGML_PY_OP_CONT = 33,
    GGML_PY_OP_CONCAT = 34,
    GGML_PY_OP_REPEAT = 35,
    GGML_PY_OP_PAD = 36,
    GGML_PY_OP_COUNT = 37
};
#define GGML_PY_TENSOR_INPUT 1
#define GGML_PY_TENSOR_OUTPUT 2
#define GGML_PY_TENSOR_PARAM 4
#define GGML_PY_TENSOR_STATE 8
#define GGML_PY_TENSOR_SYMBOLIC 16
typedef struct ggml_py_tensor {
    int32_t type;
    int32_t flags;
    int64_t ne[GGML_PY_MAX_DIMS];
    size_t nb[GGML_PY_MAX_DIMS];
    void *data;
    const char *name;
} ggml_py_tensor;
typedef union ggml_py_op_params {
    int32_t i[GGML_PY_MAX_OP_PARAMS];
    float f[GGML_PY_MAX_OP_PARAMS];
} ggml_py_op_params;
typedef struct ggml_py_node {
    int32_t op;
    int32_t n_src;
    ggml_py_tensor *dst;
    ggml_py_tensor *src[GGML_PY_MAX_SRC];
    ggml_py_op_params params;
} ggml_py_node;
typedef struct ggml_py_error {
    int32_t node;
    char message[GGML_PY_ERROR_MAX];
} ggml_py_error;
typedef struct ggml_py_buffer {
    void *base;
    size_t size;
    void *context;
} ggml_py_buffer;
typedef struct ggml_py_buffer_type_i {
    const char *name;
    size_t alignment;
    size_t max_size;
    int32_t is_host;
    int32_t (*alloc_buffer)(size_t size, ggml_py_buffer *buf);
    size_t (*get_alloc_size)(const ggml_py_tensor *tensor);
} ggml_py_buffer_type_i;
typedef struct ggml_py_buffer_i {
    void (*free_buffer)(ggml_py_buffer *buf);
    int32_t (*set_tensor)(ggml_py_buffer *buf, size_t offset, const void *src, size_t size);
    int32_t (*get_tensor)(ggml_py_buffer *buf, size_t offset, void *dst, size_t size);
    int32_t (*memset_tensor)(ggml_py_buffer *buf, size_t offset, uint8_t value, size_t size);
} ggml_py_buffer_i;
typedef struct ggml_py_backend_i {
    void *(*init)(int32_t n_threads);
    void (*free)(void *backend);
    int32_t (*supports_op)(void *backend, const ggml_py_node *node);
    int32_t (*graph_plan_create)(void *backend, const ggml_py_node *nodes, int32_t n_nodes, void **plan);
    void (*graph_plan_free)(void *backend, void *plan);
    int32_t (*graph_compute)(void *backend, void *plan, const ggml_py_node *nodes, int32_t n_nodes,
                             ggml_py_error *err);
    void (*set_n_threads)(void *backend, int32_t n_threads);
    void (*synchronize)(void *backend);
} ggml_py_backend_i;
typedef struct ggml_py_plugin {
    uint32_t abi_version;
    uint32_t struct_size;
    const char *name;
    const char *version;
    const char *description;
    int32_t score;
    int32_t n_threads;
    uint64_t memory_total;
    uint64_t memory_free;
    ggml_py_buffer_type_i buffer_type;
    ggml_py_buffer_i buffer;
    ggml_py_backend_i backend;
} ggml_py_plugin;
uint32_t ggml_py_plugin_abi_version(void);
const ggml_py_plugin *ggml_py_plugin_init(void);
"""

_CDEF_BEGIN = "/* GGML_PY_CDEF_BEGIN */"
_CDEF_END = "/* GGML_PY_CDEF_END */"

# Function pointers a plugin must provide, as "struct.field".
REQUIRED_FUNCTIONS = ("buffer_type.alloc_buffer", "buffer.free_buffer", "backend.init", "backend.free",
                      "backend.supports_op", "backend.graph_compute")
NON_HOST_FUNCTIONS = ("buffer.set_tensor", "buffer.get_tensor", "buffer.memset_tensor")

GGML_PY_TENSOR_SYMBOLIC = 16

_STATUS = {0: "OK", 1: "FAILED", 2: "UNSUPPORTED", 3: "NO_MEMORY"}


# -- the cffi declarations ------------------------------------------------------------------------------------------
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


def normalize_cdef(text: str) -> str:
    """Comments removed and whitespace collapsed: two cdefs that agree normalise to the same string."""
    return " ".join(strip_comments(text).split())


_ffi_lock = threading.Lock()
_ffi_obj: Any = None


def ffi() -> Any:
    """The shared cffi.FFI holding the ABI declarations."""
    global _ffi_obj
    with _ffi_lock:
        if _ffi_obj is None:
            try:
                import cffi
            except ImportError as e:  # pragma: no cover - cffi is a dependency
                raise BackendError(f"native backends need cffi ({e})") from e
            f = cffi.FFI()
            f.cdef(CDEF)
            _ffi_obj = f
        return _ffi_obj


def _enum(name: str, prefix: str) -> dict[str, int]:
    return {k[len(prefix):]: v for k, v in ffi().typeof(f"enum {name}").relements.items()}


_op_codes: dict[str, int] | None = None


def op_codes() -> dict[str, int]:
    """ggml_py op name -> ABI op code (from enum ggml_py_op)."""
    global _op_codes
    if _op_codes is None:
        codes = _enum("ggml_py_op", "GGML_PY_OP_")
        codes.pop("COUNT", None)
        codes.pop("NONE", None)
        _op_codes = codes
    return _op_codes


# -- op params ----------------------------------------------------------------------------------------------------
def _float_params(*names: str) -> Callable[[Tensor], list[tuple[int, str, Any]]]:
    return lambda n: [(i, "f", float(n.params[k])) for i, k in enumerate(names)]


_PARAMS: dict[str, Callable[[Tensor], list[tuple[int, str, Any]]]] = {
    "SCALE": _float_params("s", "b"),
    "CLAMP": _float_params("min", "max"),
    "NORM": _float_params("eps"),
    "RMS_NORM": _float_params("eps"),
    "SOFT_MAX": _float_params("scale", "max_bias"),
    "FLASH_ATTN_EXT": _float_params("scale", "max_bias", "softcap"),
    "DIAG_MASK_INF": lambda n: [(0, "i", n.params["n_past"])],
    "ROPE": lambda n: [(1, "i", n.params["n_dims"]), (2, "i", n.params["mode"]), (5, "f", n.params["freq_base"]),
                       (6, "f", n.params["freq_scale"])],
    "CONCAT": lambda n: [(0, "i", n.ndim - 1 - n.params["axis"])],
    "PAD": lambda n: [(2 * (n.ndim - 1 - k) + 1, "i", p) for k, p in enumerate(n.params["pads"])],
}


def _fill_params(node_c: Any, n: Tensor) -> None:
    enc = _PARAMS.get(n.op or "")
    if enc is None:
        return
    for slot, kind, value in enc(n):
        if isinstance(value, Expr):
            raise BackendError(f"{n.op} ({n.name}): op param {value} is symbolic, which the C ABI cannot carry")
        if kind == "f":
            node_c.params.f[slot] = value
        else:
            node_c.params.i[slot] = int(value)


# -- descriptors ------------------------------------------------------------------------------------------------------
def _flags(t: Tensor) -> int:
    root = t.view_src if t.view_src is not None else t
    return (t.flags | root.flags) & (INPUT | OUTPUT | PARAM | STATE)


def _write_layout(tc: Any, shape: Sequence[int], strides: Sequence[int], itemsize: int) -> None:
    """ne/nb in ggml order: numpy order reversed, unused outer dims 1 (their stride continues the last one)."""
    nd = len(shape)
    if nd == 0:
        shape, strides = (1,), (itemsize,)
        nd = 1
    for k in range(4):
        if k < nd:
            tc.ne[k] = shape[nd - 1 - k]
            tc.nb[k] = strides[nd - 1 - k]
        else:
            tc.ne[k] = 1
            tc.nb[k] = tc.nb[k - 1] * tc.ne[k - 1]


def _upper_layout(t: Tensor) -> tuple[tuple[int, ...], tuple[int, ...]]:
    return tuple(upper(d) for d in t.shape), tuple(upper(s) for s in t.strides)


def _buffer_address(buf: Buffer) -> int:
    return int(buf.base)


class NativeLibrary:
    """One opened plugin library, checked against this ggml_py's ABI."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        f = ffi()
        self.path = str(path)
        if not os.path.exists(self.path):
            raise BackendError(f"native backend library {self.path} does not exist")
        try:
            self.lib = f.dlopen(os.path.abspath(self.path))
        except OSError as e:
            raise BackendError(f"cannot load native backend library {self.path}: {e}") from e
        missing = []
        for sym in SYMBOLS:
            try:
                getattr(self.lib, sym)
            except AttributeError:
                missing.append(sym)
        if missing:
            raise BackendError(f"{self.path} is not a ggml_py backend plugin: missing symbol(s) {', '.join(missing)} "
                               "(see csrc/include/ggml_py/backend_abi.h)")
        version = int(self.lib.ggml_py_plugin_abi_version())
        if version != ABI_VERSION:
            raise BackendError(f"{self.path}: plugin built for ggml_py backend ABI version {version}, but this ggml_py "
                               f"speaks version {ABI_VERSION}; rebuild it against this ggml_py's backend_abi.h")
        p = self.lib.ggml_py_plugin_init()
        if p == f.NULL:
            raise BackendError(f"{self.path}: ggml_py_plugin_init() returned NULL")
        if int(p.abi_version) != ABI_VERSION:
            raise BackendError(f"{self.path}: ggml_py_plugin_init() reports ABI version {int(p.abi_version)}, "
                               f"expected {ABI_VERSION}")
        if int(p.struct_size) != f.sizeof("ggml_py_plugin"):
            raise BackendError(f"{self.path}: ggml_py_plugin is {int(p.struct_size)} bytes in the plugin but "
                               f"{f.sizeof('ggml_py_plugin')} here; it was built against another backend_abi.h")
        self.plugin = p
        self.name = self._string(p.name, "name")
        if not re.fullmatch(r"[a-z0-9_]+", self.name):
            raise BackendError(f"{self.path}: backend name {self.name!r} must match [a-z0-9_]+")
        self.version = self._string(p.version, "version", "0")
        self.description = self._string(p.description, "description", "")
        self.score = int(p.score)
        self.default_threads = max(1, int(p.n_threads))
        self.is_host = bool(p.buffer_type.is_host)
        need = REQUIRED_FUNCTIONS + (() if self.is_host else NON_HOST_FUNCTIONS)
        null = [fn for fn in need if self._fn(fn) == f.NULL]
        if null:
            raise BackendError(f"{self.path} (backend {self.name!r}): required plugin function(s) "
                               f"{', '.join(null)} are NULL")
        self.buffer_type = NativeBufferType(self)
        self._registration: NativeRegistration | None = None

    def _fn(self, dotted: str) -> Any:
        struct, field = dotted.split(".")
        return getattr(getattr(self.plugin, struct), field)

    def _string(self, ptr: Any, what: str, default: str | None = None) -> str:
        if ptr == ffi().NULL:
            if default is None:
                raise BackendError(f"{self.path}: the plugin's {what} is NULL")
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
        return f"<NativeLibrary {self.name} {self.version} {self.path}>"


class NativeHostBuffer(HostBuffer):
    """Host memory allocated by a plugin; numpy reads it directly. Freed by the plugin when the last view dies."""


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
        fn = self.library.plugin.buffer_type.get_alloc_size
        if fn == ffi().NULL:
            return tensor.nbytes
        tc = ffi().new("ggml_py_tensor *")
        _describe(tc, tensor, *_upper_layout(tensor), data=0, flags=_flags(tensor))
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


def _describe(tc: Any, t: Tensor, shape: Sequence[int], strides: Sequence[int], data: int, flags: int,
              name: Any = None) -> None:
    tc.type = t.dtype.ggml_id
    tc.flags = flags
    _write_layout(tc, shape, strides, t.dtype.type_size)
    tc.data = ffi().cast("void *", data)
    if name is not None:
        tc.name = name


class _NativePlan:
    """A split lowered to a descriptor array, kept alive (at a fixed address) until freed."""

    def __init__(self, backend: NativeBackend, split: Split) -> None:
        f = ffi()
        self.split = split
        self.backend = backend
        self.nodes_py = list(split.nodes)
        tensors: dict[int, Tensor] = {}
        for n in self.nodes_py:
            for t in (n, *n.src):
                if t is not None:
                    tensors.setdefault(t.id, t)
        order = list(tensors.values())
        index = {t.id: i for i, t in enumerate(order)}
        self.tensors = f.new("ggml_py_tensor[]", len(order))
        self.n = len(self.nodes_py)
        self.nodes = f.new("ggml_py_node[]", self.n)
        self.err = f.new("ggml_py_error *")
        self._keep: list[Any] = []
        # symbolic tensors: (descriptor, tensor, buffer base); their ne/nb/data are written per compute
        self.patches: list[tuple[Any, Tensor, int]] = []
        for i, t in enumerate(order):
            tc = self.tensors[i]
            buf, off = split.address(t)
            base = _buffer_address(buf)
            name = f.new("char[]", t.name.encode("utf-8", "replace"))
            self._keep.append(name)
            symbolic = t.is_symbolic or isinstance(off, Expr)
            flags = _flags(t) | (GGML_PY_TENSOR_SYMBOLIC if symbolic else 0)
            if symbolic:
                shape, strides = _upper_layout(t)
                _describe(tc, t, shape, strides, base + upper(off), flags, name)
                self.patches.append((tc, t, base))
            else:
                _describe(tc, t, t.shape, t.strides, base + int(off), flags, name)  # type: ignore[arg-type]
        for i, n in enumerate(self.nodes_py):
            nc = self.nodes[i]
            nc.op = backend.op_code(n)
            nc.dst = self.tensors + index[n.id]
            last = 0
            for j, s in enumerate(n.src):
                if s is not None:
                    nc.src[j] = self.tensors + index[s.id]
                    last = j + 1
            nc.n_src = last
            _fill_params(nc, n)
        self._bound: tuple[tuple[str, int], ...] | None = None
        self.handle = f.NULL
        iface = backend.library.plugin.backend
        if iface.graph_plan_create != f.NULL:
            out = f.new("void **")
            with backend.lock:
                rc = int(iface.graph_plan_create(backend._ctx, self.nodes, self.n, out))
            if rc != 0:
                raise BackendError(f"{backend.library.where()}: graph_plan_create failed for a split of {self.n} "
                                   f"nodes ({', '.join(sorted({n.op or '' for n in self.nodes_py}))}): status {rc} "
                                   f"{_STATUS.get(rc, '?')}")
            self.handle = out[0]
        self._finalizer = weakref.finalize(self, _free_plan, backend.library, backend._ctx_holder, self.handle,
                                           backend.lock)

    def patch(self, bindings: Mapping[str, int]) -> None:
        if not self.patches:
            return
        key = tuple(sorted(bindings.items()))
        if key == self._bound:
            return
        f = ffi()
        for tc, t, base in self.patches:
            shape, strides, off = self.split.layout(t, bindings)
            _write_layout(tc, shape, strides, t.dtype.type_size)
            tc.data = f.cast("void *", base + off)
        self._bound = key

    def free(self) -> None:
        self._finalizer()


def _free_plan(lib: NativeLibrary, ctx_holder: list[Any], handle: Any, lock: Any) -> None:
    fn = lib.plugin.backend.graph_plan_free
    if handle != ffi().NULL and fn != ffi().NULL:
        with lock:
            if ctx_holder[0] is not None:
                fn(ctx_holder[0], handle)


def _free_backend(lib: NativeLibrary, ctx_holder: list[Any], lock: Any) -> None:
    with lock:
        ctx, ctx_holder[0] = ctx_holder[0], None
        if ctx is not None:
            lib.plugin.backend.free(ctx)


class NativeBackend(Backend):
    """A ggml_py Backend whose kernels are a plugin library's."""

    def __init__(self, library: NativeLibrary, device: Device) -> None:
        f = ffi()
        if library.score <= 0:
            raise BackendError(f"{library.where()} reports score {library.score}: it cannot run on this machine")
        self.library = library
        self.name = library.name
        self.device = device
        self.default_buffer_type = library.buffer_type
        ctx = library.plugin.backend.init(int(device.n_threads))
        if ctx == f.NULL:
            raise BackendError(f"{library.where()}: backend init({device.n_threads}) returned NULL")
        self._ctx = ctx
        # plans hold the holder, so a plan freed after its backend never calls into a freed context
        self._ctx_holder: list[Any] = [ctx]
        # the ABI promises one call at a time per context; plans sharing this backend may compute from two threads
        self.lock = threading.RLock()  # re-entrant: a GC-run plan finalizer may free while this thread holds it
        self._finalizer = weakref.finalize(self, _free_backend, library, self._ctx_holder, self.lock)

    def op_code(self, node: Tensor) -> int:
        code = op_codes().get(node.op or "")
        if code is None:
            raise BackendError(f"{self.library.where()}: op {node.op} ({node.name}) has no code in the C ABI")
        return code

    def supports_op(self, node: Tensor) -> bool:
        code = op_codes().get(node.op or "")
        if code is None or len(node.src) > 4:
            return False
        f = ffi()
        tensors = f.new("ggml_py_tensor[]", 1 + len(node.src))
        nc = f.new("ggml_py_node *")
        nc.op = code
        for k, t in enumerate((node, *node.src)):
            if t is None:
                continue
            flags = _flags(t) | (GGML_PY_TENSOR_SYMBOLIC if t.is_symbolic else 0)
            _describe(tensors[k], t, *_upper_layout(t), data=0, flags=flags)
            if k == 0:
                nc.dst = tensors + 0
            else:
                nc.src[k - 1] = tensors + k
                nc.n_src = k
        _fill_params(nc, node)
        with self.lock:
            return bool(self.library.plugin.backend.supports_op(self._ctx, nc))

    def graph_plan_create(self, split: Split) -> _NativePlan:
        return _NativePlan(self, split)

    def graph_plan_compute(self, plan: _NativePlan, bindings: Mapping[str, int]) -> None:
        with self.lock:
            if self._ctx_holder[0] is None:
                raise BackendError(f"{self.library.where()}: this backend was closed; prepare the graph again")
            plan.patch(bindings)
            err = plan.err
            err.node = -1
            err.message[0] = b"\0"
            rc = int(self.library.plugin.backend.graph_compute(self._ctx, plan.handle, plan.nodes, plan.n, err))
        if rc != 0:
            msg = ffi().string(err.message).decode("utf-8", "replace").strip() or "no message"
            i = int(err.node)
            if 0 <= i < plan.n:
                n = plan.nodes_py[i]
                what = f"{n.op} (node {n.name!r}, {i + 1} of {plan.n})"
            else:
                what = f"a split of {plan.n} nodes ({', '.join(sorted({n.op or '' for n in plan.nodes_py}))})"
            raise BackendError(f"{self.library.where()} failed in {what}: {msg} "
                               f"(status {rc} {_STATUS.get(rc, '?')})")

    def graph_plan_free(self, plan: _NativePlan) -> None:
        plan.free()

    def synchronize(self) -> None:
        fn = self.library.plugin.backend.synchronize
        if fn != ffi().NULL:
            with self.lock:
                fn(self._ctx)

    def set_n_threads(self, n: int) -> None:
        super().set_n_threads(n)
        fn = self.library.plugin.backend.set_n_threads
        if fn != ffi().NULL:
            with self.lock:
                fn(self._ctx, int(n))

    def close(self) -> None:
        """Free the plugin's backend context now (plans made by this backend must not be computed afterwards)."""
        self._finalizer()


class NativeRegistration(BackendRegistration):
    """The registration of a plugin library: one device, backends created through the plugin's init."""

    def __init__(self, library: NativeLibrary) -> None:
        self.library = library
        self.name = library.name
        self.version = library.version

    def devices(self) -> list[Device]:
        lib = self.library
        p = lib.plugin
        return [Device("native", lib.description or f"native plugin {lib.name}", memory_total=int(p.memory_total),
                       memory_free=int(p.memory_free), n_threads=lib.default_threads, score=lib.score,
                       caps={"native": True, "library": lib.path, "abi_version": ABI_VERSION,
                             "buffer_type": lib.buffer_type.name, "host_buffer": lib.is_host})]

    def create(self, device: Device | None = None, **options: Any) -> Backend:
        dev = device or self.devices()[0]
        n = options.get("n_threads") or dev.n_threads
        return NativeBackend(self.library, Device(dev.name, dev.description, dev.memory_total, dev.memory_free,
                                                  n_threads=int(n), score=dev.score, caps=dict(dev.caps)))


# -- loading and discovery ---------------------------------------------------------------------------------------------
_libraries: dict[str, NativeLibrary] = {}
_libraries_lock = threading.Lock()


def load_library(path: str | os.PathLike[str]) -> NativeLibrary:
    """Open and check a plugin library (once per real path)."""
    key = os.path.realpath(os.fspath(path))
    with _libraries_lock:
        lib = _libraries.get(key)
        if lib is None:
            lib = NativeLibrary(os.fspath(path))
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


def _main(argv: Sequence[str]) -> int:
    if len(argv) == 2 and argv[0] == "cdef":
        sys.stdout.write(cdef_from_header(Path(argv[1]).read_text()))
        return 0
    print("usage: python -m ggml_py.native cdef path/to/backend_abi.h", file=sys.stderr)
    return 2


if __name__ == "__main__":
    raise SystemExit(_main(sys.argv[1:]))


__all__ = ["ABI_VERSION", "CDEF", "NativeBackend", "NativeBufferType", "NativeLibrary", "NativeRegistration",
           "backend", "cdef_from_header", "discover_path_backends", "library_paths", "load", "load_library",
           "normalize_cdef", "op_codes", "register", "resolve_entry_point_object"]
