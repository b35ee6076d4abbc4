"""Validated, zero-copy loading of GGUF files.

`open_gguf(path)` memory-maps the file and walks it with our own validating parser before anything in it is
trusted. Every length, count and offset is checked against the bytes that remain *before* anything is read or
allocated, so a hostile file can make the parser neither allocate more than the file holds nor read out of bounds.
Any violation raises `GGUFError(path, reason)`.

Layout (little-endian): magic ``GGUF``, version u32 (2 or 3), tensor count u64, KV count u64; KV entries
(key string, value type u32, value); tensor infos (name string, n_dims u32, ne u64 x n_dims, type u32, offset u64
relative to the data section); padding to ``general.alignment`` (default 32); the data section.
Strings are a u64 byte length followed by UTF-8 bytes; arrays are an element type u32, a u64 count, then the elements.

Metadata values: scalars become Python scalars, strings `str`; an array of numbers or bools becomes a read-only
numpy array (a copy: the bytes it holds, not a Python object per element), an array of strings a list of `str`, an
array of arrays a list. A file may hold at most `MAX_NESTED_ARRAYS` arrays inside arrays, at most `MAX_ARRAY_DEPTH`
levels deep (llama.cpp's reader accepts no nested arrays at all).
"""

from __future__ import annotations

import mmap
import os
import stat
import struct
from array import array
from dataclasses import dataclass
from typing import Any

import numpy as np

from ggml_py.errors import GGUFError
from ggml_py.ir import dtypes
from ggml_py.ir.dtypes import DType

__all__ = ["GGUFFile", "TensorInfo", "open_gguf", "MAX_ARRAY_DEPTH", "MAX_NESTED_ARRAYS", "MAX_DIMS",
           "DEFAULT_ALIGNMENT", "VALUE_TYPES"]

GGUF_MAGIC = b"GGUF"
SUPPORTED_VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32
MAX_DIMS = 4
MAX_ARRAY_DEPTH = 8  # an array of arrays of ... at most this many levels
# Arrays inside arrays, over the whole file: each becomes a Python list or numpy array (~100 bytes however empty),
# so a file of 12-byte empty arrays would otherwise cost ~10x its size and minutes to build.
MAX_NESTED_ARRAYS = 65536
MAX_KEY_BYTES = 65535  # GGUF spec: keys are at most 2^16-1 bytes
INT64_MAX = 2**63 - 1

HEADER_BYTES = 24  # magic, version, tensor count, KV count
MIN_KV_BYTES = 8 + 1 + 4 + 1  # key length, a 1-byte key, value type, smallest value
MIN_TENSOR_INFO_BYTES = 8 + 1 + 4 + 8 + 4 + 8  # name length, 1-byte name, n_dims, one dim, type, offset

# GGUF value type ids.
T_UINT8, T_INT8, T_UINT16, T_INT16, T_UINT32, T_INT32, T_FLOAT32, T_BOOL = range(8)
T_STRING, T_ARRAY, T_UINT64, T_INT64, T_FLOAT64 = range(8, 13)

VALUE_TYPES: dict[int, str] = {
    T_UINT8: "uint8", T_INT8: "int8", T_UINT16: "uint16", T_INT16: "int16", T_UINT32: "uint32", T_INT32: "int32",
    T_FLOAT32: "float32", T_BOOL: "bool", T_STRING: "string", T_ARRAY: "array", T_UINT64: "uint64",
    T_INT64: "int64", T_FLOAT64: "float64",
}  # fmt: skip

# Scalar value types: (struct for one value, numpy dtype for arrays of them).
_SCALARS: dict[int, tuple[struct.Struct, np.dtype]] = {
    t: (struct.Struct("<" + c), np.dtype("<" + n))
    for t, c, n in (
        (T_UINT8, "B", "u1"), (T_INT8, "b", "i1"), (T_UINT16, "H", "u2"), (T_INT16, "h", "i2"),
        (T_UINT32, "I", "u4"), (T_INT32, "i", "i4"), (T_FLOAT32, "f", "f4"), (T_BOOL, "B", "u1"),
        (T_UINT64, "Q", "u8"), (T_INT64, "q", "i8"), (T_FLOAT64, "d", "f8"),
    )
}  # fmt: skip
_ARRAY_TYPE_OF = {npd.newbyteorder("="): t for t, (_, npd) in _SCALARS.items() if t != T_BOOL}


def array_element_type(dtype: np.dtype) -> int:
    """The GGUF element type of a numeric or bool metadata array read as `dtype` (the reader's table backwards:
    bools arrive as np.bool_)."""
    return T_BOOL if dtype == np.bool_ else _ARRAY_TYPE_OF[np.dtype(dtype).newbyteorder("=")]


# Fewest bytes one value of each type can take (a string or array needs at least its length/header).
_MIN_VALUE_BYTES: dict[int, int] = {**{t: s.size for t, (s, _) in _SCALARS.items()}, T_STRING: 8, T_ARRAY: 12}

_FAST_STRINGS_MIN = 256  # string arrays at least this long take the vectorized path
_U32 = struct.Struct("<I")
_U64 = struct.Struct("<Q")
_U32U64 = struct.Struct("<IQ")


@dataclass(frozen=True)
class TensorInfo:
    """One tensor of a GGUF file: `shape` in numpy order (reversed ne), `offset` absolute in the file."""

    name: str
    dtype: DType
    shape: tuple[int, ...]
    offset: int
    nbytes: int

    @property
    def n_elements(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n

    @property
    def row_bytes(self) -> int:
        """Bytes taken by one innermost row."""
        return self.dtype.row_size(self.shape[-1])


def _type_name(t: int) -> str:
    return VALUE_TYPES.get(t, f"type {t}")


def _ggml_type_label(type_id: int) -> str:
    """Name of a ggml type id as gguf knows it, for error messages ('' if gguf does not know it either)."""
    try:
        from gguf.constants import GGMLQuantizationType

        return f" ({GGMLQuantizationType(type_id).name})"
    except Exception:  # gguf missing or id unknown to it
        return ""


class _Parser:
    """Single pass over the mapped bytes; every read is preceded by a bounds check."""

    def __init__(self, mm: mmap.mmap, path: str) -> None:
        self.mm = mm
        self.buf = memoryview(mm)  # slices of it decode without a copy; released when parsing ends
        self.path = path
        self.end = len(mm)
        self.pos = 0
        self.nested = 0  # arrays met inside arrays so far

    def fail(self, reason: str) -> GGUFError:
        return GGUFError(self.path, reason)

    def need(self, n: int, what: str) -> None:
        if n > self.end - self.pos:
            raise self.fail(f"truncated {what} at offset {self.pos}: needs {n} bytes, {self.end - self.pos} left")

    def u32(self, what: str) -> int:
        self.need(4, what)
        (v,) = _U32.unpack_from(self.buf, self.pos)
        self.pos += 4
        return v

    def u64(self, what: str) -> int:
        self.need(8, what)
        (v,) = _U64.unpack_from(self.buf, self.pos)
        self.pos += 8
        return v

    def string(self, what: str, max_len: int | None = None) -> str:
        n = self.u64(f"length of {what}")
        if n > self.end - self.pos:
            raise self.fail(f"{what} at offset {self.pos - 8}: length {n} exceeds the {self.end - self.pos} bytes left")
        if max_len is not None and n > max_len:
            raise self.fail(f"{what} at offset {self.pos - 8}: length {n} exceeds the maximum of {max_len}")
        start = self.pos
        self.pos += n
        try:
            return str(self.buf[start : self.pos], "utf-8")
        except UnicodeDecodeError:
            raise self.fail(f"{what} at offset {start} is not valid UTF-8") from None

    # -- values -----------------------------------------------------------------------------------------------

    def value(self, vtype: int, key: str, depth: int) -> Any:
        sc = _SCALARS.get(vtype)
        if sc is not None:
            st = sc[0]
            self.need(st.size, f"{_type_name(vtype)} value of key {key!r}")
            (v,) = st.unpack_from(self.buf, self.pos)
            self.pos += st.size
            return bool(v) if vtype == T_BOOL else v
        if vtype == T_STRING:
            return self.string(f"string value of key {key!r}")
        if vtype == T_ARRAY:
            return self.array(key, depth + 1)
        raise self.fail(f"unknown value type {vtype} for key {key!r}")

    def array(self, key: str, depth: int) -> list[Any] | np.ndarray:
        if depth > MAX_ARRAY_DEPTH:
            raise self.fail(f"arrays nested deeper than {MAX_ARRAY_DEPTH} levels in key {key!r}")
        if depth > 1:
            self.nested += 1
            if self.nested > MAX_NESTED_ARRAYS:
                raise self.fail(f"more than {MAX_NESTED_ARRAYS} arrays nested inside arrays (at key {key!r})")
        at = self.pos
        self.need(12, f"array header of key {key!r}")
        etype, count = _U32U64.unpack_from(self.buf, self.pos)
        self.pos += 12
        min_size = _MIN_VALUE_BYTES.get(etype)
        if min_size is None:
            raise self.fail(f"unknown array element type {etype} for key {key!r}")
        left = self.end - self.pos
        if count > left // min_size:  # also covers counts up to 2^64-1 without forming count * size
            raise self.fail(
                f"array of key {key!r} at offset {at} claims {count} {_type_name(etype)} elements "
                f"(at least {min_size} bytes each), only {left} bytes left"
            )
        sc = _SCALARS.get(etype)
        if sc is not None:
            npd = sc[1]
            arr = np.frombuffer(self.buf, dtype=npd, count=count, offset=self.pos)
            self.pos += count * npd.itemsize
            # a copy (the mapping may close) in native byte order, as compact as the file: not a list of objects
            out = (arr != 0) if etype == T_BOOL else arr.astype(npd.newbyteorder("="))
            del arr  # release the buffer export at once
            out.flags.writeable = False  # metadata is shared (tokenizer, hparams, info): nobody edits it in place
            return out
        if etype == T_STRING:
            return self.string_array(key, count)
        return [self.array(key, depth + 1) for _ in range(count)]

    def string_array(self, key: str, count: int) -> list[str]:
        """A string array. Long ones (a vocabulary) are walked once for their lengths, then decoded in one go."""
        if count < _FAST_STRINGS_MIN:
            return self.string_items(key, count)
        buf, pos, unpack = self.buf, self.pos, _U64.unpack_from
        start = pos
        ends = array("q")  # 8 bytes per string, no int objects kept
        append = ends.append
        try:  # optimistic walk: a length running past the end shows up as an error or as pos > end below
            for _ in range(count):
                (n,) = unpack(buf, pos)
                pos += 8 + n
                append(pos)
        except (struct.error, OverflowError):
            pos = self.end + 1
        if pos > self.end:
            del ends
            return self.string_items(key, count)  # the checked walk names the culprit
        # Drop each 8-byte length but its last byte, which becomes a NUL separator; then decode and split once.
        size = pos - start
        prefix = np.empty(count, dtype=np.int64)
        prefix[0] = 0
        prefix[1:] = np.frombuffer(ends, dtype=np.int64, count=count - 1) - start
        del ends
        region = np.frombuffer(buf, dtype=np.uint8, count=size, offset=start)
        joined = region.copy()
        del region
        step = np.zeros(size + 1, dtype=np.int8)
        step[prefix] = 1
        step[prefix + 7] = -1
        keep = np.cumsum(step[:size], dtype=np.int8) == 0
        del step
        joined[prefix + 7] = 0
        data = joined[keep].tobytes()
        del joined, keep, prefix
        if data.count(0) == count:  # no NUL inside the strings themselves: the split is exact
            try:
                out = str(data, "utf-8").split("\0")
            except UnicodeDecodeError:
                pass  # rescan one by one to name the bad string
            else:
                self.pos = pos
                return out[1:]
        del data
        return self.string_items(key, count)

    def string_items(self, key: str, count: int) -> list[str]:
        """A string array, one string at a time."""
        buf, end, pos, unpack = self.buf, self.end, self.pos, _U64.unpack_from
        out: list[str] = []
        append = out.append
        try:
            for i in range(count):
                if end - pos < 8:
                    self.pos = pos
                    self.need(8, f"length of string {i} in array of key {key!r}")
                (n,) = unpack(buf, pos)
                pos += 8
                if n > end - pos:
                    raise self.fail(
                        f"string {i} in array of key {key!r} at offset {pos - 8}: "
                        f"length {n} exceeds the {end - pos} bytes left"
                    )
                append(str(buf[pos : pos + n], "utf-8"))
                pos += n
        except UnicodeDecodeError:
            raise self.fail(f"string {len(out)} in array of key {key!r} at offset {pos} is not valid UTF-8") from None
        self.pos = pos
        return out

    # -- sections ---------------------------------------------------------------------------------------------

    def parse(self) -> GGUFFile:
        try:
            return self._parse()
        finally:
            self.buf.release()

    def _parse(self) -> GGUFFile:
        if self.end == 0:
            raise self.fail("file is empty")
        self.need(4, "magic")
        magic = self.buf[0:4].tobytes()
        if magic != GGUF_MAGIC:
            raise self.fail(f"bad magic {magic!r}, not a GGUF file")
        self.pos = 4
        version = self.u32("version")
        if version not in SUPPORTED_VERSIONS:
            if int.from_bytes(version.to_bytes(4, "little"), "big") in SUPPORTED_VERSIONS:
                raise self.fail(f"big-endian GGUF (version field {version:#010x}) is not supported")
            raise self.fail(f"unsupported GGUF version {version} (supported: 2, 3)")
        n_tensors = self.u64("tensor count")
        n_kv = self.u64("KV count")
        left = self.end - self.pos
        if n_kv > left // MIN_KV_BYTES:
            raise self.fail(f"KV count {n_kv} is implausible: {left} bytes left, each entry needs {MIN_KV_BYTES}")
        if n_tensors > left // MIN_TENSOR_INFO_BYTES:
            raise self.fail(
                f"tensor count {n_tensors} is implausible: {left} bytes left, each needs {MIN_TENSOR_INFO_BYTES}"
            )
        if n_kv * MIN_KV_BYTES + n_tensors * MIN_TENSOR_INFO_BYTES > left:
            raise self.fail(f"{n_kv} KV entries and {n_tensors} tensor infos cannot fit in the {left} bytes left")

        metadata: dict[str, Any] = {}
        types: dict[str, int] = {}
        for i in range(n_kv):
            key = self.string(f"key of KV {i}", MAX_KEY_BYTES)
            if not key:
                raise self.fail(f"KV {i} has an empty key")
            if key in metadata:
                raise self.fail(f"duplicate key {key!r}")
            vtype = self.u32(f"value type of key {key!r}")
            metadata[key] = self.value(vtype, key, 0)
            types[key] = vtype

        alignment = DEFAULT_ALIGNMENT
        if "general.alignment" in metadata:
            if types["general.alignment"] != T_UINT32:
                raise self.fail(f"general.alignment must be uint32, not {_type_name(types['general.alignment'])}")
            alignment = metadata["general.alignment"]
            if alignment == 0 or alignment & (alignment - 1):
                raise self.fail(f"general.alignment {alignment} is not a power of two")

        raw: list[tuple[str, DType, tuple[int, ...], int, int]] = []
        names: set[str] = set()
        for i in range(n_tensors):
            name = self.string(f"name of tensor {i}")
            if not name:
                raise self.fail(f"tensor {i} has an empty name")
            if name in names:
                raise self.fail(f"duplicate tensor name {name!r}")
            names.add(name)
            n_dims = self.u32(f"n_dims of tensor {name!r}")
            if not 1 <= n_dims <= MAX_DIMS:
                raise self.fail(f"tensor {name!r}: n_dims {n_dims} is not in 1..{MAX_DIMS}")
            self.need(8 * n_dims + 12, f"dims, type and offset of tensor {name!r}")
            ne = struct.unpack_from(f"<{n_dims}Q", self.buf, self.pos)
            self.pos += 8 * n_dims
            type_id, rel = _U32U64.unpack_from(self.buf, self.pos)
            self.pos += 12
            n = 1
            for j, d in enumerate(ne):
                if d == 0:
                    raise self.fail(f"tensor {name!r}: ne[{j}] is 0")
                if d > INT64_MAX:
                    raise self.fail(f"tensor {name!r}: ne[{j}] = {d} exceeds int64")
                n *= d
                if n > INT64_MAX:
                    raise self.fail(f"tensor {name!r}: element count of ne {list(ne)} overflows int64")
            dt = dtypes.from_ggml_id(type_id)
            if dt is None:
                label = _ggml_type_label(type_id)
                raise self.fail(f"tensor {name!r}: tensor type id {type_id}{label} is not supported by ggml_py")
            if ne[0] % dt.block_size:
                raise self.fail(
                    f"tensor {name!r}: innermost dimension {ne[0]} is not a multiple of the {dt.name} "
                    f"block size {dt.block_size}"
                )
            if rel % alignment:
                raise self.fail(f"tensor {name!r}: offset {rel} is not a multiple of the alignment {alignment}")
            nbytes = n // dt.block_size * dt.type_size
            raw.append((name, dt, tuple(reversed(ne)), rel, nbytes))

        data_offset = -(-self.pos // alignment) * alignment
        if raw and data_offset > self.end:
            raise self.fail(f"data section offset {data_offset} is past the end of the file ({self.end} bytes)")
        tensors: dict[str, TensorInfo] = {}
        for name, dt, shape, rel, nbytes in raw:
            start = data_offset + rel
            if start + nbytes > self.end:
                raise self.fail(
                    f"tensor {name!r}: data [{start}, {start + nbytes}) extends past the end of the file "
                    f"({self.end} bytes)"
                )
            tensors[name] = TensorInfo(name, dt, shape, start, nbytes)
        prev: TensorInfo | None = None
        for t in sorted(tensors.values(), key=lambda t: t.offset):
            if prev is not None and t.offset < prev.offset + prev.nbytes:
                raise self.fail(
                    f"tensors {prev.name!r} [{prev.offset}, {prev.offset + prev.nbytes}) and {t.name!r} "
                    f"[{t.offset}, {t.offset + t.nbytes}) overlap"
                )
            prev = t
        return GGUFFile(self.path, self.mm, version, alignment, data_offset, metadata, types, tensors)


class GGUFFile:
    """A validated GGUF file. Tensor data are zero-copy, read-only views of the file's memory map.

    Use as a context manager or call `close()`; arrays returned by `data()` keep the mapping alive on their own.
    """

    def __init__(
        self,
        path: str,
        mm: mmap.mmap,
        version: int,
        alignment: int,
        data_offset: int,
        metadata: dict[str, Any],
        metadata_types: dict[str, int],
        tensors: dict[str, TensorInfo],
    ) -> None:
        self.path = path
        self.file_size = len(mm)
        self.version = version
        self.alignment = alignment
        self.data_offset = data_offset
        self.metadata = metadata
        self.metadata_types = metadata_types  # GGUF value type id of each key (see VALUE_TYPES)
        self.tensors = tensors
        self._mm: mmap.mmap | None = mm

    @property
    def architecture(self) -> str | None:
        """`general.architecture`, or None when absent or not a string."""
        arch = self.metadata.get("general.architecture")
        return arch if isinstance(arch, str) else None

    @property
    def closed(self) -> bool:
        return self._mm is None

    def check_size(self) -> None:
        """Raise GGUFError if the file on disk is now shorter than when it was mapped.

        Touching a mapped page past the new end of a truncated file kills the process with SIGBUS, so callers check
        this where it is cheap (one fstat): at load and before each eval/generate. A file truncated *during* a
        compute still faults; llama.cpp has the same exposure with its mmap'd weights."""
        if self._mm is None:
            raise GGUFError(self.path, "file is closed")
        try:
            size = self._mm.size()  # fstat of the mapping's own descriptor: the file as it is now
        except (OSError, ValueError) as e:
            raise GGUFError(self.path, f"cannot check the file's size: {e}") from None
        if size < self.file_size:
            raise GGUFError(self.path, f"the file shrank on disk from {self.file_size} to {size} bytes while "
                                       "loaded; its weights can no longer be read (reload it)")

    def data(self, name: str) -> np.ndarray:
        """Zero-copy read-only view of a tensor's bytes: typed with the numpy shape for scalar types,
        uint8 of shape `(*shape[:-1], row_bytes)` for quantized types."""
        t = self.tensors.get(name)
        if t is None:
            raise GGUFError(self.path, f"no tensor named {name!r}")
        if self._mm is None:
            raise GGUFError(self.path, "file is closed")
        npd = t.dtype.np_dtype
        if npd is None:
            arr = np.frombuffer(self._mm, dtype=np.uint8, count=t.nbytes, offset=t.offset)
            return arr.reshape(*t.shape[:-1], t.row_bytes)
        arr = np.frombuffer(self._mm, dtype=npd.newbyteorder("<"), count=t.nbytes // npd.itemsize, offset=t.offset)
        return arr.reshape(t.shape)

    def close(self) -> None:
        """Drop the mapping; if arrays from `data()` are still alive it is unmapped when the last one goes."""
        mm, self._mm = self._mm, None
        if mm is not None:
            try:
                mm.close()
            except BufferError:  # exported views still exist; they own the mapping now
                pass

    def __enter__(self) -> GGUFFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self.closed else f"{len(self.tensors)} tensors, {len(self.metadata)} keys"
        return f"<GGUFFile {self.path!r} v{self.version} {self.architecture or '?'}: {state}>"


def open_gguf(path: str | os.PathLike[str]) -> GGUFFile:
    """Memory-map and validate a GGUF file; raises `GGUFError(path, reason)` on any problem."""
    spath = os.fspath(path)
    try:
        # O_NONBLOCK: opening a FIFO must not wait for a writer; it is refused below like any non-regular file
        fd = os.open(spath, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
        try:
            st = os.fstat(fd)
            if stat.S_ISDIR(st.st_mode):
                raise IsADirectoryError(spath)
            if not stat.S_ISREG(st.st_mode):
                raise GGUFError(spath, "not a regular file (a FIFO, socket or device cannot be memory-mapped)")
            if st.st_size == 0:
                raise GGUFError(spath, "file is empty")
            mm = mmap.mmap(fd, 0, access=mmap.ACCESS_READ)
        finally:
            os.close(fd)
    except FileNotFoundError:
        raise GGUFError(spath, "no such file") from None
    except IsADirectoryError:
        raise GGUFError(spath, "is a directory") from None
    except (OSError, ValueError) as e:
        raise GGUFError(spath, f"cannot open: {getattr(e, 'strerror', None) or e}") from None
    try:
        return _Parser(mm, spath).parse()
    except BaseException:
        try:
            mm.close()
        except BufferError:
            pass
        raise
