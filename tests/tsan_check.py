"""Runs the thread tests under ThreadSanitizer (`make test-tsan`) and fails on any report.

The SIMD extension (and the C plugins the tests build, see test_native_plugin.build) are compiled with
-fsanitize=thread; the interpreter is not, so the runtime is preloaded. Only instrumented code is checked: a
report is a race (or a lock-order inversion, a signal-unsafe call...) involving ggml_py's native code or a plugin.
Each target (a test file or node id) runs in a process of its own; reports go to `<log_dir>/<target>/log.<pid>`.

    python tests/tsan_check.py build/tsan tests/test_concurrency.py tests/test_interrupt.py ...
    python tests/tsan_check.py build/tsan tests/test_native_plugin.py::test_cancel_from_another_thread
"""

from __future__ import annotations

import glob
import os
import re
import subprocess
import sys

REPORT = re.compile(r"^WARNING: ThreadSanitizer: .*$|^ThreadSanitizer: .*$", re.M)


def tsan_env(prefix: str) -> dict[str, str]:
    lib = subprocess.run(["gcc", "-print-file-name=libtsan.so"], capture_output=True, text=True,
                         check=True).stdout.strip()
    opts = ["halt_on_error=0", "exitcode=0", f"log_path={prefix}", "second_deadlock_stack=1",
            "report_signal_unsafe=0"]  # CPython's own signal handling is not ours and not instrumented
    return dict(os.environ, TSAN_OPTIONS=":".join(opts), LD_PRELOAD=lib, GGML_PY_SANITIZE="thread")


def reports(prefix: str) -> list[str]:
    out = []
    for p in sorted(glob.glob(glob.escape(prefix) + ".*")):
        with open(p, errors="replace") as f:
            text = f.read()
        for block in text.split("=" * 18):
            if REPORT.search(block):
                out.append(f"{p}:\n{block.strip()}")
    return out


def run(log_dir: str, targets: list[str]) -> int:
    """pytest on each target (a file, or file::test) in a process of its own; 1 if a test fails or TSan reports."""
    failed = 0
    for target in targets:
        name = re.sub(r"\W+", "_", os.path.basename(target).replace(".py", ""))
        prefix = os.path.join(log_dir, name, "log")
        os.makedirs(os.path.dirname(prefix), exist_ok=True)
        for old in glob.glob(glob.escape(prefix) + ".*"):
            os.remove(old)
        rc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", target],
                            env=tsan_env(prefix)).returncode
        found = reports(prefix)
        print(f"tsan: {target}: pytest exit {rc}, {len(found)} ThreadSanitizer report(s)")
        for r in found:
            print("\n" + r)
        failed |= rc != 0 or bool(found)
    return int(failed)


if __name__ == "__main__":
    sys.exit(run(sys.argv[1], sys.argv[2:]))
