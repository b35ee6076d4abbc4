"""Valid tiny GGUF models and a corpus of precisely malformed ones, for testing `ggml_py.formats.gguf`.

The valid base is written by `gguf.GGUFWriter`. It is then taken apart into a `RawGGUF` (raw KV payloads, tensor
infos, data section) by a trusting walker, edited, and written back with our own small struct serializer
(gguf_bytes.py), so an invalid file can be crafted field by field. Each malformed case has a name and a regex the
loader's reason must match.
"""

from __future__ import annotations

import copy
import os
import re
import struct
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ggml_py.formats.gguf import MAX_ARRAY_DEPTH, MIN_KV_BYTES, MIN_TENSOR_INFO_BYTES
from ggml_py.ir import dtypes
from ggml_py.testing.gguf_bytes import (  # noqa: F401 (re-exported: the corpus's users build bytes with them)
    KV,
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
    TI,
    U64_MAX,
    RawGGUF,
    dissect,
    enc_array,
    enc_string,
    enc_value,
    field_spans,
    u32,
    u64,
)

__all__ = [
    "Case",
    "KV",
    "RawGGUF",
    "TI",
    "dissect",
    "enc_array",
    "enc_string",
    "enc_value",
    "field_spans",
    "malformed_cases",
    "tiny_model",
    "tiny_spec",
    "truncations",
    "write_tiny_model",
]

# -- valid tiny models, written by gguf.GGUFWriter -------------------------------------------------------------------


def tiny_spec(seed: int = 0) -> tuple[list[tuple[str, int, Any, int | None]], list[tuple[str, np.ndarray, int | None]]]:
    """What a tiny model holds: KVs as (key, value type, value, array element type) and tensors as
    (name, array as GGUFWriter gets it, raw ggml type id or None). Quantized tensors are random bytes."""
    rng = np.random.default_rng(seed)
    kvs: list[tuple[str, int, Any, int | None]] = [
        ("general.name", T_STRING, f"tiny-{seed}", None),
        ("llama.block_count", T_UINT32, 1, None),
        ("llama.context_length", T_UINT32, 64, None),
        ("llama.rope.freq_base", T_FLOAT32, 10000.0, None),
        ("test.u8", T_UINT8, 200, None),
        ("test.i8", T_INT8, -5, None),
        ("test.u16", T_UINT16, 65535, None),
        ("test.i16", T_INT16, -300, None),
        ("test.i32", T_INT32, -70000, None),
        ("test.u64", T_UINT64, 2**64 - 1, None),
        ("test.i64", T_INT64, -(2**63), None),
        ("test.f64", T_FLOAT64, 0.1, None),
        ("test.bool", T_BOOL, True, None),
        ("test.unicode", T_STRING, "héllo ✓ 🙂", None),
        ("tokenizer.ggml.tokens", T_ARRAY, ["<s>", "</s>", "a", "Ġb", "é", "🙂", "", "xyz"], T_STRING),
        ("tokenizer.ggml.token_type", T_ARRAY, [3, 3, 1, 1, 1, 1, 1, 1], T_INT32),
        ("test.f32s", T_ARRAY, [0.5, -1.25, 3.0], T_FLOAT32),
        ("test.bools", T_ARRAY, [True, False, True], T_BOOL),
        ("test.nested", T_ARRAY, [[1, 2], [3]], T_ARRAY),
    ]
    tensors: list[tuple[str, np.ndarray, int | None]] = [
        ("token_embd.weight", rng.integers(0, 256, (8, 2 * 34), dtype=np.uint8), dtypes.Q8_0.ggml_id),
        ("blk.0.attn_norm.weight", rng.standard_normal(64).astype(np.float32), None),
        ("blk.0.ffn_up.weight", rng.standard_normal((3, 8)).astype(np.float16), None),
        ("blk.0.ffn_down.weight", rng.integers(0, 256, (2, 144), dtype=np.uint8), dtypes.Q4_K.ggml_id),
        ("pos", np.arange(8, dtype=np.int32).reshape(2, 2, 2), None),
        ("four_d", rng.standard_normal((1, 2, 1, 3)).astype(np.float32), None),
        ("bf", rng.integers(0, 2**16, (2, 5), dtype=np.uint16), dtypes.BF16.ggml_id),
    ]
    return kvs, tensors


def write_tiny_model(
    path: str | os.PathLike[str],
    *,
    seed: int = 0,
    alignment: int | None = None,
    with_tensors: bool = True,
    fat: bool = False,
) -> None:
    """Write the tiny model of `tiny_spec(seed)` with gguf.GGUFWriter; `fat` puts a 4 KiB string first, so that
    truncating anywhere after it leaves enough bytes for the header counts to look plausible."""
    import gguf

    kvs, tensors = tiny_spec(seed)
    w = gguf.GGUFWriter(os.fspath(path), "llama")
    if fat:
        w.add_description("d" * 4096)
    if alignment is not None:
        w.add_custom_alignment(alignment)
    for key, vtype, value, sub in kvs:
        w.add_key_value(key, value, gguf.GGUFValueType(vtype), None if sub is None else gguf.GGUFValueType(sub))
    if with_tensors:
        for name, arr, raw in tensors:
            if raw is None:
                w.add_tensor(name, arr)
            elif raw == dtypes.BF16.ggml_id:
                w.add_tensor(name, arr, raw_shape=arr.shape, raw_dtype=gguf.GGMLQuantizationType(raw))
            else:
                w.add_tensor(name, arr, raw_dtype=gguf.GGMLQuantizationType(raw))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


_TINY_CACHE: dict[tuple[int, int | None, bool, bool], bytes] = {}


def tiny_model(*, seed: int = 0, alignment: int | None = None, with_tensors: bool = True, fat: bool = False) -> bytes:
    """Bytes of a valid tiny model written by GGUFWriter (cached)."""
    k = (seed, alignment, with_tensors, fat)
    if k not in _TINY_CACHE:
        with tempfile.TemporaryDirectory() as d:
            p = os.path.join(d, "tiny.gguf")
            write_tiny_model(p, seed=seed, alignment=alignment, with_tensors=with_tensors, fat=fat)
            with open(p, "rb") as f:
                _TINY_CACHE[k] = f.read()
    return _TINY_CACHE[k]


# -- malformed cases ---------------------------------------------------------------------------------------------


@dataclass
class Case:
    name: str
    data: bytes
    expect: str  # regex the GGUFError reason must match
    tags: tuple[str, ...] = field(default=())

    def matches(self, reason: str) -> bool:
        return re.search(self.expect, reason) is not None


_TRUNC = r"truncated|exceeds|past the end|implausible|cannot fit|claims|bytes left"
_HUGE = (2**63, 2**63 - 1, U64_MAX, 2**61, 2**62 + 1, 2**32, 2**32 + 1)  # include products that wrap at 2^64


def _nested(depth: int) -> bytes:
    """Payload of `depth` nested arrays around a single uint8."""
    p = enc_array(T_UINT8, [7])
    for _ in range(depth - 1):
        p = u32(T_ARRAY) + u64(1) + p
    return p


def truncations(base: bytes, prefix: str = "truncate") -> Iterator[Case]:
    """`base` cut at the start and in the middle of every field of a valid file, and inside each tensor's data."""
    raw = dissect(base)
    data_start = len(base) - len(raw.data)
    last_end = max((ti.offset + ti.nbytes for ti in raw.tensors), default=len(raw.data)) + data_start
    for name, start, end in field_spans(base):
        cuts = {start, (start + end) // 2} if end - start > 1 else {start}
        for cut in sorted(cuts):
            if 0 < cut < last_end:
                yield Case(f"{prefix}:{name}@{cut - start}", base[:cut], _TRUNC, ("truncate",))


def malformed_cases(base: bytes | None = None, fat_base: bytes | None = None) -> Iterator[Case]:
    """Every malformed variant of `base` (default: `tiny_model()`, plus truncations of `tiny_model(fat=True)`),
    each with a name and a regex for the expected reason."""
    if base is None:
        base = tiny_model()
    raw = dissect(base)
    size = len(base)
    spans = field_spans(base)
    data_start = size - len(raw.data)
    names = [ti.name for ti in raw.tensors]
    q8 = next(i for i, ti in enumerate(raw.tensors) if ti.ttype == dtypes.Q8_0.ggml_id)

    def edit(fn: Any) -> bytes:
        r = raw.copy()
        fn(r)
        return r.serialize()

    yield Case("empty-file", b"", "empty")
    # Truncation inside (and at the start of) every header field, then inside each tensor's data. In the "fat"
    # variant a big first KV keeps the counts plausible, so the cut is found by the field reads themselves.
    yield from truncations(base, "truncate")
    if fat_base is None and base is tiny_model():
        fat_base = tiny_model(fat=True)
    if fat_base is not None:
        yield from truncations(fat_base, "truncate-fat")

    # Header.
    for m in (b"GGUG", b"FUGG", b"\0\0\0\0", b"ggjt"):
        yield Case(f"magic:{m!r}", edit(lambda r, m=m: setattr(r, "magic", m)), "magic")
    for v in (0, 1, 4, 0xFFFF, U64_MAX & 0xFFFFFFFF):
        yield Case(f"version:{v}", edit(lambda r, v=v: setattr(r, "version", v)), "version")
    yield Case("version:big-endian", edit(lambda r: setattr(r, "version", 3 << 24)), "big-endian")
    # Huge counts, and counts just one past what the file could possibly hold.
    for n in (*_HUGE, 10**6, (size - 24) // MIN_TENSOR_INFO_BYTES + 1):
        yield Case(f"n_tensors:{n}", edit(lambda r, n=n: setattr(r, "n_tensors", n)), "implausible|cannot fit")
    for n in (*_HUGE, 10**6, (size - 24) // MIN_KV_BYTES + 1):
        yield Case(f"n_kv:{n}", edit(lambda r, n=n: setattr(r, "n_kv", n)), "implausible|cannot fit")
    left = size - 24
    nt, nk = left // 2 // MIN_TENSOR_INFO_BYTES, left // 2 // MIN_KV_BYTES + 2  # each fits alone, not together
    yield Case(
        "counts:together-too-many", edit(lambda r: (setattr(r, "n_tensors", nt), setattr(r, "n_kv", nk))), "cannot fit"
    )
    yield Case("n_tensors:+1", edit(lambda r: setattr(r, "n_tensors", len(r.tensors) + 1)), ".")
    yield Case("n_kv:+1", edit(lambda r: setattr(r, "n_kv", len(r.kvs) + 1)), ".")
    yield Case("n_kv:-1", edit(lambda r: setattr(r, "n_kv", len(r.kvs) - 1)), ".")

    # String lengths: key, string value, tensor name, string inside an array.
    i_name = raw.kv_index("general.name")
    for n in (size, size * 2, *_HUGE):
        yield Case(f"key-length:{n}", edit(lambda r, n=n: setattr(r.kvs[1], "key_len", n)), "length .* exceeds")
        yield Case(
            f"string-length:{n}",
            edit(lambda r, n=n: r.set_kv("general.name", T_STRING, enc_string(b"tiny", n))),
            "length .* exceeds",
        )
        yield Case(
            f"tensor-name-length:{n}", edit(lambda r, n=n: setattr(r.tensors[0], "name_len", n)), "length .* exceeds"
        )
        yield Case(
            f"array-string-length:{n}",
            edit(
                lambda r, n=n: r.set_kv(
                    "tokenizer.ggml.tokens", T_ARRAY, u32(T_STRING) + u64(2) + enc_string("ok") + enc_string("bad", n)
                )
            ),
            "length .* exceeds",
        )
    # Array lengths of each kind of element, past the end and up to 2^64-1 (some wrap count*size to 0).
    for etype, item in ((T_UINT8, 1), (T_UINT32, 1), (T_UINT64, 1), (T_STRING, "a"), (T_ARRAY, None)):
        for n in (size, *_HUGE):
            items = [] if item is None else [item]
            payload = enc_array(etype, items, count=n) if item is not None else u32(T_ARRAY) + u64(n)
            yield Case(
                f"array-count:{_tn(etype)}:{n}",
                edit(lambda r, p=payload: r.set_kv("test.f32s", T_ARRAY, p)),
                "claims",
            )
    yield Case(
        "array-count:nested-inner:2^63",
        edit(lambda r: r.set_kv("test.nested", T_ARRAY, u32(T_ARRAY) + u64(1) + u32(T_UINT8) + u64(2**63))),
        "claims",
    )
    yield Case(
        f"nested-depth:{MAX_ARRAY_DEPTH + 1}",
        edit(lambda r: r.set_kv("test.nested", T_ARRAY, _nested(MAX_ARRAY_DEPTH + 1))),
        "nested deeper",
    )
    yield Case("nested-depth:1000", edit(lambda r: r.set_kv("test.nested", T_ARRAY, _nested(1000))), "nested deeper")
    # Value types.
    for t in (13, 14, 100, 0xFFFFFFFF):
        yield Case(f"value-type:{t}", edit(lambda r, t=t: setattr(r.kvs[i_name], "vtype", t)), "unknown value type")
        yield Case(
            f"array-element-type:{t}",
            edit(lambda r, t=t: r.set_kv("test.f32s", T_ARRAY, u32(t) + u64(1) + b"\0" * 8)),
            "unknown array element type",
        )
    # Keys.
    yield Case("duplicate-key", edit(lambda r: r.kvs.append(copy.deepcopy(r.kvs[i_name]))), "duplicate key")
    yield Case(
        "duplicate-key:other-type", edit(lambda r: r.kvs.append(KV(b"general.name", T_UINT32, u32(1)))), "duplicate key"
    )
    yield Case("empty-key", edit(lambda r: setattr(r.kvs[i_name], "key", b"")), "empty key")
    yield Case("key-too-long", edit(lambda r: setattr(r.kvs[i_name], "key", b"k" * 65536)), "maximum of 65535")
    for bad in (b"\xff", b"gen\xc3eral", b"\xed\xa0\x80"):
        yield Case(f"utf8:key:{bad!r}", edit(lambda r, bad=bad: setattr(r.kvs[i_name], "key", bad)), "UTF-8")
        yield Case(
            f"utf8:value:{bad!r}", edit(lambda r, bad=bad: r.set_kv("general.name", T_STRING, enc_string(bad))), "UTF-8"
        )
        yield Case(
            f"utf8:array:{bad!r}",
            edit(lambda r, bad=bad: r.set_kv("tokenizer.ggml.tokens", T_ARRAY, enc_array(T_STRING, [b"ok", bad]))),
            "UTF-8",
        )
        yield Case(f"utf8:tensor-name:{bad!r}", edit(lambda r, bad=bad: setattr(r.tensors[0], "name", bad)), "UTF-8")
    # Alignment.
    for a in (0, 24, 3, 2**32 - 1):
        yield Case(
            f"alignment:{a}", edit(lambda r, a=a: r.set_kv("general.alignment", T_UINT32, u32(a))), "power of two"
        )
    for t, p in (
        (T_UINT64, u64(32)),
        (T_INT32, u32(32)),
        (T_UINT16, struct.pack("<H", 32)),
        (T_STRING, enc_string("32")),
        (T_FLOAT32, struct.pack("<f", 32.0)),
    ):
        yield Case(
            f"alignment-type:{_tn(t)}", edit(lambda r, t=t, p=p: r.set_kv("general.alignment", t, p)), "must be uint32"
        )
    yield Case(
        "alignment:2^31",
        edit(lambda r: r.set_kv("general.alignment", T_UINT32, u32(2**31))),
        "past the end|not a multiple",
    )
    yield Case(
        "alignment:64-but-offsets-32",
        edit(lambda r: r.set_kv("general.alignment", T_UINT32, u32(64))),
        "not a multiple of the alignment",
    )
    # Tensor infos.
    for nd in (0, 5, 0xFFFFFFFF):
        yield Case(f"n_dims:{nd}", edit(lambda r, nd=nd: setattr(r.tensors[1], "n_dims", nd)), "n_dims")
    for t in (4, 5, 16, 21, 28, 39, 200, 0xFFFFFFFF):  # ids ggml_py does not model (21 = IQ3_S)
        yield Case(f"tensor-type:{t}", edit(lambda r, t=t: setattr(r.tensors[1], "ttype", t)), f"type id {t}")
    for dims, why in (
        ([64, 0], "is 0"),
        ([0], "is 0"),
        ([2**63], "exceeds int64"),
        ([U64_MAX], "exceeds int64"),
        ([2**32, 2**32], "overflows"),
        ([2**62, 4], "overflows"),
        ([2**31, 2**31, 2**2], "overflows"),
        ([64, 2**40, 2**20], "overflows"),
        ([2**16, 2**16, 2**16, 2**16], "overflows"),
        ([64, 2**40], "past the end"),
    ):
        yield Case(f"dims:{dims}", edit(lambda r, d=dims: setattr(r.tensors[1], "dims", list(d))), why)
    for ne0 in (33, 48, 1, 31):
        yield Case(
            f"block-size:Q8_0:ne0={ne0}",
            edit(lambda r, n=ne0: setattr(r.tensors[q8], "dims", [n, 1])),
            "not a multiple of the Q8_0 block size",
        )
    yield Case(
        "block-size:Q4_K:ne0=128",
        edit(lambda r: setattr(r.tensors[3], "dims", [128, 2])),
        "not a multiple of the Q4_K block size",
    )
    yield Case("duplicate-tensor-name", edit(lambda r: setattr(r.tensors[2], "name", names[0])), "duplicate tensor")
    yield Case("empty-tensor-name", edit(lambda r: setattr(r.tensors[2], "name", b"")), "empty name")
    # Offsets.
    last = len(raw.tensors) - 1
    big = raw.tensors[0]  # the Q8_0 embedding, larger than one alignment unit
    for ti_i, off in (
        (last, len(raw.data)),
        (0, len(raw.data) - 32),
        (last, 2**63),
        (last, U64_MAX - 31),
        (last, 2**64 - 2**40),
        (last, len(raw.data) + 2**32),
    ):
        assert ti_i != 0 or big.nbytes > 32
        yield Case(
            f"offset:past-end:ti{ti_i}:{off}",
            edit(lambda r, i=ti_i, o=off: setattr(r.tensors[i], "offset", o)),
            "past the end",
        )
    for delta in (1, 4, 16, 31):
        yield Case(
            f"offset:misaligned:+{delta}",
            edit(lambda r, d=delta: setattr(r.tensors[1], "offset", r.tensors[1].offset + d)),
            "not a multiple",
        )
    yield Case("offset:same-as-other", edit(lambda r: setattr(r.tensors[1], "offset", r.tensors[0].offset)), "overlap")
    yield Case(
        "offset:inside-other", edit(lambda r: setattr(r.tensors[1], "offset", r.tensors[0].offset + 32)), "overlap"
    )
    yield Case(
        "offset:swap-overlap", edit(lambda r: setattr(r.tensors[2], "offset", r.tensors[1].offset + 64)), "overlap"
    )
    # Data section: cut right after the tensor infos (no padding, no data).
    infos_end = max(end for name, _, end in spans if name.startswith("ti["))
    yield Case("data-section:missing", base[:infos_end], "past the end")
    yield Case("data-section:padding-only", base[:data_start], "past the end")
    yield Case("data-section:offset-past-end", edit(lambda r: setattr(r, "data", b"")), "past the end")


def _tn(t: int) -> str:
    return {
        T_UINT8: "uint8",
        T_UINT32: "uint32",
        T_UINT64: "uint64",
        T_STRING: "string",
        T_ARRAY: "array",
        T_INT32: "int32",
        T_UINT16: "uint16",
        T_FLOAT32: "float32",
    }.get(t, str(t))
