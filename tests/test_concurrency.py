"""Plans computed from several threads: different plans on one backend run concurrently and stay correct; one plan
computed from two threads is serialised by the plan's lock (docs/architecture.md)."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

import ggml_py as gp
from ggml_py.ir import ops

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
def test_entry_recorder_sees_two_plans_overlap(backend, monkeypatch):
    """The recorder of the test below can see an overlap: two plans on one backend do run at once."""
    plans = [_plan(backend, s)[0] for s in (0.5, 2.0)]
    for p in plans:
        p.set_input("x", np.ones((64, 256), np.float32))
    rec = _record_entries(plans[0], monkeypatch)
    barrier = threading.Barrier(2)

    def work(p) -> None:
        barrier.wait()
        for _ in range(10):
            p.compute()

    threads = [threading.Thread(target=work, args=(p,)) for p in plans]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert rec.calls == 20 and rec.max_inside == 2


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


class EntryRecorder:
    """Wraps a backend's graph_plan_compute (the call that runs the kernels): counts the calls inside at once and
    keeps the largest count. Each call sleeps inside (the GIL is released), so two unserialised computes overlap."""

    def __init__(self, inner, hold_s: float = 0.002) -> None:
        self.inner, self.hold_s = inner, hold_s
        self.lock = threading.Lock()
        self.inside = self.max_inside = self.calls = 0

    def __call__(self, *args, **kwargs):
        with self.lock:
            self.inside += 1
            self.calls += 1
            self.max_inside = max(self.max_inside, self.inside)
        try:
            time.sleep(self.hold_s)
            return self.inner(*args, **kwargs)
        finally:
            with self.lock:
                self.inside -= 1


def _record_entries(plan, monkeypatch) -> EntryRecorder:
    (be,) = {id(r.split.backend): r.split.backend for r in plan.runs}.values()
    rec = EntryRecorder(be.graph_plan_compute)
    monkeypatch.setattr(be, "graph_plan_compute", rec)
    return rec


@pytest.mark.parametrize("backend", BACKENDS)
def test_same_plan_two_threads_is_serialised(backend, monkeypatch):
    plan, w = _plan(backend, 1.0)
    xv = np.random.default_rng(1).standard_normal((64, 256)).astype(np.float32)
    plan.set_input("x", xv)
    rec = _record_entries(plan, monkeypatch)
    errors: list[BaseException] = []
    barrier = threading.Barrier(2)

    def work() -> None:
        try:
            barrier.wait()
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
    assert plan.stats()["computes"] == 60 and rec.calls == 60
    assert rec.max_inside == 1, f"{rec.max_inside} computes of one plan ran the backend at once"
    np.testing.assert_allclose(plan.get_output("y"), _expected(xv, w, 1.0), rtol=1e-3, atol=1e-3)


# -- issue 11, row 8: get_output never mixes two computes ------------------------------------------------------------
def racing_computes(plan, inputs, expected, n_threads: int, iters: int) -> tuple[int, int]:
    """n_threads threads each loop set_input(own x) -> compute() -> get_output(): every output must be the whole
    result of *some* compute (any thread's input may have won the race for the input, never half of two).
    Returns (outputs read, torn outputs)."""
    torn = [0] * n_threads
    errors: list[BaseException] = []
    barrier = threading.Barrier(n_threads)

    def work(i: int) -> None:
        try:
            barrier.wait()
            for _ in range(iters):
                plan.set_input("x", inputs[i])
                plan.compute()
                out = plan.get_output("y")
                if not any(np.allclose(out, e, rtol=1e-3, atol=1e-3) for e in expected):
                    torn[i] += 1
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(n_threads)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    return n_threads * iters, sum(torn)


@pytest.mark.parametrize("backend", BACKENDS)
def test_eight_threads_never_see_a_torn_output(backend):
    plan, w = _plan(backend, 1.0)
    # constant inputs per thread: any mix of two computes' rows matches none of the expected outputs
    inputs = [np.full((64, 256), (i + 1) / 8, np.float32) for i in range(8)]
    expected = [_expected(x, w, 1.0) for x in inputs]
    n, torn = racing_computes(plan, inputs, expected, 8, 25)
    assert torn == 0, f"{torn} of {n} outputs were torn"


# -- issue 11, rows 7 and 10: one Model shared by threads, overtaken iterators, close -------------------------------
@pytest.fixture(scope="module")
def shared_model(tmp_path_factory):
    from model_factory import write_tiny_llama

    p = tmp_path_factory.mktemp("shared") / "tiny.gguf"
    write_tiny_llama(p, seed=7)
    return str(p)


def _load(path):
    return gp.load_model(path, backends="simd" if "simd" in BACKENDS else "numpy", progress=False)


def _gen(m, prompt, n=12):
    return [t.id for t in m.generate(prompt, n, temperature=0, stop_at_eos=False)]


def test_interleaved_generate_iterators_in_one_thread(shared_model):
    from ggml_py.errors import ModelError

    with _load(shared_model) as m:
        want_a, want_b = _gen(m, [1, 2, 3]), _gen(m, [4, 5])
        it1 = m.generate([1, 2, 3], 12, temperature=0, stop_at_eos=False)
        first = next(it1).id
        assert first == want_a[0]
        assert _gen(m, [4, 5]) == want_b  # the second generation is right...
        with pytest.raises(ModelError, match="overtaken"):
            next(it1)  # ...and the first stops instead of continuing on the other's cache
        it2 = m.generate([1, 2, 3], 12, temperature=0, stop_at_eos=False)
        next(it2)
        m.eval([7, 8])  # eval and reset overtake too
        with pytest.raises(ModelError, match="overtaken"):
            next(it2)
        it3 = m.generate([1, 2, 3], 12, temperature=0, stop_at_eos=False)
        next(it3)
        m.reset()
        with pytest.raises(ModelError, match="overtaken"):
            next(it3)
        assert _gen(m, [1, 2, 3]) == want_a


def test_two_threads_generating_on_one_model(shared_model):
    """Calls are serialised; each generation either returns exactly the tokens it would alone or stops with
    ModelError('overtaken') -- never another error, never other tokens."""
    from ggml_py.errors import ModelError

    with _load(shared_model) as m:
        prompts = [[1, 2, 3], [9, 8, 7, 6]]
        want = [_gen(m, p) for p in prompts]
        results: list[tuple[int, object]] = []
        lock = threading.Lock()

        def work(i: int) -> None:
            for _ in range(6):
                try:
                    got: object = _gen(m, prompts[i])
                except ModelError as e:
                    got = e
                except BaseException as e:  # anything else is a failure
                    got = ("unexpected", e)
                with lock:
                    results.append((i, got))

        threads = [threading.Thread(target=work, args=(i,)) for i in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert len(results) == 12
        for i, got in results:
            if isinstance(got, ModelError):
                assert "overtaken" in str(got)
            else:
                assert got == want[i], got
        assert any(not isinstance(g, ModelError) for _, g in results)


def test_close_while_another_thread_generates(shared_model):
    from ggml_py.errors import ModelError

    m = _load(shared_model)
    started, stop = threading.Event(), []

    def work() -> None:
        try:
            for _ in m.generate([1, 2], 200, temperature=0, stop_at_eos=False):
                started.set()
                time.sleep(0.002)
        except BaseException as e:
            stop.append(e)
        finally:
            started.set()

    t = threading.Thread(target=work)
    t.start()
    assert started.wait(30)
    m.close()
    # close waits for a step in progress, which may prepare the decode plan (when the thread's next step had begun):
    # counted from here, nothing more may be prepared
    prepared = m.plans_prepared
    t.join(30)
    assert not t.is_alive()
    assert len(stop) == 1 and isinstance(stop[0], ModelError) and "closed" in str(stop[0])
    assert m.plans_prepared == prepared  # no plan was prepared after close
    for call in (lambda: m.eval([1]), lambda: m.generate([1], 1), lambda: m.tokenize("a"), m.reset):
        with pytest.raises(ModelError, match="closed"):
            call()
