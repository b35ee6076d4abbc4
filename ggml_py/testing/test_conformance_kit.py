"""The conformance kit as pytest tests: `pytest --pyargs ggml_py.testing --ggml-backend NAME`.

Needs the plugin ggml_py.testing.pytest_plugin (loaded by its pytest11 entry point, or with
`-p ggml_py.testing.pytest_plugin`). Each case is one test with the id `OP[TYPES](CASE)`.
"""

from __future__ import annotations

import pytest

from ggml_py.testing.case import Case
from ggml_py.testing.cases import cases
from ggml_py.testing.runner import run_case


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "kit_case" not in metafunc.fixturenames:
        return
    try:
        from ggml_py.testing.pytest_plugin import selected_cases

        selected = selected_cases(metafunc.config)
    except ValueError:  # the plugin's options are not registered: every case, the fixtures will skip
        selected = cases()
    metafunc.parametrize("kit_case", selected, ids=[c.id for c in selected])


def _plugin_loaded(config: pytest.Config) -> bool:
    try:
        config.getoption("--ggml-backend")
        return True
    except ValueError:
        return False


@pytest.fixture
def _kit_backends(request: pytest.FixtureRequest) -> tuple:
    if not _plugin_loaded(request.config):
        pytest.skip("the conformance kit needs its plugin: pytest -p ggml_py.testing.pytest_plugin --ggml-backend NAME")
    return request.getfixturevalue("ggml_backend"), request.getfixturevalue("ggml_reference")


def test_case(kit_case: Case, _kit_backends: tuple) -> None:
    backend, reference = _kit_backends
    r = run_case(kit_case, backend, reference)
    if r.status == "skipped":
        pytest.skip(r.message)
    if r.status == "failed":
        pytest.fail(r.message, pytrace=False)
