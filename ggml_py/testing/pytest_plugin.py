"""pytest plugin of the conformance kit, for backend authors.

    pytest --pyargs ggml_py.testing --ggml-backend NAME          # with the plugin loaded by its pytest11 entry point
    pytest -p ggml_py.testing.pytest_plugin --pyargs ggml_py.testing --ggml-backend NAME

runs every conformance case (ggml_py/testing/test_conformance_kit.py) as one parametrized test with the kit's
thresholds; cases whose ops the backend does not claim (`supports_op`) show as skips with the reason. Select cases
with pytest's own `-k` (the test ids are the case ids `OP[TYPES](CASE)`) or with `--ggml-op MUL_MAT,ROPE`.

A backend that is not installed yet (no entry point) can be registered for the run with
`--ggml-register NAME=package.module:register` (repeatable).
"""

from __future__ import annotations

import importlib
from typing import Any

import pytest

from ggml_py.runtime.backend import Backend


def pytest_addoption(parser: pytest.Parser) -> None:
    g = parser.getgroup("ggml_py", "ggml_py conformance kit")
    g.addoption("--ggml-backend", action="store", default=None, metavar="NAME",
                help="backend to check with the conformance kit (pytest --pyargs ggml_py.testing)")
    g.addoption("--ggml-reference", action="store", default="numpy", metavar="NAME",
                help="reference backend of the conformance kit (default: numpy)")
    g.addoption("--ggml-op", action="store", default=None, metavar="OPS",
                help="only conformance cases of these ops (comma-separated ggml names)")
    g.addoption("--ggml-register", action="append", default=[], metavar="NAME=MODULE:ATTR",
                help="register a backend in-process before the run (repeatable), e.g. numpy=ggml_py_numpy:register")


def _register(specs: list[str]) -> None:
    from ggml_py.runtime.registry import registry

    for spec in specs:
        name, sep, target = spec.partition("=")
        mod_name, sep2, attr = target.partition(":")
        if not (sep and sep2 and name and mod_name and attr):
            raise pytest.UsageError(f"--ggml-register expects NAME=MODULE:ATTR, got {spec!r}")
        try:
            fn = getattr(importlib.import_module(mod_name), attr)
        except (ImportError, AttributeError) as e:
            raise pytest.UsageError(f"--ggml-register {spec}: {e}") from e
        registry.register(name, fn, source=f"pytest --ggml-register {target}")


def pytest_configure(config: pytest.Config) -> None:
    _register(config.getoption("--ggml-register"))
    # a mistyped name is one usage error before collection, not an error in every test that uses the fixture
    from ggml_py.runtime.registry import registry

    for opt in ("--ggml-backend", "--ggml-reference"):
        name = config.getoption(opt)
        if name and name not in registry.names():
            raise pytest.UsageError(f"{opt} {name!r}: unknown backend; available: {', '.join(registry.names())}")


def _backend(name: str, what: str) -> Backend:
    from ggml_py.errors import GgmlPyError
    from ggml_py.runtime.registry import get_backend

    try:
        return get_backend(name)
    except GgmlPyError as e:
        raise pytest.UsageError(f"{what} {name!r}: {e}") from e


@pytest.fixture(scope="session")
def ggml_backend(request: pytest.FixtureRequest) -> Backend:
    """The backend under test (--ggml-backend); the kit's tests skip when none is given."""
    name = request.config.getoption("--ggml-backend")
    if not name:
        pytest.skip("no backend to check: pass --ggml-backend NAME")
    return _backend(name, "--ggml-backend")


@pytest.fixture(scope="session")
def ggml_reference(request: pytest.FixtureRequest) -> Backend:
    """The reference backend the kit compares with (--ggml-reference, default numpy)."""
    return _backend(request.config.getoption("--ggml-reference"), "--ggml-reference")


def selected_cases(config: Any) -> list[Any]:
    """The kit's cases, restricted by --ggml-op when given (pytest's -k then filters by id)."""
    from ggml_py.testing.cases import cases

    op = config.getoption("--ggml-op", default=None)
    try:
        return cases(op=op) if op else cases()
    except ValueError as e:
        raise pytest.UsageError(f"--ggml-op: {e}") from e
