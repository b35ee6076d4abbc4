"""Run the conformance kit on a backend against the numpy reference; exit 1 if a case fails."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from ggml_py.testing import cases, run_backend
from ggml_py.testing.runner import Result


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("name", metavar="NAME", help="the backend to test (as listed by `ggml-py backends`)")
    p.add_argument("--op", default=None, help="only these ops (ggml names, comma-separated), e.g. MUL_MAT,ROPE")
    p.add_argument("-k", dest="substr", default=None, help="only cases whose id OP[TYPES](CASE) contains SUBSTR")
    p.add_argument("--reference", default="numpy", help="the reference backend (default: numpy)")
    p.add_argument("-v", "--verbose", action="store_true", help="list passed and skipped cases too")
    p.add_argument("-q", "--quiet", action="store_true",
                   help="list failed cases only, then the counts (no skipped case, no coverage lines)")


def run(args: argparse.Namespace) -> tuple[dict[str, Any], int]:
    selected = cases(args.substr, op=args.op)
    if not selected:
        raise ValueError(f"no conformance case matches --op {args.op!r} -k {args.substr!r}")

    def progress(r: Result) -> None:
        if r.status == "failed":  # on stderr: stdout carries only the table or the JSON object
            print(f"FAILED {r.op} [{r.types}] ({r.case}): {r.message}", file=sys.stderr)

    report = run_backend(args.name, selected, reference=args.reference, progress=progress if args.json else None)
    if not args.json:
        if args.quiet and args.verbose:
            raise ValueError("--quiet and --verbose exclude each other")
        show = ("passed", "failed", "skipped") if args.verbose else ("failed",) if args.quiet else ("failed", "skipped")
        print(report.table(show=show, coverage=not args.quiet))
    return report.to_dict(), (1 if report.failed else 0)
