"""The conformance kit (ggml_py.testing): numpy passes against itself, broken backends are caught, a backend claiming
a subset is judged only on it, the CLI and the pytest plugin report the same."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
from ggml_py_numpy import NumpyBackend, NumpyRegistration

import ggml_py as gp
from ggml_py.commands import cli
from ggml_py.ir import schema
from ggml_py.runtime.backend import Backend, BackendRegistration, Device
from ggml_py.testing import ALL_OPS, cases, compare, nmse, run_backend
from ggml_py.testing.case import CONVERT_MAX_NMSE, WEIGHT_TYPES
from ggml_py.testing.view_cases import view_of

from conftest import available_backends

ROOT = Path(__file__).resolve().parents[1]


# -- deliberately wrong backends, registered in-process ------------------------------------------------------------
class _Tweaked(NumpyBackend):
    """The numpy backend with some kernels replaced; `wrap(op, kernel) -> kernel`, `claims(node) -> bool`."""

    def __init__(self, name: str, wrap: Callable | None = None, claims: Callable | None = None) -> None:
        super().__init__(Device("cpu", f"numpy, tweaked ({name})"))
        self.name = name
        self._wrap = wrap
        self._claims = claims

    def supports_op(self, node: gp.Tensor) -> bool:
        return super().supports_op(node) and (self._claims is None or self._claims(node))

    def graph_plan_create(self, split):  # type: ignore[no-untyped-def]
        plan = super().graph_plan_create(split)
        if self._wrap is not None:
            for s in plan.steps:  # the numpy backend's _Step objects
                s.kernel = self._wrap(s.node.op, s.kernel)
        return plan


class _Reg(BackendRegistration):
    def __init__(self, name: str, **kw: object) -> None:
        self.name = name
        self._kw = kw

    def devices(self) -> list[Device]:
        return NumpyRegistration().devices()

    def create(self, device: Device | None = None, **options: object) -> Backend:
        return _Tweaked(self.name, **self._kw)  # type: ignore[arg-type]


class _UpperBoundReg(_Reg):
    def create(self, device: Device | None = None, **options: object) -> Backend:
        return _UpperBound(self.name)


def _only(op_name: str) -> Callable[[Callable[[Callable], Callable]], Callable]:
    """A kernel tweak `wrap(op, kernel) -> kernel` that replaces the kernel of `op_name` alone."""
    def deco(make: Callable[[Callable], Callable]) -> Callable:
        return lambda op, k: make(k) if op == op_name else k
    return deco


@_only("ADD")
def _perturb_add(k: Callable) -> Callable:
    return lambda n, s, o: k(n, s, o) * np.float32(1.01)


@_only("SOFT_MAX")
def _softmax_ignores_mask(k: Callable) -> Callable:
    return lambda n, s, o: k(n, [s[0], None], o)


@_only("LOG")
def _log_without_nan(k: Callable) -> Callable:
    return lambda n, s, o: k(n, [np.abs(s[0])], o)  # log|x|: no NaN for negative inputs


@_only("ROPE")
def _rope_raises(k: Callable) -> Callable:
    def boom(n, s, o):  # type: ignore[no-untyped-def]
        raise RuntimeError("kernel exploded")

    return boom


@_only("CPY")
def _truncating_convert(k: Callable) -> Callable:
    """F32 -> F16/BF16 by dropping mantissa bits (round toward zero) instead of rounding to nearest even."""
    def cpy(n, s, o):  # type: ignore[no-untyped-def]
        x = np.ascontiguousarray(k(n, s, o), dtype=np.float32)
        mask = {"F16": 0xFFFFE000, "BF16": 0xFFFF0000}.get(n.dtype.name)
        return x if mask is None else (x.view(np.uint32) & np.uint32(mask)).view(np.float32)

    return cpy


@_only("RMS_NORM")
def _norm_without_eps(k: Callable) -> Callable:
    def rms(n, s, o):  # type: ignore[no-untyped-def]
        x = s[0].astype(np.float64)
        return (x / np.sqrt((x * x).mean(axis=-1, keepdims=True))).astype(np.float32)

    return rms


@_only("MUL")
def _mul_nan_where_b_is_zero(k: Callable) -> Callable:
    def mul(n, s, o):  # type: ignore[no-untyped-def]
        out = np.array(k(n, s, o), dtype=np.float32)
        b_zero = k(n, [np.ones_like(s[0]), (s[1] == 0).astype(np.float32)], o) > 0  # b tiled as the kernel does
        out[b_zero] = np.nan
        return out

    return mul


class _UpperBound(_Tweaked):
    """Computes every node at the upper bounds of its symbols, whatever a compute binds them to."""

    def graph_plan_create(self, split):  # type: ignore[no-untyped-def]
        from ggml_py.runtime.schedule import symbols_of

        plan = super().graph_plan_create(split)
        upper = {s.name: s.max for s in symbols_of([*split.nodes, *(s for n in split.nodes for s in n.src if s)])}
        plan.steps = [lambda b, st=st: st(upper) for st in plan.steps]
        return plan


def _claims_subset(node: gp.Tensor) -> bool:
    if node.op == "MUL_MAT":
        return node.src[0].dtype.name in ("F32", "F16")
    return node.op in ("ADD", "MUL")


def register_broken_add() -> BackendRegistration:
    return _Reg("broken_add", wrap=_perturb_add)


def register_subset() -> BackendRegistration:
    return _Reg("subset", claims=_claims_subset)


TWEAKED = {
    "broken_add": register_broken_add,
    "subset": register_subset,
    "bad_softmax": lambda: _Reg("bad_softmax", wrap=_softmax_ignores_mask),
    "bad_log": lambda: _Reg("bad_log", wrap=_log_without_nan),
    "rope_raises": lambda: _Reg("rope_raises", wrap=_rope_raises),
    "truncating": lambda: _Reg("truncating", wrap=_truncating_convert),
    "no_eps": lambda: _Reg("no_eps", wrap=_norm_without_eps),
    "nan_mul": lambda: _Reg("nan_mul", wrap=_mul_nan_where_b_is_zero),
    "upper_bound": lambda: _UpperBoundReg("upper_bound"),
}


@pytest.fixture(autouse=True, scope="module")
def _tweaked_backends():
    for name, fn in TWEAKED.items():
        gp.registry.register(name, fn, source="tests/test_conformance.py")
    yield
    for name in TWEAKED:
        gp.registry.unregister(name)


# -- the kit itself ----------------------------------------------------------------------------------------------
def test_numpy_passes_everything_against_itself_quickly():
    t0 = time.perf_counter()
    rep = run_backend("numpy")
    took = time.perf_counter() - t0
    assert rep.failed == 0, rep.table(show=("failed",))
    assert rep.skipped == 0 and rep.passed == len(cases()) > 300
    assert rep.not_covered == [] and rep.ok
    assert took < 20, f"the kit took {took:.1f}s on numpy"
    assert all(r.nmse is not None and r.nmse <= r.max_nmse for r in rep.results)


def test_kit_covers_every_op_type_and_size():
    all_ = cases()
    assert {c.op for c in all_} == set(ALL_OPS)
    mm_types = {c.types.split(",")[0] for c in all_ if c.op == "MUL_MAT"}
    assert mm_types == {t.name for t in WEIGHT_TYPES}
    for t in WEIGHT_TYPES:  # single-row GEMV, several rows, batched with broadcast
        mine = [c.case for c in all_ if c.op == "MUL_MAT" and c.types.startswith(f"{t.name},")]
        assert any(",b=[1," in s for s in mine) and any("a=[2,1," in s for s in mine) and len(mine) >= 5
    text = " ".join(c.id for c in all_)
    for size in ("[1]", "[7]", "[33]", "[4097]", ",33]", ",4097]"):
        assert size in text
    for needle in ("layout=(perm,cont)", "layout=(cont,trans)", "layout=(view,cont)", "a=[4,6,33],b=[2,3,33]",
                   "SOFT_MAX[F32,F16]", "SOFT_MAX[F32,F32]", "max_bias=8.0", "mode=0", "mode=2",
                   "FLASH_ATTN_EXT[F32,F16", "FLASH_ATTN_EXT[F32,F32", "kv=[1,1,33", "kv=[1,2,256"):
        assert needle in text, needle
    thr = {c.op: c.max_nmse for c in all_}
    assert thr["FLASH_ATTN_EXT"] == 5e-4 and thr["SOFT_MAX"] == 1e-6 and thr["ROPE"] == 1e-7
    mm = {c.types.split(",")[0]: c.max_nmse for c in all_ if c.op == "MUL_MAT"}
    assert {mm[t] for t in ("F32", "F16", "BF16")} == {1e-10} and {v for t, v in mm.items() if "F" not in t} == {5e-4}
    assert all(c.max_nmse == 0 for c in all_ if c.op in ("ARGMAX", "CONT", "CONCAT", "REPEAT", "PAD"))
    assert all(c.max_nmse == 0 for c in all_ if c.op == "CPY" and c.types.split("->")[0] == c.types.split("->")[1])


def test_cases_are_deterministic_and_filterable():
    c = cases("Q4_K", op="MUL_MAT")[0]
    a, b = c.build(), c.build()
    for (_, x), (_, y) in zip(a.inputs, b.inputs):
        np.testing.assert_array_equal(x, y)
    assert all(k.op == "ROPE" for k in cases(op="rope"))
    assert [k.id for k in cases(lambda k: k.op == "PAD")] == [k.id for k in cases(op="PAD")]
    with pytest.raises(ValueError, match="unknown op"):
        cases(op="NOPE")


def test_compare_nmse_and_non_finite_positions():
    a = np.array([1.0, 2.0, np.inf, np.nan])
    assert compare(a, a.copy()) == (0.0, "")
    err, why = compare(a, np.array([1.0, 2.0, np.inf, 0.0]))
    assert err == float("inf") and "NaN positions differ" in why
    err, why = compare(a, np.array([1.0, 2.0, -np.inf, np.nan]))
    assert "inf positions differ" in why
    assert nmse(np.zeros(3), np.zeros(3)) == 0.0 and nmse(np.zeros(3), np.ones(3)) == float("inf")
    assert nmse(np.array([3.0, 4.0]), np.array([3.0, 3.0])) == pytest.approx(1 / 25)


def test_perturbed_add_is_caught_with_op_and_nmse():
    rep = run_backend("broken_add", cases(op="ADD,MUL"))
    fails = rep.failures
    assert fails and {r.op for r in fails} == {"ADD"} and rep.failed == len(cases(op="ADD"))
    for r in fails:
        assert r.nmse is not None and r.nmse > r.max_nmse
        assert "broken_add" in r.message and "ADD" in r.message and "NMSE" in r.message
    assert rep.count("passed") == len(cases(op="MUL"))


def test_softmax_ignoring_its_mask_is_caught():
    rep = run_backend("bad_softmax", cases(op="SOFT_MAX"))
    failed = {r.case for r in rep.failures}
    assert failed and all("mask=" in c for c in failed)
    assert {r.case for r in rep.results if r.status == "passed"} == {c.case for c in cases(op="SOFT_MAX")
                                                                    if "mask=" not in c.case}
    assert all(r.nmse > 1e-6 for r in rep.failures)


def test_planted_bugs_fail_the_edge_cases():
    # eps ignored: right on ordinary data, wrong where eps matters (tiny data, rows of zeros)
    rep = run_backend("no_eps", cases(op="RMS_NORM"))
    failed = {r.case for r in rep.failures}
    assert any("eps=0.1,data=uniform(-0.0001" in c for c in failed) and any("row 2 zeros" in c for c in failed)
    assert not any("eps=0," in c for c in failed)  # with eps 0 the bug is no bug
    # NaN where b == 0 (0 * x is 0 for finite x): only the special-value cases have a zero divisor... factor
    rep = run_backend("nan_mul", cases(op="MUL"))
    assert {r.case for r in rep.failures} == {c.case for c in cases(op="MUL") if c.case.startswith("specials")}
    assert all("NaN positions differ" in r.message for r in rep.failures)
    # symbols never bound: every case that computes at several bindings and reads along a symbolic dim fails
    rep = run_backend("upper_bound", cases("symbolic"))
    failed_ops = {r.op for r in rep.failures}
    assert {"SOFT_MAX", "SUM_ROWS", "FLASH_ATTN_EXT"} <= failed_ops, [r.id for r in rep.results]
    assert all("T=" in r.message or "n_kv=" in r.message for r in rep.failures)  # the binding is named


def test_missing_nan_is_caught():
    rep = run_backend("bad_log", cases(op="LOG"))
    (r,) = rep.failures
    assert "values=" in r.case and "NaN positions differ" in r.message and "bad_log" in r.message


def test_truncating_conversion_fails_the_conversion_thresholds():
    rep = run_backend("truncating", cases(op="CPY"))
    bad = {r.types for r in rep.failures}
    assert {"F32->F16", "F32->BF16"} <= bad and all("->F16" in t or "->BF16" in t for t in bad)
    assert CONVERT_MAX_NMSE["F16"] < CONVERT_MAX_NMSE["BF16"] < CONVERT_MAX_NMSE["Q8_0"] < CONVERT_MAX_NMSE["Q4_0"]


def test_backend_exception_fails_the_case_naming_backend_and_op():
    rep = run_backend("rope_raises", cases(op="ROPE"))
    assert rep.failed == len(cases(op="ROPE"))
    for r in rep.failures:
        assert "rope_raises" in r.message and "ROPE" in r.message and "kernel exploded" in r.message


# A rope kernel that drops one of the scalings: what it computes with instead (node params, or no freq_factors), and
# the text of the kit's ROPE cases that must then fail (all others pass)
_ROPE_SHORTCUTS: dict[str, tuple[Callable[[dict], dict], bool, str]] = {
    "no-freq-factors": (lambda p: p, True, ",freq_factors"),
    "no-ext-factor": (lambda p: {**p, "ext_factor": 0.0}, False, ",ext_factor="),
    "no-attn-factor": (lambda p: {**p, "attn_factor": 1.0}, False, ",attn_factor="),
    "default-betas": (lambda p: {**p, "beta_fast": 32.0, "beta_slow": 1.0}, False, ",beta_fast="),
    "other-n-ctx-orig": (lambda p: {**p, "n_ctx_orig": 2 * p["n_ctx_orig"]}, False, ",n_ctx_orig="),
}


@pytest.mark.parametrize("shortcut", list(_ROPE_SHORTCUTS))
def test_rope_kernel_dropping_a_scaling_is_caught(shortcut):
    """The kit's ROPE cases catch a kernel that ignores the frequency factors, YaRN's ext_factor, the attn_factor, or
    computes the correction dims from other betas or another original context, and only the cases that use it."""
    params, drop_factors, marker = _ROPE_SHORTCUTS[shortcut]

    def wrap(op, k):  # type: ignore[no-untyped-def]
        if op != "ROPE":
            return k
        return lambda n, s, o: k(SimpleNamespace(params=params(dict(n.params))),
                                 [s[0], s[1], None if drop_factors else s[2]], o)

    sel = cases(op="ROPE")
    rep = run_backend(_Tweaked(shortcut, wrap=wrap), sel)
    assert {r.case for r in rep.failures} == {c.case for c in sel if marker in c.case} != set()
    assert min(r.nmse for r in rep.failures) > 1e3 * schema.OPS["ROPE"].max_nmse


def test_subset_backend_is_skipped_for_the_rest():
    rep = run_backend("subset", cases(op="ADD,MUL_MAT,ROPE,SOFT_MAX"))
    assert rep.failed == 0
    ran = {(r.op, r.types.split(",")[0]) for r in rep.results if r.status == "passed"}
    assert ("ADD", "F32") in ran and ("MUL_MAT", "F16") in ran and ("MUL_MAT", "Q4_0") not in ran
    skipped = [r for r in rep.results if r.status == "skipped"]
    assert {r.op for r in skipped} == {"MUL_MAT", "ROPE", "SOFT_MAX"}
    assert all("subset does not support" in r.message for r in skipped)
    assert rep.not_covered == ["SOFT_MAX", "ROPE"] and rep.partially_covered == ["MUL_MAT"]
    assert "not covered" in rep.table()


# -- view cases (ggml_py/testing/view_cases.py) ----------------------------------------------------------------
def test_view_cases_give_each_source_the_layouts_its_schema_allows():
    """Every source that need not be contiguous gets a window of a wider input; every one of any layout also a
    transposed view (SET_ROWS' 1-D idx: every other element); a source that needs contiguous rows never gets strided
    rows, a contiguous one nothing. Each view case's source has the layout its id names."""
    given: dict[tuple[str, str], set[str]] = {}
    for c in cases():
        v = view_of(c)
        if v is not None:
            given.setdefault((c.op, v[0]), set()).add(v[1])
    for o in (schema.OPS[op] for op in ALL_OPS):
        for role in o.roles:
            got, need = given.get((o.name, role), set()), o.requires(role)
            if (o.name, role) == ("SET_ROWS", "idx"):
                assert got == {"strided"}
            elif need == schema.ANY:
                assert {"window", "transposed"} <= got, (o.name, role, got)
            else:
                assert got == ({"window"} if need == schema.ROWS else set()), (o.name, role, got)
    for c in cases(lambda c: view_of(c) is not None):
        role, how = view_of(c)  # type: ignore[misc]
        j = schema.OPS[c.op].roles.index(role)
        (node,) = [n for n in gp.Graph(c.build().outputs).nodes if n.op == c.op]
        s = node.src[j]
        rows = schema.has_layout(schema.ROWS, s.shape, s.strides, s.dtype)
        dense = schema.has_layout(schema.CONTIGUOUS, s.shape, s.strides, s.dtype)
        if how == "window":
            assert rows and not dense and s.strides[-2] > s.dtype.row_size(s.shape[-1]), c.id
        else:
            assert not rows and s.is_view, c.id


def _c_strides(a: np.ndarray) -> tuple[int, ...]:
    out, step = [], a.itemsize
    for d in reversed(a.shape):
        out.append(step)
        step *= d
    return tuple(reversed(out))


class _IgnoresStrides(_Tweaked):
    """The plugin bug "strides ignored" in numpy: every operand of `op` (its result too) read and written from its
    first byte as if it were contiguous."""

    def __init__(self, op: str) -> None:
        super().__init__(f"strides_ignored_{op.lower()}")
        self.op = op

    def graph_plan_create(self, split):  # type: ignore[no-untyped-def]
        plan = super().graph_plan_create(split)
        for st in plan.steps:
            if st.node.op == self.op:
                def dense(i, bindings, read=st.operand):  # type: ignore[no-untyped-def]
                    a, shape = read(i, bindings)
                    return np.lib.stride_tricks.as_strided(a, a.shape, _c_strides(a)), shape

                st.operand = dense
        return plan


def test_a_backend_ignoring_strides_fails_the_view_cases_of_every_source():
    """For each op, a numpy backend that ignores the strides of that op's operands fails at least one view case of
    each of its sources (the plugin bug the C example plants too: tests/test_native_plugin.py)."""
    views = cases(lambda c: view_of(c) is not None)
    missed = {}
    for op in dict.fromkeys(c.op for c in views):
        mine = [c for c in views if c.op == op]
        rep = run_backend(_IgnoresStrides(op), mine)
        caught = {view_of(r)[0] for r in rep.failures}  # type: ignore[index]
        if caught != {view_of(c)[0] for c in mine}:  # type: ignore[index]
            missed[op] = sorted({view_of(c)[0] for c in mine} - caught)  # type: ignore[index]
    assert missed == {}


def test_refusing_only_what_the_schema_allows_skips_no_view_case():
    """A backend may decline a node whose source lacks the layout its op requires (as ggml's CPU backend does): the
    kit skips such a case saying so, and none of its generated view cases is one."""
    strict = _Tweaked("strict_layouts", claims=lambda n: not schema.unmet_layouts(n))
    rep = run_backend(strict, cases(op="ADD,SOFT_MAX,MUL_MAT,SILU"))
    assert rep.failed == 0, rep.table(show=("failed",))
    skipped = [r for r in rep.results if r.status == "skipped"]
    assert {r.op for r in skipped} == {"ADD", "SOFT_MAX", "MUL_MAT", "SILU"}  # the hand-written permuted operands
    assert all("the schema allows it: " in r.message and "must be contiguous" in r.message for r in skipped)
    assert not any(view_of(r) for r in skipped)
    assert any(view_of(r) for r in rep.results if r.status == "passed")


# -- the CLI ---------------------------------------------------------------------------------------------------
def _cli(argv: list[str], capsys: pytest.CaptureFixture) -> tuple[int, str, str]:
    code = cli.main(argv)
    out, err = capsys.readouterr()
    return code, out, err


def test_cli_json_shape_and_exit_codes(capsys):
    code, out, _ = _cli(["test-backend", "numpy", "--json", "--op", "ADD,ARGMAX"], capsys)
    d = json.loads(out)
    assert code == 0
    assert set(d) == {"backend", "precision", "passed", "failed", "skipped", "results", "not_covered"}
    assert d["precision"] == "exact"
    assert d["backend"] == "numpy" and d["failed"] == d["skipped"] == 0
    assert d["passed"] == len(d["results"]) == len(cases(op="ADD,ARGMAX"))
    for r in d["results"]:
        assert set(r) == {"op", "case", "types", "status", "nmse", "max_nmse"}
        assert r["status"] == "passed" and r["op"] in ("ADD", "ARGMAX")

    code, out, err = _cli(["test-backend", "broken_add", "--json", "--op", "ADD", "-k", "4097"], capsys)
    d = json.loads(out)
    assert code == 1 and d["failed"] == len(d["results"]) == 1
    (r,) = d["results"]
    assert r["op"] == "ADD" and r["status"] == "failed" and r["nmse"] > r["max_nmse"]
    assert "FAILED ADD" in err

    code, out, _ = _cli(["test-backend", "subset", "--json", "--op", "ADD,ROPE"], capsys)
    d = json.loads(out)
    assert code == 0 and d["skipped"] == len(cases(op="ROPE")) and d["not_covered"] == ["ROPE"]


def test_cli_human_table_and_errors(capsys):
    code, out, _ = _cli(["test-backend", "broken_add", "--op", "ADD", "-k", "b=[7,1]"], capsys)
    assert code == 1 and "FAILED" in out and "broken_add vs numpy: 0 passed, 1 failed" in out
    code, _, err = _cli(["test-backend", "no_such_backend"], capsys)
    assert code == 1 and err.startswith("error: unknown backend")
    code, _, err = _cli(["test-backend", "numpy", "-k", "no such case"], capsys)
    assert code == 1 and "no conformance case" in err
    # --quiet: the failures and the counts, not the cases a backend does not claim
    code, out, _ = _cli(["test-backend", "broken_add", "--op", "ADD,ROPE", "-k", "b=[7,1]", "-q"], capsys)
    lines = out.strip().splitlines()
    assert code == 1 and lines[0].split()[:2] == ["FAILED", "ADD"] and "SKIPPED" not in out
    assert lines[-1].startswith("broken_add vs numpy: 0 passed, 1 failed")


# -- the pytest plugin -----------------------------------------------------------------------------------------
def _pytest(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    # the installed ggml_py and backends (the checkout's backends/ has no compiled simd module); tests/ for the
    # test backends registered below
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "tests"), env.get("PYTHONPATH", "")])
    cmd = [sys.executable, "-m", "pytest", "-p", "ggml_py.testing.pytest_plugin", "-p", "no:cacheprovider",
           "-p", "no:hypothesispytest", "--pyargs", "ggml_py.testing", "-q", "-rsf",
           "--ggml-register", "numpy=ggml_py_numpy:register", *args]
    return subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)


def test_pytest_plugin_runs_cases_as_tests(tmp_path):
    p = _pytest(tmp_path, "--ggml-backend", "numpy", "--ggml-op", "ARGMAX,PAD")
    assert p.returncode == 0, p.stdout + p.stderr
    assert f"{len(cases(op='ARGMAX,PAD'))} passed" in p.stdout

    p = _pytest(tmp_path, "--ggml-register", "broken_add=test_conformance:register_broken_add",
                "--ggml-register", "subset=test_conformance:register_subset",
                "--ggml-backend", "broken_add", "-k", "ADD and 4097")
    assert p.returncode == 1 and "1 failed" in p.stdout and "NMSE" in p.stdout, p.stdout + p.stderr

    p = _pytest(tmp_path, "--ggml-register", "subset=test_conformance:register_subset",
                "--ggml-backend", "subset", "--ggml-op", "MUL_MAT", "-k", "Q4_0 or F16")
    assert p.returncode == 0, p.stdout + p.stderr
    assert "SKIPPED" in p.stdout and "subset does not support MUL_MAT" in p.stdout and " passed" in p.stdout

    # a mistyped backend: one usage error before collection (pytest's exit code 4), not an error per case
    p = _pytest(tmp_path, "--ggml-backend", "nmupy")
    assert p.returncode == 4, p.stdout + p.stderr
    assert "--ggml-backend 'nmupy': unknown backend; available: " in p.stderr and "numpy" in p.stderr
    assert "errors" not in p.stdout and len((p.stdout + p.stderr).strip().splitlines()) <= 2, p.stdout + p.stderr


@pytest.mark.parametrize("backend", available_backends())
def test_top_k_follows_its_contract(backend):
    """TOP_K against the contract written out in Python (not the numpy kernel the kit compares with): NaN first,
    then largest first, the lower index first on ties; rows longer than the simd kernel's 4096-column chunks."""
    rng = np.random.default_rng(3)
    x = rng.integers(-5, 6, size=(3, 9000)).astype(np.float32)
    x[0, [10, 8000, 4100]] = np.nan
    x[1, rng.choice(9000, 200, replace=False)] = -np.inf
    x[2, :] = -np.inf
    x[2, 5000] = 1.0
    inp = gp.input(x.shape)
    out = gp.ops.top_k(inp, 50).set_output()
    plan = gp.prepare(out, backends=[backend])
    plan.set_input(inp, x)
    plan.compute()
    got = plan.get_output(out)
    for r in range(3):
        key = [(not np.isnan(v), -v if not np.isnan(v) else 0.0, i) for i, v in enumerate(x[r])]
        want = [i for _, _, i in sorted(key)[:50]]
        assert got[r].tolist() == want
    with pytest.raises(gp.GgmlPyError, match="k must be"):
        gp.ops.top_k(inp, 9001)
