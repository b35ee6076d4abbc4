"""Serve a model over HTTP: an OpenAI-compatible API with continuous batching (needs ggml_py[server])."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from ggml_py.commands._model_args import add_model_arguments
from ggml_py.errors import ModelError


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_model_arguments(p)
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default: 127.0.0.1)")
    p.add_argument("--port", type=int, default=8080, help="port (default: 8080; 0 picks a free one)")
    p.add_argument("-np", "--parallel", type=int, default=4,
                   help="sequences decoded together (default: 4); more requests wait in the queue")
    p.add_argument("-c", "--ctx", type=int, default=None, dest="ctx",
                   help="KV cache cells shared by all sequences; each may use ctx / parallel "
                        "(default: parallel x min(2048, the model's context))")
    p.add_argument("--queue", type=int, default=64, help="requests waiting beyond which the server answers 503 "
                   "(default: 64)")
    p.add_argument("-b", "--batch", type=int, default=128, help="tokens per step: decode tokens + prompt chunks "
                   "(default: 128)")
    p.add_argument("-n", "--max-tokens", type=int, default=None, dest="max_tokens",
                   help="default max_tokens of chat requests (default: until EOS or the sequence's context; "
                        "completions default to 16 as OpenAI's)")
    p.add_argument("--alias", default=None, help="the model name the API reports (default: the file name)")
    p.add_argument("-t", "--threads", type=int, default=None, help="threads per backend (default: the backend's)")
    p.add_argument("--backend", default=None, help="comma-separated backends in order of preference")
    p.add_argument("--kv-type", default="F16", choices=["F16", "F32", "f16", "f32"], help="KV cache type")
    p.add_argument("--log-level", default="warning", choices=["critical", "error", "warning", "info", "debug"],
                   help="uvicorn's log level (default: warning)")


def run(args: argparse.Namespace) -> dict[str, Any]:
    from ggml_py.models import load_model
    from ggml_py.serving.server import require_server_extra, serve

    require_server_extra()
    for name in ("parallel", "queue", "batch"):
        v = getattr(args, name)
        if v < (0 if name == "queue" else 1):
            raise ModelError(f"--{name} must be {'>= 0' if name == 'queue' else 'positive'}, got {v}")
    if not 0 <= args.port <= 65535:
        raise ModelError(f"--port must be in [0, 65535], got {args.port}")
    if args.ctx is not None and args.ctx < 2 * args.parallel:
        raise ModelError(f"--ctx {args.ctx} is too small for {args.parallel} parallel sequences")
    model = load_model(args.model, backends=args.backend, n_threads=args.threads, n_ctx=None,
                       kv_type=args.kv_type.upper())
    try:
        ctx = args.ctx or args.parallel * min(2048, model.hparams.n_ctx_train)

        def log(msg: str) -> None:
            print(msg, file=sys.stderr, flush=True)

        metrics = serve(model, host=args.host, port=args.port, n_parallel=args.parallel, n_ctx=ctx,
                        max_queue=args.queue, n_batch=args.batch, model_name=args.alias,
                        default_max_tokens=args.max_tokens, log=log, log_level=args.log_level)
        log(f"ggml-py serve: stopped after {metrics['requests_finished']} requests, "
            f"{metrics['tokens_generated']} tokens generated")
        return {"model": model.path, "metrics": metrics}
    finally:
        model.close()
