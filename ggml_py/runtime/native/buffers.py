"""A plugin's buffer type and buffers: host memory numpy reads directly, or device memory reached through the
plugin's copy functions."""

from __future__ import annotations

import weakref
from typing import TYPE_CHECKING, Any

import numpy as np

from ggml_py import counters
from ggml_py.errors import BackendError
from ggml_py.ir.tensor import Tensor
from ggml_py.runtime.backend import Buffer, BufferType, HostBuffer
from ggml_py.runtime.native.abi import STATUS, ffi
from ggml_py.runtime.native.lowering import upper_layout, write_tensor

if TYPE_CHECKING:
    from ggml_py.runtime.native.library import NativeLibrary


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
        self._finalizer = weakref.finalize(self, free_buffer, self._lib, cbuf)

    @property
    def base(self) -> int:
        return int(ffi().cast("uintptr_t", self._cbuf.base))

    def _call(self, what: str, rc: int) -> None:
        if rc != 0:
            raise BackendError(f"{self._lib.where()}: buffer {what} failed (status {rc} {STATUS.get(rc, '?')})")

    def set_tensor(self, offset: int, data: bytes | memoryview | np.ndarray) -> None:
        src = np.ascontiguousarray(np.frombuffer(data, np.uint8) if not isinstance(data, np.ndarray) else
                                   data.reshape(-1).view(np.uint8))
        self._check(offset, src.nbytes)
        self._call("set_tensor", self._lib.plugin.buffer.set_tensor(self._cbuf, offset, ffi().from_buffer(src),
                                                                    src.nbytes))
        counters.bump("abi_set_tensor")

    def get_tensor(self, offset: int, size: int) -> np.ndarray:
        self._check(offset, size)
        out = np.empty(size, np.uint8)
        self._call("get_tensor", self._lib.plugin.buffer.get_tensor(self._cbuf, offset, ffi().from_buffer(out), size))
        counters.bump("abi_get_tensor")
        return out

    def copy_tensor(self, src: Buffer, src_offset: int, dst_offset: int, size: int) -> bool:
        """Through the plugin's buffer_copy (ABI 2.2) when `src` is a buffer of the same plugin: no host memory."""
        fn = self._lib.fn("buffer_copy")
        if fn is None or not isinstance(src, NativeDeviceBuffer) or src._lib is not self._lib:
            return False
        src._check(src_offset, size)
        self._check(dst_offset, size)
        self._call("buffer_copy", fn(src._cbuf, src_offset, self._cbuf, dst_offset, size))
        counters.bump("abi_buffer_copy")
        return True

    def memset(self, offset: int, value: int, size: int) -> None:
        self._check(offset, size)
        self._call("memset_tensor", self._lib.plugin.buffer.memset_tensor(self._cbuf, offset, value, size))

    def free(self) -> None:
        self._finalizer()
        self.size = 0


def free_buffer(lib: NativeLibrary, cbuf: Any) -> None:
    lib.plugin.buffer.free_buffer(cbuf)


class NativeBufferType(BufferType):
    """The plugin's buffer type; allocations go through its alloc_buffer."""

    def __init__(self, library: NativeLibrary, device: int | None = None, device_name: str = "") -> None:
        bt = library.plugin.buffer_type
        self.library = library
        self.device = device  # the device of a plugin that drives several (its memory: a buffer type of its own)
        self.name = library._string(bt.name, "buffer type name", library.name)
        if device is not None:
            self.name += f":{device_name}"
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
        write_tensor(tc, tensor, *upper_layout(tensor), data=0)
        return max(int(fn(tc)), tensor.nbytes)

    def alloc_buffer(self, size: int) -> Buffer:
        f = ffi()
        lib = self.library
        size = max(int(size), 1)
        cbuf = f.new("ggml_py_buffer *")
        rc = int(lib.plugin.buffer_type.alloc_buffer(size, cbuf) if self.device is None else
                 lib.plugin.alloc_buffer_device(self.device, size, cbuf))
        if rc != 0 or cbuf.base == f.NULL:
            raise BackendError(f"{lib.where()}: alloc_buffer({size}) failed (status {rc} {STATUS.get(rc, '?')})")
        if int(cbuf.size) < size:
            free_buffer(lib, cbuf)
            raise BackendError(f"{lib.where()}: alloc_buffer({size}) returned only {int(cbuf.size)} bytes")
        if not self.is_host:
            buf: Buffer = NativeDeviceBuffer(self, cbuf, size)
            buf.clear()
            return buf
        addr = int(f.cast("uintptr_t", cbuf.base))
        if addr % self.alignment:
            free_buffer(lib, cbuf)
            raise BackendError(f"{lib.where()}: alloc_buffer returned an address not aligned to {self.alignment}")
        # The memory is released (free_buffer) when the last numpy view over it is gone, never before.
        owner = f.gc(f.cast("uint8_t *", cbuf.base), lambda _ptr, lib=lib, cbuf=cbuf: free_buffer(lib, cbuf))
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
        owner = (array, weakref.finalize(cbuf, free_buffer, self.library, cbuf), cbuf)
        return NativeHostBuffer(self, raw, owner=owner)
