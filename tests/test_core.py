"""Core runtime: op validation, graph, allocator, scheduler, plans, symbolic dims, registry."""

from __future__ import annotations

import logging
import sysconfig

import numpy as np
import pytest

import ggml_py as gp
from ggml_py import counters
from ggml_py.errors import BackendError, PlanError, ShapeError
from ggml_py.ir import ops
from ggml_py.runtime.backend import BackendRegistration

from conftest import DECLARED, expected_backends, installed_check


def run(out, inputs, backends="numpy", **bind):
    plan = gp.prepare(out, backends=backends)
    for k, v in inputs.items():
        plan.set_input(k, v)
    plan.compute(**bind)
    return plan.get_output(out)


# -- op validation -----------------------------------------------------------------------------------------------
def test_shape_error_names_op_and_shapes():
    a = gp.input((4, 8), name="a")
    b = gp.input((3, 8), name="b")
    with pytest.raises(ShapeError, match=r"ADD: .*\[3, 8\].*\[4, 8\]"):
        ops.add(a, b)
    w = gp.input((16, 7), name="w")
    with pytest.raises(ShapeError, match="MUL_MAT: inner dimensions differ"):
        ops.mul_mat(w, a)
    with pytest.raises(ShapeError, match="RESHAPE"):
        ops.reshape(a, (5, 7))
    with pytest.raises(ShapeError, match="block size"):
        gp.input((4, 33), "Q4_0")
    with pytest.raises(ShapeError, match="VIEW: .*runs past"):
        ops.view(a, (4, 9))
    with pytest.raises(ShapeError, match="ROPE"):
        ops.rope(gp.input((2, 3, 8)), gp.input((3,), "I32"), n_dims=8)


def test_broadcast_tiles_like_ggml():
    a = gp.input((4, 6), name="a")
    b = gp.input((2, 6), name="b")
    av = np.arange(24, dtype=np.float32).reshape(4, 6)
    bv = np.arange(12, dtype=np.float32).reshape(2, 6)
    out = run(ops.add(a, b), {"a": av, "b": bv})
    np.testing.assert_array_equal(out, av + np.tile(bv, (2, 1)))


def test_views_permute_cont(rng):
    a = gp.input((2, 3, 4), name="a")
    av = rng.standard_normal((2, 3, 4)).astype(np.float32)
    out = run(ops.cont(ops.permute(a, (2, 0, 1))), {"a": av})
    np.testing.assert_array_equal(out, av.transpose(2, 0, 1))
    v = ops.view(a, (3, 2), strides=(16, 4), offset=8)  # strided window
    out = run(ops.cont(v), {"a": av})
    np.testing.assert_array_equal(out, np.lib.stride_tricks.as_strided(av.reshape(-1)[2:], (3, 2), (16, 4)))


# -- graph ---------------------------------------------------------------------------------------------------
def test_graph_order_leafs_structure_key_dot():
    def build():
        x = gp.input((4, 8), name="x")
        w = gp.weight(np.ones((16, 8), np.float32), name="w")
        h = ops.mul_mat(w, x)
        return ops.add(ops.silu(h), h)

    g1, g2 = gp.Graph(build()), gp.Graph(build())
    assert [n.op for n in g1.nodes] == ["MUL_MAT", "SILU", "ADD"]
    assert sorted(t.name for t in g1.leafs) == ["w", "x"]
    assert g1.structure_key() == g2.structure_key()
    x = gp.input((4, 8), name="x")
    assert gp.Graph(ops.silu(x)).structure_key() != gp.Graph(ops.gelu(x)).structure_key()
    dot = g1.to_dot()
    assert dot.startswith("digraph") and "MUL_MAT" in dot and "->" in dot


def test_graph_puts_products_of_one_input_side_by_side(rng):
    """A layer's q, k and v products (one computed input, each followed by its own ops) come out adjacent, in an order
    that is still topological (a backend may compute them as one), with the same results."""
    x = gp.input((2, 8), name="x")
    h = ops.silu(x)
    ws = [rng.standard_normal((16, 8)).astype(np.float32) for _ in range(3)]
    q, k, v = (ops.mul_mat(gp.weight(w, name=f"w{i}"), h) for i, w in enumerate(ws))
    out = ops.add(ops.add(ops.gelu(q), ops.silu(k)), v)
    g = gp.Graph(out)
    assert [n.op for n in g.nodes] == ["SILU", "MUL_MAT", "MUL_MAT", "MUL_MAT", "GELU", "SILU", "ADD", "ADD"]
    pos = {n.id: i for i, n in enumerate(g.nodes)}
    assert all(pos[s.id] < pos[n.id] for n in g.nodes for s in n.src if s is not None and s.id in pos)
    xv = rng.standard_normal((2, 8)).astype(np.float32)
    hv = xv / (1 + np.exp(-xv))
    qv, kv, vv = (hv @ w.T for w in ws)
    gelu = 0.5 * qv * (1 + np.tanh(0.7978845608 * (qv + 0.044715 * qv**3)))
    np.testing.assert_allclose(run(out, {"x": xv}), gelu + kv / (1 + np.exp(-kv)) + vv, rtol=1e-4, atol=1e-4)


def test_graph_moves_no_sibling_past_a_write_into_a_leaf(rng):
    """A product that reads a cache (a leaf) after a SET_ROWS into it stays after the write, though it shares its op
    and input with an earlier product: the graph has no edge between them, only the order."""
    x, cache = gp.input((2, 8), name="x"), gp.input((4, 8), name="cache")
    rows, idx = gp.input((1, 8), name="rows"), gp.input((1,), "I32", name="idx")
    h = ops.silu(x)
    w = rng.standard_normal((16, 8)).astype(np.float32)
    q = ops.mul_mat(gp.weight(w, name="w"), h)
    written = ops.set_rows(cache, rows, idx)
    k = ops.mul_mat(cache, h)
    assert [n.op for n in gp.Graph([q, written, k]).nodes] == ["SILU", "MUL_MAT", "SET_ROWS", "MUL_MAT"]
    plan = gp.prepare([q, written, k], backends="numpy")
    xv, cv, rv = (rng.standard_normal(s).astype(np.float32) for s in [(2, 8), (4, 8), (1, 8)])
    for name, v in [("x", xv), ("cache", cv), ("rows", rv), ("idx", np.array([2], np.int32))]:
        plan.set_input(name, v)
    plan.compute()
    cv[2] = rv[0]
    np.testing.assert_allclose(plan.get_output(k), (xv / (1 + np.exp(-xv))) @ cv.T, rtol=1e-5, atol=1e-5)


# -- allocator -----------------------------------------------------------------------------------------------
def test_allocator_reuses_memory_over_long_chain():
    n = 1 << 18  # 1 MiB of float32
    x = gp.input((n,), name="x")
    y = x
    for i in range(200):
        y = ops.scale(y, 1.0 + 1e-3) if i % 2 else ops.add(y, x)
    plan = gp.prepare(y, backends="numpy")
    size = plan.stats()["buffer_sizes"]["numpy"]
    assert size <= 4 * (1 << 20), f"compute buffer {size} bytes for a 200-op chain over 1 MiB"
    xv = np.ones(n, np.float32)
    plan.set_input("x", xv)
    plan.compute()
    ref = xv.copy()
    for i in range(200):
        ref = ref * np.float32(1.0 + 1e-3) if i % 2 else ref + xv
    np.testing.assert_allclose(plan.get_output(y), ref, rtol=1e-5)


def test_allocator_keeps_values_a_later_node_needs():
    x = gp.input((8,), name="x")
    a = ops.exp(x)
    b = ops.neg(a)  # a is still needed below: must not be overwritten in place
    c = ops.add(b, a)
    xv = np.linspace(-1, 1, 8, dtype=np.float32)
    np.testing.assert_allclose(run(c, {"x": xv}), np.zeros(8), atol=1e-6)


# -- plans ---------------------------------------------------------------------------------------------------
def test_plan_reuse_does_no_building_or_allocation():
    x = gp.input((4, 8), name="x")
    w = gp.weight(np.eye(8, dtype=np.float32), name="w")
    y = ops.rms_norm(ops.mul_mat(w, x), 1e-6)
    plan = gp.prepare(y, backends="numpy")
    before = counters.snapshot()
    for i in range(10):
        plan.set_input("x", np.full((4, 8), i + 1, np.float32))
        plan.compute()
        np.testing.assert_allclose(plan.get_output(y), np.ones((4, 8)), rtol=1e-5)
    after = counters.snapshot()
    assert after.get("graphs_built", 0) == before.get("graphs_built", 0)
    assert after.get("buffers_allocated", 0) == before.get("buffers_allocated", 0)
    assert after.get("plans_prepared", 0) == before.get("plans_prepared", 0)
    assert after["plan_computes"] - before.get("plan_computes", 0) == 10
    st = plan.stats()
    assert st["computes"] == 10 and st["splits"] == 1 and st["nodes"] == 2
    assert [a["backend"] for a in plan.assignment()] == ["numpy", "numpy"]


def test_symbolic_dim_one_plan_serves_many_lengths(rng):
    n_kv = gp.sym("n_kv", 64)
    cache = gp.state((64, 8), "F32", name="cache")
    rows = gp.input((1, 8), name="rows")
    idx = gp.input((1,), "I32", name="idx")
    written = ops.set_rows(cache, rows, idx)
    kv = ops.view(written, (n_kv, 8), strides=(32, 4))
    q = gp.input((1, 8), name="q")
    scores = ops.soft_max(ops.mul_mat(kv, q), None, 0.5).set_name("scores")
    plan = gp.prepare(scores, backends="numpy")
    ref_cache = np.zeros((64, 8), np.float32)
    for step in range(20):
        r = rng.standard_normal((1, 8)).astype(np.float32)
        qv = rng.standard_normal((1, 8)).astype(np.float32)
        ref_cache[step] = r[0]
        plan.set_input("rows", r)
        plan.set_input("idx", np.array([step], np.int32))
        plan.set_input("q", qv)
        plan.compute(n_kv=step + 1)
        s = qv @ ref_cache[: step + 1].T * 0.5
        e = np.exp(s - s.max())
        np.testing.assert_allclose(plan.get_output("scores"), e / e.sum(), rtol=1e-5, atol=1e-6)
    assert plan.stats()["computes"] == 20


def test_symbolic_input_binds_from_shape():
    n = gp.sym("n", 10)
    a = gp.input((2, n), name="a")
    y = ops.sum_rows(a)
    plan = gp.prepare(y, backends="numpy")
    for k in (1, 4, 10):
        plan.set_input("a", np.ones((2, k), np.float32))
        plan.compute()
        np.testing.assert_array_equal(plan.get_output(y), np.full((2, 1), k, np.float32))
    plan.set_input("a", np.ones((2, 3), np.float32))
    with pytest.raises(PlanError, match="conflicts"):
        plan.compute(n=4)
    plan.compute(n=3)
    with pytest.raises(PlanError, match="outside 1..10"):
        plan.set_input("a", np.ones((2, 11), np.float32))
    with pytest.raises(PlanError, match="must be bound"):
        plan.compute()


def test_a_refused_compute_drops_the_inputs_bindings():
    """A compute refused before running (a binding that conflicts with an input's shape, an unknown or non-integer
    symbol) uses up the sizes the inputs bound, as a compute that ran does: the next set_input may bind another size.
    (They used to stay, and every set_input of another size was refused until a compute of the old size ran.)"""
    n = gp.sym("n", 10)
    a = gp.input((2, n), name="a")
    y = ops.sum_rows(a)
    plan = gp.prepare(y, backends="numpy")
    for refused, match in (({"n": 4}, "conflicts"), ({"m": 1}, "unknown symbol"), ({"n": "3"}, "integer")):
        plan.set_input("a", np.ones((2, 3), np.float32))
        with pytest.raises(PlanError, match=match):
            plan.compute(**refused)
        plan.set_input("a", np.ones((2, 5), np.float32))
        plan.compute()
        np.testing.assert_array_equal(plan.get_output(y), np.full((2, 1), 5, np.float32))
    plan.set_input("a", np.ones((2, 3), np.float32))
    with pytest.raises(PlanError, match="conflicts"):
        plan.compute(n=4)
    with pytest.raises(PlanError, match="must be bound"):  # nothing bound is left over
        plan.compute()


def test_set_input_errors():
    x = gp.input((4, 8), name="x")
    i = gp.input((3,), "I32", name="i")
    plan = gp.prepare([ops.silu(x), ops.get_rows(gp.weight(np.ones((5, 8), np.float32)), i)], backends="numpy")
    with pytest.raises(PlanError, match=r"expected shape \[4, 8\].*got \[4, 9\]"):
        plan.set_input("x", np.zeros((4, 9), np.float32))
    with pytest.raises(PlanError, match="expected integer"):
        plan.set_input("i", np.zeros(3, np.float32))
    with pytest.raises(PlanError, match="no tensor named 'nope'.*inputs: x, i|inputs: i, x"):
        plan.set_input("nope", np.zeros(3))


@pytest.mark.parametrize("backend", expected_backends())
def test_input_and_output_arrays_are_the_plans_memory(backend):
    """Plan.input_array: an array over an input's memory; writing it then computing equals set_input + compute, for
    a concrete input and a symbolic one (given its symbol), across compute calls. Plan.output_array: a read-only
    array over an output's memory, holding each compute's values. Refusals are PlanError."""
    n = gp.sym("n", 6)
    x = gp.input((3,), "I32", name="x")
    m = gp.input((n,), name="m")
    table = gp.weight(np.arange(40, dtype=np.float32).reshape(10, 4))
    y = ops.get_rows(table, x)
    z = ops.scale(m, 2.0)
    plan = gp.prepare([y, z], backends=backend)
    xs = plan.input_array("x")
    assert xs.dtype == np.int32 and xs.shape == (3,)
    ms = plan.input_array(m, n=6)
    assert ms.shape == (6,)
    ms[...] = np.arange(6)  # once, at the bound: every n reads its first n values
    ys = plan.output_array(y)
    assert not ys.flags.writeable
    for ids, k in (([1, 2, 9], 4), ([0, 0, 5], 6)):
        xs[...] = ids
        plan.compute(n=k)
        np.testing.assert_array_equal(plan.get_output(y), np.arange(40).reshape(10, 4)[ids])
        np.testing.assert_array_equal(ys, np.arange(40).reshape(10, 4)[ids])
        np.testing.assert_array_equal(plan.get_output(z), 2 * np.arange(k))
    with pytest.raises(PlanError, match="not an output of a concrete shape"):
        plan.output_array(z)
    with pytest.raises(PlanError, match="symbolic shape: give \\['n'\\]"):
        plan.input_array(m)
    with pytest.raises(PlanError, match="outside 1..6"):
        plan.input_array(m, n=7)
    with pytest.raises(PlanError, match="not an input"):
        plan.input_array(y)
    plan.close()
    with pytest.raises(PlanError, match="closed plan"):
        plan.input_array("x")


def test_unknown_backend_and_unsupported_op():
    x = gp.input((4,), name="x")
    with pytest.raises(BackendError, match="unknown backend 'nosuch'; available: .*numpy"):
        gp.prepare(ops.silu(x), backends=["nosuch"])

    numpy_backend = gp.get_backend("numpy")

    class OnlyAdd(type(numpy_backend)):
        name = "onlyadd"

        def supports_op(self, node):
            return node.op == "ADD"

    b = OnlyAdd(numpy_backend.device)
    with pytest.raises(PlanError, match="no backend supports SILU"):
        gp.prepare(ops.silu(x), backends=[b])
    # with numpy as fallback, the scheduler splits
    y = ops.add(ops.silu(ops.add(x, x)), x)
    plan = gp.prepare(y, backends=[b, numpy_backend])
    assert [a["backend"] for a in plan.assignment()] == ["onlyadd", "numpy", "onlyadd"]
    assert plan.stats()["splits"] == 3
    plan.set_input("x", np.arange(4, dtype=np.float32))
    plan.compute()
    xv = np.arange(4, dtype=np.float32)
    np.testing.assert_allclose(plan.get_output(y), 2 * xv / (1 + np.exp(-2 * xv)) + xv, rtol=1e-6)


def test_copies_across_buffer_types():
    """A backend that cannot read the other's buffers gets its split inputs copied."""
    numpy_backend = gp.get_backend("numpy")
    base = type(numpy_backend)

    class PrivateBT(type(numpy_backend.default_buffer_type)):
        name = "private"

    class Private(base):
        name = "private"

        def __init__(self, dev):
            super().__init__(dev)
            self.default_buffer_type = PrivateBT()

        def supports_op(self, node):
            return node.op == "MUL"

        def supports_buffer_type(self, bt):
            return bt is self.default_buffer_type

    p = Private(numpy_backend.device)
    x = gp.input((6,), name="x")
    y = ops.exp(ops.mul(ops.neg(x), x))
    plan = gp.prepare(y, backends=[p, numpy_backend])
    assert plan.stats()["copies"] >= 1
    xv = np.linspace(-1, 1, 6, dtype=np.float32)
    plan.set_input("x", xv)
    plan.compute()
    np.testing.assert_allclose(plan.get_output(y), np.exp(-xv * xv), rtol=1e-6)


# -- registry ------------------------------------------------------------------------------------------------
def test_broken_plugin_is_recorded_not_fatal(caplog):
    class Boom(Exception):
        pass

    def loader() -> BackendRegistration:
        raise Boom("no device here")

    gp.registry.register("broken", loader)
    try:
        with caplog.at_level(logging.WARNING, logger="ggml_py.runtime.registry"):
            rows = {i.name: i.describe() for i in gp.registry.infos()}
        assert rows["broken"]["status"].startswith("error: Boom: no device here")
        assert any("broken" in r.message for r in caplog.records)
        assert "broken" not in gp.registry.default_names()
        with pytest.raises(Boom, match="no device here"):
            gp.get_backend("broken")
    finally:
        gp.registry.unregister("broken")


def test_env_selects_and_orders(monkeypatch):
    monkeypatch.setenv("GGML_PY_BACKENDS", "numpy")
    assert gp.registry.default_names() == ["numpy"]
    x = gp.input((2,), name="x")
    plan = gp.prepare(ops.neg(x))
    assert plan.stats()["backends"] == ["numpy"]


@pytest.mark.parametrize("name", ["numpy", "simd"])
def test_builtin_backend_is_registered_through_its_entry_point(name):
    """No fallback registers the built-ins in process (issue 15): a broken entry point fails here."""
    if name not in expected_backends():
        pytest.skip(f"{name} {DECLARED}")
    info = {i.name: i for i in gp.registry.infos()}[name]
    assert info.source.startswith(f"entry point ggml_py_{name}:register (ggml_py "), info.source
    reg = info.load()
    assert reg.name == name and reg.create().name == name


def test_the_suite_runs_against_the_installed_package():
    """ggml_py and the built-in backends come from site-packages, in this process and in a subprocess (as the CLI
    tests run), never from the checkout (conftest's session guard stops the run before; this shows it)."""
    import subprocess
    import sys

    assert not installed_check()
    site = {sysconfig.get_path("purelib"), sysconfig.get_path("platlib")}
    assert any(gp.__file__.startswith(s) for s in site), gp.__file__
    code = "import ggml_py, ggml_py_numpy, ggml_py_simd; print(ggml_py.__file__); print(ggml_py_simd.__file__)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert all(any(p.startswith(s) for s in site) for p in out), (out, site)


def test_core_imports_no_backend():
    import subprocess
    import sys

    code = ("import sys, ggml_py, ggml_py.runtime.plan, ggml_py.commands.cli; "
            "print(any(m.startswith('ggml_py_') for m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"


def test_bench_reuse_runs_and_agrees():
    from ggml_py.commands import bench_reuse as reuse

    r = reuse.run(steps=2, n_layers=2)
    assert r["identical_results"] and r["nodes"] > 40
    assert r["reuse_ms_per_compute"] > 0 and r["rebuild_ms_per_compute"] > 0


def test_gc_paused_while_preparing_and_restored() -> None:
    """Plans are prepared (and models loaded) with the cyclic collector paused, and it is back on afterwards, also
    after an error, nested, and left off when the caller had turned it off."""
    import gc

    from ggml_py.gcpause import gc_paused

    seen = []
    with gc_paused():
        seen.append(gc.isenabled())
        with gc_paused():
            seen.append(gc.isenabled())
        seen.append(gc.isenabled())
    assert seen == [False, False, False] and gc.isenabled()
    with pytest.raises(BackendError, match="no backends selected"):
        gp.prepare(ops.silu(gp.input((4,))), backends=[])
    assert gc.isenabled()
    gc.disable()
    try:
        gp.prepare(ops.silu(gp.input((4,))), backends=["numpy"])
        assert not gc.isenabled()
    finally:
        gc.enable()
