"""llama-cpp-python in a venv of its own: the peer the tests and `ggml-py bench --vs-llamacpp` compare with.

pip builds llama.cpp from source for this CPU (3-8 minutes on 2 cores), less the multimodal library, which nothing
here uses (-25% build time), and less AMX: on a KVM machine whose CPU reports AMX, llama.cpp 0.3.36's AMX matrix
product faulted at its first tile instruction (SIGSEGV in ggml_backend_amx_mul_mat, 2026-12-05). The wheel is kept
in a directory named after the version, the flags and the CPU's features (a native build may not run on another
CPU), not left to pip's cache, whose key ignores CMAKE_ARGS (a wheel built there with other flags would be reused),
and is installed over whatever build the venv held.

Standard library only: `make llamacpp-venv` runs this file with the system python before ggml_py is installed
(`python ggml_py/commands/llamacpp_venv.py VENV`).
"""

from __future__ import annotations

import hashlib
import os
import platform
import subprocess
import sys
from collections.abc import Callable

VERSION = "0.3.36"
NO_AMX = "-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"  # explicit -mno-* win over -march=native in any order
CMAKE_ARGS = f"-DLLAVA_BUILD=OFF -DCMAKE_C_FLAGS='{NO_AMX}' -DCMAKE_CXX_FLAGS='{NO_AMX}'"


def cpu_tag(cpuinfo: str = "/proc/cpuinfo") -> str:
    """A short hash of the machine and its CPU's feature flags: the wheel is built with -march=native, and one built
    where AVX-512 exists would fault on a machine without it, so a cache that moves to another CPU builds anew."""
    flags = platform.machine() + " "
    try:
        with open(cpuinfo) as f:
            flags += next((line for line in f if line.startswith(("flags", "Features"))), "")
    except OSError:
        pass
    return hashlib.sha256(" ".join(sorted(flags.split())).encode()).hexdigest()[:10]


WHEELS = os.path.join(os.path.expanduser("~"), ".cache", "ggml_py", "wheels",
                      f"llama-cpp-python-{VERSION}-native-noamx-{cpu_tag()}")
MARKER = ".ggml_py-llamacpp"  # in the venv: the wheel directory its llama-cpp-python came from


def venv_python(venv: str) -> str:
    return os.path.join(venv, "Scripts" if os.name == "nt" else "bin", "python")


def is_ready(venv: str) -> bool:
    """The venv holds llama-cpp-python from this module's wheel and it imports."""
    py = venv_python(venv)
    try:
        with open(os.path.join(venv, MARKER)) as f:
            if f.read().strip() != WHEELS:
                return False
    except OSError:
        return False
    return subprocess.run([py, "-c", "import llama_cpp"], capture_output=True).returncode == 0


def _wheels() -> list[str]:
    """The kept wheels of VERSION, sorted."""
    if not os.path.isdir(WHEELS):
        return []
    return sorted(f for f in os.listdir(WHEELS) if f.startswith(f"llama_cpp_python-{VERSION}-"))


def _pip(py: str, args: list[str], log: Callable[[str], None], env: dict[str, str] | None = None) -> None:
    proc = subprocess.Popen([py, "-m", "pip", *args], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=env)
    assert proc.stdout is not None
    for line in proc.stdout:
        line = line.rstrip()
        if line and not line.startswith("WARNING: Location"):
            log(f"  pip: {line[:150]}")
    if proc.wait() != 0:
        raise RuntimeError(f"pip {' '.join(args[:2])} ... failed (exit {proc.returncode})")


def ensure(venv: str, log: Callable[[str], None] = print) -> str:
    """The python of `venv` with llama-cpp-python VERSION built without AMX: the venv created, the wheel built once
    (into WHEELS) and installed, as needed. Raises RuntimeError when pip fails."""
    py = venv_python(venv)
    if is_ready(venv):
        return py
    if not os.path.exists(py):
        log(f"creating venv {venv} for llama-cpp-python ...")
        subprocess.run([sys.executable, "-m", "venv", venv], check=True)
    if not _wheels():
        log(f"building llama-cpp-python {VERSION} without AMX into {WHEELS} (llama.cpp from source, 3-8 minutes) ...")
        env = dict(os.environ, CMAKE_ARGS=f"{CMAKE_ARGS} {os.environ.get('CMAKE_ARGS', '')}".strip())
        _pip(py, ["wheel", "--no-deps", "--no-cache-dir", "-w", WHEELS, f"llama-cpp-python=={VERSION}"], log, env)
    wheel = os.path.join(WHEELS, _wheels()[-1])
    log(f"installing {wheel} into {venv} ...")
    _pip(py, ["install", wheel], log)  # with its dependencies
    _pip(py, ["install", "--force-reinstall", "--no-deps", wheel], log)  # over another build of the same version
    with open(os.path.join(venv, MARKER), "w") as f:
        f.write(WHEELS + "\n")
    return py


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit(f"usage: {sys.argv[0]} VENV")
    try:
        print(ensure(sys.argv[1]))
    except (RuntimeError, subprocess.CalledProcessError) as e:
        sys.exit(f"llamacpp_venv: {e}")
