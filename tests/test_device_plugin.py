"""The device example (examples/device-backend/devexample.c): the path a GPU plugin takes, through ABI 2.2.

Its memory is behind handles the host cannot dereference, stored scrambled; data crosses only through the plugin's
copy functions; work runs on a queue per backend (a worker thread) with events; it drives two devices. SmolLM2 split
between it (ADD, MUL) and simd must give simd's tokens, with every copy counted on both sides of the ABI and a
copy to the device overlapping simd's compute in the profile."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from test_native_plugin import CC, ROOT, build

import ggml_py as gp
from ggml_py import counters, ops
from ggml_py.errors import BackendError
from ggml_py.runtime.registry import get_backend, parse_backend_options, register_library, registry

DEVEXAMPLE = ROOT / "examples" / "device-backend" / "devexample.c"
PROMPT = "The three primary colors are"

pytestmark = pytest.mark.skipif(CC is None, reason="no C compiler")


@pytest.fixture(scope="module")
def devlib(tmp_path_factory: pytest.TempPathFactory) -> Path:
    lib = build(DEVEXAMPLE, tmp_path_factory.mktemp("dev") / "libggml_py_devexample.so", "-pthread")
    register_library(lib)
    yield lib
    registry.unregister("devexample")


def stat(lib: Path, k: int) -> int:
    import cffi

    f = cffi.FFI()
    f.cdef("long devexample_stat(int k);")
    return int(f.dlopen(str(lib)).devexample_stat(k))


def delta(before: dict[str, int], lib: Path, plugin0: list[int]) -> dict[str, int]:
    now = counters.snapshot()
    d = {k: now.get(k, 0) - before.get(k, 0) for k in ("abi_set_tensor", "abi_get_tensor", "abi_buffer_copy",
                                                           "abi_set_tensor_async")}
    d.update({f"plugin_{k}": stat(lib, i) - plugin0[i] for i, k in enumerate(
        ("set", "get", "copy", "set_async", "queued_computes", "direct_computes"))})
    return d


def test_memory_is_behind_handles(devlib: Path) -> None:
    be = get_backend("devexample:d0")
    bt = be.default_buffer_type
    assert be.is_async and not bt.is_host and bt.name == "devexample_mem:d0"
    assert be.device.caps["host_threads"] == 1 and be.device.caps["async"]
    buf = bt.alloc_buffer(100)
    assert buf.base >= 0xDEC0000000000000  # non-canonical: the host would fault dereferencing it
    with pytest.raises(NotImplementedError):
        buf.host_view()
    data = np.arange(100, dtype=np.uint8)
    buf.set_tensor(0, data)
    assert buf.get_tensor(0, 100).tolist() == data.tolist()
    buf.memset(10, 255, 5)
    assert buf.get_tensor(8, 8).tolist() == [8, 9, 255, 255, 255, 255, 255, 15]
    assert {d.name for d in registry.registration("devexample").devices()} == {"d0", "d1"}


def test_two_devices_copy_without_the_host(devlib: Path, rng: np.random.Generator) -> None:
    """ADD on d0, MUL on d1: the sum moves from d0's memory to d1's through buffer_copy, never through the host."""
    d0 = registry.registration("devexample").create("d0")
    d1 = get_backend("devexample:d1")
    only_add = d0.supports_op
    d0.supports_op = lambda n: n.op == "ADD" and only_add(n)  # type: ignore[method-assign]
    a, b, c = (gp.input((3, 16), name=x) for x in "abc")
    y = ops.mul(ops.add(a, b), c)
    plan = gp.prepare(y, backends=[d0, d1])
    assert [x["backend"] for x in plan.assignment()] == ["devexample:d0", "devexample:d1"]
    vals = {x: rng.standard_normal((3, 16)).astype(np.float32) for x in "abc"}
    for k, v in vals.items():
        plan.set_input(k, v)
    before, plugin0 = counters.snapshot(), [stat(devlib, i) for i in range(8)]
    plan.compute()
    d = delta(before, devlib, plugin0)
    assert d["abi_buffer_copy"] == d["plugin_copy"] == 1 and d["plugin_get"] == 0
    np.testing.assert_array_equal(plan.get_output(y), (vals["a"] + vals["b"]) * vals["c"])


def test_kit_passes_on_device_memory(devlib: Path) -> None:
    from ggml_py.testing import run_backend

    for name in ("devexample:d0", "devexample:d1"):
        rep = run_backend(get_backend(name))
        assert rep.failed == 0, rep.table(show=("failed",))
        assert {r.op for r in rep.results if r.status == "passed"} == {"ADD", "MUL"}


def _tokens(backends: Any, **kw: Any) -> tuple[list[int], Any]:
    m = gp.load_model(backends=backends, progress=False, **kw)
    return [t.id for t in m.generate(PROMPT, max_tokens=16, temperature=0)], m


def test_smollm2_with_simd_gives_simds_tokens(devlib: Path) -> None:
    """Every ADD and MUL of SmolLM2 on the device (memory the host cannot read), the rest on simd: simd's tokens,
    queued and direct alike; every copy through the ABI counted by ggml_py and by the plugin."""
    ref, _ = _tokens(["simd"])
    before, plugin0 = counters.snapshot(), [stat(devlib, i) for i in range(8)]
    toks, m = _tokens(["devexample", "simd"])
    d = delta(before, devlib, plugin0)
    assert toks == ref
    plan = next(iter(m._plans.values())).plan
    ops_on = {(x["backend"], x["op"]) for x in plan.assignment()}
    assert {("devexample:d0", "ADD"), ("devexample:d0", "MUL")} <= ops_on
    assert not {op for b, op in ops_on if b == "simd"} & {"ADD", "MUL"}
    # the thread budget: the device's worker keeps one of the CPUs busy, simd gets the rest
    cpus = len(os.sched_getaffinity(0))
    assert m.backends[1].n_threads == max(1, cpus - 1)
    # the weights of its nodes (2 norms a layer and the output norm) copied in once, at load, through set_tensor
    assert d["abi_set_tensor"] == d["plugin_set"] == 2 * m.hparams.n_layer + 1
    # every split input crossed the ABI once per compute: host to device on the queue, device to host with
    # get_tensor; every device split was enqueued
    to_dev = from_dev = splits = 0
    for p in (p.plan for p in m._plans.values()):
        n = p.stats()["computes"]
        for run in p.runs:
            to_dev += n * sum(c.dst[0].buffer_type.name == "devexample_mem:d0" for c in run.copies)
            from_dev += n * sum(c.src[0].buffer_type.name == "devexample_mem:d0" for c in run.copies)
            splits += n * (run.split.backend.name == "devexample:d0")
    assert d["abi_set_tensor_async"] == d["plugin_set_async"] == to_dev > 0
    assert d["abi_get_tensor"] == d["plugin_get"] == from_dev > 0
    assert d["plugin_queued_computes"] == splits and d["plugin_direct_computes"] == 0
    print("copies through the ABI:", json.dumps(d))
    assert _tokens(["devexample", "simd"], backend_options={"devexample": {"async": "0"}})[0] == ref


def test_copy_overlaps_simd_compute_in_the_profile(devlib: Path) -> None:
    """A slow bus (slow_copy_us) makes each copy to the device last 1 ms: the copy of layer 0's residual, enqueued
    before simd's attention split, runs on the device's queue while simd computes. The profile's timeline is the last
    compute's, and under a loaded test run the queue's thread may only get a CPU once simd's split is over: up to three
    prompts, the first whose timeline shows the overlap (one did in every run alone)."""
    m = gp.load_model(backends=["devexample", "simd"], progress=False,
                      backend_options={"devexample": {"slow_copy_us": "1000"}})
    m.start_profiling()
    for _ in range(3):
        m.reset()
        m.eval(m.tokenize(PROMPT * 4))
        reps = m.profile_report()  # a plan per prompt batch size
        ov = [o for r in reps for o in r["overlaps"]]
        if ov:
            break
    assert ov and all(o["to"] == "devexample:d0" and o["on"] == "simd" and o["seconds"] > 0 for o in ov), ov
    assert all(any(e["what"].startswith("copy") and e["backend"] == "devexample:d0" for e in r["timeline"])
               for r in reps)


def test_generate_profile_shows_the_overlap(devlib: Path) -> None:
    env = {**os.environ, "GGML_PY_BACKEND_PATH": str(devlib)}
    r = subprocess.run([sys.executable, "-m", "ggml_py", "generate", "-p", PROMPT * 4, "-n", "2", "--temp", "0",
                        "--backend", "devexample,simd", "--backend-opt", "devexample:slow_copy_us=1000", "--profile"],
                       capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stderr
    assert "copy/compute overlaps in the last compute: " in r.stderr
    assert any(line.strip().startswith("copy/compute overlaps") and "during split" in line and "on simd" in line
               for line in r.stderr.splitlines()), r.stderr


def test_backend_options(devlib: Path) -> None:
    assert parse_backend_options(["devexample:async=0", "simd:level=avx2", "devexample:d1:slow_copy_us=5"]) == {
        "devexample": {"async": "0"}, "simd": {"level": "avx2"}, "devexample:d1": {"slow_copy_us": "5"}}
    for bad in ("devexample", "devexample:async", ":a=1"):
        with pytest.raises(BackendError, match="is not NAME:KEY=VALUE"):
            parse_backend_options([bad])
    with pytest.raises(BackendError, match="init.*returned NULL"):
        gp.prepare(ops.add(gp.input((4,)), gp.input((4,))), backends=["devexample"],
                   backend_options={"devexample": {"colour": "blue"}})
    with pytest.raises(BackendError, match="n_threads must be an integer, got 'two'"):
        gp.prepare(ops.add(gp.input((4,)), gp.input((4,))), backends=["numpy"],
                   backend_options={"numpy": {"n_threads": "two"}})
    with pytest.raises(BackendError, match="options for backend.*numpy, which are not selected"):
        gp.prepare(ops.add(gp.input((4,)), gp.input((4,))), backends=["devexample"],
                   backend_options={"numpy": {"n_threads": 1}})
    env = {**os.environ, "GGML_PY_BACKEND_PATH": str(devlib)}
    r = subprocess.run([sys.executable, "-m", "ggml_py", "generate", "-p", "Hi", "-n", "1", "--backend",
                        "devexample,simd", "--backend-opt", "devexample:colour=blue"], capture_output=True, text=True,
                       env=env, timeout=300)
    assert r.returncode != 0 and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert "options='colour=blue'" in r.stderr


def test_python_backend_blas_pool_held_to_its_threads() -> None:
    """A Python backend's BLAS pool runs with the backend's n_threads while it computes (the thread budget)."""
    from threadpoolctl import threadpool_info

    seen: list[int] = []
    be = registry.registration("numpy").create(n_threads=1)
    step = type(be).graph_plan_create

    def spy(self: Any, split: Any) -> Any:
        plan = step(self, split)
        plan.steps[0] = (lambda f: lambda b: (seen.append(max(i["num_threads"] for i in threadpool_info()
                                                               if i["user_api"] == "blas")), f(b)))(plan.steps[0])
        return plan

    be.graph_plan_create = spy.__get__(be)  # type: ignore[method-assign]
    x = gp.input((8, 8), name="x")
    plan = gp.prepare(ops.mul_mat(x, x), backends=[be])
    plan.set_input("x", np.eye(8, dtype=np.float32))
    plan.compute()
    assert seen == [1]


def _patched(tmp_path: Path, name: str, old: str, new: str) -> Path:
    src = DEVEXAMPLE.read_text()
    assert old in src
    path = tmp_path / f"{name}.c"
    path.write_text(src.replace(old, new).replace('.name = "devexample"', f'.name = "{name}"'))
    return build(path, tmp_path / f"lib{name}.so", "-pthread", "-Wno-unused-function")


def test_async_functions_all_or_none(tmp_path: Path) -> None:
    from ggml_py.runtime import native

    lib = _patched(tmp_path, "devhalf", "    .event_record = event_record,\n", "    .event_record = NULL,\n")
    with pytest.raises(BackendError, match="asynchronous execution needs all of .*only graph_compute_async"):
        native.load(lib)


def test_error_in_queued_work_names_the_plugin(tmp_path: Path) -> None:
    """A queued compute that fails is reported by the next event: one BackendError with the plugin's message."""
    from ggml_py.runtime import native

    lib = _patched(tmp_path, "devfail", "        binary_f32(in->op, &vd, &va, &vb);\n",
                   '        snprintf(err->message, sizeof(err->message), "devfail: injected in %s", in->dst->name);\n'
                   "        err->node = i;\n        return GGML_PY_ERR_FAILED;\n")
    be = native.backend(lib)
    a = gp.input((4,), name="a")
    y = ops.silu(ops.add(a, a).set_name("the_add"))
    plan = gp.prepare(y, backends=[be, "numpy"])
    plan.set_input("a", np.ones(4, np.float32))
    with pytest.raises(BackendError, match=r"native backend 'devfail' .* failed in queued work: devfail: injected in "
                                           r"the_add \(status 1 FAILED\)"):
        plan.compute()
    plan.set_input("a", np.ones(4, np.float32))  # reported once: the plan stays usable, and fails the same way again
    with pytest.raises(BackendError, match="injected"):
        plan.compute()
