"""Serve a model over HTTP: an OpenAI-compatible API with continuous batching (needs ggml_py[server])."""

from __future__ import annotations

import argparse
import math
import os
import signal
import sys
from typing import Any

from ggml_py.commands._model_args import add_backend_opt_argument, add_model_arguments, backend_options
from ggml_py.sysmem import parse_size

API_KEY_ENV = "GGML_PY_API_KEY"


def add_arguments(p: argparse.ArgumentParser) -> None:
    from ggml_py.serving.options import ServeOptions

    d = ServeOptions()
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
    p.add_argument("--no-prefix-cache", action="store_false", dest="prefix_cache",
                   help="do not keep whole blocks of computed prompts for later requests that start with the same "
                        "tokens (on by default; the answers are the same either way: docs/serving.md)")
    p.add_argument("--alias", default=None, help="the model name the API reports (default: the file name)")
    p.add_argument("-t", "--threads", type=int, default=None, help="threads per backend (default: the backend's)")
    p.add_argument("--backend", default=None, help="comma-separated backends in order of preference")
    add_backend_opt_argument(p)
    p.add_argument("--kv-type", default="F16", choices=["F16", "F32", "f16", "f32"], help="KV cache type")
    p.add_argument("--log-level", default="warning", choices=["critical", "error", "warning", "info", "debug"],
                   help="uvicorn's log level (default: warning)")
    c = p.add_argument_group("beyond one machine (docs/cluster.md)")
    c.add_argument("--cluster", default=None, metavar="ADDRESS",
                   help="run the model's blocks as pipeline stages on a Ray cluster: its address (host:port), 'auto' "
                        "(the cluster `ray start` made here) or 'local' (a Ray instance started for this server)")
    c.add_argument("--stages", type=int, default=None,
                   help="with --cluster: pipeline stages (default: one per node of the cluster)")
    c.add_argument("--stage-memory", type=_size, default=None, metavar="SIZE",
                   help="with --cluster: the memory each stage may hold (its weights, KV cache and compute buffer, "
                        "e.g. 600M or 1.5G); the blocks are split to fit, or the server refuses to start")
    c.add_argument("--micro-batches", type=int, default=None, metavar="N",
                   help="with --cluster: split the requests into N micro-batches, one step of each in flight (N = "
                        "stages + 1 keeps every stage busy; pays where steps are bound by arithmetic: "
                        "docs/cluster.md); default 1")
    c.add_argument("--compiled-graph", action="store_true",
                   help="with --cluster: run each step as a Ray compiled graph (experimental: less time per hop, "
                        "but the waiting coordinator spins on a core, and Ray may crash it when a stage dies: "
                        "docs/cluster.md)")
    c.add_argument("--stage-restarts", type=int, default=0, metavar="N",
                   help="with --cluster: start a lost stage again (on a node that holds the model file) and rebuild "
                        "the caches, up to N times in all, instead of failing every request (default 0)")
    g = p.add_argument_group("limits and security (docs/serving.md, \"Limits and security\")")
    g.add_argument("--max-body-bytes", type=int, default=d.max_body_bytes,
                   help=f"larger request bodies get 413, unread (default: {d.max_body_bytes})")
    g.add_argument("--max-prompt-chars", type=int, default=None,
                   help="longer prompts get 400 before they are tokenized (default: a sequence's context in "
                        "tokens x the longest token's bytes)")
    g.add_argument("--max-embedding-inputs", type=int, default=d.max_embedding_inputs,
                   help=f"inputs one /v1/embeddings request may have, else 400 (default: "
                        f"{d.max_embedding_inputs}, as OpenAI)")
    g.add_argument("--header-timeout", type=float, default=d.header_timeout,
                   help=f"seconds for a request head to arrive, else the connection is closed "
                        f"(default: {d.header_timeout:g})")
    g.add_argument("--body-timeout", type=float, default=d.body_timeout,
                   help=f"seconds for a request body to arrive, else 408 (default: {d.body_timeout:g})")
    g.add_argument("--keep-alive-timeout", type=int, default=d.keep_alive_timeout,
                   help=f"seconds an idle keep-alive connection stays open (default: {d.keep_alive_timeout})")
    g.add_argument("--max-connections", type=int, default=d.max_connections,
                   help="open connections beyond which the one waiting longest for its request head is closed "
                        f"(default: {d.max_connections}, lowered to fit the open-file limit)")
    g.add_argument("--drain-timeout", type=float, default=d.drain_timeout,
                   help=f"seconds the open requests may take to finish on Ctrl-C / SIGTERM before they are "
                        f"cancelled (default: {d.drain_timeout:g}); a second signal stops at once")
    g.add_argument("--api-key", default=None,
                   help=f"require 'Authorization: Bearer KEY' on /v1/* and /metrics (default: ${API_KEY_ENV}, "
                        "else none)")
    g.add_argument("--allowed-hosts", default="",
                   help="comma-separated Host names accepted besides the bound address and localhost "
                        "('*' any, '*.example.com' a domain)")
    g.add_argument("--cors-origins", default="",
                   help="comma-separated origins browsers may call the API from, e.g. http://localhost:3000 "
                        "('*' any; default: none, CORS off)")
    p.set_defaults(_serve_parser=p)


def _size(text: str) -> int:
    try:
        return parse_size(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _csv(s: str) -> tuple[str, ...]:
    return tuple(x.strip() for x in s.split(",") if x.strip())


def check_arguments(args: argparse.Namespace) -> list[str]:
    """What is wrong with the flags, one message each (empty: nothing)."""
    bad = []

    def at_least(name: str, lo: float, hi: float | None = None) -> None:
        v = getattr(args, name.lstrip("-").replace("-", "_"))
        if v is None:
            return
        if not math.isfinite(v) or v < lo or (hi is not None and v > hi):
            rng = f">= {lo:g}" if hi is None else f"in [{lo:g}, {hi:g}]"
            bad.append(f"{name} must be {rng}, got {v:g}")

    at_least("--port", 0, 65535)
    at_least("--parallel", 1)
    at_least("--queue", 0)
    at_least("--batch", 1)
    at_least("--max-tokens", 0)
    at_least("--threads", 1)
    at_least("--max-body-bytes", 1024)
    at_least("--max-prompt-chars", 1)
    at_least("--max-embedding-inputs", 1)
    at_least("--header-timeout", 0.01)
    at_least("--body-timeout", 0.01)
    at_least("--keep-alive-timeout", 1)
    at_least("--max-connections", 1)
    at_least("--drain-timeout", 0)
    at_least("--stages", 1)
    at_least("--stage-restarts", 0)
    at_least("--micro-batches", 1)
    for flag, v in (("--stages", args.stages is not None), ("--stage-restarts", args.stage_restarts),
                    ("--stage-memory", args.stage_memory is not None), ("--compiled-graph", args.compiled_graph),
                    ("--micro-batches", args.micro_batches is not None)):
        if v and args.cluster is None:
            bad.append(f"{flag} needs --cluster")
    if args.ctx is not None and args.parallel >= 1 and args.ctx < 2 * args.parallel:
        bad.append(f"--ctx {args.ctx} is too small for {args.parallel} parallel sequences (at least 2 cells each)")
    if args.api_key is not None and not args.api_key.strip():
        bad.append("--api-key is empty")
    for o in _csv(args.cors_origins):
        if o != "*" and not (o.startswith(("http://", "https://")) and "/" not in o.split("://", 1)[1].rstrip("/")):
            bad.append(f"--cors-origins: {o!r} is not an origin (scheme://host[:port], or '*')")
    return bad


def run(args: argparse.Namespace) -> tuple[dict[str, Any], int]:
    from ggml_py.models import load_model
    from ggml_py.serving.http_common import require_server_extra
    from ggml_py.serving.options import ServeOptions

    bad = check_arguments(args)
    if bad:  # a usage error (exit 2), before the model loads: not a 400 blaming every client later
        args._serve_parser.error("; ".join(bad))
    require_server_extra()
    from ggml_py.serving.server import serve

    api_key = args.api_key if args.api_key is not None else (os.environ.get(API_KEY_ENV) or None)
    options = ServeOptions(max_body_bytes=args.max_body_bytes, max_prompt_chars=args.max_prompt_chars,
                           header_timeout=args.header_timeout, body_timeout=args.body_timeout,
                           keep_alive_timeout=args.keep_alive_timeout, max_connections=args.max_connections,
                           drain_timeout=args.drain_timeout, api_key=api_key,
                           allowed_hosts=_csv(args.allowed_hosts), cors_origins=_csv(args.cors_origins),
                           max_embedding_inputs=args.max_embedding_inputs)
    stages: list[Any] = []
    model = load_model(args.model, backends=args.backend, n_threads=args.threads, n_ctx=None,
                       kv_type=args.kv_type.upper(), backend_options=backend_options(args))
    try:
        ctx = args.ctx or args.parallel * min(2048, model.hparams.n_ctx_train)

        def log(msg: str) -> None:
            print(msg, file=sys.stderr, flush=True)

        if args.cluster is not None:
            from ggml_py.cluster import start_pipeline

            pipe = start_pipeline(model, ctx, args.parallel, max(args.batch, args.parallel),
                                  address=args.cluster, n_stages=args.stages, backends=args.backend,
                                  n_threads=args.threads, max_restarts=args.stage_restarts,
                                  memory_limit=args.stage_memory, compiled=args.compiled_graph)
            log(f"ggml-py serve: {len(pipe.specs)} pipeline stages: " + ", ".join(
                f"blocks {a}-{b - 1} on {node}" for (a, b), node in zip((s.layers for s in pipe.specs), pipe.nodes)))
            stages.append(pipe)
        metrics = serve(model, host=args.host, port=args.port, n_parallel=args.parallel, n_ctx=ctx,
                        max_queue=args.queue, n_batch=args.batch, model_name=args.alias,
                        default_max_tokens=args.max_tokens, log=log, log_level=args.log_level, options=options,
                        stages=stages or None, micro_batches=args.micro_batches, prefix_cache=args.prefix_cache)
        log(f"ggml-py serve: stopped after {metrics['requests_finished']} requests, "
            f"{metrics['tokens_generated']} tokens generated ({metrics['shutdown']})")
        # a second signal cut the drain short: exit as that signal would have (128 + its number)
        code = 128 + signal.Signals[metrics["signal"]].value if metrics["shutdown"] == "forced" else 0
        return {"model": model.path, "metrics": metrics}, code
    finally:
        for st in stages:  # the pipeline's actors, whatever happened
            st.close()
        model.close()
