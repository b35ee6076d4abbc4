"""Reads sanitizer logs: fails on any ASan error report, and on any leak allocated by ggml_py's own native code.

CPython frees few of its objects at exit, so a run of the suite under LSan always reports leaks; they are the
interpreter's, not ours. A leak is attributed to the first frame of its allocation stack past the allocator itself
(malloc/new interceptors, libstdc++): if that frame is in one of our native modules it is ours. Used by
`make test-asan`, which runs LSan with `stack_trace_format=STACK_TRACE_FORMAT`:

    python tests/lsan_check.py build/asan/log    # reads build/asan/log.<pid>; exit 1 printing what we leaked or erred
"""

from __future__ import annotations

import glob
import re
import sys
from collections.abc import Iterable
from dataclasses import dataclass, field

# The frame format `make test-asan` asks for, so that every frame names its module (symbolized or not).
STACK_TRACE_FORMAT = "    #%n %p in %f %S [%m]"
# Our native code: the simd extension and the C ABI example (by module), or our sources (by file).
OURS = re.compile(r"ggml_py_simd/_simd[^/\]]*\.so|libggml_py_|/csrc/simd/|/csrc/include/ggml_py/|/examples/c-backend/|"
                  r"/tests/plugins/")
# Frames that only pass an allocation on: the sanitizer's interceptors and the C++ runtime.
ALLOCATOR = re.compile(r"lib(asan|lsan|ubsan|stdc\+\+)[.-][^/\]]*\]$|\bin (__interceptor_\w+|operator new)")
RECORD = re.compile(r"^(Direct|Indirect) leak of (\d+) byte\(s\) in (\d+) object\(s\) allocated from:")
FRAME = re.compile(r"^\s+#\d+ ")


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


def main(prefix: str) -> int:
    paths = sorted(glob.glob(glob.escape(prefix) + ".*"))
    leaks: list[Leak] = []
    errs: list[str] = []
    for p in paths:
        with open(p, errors="replace") as f:
            text = f.read()
        leaks += parse(text.splitlines())
        errs += errors(text)
    ours = [lk for lk in leaks if lk.ours]
    print(f"lsan: {len(paths)} log(s), {len(leaks)} leak record(s), {sum(lk.nbytes for lk in leaks)} bytes; "
          f"from ggml_py's native code: {len(ours)} record(s), {sum(lk.nbytes for lk in ours)} bytes; "
          f"other sanitizer errors: {len(errs)}")
    for lk in ours:
        print(f"\n{lk.kind} leak of {lk.nbytes} bytes:\n  " + "\n  ".join(lk.frames))
    for e in errs:
        print("\n" + e)
    return 1 if ours or errs else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
