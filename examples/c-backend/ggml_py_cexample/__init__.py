"""The example native backend as an installable package: the `ggml_py.backends` entry point is library_path."""

from __future__ import annotations

import importlib.machinery
from pathlib import Path


def library_path() -> str:
    """The plugin's shared library, built next to this file (its name carries the platform's extension suffix)."""
    here = Path(__file__).resolve().parent
    for suffix in importlib.machinery.EXTENSION_SUFFIXES:
        lib = here / f"_plugin{suffix}"
        if lib.exists():
            return str(lib)
    raise FileNotFoundError(f"the cexample plugin library is not built in {here}")
