"""`ggml-py bench ops`: the simd backend's kernels measured side by side in one run.

- F32 MUL_MAT 4096x4096 (weight) x 4096x512 (activations): GFLOP/s of simd vs numpy's `@` (BLAS), ratio (target >= 0.8).
- Q4_1 and Q4_K GEMV 4096x4096 x one row: effective GB/s (weight bytes / time) vs a plain streaming read of the same
  number of bytes by the module's C read loop with the same threads, ratio (target >= 0.6). Q2_K, Q3_K, Q5_K,
  Q6_K, IQ4_NL and IQ4_XS the same way when ggml_py.ir.dtypes has them (reported, no target). Measured with weights
  that exceed the last-level cache (several matrices used in turn, as in a model's decode), and with one matrix
  that stays cached ("cached" figures).
- Dispatch: a plan of 600 tiny nodes computed in one call, microseconds per node (target < 2).

Every figure goes through ggml_py's public interface (gp.prepare on the simd backend), except the read loop.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np

TARGETS = {"mul_mat_f32_ratio": 0.8, "gemv_bandwidth_ratio": 0.6, "dispatch_us_per_node": 2.0}


def _best(fn, reps: int, min_time: float = 0.0) -> float:
    best = float("inf")
    t_end = time.perf_counter() + min_time
    n = 0
    while n < reps or time.perf_counter() < t_end:
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
        n += 1
    return best


def _backend(threads: int, **options: Any):
    import ggml_py_simd

    return ggml_py_simd.register().create(n_threads=threads, **options)


def bench_mul_mat_f32(threads: int, m: int = 4096, k: int = 4096, n: int = 512, reps: int = 3) -> dict[str, Any]:
    import ggml_py as gp
    from ggml_py.ir import ops

    rng = np.random.default_rng(0)
    w = rng.standard_normal((m, k), dtype=np.float32)
    x = rng.standard_normal((n, k), dtype=np.float32)
    wt = gp.weight(w, name="w")
    xt = gp.input((n, k), name="x")
    y = ops.mul_mat(wt, xt).set_output()
    plan = gp.prepare(y, backends=[_backend(threads)])
    plan.set_input("x", x)
    plan.compute()  # warm-up
    t_simd = _best(plan.compute, reps)
    got = plan.get_output(y)
    wt_t = np.ascontiguousarray(w.T)
    x @ wt_t
    t_np = _best(lambda: x @ wt_t, reps)
    ref = x[:4] @ wt_t
    err = float(np.sum((got[:4] - ref) ** 2) / np.sum(ref * ref))
    flops = 2.0 * m * n * k
    return {"shape": [m, k, n], "simd_gflops": flops / t_simd / 1e9, "numpy_gflops": flops / t_np / 1e9,
            "ratio": t_np / t_simd, "simd_seconds": t_simd, "numpy_seconds": t_np, "nmse": err,
            "target": TARGETS["mul_mat_f32_ratio"]}


# byte offset and count of a block's f16 scales where they are not the first two f16 (d and m of Q4_1, d and dmin
# of Q4_K); Q6_K's int8 sub-block scales may be any byte
_F16_SCALES = {"Q2_K": (80, 2), "Q3_K": (108, 1), "Q6_K": (208, 1), "IQ4_NL": (0, 1), "IQ4_XS": (0, 1)}


def _quant_rows(t, m: int, k: int, rng: np.random.Generator) -> np.ndarray:
    """Random valid blocks (the values do not matter for speed): random quants, small finite f16 scales."""
    nb = m * k // t.block_size
    raw = rng.integers(0, 256, (nb, t.type_size), dtype=np.uint8)
    off, n = _F16_SCALES.get(t.name, (0, 2))
    raw[:, off:off + 2 * n] = (rng.random((nb, n)) * 0.01).astype(np.float16).view(np.uint8)
    return raw.reshape(-1)


def bench_gemv(tname: str, threads: int, m: int = 4096, k: int = 4096, llc_bytes: int = 32 << 20,
               reps: int = 20, min_time: float = 0.2) -> dict[str, Any]:
    import ggml_py as gp
    from ggml_py.ir import dtypes, ops

    from . import _simd

    t = dtypes.get(tname)
    rng = np.random.default_rng(1)
    nbytes = t.row_size(k) * m
    n_mats = max(1, -(-3 * llc_bytes // nbytes))  # enough matrices to exceed the last-level cache 3x
    raws = [_quant_rows(t, m, k, rng) for _ in range(n_mats)]
    x = gp.input((1, k), name="x")
    outs = [ops.mul_mat(gp.weight(r, t, shape=(m, k), name=f"w{i}"), x).set_output() for i, r in enumerate(raws)]
    b = _backend(threads)
    plans = [gp.prepare(o, backends=[b]) for o in outs]
    xv = rng.standard_normal((1, k)).astype(np.float32)
    for p in plans:
        p.set_input("x", xv)
        p.compute()

    def run_all() -> None:
        for p in plans:
            p.compute()

    t_all = _best(run_all, max(min(3, reps), reps // n_mats), 1.5 * min_time) / n_mats
    t_one = _best(plans[0].compute, reps, min_time)
    big = np.ones(nbytes * n_mats, np.uint8)  # pages faulted in
    one = np.ones(nbytes, np.uint8)
    bw = _simd.stream_read_bandwidth(big, threads, 7 if reps > 2 else 1)
    bw_one = _simd.stream_read_bandwidth(one, threads, 20 if reps > 2 else 1)
    eff = nbytes / t_all / 1e9
    eff_one = nbytes / t_one / 1e9
    return {"type": tname, "shape": [m, k, 1], "weight_bytes": nbytes, "matrices": n_mats, "seconds": t_all,
            "gbps": eff, "stream_gbps": bw, "ratio": eff / bw,
            "cached_seconds": t_one, "cached_gbps": eff_one, "cached_stream_gbps": bw_one,
            "cached_ratio": eff_one / bw_one, "target": TARGETS["gemv_bandwidth_ratio"]}


def bench_dispatch(threads: int, n_nodes: int = 600, reps: int = 50, min_time: float = 0.2) -> dict[str, Any]:
    import ggml_py as gp
    from ggml_py.ir import ops

    x = gp.input((4, 16), name="x")
    y = x
    for i in range(n_nodes):
        y = ops.scale(y, 1.0, 0.001) if i % 3 == 0 else (ops.add(y, x) if i % 3 == 1 else ops.mul(y, x))
    y.set_output()
    plan = gp.prepare(y, backends=[_backend(threads)])
    plan.set_input("x", np.ones((4, 16), np.float32))
    nodes = sum(len(r.split.nodes) for r in plan.runs)
    plan.compute()
    t_plan = _best(plan.compute, reps, min_time)
    run = plan.runs[0]
    t_native = _best(lambda: run.split.backend.graph_plan_compute(run.plan, {}), reps, min_time)
    # the same graph with every node spread over all threads: a barrier after each node
    par = gp.prepare(y, backends=[_backend(threads, force_parallel=1)])
    par.set_input("x", np.ones((4, 16), np.float32))
    par.compute()
    t_par = _best(par.compute, reps, min_time)
    return {"nodes": nodes, "splits": len(plan.runs), "us_per_node": t_plan / nodes * 1e6,
            "us_per_node_native": t_native / nodes * 1e6, "us_per_node_all_threads": t_par / nodes * 1e6,
            "compute_us": t_plan * 1e6, "target": TARGETS["dispatch_us_per_node"]}


def run(json: bool = False, threads: int = 2, quick: bool = False, **_: Any) -> dict[str, Any]:
    """Run every measurement; `threads` for both sides (numpy's BLAS uses its own default pool). `quick`: tiny
    shapes and two repetitions, a functional smoke run whose figures mean nothing."""
    import ggml_py_simd

    from . import _simd

    res: dict[str, Any] = {"backend": "simd", "level": _simd.level(), "threads": threads,
                           "cpu": _simd.cpu_features().get("brand", "")}
    mm: dict[str, Any] = dict(m=256, k=256, n=16, reps=2) if quick else {}
    gemv: dict[str, Any] = dict(m=256, k=256, llc_bytes=1 << 16, reps=2, min_time=0.0) if quick else {}
    disp: dict[str, Any] = dict(n_nodes=30, reps=2, min_time=0.0) if quick else {}
    res["mul_mat_f32"] = bench_mul_mat_f32(threads, **mm)
    res["gemv_q4_1"] = bench_gemv("Q4_1", threads, **gemv)
    res["gemv_q4_k"] = bench_gemv("Q4_K", threads, **gemv)
    from ggml_py.ir import dtypes

    for name in ("Q2_K", "Q3_K", "Q5_K", "Q6_K", "IQ4_NL", "IQ4_XS"):  # informational: no target
        if getattr(dtypes, name, None) is not None:
            res[f"gemv_{name.lower()}"] = bench_gemv(name, threads, **gemv)
    res["dispatch"] = bench_dispatch(threads, **disp)
    res["ok"] = {
        "mul_mat_f32": res["mul_mat_f32"]["ratio"] >= TARGETS["mul_mat_f32_ratio"],
        "gemv_q4_1": res["gemv_q4_1"]["ratio"] >= TARGETS["gemv_bandwidth_ratio"],
        "gemv_q4_k": res["gemv_q4_k"]["ratio"] >= TARGETS["gemv_bandwidth_ratio"],
        "dispatch": res["dispatch"]["us_per_node"] < TARGETS["dispatch_us_per_node"],
    }
    del ggml_py_simd
    return res


def report(r: dict[str, Any]) -> str:
    mm, d = r["mul_mat_f32"], r["dispatch"]
    lines = [f"simd bench ops ({r['level']}, {r['threads']} threads, {r['cpu']})",
             f"  mul_mat F32 {mm['shape'][0]}x{mm['shape'][1]} x {mm['shape'][1]}x{mm['shape'][2]}: "
             f"simd {mm['simd_gflops']:.1f} GFLOP/s, numpy {mm['numpy_gflops']:.1f} GFLOP/s, ratio {mm['ratio']:.2f} "
             f"(target >= {mm['target']})"]
    for key in [k for k in r if k.startswith("gemv_")]:  # in the order measured
        g = r[key]
        lines.append(f"  GEMV {g['type']} {g['shape'][0]}x{g['shape'][1]}: {g['gbps']:.1f} GB/s vs stream "
                     f"{g['stream_gbps']:.1f} GB/s, ratio {g['ratio']:.2f} (target >= {g['target']}); cached "
                     f"{g['cached_gbps']:.1f} vs {g['cached_stream_gbps']:.1f} GB/s, ratio {g['cached_ratio']:.2f}")
    lines.append(f"  dispatch: {d['nodes']} tiny nodes, {d['us_per_node']:.3f} us/node through plan.compute "
                 f"({d['us_per_node_native']:.3f} native; {d['us_per_node_all_threads']:.3f} with a barrier after "
                 f"every node) (target < {d['target']})")
    return "\n".join(lines)


if __name__ == "__main__":  # pragma: no cover
    import json as _json
    import sys

    out = run(json="--json" in sys.argv)
    print(_json.dumps(out) if "--json" in sys.argv else report(out))
