"""`ggml-py bench model`: SmolLM2 prefill and decode speed, graph reuse vs rebuild, and llama.cpp side by side.

One run measures, at the same thread count and on the same prompt tokens:
- ggml_py prefill tok/s (a `n_prompt`-token prompt) and decode tok/s (`n_gen` greedy tokens), with graph reuse;
- decode tok/s with `graph_reuse=False` (graph rebuilt and re-prepared every step) and the ratio;
- host overhead of a decode step (time outside plan.compute), peak RSS against file + KV cache + 300 MB;
- with `vs_llamacpp`: llama-cpp-python in a subprocess from a side venv (created on demand), its prefill/decode
  tok/s and our ratios to them, whether the greedy tokens agree, and the NMSE of our logits against its logits
  (logits_all=True) over the prompt and the generated tokens.
"""

from __future__ import annotations

import json as _json
import os
import subprocess
import sys
import tempfile
import time
from typing import Any

import numpy as np

from ggml_py.commands import llamacpp_venv
from ggml_py.commands.profile_report import plan_profile_lines
from ggml_py.errors import GgmlPyError
from ggml_py.sysmem import peak_rss_bytes

# The side venv with llama-cpp-python (made on first use); LLAMA_CPP_PYTHON, when set, names an interpreter to use
# instead (e.g. the one `make llamacpp-venv` makes).
LLAMACPP_VENV = os.environ.get("GGML_PY_LLAMACPP_VENV",
                               os.path.join(os.path.expanduser("~"), ".cache", "ggml_py", "llamacpp-venv"))
BENCH_TEXT = ("The history of natural philosophy runs from the speculations of the ancient Greeks about the elements, "
              "through the careful measurements of astronomers in the middle ages, to the experiments of Galileo and "
              "the laws of motion written down by Newton. Each generation asked how the world is made and why it "
              "moves, and each answer raised new questions about light, heat, electricity and the smallest parts of "
              "matter. ")


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def prompt_tokens(model: Any, n: int) -> list[int]:
    """Exactly n tokens of English text (the paragraph repeated)."""
    ids: list[int] = []
    chunk = model.tokenize(BENCH_TEXT, add_special=False)
    while len(ids) < n:
        ids += chunk
    return ids[:n]


def _greedy(model: Any, ids: list[int], n_gen: int) -> tuple[list[int], dict[str, Any]]:
    toks = [t.id for t in model.generate(ids, n_gen + 1, temperature=0.0, stop_at_eos=False)]
    return toks, model.timings


def run(vs_llamacpp: bool = False, n_prompt: int = 128, n_gen: int = 64, threads: int = 2, json: bool = False,
        backend: str | None = None, model: str | None = None, profile: bool = False, quick: bool = False,
        **_: Any) -> dict[str, Any]:
    """Measure and return the figures (see the module docstring). Progress goes to stderr. `quick`: 16 prompt
    tokens and 8 generated, a functional smoke run."""
    if quick:
        n_prompt, n_gen = min(n_prompt, 16), min(n_gen, 8)
    from ggml_py.models import load_model

    t0 = time.perf_counter()
    m = load_model(model, backends=backend, n_threads=threads, n_ctx=n_prompt + n_gen + 16)
    load_s = time.perf_counter() - t0
    try:
        ids = prompt_tokens(m, n_prompt)
        _log(f"bench model: {os.path.basename(m.path)} on {','.join(m.backend_names)}, {threads} threads, "
             f"prompt {n_prompt} tokens, {n_gen} generated")
        # warm-up: prepares the prefill and decode plans, touches the weights (mmap pages, backend caches)
        _greedy(m, ids, 2)
        toks, t = _greedy(m, ids, n_gen)
        _log(f"  reuse    : prefill {t['prefill_tok_s']:.1f} tok/s, decode {t['decode_tok_s']:.1f} tok/s, "
             f"host overhead {100 * t['host_overhead_frac']:.1f}%")
        # where a decode step's time goes: the decode plan again, with the last step's inputs and bindings
        prof = m._plans[(1, False)].plan.profile(computes=20) if profile else None
        prepared_before = m.plans_prepared
        m.graph_reuse = False
        try:
            toks_nr, t_nr = _greedy(m, ids, n_gen)
        finally:
            m.graph_reuse = True
        _log(f"  no reuse : decode {t_nr['decode_tok_s']:.1f} tok/s ({m.plans_prepared - prepared_before} plans "
             "prepared)")
        kv_bytes = m.cache.nbytes
        file_bytes = os.path.getsize(m.path)
        rss = peak_rss_bytes()
        res: dict[str, Any] = {
            "benchmark": "model", "model": m.path, "backends": m.backend_names, "threads": threads,
            "n_prompt": n_prompt, "n_gen": n_gen, "load_s": load_s,
            "prefill_tok_s": t["prefill_tok_s"], "decode_tok_s": t["decode_tok_s"],
            "generate_tok_s": t["generate_tok_s"], "host_overhead_frac": t["host_overhead_frac"],
            "prefill_host_overhead_frac": t["prefill_host_overhead_frac"],
            "decode_tok_s_no_reuse": t_nr["decode_tok_s"],
            "reuse_speedup": t["decode_tok_s"] / t_nr["decode_tok_s"] if t_nr["decode_tok_s"] else None,
            "no_reuse_identical_tokens": toks == toks_nr,
            "plans_prepared": m.plans_prepared, "plans_reused": m.plans_reused,
            "peak_rss_bytes": rss, "file_bytes": file_bytes, "kv_cache_bytes": kv_bytes,
            "rss_budget_bytes": file_bytes + kv_bytes + 300 * 2**20,
            "rss_within_budget": rss <= file_bytes + kv_bytes + 300 * 2**20,
            "tokens": toks, "text": m.detokenize(toks),
        }
        if prof is not None:
            res["decode_profile"] = prof
        if vs_llamacpp:
            res["llamacpp"] = lc = run_llamacpp(m.path, ids, n_gen, threads, n_ctx=m.n_ctx)
            res["decode_ratio_vs_llamacpp"] = t["decode_tok_s"] / lc["decode_tok_s"] if lc["decode_tok_s"] else None
            res["prefill_ratio_vs_llamacpp"] = (t["prefill_tok_s"] / lc["prefill_tok_s"]
                                                if lc["prefill_tok_s"] else None)
            same = 0
            for a, b in zip(toks, lc["tokens"]):
                if a != b:
                    break
                same += 1
            res["greedy_tokens_identical"] = toks[:n_gen] == lc["tokens"][:n_gen]
            res["greedy_tokens_common_prefix"] = same
            # our logits over exactly llama.cpp's sequence (prompt + its greedy tokens), all positions
            seq = ids + lc["tokens"][:-1]
            m.reset()
            ours = m.eval(seq)
            theirs = np.load(lc["logits_file"])
            os.unlink(lc["logits_file"])
            lc.pop("logits_file")
            n = min(len(ours), len(theirs))
            a64, b64 = ours[:n].astype(np.float64), theirs[:n].astype(np.float64)
            res["logits_nmse_vs_llamacpp"] = float(((a64 - b64) ** 2).sum() / (b64 ** 2).sum())
            res["logits_argmax_agreement"] = float((a64.argmax(-1) == b64.argmax(-1)).mean())
        return res
    finally:
        m.close()


# -- llama.cpp side --------------------------------------------------------------------------------------------
_SIDE_SCRIPT = r"""
import json, resource, sys, time
import numpy as np
from llama_cpp import Llama
a = json.loads(sys.argv[1])
ids, n_gen, th = a["ids"], a["n_gen"], a["threads"]
kw = dict(model_path=a["model"], n_ctx=a["n_ctx"], n_threads=th, n_threads_batch=th, n_batch=512, verbose=False)
llm = Llama(**kw)
def greedy():
    llm.reset()
    out, stamps = [], []
    t0 = time.perf_counter()
    for tok in llm.generate(ids, temp=0.0, top_k=1, repeat_penalty=1.0, reset=True):
        stamps.append(time.perf_counter())
        out.append(int(tok))
        if len(out) >= n_gen + 1:
            break
    return out, t0, stamps
greedy()  # warm-up
toks, t0, st = greedy()
prefill_s = st[0] - t0                     # prompt eval + first sample
decode_s = st[-1] - st[0]                  # n_gen one-token evals (+ sampling)
res = {"prefill_tok_s": len(ids) / prefill_s, "decode_tok_s": n_gen / decode_s, "tokens": toks,
       "version": __import__("llama_cpp").__version__,
       # the same job as ours (before the logits_all run below, which holds every position's logits)
       # VmHWM: this process's own peak (ru_maxrss would include the RSS of the bench process it was forked from)
       "peak_rss_bytes": next(int(ln.split()[1]) for ln in open("/proc/self/status") if ln.startswith("VmHWM:"))
       * 1024}
del llm
llm = Llama(logits_all=True, **kw)
seq = ids + toks[:-1]
llm.eval(seq)
np.save(a["logits_file"], np.asarray(llm.scores[: len(seq)], dtype=np.float32))
res["logits_file"] = a["logits_file"]
print("RESULT " + json.dumps(res))
"""


def ensure_llamacpp(venv: str = LLAMACPP_VENV) -> str:
    """The python of a side venv with llama-cpp-python (commands/llamacpp_venv.py: the version and build the tests
    use), created and installed if missing, pip's output on stderr."""
    try:
        return llamacpp_venv.ensure(venv, log=_log)
    except (RuntimeError, subprocess.CalledProcessError) as e:
        raise GgmlPyError(f"llama-cpp-python in {venv}: {e}") from None


def run_llamacpp(model_path: str, ids: list[int], n_gen: int, threads: int, n_ctx: int) -> dict[str, Any]:
    """Greedy generation with llama-cpp-python in a subprocess: prefill/decode tok/s, tokens, all logits (.npy)."""
    py = os.environ.get("LLAMA_CPP_PYTHON") or ensure_llamacpp()
    fd, logits_file = tempfile.mkstemp(suffix=".npy", prefix="llamacpp_logits_")
    os.close(fd)
    arg = _json.dumps({"model": model_path, "ids": ids, "n_gen": n_gen, "threads": threads, "n_ctx": n_ctx,
                       "logits_file": logits_file})
    _log(f"  llama.cpp: running {py} ...")
    p = subprocess.run([py, "-c", _SIDE_SCRIPT, arg], capture_output=True, text=True)
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith("RESULT ")]
    if p.returncode != 0 or not lines:
        tail = (p.stderr or p.stdout).strip().splitlines()[-1:] or ["no output"]
        raise GgmlPyError(f"llama-cpp-python run failed (exit {p.returncode}): {tail[0]}")
    res = _json.loads(lines[-1][len("RESULT "):])
    _log(f"  llama.cpp {res.get('version')}: prefill {res['prefill_tok_s']:.1f} tok/s, decode "
         f"{res['decode_tok_s']:.1f} tok/s")
    return res


def report(r: dict[str, Any]) -> str:
    mb = 2**20
    lines = [
        f"bench model: {os.path.basename(r['model'])} on {','.join(r['backends'])}, {r['threads']} threads",
        f"  prefill {r['n_prompt']} tokens      : {r['prefill_tok_s']:8.1f} tok/s",
        f"  decode {r['n_gen']} tokens        : {r['decode_tok_s']:8.1f} tok/s  (host overhead "
        f"{100 * r['host_overhead_frac']:.1f}% of a step)",
        f"  decode, no graph reuse  : {r['decode_tok_s_no_reuse']:8.1f} tok/s  -> reuse is "
        f"{r['reuse_speedup']:.2f}x (identical tokens: {r['no_reuse_identical_tokens']})",
        f"  plans prepared {r['plans_prepared']}, reused {r['plans_reused']}",
        f"  peak RSS {r['peak_rss_bytes'] / mb:.0f} MB (budget file + KV + 300 MB = "
        f"{r['rss_budget_bytes'] / mb:.0f} MB: {'ok' if r['rss_within_budget'] else 'OVER'})",
    ]
    prof = r.get("decode_profile")
    if prof:
        lines.append("  decode step profile:")
        lines += plan_profile_lines(prof, "    ")
    lc = r.get("llamacpp")
    if lc:
        lines += [
            f"  llama.cpp {lc.get('version')}: prefill {lc['prefill_tok_s']:.1f} tok/s, decode "
            f"{lc['decode_tok_s']:.1f} tok/s, peak RSS {lc.get('peak_rss_bytes', 0) / mb:.0f} MB",
            f"  ratio ggml_py/llama.cpp : prefill {r['prefill_ratio_vs_llamacpp']:.2f}x, decode "
            f"{r['decode_ratio_vs_llamacpp']:.2f}x",
            f"  greedy tokens identical : {r['greedy_tokens_identical']} (common prefix "
            f"{r['greedy_tokens_common_prefix']}/{r['n_gen'] + 1}), logits NMSE {r['logits_nmse_vs_llamacpp']:.2e}, "
            f"argmax agreement {100 * r['logits_argmax_agreement']:.1f}%",
        ]
    return "\n".join(lines)
