"""`ggml-py bench matrix`: ggml_py against llama.cpp over weight types x prompt sizes x decode contexts x threads.

For each weight type the model is requantized once with `ggml-py quantize` (cached next to the other benchmark
files), then for each thread count both runtimes run the same job, each in a fresh process of its own, alternating
which goes first, `rounds` times: prefill of 32/128/512 prompt tokens (tok/s), greedy decode of `n_gen` tokens after
a 16- and a 1000-token context (tok/s; each figure the better of two runs in the process, for both runtimes), and the
process's peak RSS. The best of the rounds is kept for each figure (and the spread reported); ratios are ggml_py /
llama.cpp, so above 1 means ggml_py is faster (or, for RSS, uses more memory); the report adds each runtime's decode
speed-up from 1 thread to more, and decode's share of the memory limit: the bytes a token reads x tok/s over the
simd backend's read loop, run in the job's own process just before and just after each decode. Run it on a quiet
machine: both runtimes spin worker threads that collapse when something else runs.
"""

from __future__ import annotations

import json as _json
import os
import subprocess
import sys
import time
from typing import Any

from ggml_py.commands.bench_model import BENCH_TEXT, ensure_llamacpp
from ggml_py.errors import GgmlPyError

TYPES = ("Q4_0", "Q4_1", "Q5_K_M", "Q8_0", "Q4_K_M", "Q6_K")
PREFILL = (32, 128, 512)
CONTEXTS = (16, 1000)
THREADS = (1, 2)
CACHE = os.environ.get("GGML_PY_BENCH_CACHE", os.path.join(os.path.expanduser("~"), ".cache", "ggml_py", "bench"))

# One job in a fresh process: argv[1] is {"model", "threads", "prefill": [...], "contexts": [...], "n_gen",
# "n_ctx", "text"}; prints "RESULT {json}". The two workers share everything but the runtime's calls.
_COMMON = r"""
import json, sys, time
a = json.loads(sys.argv[1])

def peak_rss():
    return next(int(ln.split()[1]) for ln in open("/proc/self/status") if ln.startswith("VmHWM:")) * 1024

peaks = []  # the peak RSS of each stretch between read loops (whose 1 GiB buffer must not count)

# The simd backend's compiled module, loaded once: imported where ggml_py_simd is installed, else (llama.cpp's
# interpreter) from its file; None where neither works.
def simd_module():
    if "mod" not in simd_module.__dict__:
        simd_module.mod = None
        if a.get("read_loop"):
            try:
                from ggml_py_simd import _simd
            except ImportError:
                import importlib.util
                try:
                    spec = importlib.util.spec_from_file_location("_simd", a["read_loop"])
                    _simd = importlib.util.module_from_spec(spec)
                    spec.loader.exec_module(_simd)
                except (ImportError, OSError):
                    _simd = None
            simd_module.mod = _simd
    return simd_module.mod

# Bytes/s of that module's read loop over 1 GiB with the job's threads, in this very process; None without it. The
# peak RSS so far is kept, and its mark reset once the buffer is freed.
def read_loop():
    _simd = simd_module()
    if _simd is None:
        return None
    import numpy as np
    try:
        reset = open("/proc/self/clear_refs", "w")
    except OSError:  # the buffer would count in the peak RSS: no yardstick
        return None
    peaks.append(peak_rss())
    buf = np.ones(1 << 30, np.uint8)  # far past the last-level cache; ones: every page faulted in
    rate = float(_simd.stream_read_bandwidth(buf, a["threads"], 5)) * 1e9
    del buf
    with reset:
        reset.write("5")  # the peak RSS mark back to the current RSS
    return rate

def job(tokenize, greedy):
    ids = []
    while len(ids) < max(a["prefill"] + a["contexts"]):
        ids += tokenize(a["text"])
    greedy(ids[:32], 2)  # warm-up: first plans / buffers, weights touched
    res = {"prefill": {}, "decode": {}, "read_bps": {}}
    for p in a["prefill"]:
        res["prefill"][str(p)] = max(p / greedy(ids[:p], 1)[0] for _ in range(2))
    for c in a["contexts"]:
        before = read_loop()
        res["decode"][str(c)] = max(a["n_gen"] / greedy(ids[:c], a["n_gen"])[1] for _ in range(2))
        after = read_loop()
        if before and after:
            res["read_bps"][str(c)] = (before + after) / 2
    res["peak_rss_bytes"] = max(peaks + [peak_rss()])
    print("RESULT " + json.dumps(res))
"""

_OURS = _COMMON + r"""
import ggml_py
m = ggml_py.load_model(a["model"], backends=a.get("backend"), n_threads=a["threads"], n_ctx=a["n_ctx"],
                       progress=False)

def greedy(ids, n):
    list(m.generate(ids, n + 1, temperature=0.0, stop_at_eos=False))
    t = m.timings
    return t["prefill_s"], t["decode_s"]  # decode_s: n one-token steps

job(lambda s: m.tokenize(s, add_special=False), greedy)
"""

_LLAMACPP = _COMMON + r"""
from llama_cpp import Llama
llm = Llama(model_path=a["model"], n_ctx=a["n_ctx"], n_threads=a["threads"], n_threads_batch=a["threads"],
            n_batch=512, verbose=False)

def greedy(ids, n):
    llm.reset()
    stamps = []
    t0 = time.perf_counter()
    for tok in llm.generate(ids, temp=0.0, top_k=1, repeat_penalty=1.0, reset=True):
        stamps.append(time.perf_counter())
        if len(stamps) > n:
            break
    return stamps[0] - t0, stamps[-1] - stamps[0]  # prompt eval (+ first sample); n one-token evals

job(lambda s: llm.tokenize(s.encode(), add_bos=False), greedy)
"""


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def variant(model: str, type_name: str) -> str:
    """`model` requantized to `type_name` (cached; the source itself when it already is of that type)."""
    from ggml_py.formats.gguf import open_gguf
    from ggml_py.formats.quantize import quantize_file
    from ggml_py.formats.quantize_policy import file_type

    ft = file_type(type_name)
    gf = open_gguf(model)
    try:
        if int(gf.metadata.get("general.file_type", -1)) == ft.ftype:
            return model
    finally:
        gf.close()
    os.makedirs(CACHE, exist_ok=True)
    stem = os.path.splitext(os.path.basename(model))[0]
    out = os.path.join(CACHE, f"{stem}.{ft.name}.gguf")
    if not (os.path.exists(out) and os.path.getmtime(out) >= os.path.getmtime(model)):
        _log(f"  quantizing {os.path.basename(model)} to {ft.name} ...")
        t0 = time.perf_counter()
        quantize_file(model, out, ft.name, allow_requantize=True, force=True)
        _log(f"  ... {out} ({time.perf_counter() - t0:.0f} s)")
    return out


def shape_file(shape: str, type_name: str) -> str:
    """The random-weight model of a named shape (`bench write-model`) in `type_name`, written into the benchmark
    cache the first time it is asked for."""
    from ggml_py.commands.bench_write_model import get_shape, write_model
    from ggml_py.formats.quantize_policy import file_type

    s, ft = get_shape(shape), file_type(type_name)
    out = os.path.join(CACHE, f"{s.name}.{ft.name}.gguf")
    if not os.path.exists(out):
        os.makedirs(CACHE, exist_ok=True)
        _log(f"  writing {s.name} ({s.like}, random weights) in {ft.name} ...")
        t0 = time.perf_counter()
        write_model(s, ft.name, out + ".part", force=True)
        os.replace(out + ".part", out)
        _log(f"  ... {out} ({time.perf_counter() - t0:.0f} s)")
    return out


def decode_bytes(path: str, context: int, kv_bytes: int = 2) -> int:
    """Bytes a decode step reads at `context` tokens of context: every weight but the token embedding (of which it
    reads one row; all of it when it is also the output matrix), and the K and V cache rows of every layer (F16)."""
    weights, per_token = decode_reads(path, kv_bytes)
    return weights + per_token * context


def decode_reads(path: str, kv_bytes: int = 2) -> tuple[int, int]:
    """What decode_bytes adds up, read from the file once: the weight bytes, and the cache bytes per token of
    context."""
    from ggml_py.formats.gguf import open_gguf
    from ggml_py.models.families import get_architecture

    gf = open_gguf(path)
    try:
        tied = "output.weight" not in gf.tensors
        weights = sum(t.nbytes for name, t in gf.tensors.items() if tied or name != "token_embd.weight")
        n_vocab = gf.tensors["token_embd.weight"].shape[0]
        hp = get_architecture(gf.architecture, path).hparams(gf.metadata, path, n_vocab)
    finally:
        gf.close()
    return weights, 2 * hp.n_layer * hp.n_head_kv * hp.head_dim * kv_bytes


def read_loop_module() -> str | None:
    """The file of the simd backend's compiled module, whose read loop the jobs of both runtimes run; None without
    it."""
    try:
        from ggml_py_simd import _simd  # type: ignore[import-not-found]
    except ImportError:
        return None
    return str(_simd.__file__)


def run_job(python: str, script: str, job: dict[str, Any], who: str) -> dict[str, Any]:
    """`script` run by `python` in a fresh process with the job as argv[1]; its last `RESULT {json}` line."""
    p = subprocess.run([python, "-c", script, _json.dumps(job)], capture_output=True, text=True)
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith("RESULT ")]
    if p.returncode != 0 or not lines:
        tail = (p.stderr or p.stdout).strip().splitlines()[-1:] or ["no output"]
        raise GgmlPyError(f"{who} job failed (exit {p.returncode}): {tail[0]}")
    return dict(_json.loads(lines[-1][len("RESULT "):]))


def _figures(r: dict[str, Any]) -> dict[str, float]:
    out = {f"prefill_{k}": v for k, v in r["prefill"].items()}
    out.update({f"decode_ctx_{k}": v for k, v in r["decode"].items()})
    out["peak_rss_mib"] = r["peak_rss_bytes"] / 2**20
    out.update({f"read_bps_{k}": v for k, v in r.get("read_bps", {}).items()})
    return out


def run(model: str | None = None, types: tuple[str, ...] = TYPES, threads_list: tuple[int, ...] = THREADS,
        prefill: tuple[int, ...] = PREFILL, contexts: tuple[int, ...] = CONTEXTS, n_gen: int = 32, rounds: int = 3,
        backend: str | None = None, quick: bool = False, json: bool = False, shape: str | None = None,
        **_: Any) -> dict[str, Any]:
    """Measure the matrix (see the module docstring); progress on stderr. `shape`: instead of requantizing `model`,
    the random-weight files of that shape (`bench write-model`, written once into the cache) of each type. `quick`:
    one type, tiny sizes, one round, a functional smoke run."""
    from ggml_py.models import default_model_path

    if quick:
        types, threads_list, prefill, contexts, n_gen, rounds = types[:1], threads_list[-1:], (32,), (16,), 4, 1
    if shape and model:
        raise GgmlPyError("bench matrix takes a model (-m) or a shape (--shape), not both")
    src = shape or model or default_model_path()
    llama_py = os.environ.get("LLAMA_CPP_PYTHON") or ensure_llamacpp()
    rows: list[dict[str, Any]] = []
    for type_name in types:
        path = shape_file(shape, type_name) if shape else variant(src, type_name)
        for th in threads_list:
            job = {"model": path, "threads": th, "prefill": list(prefill), "contexts": list(contexts),
                   "n_gen": n_gen, "n_ctx": max(*prefill, *contexts) + n_gen + 8, "text": BENCH_TEXT,
                   "backend": backend, "read_loop": read_loop_module()}
            runs: dict[str, list[dict[str, float]]] = {"ggml_py": [], "llama.cpp": []}
            for k in range(rounds):  # interleaved, the first runner alternating
                order = [("ggml_py", sys.executable, _OURS), ("llama.cpp", llama_py, _LLAMACPP)]
                for who, py, script in order if k % 2 == 0 else order[::-1]:
                    runs[who].append(_figures(run_job(py, script, job, who)))
            row: dict[str, Any] = {"type": type_name, "threads": th, "model": path, "rounds": rounds}
            for fig in (f for f in runs["ggml_py"][0] if not f.startswith("read_bps_")):
                best = min if fig == "peak_rss_mib" else max
                for who in runs:
                    vals = [r[fig] for r in runs[who]]
                    row[f"{who}.{fig}"] = best(vals)
                    row[f"{who}.{fig}.spread"] = [min(vals), max(vals)]
                row[f"ratio.{fig}"] = row[f"ggml_py.{fig}"] / row[f"llama.cpp.{fig}"]
            # decode's share of the memory limit: bytes read a token x tokens/s / the read loop's rate, measured in
            # the decode's own process just before and just after it (their mean): a VM's memory bandwidth drifts
            # (on one 2-vCPU machine 34.6 GB/s, then 27.0 half an hour later) and jumps (a Zen 4 VM: between ~30 and
            # ~60 GB/s at 2 threads within one matrix), so a rate measured beside a row gave shares of 47-122%
            reads = [r.get(f"read_bps_{c}") for rs in runs.values() for r in rs for c in contexts]
            if reads and None not in reads:  # every run of both runtimes measured it
                row["read_gbps.spread"] = [min(reads) / 1e9, max(reads) / 1e9]
                weights, per_token = decode_reads(path)
                for c in contexts:
                    for who in runs:  # the run of the best decode, against the loop around that decode
                        top = max(runs[who], key=lambda r: r[f"decode_ctx_{c}"])
                        row[f"{who}.decode_ctx_{c}.read_gbps"] = top[f"read_bps_{c}"] / 1e9
                        row[f"{who}.decode_ctx_{c}.of_bandwidth"] = (
                            (weights + per_token * c) * top[f"decode_ctx_{c}"] / top[f"read_bps_{c}"])
            rows.append(row)
            _log(_row_text(row))
    res = {"benchmark": "matrix", "source": src, "shape": shape, "rows": rows, "prefill": list(prefill),
           "contexts": list(contexts), "n_gen": n_gen, "rounds": rounds}
    res["decode_thread_scaling"] = {f"1->{t} {fig}": v for (t, fig), v in thread_scaling(res).items()}
    return res


def _row_text(row: dict[str, Any]) -> str:
    figs = [k[len("ratio."):] for k in row if k.startswith("ratio.")]
    parts = [f"{f} {row[f'ggml_py.{f}']:.0f}/{row[f'llama.cpp.{f}']:.0f}={row[f'ratio.{f}']:.2f}x" for f in figs]
    return f"  {row['type']:<7} t={row['threads']}: " + ", ".join(parts)


def report(r: dict[str, Any]) -> str:
    what = (f"the {r['shape']} shape (random weights)" if r.get("shape")
            else f"{os.path.basename(r['source'])} requantized")
    lines = [f"bench matrix: {what}, ggml_py vs llama.cpp, best of "
             f"{r['rounds']} interleaved rounds (ratio > 1: ggml_py faster; for peak RSS: ggml_py larger)"]
    if not r["rows"]:
        return "\n".join(lines)
    figs = [k[len("ratio."):] for k in r["rows"][0] if k.startswith("ratio.")]
    lines.append(f"  {'type':<7} {'thr':>3}  " + "  ".join(f"{f:>22}" for f in figs))
    for row in r["rows"]:
        cells = [f"{row[f'ggml_py.{f}']:7.0f}/{row[f'llama.cpp.{f}']:<6.0f}{row[f'ratio.{f}']:5.2f}x" for f in figs]
        lines.append(f"  {row['type']:<7} {row['threads']:>3}  " + "  ".join(f"{c:>22}" for c in cells))
    lines.append("  (each cell: ggml_py / llama.cpp  ratio; tok/s, peak RSS in MiB)")
    for row in r["rows"]:
        if "read_gbps.spread" in row:
            lo, hi = row["read_gbps.spread"]
            lines.append(f"  {row['type']:<7} {row['threads']:>3}  decode as a share of the read loop around it "
                         f"(bytes a token reads x tok/s / loop; the loop {lo:.1f}-{hi:.1f} GB/s in the row): "
                         + ", ".join(
                             f"@{c} {row[f'ggml_py.decode_ctx_{c}.of_bandwidth']:.0%} of "
                             f"{row[f'ggml_py.decode_ctx_{c}.read_gbps']:.1f} (llama.cpp "
                             f"{row[f'llama.cpp.decode_ctx_{c}.of_bandwidth']:.0%} of "
                             f"{row[f'llama.cpp.decode_ctx_{c}.read_gbps']:.1f})" for c in r["contexts"]))
    lines += [f"  decode 1 -> {t} threads, {fig[len('decode_'):]}: " + ", ".join(
        f"{typ} {sc['ggml_py']:.2f}x (llama.cpp {sc['llama.cpp']:.2f}x)" for typ, sc in by_type.items())
        for (t, fig), by_type in thread_scaling(r).items()]
    return "\n".join(lines)


def thread_scaling(r: dict[str, Any]) -> dict[tuple[int, str], dict[str, dict[str, float]]]:
    """Decode speed-up from one thread to each larger thread count, per type and runtime:
    {(threads, "decode_ctx_16"): {type: {"ggml_py": x, "llama.cpp": y}}}."""
    rows = {(row["type"], row["threads"]): row for row in r["rows"]}
    out: dict[tuple[int, str], dict[str, dict[str, float]]] = {}
    for (typ, t), row in rows.items():
        one = rows.get((typ, 1))
        if t == 1 or one is None:
            continue
        for fig in (k[len("ratio."):] for k in row if k.startswith("ratio.decode_")):
            out.setdefault((t, fig), {})[typ] = {who: row[f"{who}.{fig}"] / one[f"{who}.{fig}"]
                                                for who in ("ggml_py", "llama.cpp")}
    return out
