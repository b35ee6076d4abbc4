"""Quantize a GGUF model to another weight type or mixture (Q4_K_M, Q8_0, ...), as llama-quantize does.

The per-tensor rules are llama.cpp's (ggml_py/formats/quantize.py); the bytes come from ggml_py's own quantizers.
See docs/quantize.md.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any


def add_arguments(p: argparse.ArgumentParser) -> None:
    from ggml_py.formats.quantize_policy import ALIASES, MIXTURES

    p.add_argument("input", help="GGUF model to read")
    p.add_argument("output", help="GGUF file to write (refused if it exists, unless --force; never the input)")
    p.add_argument("type", help=f"file type: {', '.join(MIXTURES)} (also {', '.join(ALIASES)})")
    p.add_argument("--allow-requantize", action="store_true",
                   help="allow converting tensors that are quantized already (dequantized, then requantized)")
    p.add_argument("--output-type", default=None, metavar="T", help="type of output.weight (e.g. Q8_0, F16)")
    p.add_argument("--token-embedding-type", default=None, metavar="T", help="type of token_embd.weight")
    p.add_argument("--pure", action="store_true",
                   help="every quantizable tensor in the file type's default type: no mixture rules")
    p.add_argument("--force", action="store_true", help="replace the output file if it exists")


def run(args: argparse.Namespace) -> dict[str, Any]:
    from ggml_py.formats.quantize import quantize_file
    from ggml_py.formats.quantize_policy import TensorPlan

    tty = not args.json and sys.stderr.isatty()

    def progress(i: int, n: int, p: TensorPlan) -> None:
        if tty:
            line = f"[{i + 1:4d}/{n}] {p.name:<36} {p.src.name:>6} -> {p.dst.name:<6}"
            print(f"\r{line:<80}", end="", file=sys.stderr, flush=True)

    try:
        r = quantize_file(args.input, args.output, args.type, allow_requantize=args.allow_requantize,
                          output_type=args.output_type, token_embedding_type=args.token_embedding_type,
                          pure=args.pure, force=args.force, progress=progress)
    finally:
        if tty:
            print("\r" + " " * 80 + "\r", end="", file=sys.stderr, flush=True)
    if not args.json:
        mib = 2**20
        print(f"{r.output}: {r.type} (file type {r.file_type}), {r.n_tensors} tensors: "
              + ", ".join(f"{k} x{v}" for k, v in r.tensor_types.items()))
        print(f"  size {r.input_bytes / mib:.1f} MiB -> {r.output_bytes / mib:.1f} MiB "
              f"({r.output_bytes / max(r.input_bytes, 1):.2f}x) in {r.seconds:.1f} s"
              + (f", {r.n_requantized} tensors requantized" if r.n_requantized else ""))
        if r.fallbacks:
            kinds: dict[str, int] = {}
            for f in r.fallbacks:
                kind = f.split(": ", 1)[1]
                kinds[kind] = kinds.get(kind, 0) + 1
            print(f"  {len(r.fallbacks)} tensors fell back to another type (rows not a multiple of the block): "
                  + ", ".join(f"{k} x{v}" for k, v in kinds.items()))
        if r.dropped_keys:
            print(f"  metadata not copied (empty arrays): {', '.join(r.dropped_keys)}", file=sys.stderr)
    return r.as_dict()
