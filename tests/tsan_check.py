"""Runs the thread tests under ThreadSanitizer (`make test-tsan`) and fails on any report.

The SIMD extension (and the C plugins the tests build, see test_native_plugin.build) are compiled with
-fsanitize=thread; the interpreter is not, so the runtime is preloaded. A report counts when one of its
stacks is in ggml_py's native code or a test plugin (a race, a lock-order inversion...); reports whose stacks are
all in uninstrumented libraries (numpy, OpenBLAS) are counted apart and printed as a number.
Each target (a test file or node id) runs in a process of its own; reports go to `<log_dir>/<target>/log.<pid>`.

    python tests/tsan_check.py build/tsan tests/test_concurrency.py tests/test_interrupt.py ...
    python tests/tsan_check.py build/tsan tests/test_native_plugin.py::test_cancel_from_another_thread
    python tests/tsan_check.py --jobs 2 build/tsan ...  (two targets at a time, each one's output when it ends)
"""

from __future__ import annotations

import glob
import os
import re
import subprocess
import sys

REPORT = re.compile(r"^WARNING: ThreadSanitizer: .*$|^ThreadSanitizer: .*$", re.M)
# our native code: the simd extension, the C plugins the tests build (as in lsan_check.OURS)
OURS = re.compile(r"ggml_py_simd/_simd[^/)\s]*\.so|libggml_py_|/csrc/simd/|/ggml_py/include/ggml_py/|"
                  r"/examples/c-backend/|/tests/plugins/|testplug|cexample|slowplug")


def tsan_env(prefix: str) -> dict[str, str]:
    lib = subprocess.run(["gcc", "-print-file-name=libtsan.so"], capture_output=True, text=True,
                         check=True).stdout.strip()
    opts = ["halt_on_error=0", "exitcode=0", f"log_path={prefix}", "second_deadlock_stack=1",
            "report_signal_unsafe=0"]  # CPython's own signal handling is not ours and not instrumented
    # OpenBLAS's worker threads synchronise by spinning on plain memory: TSan sees races between numpy's copies and
    # BLAS kernels that are not there; one BLAS thread removes that noise (our code is not involved either way)
    return dict(os.environ, TSAN_OPTIONS=":".join(opts), LD_PRELOAD=lib, GGML_PY_SANITIZE="thread",
                OPENBLAS_NUM_THREADS="1")


def reports(prefix: str) -> tuple[list[str], int]:
    """The reports with a frame in our native code, and the number of other reports (uninstrumented libraries
    only, e.g. numpy's memmove against OpenBLAS: TSan cannot see their synchronisation)."""
    ours, others = [], 0
    for p in sorted(glob.glob(glob.escape(prefix) + ".*")):
        with open(p, errors="replace") as f:
            text = f.read()
        for block in text.split("=" * 18):
            if REPORT.search(block):
                if OURS.search(block):
                    ours.append(f"{p}:\n{block.strip()}")
                else:
                    others += 1
    return ours, others


def run_target(log_dir: str, target: str, quiet: bool = False) -> int:
    """pytest on one target (a file, or file::test) in a process of its own; 1 if a test fails or TSan reports.
    `quiet`: pytest's output is captured and printed with the verdict (parallel runs)."""
    name = re.sub(r"\W+", "_", os.path.basename(target).replace(".py", ""))
    prefix = os.path.join(log_dir, name, "log")
    os.makedirs(os.path.dirname(prefix), exist_ok=True)
    for old in glob.glob(glob.escape(prefix) + ".*"):
        os.remove(old)
    p = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", target],
                       env=tsan_env(prefix), capture_output=quiet, text=True)
    found, others = reports(prefix)
    lines = [p.stdout + p.stderr] if quiet else []
    lines.append(f"tsan: {target}: pytest exit {p.returncode}, {len(found)} ThreadSanitizer report(s) in our code "
                 f"({others} in uninstrumented libraries only, not counted)")
    lines += ["\n" + r for r in found]
    print("\n".join(lines), flush=True)
    return int(p.returncode != 0 or bool(found))


def run(log_dir: str, targets: list[str], jobs: int = 1) -> int:
    """Each target in a process of its own, `jobs` at a time; 1 if any fails."""
    if jobs <= 1:
        return int(any([run_target(log_dir, t) for t in targets]))
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(jobs) as ex:
        return int(any(list(ex.map(lambda t: run_target(log_dir, t, quiet=True), targets))))


if __name__ == "__main__":
    args, jobs = sys.argv[1:], 1
    if args[:1] == ["--jobs"]:
        jobs, args = int(args[1]), args[2:]
    sys.exit(run(args[0], args[1:], jobs))
