"""GGUF bytes by hand: a small struct serializer, and a trusting walker that takes a *valid* file apart into a
`RawGGUF` (raw KV payloads, tensor infos, data section) to be edited field by field (gguf_corpus.py's malformed
cases). The value type ids are the loader's own (formats/gguf.py)."""

from __future__ import annotations

import copy
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from ggml_py.formats.gguf import (
    T_ARRAY,
    T_BOOL,
    T_FLOAT32,
    T_FLOAT64,
    T_INT8,
    T_INT16,
    T_INT32,
    T_INT64,
    T_STRING,
    T_UINT8,
    T_UINT16,
    T_UINT32,
    T_UINT64,
)
from ggml_py.ir import dtypes

_FMT = {
    T_UINT8: "B",
    T_INT8: "b",
    T_UINT16: "H",
    T_INT16: "h",
    T_UINT32: "I",
    T_INT32: "i",
    T_FLOAT32: "f",
    T_BOOL: "?",
    T_UINT64: "Q",
    T_INT64: "q",
    T_FLOAT64: "d",
}
_SIZE = {t: struct.calcsize("<" + f) for t, f in _FMT.items()}
U64_MAX = 2**64 - 1


# -- serializer ---------------------------------------------------------------------------------------------------


def u32(v: int) -> bytes:
    return struct.pack("<I", v & 0xFFFFFFFF)


def u64(v: int) -> bytes:
    return struct.pack("<Q", v & U64_MAX)


def enc_string(s: str | bytes, length: int | None = None) -> bytes:
    """A GGUF string; `length` overrides the stored length (to lie about it)."""
    b = s.encode() if isinstance(s, str) else s
    return u64(len(b) if length is None else length) + b


def enc_value(vtype: int, value: Any, sub_type: int | None = None) -> bytes:
    """Payload of a value of `vtype` (without the type id itself)."""
    if vtype in _FMT:
        return struct.pack("<" + _FMT[vtype], value)
    if vtype == T_STRING:
        return enc_string(value)
    if vtype == T_ARRAY:
        assert sub_type is not None
        return enc_array(sub_type, value)
    raise ValueError(f"cannot encode value type {vtype}")


def enc_array(etype: int, items: Sequence[Any], count: int | None = None, inner: int | None = None) -> bytes:
    """Array payload; `count` overrides the stored count; `inner` is the element type of nested arrays."""
    body = b"".join(enc_value(etype, it, inner) for it in items)
    return u32(etype) + u64(len(items) if count is None else count) + body


@dataclass
class KV:
    key: bytes
    vtype: int
    payload: bytes  # everything after the value type id
    key_len: int | None = None  # override the stored key length

    def encode(self) -> bytes:
        return enc_string(self.key, self.key_len) + u32(self.vtype) + self.payload


@dataclass
class TI:
    name: bytes
    dims: list[int]  # ne order (innermost first)
    ttype: int
    offset: int  # relative to the data section
    n_dims: int | None = None  # override the stored n_dims
    name_len: int | None = None  # override the stored name length

    def encode(self) -> bytes:
        nd = len(self.dims) if self.n_dims is None else self.n_dims
        return (
            enc_string(self.name, self.name_len)
            + u32(nd)
            + b"".join(u64(d) for d in self.dims)
            + u32(self.ttype)
            + u64(self.offset)
        )

    @property
    def nbytes(self) -> int:
        dt = dtypes.from_ggml_id(self.ttype)
        assert dt is not None
        n = 1
        for d in self.dims:
            n *= d
        return n // dt.block_size * dt.type_size


@dataclass
class RawGGUF:
    """A GGUF file as editable raw parts; `serialize()` writes it back byte for byte."""

    kvs: list[KV]
    tensors: list[TI]
    data: bytes  # the data section, padding included
    version: int = 3
    magic: bytes = b"GGUF"
    n_tensors: int | None = None  # override the stored counts
    n_kv: int | None = None
    pad_to: int = 32  # alignment used to pad the tensor infos (what a writer would use)
    pad_infos: bool = True  # write that padding (a file without tensors may end right after its header)

    def header(self) -> bytes:
        nt = len(self.tensors) if self.n_tensors is None else self.n_tensors
        nk = len(self.kvs) if self.n_kv is None else self.n_kv
        return self.magic + u32(self.version) + u64(nt) + u64(nk)

    def serialize(self) -> bytes:
        out = bytearray(self.header())
        for kv in self.kvs:
            out += kv.encode()
        for ti in self.tensors:
            out += ti.encode()
        if self.pad_infos:
            out += bytes(-len(out) % self.pad_to)
        out += self.data
        return bytes(out)

    def kv_index(self, key: str) -> int:
        for i, kv in enumerate(self.kvs):
            if kv.key == key.encode():
                return i
        raise KeyError(key)

    def set_kv(self, key: str, vtype: int, payload: bytes) -> None:
        try:
            self.kvs[self.kv_index(key)] = KV(key.encode(), vtype, payload)
        except KeyError:
            self.kvs.append(KV(key.encode(), vtype, payload))

    def copy(self) -> RawGGUF:
        return copy.deepcopy(self)


# -- trusting walker over a *valid* file --------------------------------------------------------------------------


def _walk_value(b: bytes, pos: int, vtype: int, name: str, spans: list[tuple[str, int, int]] | None) -> int:
    if vtype in _SIZE:
        if spans is not None:
            spans.append((name, pos, pos + _SIZE[vtype]))
        return pos + _SIZE[vtype]
    if vtype == T_STRING:
        (n,) = struct.unpack_from("<Q", b, pos)
        if spans is not None:
            spans += [(f"{name}.len", pos, pos + 8), (f"{name}.bytes", pos + 8, pos + 8 + n)]
        return pos + 8 + n
    if vtype == T_ARRAY:
        etype, count = struct.unpack_from("<IQ", b, pos)
        if spans is not None:
            spans += [(f"{name}.etype", pos, pos + 4), (f"{name}.count", pos + 4, pos + 12)]
        pos += 12
        for i in range(count):
            pos = _walk_value(b, pos, etype, f"{name}[{i}]", spans if spans is not None and i < 3 else None)
        return pos
    raise ValueError(f"unknown value type {vtype} at {pos}")


def _walk(b: bytes, spans: list[tuple[str, int, int]] | None = None) -> RawGGUF:
    def span(name: str, start: int, n: int) -> int:
        if spans is not None:
            spans.append((name, start, start + n))
        return start + n

    magic = b[:4]
    pos = span("magic", 0, 4)
    version, n_tensors, n_kv = struct.unpack_from("<IQQ", b, 4)
    pos = span("version", pos, 4)
    pos = span("n_tensors", pos, 8)
    pos = span("n_kv", pos, 8)
    kvs: list[KV] = []
    alignment = 32
    for i in range(n_kv):
        (kl,) = struct.unpack_from("<Q", b, pos)
        key = b[pos + 8 : pos + 8 + kl]
        pos = span(f"kv[{i}].key.len", pos, 8)
        pos = span(f"kv[{i}].key.bytes", pos, kl)
        (vtype,) = struct.unpack_from("<I", b, pos)
        pos = span(f"kv[{i}].vtype", pos, 4)
        end = _walk_value(b, pos, vtype, f"kv[{i}].value", spans)
        kvs.append(KV(key, vtype, b[pos:end]))
        if key == b"general.alignment" and vtype == T_UINT32:
            (alignment,) = struct.unpack_from("<I", b, pos)
        pos = end
    tis: list[TI] = []
    for i in range(n_tensors):
        (nl,) = struct.unpack_from("<Q", b, pos)
        name = b[pos + 8 : pos + 8 + nl]
        pos = span(f"ti[{i}].name.len", pos, 8)
        pos = span(f"ti[{i}].name.bytes", pos, nl)
        (nd,) = struct.unpack_from("<I", b, pos)
        pos = span(f"ti[{i}].n_dims", pos, 4)
        dims = list(struct.unpack_from(f"<{nd}Q", b, pos))
        for j in range(nd):
            pos = span(f"ti[{i}].ne[{j}]", pos, 8)
        ttype, off = struct.unpack_from("<IQ", b, pos)
        pos = span(f"ti[{i}].type", pos, 4)
        pos = span(f"ti[{i}].offset", pos, 8)
        tis.append(TI(name, dims, ttype, off))
    data_start = pos + (-pos % alignment)
    pad_infos = data_start <= len(b)
    data_start = min(data_start, len(b))
    if spans is not None and tis:
        span("padding", pos, data_start - pos)
        for i, ti in enumerate(tis):
            span(f"data[{i}]", data_start + ti.offset, ti.nbytes)
    return RawGGUF(kvs, tis, b[data_start:], version, magic, pad_to=alignment, pad_infos=pad_infos)


def dissect(data: bytes) -> RawGGUF:
    """Take a valid GGUF file apart (no validation: use only on files known to be valid)."""
    return _walk(data)


def field_spans(data: bytes) -> list[tuple[str, int, int]]:
    """Named byte ranges of every header field of a valid file (first 3 elements of each array), then data."""
    spans: list[tuple[str, int, int]] = []
    _walk(data, spans)
    return spans
