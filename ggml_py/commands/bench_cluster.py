"""`ggml-py bench cluster`: what a pipeline on a Ray cluster costs per token over the stages' own compute.

It starts a Ray cluster on 127.0.0.1 (a head and `stages - 1` worker nodes, each its own raylet), puts the model's
blocks on them as pipeline stages, and decodes `n_gen` tokens of one sequence, alternating rounds with the same
steps in one process. Per step it reports the wall time at the coordinator, the sum of the stages' compute (as the
stages time their own plans), the difference per hop (stage boundaries plus the way in and out), the bytes per token
that crossed each boundary, and the plans each stage prepared.
"""

from __future__ import annotations

import sys
import time
from typing import Any

import numpy as np


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def run(model: str | None = None, stages: int = 2, n_gen: int = 64, rounds: int = 3, threads: int = 1,
        backend: str | None = None, quick: bool = False, **_: Any) -> dict[str, Any]:
    from ggml_py.cluster import start_pipeline
    from ggml_py.cluster.pipeline import connect, local_ray_env

    local_ray_env()  # before Ray starts: the cluster on 127.0.0.1
    from ray.cluster_utils import Cluster

    from ggml_py.models import load_model
    from ggml_py.models.batch import BatchDecoder

    if quick:
        n_gen, rounds = 4, 1
    n_ctx, n_batch = 256, 32
    c = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False})
    ray: Any = None
    try:
        for _ in range(stages - 1):
            c.add_node(num_cpus=1)
        ray = connect(c.address)
        m = load_model(model, backends=backend, n_threads=threads, n_ctx=n_ctx, progress=False)
        try:
            pipe = start_pipeline(m, n_ctx, 1, n_batch, n_stages=stages, backends=backend, n_threads=threads)
            prompt = m.tokenize("The history of natural philosophy runs from the speculations")[:n_batch]

            def decode(stage_list: list[Any] | None) -> tuple[float, int, list[int]]:
                """Seconds of n_gen one-token steps after the prompt; steps; the tokens."""
                with BatchDecoder(m, n_ctx=n_ctx, n_seq_max=1, n_batch=n_batch, stages=stage_list) as dec:
                    s = dec.new_sequence()
                    t = int(dec.decode([(s, prompt, True)])[0].argmax())
                    toks = [t]
                    t0 = time.perf_counter()
                    for _ in range(n_gen):
                        t = int(dec.decode([(s, [t], True)])[0].argmax())
                        toks.append(t)
                    return time.perf_counter() - t0, n_gen, toks

            local_s, pipe_s, compute_s = [], [], []
            for r in range(rounds):
                before = sum(i["compute_s"] for i in pipe.info())
                dt, n, toks_p = decode([pipe])
                pipe_s.append(dt / n)
                compute_s.append((sum(i["compute_s"] for i in pipe.info()) - before) / (n + 1))
                dt, n, toks_l = decode(None)
                local_s.append(dt / n)
                _log(f"round {r + 1}: pipeline {pipe_s[-1] * 1e3:.2f} ms/token (stages computing "
                     f"{compute_s[-1] * 1e3:.2f}), one process {local_s[-1] * 1e3:.2f} ms/token")
            infos = pipe.info()
            hops = stages + 1  # coordinator -> stage 0 -> ... -> last stage -> coordinator
            over = [p - c_ for p, c_ in zip(pipe_s, compute_s)]
            tokens = max(pipe.tokens, 1)
            result = {
                "model": m.path, "stages": stages, "layers": [i["layers"] for i in infos], "n_gen": n_gen,
                "rounds": rounds, "threads": threads,
                "pipeline_ms_per_token": [round(x * 1e3, 3) for x in pipe_s],
                "stage_compute_ms_per_token": [round(x * 1e3, 3) for x in compute_s],
                "one_process_ms_per_token": [round(x * 1e3, 3) for x in local_s],
                "overhead_ms_per_token": round(float(np.median(over)) * 1e3, 3),
                "overhead_ms_per_hop": round(float(np.median(over)) * 1e3 / hops, 3),
                "boundary_bytes_per_token": round(pipe.boundary_bytes / tokens / max(stages - 1, 1), 1),
                "limit_bytes_per_token": m.hparams.n_embd * 4 + 64,
                "plans_prepared": [i["plans_prepared"] for i in infos],
                "same_tokens": toks_p == toks_l,
            }
            pipe.close()
            return result
        finally:
            m.close()
    finally:
        if ray is not None:
            ray.shutdown()
        c.shutdown()


def report(r: dict[str, Any]) -> str:
    return "\n".join([
        f"{r['stages']} stages on a Ray cluster on 127.0.0.1 (blocks {r['layers']}), {r['n_gen']} tokens x "
        f"{r['rounds']} rounds, {r['threads']} thread(s) per stage",
        f"pipeline ms/token {r['pipeline_ms_per_token']}; the stages' compute {r['stage_compute_ms_per_token']}; "
        f"one process {r['one_process_ms_per_token']}",
        f"overhead {r['overhead_ms_per_token']} ms/token = {r['overhead_ms_per_hop']} ms per hop (median)",
        f"bytes per token per boundary {r['boundary_bytes_per_token']} (n_embd x 4 + 64 = "
        f"{r['limit_bytes_per_token']}); plans prepared per stage {r['plans_prepared']}; same greedy tokens as one "
        f"process: {r['same_tokens']}",
    ])
