"""Runs test files under ASan+UBSan+LSan and reads the sanitizer logs: fails on any ASan error report, and on any
leak allocated by ggml_py's own native code.

CPython frees few of its objects at exit, so a run of the suite under LSan always reports leaks; they are the
interpreter's, not ours. A leak is attributed to the first frame of its allocation stack past the allocator itself
(malloc/new interceptors, libstdc++): if that frame is in one of our native modules it is ours.

Each test file runs in a process of its own (`make test-asan`; short files a few together, ASAN_GROUPED):
LeakSanitizer's exit-time check suspends every thread with ptrace, and in a long, large process it can fail by itself
("LeakSanitizer has encountered a fatal error"; seen once in CI after all tests had passed). Such a failure of the
tool, not a finding, is retried twice, and fails the run if it persists. Its known deterministic cause, LSan
misreading glibc's dynamic TLS blocks of dlopen'd modules (the tracer segfaults; google/sanitizers#1322, hit in CI by
a CLI child process), is avoided with `intercept_tls_get_addr=0`: LSan then does not scan dynamic TLS, where our code
keeps no pointers.

    python tests/lsan_check.py run build/asan tests/test_model.py ...   # pytest per file under the sanitizers
    python tests/lsan_check.py run --jobs 2 build/asan tests/test_*.py  # two files at a time
    python tests/lsan_check.py run build/asan tests/test_core.py+tests/test_leaks.py  # both in one process
    python tests/lsan_check.py build/asan/log                            # only read build/asan/log.<pid>
"""

from __future__ import annotations

import glob
import os
import re
import subprocess
import sys
import time
from collections.abc import Iterable
from dataclasses import dataclass, field

# The frame format `make test-asan` asks for, so that every frame names its module (symbolized or not).
STACK_TRACE_FORMAT = "    #%n %p in %f %S [%m]"
# Our native code: the simd extension and the C ABI example (by module), or our sources (by file).
OURS = re.compile(r"ggml_py_simd/_simd[^/\]]*\.so|libggml_py_|/csrc/simd/|/ggml_py/include/ggml_py/|"
                  r"/examples/c-backend/|/tests/plugins/")
# Frames that only pass an allocation on: the sanitizer's interceptors and the C++ runtime.
ALLOCATOR = re.compile(r"lib(asan|lsan|ubsan|stdc\+\+)[.-][^/\]]*\]$|\bin (__interceptor_\w+|operator new)")
RECORD = re.compile(r"^(Direct|Indirect) leak of (\d+) byte\(s\) in (\d+) object\(s\) allocated from:")
FRAME = re.compile(r"^\s+#\d+ ")
# LeakSanitizer failing to run (its tracer could not stop the threads), as opposed to a report.
TOOL_FAILURE = re.compile(r"LeakSanitizer has encountered a fatal error|Tracer caught signal")
ATTEMPTS = 3


@dataclass
class Leak:
    kind: str
    nbytes: int
    frames: list[str] = field(default_factory=list)

    @property
    def origin(self) -> str:
        """The first frame past the allocator ("" if the stack has none)."""
        return next((f for f in self.frames if not ALLOCATOR.search(f)), "")

    @property
    def ours(self) -> bool:
        return bool(OURS.search(self.origin))


def parse(lines: Iterable[str]) -> list[Leak]:
    leaks: list[Leak] = []
    cur: Leak | None = None
    for line in lines:
        m = RECORD.match(line)
        if m:
            cur = Leak(m.group(1), int(m.group(2)))
            leaks.append(cur)
        elif cur is not None and FRAME.match(line):
            cur.frames.append(line.strip())
        elif cur is not None and not line.strip():
            cur = None
    return leaks


def errors(text: str) -> list[str]:
    """Sanitizer reports other than the leak report (e.g. heap-buffer-overflow), each as its full text."""
    out = []
    for block in text.split("=" * 65):
        if re.search(r"ERROR: AddressSanitizer|runtime error:", block) and "ERROR: LeakSanitizer" not in block:
            out.append(block.strip())
    return out


@dataclass
class Logs:
    """What the sanitizers wrote to `prefix.<pid>`, one file per process."""

    paths: list[str]
    leaks: list[Leak]
    errors: list[str]
    tool_failures: list[str]

    @classmethod
    def read(cls, prefix: str) -> Logs:
        logs = cls(sorted(glob.glob(glob.escape(prefix) + ".*")), [], [], [])
        for p in logs.paths:
            with open(p, errors="replace") as f:
                text = f.read()
            logs.leaks += parse(text.splitlines())
            logs.errors += errors(text)
            if TOOL_FAILURE.search(text):
                # the tool's own lines (the tracer's signal, LSan's hints), not the leak records around them
                own = [ln for ln in text.splitlines() if ln.startswith(("Tracer", "==")) and "leak" not in ln]
                logs.tool_failures.append(f"{p}:\n" + "\n".join(own[-20:]))
        return logs

    def report(self, what: str) -> int:
        """Prints the summary and what is ours or an error; 1 if the run must fail."""
        ours = [lk for lk in self.leaks if lk.ours]
        print(f"lsan: {what}{len(self.paths)} log(s), {len(self.leaks)} leak record(s), "
              f"{sum(lk.nbytes for lk in self.leaks)} bytes; from ggml_py's native code: {len(ours)} record(s), "
              f"{sum(lk.nbytes for lk in ours)} bytes; other sanitizer errors: {len(self.errors)}")
        for lk in ours:
            print(f"\n{lk.kind} leak of {lk.nbytes} bytes:\n  " + "\n  ".join(lk.frames))
        for e in self.errors:
            print("\n" + e)
        return 1 if ours or self.errors else 0


def main(prefix: str) -> int:
    return Logs.read(prefix).report("")


def sanitizer_env(prefix: str) -> dict[str, str]:
    """ASan with LSan at exit, logging to `prefix.<pid>`; `exitcode=0` because CPython always leaks at exit, and
    `abort_on_error=1` so that memory errors still stop the process. The runtimes are preloaded because the
    interpreter is not instrumented."""
    def lib(name: str) -> str:
        return subprocess.run(["gcc", f"-print-file-name={name}"], capture_output=True, text=True,
                              check=True).stdout.strip()
    asan = ["detect_leaks=1", "exitcode=0", "abort_on_error=1", "intercept_tls_get_addr=0", f"log_path={prefix}",
            f'stack_trace_format="{STACK_TRACE_FORMAT}"']
    env = dict(os.environ, ASAN_OPTIONS=":".join(asan), UBSAN_OPTIONS="halt_on_error=1:print_stacktrace=1",
               LD_PRELOAD=f"{lib('libasan.so')} {lib('libubsan.so')}")
    return env


def run_file(log_dir: str, path: str, quiet: bool = False) -> int:
    """pytest on one file in a process of its own under the sanitizers (retried when LSan itself fails); 1 if a
    test, a check or LSan fails. `path` may name several files joined by "+", run in one process (short files: a
    process's start and LSan's exit scan cost seconds each). `quiet`: pytest's output is captured and printed with
    the verdict (parallel runs)."""
    paths = path.split("+")
    name = "+".join(os.path.splitext(os.path.basename(p))[0] for p in paths)
    for attempt in range(1, ATTEMPTS + 1):
        prefix = os.path.join(log_dir, f"{name}.{attempt}", "log")
        os.makedirs(os.path.dirname(prefix), exist_ok=True)
        for old in glob.glob(glob.escape(prefix) + ".*"):
            os.remove(old)
        # RSS tests are meaningless under ASan's allocator (freed memory stays in quarantine): LSan checks leaks here;
        # python_only tests reach no native path that the others leave out
        cmd = [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", "-m",
               "not rss and not python_only", *paths]
        env = sanitizer_env(prefix)
        t0 = time.monotonic()
        if quiet:
            r = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
            print(f"lsan: {path}:\n{(r.stdout or '').strip()[-6000:]}")
        else:
            r = subprocess.run(cmd, env=env)
        rc = r.returncode
        logs = Logs.read(prefix)
        bad = logs.report(f"{path} (attempt {attempt}, pytest exit {rc}, {time.monotonic() - t0:.0f} s): ")
        if logs.tool_failures and not bad and attempt < ATTEMPTS:
            print(f"lsan: LeakSanitizer itself failed in {len(logs.tool_failures)} process(es); retrying")
            continue
        for failure in logs.tool_failures:
            print("\nLeakSanitizer failed to run in " + failure)
        return int(bool(bad or rc != 0 or logs.tool_failures))
    return 1


def run(log_dir: str, test_files: list[str], jobs: int = 1) -> int:
    """pytest on each file in a process of its own under the sanitizers, `jobs` files at a time; 1 if any fails."""
    if jobs <= 1:
        return int(any([run_file(log_dir, p) for p in test_files]))
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(jobs) as ex:
        return int(any(list(ex.map(lambda p: run_file(log_dir, p, quiet=True), test_files))))


if __name__ == "__main__":
    if sys.argv[1:2] == ["run"]:
        args = sys.argv[2:]
        jobs = 1
        if args[:1] == ["--jobs"]:
            jobs, args = int(args[1]), args[2:]
        sys.exit(run(args[0], args[1:], jobs))
    sys.exit(main(sys.argv[1]))
