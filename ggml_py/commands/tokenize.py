"""Print the token ids of a text (special tokens parsed, BOS/EOS added as the model asks)."""

from __future__ import annotations

import argparse
from typing import Any

from ggml_py.commands._model_args import add_model_arguments


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_model_arguments(p)
    p.add_argument("text", help="text to tokenize")
    p.add_argument("--no-special", action="store_true", help="do not add BOS/EOS")
    p.add_argument("--no-parse-special", action="store_true", help="treat control-token text as plain text")
    p.add_argument("--pieces", action="store_true", help="print one 'id piece' line per token")


def run(args: argparse.Namespace) -> dict[str, Any]:
    from ggml_py.formats.gguf import open_gguf
    from ggml_py.models import default_model_path
    from ggml_py.models.tokenizer import Tokenizer

    path = args.model or default_model_path()
    with open_gguf(path) as gf:
        tok = Tokenizer.from_metadata(gf.metadata)
    ids = tok.encode(args.text, add_special=not args.no_special, parse_special=not args.no_parse_special)
    pieces = [tok.token_to_piece(i).decode("utf-8", "replace") for i in ids]
    if not args.json:
        if args.pieces:
            for i, p in zip(ids, pieces):
                print(f"{i:>8} {p!r}")
        else:
            print(ids)
    return {"model": path, "text": args.text, "tokens": ids, "pieces": pieces, "n_tokens": len(ids)}
