"""The `ggml-py` command line. Each subcommand lives in ggml_py/commands/<name>.py.

Conventions: `error: <one line>` on stderr and exit 1 for failures (2 for usage errors), a traceback only with
--debug; every command takes --json and then prints exactly one JSON object on stdout.
"""

from __future__ import annotations

import argparse
import importlib
import json
import math
import sys
from collections.abc import Sequence
from typing import Any

from ggml_py.errors import GgmlPyError

# subcommand name -> module in ggml_py.commands (imported only when used, so `ggml-py --help` stays fast)
COMMANDS = {
    "backends": "backends",
    "test-backend": "test_backend",
    "bench": "bench",
    "generate": "generate",
    "serve": "serve",
    "eval": "eval",
    "perplexity": "perplexity",
    "embed": "embed",
    "tokenize": "tokenize",
    "info": "info",
    "quantize": "quantize",
    "config": "config",
    "new-backend": "new_backend",
}


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # type: ignore[override]
        self.print_usage(sys.stderr)
        print(f"error: {message}", file=sys.stderr)
        raise SystemExit(2)


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="ggml-py", description="ggml_py: prepare a graph once, execute it every step.")
    p.add_argument("--debug", action="store_true", help="show tracebacks")
    sub = p.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    for name, module in COMMANDS.items():
        mod = importlib.import_module(f"ggml_py.commands.{module}")
        sp = sub.add_parser(name, help=mod.__doc__.strip().splitlines()[0] if mod.__doc__ else None)
        sp.add_argument("--json", action="store_true", help="print one JSON object on stdout")
        sp.add_argument("--debug", action="store_true", help="show tracebacks")
        mod.add_arguments(sp)
        sp.set_defaults(_run=mod.run)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "command", None):
        parser.print_help(sys.stderr)
        return 2
    try:
        result: Any = args._run(args)
    except KeyboardInterrupt:
        sys.stdout.flush()
        print("\nerror: interrupted", file=sys.stderr)  # on a line of its own after partial output
        return 130
    except Exception as e:  # a plugin may raise anything: one line, the traceback under --debug
        if args.debug:
            raise
        msg = " ".join(str(e).split()) or type(e).__name__
        if not isinstance(e, (GgmlPyError, OSError, ValueError)):  # not one of ours: say what it was
            msg = f"{type(e).__name__}: {msg} (run with --debug for the traceback)"
        print(f"error: {msg}", file=sys.stderr)
        return 1
    code = 0
    if isinstance(result, tuple):
        result, code = result
    if args.json and result is not None:
        print(json.dumps(_finite(result), default=_jsonable, allow_nan=False))
    return code


def _jsonable(o: object) -> object:
    if hasattr(o, "tolist"):
        return _finite(o.tolist())  # numpy scalars and arrays
    return str(o)


def _finite(o: Any) -> Any:
    """NaN and infinities become null, as JavaScript's JSON.stringify does: bare NaN is not JSON."""
    if isinstance(o, float):
        return o if math.isfinite(o) else None
    if isinstance(o, dict):
        return {k: _finite(v) for k, v in o.items()}
    if isinstance(o, list | tuple):
        return [_finite(v) for v in o]
    return o


if __name__ == "__main__":
    raise SystemExit(main())
