"""Perplexity of a model on a text, chunk by chunk as llama-perplexity; KL divergence from a base model's saved
distributions (--kl-divergence-base FILE, then --kl-divergence).

    ggml-py perplexity -m MODEL -f TEXT [-c 512] [--chunks N]                      # PPL = exp(mean NLL) ± its error
    ggml-py perplexity -m BASE -f TEXT --kl-divergence-base base.npz               # ... and save BASE's distributions
    ggml-py perplexity -m QUANT --kl-divergence-base base.npz --kl-divergence      # QUANT against them

Procedure: ggml_py/models/perplexity.py; statistics: ggml_py/models/perplexity_stats.py; the file:
ggml_py/models/kld_base.py; docs/quantize.md, "What a quant type costs".
"""

from __future__ import annotations

import argparse
import hashlib
import os
import sys
import time
from typing import Any

import numpy as np

from ggml_py.commands._model_args import add_model_arguments, add_run_arguments, load_from_args
from ggml_py.errors import ModelError

DEFAULT_CTX = 512  # llama-perplexity's default -c


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_model_arguments(p)
    p.add_argument("-f", "--file", default=None,
                   help="the text (UTF-8); optional with --kl-divergence, whose base holds the tokens")
    p.add_argument("--chunks", type=int, default=None, help="evaluate at most N chunks (default: all)")
    p.add_argument("--kl-divergence-base", default=None, metavar="FILE", dest="kld_base",
                   help="save the model's log-probabilities of the scored positions to FILE (.npz); with "
                        "--kl-divergence, read them from FILE instead")
    p.add_argument("--kl-divergence", nargs="?", const=True, default=None, metavar="FILE", dest="kld",
                   help="compare with the base in FILE (default: --kl-divergence-base's): KL divergence, Δp, top-1")
    add_run_arguments(p, ctx_help=f"tokens per chunk (default: {DEFAULT_CTX}; with --kl-divergence, the base's)")


def _read_text(path: str) -> str:
    if os.path.isdir(path):
        raise ModelError(f"the text {path} is a directory")
    try:
        with open(path, encoding="utf-8") as f:
            return f.read()
    except (OSError, UnicodeDecodeError) as e:
        raise ModelError(f"cannot read the text {path}: {getattr(e, 'strerror', None) or e}") from None


def _check_writable(path: str) -> None:
    """Refuse a base file that cannot be written before the model loads and the chunks run."""
    folder = os.path.dirname(os.path.abspath(path))
    if os.path.isdir(path):
        raise ModelError(f"--kl-divergence-base {path} is a directory; give a file name")
    if not os.path.isdir(folder):
        raise ModelError(f"cannot write {path}: the folder {folder} does not exist")


def _progress(args: argparse.Namespace, total: int, desc: str) -> Any:
    """A tqdm bar on stderr, none with --json (stdout then holds only the JSON object)."""
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit="chunk", file=sys.stderr, disable=bool(args.json), leave=True,
                dynamic_ncols=True)


def run(args: argparse.Namespace) -> dict[str, Any]:
    from ggml_py.models.kld_base import BaseReader

    if args.chunks is not None and args.chunks < 1:
        raise ModelError(f"--chunks must be at least 1, got {args.chunks}")
    base_path = args.kld if isinstance(args.kld, str) else args.kld_base
    if args.kld and not base_path:
        raise ModelError("--kl-divergence needs the base: --kl-divergence FILE or --kl-divergence-base FILE")
    if args.kld:
        base = BaseReader(base_path)  # refused here, before the model loads, when it is not a base file
        if args.ctx_size is not None and args.ctx_size != base.n_ctx:
            raise ModelError(f"{base_path} was computed with chunks of {base.n_ctx} tokens; -c {args.ctx_size} "
                             f"differs (leave -c out)")
        args.ctx_size = base.n_ctx
    elif args.file is None:
        raise ModelError("no text: give one with -f TEXT")
    else:
        base = None
        args.ctx_size = DEFAULT_CTX if args.ctx_size is None else args.ctx_size
        if args.kld_base:
            _check_writable(args.kld_base)
    text = _read_text(args.file) if args.file is not None else None
    model = load_from_args(args)
    try:
        if base is not None:
            return _kl_divergence(args, model, base, text)
        assert text is not None
        return _perplexity(args, model, text)
    finally:
        model.close()
        if base is not None:
            base.close()


def _chunks_of(args: argparse.Namespace, model: Any, text: str) -> tuple[Any, int]:
    from ggml_py.models.perplexity import make_chunks, tokenize_text

    tokens = tokenize_text(model, text)
    tok = model.tokenizer
    return make_chunks(tokens, args.ctx_size, args.chunks, tok.bos_id if tok.add_bos else None), len(tokens)


def _describe(args: argparse.Namespace, model: Any, chunks: Any, n_tokens: int) -> dict[str, Any]:
    return {"model": model.path, "backends": model.backend_names, "text": args.file, "n_tokens": n_tokens,
            "n_ctx": chunks.n_ctx, "n_chunks": chunks.n_chunks, "first": chunks.first, "n_scored": chunks.n_scored,
            "bos_replaced": chunks.bos is not None}


def _perplexity(args: argparse.Namespace, model: Any, text: str) -> dict[str, Any]:
    from ggml_py.models.kld_base import BaseWriter, vocab_fingerprint
    from ggml_py.models.perplexity import evaluate_chunks
    from ggml_py.models.perplexity_stats import Perplexity, token_nll

    chunks, n_tokens = _chunks_of(args, model, text)
    info = _describe(args, model, chunks, n_tokens)
    if not args.json:
        _intro(info)
    writer = None
    if args.kld_base:
        tok = model.tokenizer
        writer = BaseWriter(args.kld_base, {
            "n_ctx": chunks.n_ctx, "n_chunks": chunks.n_chunks, "first": chunks.first, "n_scored": chunks.n_scored,
            "n_vocab": model.n_vocab, "add_bos": bool(tok.add_bos), "bos_id": tok.bos_id,
            "vocab_sha256": vocab_fingerprint(tok), "model": model.path, "text": args.file,
            "text_sha256": hashlib.sha256(text.encode("utf-8")).hexdigest()})
    ppl = Perplexity()
    running: list[float] = []
    t0 = time.perf_counter()
    bar = _progress(args, chunks.n_chunks, "perplexity")
    try:
        for c in evaluate_chunks(model, chunks):
            nll = token_nll(c.logprobs, c.targets)
            ppl.add(nll)
            running.append(ppl.estimate()[0])
            if writer is not None:
                writer.add(chunks.tokens[c.index], c.logprobs, nll, c.top)
            bar.set_postfix_str(f"PPL {running[-1]:.4f}", refresh=False)
            bar.update(1)
        if writer is not None:
            writer.close()
    except BaseException:
        if writer is not None:
            writer.abort()
        raise
    finally:
        bar.close()
    seconds = time.perf_counter() - t0
    value, unc = ppl.estimate()
    if not args.json:
        print(",".join(f"[{i + 1}]{v:.4f}" for i, v in enumerate(running)) + ",")
        print(f"Final estimate: PPL = {value:.4f} +/- {unc:.5f}")
        _timing(model, chunks, seconds)
        if writer is not None:
            print(f"log-probabilities of {ppl.count} positions saved to {args.kld_base}", file=sys.stderr)
    return {**info, "ppl": value, "ppl_uncertainty": unc, "mean_nll": float(np.log(value)), "count": ppl.count,
            "running": running, "kl_divergence_base": args.kld_base, "seconds": seconds,
            "tok_s": chunks.n_chunks * chunks.n_ctx / seconds if seconds > 0 else None}


def _kl_divergence(args: argparse.Namespace, model: Any, base: Any, text: str | None) -> dict[str, Any]:
    from ggml_py.models.kld_base import vocab_fingerprint
    from ggml_py.models.perplexity import Chunks, evaluate_chunks
    from ggml_py.models.perplexity_stats import Divergence, divergence

    tok = model.tokenizer
    meta = base.meta
    if meta["n_vocab"] != model.n_vocab or meta["vocab_sha256"] != vocab_fingerprint(tok):
        raise ModelError(f"{base.path} was computed with another vocabulary or tokenizer ({meta['n_vocab']} tokens, "
                         f"model {meta.get('model')}) than {model.path} ({model.n_vocab} tokens): compare quants of "
                         f"one model")
    n = base.n_chunks if args.chunks is None else min(args.chunks, base.n_chunks)
    chunks = Chunks(base.tokens[:n], tok.bos_id if tok.add_bos else None)
    n_tokens = int(base.tokens.size)
    if text is not None:
        mine, n_tokens = _chunks_of(args, model, text)
        if mine.n_chunks < n or not np.array_equal(mine.tokens[:n], chunks.tokens):
            raise ModelError(f"{args.file} is not the text {base.path} was computed on (its tokens differ from the "
                             f"base's {n} chunks of {base.n_ctx}; base text: {meta.get('text')})")
    info = {**_describe(args, model, chunks, n_tokens), "base": base.path, "base_model": meta.get("model"),
            "base_text": meta.get("text")}
    if not args.json:
        _intro(info)
    div = Divergence()
    rows: list[dict[str, Any]] = []
    t0 = time.perf_counter()
    bar = _progress(args, n, "KL divergence")
    try:
        for c, base_lp in zip(evaluate_chunks(model, chunks), base.logprobs()):
            div.add(divergence(c.logprobs, base_lp, c.targets, base.nll[c.index], base.top[c.index]))
            rows.append({"chunk": c.index + 1, **div.running()})
            bar.set_postfix_str(f"KLD {rows[-1]['kld'][0]:.5f}", refresh=False)
            bar.update(1)
    finally:
        bar.close()
    seconds = time.perf_counter() - t0
    summary = div.summary()
    if not args.json:
        _print_kld(rows, summary)
        _timing(model, chunks, seconds)
    return {**info, "ppl": summary["ppl"]["value"], "ppl_uncertainty": summary["ppl"]["uncertainty"],
            "count": summary["count"], "chunks": rows, "kl_divergence": summary, "seconds": seconds,
            "tok_s": n * chunks.n_ctx / seconds if seconds > 0 else None}


def _intro(info: dict[str, Any]) -> None:
    bos = "its first token replaced by BOS" if info["bos_replaced"] else "no BOS"
    print(f"perplexity: {info['n_tokens']} tokens, {info['n_chunks']} chunks of {info['n_ctx']} ({bos}), "
          f"{info['n_scored']} positions scored per chunk (from {info['first']})", file=sys.stderr)


def _timing(model: Any, chunks: Any, seconds: float) -> None:
    n = chunks.n_chunks * chunks.n_ctx
    print(f"{n} tokens in {seconds:.2f} s ({n / seconds:.1f} tok/s) on {','.join(model.backend_names)}",
          file=sys.stderr)


def _pm(v: tuple[float, float], width: int, prec: int, scale: float = 1.0) -> str:
    return f"{scale * v[0]:{width}.{prec}f} ± {scale * v[1]:{width}.{prec}f}"


def _print_kld(rows: list[dict[str, Any]], s: dict[str, Any]) -> None:
    """llama-perplexity's KL-divergence output: the running table per chunk, then the three blocks of statistics."""
    print("chunk             PPL               ln(PPL(Q)/PPL(base))          KL Divergence              Δp RMS"
          "            Same top p")
    for r in rows:
        print(f"{r['chunk']:4d}    {_pm(r['ppl'], 9, 4)}    {_pm(r['ln_ppl_ratio'], 10, 5)}    "
              f"{_pm(r['kld'], 10, 5)}    {_pm(r['rms_dp'], 6, 3, 100)} %    {_pm(r['same_top'], 6, 3, 100)} %")
    p, b = s["ppl"], s["ppl_base"]
    print("\n====== Perplexity statistics ======")
    print(f"Mean PPL(Q)                   : {p['value']:10.6f} ± {p['uncertainty']:10.6f}")
    print(f"Mean PPL(base)                : {b['value']:10.6f} ± {b['uncertainty']:10.6f}")
    print(f"Cor(ln(PPL(Q)), ln(PPL(base))): {100 * s['ln_ppl_correlation']:6.2f}%")
    for label, k in (("Mean ln(PPL(Q)/PPL(base))", "ln_ppl_ratio"), ("Mean PPL(Q)/PPL(base)", "ppl_ratio"),
                     ("Mean PPL(Q)-PPL(base)", "ppl_diff")):
        print(f"{label:30s}: {s[k]['value']:10.6f} ± {s[k]['uncertainty']:10.6f}")
    k = s["kld"]
    print("\n====== KL divergence statistics ======")
    print(f"Mean    KLD: {k['mean']:10.6f} ± {k['uncertainty']:10.6f}")
    for label, key in (("Maximum KLD", "max"), ("99.9%   KLD", "p99.9"), ("99.0%   KLD", "p99"), ("95.0%   KLD", "p95"),
                       ("90.0%   KLD", "p90"), ("Median  KLD", "median"), ("10.0%   KLD", "p10"),
                       (" 5.0%   KLD", "p5"), (" 1.0%   KLD", "p1"), (" 0.1%   KLD", "p0.1"), ("Minimum KLD", "min")):
        print(f"{label}: {k[key]:10.6f}")
    d = s["dp"]
    print("\n====== Token probability statistics ======")
    print(f"Mean    Δp: {100 * d['mean']:6.3f} ± {100 * d['uncertainty']:5.3f} %")
    for label, key in (("Maximum Δp", "max"), ("99.9%   Δp", "p99.9"), ("99.0%   Δp", "p99"), ("95.0%   Δp", "p95"),
                       ("90.0%   Δp", "p90"), ("75.0%   Δp", "p75"), ("Median  Δp", "median"), ("25.0%   Δp", "p25"),
                       ("10.0%   Δp", "p10"), (" 5.0%   Δp", "p5"), (" 1.0%   Δp", "p1"), (" 0.1%   Δp", "p0.1"),
                       ("Minimum Δp", "min")):
        print(f"{label}: {100 * d[key]:6.3f}%")
    print(f"RMS Δp    : {100 * d['rms']:6.3f} ± {100 * d['rms_uncertainty']:5.3f} %")
    print(f"Same top p: {100 * s['same_top']['value']:6.3f} ± {100 * s['same_top']['uncertainty']:5.3f} %")
