"""Our quantizers against llama.cpp's: llama_model_quantize (llama-cpp-python) turns a tiny F32 model into each block
type (`pure`: every 2-D weight to that type), and ggml_py.formats.quants.quantize (and the simd module's quantizer, for
the types it has) must produce the same bytes from the same F32 tensors.

Without an importance matrix ggml's quantizers are deterministic reference functions for every type here, so the
comparison is bit-exact (measured: every tensor of every type). Some weights are replaced by rows that reach the
quantizers' edge cases: all zeros, one constant, huge outliers, subnormals, exact ties. llama.cpp refuses to write
a file whose blocks hold inf or NaN scales, so blocks beyond F16's range (or whose squares overflow float32) go to
ggml_quantize_chunk itself, called in llama.cpp's library."""

from __future__ import annotations

import importlib

import gguf
import numpy as np
import pytest
from arch_factory import write_tiny
from gguf import GGMLQuantizationType as QT

from ggml_py.formats.quants import quantize
from ggml_py.ir import dtypes, ops

import llamacpp_peer
from conftest import declared_absent, expected_backends

pytestmark = pytest.mark.skipif(not llamacpp_peer.available(), reason=llamacpp_peer.NOT_AVAILABLE)

E, F = 256, 512
# the llama_ftype whose `pure` quantization writes every 2-D weight as this type (llama.h's LLAMA_FTYPE_MOSTLY_*)
FTYPES = {"Q4_0": 2, "Q4_1": 3, "Q8_0": 7, "Q5_0": 8, "Q5_1": 9, "Q2_K": 10, "Q3_K": 12, "Q4_K": 15, "Q5_K": 17,
          "Q6_K": 18, "IQ4_NL": 25, "IQ4_XS": 30}
# the simd module's quantizer: the quantized types CPY and SET_ROWS write
SIMD_QUANTIZES = tuple(t.name for t in ops.CPY_DST_TYPES if t.is_quantized)

_WORKER = """
import ctypes
import llama_cpp as L


def run(src, jobs):
    res = {}
    for ftype, dst in jobs:
        p = L.llama_model_quantize_default_params()
        p.nthread = 2
        p.ftype = ftype
        p.pure = True
        res[dst] = int(L.llama_model_quantize(src.encode(), dst.encode(), ctypes.byref(p)))
    return res
"""


def _hard_rows(rng: np.random.Generator, rows: int, cols: int) -> np.ndarray:
    x = rng.standard_normal((rows, cols)).astype(np.float32)
    x[0] = 0.0  # all zeros: scale 0
    x[1] = 0.75  # one constant
    x[2, ::37] = 1e4  # outliers among small values
    x[3] = rng.standard_normal(cols).astype(np.float32) * 1e-40  # subnormals
    x[4] = rng.integers(-8, 9, cols).astype(np.float32)  # exact ties after scaling
    x[5] = -np.abs(x[5])  # one sign
    x[6, :128] = 0.0  # half a row empty (a K-quant's sub-blocks of zeros)
    return x


@pytest.fixture(scope="module")
def quantized(tmp_path_factory) -> tuple[dict[str, np.ndarray], dict[str, str]]:
    d = tmp_path_factory.mktemp("quant")
    rng = np.random.default_rng(5)
    src = write_tiny(d / "f32.gguf", "llama", seed=2, output_type=QT.F32, replace={
        "blk.0.ffn_up.weight": _hard_rows(rng, F, E), "blk.1.attn_v.weight": _hard_rows(rng, 128, E)})
    jobs = [(ft, str(d / f"{name}.gguf")) for name, ft in FTYPES.items()]
    rc = llamacpp_peer.run(_WORKER, src, jobs)
    assert set(rc.values()) == {0}, rc
    f32 = {t.name: np.array(t.data, np.float32).reshape(-1, int(t.shape[0])) for t in gguf.GGUFReader(src).tensors}
    return f32, {name: str(d / f"{name}.gguf") for name in FTYPES}


@pytest.mark.parametrize("name", list(FTYPES))
def test_quantize_is_llama_cpps_bit_for_bit(quantized, name):
    f32, files = quantized
    compared = []
    for t in gguf.GGUFReader(files[name]).tensors:
        if t.tensor_type != QT[name]:
            assert len(t.shape) == 1 or t.tensor_type == QT.F32, (t.name, t.tensor_type)  # norms stay F32
            continue
        x = f32[t.name]
        theirs = np.array(t.data, np.uint8).reshape(x.shape[0], -1)
        ours = quantize(x, getattr(dtypes, name)).reshape(x.shape[0], -1)
        bad = np.flatnonzero((ours != theirs).any(1))
        assert bad.size == 0, f"{name} {t.name}: rows {bad[:10].tolist()} differ from llama.cpp's ({bad.size} rows)"
        compared.append(t.name)
    # every 2-D weight: 7 per layer, the embedding and the head
    assert len(compared) == 2 * 7 + 2 and "blk.0.ffn_up.weight" in compared


@declared_absent("simd")
@pytest.mark.parametrize("name", SIMD_QUANTIZES)
def test_simd_quantizer_is_llama_cpps_bit_for_bit(quantized, name):
    from ggml_py_simd import _simd

    f32, files = quantized
    t = next(t for t in gguf.GGUFReader(files[name]).tensors if t.name == "blk.0.ffn_up.weight")
    x = f32[t.name]
    theirs = np.array(t.data, np.uint8).reshape(-1)
    for level in _simd.levels():
        ours = np.asarray(_simd.quantize(getattr(dtypes, name).ggml_id, x.reshape(-1), level)).reshape(-1)
        assert np.array_equal(ours, theirs), f"{name} at {level}"


# Runs next to llama_cpp: ggml_quantize_chunk of libggml-base (what llama_model_quantize calls per tensor; without an
# importance matrix the K-quants' quantize_row_*_ref) on rows of 256 values saved as .npy, the bytes saved back.
_CHUNK_WORKER = """
import ctypes
import glob
import os
import numpy as np
import llama_cpp


def run(src, jobs):
    lib = ctypes.CDLL(glob.glob(os.path.join(os.path.dirname(llama_cpp.__file__), "lib", "libggml-base.so*"))[0])
    lib.ggml_quantize_chunk.restype = ctypes.c_size_t
    x = np.ascontiguousarray(np.load(src), np.float32)
    for type_id, row_size, dst in jobs:
        out = np.zeros((x.shape[0], row_size), np.uint8)
        lib.ggml_quantize_chunk(ctypes.c_int(type_id), x.ctypes.data_as(ctypes.c_void_p),
                                out.ctypes.data_as(ctypes.c_void_p), ctypes.c_int64(0), ctypes.c_int64(x.shape[0]),
                                ctypes.c_int64(x.shape[1]), ctypes.c_void_p(0))
        np.save(dst, out)
    return 0
"""


def test_extreme_rows_quantize_as_ggmls_reference(tmp_path):
    """Rows llama.cpp would not write to a file: values past F16's range (scales become inf), past the square root
    of float32's (the K-quants' weighted sums overflow to inf and NaN), subnormals, mixed magnitudes; every type's
    bytes equal ggml_quantize_chunk's, from ggml_py.formats.quants and from the simd quantizer at every level."""
    from test_quants import k_test_blocks, low_bit_extreme_blocks

    rng = np.random.default_rng(11)
    x = np.concatenate([low_bit_extreme_blocks(rng), k_test_blocks(rng),
                        rng.standard_normal((4, 256)).astype(np.float32) * 1e15]).astype(np.float32)
    np.save(tmp_path / "x.npy", x)
    types = [getattr(dtypes, name) for name in FTYPES]
    jobs = [(t.ggml_id, t.row_size(256), str(tmp_path / f"{t.name}.npy")) for t in types]
    assert llamacpp_peer.run(_CHUNK_WORKER, str(tmp_path / "x.npy"), jobs) == 0
    simd = importlib.import_module("ggml_py_simd")._simd if "simd" in expected_backends() else None
    for t, (_, _, dst) in zip(types, jobs):
        theirs = np.load(dst)
        with np.errstate(all="ignore"):
            ours = quantize(x, t).reshape(theirs.shape)
        bad = np.flatnonzero((ours != theirs).any(1))
        assert bad.size == 0, f"{t.name}: rows {bad.tolist()} differ from ggml's"
        if simd is not None and t.name in SIMD_QUANTIZES:
            for level in simd.levels():
                got = np.asarray(simd.quantize(t.ggml_id, x.reshape(-1), level)).reshape(theirs.shape)
                bad = np.flatnonzero((got != theirs).any(1))
                assert bad.size == 0, f"{t.name} at {level}: rows {bad.tolist()} differ from ggml's"
