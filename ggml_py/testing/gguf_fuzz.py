"""Seeded mutation fuzzing of `ggml_py.formats.gguf.open_gguf`.

Each case takes a valid tiny model (several variants), applies 1-4 byte-level mutations (bit flips, bytes and
structure-aware fields set to interesting values, truncation, insertion, deletion, splicing with another model)
and loads the result. `open_gguf` may accept it or raise `GGUFError`; any other exception is a bug. An accepted
file must also give every tensor's data view with the declared size.

Case `i` of seed `s` depends on nothing else, so a failure is replayed with ``--seed s --case i``.

    python -m ggml_py.testing.gguf_fuzz --cases 100000 --seed 1
    python -m ggml_py.testing.gguf_fuzz --seed 1 --case 1234 --dump case.gguf    # replay one case
    python -m ggml_py.testing.gguf_fuzz --atheris -- -runs=100000                 # coverage-guided (needs atheris)
"""

from __future__ import annotations

import argparse
import os
import random
import re
import struct
import sys
import tempfile
import time
import traceback
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

from ggml_py.errors import GGUFError
from ggml_py.formats.gguf import GGUFFile, open_gguf
from ggml_py.testing.gguf_corpus import field_spans, tiny_model

__all__ = ["Base", "FuzzFailure", "FuzzStats", "bases", "category", "check_bytes", "main", "mutate", "run"]

INTERESTING_BYTES = (0x00, 0x01, 0x02, 0x04, 0x08, 0x0C, 0x0D, 0x20, 0x40, 0x7F, 0x80, 0xFE, 0xFF)
INTERESTING_INTS = (
    0, 1, 2, 3, 4, 5, 7, 8, 9, 12, 13, 16, 24, 31, 32, 33, 64, 255, 256, 0x7FFF, 0xFFFF, 0x7FFFFFFF, 0x80000000,
    0xFFFFFFFF, 2**32, 2**61, 2**62, 2**63 - 1, 2**63, 2**64 - 1,
)  # fmt: skip


@dataclass(frozen=True)
class Base:
    """A valid model to mutate, with the byte ranges of its fields."""

    name: str
    data: bytes
    spans: tuple[tuple[str, int, int], ...]
    header_end: int  # where the data section starts


def bases() -> list[Base]:
    """The valid models the fuzzer starts from: varied alignment, version, tensors or not."""
    out = []
    variants = {
        "tiny": tiny_model(),
        "tiny-seed1-align64": tiny_model(seed=1, alignment=64),
        "tiny-align8": tiny_model(seed=2, alignment=8),
        "no-tensors": tiny_model(with_tensors=False),
    }
    v2 = bytearray(variants["tiny"])
    v2[4:8] = struct.pack("<I", 2)
    variants["tiny-v2"] = bytes(v2)
    for name, data in variants.items():
        spans = tuple(field_spans(data))
        header_end = max(e for n, _, e in spans if not n.startswith("data["))
        out.append(Base(name, data, spans, header_end))
    return out


def _pos(rng: random.Random, b: bytearray, header_end: int) -> int:
    """A position, mostly inside the header (where the parser looks)."""
    if not b:
        return 0
    hi = min(len(b), header_end) if rng.random() < 0.85 else len(b)
    return rng.randrange(max(hi, 1))


def mutate(rng: random.Random, base: Base, donors: list[Base]) -> bytes:
    """Apply 1-4 random mutations to `base.data`."""
    b = bytearray(base.data)
    for _ in range(rng.choice((1, 1, 1, 2, 2, 3, 4))):
        op = rng.randrange(10)
        p = _pos(rng, b, base.header_end)
        if op == 0 and b:  # bit flips
            for _ in range(rng.randint(1, 4)):
                q = min(len(b) - 1, p + rng.randrange(4))
                b[q] ^= 1 << rng.randrange(8)
        elif op == 1 and b:  # interesting bytes
            for _ in range(rng.randint(1, 3)):
                b[min(len(b) - 1, p + rng.randrange(3))] = rng.choice(INTERESTING_BYTES)
        elif op in (2, 3):  # a field (structure-aware) or any spot set to an interesting integer
            if op == 2:
                _, s, e = rng.choice(base.spans)
                p, width = s, e - s if e - s in (1, 2, 4, 8) else 8
            else:
                width = rng.choice((4, 8))
            v = rng.choice(INTERESTING_INTS + (len(b), len(b) - base.header_end, len(b) + 1))
            if rng.random() < 0.2:
                v += rng.choice((-1, 1))
            raw = (v % 2 ** (8 * width)).to_bytes(width, "little")
            b[p : p + width] = raw
        elif op == 4:  # truncation
            del b[p:]
        elif op == 5:  # insertion of random or interesting bytes
            n = rng.choice((1, 2, 4, 8, rng.randint(1, 64)))
            ins = bytes(rng.choice(INTERESTING_BYTES) if rng.random() < 0.5 else rng.randrange(256) for _ in range(n))
            b[p:p] = ins
        elif op == 6:  # deletion of a chunk
            del b[p : p + rng.choice((1, 2, 4, 8, rng.randint(1, 64)))]
        elif op == 7:  # duplicate a chunk of itself somewhere else
            n = rng.randint(1, 128)
            chunk = b[p : p + n]
            q = _pos(rng, b, base.header_end)
            b[q:q] = chunk
        elif op == 8:  # splice: our head, a donor's tail
            d = rng.choice(donors)
            q = _pos(rng, bytearray(d.data), d.header_end)
            b = b[:p] + d.data[q:]
        else:  # copy a donor's field over ours
            d = rng.choice(donors)
            _, s, e = rng.choice(d.spans)
            b[p : p + (e - s)] = d.data[s:e]
    return bytes(b)


def category(reason: str) -> str:
    """A reason with its numbers, names and lists blanked out, for counting by kind."""
    r = re.sub(r"b'(?:[^'\\]|\\.)*'|'(?:[^'\\]|\\.)*'|\"[^\"]*\"", "'…'", reason)
    r = re.sub(r"\[[^\])]*[\])]", "[…]", r)
    r = re.sub(r"0x[0-9a-fA-F]+|(?<![A-Za-z0-9_-])\d+", "N", r)
    return r


def _exercise(g: GGUFFile) -> None:
    """Use everything an accepted file offers; sizes must agree with what the header declared."""
    for name, t in g.tensors.items():
        a = g.data(name)
        if a.nbytes != t.nbytes or t.offset + t.nbytes > g.file_size or t.offset % g.alignment:
            raise AssertionError(f"tensor {name!r}: view of {a.nbytes} bytes, info {t}")
    repr(g)
    _ = g.architecture


def check_bytes(data: bytes, path: str) -> str | None:
    """Write `data` to `path` and load it: the GGUFError reason, or None when accepted. Other exceptions propagate."""
    with open(path, "wb") as f:
        f.write(data)
    try:
        g = open_gguf(path)
    except GGUFError as e:
        return e.reason
    with g:
        _exercise(g)
    return None


@dataclass
class FuzzFailure:
    seed: int
    case: int
    base: str
    error: str
    data: bytes


@dataclass
class FuzzStats:
    cases: int = 0
    accepted: int = 0
    elapsed: float = 0.0
    slowest: float = 0.0
    slowest_case: int = -1
    by_category: Counter[str] = field(default_factory=Counter)
    by_base: Counter[str] = field(default_factory=Counter)
    failures: list[FuzzFailure] = field(default_factory=list)

    def summary(self, top: int = 25) -> str:
        rate = self.cases / self.elapsed if self.elapsed else 0.0
        lines = [
            f"cases: {self.cases}  rejected: {self.cases - self.accepted - len(self.failures)}  "
            f"accepted: {self.accepted}  failures: {len(self.failures)}",
            f"elapsed: {self.elapsed:.1f} s ({rate:.0f} cases/s), slowest case: {self.slowest * 1e3:.1f} ms "
            f"(#{self.slowest_case})",
            f"rejection reasons: {len(self.by_category)} categories",
        ]
        for cat, n in self.by_category.most_common(top):
            lines.append(f"  {n:7d}  {cat}")
        if len(self.by_category) > top:
            rest = sum(n for _, n in self.by_category.most_common()[top:])
            lines.append(f"  {rest:7d}  ({len(self.by_category) - top} more categories)")
        for f in self.failures[:10]:
            lines.append(f"FAILURE seed={f.seed} case={f.case} base={f.base}: {f.error.splitlines()[-1]}")
        return "\n".join(lines)


def case_rng(seed: int, case: int) -> random.Random:
    return random.Random(seed * 1_000_003 + case)


def make_case(seed: int, case: int, pool: list[Base]) -> tuple[Base, bytes]:
    """The mutated bytes of case `case` of seed `seed` (deterministic)."""
    rng = case_rng(seed, case)
    base = rng.choice(pool)
    return base, mutate(rng, base, pool)


def run(
    cases: int,
    seed: int,
    *,
    start: int = 0,
    progress: Callable[[FuzzStats], None] | None = None,
    progress_every: int = 10_000,
    stop_on_failure: bool = False,
) -> FuzzStats:
    """Run cases `start .. start+cases-1` of `seed`; failures are collected, not raised."""
    pool = bases()
    stats = FuzzStats()
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="gguf_fuzz_") as d:
        path = os.path.join(d, "case.gguf")
        for i in range(start, start + cases):
            base, data = make_case(seed, i, pool)
            stats.by_base[base.name] += 1
            t = time.perf_counter()
            try:
                reason = check_bytes(data, path)
            except Exception:
                stats.failures.append(FuzzFailure(seed, i, base.name, traceback.format_exc(), data))
                if stop_on_failure:
                    stats.cases += 1
                    break
            else:
                if reason is None:
                    stats.accepted += 1
                else:
                    stats.by_category[category(reason)] += 1
            dt = time.perf_counter() - t
            if dt > stats.slowest:
                stats.slowest, stats.slowest_case = dt, i
            stats.cases += 1
            if progress is not None and stats.cases % progress_every == 0:
                stats.elapsed = time.perf_counter() - t0
                progress(stats)
    stats.elapsed = time.perf_counter() - t0
    return stats


def _atheris_main(argv: list[str]) -> None:  # pragma: no cover - optional, needs atheris
    """Coverage-guided fuzzing with atheris (libFuzzer); the seed corpus is our valid and malformed files."""
    import atheris

    import ggml_py.formats.gguf as target

    for name in ("_parse", "value", "array", "string_array", "string_items", "string", "need", "u32", "u64"):
        atheris.instrument_func(getattr(target._Parser, name))  # coverage feedback from the parser only
    d = tempfile.mkdtemp(prefix="gguf_atheris_")
    path = os.path.join(d, "case.gguf")
    corpus = os.path.join(d, "corpus")
    os.makedirs(corpus)
    from ggml_py.testing.gguf_corpus import malformed_cases

    for i, b in enumerate(bases()):
        with open(os.path.join(corpus, f"valid{i}.gguf"), "wb") as f:
            f.write(b.data)
    for i, c in enumerate(malformed_cases()):
        with open(os.path.join(corpus, f"bad{i}.gguf"), "wb") as f:
            f.write(c.data)

    def one(data: bytes) -> None:
        check_bytes(data, path)  # anything but GGUFError propagates and is reported by libFuzzer

    print(f"atheris corpus (seeded with {len(os.listdir(corpus))} files): {corpus}", flush=True)
    atheris.Setup([sys.argv[0], *argv, corpus], one)
    atheris.Fuzz()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m ggml_py.testing.gguf_fuzz", description=__doc__.split("\n")[0])
    ap.add_argument("--cases", type=int, default=10_000, help="number of cases (default 10000)")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--start", type=int, default=0, help="first case index")
    ap.add_argument("--case", type=int, default=None, help="replay this single case and show its outcome")
    ap.add_argument("--dump", default=None, help="with --case: write the case's bytes to this file")
    ap.add_argument("--every", type=int, default=10_000, help="progress line every N cases")
    ap.add_argument("--atheris", action="store_true", help="coverage-guided run with atheris; libFuzzer args follow")
    args, rest = ap.parse_known_args(argv)
    if args.atheris:
        _atheris_main([a for a in rest if a != "--"])
        return 0
    if rest:
        ap.error(f"unrecognized arguments: {' '.join(rest)}")
    if args.case is not None:
        base, data = make_case(args.seed, args.case, bases())
        if args.dump:
            with open(args.dump, "wb") as f:
                f.write(data)
        with tempfile.TemporaryDirectory() as d:
            reason = check_bytes(data, os.path.join(d, "case.gguf"))
        outcome = "accepted" if reason is None else f"GGUFError: {reason}"
        print(f"seed {args.seed} case {args.case} (base {base.name}, {len(data)} bytes): {outcome}")
        return 0

    def progress(s: FuzzStats) -> None:
        line = f"[{s.cases:>8d}/{args.cases}] {s.elapsed:6.1f} s  accepted {s.accepted}  failures {len(s.failures)}"
        print(line, flush=True)

    stats = run(args.cases, args.seed, start=args.start, progress=progress, progress_every=args.every)
    print(stats.summary())
    for f in stats.failures[:3]:
        print(f"--- seed={f.seed} case={f.case} base={f.base}\n{f.error}")
    return 1 if stats.failures else 0


if __name__ == "__main__":
    sys.exit(main())
