"""The C ABI as cffi sees it: declarations parsed from the installed backend_abi.h, its constants, version checks."""

from __future__ import annotations

import re
import threading
from typing import Any

from ggml_py.errors import BackendError
from ggml_py.ir import schema

SYMBOLS = ("ggml_py_plugin_abi_version", "ggml_py_plugin_init")

# Function pointers a plugin must provide, as "struct.field".
REQUIRED_FUNCTIONS = ("buffer_type.alloc_buffer", "buffer.free_buffer", "backend.init", "backend.free",
                      "backend.supports_op", "backend.graph_compute")
NON_HOST_FUNCTIONS = ("buffer.set_tensor", "buffer.get_tensor", "buffer.memset_tensor")
# ABI 2.2 asynchronous execution: all of these or none.
ASYNC_FUNCTIONS = ("graph_compute_async", "set_tensor_async", "event_new", "event_free", "event_record",
                   "event_synchronize")

STATUS = {0: "OK", 1: "FAILED", 2: "UNSUPPORTED", 3: "NO_MEMORY", 4: "ABORTED"}
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
            cdef = cdef_from_header(schema.header_path().read_text())
            _ffi_obj = _compiled_ffi(cdef) or _parsed_ffi(cdef)
            _consts.update((k, int(v)) for k, v in re.findall(r"^#define (GGML_PY_\w+) (\d+)", cdef, flags=re.M))
        return _ffi_obj


def _parsed_ffi(cdef: str) -> Any:
    import cffi

    f = cffi.FFI()
    f.cdef(cdef)
    return f


def _compiled_ffi(cdef: str) -> Any:
    """The declarations as cffi's out-of-line ABI module (types pre-parsed into a small Python file), kept in
    ~/.cache/ggml_py/cffi under a hash of the declarations: parsing them with pycparser costs ~30 ms in every
    process, a noticeable part of a cold start's time to first token. None when the cache cannot be written."""
    import contextlib
    import hashlib
    import importlib.util
    import io
    import os

    key = hashlib.sha256(cdef.encode()).hexdigest()[:16]
    name = f"_ggml_py_abi_{key}"
    folder = os.path.join(os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "ggml_py", "cffi")
    path = os.path.join(folder, name + ".py")
    try:
        if not os.path.exists(path):
            import cffi

            builder = cffi.FFI()
            builder.cdef(cdef)
            builder.set_source(name, None)
            os.makedirs(folder, exist_ok=True)
            tmp = f"{path}.{os.getpid()}.tmp"
            with contextlib.redirect_stdout(io.StringIO()):  # it says "generating ..." on stdout
                builder.emit_python_code(tmp)
            os.replace(tmp, path)  # atomic: another process never reads half a file
        spec = importlib.util.spec_from_file_location(name, path)
        if spec is None or spec.loader is None:
            return None
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module.ffi
    except Exception:  # a read-only home, a damaged file: parse in-process instead
        return None


def const(name: str) -> int:
    """An integer #define of the header (GGML_PY_...)."""
    ffi()
    return _consts[name]


def abi_version() -> tuple[int, int]:
    """(major, minor) of the ABI this ggml_py speaks."""
    return const("GGML_PY_ABI_MAJOR"), const("GGML_PY_ABI_MINOR")


def version_str(v: int) -> str:
    return f"{v >> 16}.{v & 0xFFFF}" if v >= 1 << 16 else str(v)


def check_version(version: int, where: str) -> None:
    """Refuse a plugin this ggml_py cannot run, saying what to rebuild or upgrade."""
    major, minor = abi_version()
    ours = f"{major}.{minor}"
    if version >> 16 == major and version & 0xFFFF <= minor:
        return
    if version >> 16 == major:
        raise BackendError(f"{where}: plugin built against ggml_py backend ABI {version_str(version)}, newer than "
                           f"this ggml_py's {ours}: upgrade ggml_py")
    raise BackendError(f"{where}: plugin built for ggml_py backend ABI version {version_str(version)}, but this "
                       f"ggml_py speaks {ours} (any {major}.x up to {ours}); rebuild it against the header in "
                       "ggml_py.get_include() (`ggml-py config --include`)")
