"""Embed texts: one vector per text (the model's final hidden states, pooled and L2-normalized; docs/models.md)."""

from __future__ import annotations

import argparse
import sys
from typing import Any

import numpy as np

from ggml_py.commands._model_args import add_model_arguments, add_run_arguments, load_from_args
from ggml_py.commands.eval import out_path
from ggml_py.errors import ModelError

SHOWN = 4  # values shown at each end of a vector (without --json)


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_model_arguments(p)
    p.add_argument("-p", "--prompt", action="append", required=True,
                   help="a text to embed (special tokens parsed); repeat for several, embedded together")
    p.add_argument("--pooling", default=None, choices=["mean", "cls", "last"],
                   help="how a text's token vectors make one (default: the file's pooling_type, else mean)")
    p.add_argument("--no-normalize", action="store_true", help="do not L2-normalize the vectors")
    p.add_argument("--out", default=None, help="also write the vectors (n_texts x n_embd float32) to this .npy file")
    add_run_arguments(p)


def run(args: argparse.Namespace) -> dict[str, Any]:
    out = out_path(args.out) if args.out else None
    model = load_from_args(args)
    try:
        vecs = model.embed(args.prompt, normalize=not args.no_normalize, pooling=args.pooling)
        emb = model._embedder
        n_tokens = [len(model.tokenize(t)) for t in args.prompt]
        if out is not None:
            try:
                np.save(out, vecs)
            except OSError as e:
                raise ModelError(f"cannot write {out}: {e.strerror or e}") from None
        if not args.json:
            for i, (v, n) in enumerate(zip(vecs, n_tokens)):
                head = " ".join(f"{x:.6f}" for x in v[:SHOWN])
                tail = " ".join(f"{x:.6f}" for x in v[-SHOWN:])
                print(f"embedding {i} ({n} tokens): {head} ... {tail}")
            if len(vecs) > 1:  # cosine similarities (dot products of the normalized vectors)
                unit = vecs / np.maximum(np.linalg.norm(vecs, axis=1, keepdims=True), 1e-30)
                print("cosine similarity:")
                for row in unit @ unit.T:
                    print(" ".join(f"{x:6.3f}" for x in row))
            print(f"{len(vecs)} x {vecs.shape[1]} float32, {emb.pooling if args.pooling is None else args.pooling} "
                  f"pooling, {emb.tokens} tokens in {emb.steps} steps on {','.join(model.backend_names)}",
                  file=sys.stderr)
        return {"model": model.path, "backends": model.backend_names, "n_embd": int(vecs.shape[1]),
                "pooling": args.pooling or emb.pooling, "normalized": not args.no_normalize, "tokens": n_tokens,
                "embeddings": vecs.tolist(), "out": out}
    finally:
        model.close()
