"""The simd backend through ggml_py's public interface: the conformance kit at every SIMD level this CPU has,
level selection (GGML_PY_SIMD, set_level, the `level` option), zero-copy buffers, symbolic plans, node dispatch."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

import ggml_py as gp
from ggml_py.errors import BackendError, GgmlPyError
from ggml_py.ir import dtypes, ops

from conftest import require_backend

require_backend("simd")

import ggml_py_simd as simd_pkg  # noqa: E402

from ggml_py.testing import cases, run_backend  # noqa: E402

# the package imports without its extension (then `_simd` is None); this run expects it built
assert simd_pkg._simd is not None, f"ggml_py_simd._simd did not import: {simd_pkg._IMPORT_ERROR}"

LEVELS = simd_pkg.levels()


def _backend(level: str | None = None, n_threads: int = 2):
    return simd_pkg.register().create(level=level, n_threads=n_threads)


def _numpy():
    import ggml_py_numpy

    return ggml_py_numpy.register().create()


@pytest.mark.parametrize("level", LEVELS)
def test_conformance_kit_at_level(level):
    rep = run_backend(_backend(level), reference=_numpy())
    assert rep.ok, rep.table(show=("failed",))
    assert rep.skipped == 0, rep.table(show=("skipped",))
    assert not rep.not_covered


@pytest.mark.parametrize("level", LEVELS)
def test_conformance_kit_one_thread_and_three(level):
    sel = cases(op=["MUL_MAT", "FLASH_ATTN_EXT", "SOFT_MAX", "ROPE", "GET_ROWS", "CPY"])
    for nt in (1, 3):
        rep = run_backend(_backend(level, nt), sel, reference=_numpy())
        assert rep.ok, rep.table(show=("failed",))


def test_set_level_applies_to_new_plans():
    old = simd_pkg.level()
    try:
        for name in LEVELS:
            simd_pkg.set_level(name)
            b = _backend()
            x = gp.input((4, 64), name="x")
            y = ops.silu(x).set_output()
            plan = gp.prepare(y, backends=[b])
            assert b.plan_info(plan.runs[0].plan)["level"] == name
            v = np.linspace(-3, 3, 256, dtype=np.float32).reshape(4, 64)
            plan.set_input("x", v)
            plan.compute()
            np.testing.assert_allclose(plan.get_output(y), v / (1 + np.exp(-v.astype(np.float64))), rtol=1e-5)
    finally:
        simd_pkg.set_level(old)
    missing = [lv for lv in ("scalar", "avx2", "avx512") if lv not in LEVELS]
    for lv in missing:
        with pytest.raises(BackendError, match="not supported"):
            simd_pkg.set_level(lv)
        with pytest.raises(BackendError, match="not supported"):
            simd_pkg.register().create(level=lv)


def _run_cli(env_level: str, *args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, GGML_PY_SIMD=env_level)
    return subprocess.run([sys.executable, "-m", "ggml_py", *args], capture_output=True, text=True, env=env,
                          timeout=600)


@pytest.mark.parametrize("level", ["scalar", "avx2", "avx512"])
def test_env_level_with_cli(level):
    r = _run_cli(level, "test-backend", "simd", "--json")
    if level in LEVELS:
        assert r.returncode == 0, r.stderr
        rep = json.loads(r.stdout)
        assert rep["failed"] == 0 and rep["skipped"] == 0 and rep["passed"] > 300
    else:
        assert r.returncode == 1
        assert "GGML_PY_SIMD" in r.stderr and "not supported" in r.stderr


def test_weights_are_wrapped_zero_copy(tmp_path):
    b = _backend()
    bt = b.default_buffer_type
    w = np.arange(64 * 32, dtype=np.float32).reshape(64, 32)
    buf = bt.buffer_from_host(w)
    assert buf is not None and buf.base == w.__array_interface__["data"][0]
    mm_path = tmp_path / "w.bin"
    w.tofile(mm_path)
    mm = np.memmap(mm_path, dtype=np.float32, mode="r", shape=(64, 32))
    buf2 = bt.buffer_from_host(mm)
    assert buf2 is not None and buf2.base == mm.__array_interface__["data"][0]
    del mm
    assert buf2.host_view().view(np.float32)[5] == 5.0
    # a graph computing on the mmap'd weight without a copy
    wt = gp.weight(np.memmap(mm_path, dtype=np.float32, mode="r", shape=(64, 32)), name="w")
    x = gp.input((3, 32), name="x")
    y = ops.mul_mat(wt, x).set_output()
    plan = gp.prepare(y, backends=[b])
    xv = np.ones((3, 32), np.float32)
    plan.set_input("x", xv)
    plan.compute()
    np.testing.assert_allclose(plan.get_output(y), xv @ w.T, rtol=1e-6)
    a = bt.alloc_buffer(1000)
    assert a.base % 64 == 0 and a.size >= 1000 and not a.host_view().any()


def test_symbolic_decode_plan_one_compute_call():
    """A KV-length symbol: one plan serves every length; each compute is one C call."""
    H, Hk, D, MAX = 4, 2, 32, 64
    n_kv = gp.sym("n_kv", MAX)
    b = _backend()
    k_cache = gp.state((Hk, MAX, D), dtypes.F16, name="k_cache")
    v_cache = gp.state((Hk, MAX, D), dtypes.F16, name="v_cache")
    q = gp.input((H, 1, D), name="q")
    k = ops.view(k_cache, (Hk, n_kv, D), strides=k_cache.strides)
    v = ops.view(v_cache, (Hk, n_kv, D), strides=v_cache.strides)
    out = ops.flash_attn_ext(q, k, v, None, scale=0.2).set_output()
    plan = gp.prepare(out, backends=[b])
    rng = np.random.default_rng(0)
    kc = rng.standard_normal((Hk, MAX, D)).astype(np.float16)
    vc = rng.standard_normal((Hk, MAX, D)).astype(np.float16)
    plan.set_input("k_cache", kc)
    plan.set_input("v_cache", vc)
    qv = rng.standard_normal((H, 1, D)).astype(np.float32)
    for L in (1, 5, 64):
        plan.set_input("q", qv)
        plan.compute(n_kv=L)
        got = plan.get_output(out)
        kk = np.repeat(kc[:, :L].astype(np.float64), 2, 0)
        vv = np.repeat(vc[:, :L].astype(np.float64), 2, 0)
        s = np.einsum("hqd,hkd->hqk", qv, kk) * 0.2
        p = np.exp(s - s.max(-1, keepdims=True))
        p /= p.sum(-1, keepdims=True)
        ref = np.einsum("hqk,hkd->hqd", p, vv).transpose(1, 0, 2)
        assert np.sum((ref - got) ** 2) / np.sum(ref ** 2) < 5e-4


@pytest.mark.parametrize("t_max", [2, 16])
def test_decode_attention_with_a_symbolic_row_count(t_max):
    """Attention whose query row count is a symbol (batched decode): with few rows x KV heads the keys are split
    across threads (t_max 2: a plan of two phases), with many they are not (t_max 16); any bound value computes, with
    the scratch planned for the symbol's whole range (a regression: 2 rows once needed more than planned)."""
    H, Hk, D, NKV = 6, 2, 64, 300
    T = gp.sym("T", t_max)
    b = _backend(n_threads=2)
    q = gp.input((1, H, T, D), name="q")
    k = gp.input((1, Hk, NKV, D), dtypes.F16, name="k")
    v = gp.input((1, Hk, NKV, D), dtypes.F16, name="v")
    out = ops.flash_attn_ext(q, k, v, None, scale=0.125).set_output()
    plan = gp.prepare(out, backends=[b])
    rng = np.random.default_rng(1)
    kv = rng.standard_normal((1, Hk, NKV, D)).astype(np.float32)
    vv = rng.standard_normal((1, Hk, NKV, D)).astype(np.float32)
    plan.set_input("k", kv)
    plan.set_input("v", vv)
    kk = np.repeat(kv[0].astype(np.float16).astype(np.float64), H // Hk, 0)
    vk = np.repeat(vv[0].astype(np.float16).astype(np.float64), H // Hk, 0)
    for rows in sorted({1, 2, t_max}):
        qv = rng.standard_normal((1, H, rows, D)).astype(np.float32)
        plan.set_input("q", qv)
        plan.compute()
        s = np.einsum("hqd,hkd->hqk", qv[0], kk) * 0.125
        p = np.exp(s - s.max(-1, keepdims=True))
        ref = (np.einsum("hqk,hkd->hqd", p / p.sum(-1, keepdims=True), vk)).transpose(1, 0, 2)
        got = plan.get_output(out)[0]
        assert np.sum((ref - got) ** 2) / np.sum(ref ** 2) < 1e-6


def test_errors_are_ggml_py_errors():
    b = _backend()
    emb = gp.weight(np.zeros((4, 8), np.float32), name="emb")
    idx = gp.input((2,), dtypes.I32, name="idx")
    y = ops.get_rows(emb, idx).set_output()
    plan = gp.prepare(y, backends=[b])
    plan.set_input("idx", np.array([0, 9], np.int32))
    with pytest.raises(GgmlPyError, match="out of range"):
        plan.compute()
    plan.set_input("idx", np.array([0, 3], np.int32))
    plan.compute()


def test_supports_op_matches_kernels():
    b = _backend()
    x = gp.input((4, 64), name="x")
    assert b.supports_op(ops.silu(x))
    assert b.supports_op(ops.mul_mat(gp.weight(np.zeros((8, 64), np.float32)), x))
    # a node type the kernels do not have
    t = ops.silu(x)
    t.op = "IM2COL"
    assert not b.supports_op(t)


def test_kit_with_the_gemm_taking_every_product_of_four_rows_or_more():
    """By default quantized products take the integer path at every row count (a row's result must not depend on
    the row count: tests/test_determinism_ops.py); with the thresholds at 4 (GGML_PY_SIMD_GEMM_ROWS_X8,
    GGML_PY_SIMD_GEMM_ROWS) the kit's MUL_MAT cases run the F32 GEMM, including its reading of the 8-row records of
    the repacked types, which must pass too."""
    code = ("import ggml_py_simd, ggml_py_numpy\n"
            "from ggml_py.testing import cases, run_backend\n"
            "assert ggml_py_simd._simd.GEMM_MIN_ROWS == 4\n"
            "for level in ggml_py_simd.levels():\n"
            "    r = run_backend(ggml_py_simd.register().create(level=level, n_threads=2), cases(op='MUL_MAT'),\n"
            "                    reference=ggml_py_numpy.register().create())\n"
            "    assert r.ok and not r.skipped, r.table(show=('failed', 'skipped'))\n")
    env = {**os.environ, "GGML_PY_SIMD_GEMM_ROWS_X8": "4", "GGML_PY_SIMD_GEMM_ROWS": "4"}
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600, env=env)
    assert r.returncode == 0, r.stderr[-3000:]
