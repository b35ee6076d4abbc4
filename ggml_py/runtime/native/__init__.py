"""Native backends: plugins speaking the C ABI v2 of `ggml_py/include/ggml_py/backend_abi.h`, driven with cffi.

A plugin is a table of C functions (`ggml_py_plugin`). A shared library exports it through
`ggml_py_plugin_abi_version()` and `ggml_py_plugin_init()`; an extension module already loaded in-process (the
built-in SIMD backend) hands over its address (`load_table`). Either way this package checks the ABI version before
reading anything else, and wraps the table as an ordinary `Backend` / `BufferType` / `BackendRegistration`. Each
split is lowered once into a node array that stays at a fixed address with the plan; symbolic dimensions travel as
affine expressions the plugin binds itself, so a compute is one C call with the symbol values and nothing else.

Ways in (see docs/writing-a-backend.md):
- `ggml_py.runtime.native.load(path)` -> BackendRegistration; `ggml_py.runtime.native.backend(path)` -> Backend;
  `ggml_py.runtime.registry.register_library(path)` adds it to the registry in-process;
- an entry point of group `ggml_py.backends` whose object is a path (str / os.PathLike) or a callable returning one;
- `GGML_PY_BACKEND_PATH`: os.pathsep-separated library paths (or directories of libraries); the backend's name is
  the one the library's init reports.

The package is the ABI adapter only, one concern a module: `abi` (cffi declarations from the header, versions),
`library` (a plugin's table, loading), `buffers`, `lowering` (tensors and nodes into the ABI's structs), `plan` (a
lowered split, the abort callback), `backend` (Backend and BackendRegistration over the table). Discovery (entry
points, GGML_PY_BACKEND_PATH) is the registry's.
"""

from __future__ import annotations

from ggml_py.runtime.native.abi import abi_version, cdef_from_header, check_version, const, ffi, get_include
from ggml_py.runtime.native.backend import ComputeCancelled, NativeBackend, NativeRegistration
from ggml_py.runtime.native.buffers import NativeBufferType
from ggml_py.runtime.native.library import NativeLibrary, backend, load, load_library, load_table

__all__ = ["ComputeCancelled", "NativeBackend", "NativeBufferType", "NativeLibrary", "NativeRegistration",
           "abi_version", "backend", "cdef_from_header", "check_version", "const", "ffi", "get_include", "load",
           "load_library", "load_table"]
