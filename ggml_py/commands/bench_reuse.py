"""Prepared-plan reuse vs rebuilding and re-preparing every step, on a ~600-node transformer-like graph."""

from __future__ import annotations

import time
from typing import Any

import numpy as np

from ggml_py.ir import ops
from ggml_py.ir.tensor import Tensor, input, weight
from ggml_py.runtime.plan import prepare


def make_weights(n_layers: int, d: int, rng: np.random.Generator) -> list[dict[str, Tensor]]:
    def w(*shape: int, name: str) -> Tensor:
        return weight((rng.standard_normal(shape) / np.sqrt(shape[-1])).astype(np.float32), name=name)

    return [{k: w(*s, name=f"blk.{i}.{k}") for k, s in
             {"norm": (d,), "wq": (d, d), "wk": (d, d), "wv": (d, d), "wo": (d, d), "ffn_norm": (d,),
              "up": (2 * d, d), "gate": (2 * d, d), "down": (d, 2 * d)}.items()} for i in range(n_layers)]


def build(layers: list[dict[str, Tensor]], n_tokens: int, d: int, n_head: int) -> Tensor:
    """A stack of pre-norm attention + SwiGLU blocks (20 nodes per block)."""
    hd = d // n_head
    x = input((n_tokens, d), name="x")
    pos = input((n_tokens,), "I32", name="pos")
    mask = input((n_tokens, n_tokens), name="mask")
    for ly in layers:
        h = ops.mul(ops.rms_norm(x, 1e-5), ly["norm"])
        q = ops.rope(ops.reshape(ops.mul_mat(ly["wq"], h), (n_tokens, n_head, hd)), pos, hd)
        k = ops.rope(ops.reshape(ops.mul_mat(ly["wk"], h), (n_tokens, n_head, hd)), pos, hd)
        v = ops.reshape(ops.mul_mat(ly["wv"], h), (n_tokens, n_head, hd))
        att = ops.flash_attn_ext(ops.permute(q, (1, 0, 2)), ops.permute(k, (1, 0, 2)), ops.permute(v, (1, 0, 2)),
                                 mask, scale=1.0 / np.sqrt(hd))
        x = ops.add(x, ops.mul_mat(ly["wo"], ops.reshape(att, (n_tokens, d))))
        h = ops.mul(ops.rms_norm(x, 1e-5), ly["ffn_norm"])
        x = ops.add(x, ops.mul_mat(ly["down"], ops.swiglu(ops.mul_mat(ly["gate"], h), ops.mul_mat(ly["up"], h))))
    return x.set_name("out")


def run(backend: str = "numpy", steps: int = 200, n_layers: int = 25, d: int = 64, n_tokens: int = 4,
        n_head: int = 4, quick: bool = False, **_: Any) -> dict[str, Any]:
    if quick:  # a smoke run: the figures mean nothing
        steps, n_layers = min(steps, 3), min(n_layers, 2)
    rng = np.random.default_rng(0)
    layers = make_weights(n_layers, d, rng)
    xs = rng.standard_normal((n_tokens, d)).astype(np.float32)
    pos = np.arange(n_tokens, dtype=np.int32)
    mask = np.triu(np.full((n_tokens, n_tokens), -np.inf, np.float32), 1)

    def feed(plan: Any) -> None:
        plan.set_input("x", xs)
        plan.set_input("pos", pos)
        plan.set_input("mask", mask)

    out = build(layers, n_tokens, d, n_head)
    plan = prepare(out, backends=backend)
    n_nodes = plan.stats()["nodes"]
    feed(plan)
    plan.compute()  # warm-up (weights placed, caches filled)
    ref = plan.get_output("out")

    t0 = time.perf_counter()
    for _ in range(steps):
        feed(plan)
        plan.compute()
    reuse_s = (time.perf_counter() - t0) / steps
    same = np.array_equal(plan.get_output("out"), ref)

    t0 = time.perf_counter()
    for _ in range(steps):
        p = prepare(build(layers, n_tokens, d, n_head), backends=backend)
        feed(p)
        p.compute()
    rebuild_s = (time.perf_counter() - t0) / steps
    same = same and np.array_equal(p.get_output("out"), ref)
    return {"benchmark": "reuse", "backend": backend, "nodes": n_nodes, "steps": steps,
            "reuse_ms_per_compute": reuse_s * 1e3, "rebuild_ms_per_compute": rebuild_s * 1e3,
            "speedup": rebuild_s / reuse_s, "identical_results": bool(same)}


def report(r: dict[str, Any]) -> str:
    return (f"bench reuse: {r['nodes']}-node graph, {r['steps']} computes on {r['backend']}\n"
            f"  prepared once, computed each step : {r['reuse_ms_per_compute']:8.3f} ms/compute\n"
            f"  rebuilt and prepared every step   : {r['rebuild_ms_per_compute']:8.3f} ms/compute\n"
            f"  ratio rebuild/reuse               : {r['speedup']:8.2f}x  (identical results: "
            f"{r['identical_results']})")
