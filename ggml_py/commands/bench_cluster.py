"""`ggml-py bench cluster`: what a pipeline on a Ray cluster costs per token over the stages' own compute.

It starts a Ray cluster on 127.0.0.1 (a head and `stages - 1` worker nodes, each its own raylet), or joins the one
`cluster` names, puts the model's blocks on its nodes as pipeline stages, and decodes `n_gen` tokens of one
sequence, alternating rounds with the same steps in one process. The same stages run twice: their step as a Ray
compiled graph, and as plain actor calls. Per step it reports the wall time at the coordinator, the sum of the
stages' compute (as the stages time their own plans), the difference per hop (stage boundaries plus the way in and
out), the bytes per token that crossed each boundary, and the plans each stage prepared; and beside them, round by
round, what Ray alone costs a hop for steps as long as the stages' (actors that only spin), the floor under the
pipeline's figure.
"""

from __future__ import annotations

import os
import sys
import time
from typing import Any

import numpy as np

from ggml_py.sysmem import mib, peak_rss_bytes


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


class Spinner:
    """An actor standing in for a stage: it spins as long as the stage's step took and returns as many bytes, so
    that what Ray alone costs a hop, for steps this long on these nodes, is measured beside the pipeline."""

    def __init__(self, out_bytes: int) -> None:
        self.out = bytes(out_bytes)

    def step(self, msg: bytes, busy_s: float) -> bytes:
        t = time.perf_counter()
        while time.perf_counter() - t < busy_s:
            pass
        return self.out


def run(model: str | None = None, stages: int = 2, n_gen: int = 64, rounds: int = 3, threads: int = 1,
        backend: str | None = None, quick: bool = False, stage_memory: int | None = None, requests: int = 100,
        cluster: str | None = None, **_: Any) -> dict[str, Any]:
    """`stage_memory`: bytes each node has (Ray's memory resource, on the local cluster) and each stage may hold
    (start_pipeline's memory_limit). `requests`: served at the end by an engine on the compiled pipeline (4 at a
    time), to count the plans and graphs prepared over a run of many requests. `cluster`: a running cluster's
    address (connect()'s rules: token authentication beyond this machine), left running afterwards."""
    from ggml_py.cluster import start_pipeline
    from ggml_py.cluster.pipeline import connect, local_ray_env

    local_ray_env()  # before Ray starts: the cluster on 127.0.0.1
    from ray.cluster_utils import Cluster
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    from ggml_py.models import load_model
    from ggml_py.models.batch import BatchDecoder
    from ggml_py.serving.engine import Engine, GenParams

    if quick:
        n_gen, rounds, requests = 4, 1, 4
    n_ctx, n_batch, n_par = 256, 32, 4
    node = {"num_cpus": 1, **({"memory": stage_memory} if stage_memory else {})}
    c = None if cluster else Cluster(initialize_head=True, head_node_args={**node, "include_dashboard": False})
    ray: Any = None
    try:
        if c is not None:
            for _ in range(stages - 1):
                c.add_node(**node)
        ray = connect(cluster if c is None else c.address)
        m = load_model(model, backends=backend, n_threads=threads, n_ctx=n_ctx, progress=False)
        try:
            # the same stages twice: steps as a compiled graph, and as plain actor calls
            pipes = {name: start_pipeline(m, n_ctx, n_par, n_batch, n_stages=stages, backends=backend,
                                          n_threads=threads, compiled=name == "compiled", memory_limit=stage_memory)
                     for name in ("compiled", "calls")}
            prompt = m.tokenize("The history of natural philosophy runs from the speculations")[:n_batch]

            def decode(pipe: Any = None) -> tuple[float, list[int], float, float]:
                """n_gen one-token steps after the prompt, on `pipe` or in one process: seconds per token, the
                tokens, and on a pipe its stages' plan compute and what carrying the steps took, per token."""
                with BatchDecoder(m, n_ctx=n_ctx, n_seq_max=n_par, n_batch=n_batch,
                                  stages=None if pipe is None else [pipe]) as dec:
                    s = dec.new_sequence()
                    t = int(dec.decode([(s, prompt, True)])[0].argmax())
                    toks = [t]
                    before, waited = (pipe.info(), pipe.step_s) if pipe is not None else ([], 0.0)
                    t0 = time.perf_counter()
                    for _ in range(n_gen):
                        t = int(dec.decode([(s, [t], True)])[0].argmax())
                        toks.append(t)
                    dt = (time.perf_counter() - t0) / n_gen
                if pipe is None:
                    return dt, toks, 0.0, 0.0
                after = pipe.info()
                plans = sum(a["compute_s"] - b["compute_s"] for a, b in zip(after, before)) / n_gen
                steps = [(a["step_s"] - b["step_s"]) / n_gen for a, b in zip(after, before)]  # all a stage does
                stage_steps[:] = steps
                return dt, toks, plans, (pipe.step_s - waited) / n_gen - sum(steps)

            stage_steps: list[float] = []  # each stage's step, per token, in the last pipelined decode
            spinners = [ray.remote(Spinner).options(num_cpus=0, scheduling_strategy=NodeAffinitySchedulingStrategy(
                node, soft=False)).remote(m.n_vocab * 4 if i == stages - 1 else m.hparams.n_embd * 4 + 64)
                for i, node in enumerate(pipes["calls"].node_ids)]

            def ray_alone() -> float:
                """Per token, what n_gen steps chained through the spinners take over their spinning."""
                calls = [a.step.options(enable_task_events=False) for a in spinners]
                ray.get([a.step.remote(b"", 0.0) for a in spinners])
                t0 = time.perf_counter()
                for _ in range(n_gen):
                    ref: Any = bytes(64)
                    for call, busy in zip(calls, stage_steps):
                        ref = call.remote(ref, busy)
                    ray.get(ref)
                return (time.perf_counter() - t0) / n_gen - sum(stage_steps)

            per_token: dict[str, list[float]] = {"compiled": [], "calls": [], "one process": []}
            compute: dict[str, list[float]] = {"compiled": [], "calls": []}
            carry: dict[str, list[float]] = {"compiled": [], "calls": []}  # pipe.step's wait over the stages' steps
            floor: list[float] = []  # Ray alone, for steps as long as the plain-call stages' of the same round
            same = True
            for r in range(rounds):  # interleaved: every round runs each way once
                dt, local, _, _ = decode()
                per_token["one process"].append(dt)
                for name, pipe in pipes.items():
                    dt, toks, plans, carried = decode(pipe)
                    per_token[name].append(dt)
                    compute[name].append(plans)
                    carry[name].append(carried)
                    same &= toks == local
                floor.append(ray_alone())
                _log(f"round {r + 1}: " + ", ".join(f"{k} {v[-1] * 1e3:.2f} ms/token" for k, v in per_token.items()))
            hops = stages + 1  # coordinator -> stage 0 -> ... -> last stage -> coordinator
            infos = {"compiled": pipes["compiled"].info()}
            compiles, compile_s = pipes["compiled"].compiles, pipes["compiled"].compile_s
            pipes["compiled"].close()
            pipe = pipes["calls"]
            # many requests on one engine over the pipeline (plain calls, the default): still one plan per stage;
            # once with every request in one step, once in P + 1 micro-batches in flight (the engine's default)
            served: dict[str, dict[str, float]] = {}
            prompts = [m.tokenize(f"Question {i}: what is {i} plus {i + 1}?") for i in range(8)]
            for label, mb in (("one batch", 1), (f"{stages + 1} micro-batches", stages + 1)):
                eng = Engine(m, n_parallel=n_par, n_ctx=n_ctx, n_batch=n_batch, max_queue=requests, stages=[pipe],
                             micro_batches=mb)
                try:
                    reqs = [eng.submit(prompts[i % len(prompts)], GenParams(max_tokens=8, temperature=0,
                                                                            stop_at_eos=False))
                            for i in range(requests)]
                    t0 = time.perf_counter()
                    eng.run_until_idle()
                    dt = time.perf_counter() - t0
                    done = sum(r.result().finish_reason in ("stop", "length") for r in reqs)
                    gen = sum(len(r.result().tokens) for r in reqs)
                finally:
                    eng.close()
                served[label] = {"completed": done, "seconds": round(dt, 2), "tokens": gen,
                                 "tokens_per_s": round(gen / dt, 1)}
                _log(f"{requests} requests, {label}: {gen / dt:.1f} generated tokens/s")
            infos["calls"] = pipe.info()
            tokens = max(pipe.tokens, 1)
            result = {
                "model": m.path, "stages": stages, "layers": [i["layers"] for i in infos["compiled"]],
                "n_gen": n_gen, "rounds": rounds, "threads": threads,
                "ms_per_token": {k: [round(x * 1e3, 3) for x in v] for k, v in per_token.items()},
                "stage_compute_ms_per_token": {k: [round(x * 1e3, 3) for x in v] for k, v in compute.items()},
                # what the pipeline adds to its stages' compute, per token and per hop (the best round's)
                "overhead_ms_per_hop": {k: round(min(p - c for p, c in zip(per_token[k], compute[k])) * 1e3 / hops,
                                                 3) for k in compute},
                "overhead_ms_per_hop_median": {k: round(float(np.median(
                    [p - c for p, c in zip(per_token[k], compute[k])])) * 1e3 / hops, 3) for k in compute},
                # the same without what the coordinator and the stages do around the plans (their host work):
                # what carrying a step from stage to stage costs
                "transport_ms_per_hop": {k: round(min(v) * 1e3 / hops, 3) for k, v in carry.items()},
                "transport_ms_per_hop_median": {k: round(float(np.median(v)) * 1e3 / hops, 3)
                                                for k, v in carry.items()},
                "ray_alone_ms_per_hop": round(min(floor) * 1e3 / hops, 3),
                "ray_alone_ms_per_hop_median": round(float(np.median(floor)) * 1e3 / hops, 3),
                "boundary_bytes_per_token": round(pipe.boundary_bytes / tokens / max(stages - 1, 1), 1),
                "limit_bytes_per_token": m.hparams.n_embd * 4 + 64,
                "plans_prepared": [i["plans_prepared"] for i in infos["calls"]],
                "plans_prepared_compiled": [i["plans_prepared"] for i in infos["compiled"]],
                "graphs_compiled": compiles, "compile_s": round(compile_s, 3),
                "same_tokens": same, "text": m.detokenize(toks),
                "requests": {"served": requests, **served},
                "file_bytes": os.path.getsize(m.path), "stage_memory_limit": stage_memory,
                "stage_held_bytes": [sum(n for _, n in i["memory_parts"]) for i in infos["calls"]],
                "stage_peak_rss_bytes": [i["peak_rss_bytes"] for i in infos["calls"]],
                "coordinator_peak_rss_bytes": peak_rss_bytes(),
            }
            pipe.close()
            return result
        finally:
            m.close()
    finally:
        if ray is not None:
            ray.shutdown()
        if c is not None:
            c.shutdown()


def report(r: dict[str, Any]) -> str:
    ms = r["ms_per_token"]
    return "\n".join([
        f"{r['stages']} stages on a Ray cluster on 127.0.0.1 (blocks {r['layers']}), {r['n_gen']} tokens x "
        f"{r['rounds']} rounds, {r['threads']} thread(s) per stage",
        *(f"{k:>12}: {v} ms/token" + (f"; the stages' compute {r['stage_compute_ms_per_token'][k]}; overhead "
                                      f"{r['overhead_ms_per_hop'][k]} ms per hop (best round; median "
                                      f"{r['overhead_ms_per_hop_median'][k]}), of which carrying the step "
                                      f"{r['transport_ms_per_hop'][k]} (median {r['transport_ms_per_hop_median'][k]})"
                                      if k in r['overhead_ms_per_hop']
                                      else "") for k, v in ms.items()),
        f"Ray alone, actors that only spin as long as the plain-call stages' steps and pass as many bytes: "
        f"{r['ray_alone_ms_per_hop']} ms per hop (median {r['ray_alone_ms_per_hop_median']})",
        f"bytes per token per boundary {r['boundary_bytes_per_token']} (n_embd x 4 + 64 = "
        f"{r['limit_bytes_per_token']}); the compiled pipeline's plans per stage {r['plans_prepared_compiled']}, its "
        f"graph compiled {r['graphs_compiled']}x in {r['compile_s']} s; same greedy tokens as one process (both "
        f"ways): {r['same_tokens']}",
        f"{r['requests']['served']} requests (4 at a time, 8 tokens each) on the pipeline (plain calls): " + "; ".join(
            f"{k}: {v['completed']} completed, {v['tokens_per_s']} tokens/s" for k, v in r["requests"].items()
            if isinstance(v, dict)) + f"; after them and the rounds, plans prepared per stage {r['plans_prepared']}",
        f"memory: file {mib(r['file_bytes'])}; each stage may hold "
        f"{mib(r['stage_memory_limit']) if r['stage_memory_limit'] else 'what its node has'}; held (weights, KV, "
        f"compute) {[mib(x) for x in r['stage_held_bytes']]}; stages' peak RSS "
        f"{[mib(x) for x in r['stage_peak_rss_bytes'] if x]}; the coordinator's (it also ran the model in one "
        f"process) {mib(r['coordinator_peak_rss_bytes'] or 0)}",
        f"text: {r['text']!r}",
    ])
