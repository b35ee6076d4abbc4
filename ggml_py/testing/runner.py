"""Run conformance cases on a backend and compare with a reference backend (numpy by default).

Each case is built once; its graph is prepared separately on the backend under test and on the reference
(`prepare(out, backends=[b])`, no fallback), both are computed with the same inputs, and every output is compared:

- non-finite values (NaN, +inf, -inf) must appear at the same positions with the same kind, else the case fails;
- NMSE = Σ(ref − out)² / Σref² over the finite positions (0 when both are all zero) must be <= the case's max_nmse.

A case with a node (views aside) that the backend's `supports_op` rejects is skipped with the reason, so a plugin is
judged only on what it claims (the reason says when a source's layout is one the op's schema lets a backend refuse);
the report lists the ops left uncovered. Exceptions raised by the backend while
preparing or computing fail the case with a message naming the backend and the op.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ggml_py.formats.quants import dequantize
from ggml_py.ir import dtypes
from ggml_py.ir.graph import Graph
from ggml_py.ir.schema import PRECISION_TIERS, VIEW_OPS, unmet_layouts
from ggml_py.ir.tensor import Tensor
from ggml_py.runtime.backend import Backend
from ggml_py.runtime.plan import prepare
from ggml_py.runtime.registry import resolve_backends
from ggml_py.testing.case import ALL_OPS, Case, bound_values
from ggml_py.testing.cases import all_cases

__all__ = ["Report", "Result", "compare", "nmse", "run_backend", "run_case", "to_float"]

STATUSES = ("passed", "failed", "skipped")


@dataclass
class Result:
    """The outcome of one case on one backend."""

    op: str
    case: str
    types: str
    status: str  # passed | failed | skipped
    nmse: float | None = None  # worst over the outputs; None if not compared; inf for mismatched non-finite values
    max_nmse: float = 0.0
    message: str = ""
    seconds: float = 0.0

    @property
    def id(self) -> str:
        return f"{self.op}[{self.types}]({self.case})"

    def to_dict(self) -> dict[str, Any]:
        """The JSON form: op, case, types, status, nmse (null if not compared or not finite), max_nmse."""
        nm = self.nmse if self.nmse is not None and np.isfinite(self.nmse) else None
        return {"op": self.op, "case": self.case, "types": self.types, "status": self.status, "nmse": nm,
                "max_nmse": self.max_nmse}


@dataclass
class Report:
    """Results of a backend against a reference, with counts and the ops no case could check."""

    backend: str
    reference: str
    results: list[Result] = field(default_factory=list)
    seconds: float = 0.0
    precision: str = "exact"  # the tier the backend declares (schema.PRECISION_TIERS)

    def count(self, status: str) -> int:
        return sum(r.status == status for r in self.results)

    @property
    def passed(self) -> int:
        return self.count("passed")

    @property
    def failed(self) -> int:
        return self.count("failed")

    @property
    def skipped(self) -> int:
        return self.count("skipped")

    @property
    def ok(self) -> bool:
        return self.failed == 0

    @property
    def failures(self) -> list[Result]:
        return [r for r in self.results if r.status == "failed"]

    @property
    def not_covered(self) -> list[str]:
        """Ops (in the kit's order) that were selected but of which no case ran: every one was skipped."""
        ran = {r.op for r in self.results if r.status != "skipped"}
        seen = {r.op for r in self.results}
        return [op for op in ALL_OPS if op in seen and op not in ran]

    @property
    def partially_covered(self) -> list[str]:
        """Ops of which some cases ran and some were skipped."""
        ran = {r.op for r in self.results if r.status != "skipped"}
        skipped = {r.op for r in self.results if r.status == "skipped"}
        return [op for op in ALL_OPS if op in ran and op in skipped]

    def to_dict(self) -> dict[str, Any]:
        return {"backend": self.backend, "precision": self.precision, "passed": self.passed, "failed": self.failed,
                "skipped": self.skipped,
                "results": [r.to_dict() for r in self.results], "not_covered": self.not_covered}

    def table(self, show: Sequence[str] = STATUSES, coverage: bool = True) -> str:
        """A human-readable table of the results with the given statuses, a summary, and (`coverage`) the ops the
        backend left out wholly or partly."""
        rows = [r for r in self.results if r.status in show]
        w_op = max([len(r.op) for r in rows] + [2])
        w_ty = max([len(r.types) for r in rows] + [5])
        lines = []
        for r in rows:
            nm = "-" if r.nmse is None else f"{r.nmse:.2e}"
            line = (f"{r.status.upper():<7} {r.op:<{w_op}} {r.types:<{w_ty}} nmse {nm:>9} (max {r.max_nmse:.0e}) "
                    f"{r.case}")
            if r.message and r.status != "passed" and "NMSE" not in r.message:  # the NMSE is already on the line
                line += f"\n        {r.message}"
            lines.append(line)
        lines.append(f"{self.backend} vs {self.reference}: {self.passed} passed, {self.failed} failed, "
                     f"{self.skipped} skipped in {self.seconds:.2f}s")
        if coverage and self.not_covered:
            lines.append(f"not covered (the backend supports none of their cases): {', '.join(self.not_covered)}")
        if coverage and self.partially_covered:
            lines.append(f"partially covered (some cases skipped): {', '.join(self.partially_covered)}")
        return "\n".join(lines)


# -- comparison --------------------------------------------------------------------------------------------------
def _bf16_to_f32(raw: np.ndarray) -> np.ndarray:
    return (np.ascontiguousarray(raw).view(np.uint16).astype(np.uint32) << 16).view(np.float32)


def to_float(values: np.ndarray, t: dtypes.DType) -> np.ndarray:
    """An output's values as float64 (dequantized for quantized types, decoded for BF16)."""
    if t.is_quantized:
        return dequantize(np.ascontiguousarray(values), t).astype(np.float64)
    if t is dtypes.BF16:
        return _bf16_to_f32(values).astype(np.float64)
    return np.asarray(values).astype(np.float64)


def nmse(ref: np.ndarray, out: np.ndarray) -> float:
    """Σ(ref − out)² / Σref² (both float64, finite). 0 if both are zero, inf if only the reference is."""
    num = float(np.sum((ref - out) ** 2))
    den = float(np.sum(ref * ref))
    if den == 0.0:
        return 0.0 if num == 0.0 else float("inf")
    return num / den


def compare(ref: np.ndarray, out: np.ndarray) -> tuple[float, str]:
    """(NMSE, problem): problem is '' when shapes and the non-finite positions agree."""
    if ref.shape != out.shape:
        return float("inf"), f"shape {list(out.shape)} instead of {list(ref.shape)}"
    fr, fo = np.isfinite(ref), np.isfinite(out)
    kinds = [("NaN", np.isnan), ("+inf", lambda a: np.isposinf(a)), ("-inf", lambda a: np.isneginf(a))]
    for name, fn in kinds:
        mr, mo = fn(ref), fn(out)
        if not np.array_equal(mr, mo):
            where = np.argwhere(mr != mo)[0].tolist()
            return float("inf"), (f"{name} positions differ (reference has {int(mr.sum())}, backend {int(mo.sum())};"
                                   f" first difference at {where})")
    both = fr & fo
    return nmse(ref[both], out[both]), ""


# -- running ---------------------------------------------------------------------------------------------------
def _compute(built_outputs: list[Tensor], inputs: list[tuple[Tensor, np.ndarray]], backend: Backend,
             bindings: Sequence[Mapping[str, int]] = ()) -> list[tuple[str, Any]]:
    """(label, values) of every output, computed on one plan once, or once per binding in turn."""
    plan = prepare(built_outputs, backends=[backend])
    names = {s.name for s in plan.symbols}
    try:
        out = []
        for b in bindings or ({},):
            for t, v in inputs:
                plan.set_input(t, bound_values(t, v, b))
            bound = {k: v for k, v in b.items() if k in names}
            plan.compute(**bound)
            where = f"{', '.join(f'{k}={v}' for k, v in bound.items())}: " if bound else ""
            out += [(f"{where}output {i}", to_float(plan.get_output(t), t.dtype)) for i, t in enumerate(built_outputs)]
        return out
    finally:
        plan.close()


def _unsupported(nodes: list[Tensor], backend: Backend) -> str | None:
    for n in nodes:
        if n.op in VIEW_OPS:
            continue
        if not backend.supports_op(n):
            srcs = ", ".join(f"{s.dtype}{list(s.shape)}" for s in n.src if s is not None)
            why = f"{backend.name} does not support {n.op} ({n.dtype}{list(n.shape)} from {srcs})"
            unmet = unmet_layouts(n)  # a layout the schema lets a backend refuse, as ggml does: say so
            return why + (f"; the schema allows it: {'; '.join(unmet)}" if unmet else "")
    return None


def _describe(e: BaseException) -> str:
    msg = " ".join(str(e).split())
    return f"{type(e).__name__}: {msg}" if msg else type(e).__name__


class _Failed(Exception):
    """A case that cannot go on: its message is the result's."""


def _attempt(what: str, fn: Callable[..., Any], *args: Any) -> Any:
    """fn(*args); an exception from a kit bug or a backend becomes the case's failure instead of ending the run."""
    try:
        return fn(*args)
    except Exception as e:
        raise _Failed(f"{what}: {_describe(e)}") from None


def precision(backend: Backend) -> str:
    """The precision tier a backend declares in its device caps ("precision"; absent: "exact")."""
    tier = backend.device.caps.get("precision", "exact")
    if tier not in PRECISION_TIERS:
        raise ValueError(f"backend {backend.name!r} declares precision {tier!r}; one of {', '.join(PRECISION_TIERS)}")
    return str(tier)


def _evaluate(case: Case, backend: Backend, reference: Backend, limit: float) -> tuple[str, str, float | None]:
    """(status, message, worst NMSE) of one case."""
    built = _attempt("building the case failed", case.build)
    nodes = _attempt("building the case failed", lambda: Graph(built.outputs).nodes)
    why = _attempt(f"backend {backend.name!r} raised in supports_op for {case.op}", _unsupported, nodes, backend)
    if why is None:
        why_ref = _unsupported(nodes, reference)
        if why_ref is not None:
            why = f"reference {why_ref}"
    if why is not None:
        return "skipped", why, None
    ref_out = _attempt(f"reference backend {reference.name!r} failed on {case.op}", _compute, built.outputs,
                       built.inputs, reference, case.bindings)
    got = _attempt(f"backend {backend.name!r} failed on {case.op} ({case.case})", _compute, built.outputs,
                   built.inputs, backend, case.bindings)
    worst, worst_at, problems = 0.0, "", []
    for (label, r), (_, g) in zip(ref_out, got):
        err, problem = compare(r, g)
        if err > worst or not worst_at:
            worst, worst_at = max(worst, err), label
        if problem:
            problems.append(f"{label}: {problem}" if len(ref_out) > 1 else problem)
    if problems:
        return "failed", f"backend {backend.name!r}: {case.op} ({case.case}): " + "; ".join(problems), worst
    if worst > limit:
        at = f" at {worst_at}" if len(ref_out) > 1 else ""
        return "failed", (f"backend {backend.name!r}: {case.op} ({case.case}) [{case.types}]: NMSE {worst:.3e} > "
                          f"{limit:.1e}{at}"), worst
    return "passed", "", worst


def run_case(case: Case, backend: Backend, reference: Backend) -> Result:
    """Build one case, compute it on `backend` and on `reference`, and compare."""
    t0 = time.perf_counter()
    res = Result(case.op, case.case, case.types, "failed", max_nmse=case.limit(precision(backend)))
    try:
        res.status, res.message, res.nmse = _evaluate(case, backend, reference, res.max_nmse)
    except _Failed as e:
        res.message = str(e)
    res.seconds = time.perf_counter() - t0
    return res


def _resolve(b: str | Backend) -> Backend:
    return b if isinstance(b, Backend) else resolve_backends([b])[0]


def run_backend(backend: str | Backend, cases: Sequence[Case] | None = None, reference: str | Backend = "numpy",
                progress: Callable[[Result], None] | None = None) -> Report:
    """Run `cases` (default: all of them) on `backend` against `reference`; `progress` is called after each case."""
    b, ref = _resolve(backend), _resolve(reference)
    todo = all_cases() if cases is None else list(cases)
    rep = Report(b.name, ref.name, precision=precision(b))
    t0 = time.perf_counter()
    for c in todo:
        r = run_case(c, b, ref)
        rep.results.append(r)
        if progress is not None:
            progress(r)
    rep.seconds = time.perf_counter() - t0
    return rep
