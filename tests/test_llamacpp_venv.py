"""The llama.cpp the comparisons run (commands/llamacpp_venv.py): the pinned version, built without AMX; a venv whose
marker names another wheel directory is rebuilt, not trusted."""

from __future__ import annotations

import os

import pytest

from ggml_py.commands import llamacpp_venv

import llamacpp_peer

needs_llamacpp = pytest.mark.skipif(not llamacpp_peer.available(), reason=llamacpp_peer.NOT_AVAILABLE)

SYSTEM_INFO_WORKER = """
import llama_cpp


def run():
    return [llama_cpp.__version__, llama_cpp.llama_print_system_info().decode()]
"""


@needs_llamacpp
def test_peer_is_the_pinned_version_without_amx():
    version, info = llamacpp_peer.run(SYSTEM_INFO_WORKER)
    assert version == llamacpp_venv.VERSION
    assert "AMX_INT8 = 1" not in info, info  # its AMX product faults on this kind of machine
    assert "AVX2 = 1" in info or "AVX2" not in open("/proc/cpuinfo").read().upper(), info  # still built native


@needs_llamacpp
def test_a_venv_from_another_wheel_is_not_ready(monkeypatch):
    python = os.environ.get("LLAMA_CPP_PYTHON")
    if not python:
        pytest.skip("llama_cpp is importable here: no side venv to look at")
    venv = os.path.dirname(os.path.dirname(python))
    assert llamacpp_venv.is_ready(venv)
    monkeypatch.setattr(llamacpp_venv, "WHEELS", llamacpp_venv.WHEELS + "-other")
    assert not llamacpp_venv.is_ready(venv)
