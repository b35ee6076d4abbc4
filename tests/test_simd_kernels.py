"""Phase-1 tests of the simd backend's compiled module: kernels against numpy math at every SIMD level this CPU has,
plan validation, symbolic dimensions, buffers. Plans are built directly through a thin helper (no ggml_py core).

NMSE thresholds as ggml's test-backend-ops: 1e-7 default, 5e-4 MUL_MAT / FLASH_ATTN_EXT, 1e-6 SOFT_MAX, 0 for copies,
argmax and integer ops.
"""

from __future__ import annotations

import math
import platform
import threading

import numpy as np
import pytest

from conftest import require_backend

require_backend("simd")

import gguf.quants as gq  # noqa: E402
from ggml_py_simd import _simd  # noqa: E402
from simd_abi import OPS, Arena, Plan, PlanError, validate  # noqa: E402

from ggml_py.formats import quants  # noqa: E402
from ggml_py.ir import dtypes, ops, schema  # noqa: E402
from ggml_py.runtime import native  # noqa: E402

LEVELS = _simd.levels()

F32, F16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, I32, I64, BF16 = 0, 1, 2, 3, 6, 7, 8, 26, 27, 30
Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, IQ4_NL, IQ4_XS = 10, 11, 12, 13, 14, 20, 23
K_QUANTS = (Q2_K, Q3_K, Q4_K, Q5_K, Q6_K)
IQ4 = (IQ4_NL, IQ4_XS)
RANDOM_BLOCK_TYPES = (*K_QUANTS, *IQ4)  # types gguf cannot quantize: tests use random blocks
QBLOCK = {Q4_0: (32, 18), Q4_1: (32, 20), Q5_0: (32, 22), Q5_1: (32, 24), Q8_0: (32, 34), Q2_K: (256, 84),
          Q3_K: (256, 110), Q4_K: (256, 144), Q5_K: (256, 176), Q6_K: (256, 210), IQ4_NL: (32, 18),
          IQ4_XS: (256, 136)}
# byte offset of the f16 super-block scales (d, then dmin where there is one) in a random block
K_SCALE_OFFSET = {Q2_K: 80, Q3_K: 108, Q4_K: 0, Q5_K: 0, Q6_K: 208, IQ4_NL: 0, IQ4_XS: 0}
K_SCALE_COUNT = {Q2_K: 2, Q3_K: 1, Q4_K: 2, Q5_K: 2, Q6_K: 1, IQ4_NL: 1, IQ4_XS: 1}
NP_TYPE = {F32: np.float32, F16: np.float16, I32: np.int32, I64: np.int64, BF16: np.uint16}


# ---------------------------------------------------------------------------------------------------------------
# helper: an arena of simd memory, tensor descriptions in ggml order, one-node plans

def desc(arena: Arena, arr: np.ndarray, t: int | None = None, ne0: int | None = None):
    """(type, ne[4], nb[4], base, offset) of a numpy view into the arena; quantized: arr is raw rows (..., bytes)."""
    if t is None:
        t = {np.dtype(np.float32): F32, np.dtype(np.float16): F16, np.dtype(np.int32): I32,
             np.dtype(np.int64): I64}[arr.dtype]
    shape = list(arr.shape)
    strides = list(arr.strides)
    if t in QBLOCK:
        bs, ts = QBLOCK[t]
        assert ne0 is not None
        shape[-1] = ne0
        strides[-1] = ts
    ne = list(reversed(shape)) + [1] * (4 - len(shape))
    nb = list(reversed(strides))
    while len(nb) < 4:
        nb.append(nb[-1] * ne[len(nb) - 1] if nb else 4)
    addr = arr.__array_interface__["data"][0]
    return (t, ne, nb, arena.address, addr - arena.address)


def run(arena, op, dst, srcs, ip=(), fp=(), level=None, n_threads=2):
    p = Plan([(op, dst, list(srcs), list(ip), list(fp))], arena.ranges, [], n_threads, level)
    p.compute([])
    return p


def nmse(ref, got) -> float:
    ref = np.asarray(ref, dtype=np.float64)
    got = np.asarray(got, dtype=np.float64)
    den = np.sum(ref * ref)
    return float(np.sum((ref - got) ** 2) / (den if den > 0 else 1.0))


def random_k_blocks(shape, t: int, seed: int = 7) -> np.ndarray:
    """Random valid rows of a type gguf cannot quantize (K-quants, IQ4): random bits, sane super-block scales."""
    bs, ts = QBLOCK[t]
    rows = int(np.prod(shape[:-1]))
    nb = shape[-1] // bs
    r = np.random.default_rng(seed)
    raw = r.integers(0, 256, (rows * nb, ts), dtype=np.uint8)
    n = K_SCALE_COUNT[t]
    d = (r.random((rows * nb, n)) * 0.02 + 0.001).astype(np.float16).view(np.uint8)
    off = K_SCALE_OFFSET[t]
    raw[:, off:off + 2 * n] = d
    return raw.reshape(*shape[:-1], nb * ts)


def quantize(x: np.ndarray, t: int) -> np.ndarray:
    if t in RANDOM_BLOCK_TYPES:
        return random_k_blocks(x.shape, t)
    return gq.quantize(np.ascontiguousarray(x, dtype=np.float32), t)


def dequantize(raw: np.ndarray, t: int) -> np.ndarray:
    return gq.dequantize(raw, t)


@pytest.fixture(params=LEVELS)
def level(request):
    return request.param


@pytest.fixture
def arena():
    return Arena()


@pytest.fixture
def rng():
    return np.random.default_rng(1234)


# ---------------------------------------------------------------------------------------------------------------
# levels, features, buffers

def _cpuinfo_flags() -> set[str] | None:
    try:
        with open("/proc/cpuinfo") as f:
            return next((set(ln.split(":", 1)[1].split()) for ln in f if ln.startswith("flags")), None)
    except OSError:
        return None


# cpu_features() key -> the kernel's /proc/cpuinfo flag
CPUINFO_FLAG = {"sse2": "sse2", "ssse3": "ssse3", "sse4_1": "sse4_1", "avx": "avx", "avx2": "avx2", "fma": "fma",
                "f16c": "f16c", "bmi2": "bmi2", "avx512f": "avx512f", "avx512bw": "avx512bw",
                "avx512vl": "avx512vl", "avx512dq": "avx512dq", "avx512cd": "avx512cd"}
LEVEL_NEEDS = {"avx2": ("avx2", "fma", "f16c"),
               "avx512": ("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512cd")}


def test_levels_and_features():
    feats = _simd.cpu_features()
    assert set(CPUINFO_FLAG) <= set(feats) and all(isinstance(feats[k], bool) for k in CPUINFO_FLAG)
    flags = _cpuinfo_flags()
    if flags is not None and platform.machine() in ("x86_64", "AMD64"):
        # what CPUID says is what the kernel says, feature by feature, whatever this CPU has
        assert {k: feats[k] for k in CPUINFO_FLAG} == {k: v in flags for k, v in CPUINFO_FLAG.items()}
        # a level is offered exactly when the CPU has what its kernels were compiled for (and the OS saves the state)
        for level, needs in LEVEL_NEEDS.items():
            os_state = feats["os_avx512" if level == "avx512" else "os_avx"]
            assert (level in LEVELS) == (all(feats[n] for n in needs) and os_state), (level, feats)
    assert "scalar" in LEVELS
    assert _simd.level() in LEVELS
    assert set(_simd.all_levels()) == {"scalar", "avx2", "avx512"}
    for name in _simd.all_levels():
        if name not in LEVELS:
            with pytest.raises(ValueError, match="not supported"):
                _simd.set_level(name)
            assert _simd.level_missing(name)
    with pytest.raises(ValueError, match="unknown"):
        _simd.set_level("sse9")
    old = _simd.level()
    try:
        for name in LEVELS:
            _simd.set_level(name)
            assert _simd.level() == name
    finally:
        _simd.set_level(old)
    assert _simd.physical_cores() >= 1


# ---------------------------------------------------------------------------------------------------------------
# elementwise

BIN = {"ADD": np.add, "SUB": np.subtract, "MUL": np.multiply, "DIV": np.divide}


@pytest.mark.parametrize("op", list(BIN))
@pytest.mark.parametrize("shapes", [((3, 5, 70), (3, 5, 70)), ((2, 3, 5, 70), (70,)), ((4, 6, 33), (1, 6, 1)),
                                    ((4, 6, 32), (2, 3, 16)), ((2, 7, 9), (1, 1, 1))])
def test_binary(level, arena, op, shapes, rng):
    sa, sb = shapes
    a = rng.standard_normal(sa).astype(np.float32)
    b = rng.standard_normal(sb).astype(np.float32) + (3.0 if op == "DIV" else 0.0)
    A, B = arena.put(a), arena.put(b)
    D = arena.empty(sa, np.float32)
    run(arena, op, desc(arena, D), [desc(arena, A), desc(arena, B)], level=level)
    bb = b.reshape((1,) * (len(sa) - b.ndim) + b.shape)
    ref = BIN[op](a.astype(np.float64), np.tile(bb, [x // y for x, y in zip(sa, bb.shape)]))
    assert nmse(ref, D) < 1e-7


def test_binary_strided_inplace(level, arena, rng):
    a = rng.standard_normal((8, 40)).astype(np.float32)
    A = arena.put(a)
    B = arena.put(rng.standard_normal((40, 8)).astype(np.float32)).T  # transposed view
    run(arena, "ADD", desc(arena, A), [desc(arena, A), desc(arena, B)], level=level)
    assert nmse(a + np.asarray(B), A) < 1e-12


def _gelu(x):
    return 0.5 * x * (1 + np.tanh(math.sqrt(2 / math.pi) * x * (1 + 0.044715 * x * x)))


_erf = np.vectorize(math.erf, otypes=[np.float64])


def _gelu_erf(x):
    return 0.5 * x * (1 + _erf(x / math.sqrt(2)))


# independent float64 references of the unary family's ops (an op without one is checked against the numpy backend)
UN = {
    "SQR": np.square, "SQRT": np.sqrt, "NEG": np.negative, "ABS": np.abs, "EXP": np.exp, "LOG": np.log,
    "SILU": lambda x: x / (1 + np.exp(-x)), "GELU": _gelu, "RELU": lambda x: np.maximum(x, 0), "TANH": np.tanh,
    "SIGMOID": lambda x: 1 / (1 + np.exp(-x)), "GELU_ERF": _gelu_erf,
}


def _unary_reference(op):
    if op in UN:
        return UN[op]
    from ggml_py_numpy.kernels import KERNELS

    return lambda x: KERNELS[op](None, [x], x.shape)


@pytest.mark.parametrize("op", schema.UNARY_OPS)
def test_unary(level, arena, op, rng):
    x = (rng.standard_normal((3, 7, 131)) * 4).astype(np.float32)
    if op in ("SQRT", "LOG"):
        x = np.abs(x) + 0.01
    X = arena.put(x)
    D = arena.empty(x.shape, np.float32)
    run(arena, op, desc(arena, D), [desc(arena, X)], level=level)
    assert nmse(_unary_reference(op)(x.astype(np.float64)), D) < 1e-7


def test_unary_special_values(level, arena):
    x = np.array([0, -0.0, 1e-30, -1e-30, 88.0, 89.0, -88.0, -104.0, -200, np.inf, -np.inf, 30, -30, 0.3, -0.3,
                  1e-4], dtype=np.float32)
    X = arena.put(x)
    for op, fn in (("EXP", np.exp), ("TANH", np.tanh), ("SIGMOID", lambda v: 1 / (1 + np.exp(-v))),
                   ("SILU", lambda v: v / (1 + np.exp(-v))), ("GELU_ERF", _gelu_erf)):
        D = arena.empty(x.shape, np.float32)
        run(arena, op, desc(arena, D), [desc(arena, X)], level=level)
        with np.errstate(all="ignore"):
            ref = fn(x.astype(np.float64)).astype(np.float32)
        fin = np.isfinite(ref)
        assert np.array_equal(np.isnan(ref), np.isnan(D)), op
        assert np.array_equal(ref[~fin & ~np.isnan(ref)], D[~fin & ~np.isnan(ref)]), op
        np.testing.assert_allclose(D[fin], ref[fin], rtol=2e-6, atol=1e-37, err_msg=op)


def test_scale_clamp(level, arena, rng):
    x = rng.standard_normal((5, 100)).astype(np.float32)
    X = arena.put(x)
    D = arena.empty(x.shape, np.float32)
    run(arena, "SCALE", desc(arena, D), [desc(arena, X)], fp=[0.75, -0.25], level=level)
    assert np.array_equal(D, x * np.float32(0.75) + np.float32(-0.25))
    run(arena, "CLAMP", desc(arena, D), [desc(arena, X)], fp=[-0.5, 0.7], level=level)
    assert np.array_equal(D, np.clip(x, -0.5, 0.7))


@pytest.mark.parametrize("op", ["SWIGLU", "GEGLU"])
@pytest.mark.parametrize("split", [False, True])
def test_glu(level, arena, op, split, rng):
    act = (lambda v: v / (1 + np.exp(-v))) if op == "SWIGLU" else _gelu
    if split:
        a = rng.standard_normal((4, 3, 2 * 77)).astype(np.float32)
        A = arena.put(a)
        D = arena.empty((4, 3, 77), np.float32)
        run(arena, op, desc(arena, D), [desc(arena, A)], level=level)
        a64 = a.astype(np.float64)
        ref = act(a64[..., :77]) * a64[..., 77:]
    else:
        a = rng.standard_normal((4, 3, 77)).astype(np.float32)
        b = rng.standard_normal((4, 3, 77)).astype(np.float32)
        A, B = arena.put(a), arena.put(b)
        D = arena.empty(a.shape, np.float32)
        run(arena, op, desc(arena, D), [desc(arena, A), desc(arena, B)], level=level)
        ref = act(a.astype(np.float64)) * b
    assert nmse(ref, D) < 1e-7


# ---------------------------------------------------------------------------------------------------------------
# rows

@pytest.mark.parametrize("op", ["NORM", "RMS_NORM"])
def test_norms(level, arena, op, rng):
    x = (rng.standard_normal((2, 9, 576)) + 0.5).astype(np.float32)
    X = arena.put(x)
    D = arena.empty(x.shape, np.float32)
    run(arena, op, desc(arena, D), [desc(arena, X)], fp=[1e-5], level=level)
    x64 = x.astype(np.float64)
    if op == "NORM":
        x64 = x64 - x64.mean(-1, keepdims=True)
    ref = x64 / np.sqrt((x64 * x64).mean(-1, keepdims=True) + 1e-5)
    assert nmse(ref, D) < 1e-7


def test_sum_rows_mean_argmax(level, arena, rng):
    x = rng.standard_normal((3, 4, 1001)).astype(np.float32)
    x[1, 2, 17] = 50.0
    x[1, 2, 900] = 50.0  # tie: first index wins
    X = arena.put(x)
    S = arena.empty((3, 4, 1), np.float32)
    run(arena, "SUM_ROWS", desc(arena, S), [desc(arena, X)], level=level)
    assert nmse(x.astype(np.float64).sum(-1, keepdims=True), S) < 1e-7
    run(arena, "MEAN", desc(arena, S), [desc(arena, X)], level=level)
    assert nmse(x.astype(np.float64).mean(-1, keepdims=True), S) < 1e-7
    A = arena.empty((3, 4), np.int32)
    run(arena, "ARGMAX", desc(arena, A), [desc(arena, X)], level=level)
    assert np.array_equal(A, np.argmax(x, -1))
    assert A[1, 2] == 17


def _alibi(n_head, max_bias):
    n_log2 = 2 ** int(math.floor(math.log2(n_head)))
    m0 = 2.0 ** (-max_bias / n_log2)
    m1 = 2.0 ** (-max_bias / 2.0 / n_log2)
    h = np.arange(n_head)
    return np.where(h < n_log2, m0 ** (h + 1), m1 ** (2 * (h - n_log2) + 1))


@pytest.mark.parametrize("max_bias,mask_t", [(0.0, None), (0.0, F32), (0.0, F16), (8.0, F32), (8.0, F16)])
def test_soft_max(level, arena, mask_t, max_bias, rng):  # ALiBi (max_bias > 0) needs a mask
    x = rng.standard_normal((2, 6, 5, 37)).astype(np.float32)
    X = arena.put(x)
    D = arena.empty(x.shape, np.float32)
    srcs = [desc(arena, X)]
    x64 = x.astype(np.float64) * 0.7
    if mask_t is not None:
        m = rng.standard_normal((8, 37)).astype(np.float32)
        m[:, 30:] = -np.inf
        M = arena.put(m.astype(NP_TYPE[mask_t]))
        srcs.append(desc(arena, M))
        slope = _alibi(6, max_bias)[:, None, None] if max_bias > 0 else 1.0
        x64 = x64 + slope * M[:5].astype(np.float64)
    run(arena, "SOFT_MAX", desc(arena, D), srcs, fp=[0.7, max_bias], level=level)
    e = np.exp(x64 - x64.max(-1, keepdims=True))
    assert nmse(e / e.sum(-1, keepdims=True), D) < 1e-6


def test_diag_mask_inf(level, arena, rng):
    x = rng.standard_normal((3, 5, 9)).astype(np.float32)
    X = arena.put(x)
    D = arena.empty(x.shape, np.float32)
    run(arena, "DIAG_MASK_INF", desc(arena, D), [desc(arena, X)], ip=[2], level=level)
    ref = x.copy()
    ref[:, np.arange(9)[None, :] > 2 + np.arange(5)[:, None]] = -np.inf
    assert np.array_equal(ref, D)


def _rope_ref(x, pos, n_dims, mode, base, fscale):
    x = x.astype(np.float64)
    half = n_dims // 2
    inv = base ** (-2.0 * np.arange(half) / n_dims)
    th = (pos.astype(np.float64) * fscale)[:, None] * inv[None, :]
    c, s = np.cos(th)[:, None, :], np.sin(th)[:, None, :]
    out = x.copy()
    if mode == 2:
        x0, x1 = x[..., :half], x[..., half:n_dims]
        out[..., :half] = x0 * c - x1 * s
        out[..., half:n_dims] = x0 * s + x1 * c
    else:
        x0, x1 = x[..., 0:n_dims:2], x[..., 1:n_dims:2]
        out[..., 0:n_dims:2] = x0 * c - x1 * s
        out[..., 1:n_dims:2] = x0 * s + x1 * c
    return out


@pytest.mark.parametrize("mode", [0, 2])
@pytest.mark.parametrize("n_dims", [64, 32, 6])
def test_rope(level, arena, mode, n_dims, rng):
    T, H, Dh = 7, 5, 64
    x = rng.standard_normal((2, T, H, Dh)).astype(np.float32)
    pos = rng.integers(0, 3000, T).astype(np.int32)
    X, P = arena.put(x), arena.put(pos)
    D = arena.empty(x.shape, np.float32)
    run(arena, "ROPE", desc(arena, D), [desc(arena, X), desc(arena, P)], ip=[n_dims, mode], fp=[10000.0, 0.5],
        level=level)
    assert nmse(_rope_ref(x, pos, n_dims, mode, 10000.0, 0.5), D) < 1e-7
    # strided source (a view with padding between heads), in-place destination
    big = arena.put(rng.standard_normal((T, H, Dh + 8)).astype(np.float32))
    view = big[:, :, 4:4 + Dh]
    ref = _rope_ref(np.asarray(view), pos, n_dims, mode, 10000.0, 1.0)
    run(arena, "ROPE", desc(arena, view), [desc(arena, view), desc(arena, P)], ip=[n_dims, mode],
        fp=[10000.0, 1.0], level=level)
    assert nmse(ref, view) < 1e-7


def _attn_ref(sc, v, rep):
    """softmax(scores) v in float64, v's KV heads repeated for the query heads sharing them: (B, Nq, H, Dv)."""
    p = np.exp(sc - sc.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    return np.einsum("bhqk,bhkd->bhqd", p, np.repeat(v.astype(np.float64), rep, 1)).transpose(0, 2, 1, 3)


@pytest.mark.parametrize("kv_t", [F16, F32])
@pytest.mark.parametrize("with_mask", [False, True])
@pytest.mark.parametrize("nq,nkv,D", [(1, 37, 64), (5, 40, 64), (3, 17, 20), (1, 300, 64), (2, 520, 32)])
def test_flash_attn_ext(level, arena, kv_t, with_mask, nq, nkv, D, rng):
    B, H, Hk = 2, 6, 2
    q = rng.standard_normal((B, H, nq, D)).astype(np.float32)
    k = rng.standard_normal((B, Hk, nkv, D)).astype(NP_TYPE[kv_t])
    v = rng.standard_normal((B, Hk, nkv, D)).astype(NP_TYPE[kv_t])
    Q, K, V = arena.put(q), arena.put(k), arena.put(v)
    out = arena.empty((B, nq, H, D), np.float32)
    srcs = [desc(arena, Q), desc(arena, K), desc(arena, V)]
    scale = 1 / math.sqrt(D)
    sc = np.einsum("bhqd,bhkd->bhqk", q.astype(np.float64), np.repeat(k.astype(np.float64), H // Hk, 1)) * scale
    if with_mask:
        m = np.zeros((nq + 3, nkv), np.float32)
        m[np.arange(nkv)[None, :] > (nkv - nq + np.arange(nq + 3))[:, None]] = -np.inf
        M = arena.put(m.astype(np.float16))
        srcs.append(desc(arena, M))
        sc = sc + m[:nq].astype(np.float64)
    run(arena, "FLASH_ATTN_EXT", desc(arena, out), srcs, fp=[scale, 0.0, 0.0], level=level)
    assert nmse(_attn_ref(sc, v, H // Hk), out) < 5e-4


def test_flash_attn_mask_per_head_with_grouped_heads(level, arena, rng):
    # enough query rows for the kernel to share each key tile among the heads of a KV head: a mask that differs by
    # head must still reach each head
    B, H, Hk, nq, nkv, D = 1, 6, 2, 8, 40, 32
    q = rng.standard_normal((B, H, nq, D)).astype(np.float32)
    k = rng.standard_normal((B, Hk, nkv, D)).astype(np.float16)
    v = rng.standard_normal((B, Hk, nkv, D)).astype(np.float16)
    m = rng.standard_normal((H, nq, nkv)).astype(np.float32)
    m[rng.random(m.shape) < 0.3] = -np.inf
    m[..., 0] = 0.0  # every row keeps a key
    Q, K, V, M = arena.put(q), arena.put(k), arena.put(v), arena.put(m)
    out = arena.empty((B, nq, H, D), np.float32)
    run(arena, "FLASH_ATTN_EXT", desc(arena, out), [desc(arena, Q), desc(arena, K), desc(arena, V), desc(arena, M)],
        fp=[0.2, 0.0, 0.0], level=level)
    sc = np.einsum("bhqd,bhkd->bhqk", q.astype(np.float64), np.repeat(k.astype(np.float64), H // Hk, 1)) * 0.2 + m
    assert nmse(_attn_ref(sc, v, H // Hk), out) < 5e-4


def test_flash_attn_softcap_alibi(level, arena, rng):
    B, H, Hk, nq, nkv, D = 1, 4, 4, 3, 24, 32
    q = rng.standard_normal((B, H, nq, D)).astype(np.float32)
    k = rng.standard_normal((B, Hk, nkv, D)).astype(np.float16)
    v = rng.standard_normal((B, Hk, nkv, D)).astype(np.float16)
    m = rng.standard_normal((nq, nkv)).astype(np.float32)
    Q, K, V, M = arena.put(q), arena.put(k), arena.put(v), arena.put(m)
    out = arena.empty((B, nq, H, D), np.float32)
    run(arena, "FLASH_ATTN_EXT", desc(arena, out), [desc(arena, Q), desc(arena, K), desc(arena, V), desc(arena, M)],
        fp=[0.3, 4.0, 2.0], level=level)
    sc = np.einsum("bhqd,bhkd->bhqk", q.astype(np.float64), k.astype(np.float64)) * 0.3
    sc = 2.0 * np.tanh(sc / 2.0) + _alibi(H, 4.0)[:, None, None] * m
    assert nmse(_attn_ref(sc, v, 1), out) < 5e-4


@pytest.mark.parametrize("Hk", [4, 2])
@pytest.mark.parametrize("D", [32, 64, 128])
def test_flash_attn_prefill_rows_share_tiles(level, arena, rng, Hk, D):
    """A prefill takes its query rows a few at a time (8 rows without GQA, 4 with 2 heads a KV head) where their
    chunks of keys start at the same tiles, and converts each tile the rows all see whole once for all of them; a
    tile some row sees in part, and a block that straddles a chunk's end, go row by row. Mask values that are not
    0 (ALiBi's slope times them) and a softcap; each row must equal the reference and, to the bit, itself alone."""
    B, H, nq, nkv = 1, 4, 64, 300  # blocks of rows for each of the 8 units of 2 threads
    q = rng.standard_normal((B, H, nq, D)).astype(np.float32)
    k = rng.standard_normal((B, Hk, nkv, D)).astype(np.float16)
    v = rng.standard_normal((B, Hk, nkv, D)).astype(np.float16)
    m = rng.standard_normal((nq, nkv)).astype(np.float32)
    ends = 180 + 2 * np.arange(nq)  # causal ends 2 keys apart: tiles seen whole and in part, chunks of 2 and of 3
    m[np.arange(nkv)[None, :] >= ends[:, None]] = -np.inf
    m[:, 40:64] = -np.inf  # whole tiles no row sees
    Q, K, V, M = arena.put(q), arena.put(k), arena.put(v), arena.put(m)
    out = arena.empty((B, nq, H, D), np.float32)
    fp = [0.3, 4.0, 2.0]
    run(arena, "FLASH_ATTN_EXT", desc(arena, out), [desc(arena, Q), desc(arena, K), desc(arena, V), desc(arena, M)],
        fp=fp, level=level)
    sc = np.einsum("bhqd,bhkd->bhqk", q.astype(np.float64), np.repeat(k.astype(np.float64), H // Hk, 1)) * 0.3
    sc = 2.0 * np.tanh(sc / 2.0) + _alibi(H, 4.0)[:, None, None] * m
    assert nmse(_attn_ref(sc, v, H // Hk), out) < 5e-4
    for i in range(nq):
        Qi, Mi = arena.put(np.ascontiguousarray(q[:, :, i:i + 1])), arena.put(np.ascontiguousarray(m[i:i + 1]))
        one = arena.empty((B, 1, H, D), np.float32)
        run(arena, "FLASH_ATTN_EXT", desc(arena, one), [desc(arena, Qi), desc(arena, K), desc(arena, V),
                                                        desc(arena, Mi)], fp=fp, level=level)
        assert np.array_equal(one[:, 0], out[:, i]), i


# ---------------------------------------------------------------------------------------------------------------
# matmul

WEIGHT_TYPES = [F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, IQ4_NL, IQ4_XS]


def _weight(arena, w: np.ndarray, t: int):
    """(desc, float reference) of a weight matrix stored as type t."""
    if t in QBLOCK:
        raw = quantize(w, t)
        W = arena.put(raw)
        return desc(arena, W, t, ne0=w.shape[-1]), dequantize(raw, t).reshape(w.shape)
    if t == BF16:
        bits = (w.astype(np.float32).view(np.uint32) >> 16).astype(np.uint16)
        W = arena.put(bits)
        ref = (bits.astype(np.uint32) << 16).view(np.float32)
        d = desc(arena, W.view(np.float16))
        return (BF16, *d[1:]), ref
    W = arena.put(w.astype(NP_TYPE[t]))
    return desc(arena, W), W.astype(np.float32)


@pytest.mark.parametrize("t", WEIGHT_TYPES)
@pytest.mark.parametrize("n", [1, 2, 3, 5, 67])
def test_mul_mat(level, arena, t, n, rng):
    K = 512 if t in K_QUANTS or t == IQ4_XS else 352 if t == IQ4_NL else 320  # IQ4_NL: an odd block count
    M = 45
    w = rng.standard_normal((M, K)).astype(np.float32)
    wd, wref = _weight(arena, w, t)
    x = rng.standard_normal((n, K)).astype(np.float32)
    X = arena.put(x)
    D = arena.empty((n, M), np.float32)
    run(arena, "MUL_MAT", desc(arena, D), [wd, desc(arena, X)], level=level)
    assert nmse(x.astype(np.float64) @ wref.astype(np.float64).T, D) < 5e-4


@pytest.mark.parametrize("t", [F32, F16, Q4_1, Q8_0, Q2_K, Q3_K, Q4_K, IQ4_NL, IQ4_XS])
@pytest.mark.parametrize("n", [1, 9])
def test_mul_mat_broadcast_and_strides(level, arena, t, n, rng):
    K = 256
    w = rng.standard_normal((2, 1, 33, K)).astype(np.float32)  # batch dims (2, 1) repeated over (2, 3)
    wd, wref = _weight(arena, w.reshape(66, K), t)
    # fix the weight desc to 4-D: [K, 33, 1, 2]
    tt, ne, nb, base, off = wd
    row = nb[1]
    wd = (tt, [K, 33, 1, 2], [nb[0], row, row * 33, row * 33], base, off)
    wref = wref.reshape(2, 1, 33, K)
    # activations: a transposed (strided) view
    xs = rng.standard_normal((2, 3, K, n)).astype(np.float32)
    X = arena.put(xs).swapaxes(-1, -2)
    D = arena.empty((2, 3, n, 33), np.float32)
    run(arena, "MUL_MAT", desc(arena, D), [wd, desc(arena, X)], level=level)
    wr = np.repeat(np.repeat(wref, 1, 0), 3, 1).astype(np.float64)
    ref = np.matmul(np.asarray(X, dtype=np.float64), np.swapaxes(wr, -1, -2))
    assert nmse(ref, D) < 5e-4


REPACKED_TYPES = [Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K]


@pytest.mark.parametrize("t", REPACKED_TYPES)
@pytest.mark.parametrize("m", [8, 45, 200])
@pytest.mark.parametrize("n", [1, 3, 21])
def test_mul_mat_repacked_weights(level, arena, t, m, n, rng):
    """A weight marked constant (const id) is repacked 8 rows at a time; results match the plain path (at 21 rows:
    the repacked weights' integer path against the F32 GEMM of the others, or the row kernels at scalar level)."""
    K = 512
    w = rng.standard_normal((m, K)).astype(np.float32)
    wd, wref = _weight(arena, w, t)
    x = rng.standard_normal((n, K)).astype(np.float32)
    X = arena.put(x)
    outs = []
    for cid in (0, 1000 + 17 * t + m):
        D = arena.empty((n, m), np.float32)
        run(arena, "MUL_MAT", desc(arena, D), [(*wd, cid), desc(arena, X)], level=level)
        outs.append(np.array(D))
    ref = x.astype(np.float64) @ wref.astype(np.float64).T
    for o in outs:
        assert nmse(ref, o) < 5e-4
    np.testing.assert_allclose(outs[0], outs[1], rtol=1e-4, atol=1e-3)


@pytest.mark.skipif("avx2" not in LEVELS, reason="no avx2 on this CPU")
@pytest.mark.parametrize("t", [Q4_0, Q5_0, Q5_1])
@pytest.mark.parametrize("m", [8, 20])
@pytest.mark.parametrize("k", [32, 224, 576, 4096])
@pytest.mark.parametrize("n", [1, 3, 17, 64])
def test_mul_mat_repacked_q45_01(arena, t, m, k, n, rng):
    """Q4_0 / Q5_0 / Q5_1 weights repacked 8 rows at a time (x8, avx2), with a remainder of rows read as stored (20),
    against numpy and against the row kernels (no const id: not repacked), at every activation row count (the integer
    path serves them all). Weights shifted off zero so the offsets (-8, -16, m) matter."""
    w = (rng.standard_normal((m, k)) + 0.5 * rng.standard_normal((m, 1))).astype(np.float32)
    wd, wref = _weight(arena, w, t)
    x = (rng.standard_normal((n, k)) + 0.3).astype(np.float32)
    X = arena.put(x)
    outs = []
    for cid in (0, 7000 + 97 * t + 13 * m + k):
        D = arena.empty((n, m), np.float32)
        run(arena, "MUL_MAT", desc(arena, D), [(*wd, cid), desc(arena, X)], level="avx2", n_threads=2)
        outs.append(np.array(D))
    ref = x.astype(np.float64) @ wref.astype(np.float64).T
    for o in outs:
        assert nmse(ref, o) < 5e-4
    # the same integer dot products, summed in another order
    np.testing.assert_allclose(outs[1], outs[0], rtol=1e-4, atol=1e-4 * float(np.abs(outs[0]).max()))


@pytest.mark.parametrize("lv", [lv for lv in LEVELS if lv != "scalar"])
@pytest.mark.parametrize("t", REPACKED_TYPES)
@pytest.mark.parametrize("n", [2, 4, 7, 11])
def test_mul_mat_repacked_rows_together_equal_rows_alone(arena, t, n, lv, rng):
    """The x8 kernels take up to 4 activation rows per pass over the weights (Q6_K: 8; with VNNI two groups of 8
    weight rows at once, 5 groups here); each row's result is bit-identical to the row computed alone (what makes a
    batched decode step equal single steps), at 2 threads, at each level with x8 kernels."""
    m, k = 40, 576 if QBLOCK[t][0] == 32 else 512
    wd, _ = _weight(arena, rng.standard_normal((m, k)).astype(np.float32), t)
    x = rng.standard_normal((n, k)).astype(np.float32)
    D = arena.empty((n, m), np.float32)
    run(arena, "MUL_MAT", desc(arena, D), [(*wd, 8000 + t), desc(arena, arena.put(x))], level=lv, n_threads=2)
    for i in range(n):
        D1 = arena.empty((1, m), np.float32)
        run(arena, "MUL_MAT", desc(arena, D1), [(*wd, 8000 + t), desc(arena, arena.put(x[i:i + 1]))], level=lv,
            n_threads=2)
        np.testing.assert_array_equal(np.array(D)[i], np.array(D1)[0])


@pytest.mark.skipif("avx2" not in LEVELS, reason="no avx2 on this CPU")
@pytest.mark.parametrize("t", [Q4_0, Q4_1, Q5_0, Q5_1])
def test_mul_mat_repacked_extreme_products(arena, t):
    """Every quant at its top (15, Q5: 31) against activations that quantize to +-127: the largest 16-bit sums the
    x8 kernels accumulate (Q5's must be split in two), repacked (const id) and not."""
    M, K = 16, 288
    raw = np.full((M, K // 32 * QBLOCK[t][1]), 0xFF, np.uint8)
    blocks = raw.reshape(-1, QBLOCK[t][1])
    blocks[:, 0:2] = np.array([0.01], np.float16).view(np.uint8)
    if t in (Q4_1, Q5_1):
        blocks[:, 2:4] = np.array([-0.2], np.float16).view(np.uint8)
    W = arena.put(raw)
    wref = dequantize(raw, t).reshape(M, K)
    x = np.where(np.arange(K) < K - 64, 1.0, -1.0).astype(np.float32)[None, :]
    X = arena.put(x)
    for cid in (0, 9000 + t):
        D = arena.empty((1, M), np.float32)
        run(arena, "MUL_MAT", desc(arena, D), [(*desc(arena, W, t, ne0=K), cid), desc(arena, X)], level="avx2")
        assert nmse(x.astype(np.float64) @ wref.astype(np.float64).T, D) < 1e-10, cid


@pytest.mark.parametrize("t", REPACKED_TYPES)
def test_repacked_nbytes(t):
    """The interleaved copy covers the full groups of 8 rows (Q4_K: +3%, Q5_K: +2%, the others: the weight's own
    size)."""
    K = 1024
    block, size = QBLOCK[t]
    per_row = K // block * {Q4_K: 148, Q5_K: 180}.get(t, size)
    for level in _simd.levels():
        for M in (7, 8, 45, 4096):
            want = 0 if level == "scalar" else int(M // 8 * 8 * per_row)  # scalar plans don't repack
            assert _simd.repacked_nbytes(t, K, M, level) == want
        assert _simd.repacked_nbytes(Q3_K, K, 64, level) == 0


@pytest.mark.parametrize("t", [F32, F16, BF16])
def test_repacked_nbytes_float_panels(t):
    """Float weights are repacked as the GEMM's 16-row panels (p16) in their own type: the full groups of 16 rows."""
    K = 1000
    for level in _simd.levels():
        for M in (15, 16, 45, 4096):
            want = 0 if level == "scalar" else M // 16 * 16 * K * (4 if t == F32 else 2)
            assert _simd.repacked_nbytes(t, K, M, level) == want


def _plan_info(p: Plan) -> dict:
    return dict(_simd.plan_info(int(native.ffi().cast("uintptr_t", p.handle))))


@pytest.mark.parametrize("n", [1, 3])
def test_mul_mat_products_of_one_input_grouped(level, arena, n, rng):
    """A layer's q, k, v products (different types, repacked or not) read one input: simd computes them as one task
    (grouped_products), with the same results; a K-quant product (other activation format) stays apart."""
    K = 512
    x = rng.standard_normal((n, K)).astype(np.float32)
    X = arena.put(x)
    nodes, outs, refs = [], [], []
    for t, m, cid in [(Q4_1, 64, 901), (Q8_0, 24, 0), (Q4_0, 24, 902), (Q4_K, 16, 903)]:
        wd, wref = _weight(arena, rng.standard_normal((m, K)).astype(np.float32), t)
        D = arena.empty((n, m), np.float32)
        nodes.append(("MUL_MAT", desc(arena, D), [(*wd, cid), desc(arena, X)], [], []))
        outs.append(D)
        refs.append(x.astype(np.float64) @ wref.astype(np.float64).T)
    p = Plan(nodes, arena.ranges, [], 2, level)
    p.compute([])
    assert _plan_info(p)["grouped_products"] == 2
    for D, ref in zip(outs, refs):
        assert nmse(ref, D) < 5e-4


def test_mul_mat_grouping_keeps_what_nodes_in_between_do(level, arena, rng):
    """Products of one input with a node between them are grouped only where that is the same as running in order:
    not when the node between writes their input, nor when it reads what the later product writes."""
    K = 256
    x = rng.standard_normal((1, K)).astype(np.float32)
    w1, w2 = (rng.standard_normal((32, K)).astype(np.float32) for _ in range(2))
    (wd1, r1), (wd2, r2) = _weight(arena, w1, Q8_0), _weight(arena, w2, Q8_0)

    def run_around(X, D1, scale_dst, scale_src, D2) -> int:
        """D1 = w1 X, then SCALE scale_src -> scale_dst (times 2 plus 1), then D2 = w2 X; returns grouped_products."""
        p = Plan([("MUL_MAT", desc(arena, D1), [wd1, desc(arena, X)], [], []),
                  ("SCALE", desc(arena, scale_dst), [desc(arena, scale_src)], [], [2.0, 1.0]),
                  ("MUL_MAT", desc(arena, D2), [wd2, desc(arena, X)], [], [])], arena.ranges, [], 2, level)
        p.compute([])
        return _plan_info(p)["grouped_products"]

    def vec(fill=0.0):
        return arena.put(np.full((1, 32), fill, np.float32))

    x64 = x.astype(np.float64)
    # the node between overwrites the input (x = 2 x + 1): the second product reads the new x
    X, D1, D2 = arena.put(x), vec(), vec()
    assert run_around(X, D1, X, X, D2) == 0
    assert nmse(x64 @ r1.T, D1) < 5e-4 and nmse((2.0 * x64 + 1) @ r2.T, D2) < 5e-4
    # the node between reads the buffer the second product writes (its old content)
    X, D1, S, OLD = arena.put(x), vec(), vec(), vec(3.0)
    assert run_around(X, D1, S, OLD, OLD) == 0
    assert np.array_equal(S, np.full((1, 32), 7.0, np.float32)) and nmse(x64 @ r2.T, OLD) < 5e-4
    # a node between that touches neither: grouped
    X, D1, S, D2 = arena.put(x), vec(), vec(), vec()
    assert run_around(X, D1, S, D1, D2) == 1
    assert nmse(x64 @ r2.T, D2) < 5e-4


@pytest.mark.parametrize("t", [*REPACKED_TYPES, Q2_K, Q3_K, IQ4_NL, IQ4_XS])
@pytest.mark.parametrize("n_threads", [1, 3])
def test_mul_mat_decode_levels_agree(arena, t, n_threads, rng):
    """Decode GEMV gives the same results at every level and, for the repacked types, as the plain path (the integer
    dot products are equal; only float summation order differs), on a matrix split over threads in chunks, with
    rows beyond the last group of 8."""
    M, K = 301, 1024
    w = rng.standard_normal((M, K)).astype(np.float32)
    wd, wref = _weight(arena, w, t)
    x = rng.standard_normal((1, K)).astype(np.float32)
    X = arena.put(x)
    outs, repacked = [], []
    for lv in LEVELS:
        for cid in (0, 5000 + 17 * t + n_threads):
            D = arena.empty((1, M), np.float32)
            run(arena, "MUL_MAT", desc(arena, D), [(*wd, cid), desc(arena, X)], level=lv, n_threads=n_threads)
            outs.append(np.array(D))
            if cid and lv != "scalar" and t in REPACKED_TYPES:
                repacked.append(outs[-1][:, : M // 8 * 8])  # the rows in full groups of 8
    ref = x.astype(np.float64) @ wref.astype(np.float64).T
    tol = 1e-4 if t in REPACKED_TYPES else 1e-5  # the x8 layouts sum in another order than the row kernels
    for o in outs:
        assert nmse(ref, o) < 5e-4
        np.testing.assert_allclose(o, outs[0], rtol=tol, atol=tol * float(np.abs(outs[0]).max()))
    # the x8 kernels' integer sums are exact at every level (avx512 with VNNI: vpdpbusd instead of maddubs + madd),
    # and the float steps are the same: bit-identical results
    for o in repacked[1:]:
        np.testing.assert_array_equal(o, repacked[0])


@pytest.mark.parametrize("t", IQ4)
@pytest.mark.parametrize("fill", [0x00, 0xFF, 0x0F])
def test_mul_mat_iq4_extreme_products(level, arena, t, fill):
    """IQ4 codes at the table's ends (-127, 113) against activations that quantize to +-127: the largest integer
    products the AVX2 kernels must accumulate without 16-bit overflow."""
    M, K = 8, 800 if t == IQ4_NL else 768  # odd block counts
    raw = np.full((M, K // QBLOCK[t][0] * QBLOCK[t][1]), fill, np.uint8)
    blocks = raw.reshape(-1, QBLOCK[t][1])
    blocks[:, 0:2] = np.array([0.01], np.float16).view(np.uint8)
    if t == IQ4_XS:
        blocks[:, 2:8] = 0xFF  # every sub-block scale 63 - 32 = 31
    W = arena.put(raw)
    wref = dequantize(raw, t).reshape(M, K)
    # one sign over most of the row: a wrapped 16-bit sum would not cancel against one of the opposite sign
    x = np.where(np.arange(K) < K - 64, 1.0, -1.0).astype(np.float32)[None, :]
    X = arena.put(x)
    D = arena.empty((1, M), np.float32)
    run(arena, "MUL_MAT", desc(arena, D), [desc(arena, W, t, ne0=K), desc(arena, X)], level=level)
    assert nmse(x.astype(np.float64) @ wref.astype(np.float64).T, D) < 1e-10


def test_mul_mat_large_gemm(level, arena, rng):
    M, K, N = 300, 1000 if level != "scalar" else 200, 130
    w = rng.standard_normal((M, K)).astype(np.float32)
    x = rng.standard_normal((N, K)).astype(np.float32)
    W, X = arena.put(w), arena.put(x)
    D = arena.empty((N, M), np.float32)
    run(arena, "MUL_MAT", desc(arena, D), [desc(arena, W), desc(arena, X)], level=level, n_threads=2)
    assert nmse(x.astype(np.float64) @ w.T.astype(np.float64), D) < 1e-10


# ---------------------------------------------------------------------------------------------------------------
# data movement

@pytest.mark.parametrize("t", WEIGHT_TYPES)
def test_get_rows(level, arena, t, rng):
    R, C = 20, 512
    w = rng.standard_normal((R, C)).astype(np.float32)
    wd, wref = _weight(arena, w, t)
    idx = np.array([3, 0, 19, 3, 7], np.int32)
    Ix = arena.put(idx)
    D = arena.empty((5, C), np.float32)
    run(arena, "GET_ROWS", desc(arena, D), [wd, desc(arena, Ix)], level=level)
    assert nmse(wref[idx], D) < 1e-7
    if t in (F32, F16):
        assert np.array_equal(wref[idx], D)


@pytest.mark.parametrize("t", [*REPACKED_TYPES, F32, F16, BF16])
def test_get_rows_of_a_repacked_weight(level, arena, t, rng):
    """A weight both a product and GET_ROWS read (a tied embedding): once the product has repacked it, GET_ROWS reads
    its rows back from the repacked copy (the original's pages are handed back), bit for bit the rows as stored,
    the rows past the last full group from the original; in a plan where the gather comes first, and in a later
    plan of the gather alone."""
    gr = 8 if t in REPACKED_TYPES else 16
    K, M = 512, 3 * gr + 5
    w = (rng.standard_normal((M, K)) + 0.4 * rng.standard_normal((M, 1))).astype(np.float32)
    wd, wref = _weight(arena, w, t)  # K-quants: random valid blocks
    cid = 4000 + t
    idx = np.array([*range(M), 5, 0, M - 1], np.int32)
    Ix = arena.put(idx)
    X = arena.put(rng.standard_normal((1, K)).astype(np.float32))
    G, D = (arena.empty((idx.size, K), np.float32) for _ in range(2))
    gather = ("GET_ROWS", desc(arena, G), [(*wd, cid), desc(arena, Ix)], [], [])
    prod = ("MUL_MAT", desc(arena, arena.empty((1, M), np.float32)), [(*wd, cid), desc(arena, X)], [], [])
    p = Plan([gather, prod], arena.ranges, [], 2, level)
    p.compute([])
    alone = Plan([("GET_ROWS", desc(arena, D), [(*wd, cid), desc(arena, Ix)], [], [])], arena.ranges, [], 2, level)
    alone.compute([])
    repacked = _simd.repacked_nbytes(t, K, M, level) > 0
    assert _plan_info(p)["get_rows_from_repack"] == _plan_info(alone)["get_rows_from_repack"] == int(repacked)
    for out in (G, D):
        np.testing.assert_array_equal(np.asarray(out), wref[idx].astype(np.float32))


@pytest.mark.parametrize("t", RANDOM_BLOCK_TYPES)
def test_dequantize_k_quants_bit_exact(level, t):
    """Every K-quant / IQ4 row decodes bit-exactly as gguf.quants at every level: many blocks, scales of both
    signs."""
    raw = random_k_blocks((3, 256 * 7), t, seed=11 + t)
    rows = raw.reshape(3 * 7, -1)
    off, n = K_SCALE_OFFSET[t], K_SCALE_COUNT[t]
    sign = np.where(np.arange(rows.shape[0]) % 3 == 1, -1.0, 1.0)[:, None]
    d = (rows[:, off:off + 2 * n].copy().view(np.float16).astype(np.float32) * sign).astype(np.float16)
    rows[:, off:off + 2 * n] = d.view(np.uint8)
    flat = rows.reshape(-1)
    ref = dequantize(flat, t).reshape(-1)
    got = _simd.dequantize(t, flat, 3 * 256 * 7, level=level)
    assert np.array_equal(ref, got)


def test_get_rows_i32_and_batched(level, arena, rng):
    a = rng.integers(-1000, 1000, (3, 10, 6)).astype(np.int32)
    idx = rng.integers(0, 10, (3, 4)).astype(np.int32)
    A, Ix = arena.put(a), arena.put(idx)
    D = arena.empty((3, 4, 6), np.int32)
    run(arena, "GET_ROWS", desc(arena, D), [desc(arena, A), desc(arena, Ix)], level=level)
    assert np.array_equal(D, np.take_along_axis(a, idx[..., None].astype(np.intp), axis=1))


def test_get_rows_out_of_range(level, arena):
    A = arena.put(np.zeros((4, 8), np.float32))
    Ix = arena.put(np.array([1, 4], np.int32))
    D = arena.empty((2, 8), np.float32)
    with pytest.raises(PlanError, match="out of range"):
        run(arena, "GET_ROWS", desc(arena, D), [desc(arena, A), desc(arena, Ix)], level=level)


@pytest.mark.parametrize("t", [F32, F16, BF16, Q8_0, Q4_0, Q4_1])
@pytest.mark.parametrize("it", [I32, I64])
def test_set_rows(level, arena, t, it, rng):
    R, C = 12, 64
    src = rng.standard_normal((3, C)).astype(np.float32)
    idx = np.array([5, 0, 11], NP_TYPE[it])
    S, Ix = arena.put(src), arena.put(idx)
    if t in QBLOCK:
        Dst = arena.empty((R, C // 32 * QBLOCK[t][1]), np.uint8)
        run(arena, "SET_ROWS", desc(arena, Dst, t, ne0=C), [desc(arena, S), desc(arena, Ix)], level=level)
        assert np.array_equal(Dst[idx], quantize(src, t).reshape(3, -1))
    elif t == BF16:
        Dst = arena.empty((R, C), np.uint16)
        d = desc(arena, Dst.view(np.float16))
        run(arena, "SET_ROWS", (BF16, *d[1:]), [desc(arena, S), desc(arena, Ix)], level=level)
        assert np.array_equal(Dst[idx], gq.quantize(src, 30).view(np.uint16).reshape(3, C))
    else:
        Dst = arena.empty((R, C), NP_TYPE[t])
        run(arena, "SET_ROWS", desc(arena, Dst), [desc(arena, S), desc(arena, Ix)], level=level)
        assert np.array_equal(Dst[idx], src.astype(NP_TYPE[t]))
        assert not Dst[1].any()


def test_quantizer_types_are_the_schemas_cpy_destinations():
    """The C++ list of types CPY, SET_ROWS and _simd.quantize write (common.h, type_is_cpy_dst) is
    ggml_py.ir.ops.CPY_DST_TYPES: _simd.quantize takes exactly its quantized types."""
    took = []
    for t in dtypes.ALL:
        if not t.is_quantized:
            continue
        x = np.zeros(t.block_size * 2, np.float32)
        try:
            _simd.quantize(t.ggml_id, x)
            took.append(t.name)
        except ValueError:
            pass
    assert sorted(took) == sorted(t.name for t in ops.CPY_DST_TYPES if t.is_quantized)


@pytest.mark.parametrize("dt", [F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, *K_QUANTS])
def test_cpy_convert(level, arena, dt, rng):
    cols = QBLOCK[dt][0] * 2 if dt in QBLOCK else 64
    x = rng.standard_normal((6, 4, cols)).astype(np.float32)
    x[0, 0, :5] = [0.0, -0.0, 65519.0, 1e-6, -7e-8]
    x[1, 0, :16] = 0.0  # a K-quant's sub-block of zeros
    x[2, 1] *= 1e-20
    X = arena.put(x)
    if dt in QBLOCK:
        D = arena.empty((6, 4, 2 * QBLOCK[dt][1]), np.uint8)
        run(arena, "CPY", desc(arena, D, dt, ne0=cols), [desc(arena, X)], level=level)
        # gguf cannot quantize the K-quants: ours, which equal llama.cpp's (tests/test_quants_vs_llamacpp.py)
        ref = quants.quantize(x, dtypes.from_ggml_id(dt)) if dt in K_QUANTS else quantize(x, dt)
        assert np.array_equal(D.reshape(-1), ref.reshape(-1))
    elif dt == BF16:
        D = arena.empty(x.shape, np.uint16)
        d = desc(arena, D.view(np.float16))
        run(arena, "CPY", (BF16, *d[1:]), [desc(arena, X)], level=level)
        assert np.array_equal(D.reshape(-1), gq.quantize(x, 30).view(np.uint16).reshape(-1))
    else:
        D = arena.empty(x.shape, NP_TYPE[dt])
        run(arena, "CPY", desc(arena, D), [desc(arena, X)], level=level)
        assert np.array_equal(D, x.astype(NP_TYPE[dt]))


def test_fp16_conversion_exhaustive(level, arena):
    # every half value -> f32 -> half round trips; f32 values between halves round to nearest even
    h = np.arange(65536, dtype=np.uint16).view(np.float16)
    h = h[~np.isnan(h)]
    H = arena.put(h)
    F = arena.empty(h.shape, np.float32)
    run(arena, "CPY", desc(arena, F), [desc(arena, H)], level=level)
    assert np.array_equal(F, h.astype(np.float32))
    r = np.random.default_rng(5)
    f = np.concatenate([r.standard_normal(20000) * 1e-5, r.standard_normal(20000) * 3e4,
                        r.standard_normal(20000) * 1e-7, [65504, 65519.9, 65520, 1e9, -1e9]]).astype(np.float32)
    Fi = arena.put(f)
    Ho = arena.empty(f.shape, np.float16)
    run(arena, "CPY", desc(arena, Ho), [desc(arena, Fi)], level=level)
    with np.errstate(over="ignore"):
        assert np.array_equal(Ho.view(np.uint16), f.astype(np.float16).view(np.uint16))


def test_cont_permuted_and_reshaped(level, arena, rng):
    x = rng.standard_normal((3, 4, 5, 6)).astype(np.float32)
    X = arena.put(x)
    view = X.transpose(2, 0, 3, 1)
    D = arena.empty(view.shape, np.float32)
    run(arena, "CONT", desc(arena, D), [desc(arena, view)], level=level)
    assert np.array_equal(D, view)
    # copy into a differently shaped destination: element order is preserved
    D2 = arena.empty((12, 30), np.float16)
    run(arena, "CPY", desc(arena, D2), [desc(arena, view)], level=level)
    assert np.array_equal(D2, np.ascontiguousarray(view).reshape(12, 30).astype(np.float16))
    # into a strided destination
    big = arena.empty((5, 3, 6, 8), np.float32)
    dv = big.transpose(0, 1, 2, 3)[:, :, :, 2:6]
    src = arena.put(rng.standard_normal((5, 3, 6, 4)).astype(np.float32))
    run(arena, "CPY", desc(arena, dv), [desc(arena, src)], level=level)
    assert np.array_equal(dv, src) and not big[..., :2].any()
    i = arena.put(rng.integers(0, 100, (4, 6)).astype(np.int32)).T
    Di = arena.empty(i.shape, np.int32)
    run(arena, "CONT", desc(arena, Di), [desc(arena, i)], level=level)
    assert np.array_equal(Di, i)


@pytest.mark.parametrize("axis", [0, 1, 2])
def test_concat(level, arena, axis, rng):
    a = rng.standard_normal((3, 4, 5)).astype(np.float32)
    shp = list(a.shape)
    shp[axis] = 2
    b = rng.standard_normal(shp).astype(np.float32)
    A, B = arena.put(a), arena.put(b)
    ref = np.concatenate([a, b], axis)
    D = arena.empty(ref.shape, np.float32)
    run(arena, "CONCAT", desc(arena, D), [desc(arena, A), desc(arena, B)], ip=[2 - axis], level=level)
    assert np.array_equal(D, ref)


def test_repeat_pad(level, arena, rng):
    a = rng.standard_normal((2, 1, 3)).astype(np.float32)
    A = arena.put(a)
    D = arena.empty((4, 5, 6), np.float32)
    run(arena, "REPEAT", desc(arena, D), [desc(arena, A)], level=level)
    assert np.array_equal(D, np.tile(a, (2, 5, 2)))
    P = arena.empty((3, 2, 7), np.float32)
    run(arena, "PAD", desc(arena, P), [desc(arena, A)], level=level)
    assert np.array_equal(P, np.pad(a, [(0, 1), (0, 1), (0, 4)]))


# ---------------------------------------------------------------------------------------------------------------
# plans: validation, symbols, threads

def test_validation_rejects_bad_plans(arena):
    A = arena.put(np.zeros((4, 8), np.float32))
    D = arena.empty((4, 8), np.float32)
    ok = desc(arena, D)
    with pytest.raises(PlanError, match="outside"):  # dst beyond the registered range
        t, ne, nb, base, off = ok
        huge = (t, [8, 4000000, 1, 1], nb, base, off)
        Plan([(OPS["ADD"], huge, [huge, desc(arena, A)])], arena.ranges)
    with pytest.raises(PlanError, match="outside"):  # not registered at all
        other = np.zeros(32, np.float32)
        Plan([(OPS["NEG"], ok, [desc(arena, A)])],
                   [(other.__array_interface__["data"][0], other.nbytes)])
    with pytest.raises(PlanError, match="tile"):
        B = arena.put(np.zeros((3,), np.float32))
        Plan([(OPS["ADD"], ok, [desc(arena, A), desc(arena, B)])], arena.ranges)
    with pytest.raises(PlanError, match="inner"):
        W = arena.put(np.zeros((5, 9), np.float32))
        Plan([(OPS["MUL_MAT"], desc(arena, arena.empty((4, 5), np.float32)), [desc(arena, W), desc(arena, A)])],
                   arena.ranges)
    with pytest.raises(PlanError, match="unknown op"):
        Plan([(999, ok, [desc(arena, A)])], arena.ranges)
    with pytest.raises(PlanError, match="type"):
        t, ne, nb, base, off = ok
        Plan([(OPS["NEG"], (77, ne, nb, base, off), [desc(arena, A)])], arena.ranges)
    with pytest.raises(PlanError, match="needs a source"):
        Plan([(OPS["NEG"], ok, [])], arena.ranges)


@pytest.mark.parametrize("t", [Q2_K, Q3_K, IQ4_NL, IQ4_XS])
def test_validation_q2_k_q3_k_iq4_nodes(arena, t):
    """Q2_K/Q3_K/IQ4_NL/IQ4_XS are accepted where the kernels read them (MUL_MAT weights, GET_ROWS sources) and
    refused elsewhere, except that Q2_K and Q3_K, which have a quantizer here, are CPY and SET_ROWS destinations."""
    K = 256
    W = arena.put(random_k_blocks((4, K), t))
    wd = desc(arena, W, t, ne0=K)
    X = arena.put(np.zeros((2, K), np.float32))
    Ix = arena.put(np.array([1, 0], np.int32))
    mm = (OPS["MUL_MAT"], desc(arena, arena.empty((2, 4), np.float32)), [wd, desc(arena, X)])
    gr = (OPS["GET_ROWS"], desc(arena, arena.empty((2, K), np.float32)), [wd, desc(arena, Ix)])
    for node in (mm, gr):
        assert validate(node) == ""
        Plan([node], arena.ranges)
    qd = desc(arena, arena.empty((2, QBLOCK[t][1]), np.uint8), t, ne0=K)
    into = [(OPS["CPY"], qd, [desc(arena, X)]), (OPS["SET_ROWS"], wd, [desc(arena, X), desc(arena, Ix)])]
    if t in K_QUANTS:  # quantizing into the type
        for node in into:
            assert validate(node) == ""
            Plan([node], arena.ranges)
    refused = [
        *(into if t in IQ4 else []),
        (OPS["CPY"], desc(arena, arena.empty((4, K), np.float32)), [wd]),  # a quantized CPY source
        (OPS["CONCAT"], desc(arena, arena.empty((6, QBLOCK[t][1]), np.uint8), t, ne0=K), [wd, qd], [1]),
        (OPS["ADD"], desc(arena, arena.empty((4, K), np.float32)), [wd, wd]),
    ]
    for node in refused:
        assert validate(node) != "", node[0]
        with pytest.raises(PlanError):
            Plan([node], arena.ranges)
    # a weight whose rows are not whole blocks
    bad = (t, [K + 16, 4, 1, 1], wd[2], wd[3], wd[4])
    with pytest.raises(PlanError, match="block size"):
        Plan([(OPS["MUL_MAT"], desc(arena, arena.empty((2, 4), np.float32)), [bad, desc(arena, X)])],
                   arena.ranges)


def test_symbolic_kv_length(level, arena, rng):
    """A decode-style attention whose KV length is a symbol bound at compute time."""
    H, D, MAXKV = 4, 32, 50
    k = rng.standard_normal((H, MAXKV, D)).astype(np.float16)
    v = rng.standard_normal((H, MAXKV, D)).astype(np.float16)
    q = rng.standard_normal((H, 1, D)).astype(np.float32)
    K, V, Q = arena.put(k), arena.put(v), arena.put(q)
    out = arena.empty((1, H, D), np.float32)
    n_kv = (0, [(0, 1)])  # affine: 0 + 1 * sym0

    def kv_desc(arr):
        t, ne, nb, base, off = desc(arena, arr)
        return (t, [ne[0], n_kv, ne[2], ne[3]], nb, base, off)

    nodes = [(OPS["FLASH_ATTN_EXT"], desc(arena, out), [desc(arena, Q), kv_desc(K), kv_desc(V)], [], [0.2, 0, 0])]
    p = Plan(nodes, arena.ranges, [MAXKV], 2, level)
    for L in (1, 7, 50):
        p.compute([L])
        sc = np.einsum("hqd,hkd->hqk", q.astype(np.float64), k[:, :L].astype(np.float64)) * 0.2
        pr = np.exp(sc - sc.max(-1, keepdims=True))
        pr /= pr.sum(-1, keepdims=True)
        ref = np.einsum("hqk,hkd->hqd", pr, v[:, :L].astype(np.float64)).transpose(1, 0, 2)
        assert nmse(ref, out) < 5e-4
    with pytest.raises(PlanError, match="outside"):
        p.compute([51])
    with pytest.raises(PlanError):
        p.compute([])


def test_symbolic_extent_checked_at_build(arena):
    A = arena.put(np.zeros((10, 8), np.float32))
    t, ne, nb, base, off = desc(arena, A)
    rows = (0, [(0, 1)])
    d = (t, [8, rows, 1, 1], nb, base, off)
    Plan([(OPS["NEG"], d, [d])], arena.ranges, [10])
    # a bound so large the view would leave the arena
    with pytest.raises(PlanError, match="outside"):
        Plan([(OPS["NEG"], d, [d])], arena.ranges, [10 ** 9])


def test_symbolic_offset(level, arena, rng):
    """SET_ROWS-like write at a position given by a symbol (KV cache append through a view offset)."""
    cache = arena.empty((16, 8), np.float32)
    row = arena.put(rng.standard_normal((1, 8)).astype(np.float32))
    t, ne, nb, base, off = desc(arena, cache[:1])
    dst = (t, ne, nb, base, (off, [(0, 32)]))  # offset = off + 32 * pos
    p = Plan([(OPS["CPY"], dst, [desc(arena, row)])], arena.ranges, [15], 1, level)
    for pos in (0, 3, 15):
        p.compute([pos])
        assert np.array_equal(cache[pos], row[0])


def test_many_nodes_one_call_threads(level, arena, rng):
    x = rng.standard_normal((3, 200)).astype(np.float32)
    X = arena.put(x)
    bufs = [arena.empty(x.shape, np.float32) for _ in range(2)]
    nodes = []
    prev = X
    for i in range(300):
        out = bufs[i % 2]
        nodes.append((OPS["SCALE"], desc(arena, out), [desc(arena, prev)], [], [1.0, 1.0]))
        prev = out
    for nt in (1, 2, 3):
        p = Plan(nodes, arena.ranges, [], nt, level)
        assert p.n_nodes == 300 and p.n_threads == nt
        p.compute([])
        np.testing.assert_allclose(prev, x + 300, rtol=1e-5)


def test_compute_from_threads_serialises(level, arena, rng):
    w = rng.standard_normal((64, 256)).astype(np.float32)
    x = rng.standard_normal((3, 256)).astype(np.float32)
    W, X = arena.put(w), arena.put(x)
    outs = [arena.empty((3, 64), np.float32) for _ in range(4)]
    plans = [Plan([(OPS["MUL_MAT"], desc(arena, o), [desc(arena, W), desc(arena, X)])], arena.ranges, [], 2,
                        level) for o in outs]
    errors = []

    def work(p):
        try:
            for _ in range(50):
                p.compute([])
        except Exception as e:  # pragma: no cover
            errors.append(e)

    ts = [threading.Thread(target=work, args=(p,)) for p in plans]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    assert not errors
    for o in outs:
        assert nmse(x @ w.T, o) < 1e-10


def test_stream_bandwidth_and_quant_helpers():
    b = np.ones(8 << 20, np.uint8)
    gbs = _simd.stream_read_bandwidth(b, 2, 2)
    assert gbs > 0.1
    x = np.random.default_rng(0).standard_normal(256).astype(np.float32)
    for t in (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1):
        assert np.array_equal(_simd.quantize(t, x), quantize(x, t))
    for t in (*RANDOM_BLOCK_TYPES, Q8_0):
        raw = quantize(x.reshape(1, -1), t).reshape(-1)
        assert np.array_equal(_simd.dequantize(t, raw, 256), dequantize(raw, t).reshape(-1))
