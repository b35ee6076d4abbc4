"""llama.cpp as the peer of the tests: code run next to llama-cpp-python, in this process when it is importable,
else in the interpreter named by $LLAMA_CPP_PYTHON (a separate environment that has it: CI makes one with
`make llamacpp-venv`). Arguments and results cross as JSON; large arrays go through .npy files."""

from __future__ import annotations

import functools
import json
import os
import subprocess
from typing import Any

NOT_AVAILABLE = "llama_cpp not importable (set LLAMA_CPP_PYTHON to an interpreter with llama-cpp-python)"


@functools.cache
def _in_process() -> bool:
    try:
        import llama_cpp  # noqa: F401
    except ImportError:
        return False
    return True


def available() -> bool:
    return _in_process() or bool(os.environ.get("LLAMA_CPP_PYTHON"))


def run(worker: str, *args: Any) -> Any:
    """Execute `worker` (Python source defining `run(*args)`) next to llama_cpp and return what run returned.
    None when llama.cpp is not available (callers skip with NOT_AVAILABLE)."""
    if _in_process():
        namespace: dict[str, Any] = {}
        exec(worker, namespace)
        return namespace["run"](*args)
    python = os.environ.get("LLAMA_CPP_PYTHON")
    if not python:
        return None
    code = worker + "\nimport json, sys\njson.dump(run(*json.load(sys.stdin)), sys.stdout)\n"
    out = subprocess.run([python, "-c", code], input=json.dumps(list(args)), capture_output=True, text=True)
    if out.returncode:
        raise RuntimeError(f"llama.cpp worker failed ({python}):\n{out.stderr[-3000:]}")
    return json.loads(out.stdout)
