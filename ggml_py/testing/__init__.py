"""The conformance kit: every op of ggml_py checked on a backend against the numpy reference.

    from ggml_py.testing import cases, run_backend
    report = run_backend("simd")                 # all cases; or run_backend("simd", cases("MUL_MAT"))
    print(report.table()); assert report.ok

The same cases run from the command line (`ggml-py test-backend NAME`) and from pytest
(`pytest --pyargs ggml_py.testing --ggml-backend NAME`, see ggml_py.testing.pytest_plugin). See
docs/writing-a-backend.md, section "Conformance kit".
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from ggml_py.testing.case import ALL_OPS, CONVERT_MAX_NMSE, Built, Case, Ctx
from ggml_py.testing.cases import cases as _cases
from ggml_py.testing.runner import Report, Result, compare, nmse, run_backend, run_case

__all__ = ["ALL_OPS", "CONVERT_MAX_NMSE", "Built", "Case", "Ctx", "Report", "Result", "cases", "compare", "nmse",
           "run_backend", "run_case"]


def cases(filter: str | Callable[[Case], bool] | None = None, *,  # noqa: A002
          op: str | Sequence[str] | None = None) -> list[Case]:
    """The kit's cases: all, or those whose id (`OP[TYPES](CASE)`) contains `filter` / satisfy it; `op` selects ops."""
    return _cases(filter, op=op)
