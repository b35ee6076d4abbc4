"""A plugin's function table, checked against this ggml_py's ABI, and the loaders (a library path, or a table
inside an extension module already loaded)."""

from __future__ import annotations

import functools
import os
import re
import threading
from typing import Any

from ggml_py.errors import BackendError
from ggml_py.ir.schema import PRECISION_TIERS
from ggml_py.runtime.backend import Backend
from ggml_py.runtime.native.abi import (
    ASYNC_FUNCTIONS,
    NON_HOST_FUNCTIONS,
    REQUIRED_FUNCTIONS,
    SYMBOLS,
    check_version,
    ffi,
    version_str,
)
from ggml_py.runtime.native.backend import NativeRegistration
from ggml_py.runtime.native.buffers import NativeBufferType


# -- the library------------------------------------------------------------------------------------------------------
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
                               f"{version_str(int(plugin.abi_version))} does not allow (2.0: {v2_0}, this ggml_py: "
                               f"{f.sizeof('ggml_py_plugin')}); it was built against another backend_abi.h")
        self.struct_size = size
        self.plugin = plugin
        self.name = self._string(plugin.name, "name")
        if not re.fullmatch(r"[a-z0-9_]+", self.name):
            raise BackendError(f"{where}: backend name {self.name!r} must match [a-z0-9_]+")
        self.version = self._string(plugin.version, "version", "0")
        self.description = self._string(plugin.description, "description", "")
        self.abi_version = version_str(int(plugin.abi_version))
        self.abi_minor = int(plugin.abi_version) & 0xFFFF  # the op parameters and sources it knows (schema `since`)
        self.score = int(plugin.score)
        self.default_threads = max(1, int(plugin.n_threads))
        self.is_host = bool(plugin.buffer_type.is_host)
        self.precision = self._precision()
        need = REQUIRED_FUNCTIONS + (() if self.is_host else NON_HOST_FUNCTIONS)
        null = [fn for fn in need if self.fn(fn) is None]
        if null:
            raise BackendError(f"{where} (backend {self.name!r}): required plugin function(s) {', '.join(null)} "
                               "are NULL")
        have_async = [fn for fn in ASYNC_FUNCTIONS if self.fn(fn) is not None]
        if have_async and len(have_async) != len(ASYNC_FUNCTIONS):
            raise BackendError(f"{where} (backend {self.name!r}): asynchronous execution needs all of "
                               f"{', '.join(ASYNC_FUNCTIONS)}; the plugin has only {', '.join(have_async)}")
        self.is_async = bool(have_async)
        self.host_threads = int(plugin.host_threads) if self.has("host_threads") else 0
        self.devices = self._devices()
        # one buffer type per device: a device reads only its own memory
        self.buffer_types = [NativeBufferType(self, i, dev) for i, dev in enumerate(self.devices)] or [
            NativeBufferType(self)]
        self.buffer_type = self.buffer_types[0]
        self._registration: NativeRegistration | None = None

    def _devices(self) -> list[str]:
        """The names of the devices of a plugin that drives several (ABI 2.2 n_devices), [] for one."""
        f = ffi()
        if not self.has("alloc_buffer_device") or int(self.plugin.n_devices) <= 0:
            return []
        if self.fn("init_device") is None or self.fn("alloc_buffer_device") is None or \
                self.plugin.devices == f.NULL:
            raise BackendError(f"{self._where} (backend {self.name!r}): n_devices = {int(self.plugin.n_devices)} "
                               "needs devices, init_device and alloc_buffer_device")
        names = [self._string(self.plugin.devices[i].name, f"devices[{i}].name")
                 for i in range(int(self.plugin.n_devices))]
        bad = [n for n in names if not re.fullmatch(r"[a-z0-9_]+", n)]
        if bad or len(set(names)) != len(names):
            raise BackendError(f"{self._where}: device names {names} must be distinct and match [a-z0-9_]+")
        return names

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
        missing = [s for s in SYMBOLS if not _has_symbol(lib, s)]
        if missing:
            raise BackendError(f"{spath} is not a ggml_py backend plugin: missing symbol(s) {', '.join(missing)} "
                               "(see ggml_py/backend_abi.h in ggml_py.get_include())")
        check_version(int(lib.ggml_py_plugin_abi_version()), spath)  # before reading any struct
        return cls(lib.ggml_py_plugin_init(), spath, spath, keepalive=lib)

    def has(self, name: str) -> bool:
        """Whether field `name` of ggml_py_plugin lies within the plugin's struct_size (a field a later minor
        version appended is absent from a plugin built before it)."""
        return _field_ends()[name] <= self.struct_size

    def fn(self, dotted: str) -> Any:
        """A function pointer of the table, or None when NULL or past the plugin's struct_size."""
        f = ffi()
        parts = dotted.split(".")
        if not self.has(parts[0]):
            return None
        obj = self.plugin
        for p in parts:
            obj = getattr(obj, p)
        return None if obj == f.NULL else obj

    def _precision(self) -> str:
        """The tier the plugin claims (schema.PRECISION_TIERS by value), "exact" when its table ends before it."""
        if not self.has("precision"):
            return "exact"
        value = int(self.plugin.precision)
        if not 0 <= value < len(PRECISION_TIERS):
            raise BackendError(f"{self._where}: precision {value} is neither GGML_PY_PRECISION_EXACT (0) nor "
                               "GGML_PY_PRECISION_REDUCED (1)")
        return PRECISION_TIERS[value]

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


@functools.cache
def _field_ends() -> dict[str, int]:
    """The byte where each field of ggml_py_plugin ends."""
    f = ffi()
    return {name: fld.offset + f.sizeof(fld.type) for name, fld in f.typeof("ggml_py_plugin").fields}


def _has_symbol(lib: Any, name: str) -> bool:
    try:
        getattr(lib, name)
    except Exception:  # AttributeError, or ffi.error from a compiled (out-of-line) ffi
        return False
    return True


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
