"""What the runtime gives a Python backend whose graph_plan_create returns a NodePlan (ggml_py.runtime.backend): a
kernel's exception named by backend, op and node (the original as the cause), also as the CLI's one error line;
per-node time in Plan.profile and `ggml-py generate --profile`; Plan.cancel between two nodes. A backend with a plan
of its own still gets its errors named by backend and split."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import ggml_py as gp
from ggml_py import ops
from ggml_py.errors import BackendError
from ggml_py.ir.tensor import Tensor
from ggml_py.models import default_model_path
from ggml_py.runtime.backend import (
    Backend,
    Buffer,
    BufferType,
    ComputeCancelled,
    Device,
    HostBuffer,
    NodePlan,
    Split,
    aligned_host_array,
)


class _HostType(BufferType):
    name = "pyhost"

    def alloc_buffer(self, size: int) -> Buffer:
        return HostBuffer(self, aligned_host_array(size, self.alignment))


def _f32(split: Split, t: Tensor, bindings: Mapping[str, int]) -> np.ndarray:
    buf, _ = split.address(t)
    shape, strides, off = split.layout(t, bindings)
    return np.ndarray(shape, np.float32, buffer=buf.host_view(), offset=off, strides=strides)


class PyBackend(Backend):
    """ADD and MUL on F32; MUL raises when `fail` is set; every node sleeps `delay` seconds; `own_plan` lowers to a
    plain list (no NodePlan) to show what a backend without one gets."""

    name = "pyback"

    def __init__(self, fail: bool = False, delay: float = 0.0, own_plan: bool = False) -> None:
        self.device = Device("cpu", "test backend", n_threads=1, score=10)
        self.default_buffer_type = _HostType()
        self.fail, self.delay, self.own_plan = fail, delay, own_plan

    def supports_op(self, node: Tensor) -> bool:
        return node.op in ("ADD", "MUL") and node.dtype.name == "F32"

    def _step(self, split: Split, node: Tensor) -> Any:
        def run(bindings: Mapping[str, int]) -> None:
            time.sleep(self.delay)
            a, b = (_f32(split, s, bindings) for s in node.src[:2])
            if node.op == "MUL" and self.fail:
                a = a[..., :-1]  # a kernel bug: numpy raises "operands could not be broadcast together"
            _f32(split, node, bindings)[...] = a + b if node.op == "ADD" else a * b

        return run

    def graph_plan_create(self, split: Split) -> Any:
        steps = [self._step(split, n) for n in split.nodes]
        return steps if self.own_plan else NodePlan(split.nodes, steps)

    def graph_plan_compute(self, plan: Any, bindings: Mapping[str, int]) -> None:
        if self.own_plan:
            for step in plan:
                step(bindings)
        else:
            super().graph_plan_compute(plan, bindings)


def _graph() -> tuple[Tensor, Tensor, Tensor]:
    x = gp.input((3, 4), name="x")
    y = gp.input((3, 4), name="y")
    h = ops.add(x, y).set_name("h")
    out = ops.mul(h, y).set_name("prod")
    out = ops.add(out, x).set_name("out").set_output()
    return x, y, out


def _run(backend: PyBackend) -> Any:
    x, y, out = _graph()
    plan = gp.prepare(out, backends=[backend, "numpy"])
    plan.set_input(x, np.ones((3, 4), np.float32))
    plan.set_input(y, np.full((3, 4), 2.0, np.float32))
    return plan


def test_a_kernel_exception_names_backend_op_and_node():
    plan = _run(PyBackend(fail=True))
    with pytest.raises(BackendError) as info:
        plan.compute()
    msg = str(info.value)
    assert "backend 'pyback' failed in MUL (node 'prod', 2 of 3)" in msg, msg
    assert "ValueError: operands could not be broadcast" in msg
    assert isinstance(info.value.__cause__, ValueError)  # the original kept
    plan.close()


def test_a_backend_with_a_plan_of_its_own_gets_its_split_named():
    plan = _run(PyBackend(fail=True, own_plan=True))
    with pytest.raises(BackendError, match=r"backend 'pyback' failed in a split of 3 nodes \(ADD, MUL\): ValueError"):
        plan.compute()
    plan.close()


def test_the_right_result_and_per_node_time_in_the_profile():
    plan = _run(PyBackend(delay=0.002))
    rep = plan.profile(computes=3)
    np.testing.assert_array_equal(plan.get_output("out"), np.full((3, 4), 7.0, np.float32))  # (1 + 2) * 2 + 1
    assert rep["computes"] == 3
    ops_time = rep["by_backend_op"]["pyback"]
    assert set(ops_time) == {"ADD", "MUL"}
    assert ops_time["ADD"] >= 2 * 0.002 and ops_time["MUL"] >= 0.002  # two ADD nodes, one MUL, per compute
    assert rep["seconds_per_compute"] >= sum(rep["by_backend"].values()) >= 3 * 0.002
    # profiling is off again: nothing accumulates
    plan.compute()
    assert plan.backends[0].graph_plan_node_seconds(plan.runs[0].plan) is None
    plan.close()


def test_cancel_stops_a_compute_between_two_nodes():
    plan = _run(PyBackend(delay=0.3))
    assert plan.cancel() is False  # nothing running: nothing to cancel, and no later compute is affected
    errors: list[BaseException] = []

    def compute() -> None:
        try:
            plan.compute()
        except BaseException as e:  # noqa: BLE001 - the test inspects it
            errors.append(e)

    th = threading.Thread(target=compute)
    t0 = time.perf_counter()
    th.start()
    time.sleep(0.1)
    assert plan.cancel() is True
    th.join()
    assert len(errors) == 1 and isinstance(errors[0], ComputeCancelled), errors
    assert time.perf_counter() - t0 < 0.85  # stopped after the first node, not after all three (0.9 s)
    plan.compute()  # the plan stays usable
    np.testing.assert_array_equal(plan.get_output("out"), np.full((3, 4), 7.0, np.float32))
    plan.close()


def test_generate_prints_one_error_line_naming_backend_op_and_node():
    # the CLI in a process of its own, with the faulty backend registered in process as a plugin would be found
    code = textwrap.dedent(f"""
        import sys
        sys.path.insert(0, {str(Path(__file__).parent)!r})
        from ggml_py.runtime.registry import registry
        from ggml_py.runtime.backend import BackendRegistration, Device
        from test_python_backend_runtime import PyBackend
        class Reg(BackendRegistration):
            name = "pyback"
            version = "0"
            def devices(self):
                return [Device("cpu", "faulty", n_threads=1, score=10)]
            def create(self, device=None, **options):
                return PyBackend(fail=True)
        registry.register("pyback", Reg())
        from ggml_py.commands.cli import main
        sys.exit(main(["generate", "-m", {default_model_path()!r}, "--backend", "pyback,simd", "-n", "2"]))
    """)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert r.returncode == 1, r.stderr
    lines = [ln for ln in r.stderr.splitlines() if ln.startswith("error")]  # besides the loading progress bar
    assert len(lines) == 1 and "Traceback" not in r.stderr, r.stderr
    assert lines[0].startswith("error: backend 'pyback' failed in MUL (node '"), lines[0]
    assert "ValueError: operands could not be broadcast together" in lines[0]
