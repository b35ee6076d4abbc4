"""llama.cpp as the peer of the tests: code run next to llama-cpp-python, in this process when it is importable,
else in the interpreter named by $LLAMA_CPP_PYTHON (a separate environment that has it: CI makes one with
`make llamacpp-venv`). Arguments and results cross as JSON; large arrays go through .npy files."""

from __future__ import annotations

import functools
import json
import os
import subprocess
from pathlib import Path
from typing import Any

import numpy as np

from conftest import tool_env

NOT_AVAILABLE = "llama_cpp not importable (set LLAMA_CPP_PYTHON to an interpreter with llama-cpp-python)"


@functools.cache
def _in_process() -> bool:
    try:
        import llama_cpp  # noqa: F401
    except ImportError:
        return False
    return True


def available() -> bool:
    return _in_process() or bool(os.environ.get("LLAMA_CPP_PYTHON"))


def run(worker: str, *args: Any) -> Any:
    """Execute `worker` (Python source defining `run(*args)`) next to llama_cpp and return what run returned.
    None when llama.cpp is not available (callers skip with NOT_AVAILABLE)."""
    if _in_process():
        namespace: dict[str, Any] = {}
        exec(worker, namespace)
        return namespace["run"](*args)
    python = os.environ.get("LLAMA_CPP_PYTHON")
    if not python:
        return None
    code = worker + "\nimport json, sys\njson.dump(run(*json.load(sys.stdin)), sys.stdout)\n"
    # the peer runs none of our native code: under make test-asan / test-tsan it goes without the sanitizer runtime
    # (LSan's exit scan of a process holding a model: test_architectures under ASan 140 -> 77 s)
    out = subprocess.run([python, "-c", code], input=json.dumps(list(args)), capture_output=True, text=True,
                         env=tool_env())
    if out.returncode:
        raise RuntimeError(f"llama.cpp worker failed ({python}, exit {out.returncode}):\n{out.stderr[-3000:]}")
    return json.loads(out.stdout)


# Runs next to llama_cpp: the logits of every prompt position (saved to `out` as .npy), on a small context.
PROMPT_LOGITS_WORKER = """
import numpy as np
import llama_cpp


def run(model, ids, out, n_ctx=128):
    llm = llama_cpp.Llama(model_path=model, n_ctx=n_ctx, n_batch=512, logits_all=True, verbose=False, n_threads=2)
    llm.eval(ids)
    np.save(out, np.array(llm.scores[: len(ids)], dtype=np.float32))
    return 0
"""

def prompt_logits(model: str | Path, ids: list[int], out: str | Path, n_ctx: int = 128) -> np.ndarray:
    """llama.cpp's logits of every position of the prompt `ids` on `model`, (len(ids), n_vocab) F32."""
    if run(PROMPT_LOGITS_WORKER, str(model), list(ids), str(out), n_ctx) is None:
        raise RuntimeError(NOT_AVAILABLE)
    return np.load(out)


def _log_softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    m = x.max(axis=-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(axis=-1, keepdims=True))


def kl_top1(ours: np.ndarray, theirs: np.ndarray) -> tuple[float, float, int, int]:
    """How far our logits are from llama.cpp's, row by row, as llama-perplexity judges a quantization: the mean and
    the max KL(llama.cpp || ours) of the softmax, and top-1 agreement counted where llama.cpp's own best two logits
    are at least NEAR_TIE apart: (mean_kl, max_kl, agreeing, rows_counted). Give the model an untied head (a random
    tied embedding makes logits of ~100 and a one-hot softmax, whose KL is 0 whatever the graph does)."""
    lp, lq = _log_softmax(theirs), _log_softmax(ours)
    kl = (np.exp(lp) * (lp - lq)).sum(axis=-1)
    top2 = np.sort(theirs, axis=-1)[:, -2:]
    clear = (top2[:, 1] - top2[:, 0]) >= NEAR_TIE
    agree = theirs.argmax(axis=-1) == ours.argmax(axis=-1)
    return float(kl.mean()), float(kl.max()), int((agree & clear).sum()), int(clear.sum())


# Runs next to llama_cpp: logits of every prompt position (saved to `out` as .npy), then `n_gen` greedy tokens with
# the margin between the best and the second-best logit at each step (each step's logits saved to `out`.steps.npy).
GREEDY_WORKER = """
import numpy as np
import llama_cpp


def run(model, ids, out, n_gen):
    llm = llama_cpp.Llama(model_path=model, n_ctx=256, logits_all=True, verbose=False, n_threads=2)
    llm.eval(ids)
    np.save(out, np.array(llm.scores[: len(ids)], dtype=np.float32))
    gen, margins, steps = [], [], []
    for _ in range(n_gen):
        s = np.array(llm.scores[llm.n_tokens - 1])
        top2 = np.sort(s)[-2:]
        gen.append(int(np.argmax(s)))
        margins.append(float(top2[1] - top2[0]))
        steps.append(s)
        llm.eval([gen[-1]])
    if steps:
        np.save(out[:-4] + ".steps.npy", np.array(steps, dtype=np.float32))
    return gen, margins
"""

# A step where llama.cpp's best two logits are closer than this is a near tie that the rounding of 8-bit
# activations may decide either way (measured: our logits differ from llama.cpp's by up to ~0.15 there).
NEAR_TIE = 0.25


def near_ties(margins: list[float], exact: np.ndarray) -> list[bool]:
    """Per greedy step of llama.cpp: a near tie, where either token is right. That is where llama.cpp's best two
    logits are within NEAR_TIE, or where the exact computation's are: `exact` holds the numpy backend's logits (float
    activations, no 8-bit rounding) on llama.cpp's sequence, (n_steps, n_vocab). The second rule is needed because
    llama.cpp's own rounding moves a margin by up to ~1: on an AMD EPYC (llama.cpp 0.3.36, AVX-512 build) its decode
    steps put <|im_end|> 0.38 ahead of <|im_start|> on SmolLM2's Q4_1 file where its batched evaluation of the same
    sequence says 0.14 and the exact one 0.00002, and on the Q4_K_M file 0.96 where the exact one says 0.016."""
    top2 = np.sort(exact, axis=-1)[:, -2:]
    return [m < NEAR_TIE or float(t[1] - t[0]) < NEAR_TIE for m, t in zip(margins, top2)]


def greedy(model: str, ids: list[int], n_gen: int, out: str | Path) -> tuple[np.ndarray, list[int], list[float]]:
    """llama.cpp on `model`: the prompt's logits, then `n_gen` greedy tokens and each step's top-2 margin."""
    res = run(GREEDY_WORKER, str(model), list(ids), str(out), n_gen)
    if res is None:
        raise RuntimeError(NOT_AVAILABLE)
    gen, margins = res
    return np.load(out), gen, margins


def greedy_step_logits(out: str | Path) -> np.ndarray:
    """The logits llama.cpp chose each greedy token from, (n_gen, n_vocab): step 0's are the prompt's last row, the
    others come from its one-token decode steps."""
    return np.load(str(out)[:-4] + ".steps.npy")


def first_near_tie(margins: list[float]) -> int:
    """The first step where llama.cpp's choice is a near tie (len(margins) if none)."""
    return next((i for i, m in enumerate(margins) if m < NEAR_TIE), len(margins))
