"""Seeded mutation fuzzing of the GGUF loader: only GGUFError may come out.

The long run is `python -m ggml_py.testing.gguf_fuzz --cases 100000 --seed 1` (see that module).
"""

from __future__ import annotations

import os
import time
import tracemalloc
from pathlib import Path

import pytest

from ggml_py.errors import GGUFError
from ggml_py.formats.gguf import open_gguf
from ggml_py.testing import gguf_fuzz as F

SEED = 20240601
CASES = 2000
ALLOC_SLACK = 64 * 1024


def test_fuzz_only_gguf_error() -> None:
    t0 = time.perf_counter()
    stats = F.run(CASES, SEED)
    elapsed = time.perf_counter() - t0
    if stats.failures:
        f = stats.failures[0]
        pytest.fail(
            f"{len(stats.failures)} of {CASES} cases raised something other than GGUFError; first: seed={f.seed} "
            f"case={f.case} base={f.base} (replay: python -m ggml_py.testing.gguf_fuzz --seed {f.seed} "
            f"--case {f.case} --dump case.gguf)\n{f.error}"
        )
    assert stats.cases == CASES
    # Both outcomes must actually happen, or the mutations are too weak / too destructive.
    assert 0 < stats.accepted < CASES
    assert len(stats.by_category) >= 20, stats.summary()
    assert stats.slowest < 1.0, f"case {stats.slowest_case} took {stats.slowest:.2f} s"
    assert elapsed < 20.0, f"{CASES} cases took {elapsed:.1f} s"


def test_fuzz_cases_are_deterministic() -> None:
    pool = F.bases()
    for i in (0, 1, 17, 1999):
        a = F.make_case(SEED, i, pool)
        b = F.make_case(SEED, i, F.bases())
        assert a[0].name == b[0].name and a[1] == b[1]
    assert F.make_case(SEED, 3, pool)[1] != F.make_case(SEED + 1, 3, pool)[1]


def test_fuzz_allocations_bounded(tmp_path: Path) -> None:
    """A sample of fuzz cases under tracemalloc: nothing much beyond the file size is ever allocated."""
    pool = F.bases()
    path = str(tmp_path / "case.gguf")
    for i in range(0, CASES, 10):
        _, data = F.make_case(SEED, i, pool)
        with open(path, "wb") as f:
            f.write(data)
        tracemalloc.start()
        try:
            try:
                open_gguf(path).close()
            except GGUFError:
                pass
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
        assert peak <= len(data) + ALLOC_SLACK, f"case {i}: traced peak {peak} for a {len(data)}-byte file"


def test_category_blanks_numbers_and_names() -> None:
    assert F.category("tensor 'bf': data [2496, 2516) extends past the end of the file (2496 bytes)") == (
        "tensor '…': data […] extends past the end of the file (N bytes)"
    )
    assert F.category("key of KV 1 at offset 77 is not valid UTF-8") == "key of KV N at offset N is not valid UTF-8"
    assert F.category("bad magic b'G\\'UF', not a GGUF file") == "bad magic '…', not a GGUF file"


def test_replay_cli(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    dump = tmp_path / "c.gguf"
    assert F.main(["--seed", str(SEED), "--case", "5", "--dump", str(dump)]) == 0
    out = capsys.readouterr().out
    assert f"seed {SEED} case 5" in out and dump.stat().st_size == len(F.make_case(SEED, 5, F.bases())[1])
    assert F.main(["--cases", "50", "--seed", "3", "--every", "25"]) == 0
    out = capsys.readouterr().out
    assert "cases: 50" in out and "[      25/50]" in out and "rejection reasons" in out


if os.environ.get("GGML_PY_FUZZ_CASES"):  # a longer run on request (defined only then: not a skip)
    def test_fuzz_long_run_from_env() -> None:
        n = int(os.environ["GGML_PY_FUZZ_CASES"])
        stats = F.run(n, int(os.environ.get("GGML_PY_FUZZ_SEED", "1")))
        assert not stats.failures, stats.summary()
