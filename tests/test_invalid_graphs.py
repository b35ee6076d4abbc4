"""Property-based: random graphs with random (also invalid) shapes, strides, views and offsets.

Every invalid construction must be rejected by a typed error when the op is created (before any backend runs);
every valid graph must give the same values on every installed backend as on the numpy reference.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

import ggml_py as gp
from ggml_py.errors import GgmlPyError, ShapeError
from ggml_py.ir import ops

from conftest import available_backends

BACKENDS = [b for b in available_backends() if b != "numpy"]

dims = st.integers(min_value=1, max_value=6)
shapes = st.lists(dims, min_size=1, max_size=4).map(tuple)

UNARY = [ops.neg, ops.exp, ops.silu, ops.gelu, ops.tanh, ops.sigmoid, ops.relu, ops.sqr, ops.abs,
         lambda a: ops.rms_norm(a, 1e-5), lambda a: ops.norm(a, 1e-5), lambda a: ops.soft_max(a, None, 0.7),
         lambda a: ops.scale(a, 0.5, 0.25), ops.cont, ops.sum_rows]
BINARY = [ops.add, ops.sub, ops.mul]


@st.composite
def graphs(draw):
    """(builder, description): the builder raises a typed error for invalid choices."""
    steps = draw(st.lists(st.tuples(st.integers(0, 4), st.integers(0, 100), shapes, st.lists(st.integers(0, 400),
                                                                                           min_size=5, max_size=5)),
                          min_size=1, max_size=6))
    base_shape = draw(shapes)
    return base_shape, steps


def build(base_shape, steps):
    x = gp.input(base_shape, name="x")
    y = gp.input(base_shape, name="y")
    cur = x
    for i, (kind, pick, shape, nums) in enumerate(steps):
        if kind == 0:
            cur = UNARY[pick % len(UNARY)](cur)
        elif kind == 1:  # a fresh input per step: the test feeds inputs by name
            cur = BINARY[pick % len(BINARY)](cur, y if pick % 2 else gp.input(shape, name=f"b{i}"))
        elif kind == 2:  # a raw view: random shape, strides and offset, possibly out of bounds
            strides = [4 * (n % 40) for n in nums[: len(shape)]]
            cur = ops.view(cur, shape, strides=strides, offset=4 * (nums[-1] % 50))
        elif kind == 3:
            axes = [n % max(cur.ndim, 1) for n in nums[: cur.ndim]]
            cur = ops.permute(cur, axes)
        else:
            cur = ops.reshape(cur, shape)
    return cur


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(graphs(), st.integers(0, 2**31 - 1))
# two added inputs of different shapes, once both named "b0_2" by the builder (fed the wrong array)
@example(g=((1, 2), [(1, 0, (1, 1), [0] * 5), (1, 0, (1, 2), [0] * 5)]), seed=0)
def test_random_graphs(g, seed):
    base_shape, steps = g
    try:
        out = build(base_shape, steps)
    except ShapeError:
        return  # rejected at creation, with the typed error
    out = ops.cont(out) if out.op in ("VIEW", "PERMUTE", "RESHAPE", "TRANSPOSE") or out.is_leaf else out
    rng = np.random.default_rng(seed)
    graph = gp.Graph(out)
    values = {t.name: rng.standard_normal([int(d) for d in t.shape]).astype(np.float32) for t in graph.inputs}

    def run(backend):
        plan = gp.prepare(graph, backends=[backend, "numpy"])
        for k, v in values.items():
            plan.set_input(k, v)
        plan.compute()
        return plan.get_output(out)

    ref = run("numpy")
    for b in BACKENDS:
        got = run(b)
        assert np.array_equal(np.isnan(got), np.isnan(ref)), b
        fin = np.isfinite(ref)
        # NMSE, with a floor under the reference's energy: a result that cancels to ~0 (norm then sum_rows) is
        # judged by its absolute error (1e-6 per element), not relative to float rounding noise
        err = float(np.sum((got[fin] - ref[fin]) ** 2)) / max(float(np.sum(ref[fin] ** 2)), 1e-6 * ref.size)
        assert err < 1e-6, (b, err, steps)


@pytest.mark.parametrize("make", [
    lambda x: ops.view(x, (4, 4), strides=(64, 4), offset=0),
    lambda x: ops.view(x, (2,), offset=-4),
    lambda x: ops.permute(x, (0, 0)),
    lambda x: ops.reshape(x, (3, 3)),
    lambda x: ops.mul_mat(x, gp.input((3, 5))),
    lambda x: ops.concat(x, gp.input((3,)), 0),
    lambda x: ops.get_rows(x, gp.input((2,), "F32")),
])
def test_invalid_is_typed(make):
    x = gp.input((4, 4), name="x")
    with pytest.raises(GgmlPyError):
        make(x)
