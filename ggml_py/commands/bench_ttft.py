"""`ggml-py bench ttft`: time to first token from a cold process, ggml_py against llama.cpp.

What a user waits for after typing a command: the interpreter starting, the runtime imported, the model loaded,
whatever preparation the runtime does (ggml_py: plans, weight repacking; llama.cpp: its own repacking), the prompt's
prefill and the first token sampled. Each run is a fresh process; the clock starts just before it is spawned and
stops when it reports its first token (time.time() in both, the same host clock). The two runtimes alternate,
`rounds` times; best and median are reported, and the child's own split of the time (import, load, first token).
The page cache is warm for both (the file was read before): a cold disk would add the same read time to both.
"""

from __future__ import annotations

import os
import statistics
import sys
import time
from typing import Any

from ggml_py.commands.bench_matrix import run_job
from ggml_py.commands.bench_model import BENCH_TEXT, ensure_llamacpp

# argv[1]: {"model", "threads", "n_prompt", "text"}; prints "RESULT {json}" with time.time() stamps
_OURS = r"""
import time
t_start = time.time()
import json, sys
a = json.loads(sys.argv[1])
import ggml_py
t_import = time.time()
m = ggml_py.load_model(a["model"], n_threads=a["threads"], n_ctx=a["n_prompt"] + 16, progress=False)
t_load = time.time()
ids = []
while len(ids) < a["n_prompt"]:
    ids += m.tokenize(a["text"], add_special=False)
tok = next(iter(m.generate(ids[:a["n_prompt"]], 1, temperature=0.0, stop_at_eos=False)))
t_first = time.time()
print("RESULT " + json.dumps({"start": t_start, "import": t_import, "load": t_load, "first": t_first,
                              "token": int(tok.id)}))
"""

_LLAMACPP = r"""
import time
t_start = time.time()
import json, sys
a = json.loads(sys.argv[1])
from llama_cpp import Llama
t_import = time.time()
llm = Llama(model_path=a["model"], n_ctx=a["n_prompt"] + 16, n_threads=a["threads"], n_threads_batch=a["threads"],
            n_batch=512, verbose=False)
t_load = time.time()
ids = []
while len(ids) < a["n_prompt"]:
    ids += llm.tokenize(a["text"].encode(), add_bos=False)
tok = next(iter(llm.generate(ids[:a["n_prompt"]], temp=0.0, top_k=1, repeat_penalty=1.0, reset=True)))
t_first = time.time()
print("RESULT " + json.dumps({"start": t_start, "import": t_import, "load": t_load, "first": t_first,
                              "token": int(tok)}))
"""


def _run(python: str, script: str, job: dict[str, Any], who: str) -> dict[str, float]:
    t0 = time.time()
    r = run_job(python, script, job, who)
    return {"ttft": r["first"] - t0, "interpreter": r["start"] - t0, "import": r["import"] - r["start"],
            "load": r["load"] - r["import"], "prefill_first_token": r["first"] - r["load"], "token": r["token"]}


def run(model: str | None = None, threads: int = 2, n_prompt: int = 128, rounds: int = 5, quick: bool = False,
        **_: Any) -> dict[str, Any]:
    """Measure (module docstring); progress on stderr."""
    from ggml_py.models import default_model_path

    if quick:
        n_prompt, rounds = 16, 1
    path = model or default_model_path()
    llama_py = os.environ.get("LLAMA_CPP_PYTHON") or ensure_llamacpp()
    with open(path, "rb") as f:  # the page cache warm for both runtimes
        while f.read(1 << 24):
            pass
    job = {"model": path, "threads": threads, "n_prompt": n_prompt, "text": BENCH_TEXT}
    runs: dict[str, list[dict[str, float]]] = {"ggml_py": [], "llama.cpp": []}
    order = [("ggml_py", sys.executable, _OURS), ("llama.cpp", llama_py, _LLAMACPP)]
    for k in range(rounds):
        for who, py, script in order if k % 2 == 0 else order[::-1]:
            r = _run(py, script, job, who)
            runs[who].append(r)
            print(f"  round {k + 1}: {who} {r['ttft']:.3f} s", file=sys.stderr, flush=True)
    out: dict[str, Any] = {"benchmark": "ttft", "model": path, "threads": threads, "n_prompt": n_prompt,
                           "rounds": rounds}
    for who, rs in runs.items():
        best = min(rs, key=lambda r: r["ttft"])
        out[who] = {"best": best["ttft"], "median": statistics.median(r["ttft"] for r in rs),
                    "spread": [min(r["ttft"] for r in rs), max(r["ttft"] for r in rs)],
                    "best_parts": {k: best[k] for k in ("interpreter", "import", "load", "prefill_first_token")},
                    "first_token": best["token"]}
    out["ratio_best"] = out["ggml_py"]["best"] / out["llama.cpp"]["best"]
    out["ratio_median"] = out["ggml_py"]["median"] / out["llama.cpp"]["median"]
    return out


def report(r: dict[str, Any]) -> str:
    lines = [f"bench ttft: {os.path.basename(r['model'])}, {r['n_prompt']}-token prompt, {r['threads']} threads, "
             f"a fresh process each, {r['rounds']} interleaved rounds (ratio < 1: ggml_py first sooner)"]
    for who in ("ggml_py", "llama.cpp"):
        x = r[who]
        parts = ", ".join(f"{k} {v:.3f}" for k, v in x["best_parts"].items())
        lines.append(f"  {who:<9} best {x['best']:.3f} s, median {x['median']:.3f} s "
                     f"(spread {x['spread'][0]:.3f}-{x['spread'][1]:.3f}); best's parts: {parts}")
    lines.append(f"  ratio ggml_py / llama.cpp: best {r['ratio_best']:.2f}x, median {r['ratio_median']:.2f}x")
    return "\n".join(lines)
