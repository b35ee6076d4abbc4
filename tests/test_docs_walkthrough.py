"""docs/writing-a-backend.md's Python walk-through is a complete program: its blocks marked `<!-- walkthrough -->`,
run in order in one fresh namespace, define a backend, register it, use it and pass the conformance kit (the last
block asserts it). A snippet that refers to something undefined, or drifts from the interface, fails here."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import ggml_py

DOC = Path(__file__).resolve().parents[1] / "docs" / "writing-a-backend.md"


def walkthrough_blocks() -> list[str]:
    return re.findall(r"<!-- walkthrough -->\n```python\n(.*?)```", DOC.read_text(), flags=re.S)


def test_the_walkthrough_runs_and_passes_the_kit(tmp_path):
    blocks = walkthrough_blocks()
    assert len(blocks) >= 6
    program = tmp_path / "walkthrough.py"
    program.write_text("\n\n".join(blocks))
    # a process of its own: the registry change and the toy backend stay out of this one
    r = subprocess.run([sys.executable, str(program)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "('ADD', 'toy')" in r.stdout and "('MUL_MAT', 'numpy')" in r.stdout


def test_the_walkthrough_imports_only_the_public_interface():
    code = "\n".join(walkthrough_blocks())
    modules = set(re.findall(r"^\s*(?:from|import) (ggml_py[\w.]*)", code, flags=re.M))
    public = {"ggml_py", "ggml_py.runtime.backend", "ggml_py.ir.dtypes", "ggml_py.ir.tensor", "ggml_py.testing"}
    assert modules <= public, modules
    assert ggml_py  # the walkthrough runs against this ggml_py
