"""The llama.cpp the comparisons run (commands/llamacpp_venv.py): the pinned version, built without AMX; a venv whose
marker names another wheel directory is rebuilt, not trusted."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from ggml_py.commands import llamacpp_venv

import llamacpp_peer

needs_llamacpp = pytest.mark.skipif(not llamacpp_peer.available(), reason=llamacpp_peer.NOT_AVAILABLE)

SYSTEM_INFO_WORKER = """
import llama_cpp


def run():
    return [llama_cpp.__version__, llama_cpp.llama_print_system_info().decode()]
"""


def _made_here(python: str) -> bool:
    """The peer's venv was made by `make llamacpp-venv` (its marker names our wheel directory), not handed in."""
    return os.path.isfile(os.path.join(os.path.dirname(os.path.dirname(python)), llamacpp_venv.MARKER))


@needs_llamacpp
def test_peer_is_the_pinned_version_and_ours_is_built_without_amx():
    """Any llama-cpp-python of the pinned version may be the peer (LLAMA_CPP_PYTHON); the one `make test` builds
    must also be free of AMX, whose product faults on this kind of machine."""
    version, info = llamacpp_peer.run(SYSTEM_INFO_WORKER)
    assert version == llamacpp_venv.VERSION
    if _made_here(os.environ.get("LLAMA_CPP_PYTHON", "")):
        assert "AMX_INT8 = 1" not in info, info
        assert "AVX2 = 1" in info or "AVX2" not in open("/proc/cpuinfo").read().upper(), info  # still built native


@needs_llamacpp
def test_a_venv_from_another_wheel_is_not_ready(monkeypatch, tmp_path):
    """is_ready trusts a venv only when its marker names this module's wheel directory and llama_cpp imports there:
    a venv made from another build is rebuilt. Shown on a stand-in venv whose python is the peer's, whichever way the
    peer was made."""
    python = os.environ.get("LLAMA_CPP_PYTHON") or sys.executable
    venv = tmp_path / "venv"
    exe = Path(llamacpp_venv.venv_python(str(venv)))
    exe.parent.mkdir(parents=True)
    exe.write_text(f'#!/bin/sh\nexec "{python}" "$@"\n')
    exe.chmod(0o755)
    assert not llamacpp_venv.is_ready(str(venv))  # no marker
    (venv / llamacpp_venv.MARKER).write_text(llamacpp_venv.WHEELS + "\n")
    assert llamacpp_venv.is_ready(str(venv))
    monkeypatch.setattr(llamacpp_venv, "WHEELS", llamacpp_venv.WHEELS + "-other")
    assert not llamacpp_venv.is_ready(str(venv))


def test_the_kept_wheel_is_named_after_the_cpu(tmp_path):
    """The wheel is built with -march=native: its directory carries a hash of the CPU's flags, so a cache moved to a
    CPU with other features (AVX-512 or not) builds anew, and the flags' order does not matter."""
    def tag(flags: str) -> str:
        path = tmp_path / "cpuinfo"
        path.write_text(f"processor\t: 0\nflags\t\t: {flags}\n")
        return llamacpp_venv.cpu_tag(str(path))

    zen3 = "fpu sse sse2 avx avx2 fma f16c"
    assert tag(zen3) == tag("avx2 fma fpu sse sse2 avx f16c") != tag(zen3 + " avx512f avx512bw avx512vl")
    assert llamacpp_venv.WHEELS.endswith("-" + llamacpp_venv.cpu_tag())
