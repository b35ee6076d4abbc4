"""Generate text from a prompt: streams it to stdout, ends with prefill/decode tok/s on stderr."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from ggml_py.commands._model_args import add_model_arguments, add_run_arguments, load_from_args
from ggml_py.commands.profile_report import model_profile_lines
from ggml_py.errors import ModelError

DEFAULT_PROMPT = "The three primary colors are"


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_model_arguments(p)
    p.add_argument("-p", "--prompt", default=DEFAULT_PROMPT, help=f"prompt text (default: {DEFAULT_PROMPT!r})")
    p.add_argument("-f", "--file", default=None, help="read the prompt from a file (overrides -p)")
    p.add_argument("-n", "--n-predict", type=int, default=128, dest="n_predict", help="tokens to generate")
    p.add_argument("--temp", type=float, default=0.8, help="temperature (0 = greedy)")
    p.add_argument("--top-k", type=int, default=40, dest="top_k", help="top-k (0 disables)")
    p.add_argument("--top-p", type=float, default=0.95, dest="top_p", help="top-p (1 disables)")
    p.add_argument("--min-p", type=float, default=0.05, dest="min_p", help="min-p (0 disables)")
    p.add_argument("--repeat-penalty", type=float, default=1.0, dest="repeat_penalty", help="1 disables")
    p.add_argument("--repeat-last-n", type=int, default=64, dest="repeat_last_n",
                   help="tokens the repeat penalty looks back on (-1 all, 0 disables)")
    p.add_argument("-s", "--seed", type=int, default=None, help="random seed (default: fresh entropy)")
    p.add_argument("--ignore-eos", action="store_true", help="keep generating after an end-of-generation token")
    p.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template as a user turn")
    p.add_argument("--system", default=None, help="with --chat: a system message")
    p.add_argument("--profile", action="store_true",
                   help="time every step: how the model is split between backends, time per backend and op")
    add_run_arguments(p)


def chat_prompt(model: Any, text: str, system: str | None = None) -> tuple[str, bool]:
    """The prompt rendered with the chat template, and whether BOS/EOS should still be added when tokenizing."""
    messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": text}]
    rendered = model.apply_chat_template(messages, add_generation_prompt=True)
    bos = model.tokenizer.bos_token
    return rendered, not (bos and rendered.startswith(bos))


def read_prompt(args: argparse.Namespace) -> str:
    if args.file is None:
        return str(args.prompt)
    try:
        with open(args.file, encoding="utf-8") as f:
            return f.read()
    except (OSError, UnicodeDecodeError) as e:
        raise ModelError(f"cannot read the prompt file {args.file}: {getattr(e, 'strerror', None) or e}") from None


def run(args: argparse.Namespace) -> dict[str, Any]:
    if args.n_predict < 0:
        raise ModelError(f"-n must be >= 0, got {args.n_predict}")
    text = read_prompt(args)
    model = load_from_args(args)
    try:
        prompt, add_special = chat_prompt(model, text, args.system) if args.chat else (text, True)
        if args.profile:
            model.start_profiling()
        stream = model.generate(prompt, args.n_predict, temperature=args.temp, top_k=args.top_k, top_p=args.top_p,
                                min_p=args.min_p, repeat_penalty=args.repeat_penalty,
                                repeat_last_n=args.repeat_last_n, seed=args.seed, stop_at_eos=not args.ignore_eos,
                                add_special=add_special)
        pieces: list[str] = []
        tokens: list[int] = []
        for tok in stream:
            tokens.append(tok.id)
            pieces.append(tok.text)
            if not args.json:
                sys.stdout.write(tok.text)
                sys.stdout.flush()
        t = model.timings
        text = "".join(pieces)
        if not args.json:
            sys.stdout.write("\n")
            sys.stdout.flush()
            print(f"prefill: {t['prefill_tokens']} tokens, {t['prefill_tok_s']:.1f} tok/s | decode: "
                  f"{t['decode_tokens']} tokens, {t['decode_tok_s']:.1f} tok/s | host overhead "
                  f"{100 * t['host_overhead_frac']:.1f}% | plans prepared {t['plans_prepared']}, reused "
                  f"{t['plans_reused']} | backends {','.join(model.backend_names)}", file=sys.stderr)
        profile = model.profile_report() if args.profile else None
        if profile is not None and not args.json:
            print("\n".join(model_profile_lines(profile)), file=sys.stderr)
        return {"model": model.path, "backends": model.backend_names, "prompt_tokens": list(model.prompt_tokens),
                "tokens": tokens, "text": text, "timings": t, "plans_prepared": model.plans_prepared,
                "plans_reused": model.plans_reused, "graph_reuse": model.graph_reuse, "n_ctx": model.n_ctx,
                "profile": profile}
    finally:
        model.close()
