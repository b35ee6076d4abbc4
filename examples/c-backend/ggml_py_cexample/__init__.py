"""The example native backend as an installable package: the `ggml_py.backends` entry point is library_path."""

from __future__ import annotations

import sys
from pathlib import Path

# built by setup.py next to this file; no CPython tag in the name: the wheel serves every Python 3
LIBRARY = "libggml_py_cexample" + (".dll" if sys.platform == "win32" else ".so")


def library_path() -> str:
    """The plugin's shared library, built next to this file."""
    lib = Path(__file__).resolve().parent / LIBRARY
    if not lib.is_file():
        raise FileNotFoundError(f"the cexample plugin library is not built: {lib}")
    return str(lib)
