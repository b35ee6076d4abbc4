"""Pipeline stages on a real Ray cluster on 127.0.0.1 (a head and two worker nodes, each its own raylet): the logits
and tokens of the model run in one process, from 2 and 3 stages on different nodes; one plan prepared per stage;
only activations and metadata cross; a stage whose process is killed fails the step naming it within a second; a
cluster beyond this machine without Ray's token authentication is refused. The same pipeline code chained in one
process is tests/test_pipeline.py (every architecture)."""

from __future__ import annotations

import os
import pickle
import re
import signal
import time

import numpy as np
import pytest
from arch_factory import write_tiny
from test_pipeline import N_BATCH, N_CTX, N_SEQ, SHAPES, _script

from ggml_py import load_model
from ggml_py.cluster import ClusterError, start_pipeline
from ggml_py.cluster.pipeline import _alive_nodes, connect, local_ray_env
from ggml_py.models.batch import BatchDecoder
from ggml_py.serving.engine import Engine, GenParams

from model_factory import nmse

# Ray on one machine: nodes on 127.0.0.1 (Ray would advertise the host's address), no usage reports, the logits
# returned in a call's reply. Set before Ray is imported, as connect() does for a local or loopback cluster.
local_ray_env()
ray = pytest.importorskip("ray", reason="the cluster extra: pip install 'ggml_py[cluster]'")


@pytest.fixture(scope="module")
def cluster():
    from ray.cluster_utils import Cluster

    c = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False})
    for _ in range(2):
        c.add_node(num_cpus=1)
    connect(c.address)
    # every node and this driver on loopback (local_ray_env above): no traffic leaves 127.0.0.1
    assert c.address.startswith("127.0.0.1:") and {n["NodeManagerAddress"] for n in ray.nodes()} == {"127.0.0.1"}
    assert _alive_nodes(ray)[0]["NodeID"] == c.head_node.node_id  # stage 0 goes to the head (the coordinator's)
    try:
        yield c
    finally:
        ray.shutdown()
        c.shutdown()


def _pipeline(m, n_stages: int, **kw):
    return start_pipeline(m, N_CTX, N_SEQ, N_BATCH, n_stages=n_stages, backends="simd", n_threads=1, **kw)


# gemma3 and the compiled graph on three nodes only: a stage between two others, every hop kind (the compiled graph
# on two is test_bench_cluster_runs')
@pytest.mark.parametrize("arch,compiled,stage_counts", [("llama", False, (2, 3)), ("gemma3", False, (3,)),
                                                        ("llama", True, (3,))])
def test_two_and_three_nodes_equal_one_process(cluster, arch, compiled, stage_counts, tmp_path):
    path = write_tiny(tmp_path / f"{arch}.gguf", arch, seed=4, n_layer=3, **SHAPES.get(arch, {}))
    with load_model(path, backends=["simd"], n_ctx=N_CTX, progress=False) as m:
        with BatchDecoder(m, n_ctx=N_CTX, n_seq_max=N_SEQ, n_batch=N_BATCH) as dec:
            whole = _script(dec, np.random.default_rng(0))
        for n_stages in stage_counts:
            pipe = _pipeline(m, n_stages, compiled=compiled)
            try:
                infos = pipe.info()
                assert len({i["pid"] for i in infos}) == n_stages and os.getpid() not in {i["pid"] for i in infos}
                with BatchDecoder(m, n_ctx=N_CTX, n_seq_max=N_SEQ, n_batch=N_BATCH, stages=[pipe]) as dec:
                    got = _script(dec, np.random.default_rng(0))
                    n_tokens = dec.tokens
                    infos = pipe.info()
                for i, (x, y) in enumerate(zip(got, whole)):
                    assert nmse(x, y) < 1e-6, f"{arch}, {n_stages} stages, step {i}: {nmse(x, y):.2e}"
                    assert (x.argmax(-1) == y.argmax(-1)).all()
                assert [i["plans_prepared"] for i in infos] == [1] * n_stages  # prepared once, executed every step
                assert [i["steps"] for i in infos] == [pipe.steps] * n_stages
                assert [tuple(i["layers"]) for i in infos] == [s.layers for s in pipe.specs]
                # per token and boundary: the hidden states and a few bytes of metadata; the start: a small spec each
                assert pipe.boundary_bytes <= (n_stages - 1) * (m.hparams.n_embd * 4 + 64) * n_tokens
                assert all(len(pickle.dumps(s)) < 1024 for s in pipe.specs)
            finally:
                pipe.close()


def test_the_engine_serves_from_a_pipeline(cluster, tmp_path):
    """Continuous batching over two nodes: eight requests, the tokens they get from one process."""
    path = write_tiny(tmp_path / "e.gguf", "llama", seed=3, n_layer=2)
    with load_model(path, backends=["simd"], n_ctx=N_CTX, progress=False) as m:
        prompts = [m.tokenize(p) for p in ("Hello there", "the cat is on", "one two three", "x y z", "a b", "q",
                                           "and so on and", "What is")]

        def run(stages):
            eng = Engine(m, n_parallel=N_SEQ, n_ctx=N_CTX, max_queue=len(prompts), n_batch=N_BATCH, stages=stages)
            try:
                reqs = [eng.submit(p, GenParams(max_tokens=6, temperature=0, stop_at_eos=False)) for p in prompts]
                eng.run_until_idle()
                return [r.result().tokens for r in reqs]
            finally:
                eng.close()

        pipe = _pipeline(m, 2)
        try:
            assert run([pipe]) == run(None)
        finally:
            pipe.close()


def test_steps_in_flight_give_the_logits_of_steps_one_at_a_time(cluster, tmp_path):
    """Three micro-batches (other sequences each) submitted before any result is collected: each step's logits are
    those of the same steps decoded one at a time in one process; a sequence cannot be in two steps in flight; an
    ended sequence's id comes back only once its step in flight is collected."""
    from ggml_py.errors import ModelError

    path = write_tiny(tmp_path / "f.gguf", "llama", seed=6, n_layer=3)
    rng = np.random.default_rng(1)
    prompts = [rng.integers(0, 200, n) for n in (5, 9, 3, 7, 4, 6)]

    def script(dec: BatchDecoder, kill=None) -> list[np.ndarray]:
        seqs = [dec.new_sequence() for _ in prompts]
        groups = [[0, 1], [2, 3], [4, 5]]
        out: list[np.ndarray] = []
        nxt = {s: list(p) for s, p in zip(seqs, prompts)}
        for step in range(4):
            pend = [dec.submit([(seqs[i], nxt[seqs[i]], True) for i in g]) for g in groups]  # all in flight
            if kill is not None and step == 2:
                kill()  # while they are: every step in flight fails, is undone, and runs again after the restart
            for g, p in zip(groups, pend):
                logits = p.result()
                out.append(logits)
                for i, row in zip(g, logits):
                    nxt[seqs[i]] = [int(row.argmax())]
        return out

    with load_model(path, backends=["simd"], n_ctx=N_CTX, progress=False) as m:
        with BatchDecoder(m, n_ctx=N_CTX, n_seq_max=6, n_batch=N_BATCH) as dec:
            whole = script(dec)  # one process: each submit computes at once
        pipe = start_pipeline(m, N_CTX, 6, N_BATCH, n_stages=3, backends="simd", n_threads=1)
        try:
            with BatchDecoder(m, n_ctx=N_CTX, n_seq_max=6, n_batch=N_BATCH, stages=[pipe]) as dec:
                got = script(dec)
                a = dec.submit([(0, [1], True)])
                with pytest.raises(ModelError, match="in a step in flight"):
                    dec.submit([(0, [2], True)])
                dec.free_sequence(0)
                assert 0 not in dec._free_ids  # its step is still in flight
                a.result()
                assert 0 in dec._free_ids
        finally:
            pipe.close()
        for i, (x, y) in enumerate(zip(got, whole)):
            assert nmse(x, y) < 1e-6, f"step {i}: {nmse(x, y):.2e}"
        pipe = start_pipeline(m, N_CTX, 6, N_BATCH, n_stages=2, backends="simd", n_threads=1, max_restarts=1)
        try:
            with BatchDecoder(m, n_ctx=N_CTX, n_seq_max=6, n_batch=N_BATCH, stages=[pipe]) as dec:
                got = script(dec, lambda: os.kill(pipe.info()[1]["pid"], signal.SIGKILL))
                assert dec.recoveries == 1
        finally:
            pipe.close()
        for i, (x, y) in enumerate(zip(got, whole)):
            assert nmse(x, y) < 1e-6, f"after a restart, step {i}: {nmse(x, y):.2e}"
            assert (x.argmax(-1) == y.argmax(-1)).all()


def test_generate_batch_on_a_pipeline_and_bounds_checked(cluster, tmp_path):
    """`generate_batch(model, prompts, stages=[pipe])` takes the pipeline's numbers and gives one process's tokens; a
    decoder asking for more cells, sequences or tokens a step than the stages were made for is refused."""
    import ggml_py as gp
    from ggml_py.errors import ModelError

    path = write_tiny(tmp_path / "g.gguf", "llama", seed=3, n_layer=2)
    with load_model(path, backends=["simd"], n_ctx=N_CTX, progress=False) as m:
        prompts = ["Hello there", "one two three", "the cat"]
        pipe = _pipeline(m, 2)
        try:
            got = gp.generate_batch(m, prompts, max_tokens=5, temperature=0, stop_at_eos=False, stages=[pipe])
            want = gp.generate_batch(m, prompts, max_tokens=5, temperature=0, stop_at_eos=False, n_parallel=N_SEQ,
                                     n_ctx=N_CTX)
            assert [c.tokens for c in got] == [c.tokens for c in want]
            for kw in ({"n_ctx": 2 * N_CTX}, {"n_seq_max": N_SEQ + 1}, {"n_batch": 2 * N_BATCH}):
                args = {"n_ctx": N_CTX, "n_seq_max": N_SEQ, "n_batch": N_BATCH, **kw}
                with pytest.raises(ModelError, match=f"a stage was made for {next(iter(kw))}="):
                    BatchDecoder(m, stages=[pipe], **args)
        finally:
            pipe.close()


def test_a_killed_stage_fails_the_step_naming_it_within_a_second(cluster, tmp_path):
    """(Not with a compiled graph: Ray 2.60's driver crashed in _raylet.so in about 1 of 8 such kills, in
    tests/cluster_faults.py --compiled; docs/cluster.md.)"""
    path = write_tiny(tmp_path / "k.gguf", "llama", seed=5, n_layer=2)
    with load_model(path, backends=["simd"], n_ctx=N_CTX, progress=False) as m:
        pipe = _pipeline(m, 2)
        try:
            with BatchDecoder(m, n_ctx=N_CTX, n_seq_max=N_SEQ, n_batch=N_BATCH, stages=[pipe]) as dec:
                s = dec.new_sequence()
                dec.decode([(s, [1, 2, 3], True)])
                os.kill(pipe.info()[1]["pid"], signal.SIGKILL)
                t0 = time.perf_counter()
                with pytest.raises(ClusterError, match=r"stage 1 \(blocks 1-1\) on node .* died"):
                    dec.decode([(s, [4], True)])
                assert time.perf_counter() - t0 < 1.0
        finally:
            pipe.close()


def test_a_killed_stage_is_started_again_and_the_tokens_are_the_same(cluster, tmp_path):
    """With restarts on, a stage killed between steps (stage 1, then stage 0 just after a sequence ended) is started
    again on its node, every cache rebuilt from the sequences' tokens, and the script's logits are one process's."""
    path = write_tiny(tmp_path / "r.gguf", "llama", seed=4, n_layer=3)
    with load_model(path, backends=["simd"], n_ctx=N_CTX, progress=False) as m:
        with BatchDecoder(m, n_ctx=N_CTX, n_seq_max=N_SEQ, n_batch=N_BATCH) as dec:
            whole = _script(dec, np.random.default_rng(0))
        pipe = _pipeline(m, 2, max_restarts=2)
        try:
            nodes = list(pipe.node_ids)
            kill = {1: 1, 6: 0}  # after step i, stage j's process is killed

            def after(i: int) -> None:
                if i in kill:
                    os.kill(pipe.info()[kill[i]]["pid"], signal.SIGKILL)

            with BatchDecoder(m, n_ctx=N_CTX, n_seq_max=N_SEQ, n_batch=N_BATCH, stages=[pipe]) as dec:
                got = _script(dec, np.random.default_rng(0), after)
                assert dec.recoveries == 2
            assert [r["stage"] for r in pipe.restarts] == [1, 0] and pipe.node_ids == nodes  # on their own nodes
            assert [i["plans_prepared"] for i in pipe.info()] == [1, 1]  # the new actors prepared theirs once
        finally:
            pipe.close()
        for i, (x, y) in enumerate(zip(got, whole)):
            assert nmse(x, y) < 1e-6, f"step {i}: {nmse(x, y):.2e}"
            assert (x.argmax(-1) == y.argmax(-1)).all()


def test_fault_runs_on_smollm2(cluster):
    """tests/cluster_faults.py with 3 runs (the command runs 100): a stage killed at a random moment
    of a 4-request generation ends the affected requests with an error naming it within a second, none hangs; with
    restarts on, every run ends with the tokens of a run without fault, and each stage prepared one plan."""
    from cluster_faults import measure

    r = measure(runs=3, max_tokens=16, address=cluster.address)
    no, yes = r["without_restarts"], r["with_restarts"]
    assert no["hung_runs"] == 0 and no["requests_with_a_wrong_or_unnamed_error"] == 0
    assert no["runs_killed_mid_generation"] >= 1 and no["kill_to_error_s"]["max"] < 1.0
    assert yes["hung_runs"] == 0 and not yes["failed"] and yes["runs_same_tokens"] == 3
    # one plan per stage that has stepped: a kill after a run's last step is recovered at once, by an actor that
    # has not stepped (nor prepared) yet when the figures are read
    assert yes["restarts"] == 3 and 1 in yes["plans_prepared_per_stage"]
    assert yes["plans_prepared_per_stage"] == [int(n > 0) for n in yes["steps_per_stage"]], yes


def test_restarts_are_bounded(cluster, tmp_path):
    path = write_tiny(tmp_path / "b.gguf", "llama", seed=5, n_layer=2)
    with load_model(path, backends=["simd"], n_ctx=N_CTX, progress=False) as m:
        pipe = start_pipeline(m, N_CTX, N_SEQ, N_BATCH, n_stages=2, backends="simd", n_threads=1, max_restarts=1)
        try:
            with BatchDecoder(m, n_ctx=N_CTX, n_seq_max=N_SEQ, n_batch=N_BATCH, stages=[pipe]) as dec:
                s = dec.new_sequence()
                dec.decode([(s, [1, 2, 3], True)])
                for k in range(2):
                    os.kill(pipe.info()[0]["pid"], signal.SIGKILL)
                    if k == 0:
                        dec.decode([(s, [4], True)])
                        continue
                    with pytest.raises(ClusterError, match=r"stage 0 .* is lost again .*max_restarts=1"):
                        dec.decode([(s, [5], True)])
        finally:
            pipe.close()


def test_a_memory_limit_splits_the_model_to_fit_or_refuses_it(cluster, tmp_path):
    """Each stage may hold at most `memory_limit` bytes (weights, KV, compute buffer): the blocks are split so that
    each stage fits, and each stage checked its parts against the limit; a limit no split can meet is refused before
    any actor starts, naming what each stage would need."""
    from ggml_py.models.stage import stage_memory_parts

    path = write_tiny(tmp_path / "m.gguf", "llama", seed=4, n_layer=4)
    with load_model(path, backends=["simd"], n_ctx=N_CTX, progress=False) as m:
        whole = sum(n for _, n in stage_memory_parts(m, range(0, 4), N_CTX, N_SEQ, N_BATCH, m.cache.dtype))
        limit = int(0.6 * whole)
        pipe = start_pipeline(m, N_CTX, N_SEQ, N_BATCH, n_stages=2, backends="simd", n_threads=1,
                              memory_limit=limit)
        try:
            held = [sum(n for _, n in i["memory_parts"]) for i in pipe.info()]
            assert all(h <= limit for h in held) and sum(held) >= whole, (held, limit, whole)
            with BatchDecoder(m, n_ctx=N_CTX, n_seq_max=N_SEQ, n_batch=N_BATCH, stages=[pipe]) as dec:
                s = dec.new_sequence()
                assert np.isfinite(dec.decode([(s, [1, 2, 3], True)])).all()
        finally:
            pipe.close()
        with pytest.raises(ClusterError, match=r"does not fit in 2 stages .*stage 0: blocks 0-"):
            start_pipeline(m, N_CTX, N_SEQ, N_BATCH, n_stages=2, memory_limit=int(0.4 * whole))


def test_a_remote_cluster_without_token_authentication_is_refused(monkeypatch):
    monkeypatch.delenv("RAY_AUTH_MODE", raising=False)
    for address in ("10.0.0.7:6379", "ray://192.168.1.20:10001", "example.org:6379"):
        with pytest.raises(ClusterError, match="token authentication is off"):
            connect(address)


def test_a_local_cluster_is_new_even_beside_a_dead_one():
    """connect() with no address starts a new local instance, even when the last cluster started on this machine
    left its address behind and is gone (Ray's own default would try to join it, and fail after 40 s)."""
    import subprocess
    import sys
    import tempfile
    from pathlib import Path

    code = ("from ggml_py.cluster.pipeline import connect; "
            "print(connect(None).get_runtime_context().gcs_address)")
    with tempfile.TemporaryDirectory(dir="/tmp") as tmp:  # short: Ray's socket paths under it must be < 108 bytes
        (Path(tmp) / "ray").mkdir()
        (Path(tmp) / "ray" / "ray_current_cluster").write_text("127.0.0.1:9")  # nothing listens there
        t0 = time.perf_counter()
        r = subprocess.run([sys.executable, "-c", code], env={**os.environ, "TMPDIR": tmp},
                           capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.strip().splitlines()[-1] != "127.0.0.1:9" and time.perf_counter() - t0 < 30


def test_the_server_on_a_two_stage_cluster_answers_16_concurrent_clients(cluster):
    """`ggml-py serve --cluster ADDRESS --stages 2` on SmolLM2: 16 openai clients at once all complete, with their
    token counts, and the stages are in the log. (Which tokens a request gets beside 15 others can differ from one
    process's at near ties until issue 26's deterministic kernels; test_the_engine_serves_from_a_pipeline compares
    tokens exactly on a fixed admission order.)"""
    from concurrent.futures import ThreadPoolExecutor

    from serve_helpers import ServerProc

    from ggml_py.models import default_model_path

    questions = [f"Name {i + 2} colors." for i in range(16)]
    srv = ServerProc(default_model_path(), "--cluster", cluster.address, "--stages", "2", "-np", "4", "-t", "1",
                     "--backend", "simd")
    try:
        assert "2 pipeline stages: blocks 0-" in srv.log_text
        client = srv.client(timeout=120)

        def ask(q: str):
            return client.completions.create(model="x", prompt=q, max_tokens=8, temperature=0)

        with ThreadPoolExecutor(16) as pool:
            got = list(pool.map(ask, questions))
        m = srv.metrics()
    finally:
        code, _ = srv.stop()
    assert code == 0
    assert all(r.choices[0].finish_reason in ("length", "stop") and r.choices[0].text for r in got)
    assert sum(r.usage.completion_tokens for r in got) == m["tokens_generated"] >= 16
    assert m["requests_finished"] == 16


def _stage_pids() -> list[int]:
    """The processes of stage actors now alive on this machine (Ray names a worker's process after its actor)."""
    pids = []
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/cmdline", "rb") as f:
                    if b"StageHost" in f.read():
                        pids.append(int(d))
            except OSError:
                pass
    return pids


def test_the_server_answers_503_naming_a_lost_stage(cluster):
    """Without restarts, a stage that dies ends the request with HTTP 503 (server_unavailable: not the request's
    fault) naming the stage and its node; the health check then says the server failed."""
    import httpx
    from serve_helpers import ServerProc

    from ggml_py.models import default_model_path

    before = set(_stage_pids())
    srv = ServerProc(default_model_path(), "--cluster", cluster.address, "--stages", "2", "-np", "2", "-t", "1",
                     "--backend", "simd")
    try:
        body = {"model": "x", "prompt": "Hello", "max_tokens": 4, "temperature": 0}
        assert httpx.post(f"{srv.url}/v1/completions", json=body, timeout=60).status_code == 200
        stages = set(_stage_pids()) - before
        assert len(stages) == 2
        for pid in stages:
            os.kill(pid, signal.SIGKILL)
        t0 = time.perf_counter()
        r = httpx.post(f"{srv.url}/v1/completions", json=body, timeout=60)
        assert time.perf_counter() - t0 < 2.0
        assert r.status_code == 503, r.text
        err = r.json()["error"]
        assert err["type"] == "server_unavailable" and re.search(r"stage \d \(blocks \d+-\d+\) on node .* died",
                                                                   err["message"]), err
        assert httpx.get(f"{srv.url}/health", timeout=10).status_code == 500
    finally:
        srv.stop()


def test_bench_cluster_runs(cluster, tmp_path):
    """`ggml-py bench cluster --quick --cluster ADDRESS` on this module's cluster (the command's own local cluster is
    the same few lines as the fixture's): the figures are reported, each stage prepared one plan, the pipeline gives
    one process's greedy tokens, the bytes per boundary stay in bounds; the cluster is left running."""
    import json
    import shutil
    import subprocess
    import sys
    from pathlib import Path

    path = write_tiny(tmp_path / "b.gguf", "llama", seed=2, n_layer=2)
    exe = shutil.which("ggml-py", path=str(Path(sys.executable).parent))
    r = subprocess.run([exe, "bench", "cluster", "-m", path, "--stages", "2", "--quick", "--json",
                        "--cluster", cluster.address], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout)
    assert out["plans_prepared"] == out["plans_prepared_compiled"] == [1, 1] and out["same_tokens"]
    assert out["graphs_compiled"] == 1
    assert [v["completed"] for k, v in out["requests"].items() if k != "served"] == [out["requests"]["served"]] * 2
    assert 0 < out["boundary_bytes_per_token"] <= out["limit_bytes_per_token"]
    assert all(x > 0 for way in ("compiled", "calls") for x in out["ms_per_token"][way]
               + out["stage_compute_ms_per_token"][way])
    assert 0 < out["ray_alone_ms_per_hop"] <= out["ray_alone_ms_per_hop_median"]
    assert len(_alive_nodes(ray)) == 3
