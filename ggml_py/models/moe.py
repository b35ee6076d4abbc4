"""Mixture-of-experts FFN: expert routing over MUL_MAT_ID, as llama.cpp's build_moe_ffn (src/llama-graph.cpp).

Per token: the router's logits `ffn_gate_inp · h` over the experts, gated by a softmax (or a sigmoid); the k experts of
the largest scores (TOP_K); their scores as the mixing weights, optionally normalised to sum 1 (the sum clamped below
at 2^-14, as llama.cpp does); each chosen expert's SwiGLU FFN through MUL_MAT_ID; the k results weighted
and added slot by slot in slot order (llama.cpp's order of F32 additions). Shapes in numpy order, T the step's tokens.
"""

from __future__ import annotations

from ggml_py.ir import ops
from ggml_py.ir.tensor import Tensor
from ggml_py.models.hparams import HParams
from ggml_py.models.weights import Layer

# llama.cpp clamps the sum of the chosen weights to the smallest normal F16 before dividing by it
MIN_WEIGHT_SUM = 6.103515625e-5


def route(hp: HParams, gate_inp: Tensor, h: Tensor) -> tuple[Tensor, Tensor]:
    """(ids (T, k) I32, weights (T, k, 1) F32): each token's chosen experts, best first, and their mixing weights."""
    T, n_expert, k = h.shape[0], hp.n_expert, hp.n_expert_used
    logits = ops.mul_mat(gate_inp, h)  # (T, n_expert)
    probs = ops.sigmoid(logits) if hp.expert_gating == "sigmoid" else ops.soft_max(logits)
    ids = ops.top_k(probs, k)
    weights = ops.get_rows(ops.reshape(probs, (T, n_expert, 1)), ids)  # (T, k, 1)
    if hp.expert_weights_norm:
        w2 = ops.reshape(weights, (T, k))
        total = ops.clamp(ops.sum_rows(w2), MIN_WEIGHT_SUM, float("inf"))
        weights = ops.reshape(ops.div(w2, total), (T, k, 1))
    return ids, weights


def moe_ffn(hp: HParams, ly: Layer, h: Tensor) -> Tensor:
    """The routed SwiGLU FFN of the normed input h (T, E): (T, E)."""
    assert ly.gate_inp is not None and ly.gate_exps is not None and ly.up_exps is not None
    assert ly.down_exps is not None
    T, E, k = h.shape[0], h.shape[1], hp.n_expert_used
    ids, weights = route(hp, ly.gate_inp, h)
    x = ops.reshape(h, (T, 1, E))  # one row per token, shared by its k experts
    act = ops.swiglu(ops.mul_mat_id(ly.gate_exps, x, ids), ops.mul_mat_id(ly.up_exps, x, ids))  # (T, k, F)
    experts = ops.mul(ops.mul_mat_id(ly.down_exps, act, ids), weights)  # (T, k, E)
    row = k * E * 4

    def slot(i: int) -> Tensor:
        return ops.view(experts, (T, E), (row, 4), i * E * 4)

    out = slot(0) if k > 1 else ops.cont(slot(0))
    for i in range(1, k):
        out = ops.add(out, slot(i))
    return out
