"""The weights of a decoder-only transformer, wrapped zero-copy from the GGUF memory map with checked names, shapes and
types. The fields are the union over the architectures; each architecture's module says which it loads."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from ggml_py.errors import ModelError
from ggml_py.ir import dtypes
from ggml_py.ir.dtypes import DType
from ggml_py.ir.tensor import Tensor, weight
from ggml_py.models.hparams import HParams

F32_ONLY = (dtypes.F32,)  # norms and biases
# q/k RMS norms: "head" normalises each head (qwen3, gemma3), "full" the whole projection at once (olmo2)
QKNorm = Literal["head", "full"]


@dataclass
class Layer:
    """One transformer block. q/k/v come either separately (wq, wk, wv) or fused (wqkv); gate/up either separately
    (gate, up) or fused in `up` (gate = None, `up` then has 2 * n_ff rows: gate first, as llama.cpp's phi3), or
    experts (gate_inp and the *_exps). The norms a block has decide its shape (blocks.dense_layer): pre-norms
    (attn_norm, ffn_norm), post-norms of the attention and FFN outputs (attn_post_norm, ffn_post_norm), or both."""

    wo: Tensor
    up: Tensor | None = None  # None in a mixture-of-experts layer
    down: Tensor | None = None
    attn_norm: Tensor | None = None  # None: the block normalises no input (olmo2)
    ffn_norm: Tensor | None = None
    wq: Tensor | None = None
    wk: Tensor | None = None
    wv: Tensor | None = None
    wqkv: Tensor | None = None
    bq: Tensor | None = None
    bk: Tensor | None = None
    bv: Tensor | None = None
    bqkv: Tensor | None = None
    bo: Tensor | None = None
    q_norm: Tensor | None = None  # RMS norms of q and k: per head (head size) or over the whole projection
    k_norm: Tensor | None = None
    attn_post_norm: Tensor | None = None  # norms of the attention and FFN outputs before the residual (gemma3, olmo2)
    ffn_post_norm: Tensor | None = None
    gate: Tensor | None = None
    # mixture of experts (moe.py): the router (n_expert, E) and each expert's gate, up (n_expert, F, E) and down
    # (n_expert, E, F), in place of gate, up and down
    gate_inp: Tensor | None = None
    gate_exps: Tensor | None = None
    up_exps: Tensor | None = None
    down_exps: Tensor | None = None


@dataclass
class Weights:
    tok_embd: Tensor
    output_norm: Tensor
    output: Tensor  # is tok_embd when the head is tied
    layers: list[Layer]
    tied: bool
    type_counts: dict[str, int] = field(default_factory=dict)
    rope_freqs: Tensor | None = None  # llama 3's rope frequency factors (n_rot/2,), shared by every layer

    def all(self) -> list[Tensor]:
        out = [self.tok_embd, self.output_norm] + ([] if self.tied else [self.output])
        out += [] if self.rope_freqs is None else [self.rope_freqs]
        for ly in self.layers:
            out += [t for t in vars(ly).values() if t is not None]
        return out


class TensorReader:
    """Looks up GGUF tensors by name, checks their shape (numpy order: rows first) and type, wraps them as weights."""

    def __init__(self, gf: Any) -> None:
        self.gf = gf
        self.path: str = gf.path
        self.counts: dict[str, int] = {}

    def has(self, name: str) -> bool:
        return name in self.gf.tensors

    def get(self, name: str, shape: tuple[int, ...], allowed: tuple[DType, ...] = dtypes.WEIGHT_TYPES,
            required: bool = True) -> Tensor | None:
        info = self.gf.tensors.get(name)
        if info is None:
            if required:
                raise ModelError(f"{self.path}: missing tensor {name!r}")
            return None
        if tuple(info.shape) != shape:
            raise ModelError(f"{self.path}: tensor {name!r} has shape {list(info.shape)}, expected {list(shape)} "
                             "from the metadata")
        if info.dtype not in allowed:
            raise ModelError(f"{self.path}: tensor {name!r} has type {info.dtype}, which this model cannot use here "
                             f"(supported: {', '.join(map(str, allowed))})")
        self.counts[info.dtype.name] = self.counts.get(info.dtype.name, 0) + 1
        return weight(self.gf.data(name), info.dtype, info.shape, name=name)

    def need(self, name: str, shape: tuple[int, ...], allowed: tuple[DType, ...] = dtypes.WEIGHT_TYPES) -> Tensor:
        t = self.get(name, shape, allowed)
        assert t is not None
        return t

    def norm(self, name: str, n: int, required: bool = True) -> Tensor | None:
        return self.get(name, (n,), F32_ONLY, required)

    def refuse(self, unsupported: dict[str, str]) -> None:
        """Refuse a file that has a tensor the graph would ignore (it would compute something else)."""
        for name, what in unsupported.items():
            if any(n == name or n.endswith("." + name) for n in self.gf.tensors):
                raise ModelError(f"{self.path}: tensor {name!r} ({what}) is not supported by ggml_py")


# -- the blocks' tensors, as llama.cpp names them ------------------------------------------------------------------
def attention_tensors(r: TensorReader, hp: HParams, i: int, *, qk_norm: QKNorm | None = None,
                      pre_norm: bool = True) -> dict[str, Tensor | None]:
    """attn_norm (when `pre_norm`), q/k/v (separate, or fused attn_qkv when the file has it, as llama.cpp accepts
    for any architecture) with optional biases, attn_output (+ optional bias), and the q/k norms of `qk_norm`
    (per head: head size; "full": the projection's width, olmo2 and olmoe)."""
    p = f"blk.{i}."
    E, H, Hk, D, Dv = hp.n_embd, hp.n_head, hp.n_head_kv, hp.head_dim, hp.head_dim_v
    nq, nk, nv = H * D, Hk * D, Hk * Dv
    t: dict[str, Tensor | None] = {"wo": r.need(p + "attn_output.weight", (E, H * Dv)),
                                   "bo": r.norm(p + "attn_output.bias", E, required=False)}
    if r.has(p + "attn_qkv.weight"):
        t["wqkv"] = r.need(p + "attn_qkv.weight", (nq + nk + nv, E))
        t["bqkv"] = r.norm(p + "attn_qkv.bias", nq + nk + nv, required=False)
    else:
        t["wq"] = r.need(p + "attn_q.weight", (nq, E))
        t["wk"] = r.need(p + "attn_k.weight", (nk, E))
        t["wv"] = r.need(p + "attn_v.weight", (nv, E))
        t["bq"] = r.norm(p + "attn_q.bias", nq, required=False)
        t["bk"] = r.norm(p + "attn_k.bias", nk, required=False)
        t["bv"] = r.norm(p + "attn_v.bias", nv, required=False)
    if pre_norm:
        t["attn_norm"] = r.norm(p + "attn_norm.weight", E)
    if qk_norm:
        t["q_norm"] = r.norm(p + "attn_q_norm.weight", D if qk_norm == "head" else nq)
        t["k_norm"] = r.norm(p + "attn_k_norm.weight", D if qk_norm == "head" else nk)
    return t


def ffn_tensors(r: TensorReader, hp: HParams, i: int, *, fused_gate_up: bool = False,
                pre_norm: bool = True) -> dict[str, Tensor | None]:
    """ffn_norm (when `pre_norm`), ffn_gate/ffn_up/ffn_down; with `fused_gate_up`, ffn_up holds [gate; up]
    (2 * n_ff rows)."""
    p = f"blk.{i}."
    E, F = hp.n_embd, hp.n_ff
    t: dict[str, Tensor | None] = {"down": r.need(p + "ffn_down.weight", (E, F))}
    if pre_norm:
        t["ffn_norm"] = r.norm(p + "ffn_norm.weight", E)
    if fused_gate_up:
        t["up"] = r.need(p + "ffn_up.weight", (2 * F, E))
    else:
        t["gate"] = r.need(p + "ffn_gate.weight", (F, E))
        t["up"] = r.need(p + "ffn_up.weight", (F, E))
    return t


def rope_freqs_tensor(r: TensorReader, hp: HParams) -> Tensor | None:
    """`rope_freqs.weight` (n_rot/2,) F32, optional: llama 3's rope scaling, each rotated pair's angle divided by its
    factor. llama.cpp creates it for layer 0 and shares it with every other layer; so does ggml_py."""
    return r.get("rope_freqs.weight", (hp.n_rot // 2,), F32_ONLY, required=False)


def expert_tensors(r: TensorReader, hp: HParams, i: int) -> dict[str, Tensor | None]:
    """ffn_norm, the router ffn_gate_inp and the experts' ffn_gate_exps, ffn_up_exps, ffn_down_exps (llama.cpp's
    names; one 3-D tensor each, experts outermost)."""
    p = f"blk.{i}."
    E, F, X = hp.n_embd, hp.n_ff_exp, hp.n_expert
    return {"ffn_norm": r.norm(p + "ffn_norm.weight", E), "gate_inp": r.need(p + "ffn_gate_inp.weight", (X, E)),
            "gate_exps": r.need(p + "ffn_gate_exps.weight", (X, F, E)),
            "up_exps": r.need(p + "ffn_up_exps.weight", (X, F, E)),
            "down_exps": r.need(p + "ffn_down_exps.weight", (X, E, F))}
def post_norm_tensors(r: TensorReader, hp: HParams, i: int) -> dict[str, Tensor | None]:
    """post_attention_norm and post_ffw_norm: RMS norms of the attention and FFN outputs (gemma3, olmo2)."""
    p = f"blk.{i}."
    return {"attn_post_norm": r.norm(p + "post_attention_norm.weight", hp.n_embd),
            "ffn_post_norm": r.norm(p + "post_ffw_norm.weight", hp.n_embd)}


def model_tensors(r: TensorReader, hp: HParams, layers: list[Layer]) -> Weights:
    """token_embd (any weight type, read with get_rows), output_norm, output (absent: tied to token_embd)."""
    E, V = hp.n_embd, hp.n_vocab
    tok = r.need("token_embd.weight", (V, E))
    out_norm = r.norm("output_norm.weight", E)
    output = r.get("output.weight", (V, E), required=False)
    assert out_norm is not None
    return Weights(tok, out_norm, output if output is not None else tok, layers, output is None, r.counts)
