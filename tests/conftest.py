"""Shared fixtures. The installed package registers its backends through entry points; when the tests run from a
source tree without installation (development), register them in-process instead."""

from __future__ import annotations

import importlib

import pytest

import ggml_py


def _ensure_builtin_backends() -> None:
    names = ggml_py.registry.names()
    for name, module in (("numpy", "ggml_py_numpy"), ("simd", "ggml_py_simd")):
        if name in names:
            continue
        try:
            mod = importlib.import_module(module)
        except ImportError:
            continue
        if not hasattr(mod, "register"):
            continue
        ggml_py.registry.register(name, mod.register, source=f"test conftest ({module})")


_ensure_builtin_backends()


def available_backends() -> list[str]:
    out = []
    for info in ggml_py.registry.infos():
        try:
            info.load()
            out.append(info.name)
        except Exception:
            pass
    return out


@pytest.fixture
def rng():
    import numpy as np

    return np.random.default_rng(1234)
