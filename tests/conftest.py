"""Shared fixtures and the suite's guards (docs/testing.md).

- The suite runs against the *installed* package: `ggml_py` and the built-in backends must be imported from
  site-packages, not from this checkout (`make test` installs the wheel and runs pytest with PYTHONSAFEPATH=1, so
  that neither the working directory nor a script's directory is put on sys.path; subprocesses inherit it).
- Every backend named in `GGML_PY_EXPECT_BACKENDS` (default `numpy,simd`, the built-ins) must load; one that does not
  fails the session. A backend left out of the list is declared absent on purpose: its tests skip as "declared".
- At most `GGML_PY_MAX_SKIPS` (default 0) tests may skip for any other reason; more fail the session, listed.
"""

from __future__ import annotations

import os
import signal
import sysconfig
from pathlib import Path

import pytest

import ggml_py

REPO = Path(__file__).resolve().parents[1]
BUILTIN_BACKENDS = ("numpy", "simd")
# the reason of a skip that a run asked for (a backend left out of GGML_PY_EXPECT_BACKENDS): not counted
DECLARED = "declared absent"

# subprocesses of the tests (`python -c`, `python -m ggml_py`) must not import this checkout either
os.environ.setdefault("PYTHONSAFEPATH", "1")


# make test-asan / test-tsan: instrumented native code (-O1, every access checked) is several times slower, and
# ASan's allocator keeps freed memory in quarantine. Latency bounds are scaled; RSS tests are deselected there.
SANITIZED = bool(os.environ.get("GGML_PY_SANITIZE"))
SLOWDOWN = 20.0 if SANITIZED else 1.0
# the variables that preload a sanitizer runtime into every subprocess (tests/lsan_check.py, tests/tsan_check.py)
SANITIZER_RUNTIME_VARS = ("LD_PRELOAD", "ASAN_OPTIONS", "UBSAN_OPTIONS", "TSAN_OPTIONS")


def tool_env() -> dict[str, str]:
    """The environment for a subprocess that runs none of our native code (a compiler, llama.cpp): without the
    preloaded sanitizer runtime, whose leak scan at each such process's exit cost a second or more under ASan."""
    return {k: v for k, v in os.environ.items() if k not in SANITIZER_RUNTIME_VARS}


def expected_backends() -> list[str]:
    """The backends this run requires (GGML_PY_EXPECT_BACKENDS, default numpy,simd), in order."""
    raw = os.environ.get("GGML_PY_EXPECT_BACKENDS")
    if raw is None:
        return list(BUILTIN_BACKENDS)
    return [n.strip() for n in raw.split(",") if n.strip()]


def declared_absent(name: str) -> pytest.MarkDecorator:
    """Skip marker for tests that need backend `name`: they skip only when the run declared it absent."""
    return pytest.mark.skipif(name not in expected_backends(),
                              reason=f"{name} {DECLARED} (GGML_PY_EXPECT_BACKENDS={','.join(expected_backends())})")


def require_backend(name: str) -> None:
    """Module level: skip the module when the run declared `name` absent; otherwise it must be importable."""
    if name not in expected_backends():
        pytest.skip(f"{name} {DECLARED} (GGML_PY_EXPECT_BACKENDS={','.join(expected_backends())})",
                    allow_module_level=True)


def available_backends() -> list[str]:
    """The expected backends (GGML_PY_EXPECT_BACKENDS), each checked to load: a broken one raises (never filtered)."""
    out = []
    infos = {i.name: i for i in ggml_py.registry.infos()}
    for name in expected_backends():
        if name not in infos:
            raise RuntimeError(f"expected backend {name!r} is not registered (entry points: {sorted(infos)})")
        infos[name].load()  # re-raises the plugin's own error
        out.append(name)
    return out


def sigint_default() -> None:
    """preexec_fn of the subprocesses a test interrupts: SIGINT back to its default, so that the child's Python
    installs its KeyboardInterrupt handler even when this run inherited SIGINT ignored (a background job)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _installed_locations() -> list[Path]:
    return [Path(p).resolve() for p in {sysconfig.get_path("purelib"), sysconfig.get_path("platlib")}]


def installed_check() -> list[str]:
    """Problems with where ggml_py and the built-in backends were imported from (empty when all is installed)."""
    import importlib

    bad = []
    sites = _installed_locations()
    for mod in ("ggml_py", "ggml_py_numpy", "ggml_py_simd"):
        try:
            path = Path(importlib.import_module(mod).__file__ or "").resolve()
        except ImportError as e:
            if mod.removeprefix("ggml_py_") in expected_backends() or mod == "ggml_py":
                bad.append(f"{mod}: {e}")
            continue
        if not any(path.is_relative_to(s) for s in sites) or path.is_relative_to(REPO / "ggml_py") or \
                path.is_relative_to(REPO / "backends"):
            bad.append(f"{mod} imported from {path}, not from site-packages ({', '.join(map(str, sites))})")
    return bad


# The files that take longest (seconds, one process, 2026-12-06: 97, 71, 66, 60, 57, 37, 37, 31), handed to the
# xdist workers first (`make check` runs a file at a time on each of two), so that no long file starts last.
LONGEST_FIRST = ("test_cluster.py", "test_lm_eval.py", "test_determinism.py", "test_quantize_cmd.py",
                 "test_clients.py", "test_architectures.py", "test_write_model.py", "test_structured.py")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The modules that measure the pytest process's own RSS (RUN_FIRST) run first (under xdist: first on a fresh
    worker): later tests leave threads behind that allocate on their own (an HTTP client library's workers, a browser
    driver's), and freed memory that a new allocation reuses without raising the RSS. (Tests that measure a
    subprocess of their own keep their place.) Then the longest files, then the rest in their order."""
    def rank(it: pytest.Item) -> tuple[int, int]:
        if getattr(getattr(it, "module", None), "RUN_FIRST", False):
            return (0, 0)
        name = it.path.name
        return (1, LONGEST_FIRST.index(name)) if name in LONGEST_FIRST else (2, 0)

    items.sort(key=rank)


def pytest_sessionstart(session: pytest.Session) -> None:
    problems = installed_check()
    if problems:
        pytest.exit("the tests must run against the installed package (make test; or PYTHONSAFEPATH=1 "
                    ".venv/bin/python -m pytest after `make install`):\n  " + "\n  ".join(problems), returncode=1)
    infos = {i.name: i for i in ggml_py.registry.infos()}
    broken = []
    for name in expected_backends():
        if name not in infos:
            broken.append(f"{name}: not registered (entry points found: {', '.join(sorted(infos))})")
            continue
        try:
            infos[name].load()
        except Exception as e:
            broken.append(f"{name}: {type(e).__name__}: {e}")
    if broken:
        pytest.exit("expected backend(s) failed to load (declare an absence on purpose with "
                    "GGML_PY_EXPECT_BACKENDS):\n  " + "\n  ".join(broken), returncode=1)


def _skip_reason(rep: pytest.TestReport) -> str:
    if isinstance(rep.longrepr, tuple) and len(rep.longrepr) == 3:
        return str(rep.longrepr[2])
    return str(rep.longrepr)


def max_skips() -> int:
    return int(os.environ.get("GGML_PY_MAX_SKIPS", "0"))


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    if reporter is None or session.config.option.collectonly:
        return
    skipped = [r for r in reporter.stats.get("skipped", []) if DECLARED not in _skip_reason(r)]
    allowed = max_skips()
    if len(skipped) > allowed:
        lines = [f"{r.nodeid}: {_skip_reason(r)}" for r in skipped]
        reporter.write_sep("=", f"skip guard: {len(skipped)} test(s) skipped, {allowed} allowed (GGML_PY_MAX_SKIPS)",
                           red=True)
        for ln in lines:
            reporter.write_line("  " + ln)
        if session.exitstatus == 0:
            session.exitstatus = pytest.ExitCode.TESTS_FAILED


@pytest.fixture
def rng():
    import numpy as np

    return np.random.default_rng(1234)


__all__ = ["SANITIZED", "SLOWDOWN", "available_backends", "declared_absent", "expected_backends", "installed_check",
           "require_backend", "sigint_default"]
