"""`ggml-py bench serve`: aggregate decode tok/s of B concurrent streams (B = 1, 4, 8, 16), ggml_py's continuous
batching against llama.cpp's batched decode, interleaved in one run.

For every B, each side prefills B different prompts of `n_prompt` tokens (not timed), then decodes `n_gen` greedy
tokens per stream, every step advancing all B streams by one token, and reports B * n_gen / decode seconds:
- ggml_py: the serving path itself, a `Engine` (one prepared plan, per-request sampling, streaming text) stepped
  on this thread; `plans_prepared` over the whole run is reported (one is expected);
- llama.cpp (llama-cpp-python's low-level API in a side process that loads the model once): one `llama_decode` of a
  batch holding one token of each of the B sequences (seq ids 0..B-1, a unified KV cache), logits of every row,
  greedy argmax on the host.
The side process stays up and the two sides alternate per B (rounds: `rounds`), so both see the same machine load;
the best round of each is kept. Ratios are ggml_py / llama.cpp and B streams / one stream.
"""

from __future__ import annotations

import json as _json
import os
import subprocess
import tempfile
import time
from typing import Any

from ggml_py.commands.bench_model import BENCH_TEXT, _log, ensure_llamacpp
from ggml_py.errors import GgmlPyError

CONCURRENCY = (1, 4, 8, 16)

_SIDE = r"""
import json, sys, time
import numpy as np
import llama_cpp as L

a = json.loads(sys.argv[1])
L.llama_backend_init()
mp = L.llama_model_default_params()
model = L.llama_model_load_from_file(a["model"].encode(), mp)
vocab = L.llama_model_get_vocab(model)
n_vocab = L.llama_vocab_n_tokens(vocab)
B_MAX, n_ctx = a["b_max"], a["n_ctx"]
cp = L.llama_context_default_params()
cp.n_ctx, cp.n_batch, cp.n_ubatch, cp.n_seq_max = n_ctx, 512, 512, B_MAX
cp.n_threads = cp.n_threads_batch = a["threads"]
cp.kv_unified = True
ctx = L.llama_init_from_model(model, cp)
batch = L.llama_batch_init(512, 0, B_MAX)
mem = L.llama_get_memory(ctx)

def fill(items):  # items: (token, pos, seq, want_logits)
    batch.n_tokens = len(items)
    for i, (t, p, s, o) in enumerate(items):
        batch.token[i], batch.pos[i], batch.n_seq_id[i] = t, p, 1
        batch.seq_id[i][0] = s
        batch.logits[i] = 1 if o else 0

def decode(items):
    fill(items)
    rc = L.llama_decode(ctx, batch)
    if rc != 0:
        raise RuntimeError(f"llama_decode returned {rc}")

def argmax(i):
    return int(np.ctypeslib.as_array(L.llama_get_logits_ith(ctx, i), shape=(n_vocab,)).argmax())

print("READY", flush=True)
for line in sys.stdin:
    req = json.loads(line)
    prompts, n_gen = req["prompts"], req["n_gen"]
    B = len(prompts)
    L.llama_memory_clear(mem, True)
    nxt = []
    for s, p in enumerate(prompts):  # prefill, one sequence at a time (not timed)
        for c in range(0, len(p), 512):
            chunk = p[c:c + 512]
            decode([(t, c + j, s, c + j == len(p) - 1) for j, t in enumerate(chunk)])
        nxt.append(argmax(len(p) - 1 - (len(p) - 1) // 512 * 512))
    toks = [[t] for t in nxt]
    pos = [len(p) for p in prompts]
    L.llama_synchronize(ctx)
    t0 = time.perf_counter()
    for _ in range(n_gen):
        decode([(nxt[s], pos[s], s, True) for s in range(B)])
        nxt = [argmax(s) for s in range(B)]
        for s in range(B):
            pos[s] += 1
            toks[s].append(nxt[s])
    dt = time.perf_counter() - t0
    print("RESULT " + json.dumps({"decode_s": dt, "tok_s": B * n_gen / dt, "tokens": toks}), flush=True)
L.llama_batch_free(batch)
L.llama_free(ctx)
L.llama_model_free(model)
"""


class _LlamaCpp:
    """The side process: loads the model once, runs one concurrency per request line."""

    def __init__(self, model: str, threads: int, b_max: int, n_ctx: int) -> None:
        py = os.environ.get("LLAMA_CPP_PYTHON") or ensure_llamacpp()
        arg = _json.dumps({"model": model, "threads": threads, "b_max": b_max, "n_ctx": n_ctx})
        # stderr (llama.cpp logs a lot) goes to a file: a pipe nobody reads would fill and block the side process
        self.err = tempfile.TemporaryFile(mode="w+")
        self.p = subprocess.Popen([py, "-c", _SIDE, arg], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                  stderr=self.err, text=True)
        line = self._line()
        if line != "READY":
            raise GgmlPyError(f"llama-cpp-python side process failed: {line or self._err()}")
        self.version = subprocess.run([py, "-c", "import llama_cpp; print(llama_cpp.__version__)"],
                                      capture_output=True, text=True).stdout.strip()

    def _line(self) -> str:
        assert self.p.stdout is not None
        while True:
            line = self.p.stdout.readline()
            if not line:
                return ""
            if line.startswith(("READY", "RESULT ")):
                return line.strip()

    def _err(self) -> str:
        self.p.kill()
        self.p.wait()
        self.err.seek(0)
        tail = self.err.read().strip().splitlines()[-1:] or ["no output"]
        return tail[0]

    def run(self, prompts: list[list[int]], n_gen: int) -> dict[str, Any]:
        assert self.p.stdin is not None
        self.p.stdin.write(_json.dumps({"prompts": prompts, "n_gen": n_gen}) + "\n")
        self.p.stdin.flush()
        line = self._line()
        if not line.startswith("RESULT "):
            raise GgmlPyError(f"llama-cpp-python side process failed: {self._err()}")
        return _json.loads(line[len("RESULT "):])

    def close(self) -> None:
        if self.p.stdin:
            self.p.stdin.close()
        try:
            self.p.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.p.kill()
        self.err.close()


def _prompts(model: Any, b: int, n_prompt: int) -> list[list[int]]:
    """b different prompts of n_prompt tokens: the bench paragraph, each starting at another token."""
    base = model.tokenize(BENCH_TEXT, add_special=False)
    ids = base * (1 + (n_prompt + 4 * b) // len(base))
    return [ids[3 * i: 3 * i + n_prompt] for i in range(b)]


# --constrained: a JSON schema that does not end within n_gen tokens (an array of at least 1000 objects), so that a
# constrained stream decodes as long as a free one, its mask computed by llguidance's JSON lexer and parser each step
BENCH_SCHEMA = {"type": "array", "minItems": 1000, "items": {
    "type": "object", "properties": {"name": {"type": "string"}, "n": {"type": "integer"}},
    "required": ["name", "n"], "additionalProperties": False}}


def _ours(sched: Any, prompts: list[list[int]], n_gen: int, grammars: list[str | None] | None = None
          ) -> dict[str, Any]:
    from ggml_py.serving.engine import GenParams

    gs = grammars or [None] * len(prompts)
    reqs = [sched.submit(p, GenParams(max_tokens=n_gen + 1, temperature=0.0, stop_at_eos=False, grammar=g))
            for p, g in zip(prompts, gs)]
    while any(r.next_token is None and not r.done.is_set() for r in reqs):  # prefill, first tokens (not timed)
        sched.step()
    t0 = time.perf_counter()
    steps = 0
    while sched.step():
        steps += 1
    dt = time.perf_counter() - t0
    n = sum(len(r.tokens) - 1 for r in reqs)
    free = sum(len(r.tokens) - 1 for r, g in zip(reqs, gs) if g is None)
    for r in reqs:
        if r.error:
            raise GgmlPyError(f"bench serve: a request failed: {r.error}")
    return {"decode_s": dt, "tok_s": n / dt if dt else 0.0, "free_tok_s": free / dt if dt else 0.0, "steps": steps,
            "tokens": [r.tokens for r in reqs]}


def _constrained(sched: Any, model: Any, n_prompt: int, n_gen: int, streams: int, rounds: int) -> dict[str, Any]:
    """Decode tok/s of 1 stream free and constrained, and of `streams` free streams beside one more free stream and
    beside one constrained stream (the same batch size: the difference is the constraint's) (best of `rounds`,
    interleaved)."""
    from ggml_py.models.grammar import json_schema_grammar

    g = json_schema_grammar(BENCH_SCHEMA)
    one, many = _prompts(model, 1, n_prompt), _prompts(model, streams + 1, n_prompt)
    cases = {"1_free": (one, [None]), "1_constrained": (one, [g]),
             f"{streams}_free_1_free": (many, [None] * (streams + 1)),
             f"{streams}_free_1_constrained": (many, [None] * streams + [g])}
    _ours(sched, one, 4, [g])  # warm-up: llguidance's view of the tokenizer is built once
    best: dict[str, dict[str, Any]] = {}
    for _r in range(rounds):
        for name, (ps, gs) in cases.items():
            o = _ours(sched, ps, n_gen, gs)
            if name not in best or o["tok_s"] > best[name]["tok_s"]:
                best[name] = o
    out = {name: {"tok_s": o["tok_s"], "free_tok_s": o["free_tok_s"]} for name, o in best.items()}
    out["constrained_vs_free_1_stream"] = best["1_constrained"]["tok_s"] / best["1_free"]["tok_s"]
    # the free streams' tokens: all but the last stream's in both cases
    free = {k: best[k]["free_tok_s"] if "constrained" in k else best[k]["tok_s"] * streams / (streams + 1)
            for k in (f"{streams}_free_1_free", f"{streams}_free_1_constrained")}
    out["free_streams_beside_one_constrained_vs_beside_one_free"] = (free[f"{streams}_free_1_constrained"]
                                                                     / free[f"{streams}_free_1_free"])
    return out


def run(vs_llamacpp: bool = True, n_prompt: int = 64, n_gen: int = 64, threads: int = 2, json: bool = False,
        backend: str | None = None, model: str | None = None, concurrency: tuple[int, ...] = CONCURRENCY,
        rounds: int = 2, quick: bool = False, constrained: bool = False, **_: Any) -> dict[str, Any]:
    """Measure and return the figures (see the module docstring). `quick`: 1 and 2 streams, tiny sizes, one
    round: a functional smoke run."""
    from ggml_py.models import load_model
    from ggml_py.serving.engine import Engine

    if quick:
        concurrency, n_prompt, n_gen, rounds = (1, 2), min(n_prompt, 8), min(n_gen, 4), 1

    b_max = max(concurrency)
    seq_ctx = n_prompt + n_gen + 8
    m = load_model(model, backends=backend, n_threads=threads, n_ctx=seq_ctx)
    lc = None
    try:
        _log(f"bench serve: {os.path.basename(m.path)} on {','.join(m.backend_names)}, {threads} threads, "
             f"{n_prompt}-token prompts, {n_gen} tokens per stream, streams {list(concurrency)}")
        n_par = b_max + 1 if constrained else b_max
        sched = Engine(m, n_parallel=n_par, n_ctx=n_par * seq_ctx, max_queue=n_par, n_batch=128)
        if vs_llamacpp:
            lc = _LlamaCpp(m.path, threads, b_max, b_max * seq_ctx)
        _ours(sched, _prompts(m, 2, n_prompt), 4)  # warm-up: prepares the plan, touches the weights
        if lc is not None:
            lc.run(_prompts(m, 2, n_prompt), 4)
        rows = []
        for b in concurrency:
            prompts = _prompts(m, b, n_prompt)
            ours: dict[str, Any] | None = None
            theirs: dict[str, Any] | None = None
            for _r in range(rounds):  # interleaved: ours, llama.cpp, ours, llama.cpp
                o = _ours(sched, prompts, n_gen)
                if ours is None or o["tok_s"] > ours["tok_s"]:
                    ours = o
                if lc is not None:
                    t = lc.run(prompts, n_gen)
                    if theirs is None or t["tok_s"] > theirs["tok_s"]:
                        theirs = t
            assert ours is not None
            row: dict[str, Any] = {"streams": b, "tok_s": ours["tok_s"], "decode_s": ours["decode_s"],
                                   "steps": ours["steps"]}
            msg = f"  {b:2d} streams: ggml_py {ours['tok_s']:7.1f} tok/s"
            if theirs is not None:
                row["llamacpp_tok_s"] = theirs["tok_s"]
                row["ratio_vs_llamacpp"] = ours["tok_s"] / theirs["tok_s"] if theirs["tok_s"] else None
                same = [a[:n_gen] == c[:n_gen] for a, c in zip(ours["tokens"], theirs["tokens"])]
                row["greedy_streams_identical_to_llamacpp"] = sum(same)
                msg += (f", llama.cpp {theirs['tok_s']:7.1f} tok/s, ratio {row['ratio_vs_llamacpp']:.2f}x "
                        f"(greedy streams identical {sum(same)}/{b})")
            _log(msg)
            rows.append(row)
        one = rows[0]["tok_s"] if rows and rows[0]["streams"] == 1 else None
        for r in rows:
            r["scaling_vs_1_stream"] = r["tok_s"] / one if one else None
            if one and lc is not None and rows[0].get("llamacpp_tok_s"):
                r["llamacpp_scaling_vs_1_stream"] = r["llamacpp_tok_s"] / rows[0]["llamacpp_tok_s"]
        cons = None
        if constrained:
            cons = _constrained(sched, m, n_prompt, n_gen, min(b_max, 4), rounds)
            _log(f"  constrained (JSON schema): 1 stream {cons['1_constrained']['tok_s']:.1f} tok/s vs free "
                 f"{cons['1_free']['tok_s']:.1f} ({cons['constrained_vs_free_1_stream']:.2f}x); free streams beside "
                 f"one constrained: {cons['free_streams_beside_one_constrained_vs_beside_one_free']:.2f}x their tok/s "
                 "beside one free")
        res: dict[str, Any] = {
            "benchmark": "serve", "model": m.path, "backends": m.backend_names, "threads": threads,
            "n_prompt": n_prompt, "n_gen": n_gen, "rounds": rounds, "results": rows, "constrained": cons,
            "plans_prepared": sched.decoder.plans_prepared + m.plans_prepared,
            "steps": sched.decoder.steps, "llamacpp_version": lc.version if lc else None,
        }
        sched.close()
        return res
    finally:
        if lc is not None:
            lc.close()
        m.close()


def report(r: dict[str, Any]) -> str:
    lines = [f"bench serve: {os.path.basename(r['model'])} on {','.join(r['backends'])}, {r['threads']} threads, "
             f"{r['n_prompt']}-token prompts, {r['n_gen']} tokens per stream (best of {r['rounds']} rounds)",
             "  streams   ggml_py tok/s   x 1 stream" + ("   llama.cpp tok/s   x 1 stream   ggml_py/llama.cpp"
                                                        if r["llamacpp_version"] else "")]
    for row in r["results"]:
        s = f"  {row['streams']:7d}   {row['tok_s']:13.1f}   {row['scaling_vs_1_stream'] or 0:9.2f}x"
        if "llamacpp_tok_s" in row:
            s += (f"   {row['llamacpp_tok_s']:15.1f}   {row.get('llamacpp_scaling_vs_1_stream') or 0:9.2f}x   "
                  f"{row['ratio_vs_llamacpp']:16.2f}x")
        lines.append(s)
    c = r.get("constrained")
    if c:
        lines.append(f"  constrained by a JSON schema: 1 stream {c['1_constrained']['tok_s']:.1f} tok/s, free "
                     f"{c['1_free']['tok_s']:.1f} ({c['constrained_vs_free_1_stream']:.2f}x); free streams beside one "
                     f"constrained: {c['free_streams_beside_one_constrained_vs_beside_one_free']:.2f}x their tok/s "
                     "beside one free")
    lines.append(f"  plans prepared over the whole run: {r['plans_prepared']} ({r['steps']} steps)")
    if r["llamacpp_version"]:
        lines.append(f"  llama.cpp: llama-cpp-python {r['llamacpp_version']}")
    return "\n".join(lines)

