"""The coordinator side of a pipeline: stage actors placed one per node, chained step by step.

`start_pipeline` connects to (or starts) a Ray cluster, splits the model's blocks over the nodes (in proportion to
their memory unless told), starts one `StageHost` actor per stage on its node and checks each one (versions, file
hash). The `Pipeline` it returns is one stage to a `BatchDecoder` (models/batch.py): a step sends the meta to every
stage and the token ids to the first; each stage's output goes to the next as a Ray object reference, so hidden
states move from node to node without passing through the coordinator, and only the logits of the wanted rows come
back. Every wait has a timeout; a stage that dies or does not answer fails the step with a `ClusterError` naming the
stage and its node.
"""

from __future__ import annotations

import functools
import ipaddress
import logging
import os
import sys
import time
from collections.abc import Sequence
from importlib import metadata
from typing import TYPE_CHECKING, Any
from urllib.parse import urlparse

import numpy as np

from ggml_py.cluster.actor import ABI_STAGE, StageFailure, StageHost, StageSpec, file_sha256, frame
from ggml_py.errors import UnavailableError
from ggml_py.models.stage import StepMeta, split_by_memory, split_layers, stage_memory_parts
from ggml_py.sysmem import mib

if TYPE_CHECKING:
    from ggml_py.models.model import Model

__all__ = ["ClusterError", "Pipeline", "StageSpec", "start_pipeline"]

log = logging.getLogger("ggml_py.cluster")

STEP_TIMEOUT_S = 60.0  # one step through every stage (a prefill chunk of a large model on a slow node included)
START_TIMEOUT_S = 300.0  # a stage's start: hashing and mapping its file, loading the model
MAX_IN_FLIGHT = 16  # steps submitted to a compiled graph and not collected yet, at most


class ClusterError(UnavailableError):
    """A pipeline stage cannot start, died, or did not answer in time."""


def _is_loopback(address: str) -> bool:
    host = urlparse(address if "://" in address else f"ray://{address}").hostname or ""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


# The Ray settings of a cluster this process starts on this machine (tests, `bench cluster`, address 'local'); on
# real machines, the same variables are exported before `ray start` on every node (docs/cluster.md).
LOCAL_RAY_ENV = {
    # Ray replaces a loopback address by the host's own (so that other machines could reach it); on one machine
    # this keeps every node, the driver and their traffic on 127.0.0.1
    "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
    "RAY_USAGE_STATS_ENABLED": "0",  # Ray reports nothing to anyone
}
# Ray returns results up to this size inside the call's reply, larger ones through its object store, which costs
# about 1 ms more a call: the last stage's logits (n_vocab floats a row: 196 KB for 49k tokens) must fit
RAY_DIRECT_CALL_ENV = {"RAY_max_direct_call_object_size": str(8 << 20)}


def local_ray_env() -> None:
    """Set (unless set already) the environment of a Ray cluster started by this process, before Ray starts."""
    for k, v in {**LOCAL_RAY_ENV, **RAY_DIRECT_CALL_ENV}.items():
        os.environ.setdefault(k, v)


def connect(address: str | None = None) -> Any:
    """Ray, connected: to the cluster at `address` ("auto": the one `ray start` made on this machine), or a new local
    instance when None. A cluster beyond this machine is refused unless Ray's token authentication is on
    (RAY_AUTH_MODE=token on every node), since anyone who can reach an unauthenticated Ray can run code on it."""
    here = address in (None, "local") or (address != "auto" and _is_loopback(address))
    if here and "ray" not in sys.modules:
        local_ray_env()
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    try:
        import ray
    except ImportError:
        raise ClusterError("the cluster needs Ray: pip install 'ggml_py[cluster]'") from None
    if not here and address != "auto":
        if os.environ.get("RAY_AUTH_MODE", "").lower() != "token":
            raise ClusterError(f"refusing the cluster at {address}: it is not on this machine and Ray's token "
                               "authentication is off; start every node with RAY_AUTH_MODE=token (and RAY_AUTH_TOKEN "
                               "or a token file), see docs/cluster.md")
    if not ray.is_initialized():
        # "local": always a new instance (None would join the last cluster `ray start` made here, even a dead one)
        ray.init(address="local" if address in (None, "local") else address, include_dashboard=False,
                 logging_level="ERROR", log_to_driver=False, configure_logging=False)
    return ray


class Pipeline:
    """The stage actors of one model, as one stage of a BatchDecoder (`step`, `reset`, `recover`, `close`).

    `compiled` False (the default): a step is one plain actor call per stage, each stage's output passed to the next
    as an object reference (Ray returns results up to RAY_max_direct_call_object_size inside the call's reply, so
    the hidden states pass through the coordinator on their way to the next stage). True: a step runs as a Ray
    compiled graph, compiled once (at start, and again after a restart): each stage reads its input from and writes
    its output to a channel of its own, the hidden states go from a stage straight to the next and the logits from
    the last stage to the coordinator, with no task submitted per step: less time per hop, but a reader waiting on
    a channel spins, so the coordinator burns a core while a step runs, taken from stage 0 when they share a node,
    and when a stage dies Ray (2.60) can crash the coordinator tearing the graph down: experimental (docs/cluster.md
    has the figures).

    `max_restarts`: how many times in all a stage that died or stopped answering is started again (on its node if
    that is alive, else on another node that holds the file); the decoder then rebuilds every stage's cache from its
    sequences' tokens and the step goes on. 0: a lost stage fails the step, and the decoder, for good."""

    def __init__(self, ray: Any, actors: list[Any], specs: list[StageSpec], node_ids: list[str], n_embd: int,
                 n_vocab: int, *, timeout_s: float = STEP_TIMEOUT_S, max_restarts: int = 0,
                 compiled: bool = False) -> None:
        self._ray, self.actors, self.specs, self.timeout_s = ray, actors, specs, timeout_s
        self.compiled = compiled
        self._dag: Any = None  # the compiled graph of a step (compiled mode; None until the first step)
        self.compiles = 0
        self.compile_s = 0.0
        self.node_ids = node_ids
        self.n_embd, self.n_vocab = n_embd, n_vocab
        self.max_restarts = max_restarts
        self.restarts: list[dict[str, Any]] = []  # one record a stage started again: which, where, how long
        self._lost: set[int] = set()  # stages that died or did not answer in the last failed call
        self.steps = 0
        self.step_s = 0.0  # waiting for steps, at the coordinator: the stages' steps and what carries them
        self.tokens = 0
        self.boundary_bytes = 0  # hidden states and metas handed from a stage to the next (what crosses a boundary)
        self.start_s = 0.0

    @property
    def n_stages(self) -> int:
        return len(self.specs)

    @property
    def n_ctx(self) -> int:
        """Cells of every stage's KV cache (a decoder on this pipeline may use at most these)."""
        return self.specs[0].n_ctx

    @property
    def n_seq_max(self) -> int:
        return self.specs[0].n_seq_max

    @property
    def n_batch(self) -> int:
        return self.specs[0].n_batch

    @property
    def nodes(self) -> list[str]:
        """Each stage's node as 'address:node id prefix'."""
        by_id = {n["NodeID"]: n for n in self._ray.nodes()}
        return [f"{by_id[n]['NodeManagerAddress'] if n in by_id else '?'}:{n[:8]}" for n in self.node_ids]

    def _where(self, i: int) -> str:
        a, b = self.specs[i].layers
        return f"stage {i} (blocks {a}-{b - 1}) on node {self.nodes[i]}"

    def _start(self, i: int, node_id: str) -> Any:
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        return self._ray.remote(StageHost).options(num_cpus=0, max_restarts=0, scheduling_strategy=(
            NodeAffinitySchedulingStrategy(node_id, soft=False))).remote(self.specs[i], i)

    def step(self, meta: StepMeta, x: np.ndarray) -> np.ndarray:
        return self.collect(self.submit(meta, x))

    def submit(self, meta: StepMeta, x: np.ndarray) -> Any:
        """Start a step through every stage and return at once (a handle for `collect`). Steps submitted one after
        another follow each other through the stages, each stage taking them in order: while stage 1 computes one,
        stage 0 computes the next (micro-batches; a BatchDecoder keeps them apart)."""
        t0 = time.perf_counter()
        packed = meta.pack()
        msg = frame(packed, x)
        if self.compiled:
            if self._dag is None:
                self._compile()
            try:
                handle: Any = (self._dag.execute(msg), None, meta.out_rows.size)
            except Exception as e:
                raise self._compiled_failure(e) from None
        else:
            ref, refs = msg, []
            for actor in self.actors:  # each output goes on to the next stage as a reference
                ref = actor.step.options(enable_task_events=False).remote(ref)
                refs.append(ref)
            handle = (ref, refs, meta.out_rows.size)
        self.step_s += time.perf_counter() - t0
        self.steps += 1
        self.tokens += meta.n_tokens
        self.boundary_bytes += (len(self.actors) - 1) * (meta.n_tokens * self.n_embd * 4 + packed.nbytes)
        return handle

    def collect(self, handle: Any) -> np.ndarray:
        """The logits of a submitted step (steps are collected in the order they were submitted)."""
        t0 = time.perf_counter()
        ref, refs, n_out = handle
        try:
            out = self._ray.get(ref, timeout=self.timeout_s)
        except Exception as e:
            raise (self._compiled_failure(e) if refs is None else self._failure(refs, e)) from None
        finally:
            self.step_s += time.perf_counter() - t0
        return np.frombuffer(out, np.float32).reshape(n_out, self.n_vocab)  # read-only: nothing can change bytes

    def _compile(self) -> None:
        """The step as a Ray compiled graph: frame(meta, x) -> stage 0 -> ... -> the last stage's output."""
        from ray.dag import InputNode

        t0 = time.perf_counter()
        with InputNode() as inp:
            node = inp
            for actor in self.actors:
                node = actor.step.bind(node)
        self._dag = node.experimental_compile(_submit_timeout=self.timeout_s,
                                              _max_inflight_executions=MAX_IN_FLIGHT)
        self.compiles += 1
        self.compile_s += time.perf_counter() - t0

    def _ask_each(self, timeout_s: float) -> list[Any]:
        """Each stage's info(), or the exception in its place (it died, or did not answer within `timeout_s`)."""
        ray = self._ray
        refs = [a.info.remote() for a in self.actors]
        ray.wait(refs, num_returns=len(refs), timeout=timeout_s)
        answers: list[Any] = []
        for r in refs:
            try:
                answers.append(ray.get(r, timeout=0))
            except Exception as e:
                answers.append(e)
        return answers

    def _drop_dag(self) -> None:
        if self._dag is not None:
            dag, self._dag = self._dag, None
            try:
                dag.teardown()
            except Exception:
                pass  # a stage is gone: what is left of the graph goes with it

    def _compiled_failure(self, e: BaseException) -> ClusterError:
        """The stage a compiled step failed in, named. A stage's own error leaves the graph as it is; a stage that
        died or did not answer breaks it: it is torn down, and compiled again once the stages are back."""
        ray = self._ray
        cause = getattr(e, "cause", None) if isinstance(e, ray.exceptions.RayTaskError) else None
        if isinstance(cause, StageFailure):
            return ClusterError(f"{self._where(cause.index)} failed: {cause}")
        self._drop_dag()
        answers = self._ask_each(1.0)
        busy = None
        for i, info in enumerate(answers):
            if isinstance(info, ray.exceptions.RayActorError):
                self._lost.add(i)
                return ClusterError(f"{self._where(i)} died: its process or node is gone")
            if busy is None and (isinstance(info, BaseException) or info["busy_s"] > 0):
                busy = i  # no answer within a second, or still in its step
        if busy is not None:
            self._lost.add(busy)
            return ClusterError(f"{self._where(busy)} did not answer within {self.timeout_s:g} s")
        return ClusterError(f"the pipeline failed: {type(e).__name__}: {e}")

    def _failure(self, refs: list[Any], e: BaseException) -> ClusterError:
        """The first stage whose step failed, named, with what happened to it."""
        ray = self._ray
        if isinstance(e, ray.exceptions.GetTimeoutError):
            ready, _ = ray.wait(refs, num_returns=len(refs), timeout=0)
            i = len(ready) if len(ready) < len(refs) else len(refs) - 1
            self._lost.add(i)
            return ClusterError(f"{self._where(i)} did not answer within {self.timeout_s:g} s")
        for i, r in enumerate(refs):
            try:
                ray.get(r, timeout=0)
            except ray.exceptions.RayActorError:
                self._lost.add(i)
                return ClusterError(f"{self._where(i)} died: its process or node is gone")
            except ray.exceptions.RayTaskError as te:
                cause = te.cause if getattr(te, "cause", None) is not None else te
                if isinstance(cause, StageFailure):
                    return ClusterError(f"{self._where(cause.index)} failed: {cause}")
                if isinstance(cause, ray.exceptions.RayActorError):
                    continue  # an upstream stage's death, seen from here
                return ClusterError(f"{self._where(i)} failed: {type(cause).__name__}: {cause}")
            except Exception:
                continue
        return ClusterError(f"the pipeline failed: {type(e).__name__}: {e}")

    def reset(self) -> None:
        """Every stage forgets its sequences (a new decoder starts on the pipeline)."""
        refs = [a.reset.remote() for a in self.actors]
        try:
            self._ray.get(refs, timeout=self.timeout_s)
        except Exception as e:
            raise self._failure(refs, e) from None

    def recover(self) -> bool:
        """Start again every stage that died or stopped answering (within `max_restarts` in all; each stage is asked
        first): on its node if that is alive, else on the first other alive node that holds the file. True if one
        was (the caller rebuilds the caches: BatchDecoder does); False if none was lost or max_restarts is 0.
        ClusterError when one is lost and cannot be started again."""
        ray = self._ray
        if not self.max_restarts:
            self._lost.clear()
            return False  # the step's own error stands
        # a node's death can take several stages: each is asked
        self._lost.update(i for i, info in enumerate(self._ask_each(min(self.timeout_s, 5.0)))
                          if isinstance(info, BaseException))
        lost, self._lost = sorted(self._lost), set()
        if not lost:
            return False
        self._drop_dag()  # compiled again with the new actors at the next step
        for i in lost:
            where = self._where(i)
            if len(self.restarts) >= self.max_restarts:
                raise ClusterError(f"{where} is lost again and the pipeline may not start it again "
                                   f"(max_restarts={self.max_restarts}, all used)")
            ray.kill(self.actors[i], no_restart=True)
            t0 = time.perf_counter()
            alive = [n["NodeID"] for n in _alive_nodes(ray)]
            order = ([self.node_ids[i]] if self.node_ids[i] in alive else []) + [
                n for n in alive if n != self.node_ids[i]]
            errors = []
            for node in order:
                actor = self._start(i, node)
                try:
                    ray.get(actor.info.remote(), timeout=START_TIMEOUT_S)
                except Exception as e:
                    ray.kill(actor, no_restart=True)
                    errors.append(f"{node[:8]}: {type(e).__name__}: {e}"[:300])
                    continue
                self.actors[i], self.node_ids[i] = actor, node
                break
            else:
                raise ClusterError(f"{where} is lost and no node could start it again: " + "; ".join(errors))
            took = time.perf_counter() - t0
            self.restarts.append({"stage": i, "node": self.nodes[i], "start_s": took})
            log.warning("%s was lost; started again on node %s in %.2f s", where, self.nodes[i], took)
        return True

    def info(self) -> list[dict[str, Any]]:
        """Each stage's report (host, pid, blocks, backends, plans prepared, steps, compute seconds)."""
        return self._ray.get([a.info.remote() for a in self.actors], timeout=self.timeout_s)

    def close(self) -> None:
        ray = self._ray
        self._drop_dag()
        for a in self.actors:
            try:
                ray.get(a.close.remote(), timeout=10)
            except Exception:
                pass
            ray.kill(a)
        self.actors = []


def _is_head(node: dict[str, Any]) -> bool:
    return bool(node.get("IsHead")) or "node:__internal_head__" in node.get("Resources", {})


def _alive_nodes(ray: Any) -> list[dict[str, Any]]:
    """The alive nodes, the head first."""
    return sorted((n for n in ray.nodes() if n.get("Alive")), key=lambda n: (not _is_head(n), n["NodeID"]))


def start_pipeline(model: Model, n_ctx: int, n_seq_max: int, n_batch: int, *, address: str | None = None,
                   n_stages: int | None = None, shares: Sequence[float] | None = None,
                   nodes: Sequence[str] | None = None, backends: str | None = None, n_threads: int | None = None,
                   timeout_s: float = STEP_TIMEOUT_S, max_restarts: int = 0,
                   memory_limit: int | Sequence[int] | None = None, compiled: bool = False) -> Pipeline:
    """Start one stage actor per node of the cluster (or per node id in `nodes`) for `model` (the coordinator's:
    its file, which every node must hold at the same path), and check that each one runs: its ggml_py, stage
    protocol and file (size and SHA-256) are the coordinator's. The blocks are split in proportion to `shares` (block
    counts) if given, else by memory: each stage's weights, KV cache and compute buffer in proportion to its node's
    memory (Ray's `memory` resource: `ray start --memory BYTES` sets it), or to `memory_limit` (bytes, one for all or
    one per stage), which each stage may then not exceed (ClusterError at once when the model cannot fit).
    `n_stages` takes the first nodes (the head first; more stages than nodes share them). Use the result as the
    stages of a BatchDecoder of `n_ctx` cells, `n_seq_max` sequences and `n_batch` tokens a step (the same numbers).
    `max_restarts`, `compiled`: see Pipeline."""
    path, n_layer, kv_type = model.path, model.hparams.n_layer, model.cache.dtype.name
    ray = connect(address)
    alive = _alive_nodes(ray)
    by_id = {n["NodeID"]: n for n in alive}
    if nodes is not None:
        missing = [n for n in nodes if n not in by_id]
        if missing:
            raise ClusterError(f"nodes {missing} are not alive in the cluster")
        chosen = [by_id[n] for n in nodes]
    else:  # one stage per node, the head first; more stages than nodes go round the nodes again
        n = n_stages or len(alive)
        chosen = [alive[i % len(alive)] for i in range(n)]
    if shares is not None:
        if len(shares) != len(chosen):
            raise ClusterError(f"{len(shares)} shares for {len(chosen)} stages")
        ranges = split_layers(n_layer, shares)
        limits: list[int | None] = [None] * len(chosen)
    else:
        if memory_limit is None:
            budgets = [int(n["Resources"].get("memory", 1)) for n in chosen]
            limits = [None] * len(chosen)
        else:
            budgets = [int(memory_limit)] * len(chosen) if isinstance(memory_limit, (int, float)) else [
                int(b) for b in memory_limit]
            if len(budgets) != len(chosen):
                raise ClusterError(f"{len(budgets)} memory limits for {len(chosen)} stages")
            limits = list(budgets)

        @functools.cache
        def need(a: int, b: int) -> int:
            parts = stage_memory_parts(model, range(a, b), n_ctx, n_seq_max, n_batch, model.cache.dtype)
            return sum(n for _, n in parts)

        ranges = split_by_memory(lambda r: need(r.start, r.stop), n_layer, budgets)
        for r, lim in zip(ranges, limits):
            if lim is not None and need(r.start, r.stop) > lim:
                detail = ", ".join(f"stage {j}: blocks {q.start}-{q.stop - 1}, {mib(need(q.start, q.stop))}"
                                   for j, q in enumerate(ranges))
                raise ClusterError(f"the model does not fit in {len(ranges)} stages with memory limits "
                                   f"{[mib(x) for x in budgets]}: the best split needs {detail}; add nodes or "
                                   "memory, or use a smaller context (n_ctx) or batch")
    size, digest = os.path.getsize(path), file_sha256(path)
    specs = [StageSpec(os.path.abspath(path), size, digest, (r.start, r.stop), n_ctx, n_seq_max, n_batch, kv_type,
                       backends, n_threads, lim) for r, lim in zip(ranges, limits)]
    pipe = Pipeline(ray, [], specs, [n["NodeID"] for n in chosen], model.hparams.n_embd, model.n_vocab,
                    timeout_s=timeout_s, max_restarts=max_restarts, compiled=compiled)
    pipe.actors = [pipe._start(i, node_id) for i, node_id in enumerate(pipe.node_ids)]
    t0 = time.perf_counter()
    refs = [a.info.remote() for a in pipe.actors]
    try:
        infos = ray.get(refs, timeout=START_TIMEOUT_S)
    except Exception as e:
        err = pipe._failure(refs, e)
        pipe.close()
        raise ClusterError(f"the pipeline did not start: {err}") from None
    version = metadata.version("ggml_py")
    for i, info in enumerate(infos):
        if info["ggml_py"] != version or info["stage_abi"] != ABI_STAGE:
            pipe.close()
            raise ClusterError(f"{pipe._where(i)} runs ggml_py {info['ggml_py']} (stage protocol "
                               f"{info['stage_abi']}); this coordinator {version} ({ABI_STAGE})")
    if compiled:
        try:
            pipe._compile()
        except Exception as e:
            pipe.close()
            raise ClusterError(f"the pipeline's step graph did not compile: {type(e).__name__}: {e}") from None
    pipe.start_s = time.perf_counter() - t0
    return pipe
