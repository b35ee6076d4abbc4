"""Evaluate a prompt and write the float32 logits of every position (n_tokens x n_vocab) to a .npy file."""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

import numpy as np

from ggml_py.commands._model_args import add_model_arguments, add_run_arguments, load_from_args
from ggml_py.commands.generate import read_prompt
from ggml_py.errors import ModelError


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_model_arguments(p)
    g = p.add_mutually_exclusive_group(required=True)
    g.add_argument("-p", "--prompt", help="prompt text (special tokens parsed)")
    g.add_argument("-f", "--file", default=None, help="read the prompt from a file")
    p.add_argument("--out", required=True, help="output .npy file")
    p.add_argument("--no-special", action="store_true", help="do not add BOS/EOS (as the model asks by default)")
    add_run_arguments(p)


def out_path(out: str) -> str:
    """The file the logits go to: np.save appends .npy to a name without it, so say so up front, and refuse a
    directory (np.save would write DIR.npy beside it) before any work is done."""
    if out.endswith(os.sep) or os.path.isdir(out):
        raise ModelError(f"--out {out} is a directory; give a file name, e.g. {os.path.join(out, 'logits.npy')}")
    return out if out.endswith(".npy") else out + ".npy"


def run(args: argparse.Namespace) -> dict[str, Any]:
    text = read_prompt(args)
    args.out = out_path(args.out)
    model = load_from_args(args)
    try:
        ids = model.tokenize(text, add_special=not args.no_special)
        if not ids:
            raise ModelError("the prompt is empty (no tokens)")
        logits = model.eval(ids)
        try:
            np.save(args.out, logits)
        except OSError as e:
            raise ModelError(f"cannot write {args.out}: {e.strerror or e}") from None
        t = model.timings
        top = [int(i) for i in np.argmax(logits, axis=-1)]
        if not args.json:
            print(f"{len(ids)} tokens -> logits {logits.shape[0]} x {logits.shape[1]} float32 written to {args.out}")
            print(f"next token after the prompt: {top[-1]} {model.detokenize([top[-1]])!r}")
            print(f"{t['prefill_tok_s']:.1f} tok/s on {','.join(model.backend_names)}", file=sys.stderr)
        return {"model": model.path, "backends": model.backend_names, "tokens": ids, "out": args.out,
                "shape": list(logits.shape), "argmax": top, "timings": t}
    finally:
        model.close()
