"""Row invariance on the simd backend (issue 26, deterministic generation): row r of an op's result must be
bit-identical whatever other rows share the call (1..300 of them, x_r at any position among them), at 1 and 2
threads, at each SIMD level (the levels may differ from each other). MUL_MAT for every weight type the backend
reads, repacked (a constant weight) and not (the weight an input), MUL_MAT_ID (the expert-routed product), plus the
per-row ops of a decoder layer."""

from __future__ import annotations

import numpy as np
import pytest

import ggml_py as gp
from ggml_py.formats.quants import quantize
from ggml_py.ir import dtypes, ops

from conftest import require_backend

require_backend("simd")

import ggml_py_simd as simd_pkg  # noqa: E402

LEVELS = simd_pkg.levels()
ROWS = (1, 2, 3, 4, 7, 16, 17, 64, 300)
POOL = 300
# 1 thread, and 2 with every node split over both (a small node would otherwise run on one)
THREADS = ((1, False), (2, True))
TYPES = ["F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K",
         "IQ4_NL", "IQ4_XS"]


def _backend(level: str, n_threads: int, parallel: bool):
    opts = {"force_parallel": 1} if parallel else {}
    return simd_pkg.register().create(level=level, n_threads=n_threads, **opts)


def _k(t: dtypes.DType) -> int:
    """K not a multiple of 256 wherever the type allows it (floats: not even of 8, for the vector loops' tails)."""
    return 803 if t.block_size == 1 else 800 if t.block_size == 32 else 768


def _raw(w: np.ndarray, t: dtypes.DType) -> np.ndarray:
    data = quantize(w, t)
    return data.reshape(-1).view(np.uint8) if t.is_quantized or t is dtypes.BF16 else data


def _picks(n: int) -> np.ndarray:
    """Which pool rows a call of n rows holds, in which order: each row lands at another position for each n."""
    return np.random.default_rng(n).permutation(POOL)[:n]


def _diff_rows(got: np.ndarray, want: np.ndarray) -> int:
    same = np.array_equal(got, want) and np.array_equal(got.view(np.uint32), want.view(np.uint32))
    return 0 if same else int(np.sum(np.any(got.view(np.uint32) != want.view(np.uint32), axis=-1)))


def _mul_mat_plan(backend, t: dtypes.DType, wdata: np.ndarray, shape, constant: bool, rows):
    """A one-product plan: the weight constant (repacked where simd repacks t) or an input (never repacked)."""
    w = gp.weight(wdata, t, shape=shape, name="w") if constant else gp.input(shape, t, name="w")
    x = gp.input((rows, shape[1]), name="x")
    y = ops.mul_mat(w, x).set_output()
    plan = gp.prepare(y, backends=[backend])
    if not constant:
        plan.set_input("w", wdata)
    return plan, y


def _run(plan, y, x: np.ndarray) -> np.ndarray:
    plan.set_input("x", x)
    plan.compute()
    return np.array(plan.get_output(y), dtype=np.float32)


@pytest.mark.parametrize("constant", [True, False], ids=["const", "input"])
@pytest.mark.parametrize("tname", TYPES)
@pytest.mark.parametrize("level", LEVELS)
def test_mul_mat_rows_bit_identical(level, tname, constant):
    """dst row r = W . x_r is the same bits at 1..300 rows, at 1 and 2 threads, and through a plan whose row count
    is a symbol bound per compute (a batched decoder's)."""
    t = dtypes.get(tname)
    K, M = _k(t), 150  # M: not a multiple of 8 or 16 (rows beyond the repacked groups), work enough for 2 threads
    rng = np.random.default_rng(26)
    w = (rng.standard_normal((M, K)) + 0.3 * rng.standard_normal((M, 1))).astype(np.float32)
    wdata = _raw(w, t)
    pool = (rng.standard_normal((POOL, K)) + 0.2).astype(np.float32)
    ref_plan, ref_y = _mul_mat_plan(_backend(level, 1, False), t, wdata, (M, K), constant, POOL)
    ref = _run(ref_plan, ref_y, pool)
    # sanity: it is the product (the near-equality tests live in test_simd_kernels)
    assert np.isfinite(ref).all() and np.abs(ref).max() > 0
    bad = []
    for nt, par in THREADS:
        b = _backend(level, nt, par)
        for n in ROWS:
            plan, y = _mul_mat_plan(b, t, wdata, (M, K), constant, n)
            idx = _picks(n)
            d = _diff_rows(_run(plan, y, pool[idx]), ref[idx])
            if d:
                bad.append(f"{n} rows at {nt} thread(s): {d} rows differ")
    sym_plan, sym_y = _mul_mat_plan(_backend(level, 2, True), t, wdata, (M, K), constant, gp.sym("T", POOL))
    for n in ROWS:
        idx = _picks(n)
        d = _diff_rows(_run(sym_plan, sym_y, pool[idx]), ref[idx])
        if d:
            bad.append(f"{n} rows (symbolic, 2 threads): {d} rows differ")
    assert not bad, f"{tname} at {level}, weight {'constant' if constant else 'input'}: " + "; ".join(bad)


def _mul_mat_id_plan(backend, t: dtypes.DType, wdata: np.ndarray, shape, rows, k: int):
    w = gp.weight(wdata, t, shape=shape, name="w")
    x, ids = gp.input((rows, 1, shape[2]), name="x"), gp.input((rows, k), dtypes.I32, name="ids")
    y = ops.mul_mat_id(w, x, ids).set_output()
    return gp.prepare(y, backends=[backend]), y


def _run_id(plan, y, x: np.ndarray, ids: np.ndarray) -> np.ndarray:
    plan.set_input("ids", ids)
    return _run(plan, y, x[:, None, :])


@pytest.mark.parametrize("tname", ["F32", "F16", "Q4_0", "Q8_0", "Q2_K", "Q4_K", "Q6_K", "IQ4_NL"])
@pytest.mark.parametrize("level", LEVELS)
def test_mul_mat_id_rows_bit_identical(level, tname):
    """MUL_MAT_ID: a token's rows are the same bits whatever other tokens share the step and whichever experts they
    chose (the experts grouped differently each time), at 1 and 2 threads and through a symbolic token count."""
    t = dtypes.get(tname)
    E, M, K, k = 6, 48, _k(t), 2  # M a multiple of 8: the quantized x8 types' experts are repacked
    rng = np.random.default_rng(29)
    wdata = _raw(rng.standard_normal((E * M, K)).astype(np.float32), t)
    pool = (rng.standard_normal((POOL, K)) + 0.2).astype(np.float32)
    pool_ids = np.stack([rng.permutation(E)[:k] for _ in range(POOL)]).astype(np.int32)
    ref_plan, ref_y = _mul_mat_id_plan(_backend(level, 1, False), t, wdata, (E, M, K), POOL, k)
    ref = _run_id(ref_plan, ref_y, pool, pool_ids)
    assert np.isfinite(ref).all() and np.abs(ref).max() > 0
    bad = []
    for nt, par in THREADS:
        b = _backend(level, nt, par)
        for n in ROWS:
            plan, y = _mul_mat_id_plan(b, t, wdata, (E, M, K), n, k)
            idx = _picks(n)
            d = _diff_rows(_run_id(plan, y, pool[idx], pool_ids[idx]).reshape(n, -1), ref[idx].reshape(n, -1))
            if d:
                bad.append(f"{n} tokens at {nt} thread(s): {d} differ")
    sym_plan, sym_y = _mul_mat_id_plan(_backend(level, 2, True), t, wdata, (E, M, K), gp.sym("T", POOL), k)
    for n in ROWS:
        idx = _picks(n)
        d = _diff_rows(_run_id(sym_plan, sym_y, pool[idx], pool_ids[idx]).reshape(n, -1), ref[idx].reshape(n, -1))
        if d:
            bad.append(f"{n} tokens (symbolic, 2 threads): {d} differ")
    assert not bad, f"{tname} at {level}: " + "; ".join(bad)


@pytest.mark.parametrize("tname", ["F32", "F16", "BF16"])
@pytest.mark.parametrize("level", LEVELS)
def test_float_weights_same_bits_repacked_or_not(level, tname):
    """A constant float weight is read from its 16-row panels (p16, avx2 and up), an input one packed per product:
    the same micro-kernel sums, so the same bits, including the rows beyond the last full panel."""
    t = dtypes.get(tname)
    K, M = _k(t), 150
    rng = np.random.default_rng(11)
    wdata = _raw(rng.standard_normal((M, K)).astype(np.float32), t)
    pool = rng.standard_normal((POOL, K)).astype(np.float32)
    for nt, par in THREADS:
        b = _backend(level, nt, par)
        for n in (1, 5, 7, 300):
            got = [_run(*_mul_mat_plan(b, t, wdata, (M, K), const, n), pool[:n]) for const in (True, False)]
            assert _diff_rows(got[0], got[1]) == 0, (n, nt)


@pytest.mark.parametrize("tname", ["F16", "Q4_0", "Q8_0", "Q4_K", "Q6_K", "Q3_K", "IQ4_NL"])
@pytest.mark.parametrize("level", LEVELS)
def test_grouped_products_equal_lone_ones(level, tname):
    """Products of one input (a layer's q, k, v) computed as one task give each product's rows as computed alone."""
    t = dtypes.get(tname)
    K = _k(t)
    rng = np.random.default_rng(7)
    shapes = [(96, K), (40, K), (40, K)]
    wdata = [_raw(rng.standard_normal(s).astype(np.float32), t) for s in shapes]
    pool = rng.standard_normal((POOL, K)).astype(np.float32)
    b = _backend(level, 2, True)
    for n in (1, 3, 17):
        x = gp.input((n, K), name="x")
        ys = [ops.mul_mat(gp.weight(d, t, shape=s, name=f"w{i}"), x).set_output()
              for i, (d, s) in enumerate(zip(wdata, shapes))]
        plan = gp.prepare(ys, backends=[b])
        plan.set_input("x", pool[:n])
        plan.compute()
        for d, s, y in zip(wdata, shapes, ys):
            lone, ly = _mul_mat_plan(b, t, d, s, True, n)
            assert _diff_rows(np.array(plan.get_output(y)), _run(lone, ly, pool[:n])) == 0, (n, s)


# ---------------------------------------------------------------------------------------------------------------
# the per-row ops of a decoder layer

def _rows_invariant(level: str, build, inputs) -> list[str]:
    """build(rows) -> (graph outputs, {input name: array of `rows` rows}); inputs(idx) gives the arrays for the
    pool rows idx. Every output row must be the same bits as the pool's reference run at 1 thread."""
    def run(b, idx):
        outs = build(len(idx))
        plan = gp.prepare(outs, backends=[b])
        for k, v in inputs(idx).items():
            plan.set_input(k, v)
        plan.compute()
        return [np.array(plan.get_output(o)) for o in outs]

    ref = run(_backend(level, 1, False), np.arange(POOL))
    bad = []
    for nt, par in THREADS:
        b = _backend(level, nt, par)
        for n in ROWS:
            idx = _picks(n)
            for i, (got, want) in enumerate(zip(run(b, idx), ref)):
                want = want[idx]
                if got.dtype.itemsize == 4:
                    d = _diff_rows(got.reshape(n, -1), want.reshape(n, -1))
                else:
                    d = int(np.sum(np.any(got.reshape(n, -1) != want.reshape(n, -1), axis=-1)))
                if d:
                    bad.append(f"output {i}: {n} rows at {nt} thread(s): {d} rows differ")
    return bad


@pytest.mark.parametrize("level", LEVELS)
def test_norms_softmax_binary_rows_bit_identical(level):
    """RMS_NORM, NORM (times a weight row), ADD, MUL and SOFT_MAX (scale and a mask) per row."""
    C = 1000
    rng = np.random.default_rng(3)
    pool_a = rng.standard_normal((POOL, C)).astype(np.float32)
    pool_b = rng.standard_normal((POOL, C)).astype(np.float32)
    pool_m = np.where(rng.random((POOL, C)) < 0.2, -np.inf, rng.standard_normal((POOL, C))).astype(np.float32)
    g = gp.weight(rng.standard_normal(C).astype(np.float32), name="g")

    def build(n):
        a, bb = gp.input((n, C), name="a"), gp.input((n, C), name="b")
        m = gp.input((n, C), name="m")
        return [ops.mul(ops.rms_norm(a, 1e-6), g).set_output(), ops.norm(bb, 1e-5).set_output(),
                ops.add(a, bb).set_output(), ops.mul(a, bb).set_output(),
                ops.soft_max(a, m, scale=0.37).set_output()]

    bad = _rows_invariant(level, build, lambda idx: {"a": pool_a[idx], "b": pool_b[idx], "m": pool_m[idx]})
    assert not bad, "; ".join(bad)


@pytest.mark.parametrize("level", LEVELS)
def test_rope_rows_bit_identical(level):
    """ROPE (normal and neox, a partial n_dims) of rows of heads at their own positions."""
    H, D = 4, 64
    rng = np.random.default_rng(4)
    pool = rng.standard_normal((POOL, H, D)).astype(np.float32)
    pos = rng.integers(0, 4000, POOL).astype(np.int32)

    def build(n):
        q, p = gp.input((n, H, D), name="q"), gp.input((n,), dtypes.I32, name="p")
        return [ops.rope(q, p, D, ops.ROPE_NORMAL).set_output(),
                ops.rope(q, p, 48, ops.ROPE_NEOX, freq_base=500000.0, freq_scale=0.5).set_output()]

    bad = _rows_invariant(level, build, lambda idx: {"q": pool[idx], "p": pos[idx]})
    assert not bad, "; ".join(bad)


@pytest.mark.parametrize("H,Hk", [(8, 8), (16, 8), (12, 4), (4, 1), (10, 2)], ids=lambda v: str(v))
@pytest.mark.parametrize("level", LEVELS)
def test_flash_attn_rows_bit_identical(level, H, Hk):
    """FLASH_ATTN_EXT over a KV cache laid out as a model's (all KV heads of a position side by side), each query row
    with a mask of its own (a causal end, fully masked tiles): a decode step's 1-2 rows split their keys across the
    threads and read each chunk's cache rows for every head at once; more rows take each head in turn. Heads per KV
    head 1-4 (the grouped kernels) and 5 (head by head)."""
    D, Nkv = 64, 300
    rng = np.random.default_rng(5)
    pool_q = rng.standard_normal((POOL, H, D)).astype(np.float32)
    kc = rng.standard_normal((Nkv, Hk, D)).astype(np.float16)
    vc = rng.standard_normal((Nkv, Hk, D)).astype(np.float16)
    ends = rng.integers(1, Nkv + 1, POOL)
    pool_m = np.where(np.arange(Nkv)[None, :] < ends[:, None], 0.0, -np.inf).astype(np.float16)
    pool_m[:, 16:40] = -np.inf  # whole tiles of no key
    pool_m[:, 0] = 0.0

    def build(n):
        q, m = gp.input((n, H, D), name="q"), gp.input((n, Nkv), dtypes.F16, name="m")
        k, v = gp.input((Nkv, Hk, D), dtypes.F16, name="k"), gp.input((Nkv, Hk, D), dtypes.F16, name="v")
        att = ops.flash_attn_ext(ops.permute(q, (1, 0, 2)), ops.permute(k, (1, 0, 2)), ops.permute(v, (1, 0, 2)), m,
                                 scale=0.125)
        return [att.set_output()]

    bad = _rows_invariant(level, build, lambda idx: {"q": pool_q[idx], "m": pool_m[idx], "k": kc, "v": vc})
    assert not bad, "; ".join(bad)


@pytest.mark.parametrize("level", LEVELS)
def test_get_rows_and_set_rows_bit_identical(level):
    """GET_ROWS of an F32, an F16 and a Q4_K table; SET_ROWS of rows into F16 and Q8_0 tables (a KV cache's), the
    written rows read back."""
    R, C = 64, 512
    rng = np.random.default_rng(5)
    table = rng.standard_normal((R, C)).astype(np.float32)
    q4k = _raw(table, dtypes.Q4_K)
    ids = rng.integers(0, R, POOL).astype(np.int32)
    pool = rng.standard_normal((POOL, C)).astype(np.float32)

    def build(n):
        i = gp.input((n,), dtypes.I32, name="i")
        outs = [ops.get_rows(gp.weight(table, name="t32"), i).set_output(),
                ops.get_rows(gp.weight(table.astype(np.float16), name="t16"), i).set_output(),
                ops.get_rows(gp.weight(q4k, dtypes.Q4_K, shape=(R, C), name="tq"), i).set_output()]
        x, slot = gp.input((n, C), name="x"), gp.input((n,), dtypes.I32, name="slot")
        for tt in (dtypes.F16, dtypes.Q8_0):
            cache = gp.state((POOL, C), tt, name=f"cache_{tt.name}")
            outs.append(ops.get_rows(ops.set_rows(cache, x, slot), slot).set_output())
        return outs

    # each pool row is written to its own slot (its pool index), so the reference and every call agree
    bad = _rows_invariant(level, build, lambda idx: {"i": ids[idx], "x": pool[idx], "slot": idx.astype(np.int32)})
    assert not bad, "; ".join(bad)
