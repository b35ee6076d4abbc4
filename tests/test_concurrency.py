"""Plans computed from several threads: different plans on one backend run concurrently and stay correct; one plan
computed from two threads is serialised by the plan's lock (docs/architecture.md)."""

from __future__ import annotations

import threading

import numpy as np
import pytest

import ggml_py as gp
from ggml_py import ops

from conftest import available_backends

BACKENDS = available_backends()


def _plan(backend: str, scale: float):
    x = gp.input((64, 256), name="x")
    w = gp.weight((np.arange(256 * 128, dtype=np.float32).reshape(128, 256) % 7 - 3) / 10, name="w")
    y = ops.silu(ops.scale(ops.mul_mat(w, x), scale)).set_name("y")
    return gp.prepare(y, backends=[backend]), w.data


def _expected(xv, w, scale):
    h = (xv @ w.T) * np.float32(scale)
    return h / (1 + np.exp(-h))


@pytest.mark.parametrize("backend", BACKENDS)
def test_two_plans_two_threads(backend):
    rng = np.random.default_rng(0)
    plans = [_plan(backend, s) for s in (0.5, 2.0)]
    inputs = [rng.standard_normal((64, 256)).astype(np.float32) for _ in plans]
    errors: list[BaseException] = []

    def work(i: int) -> None:
        try:
            plan, w = plans[i]
            plan.set_input("x", inputs[i])
            want = _expected(inputs[i], w, (0.5, 2.0)[i])
            for _ in range(30):
                plan.compute()
                np.testing.assert_allclose(plan.get_output("y"), want, rtol=1e-3, atol=1e-3)
        except BaseException as e:  # reported from the main thread
            errors.append(e)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors


@pytest.mark.parametrize("backend", BACKENDS)
def test_same_plan_two_threads_is_serialised(backend):
    plan, w = _plan(backend, 1.0)
    xv = np.random.default_rng(1).standard_normal((64, 256)).astype(np.float32)
    plan.set_input("x", xv)
    errors: list[BaseException] = []

    def work() -> None:
        try:
            for _ in range(30):
                plan.compute()
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=work) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    assert plan.stats()["computes"] == 60
    np.testing.assert_allclose(plan.get_output("y"), _expected(xv, w, 1.0), rtol=1e-3, atol=1e-3)
