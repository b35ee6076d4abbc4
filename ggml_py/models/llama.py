"""The llama architecture: hyper-parameters and weights from GGUF, and the graph of one forward step.

The graph follows llama.cpp's `llm_build_llama` (src/models/llama.cpp):

    x = get_rows(token_embd, tokens)
    for each layer:
        h = rms_norm(x) * attn_norm
        q, k, v = h @ wq, h @ wk, h @ wv                      (+ biases when present)
        q, k = rope(q, pos), rope(k, pos)                      normal mode (0): adjacent pairs, as llama.cpp
        k_cache[kv_idx], v_cache[kv_idx] = k, v                set_rows into persistent STATE tensors
        a = flash_attn(q, k_cache[:n_kv], v_cache[:n_kv], mask, 1/sqrt(head_dim))
        x = x + a @ wo
        h = rms_norm(x) * ffn_norm
        x = x + (silu(h @ gate) * (h @ up)) @ down
    logits = (rms_norm(x) * output_norm) @ output             output = token_embd when tied

RoPE mode: llama.cpp gives LLM_ARCH_LLAMA `LLAMA_ROPE_TYPE_NORM`. HF checkpoints rotate halves (neox style), but
`convert_hf_to_gguf.py` permutes the rows of Q and K per head so that ggml's adjacent-pair rotation gives the same
result; a GGUF llama model must therefore be run with mode 0 (tests/model_factory.py reproduces that permutation).

`n_kv` (the number of cache rows attention reads) is a symbolic dimension bounded by the context size, so the same
graph and the same prepared plan serve every position; the mask input `(n_tokens, n_kv)` binds it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .. import dtypes, ops
from ..dtypes import DType
from ..errors import ModelError
from ..symbolic import Dim
from ..tensor import Tensor, input, state, weight

ARCH = "llama"


def _meta(meta: dict[str, Any], key: str, path: str, default: Any = None, required: bool = True) -> Any:
    if key in meta:
        return meta[key]
    if required and default is None:
        raise ModelError(f"{path}: missing metadata key {key!r}")
    return default


def _per_layer(v: Any, key: str, path: str) -> int:
    """Keys such as head_count_kv may be arrays (one value per layer); ggml_py needs them uniform."""
    if isinstance(v, list | np.ndarray):  # GGUF numeric arrays load as numpy arrays
        if isinstance(v, np.ndarray):
            v = v.tolist() if v.ndim == 1 and v.dtype.kind in "iu" else [v]
        if not v or any(x != v[0] for x in v):
            raise ModelError(f"{path}: {key} varies per layer ({v[:8]}...), which ggml_py does not support")
        v = v[0]
    if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
        raise ModelError(f"{path}: {key} must be a positive integer, got {v!r}")
    return int(v)


@dataclass(frozen=True)
class LlamaHParams:
    """Hyper-parameters of a llama model (from the `llama.*` GGUF keys)."""

    n_vocab: int
    n_ctx_train: int
    n_embd: int
    n_layer: int
    n_ff: int
    n_head: int
    n_head_kv: int
    head_dim: int
    head_dim_v: int
    n_rot: int
    rms_eps: float
    rope_freq_base: float
    rope_freq_scale: float

    @classmethod
    def from_metadata(cls, meta: dict[str, Any], path: str, n_vocab: int) -> LlamaHParams:
        a = ARCH
        n_embd = _per_layer(_meta(meta, f"{a}.embedding_length", path), "embedding_length", path)
        n_head = _per_layer(_meta(meta, f"{a}.attention.head_count", path), "attention.head_count", path)
        n_head_kv = _per_layer(_meta(meta, f"{a}.attention.head_count_kv", path, n_head),
                               "attention.head_count_kv", path)
        if n_head % n_head_kv:
            raise ModelError(f"{path}: head_count {n_head} is not a multiple of head_count_kv {n_head_kv}")
        if n_embd % n_head and f"{a}.attention.key_length" not in meta:
            raise ModelError(f"{path}: embedding_length {n_embd} is not a multiple of head_count {n_head}")
        head_dim = _per_layer(_meta(meta, f"{a}.attention.key_length", path, n_embd // n_head),
                              "attention.key_length", path)
        head_dim_v = _per_layer(_meta(meta, f"{a}.attention.value_length", path, head_dim),
                                "attention.value_length", path)
        n_rot = _per_layer(_meta(meta, f"{a}.rope.dimension_count", path, head_dim), "rope.dimension_count", path)
        if n_rot % 2 or n_rot > head_dim:
            raise ModelError(f"{path}: rope.dimension_count {n_rot} must be even and at most the head size {head_dim}")
        eps = _meta(meta, f"{a}.attention.layer_norm_rms_epsilon", path, 1e-5)
        base = _meta(meta, f"{a}.rope.freq_base", path, 10000.0)
        scale = 1.0
        stype = meta.get(f"{a}.rope.scaling.type")
        factor = meta.get(f"{a}.rope.scaling.factor", meta.get(f"{a}.rope.scale_linear"))
        if not isinstance(stype, str | None) or stype not in (None, "none", "linear"):
            raise ModelError(f"{path}: rope scaling type {stype!r} is not supported (supported: none, linear)")
        if factor is not None and (not isinstance(factor, int | float) or isinstance(factor, bool)
                                   or not math.isfinite(factor) or factor < 0):
            raise ModelError(f"{path}: rope scaling factor must be a finite number >= 0 (0: none), got {factor!r}")
        if factor and stype in (None, "linear") and float(factor) != 1.0:
            scale = 1.0 / float(factor)
        # an eps of 1 already swamps a unit-variance activation; 1e300 would make every norm output 0 in float32
        for key, v, hi in (("layer_norm_rms_epsilon", eps, 1.0), ("rope.freq_base", base, 1e30)):
            if not isinstance(v, (int, float)) or isinstance(v, bool) or not 0 < v <= hi:
                raise ModelError(f"{path}: {key} must be a number in (0, {hi:g}], got {v!r}")
        return cls(
            n_vocab=n_vocab,
            n_ctx_train=_per_layer(_meta(meta, f"{a}.context_length", path), "context_length", path),
            n_embd=n_embd,
            n_layer=_per_layer(_meta(meta, f"{a}.block_count", path), "block_count", path),
            n_ff=_per_layer(_meta(meta, f"{a}.feed_forward_length", path), "feed_forward_length", path),
            n_head=n_head,
            n_head_kv=n_head_kv,
            head_dim=head_dim,
            head_dim_v=head_dim_v,
            n_rot=n_rot,
            rms_eps=float(eps),
            rope_freq_base=float(base),
            rope_freq_scale=scale,
        )


@dataclass
class LlamaLayer:
    attn_norm: Tensor
    wq: Tensor
    wk: Tensor
    wv: Tensor
    wo: Tensor
    ffn_norm: Tensor
    gate: Tensor
    up: Tensor
    down: Tensor
    bq: Tensor | None = None
    bk: Tensor | None = None
    bv: Tensor | None = None
    bo: Tensor | None = None


@dataclass
class LlamaWeights:
    tok_embd: Tensor
    output_norm: Tensor
    output: Tensor  # is tok_embd when the head is tied
    layers: list[LlamaLayer]
    tied: bool
    type_counts: dict[str, int] = field(default_factory=dict)

    def all(self) -> list[Tensor]:
        out = [self.tok_embd, self.output_norm] + ([] if self.tied else [self.output])
        for ly in self.layers:
            out += [t for t in vars(ly).values() if t is not None]
        return out


_UNSUPPORTED_TENSORS = {
    "rope_freqs.weight": "rope frequency factors (llama 3.1 style rope scaling)",
}


def load_weights(gf: Any, hp: LlamaHParams) -> LlamaWeights:
    """Wrap the GGUF tensors as ggml_py weights (zero-copy views of the memory map), checking names, shapes, types."""
    path = gf.path
    for name, what in _UNSUPPORTED_TENSORS.items():
        if name in gf.tensors:
            raise ModelError(f"{path}: tensor {name!r} ({what}) is not supported by ggml_py")
    counts: dict[str, int] = {}

    def w(name: str, shape: tuple[int, ...], allowed: tuple[DType, ...] = dtypes.WEIGHT_TYPES,
          required: bool = True) -> Tensor | None:
        info = gf.tensors.get(name)
        if info is None:
            if required:
                raise ModelError(f"{path}: missing tensor {name!r}")
            return None
        if tuple(info.shape) != shape:
            raise ModelError(f"{path}: tensor {name!r} has shape {list(info.shape)}, expected {list(shape)} "
                             "from the metadata")
        if info.dtype not in allowed:
            raise ModelError(f"{path}: tensor {name!r} has type {info.dtype}, which this model cannot use here "
                             f"(supported: {', '.join(map(str, allowed))})")
        counts[info.dtype.name] = counts.get(info.dtype.name, 0) + 1
        return weight(gf.data(name), info.dtype, info.shape, name=name)

    E, H, Hk, D, Dv, F, V = hp.n_embd, hp.n_head, hp.n_head_kv, hp.head_dim, hp.head_dim_v, hp.n_ff, hp.n_vocab
    f32 = (dtypes.F32,)
    tok = w("token_embd.weight", (V, E))
    out_norm = w("output_norm.weight", (E,), f32)
    output = w("output.weight", (V, E), required=False)
    layers = []
    for i in range(hp.n_layer):
        p = f"blk.{i}."
        layers.append(LlamaLayer(
            attn_norm=w(p + "attn_norm.weight", (E,), f32),
            wq=w(p + "attn_q.weight", (H * D, E)),
            wk=w(p + "attn_k.weight", (Hk * D, E)),
            wv=w(p + "attn_v.weight", (Hk * Dv, E)),
            wo=w(p + "attn_output.weight", (E, H * Dv)),
            ffn_norm=w(p + "ffn_norm.weight", (E,), f32),
            gate=w(p + "ffn_gate.weight", (F, E)),
            up=w(p + "ffn_up.weight", (F, E)),
            down=w(p + "ffn_down.weight", (E, F)),
            bq=w(p + "attn_q.bias", (H * D,), f32, required=False),
            bk=w(p + "attn_k.bias", (Hk * D,), f32, required=False),
            bv=w(p + "attn_v.bias", (Hk * Dv,), f32, required=False),
            bo=w(p + "attn_output.bias", (E,), f32, required=False),
        ))  # type: ignore[arg-type]
    assert tok is not None and out_norm is not None
    return LlamaWeights(tok, out_norm, output if output is not None else tok, layers, output is None, counts)


class KVCache:
    """One K and one V tensor per layer: (n_ctx, n_head_kv * head_dim) rows, persistent STATE tensors.

    Row r holds the keys/values of the token at position r (one sequence). Every plan shares these tensors.
    """

    def __init__(self, hp: LlamaHParams, n_ctx: int, kv_type: DType) -> None:
        if kv_type not in (dtypes.F16, dtypes.F32):
            raise ModelError(f"KV cache type {kv_type} is not supported (supported: F16, F32)")
        self.n_ctx = n_ctx
        self.dtype = kv_type
        self.k = [state((n_ctx, hp.n_head_kv * hp.head_dim), kv_type, name=f"cache_k.{i}")
                  for i in range(hp.n_layer)]
        self.v = [state((n_ctx, hp.n_head_kv * hp.head_dim_v), kv_type, name=f"cache_v.{i}")
                  for i in range(hp.n_layer)]

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in (*self.k, *self.v))

    @staticmethod
    def nbytes_for(hp: LlamaHParams, n_ctx: int, kv_type: DType) -> int:
        """What a cache for these parameters will allocate (before making one)."""
        return hp.n_layer * n_ctx * hp.n_head_kv * (hp.head_dim + hp.head_dim_v) * kv_type.type_size


@dataclass
class StepGraph:
    """The tensors of one built forward step: its inputs and the logits output."""

    n_tokens: int
    last_only: bool
    tokens: Tensor
    pos: Tensor
    kv_idx: Tensor
    mask: Tensor
    logits: Tensor


def _add_bias(x: Tensor, b: Tensor | None) -> Tensor:
    return x if b is None else ops.add(x, b)


def build_step(hp: LlamaHParams, w: LlamaWeights, cache: KVCache, n_tokens: int, n_kv: Dim,
               last_only: bool = False) -> StepGraph:
    """The graph of one forward step over `n_tokens` new tokens attending to the first `n_kv` cache rows.

    Inputs: tokens (T,) I32, pos (T,) I32, kv_idx (T,) I32 (cache rows to write), mask (T, n_kv) F32.
    Output: logits (T, n_vocab), or (1, n_vocab) for the last token only when `last_only`.
    `n_kv` is normally the symbol `sym("n_kv", n_ctx)`, so one plan serves every position.
    """
    T, E, H, Hk, D, Dv = n_tokens, hp.n_embd, hp.n_head, hp.n_head_kv, hp.head_dim, hp.head_dim_v
    tokens = input((T,), dtypes.I32, name="tokens")
    pos = input((T,), dtypes.I32, name="pos")
    kv_idx = input((T,), dtypes.I32, name="kv_idx")
    mask = input((T, n_kv), dtypes.F32, name="kq_mask")
    kq_scale = 1.0 / math.sqrt(D)
    es = cache.dtype.type_size
    x = ops.get_rows(w.tok_embd, tokens)  # (T, E)
    for il, ly in enumerate(w.layers):
        last = il == hp.n_layer - 1
        h = ops.mul(ops.rms_norm(x, hp.rms_eps), ly.attn_norm)
        q = ops.reshape(_add_bias(ops.mul_mat(ly.wq, h), ly.bq), (T, H, D))
        k = ops.reshape(_add_bias(ops.mul_mat(ly.wk, h), ly.bk), (T, Hk, D))
        v = _add_bias(ops.mul_mat(ly.wv, h), ly.bv)  # (T, Hk*Dv)
        q = ops.rope(q, pos, hp.n_rot, ops.ROPE_NORMAL, hp.rope_freq_base, hp.rope_freq_scale)
        k = ops.rope(k, pos, hp.n_rot, ops.ROPE_NORMAL, hp.rope_freq_base, hp.rope_freq_scale)
        k_all = ops.set_rows(cache.k[il], ops.reshape(k, (T, Hk * D)), kv_idx)
        v_all = ops.set_rows(cache.v[il], v, kv_idx)
        # the first n_kv rows of the cache, as (Hk, n_kv, D): heads are the middle of a row
        kv_k = ops.view(k_all, (Hk, n_kv, D), (D * es, Hk * D * es, es))
        kv_v = ops.view(v_all, (Hk, n_kv, Dv), (Dv * es, Hk * Dv * es, es))
        att = ops.flash_attn_ext(ops.permute(q, (1, 0, 2)), kv_k, kv_v, mask, scale=kq_scale)  # (T, H, Dv)
        att = ops.reshape(att, (T, H * Dv))
        if last and last_only and T > 1:
            # only the last token's logits are wanted: finish the last layer on that row alone (llama.cpp's out_ids)
            att = ops.view(att, (1, H * Dv), offset=(T - 1) * H * Dv * 4)
            x = ops.view(x, (1, E), offset=(T - 1) * E * 4)
        x = ops.add(x, _add_bias(ops.mul_mat(ly.wo, att), ly.bo))
        h = ops.mul(ops.rms_norm(x, hp.rms_eps), ly.ffn_norm)
        ff = ops.swiglu(ops.mul_mat(ly.gate, h), ops.mul_mat(ly.up, h))
        x = ops.add(x, ops.mul_mat(ly.down, ff))
    x = ops.mul(ops.rms_norm(x, hp.rms_eps), w.output_norm)
    logits = ops.mul_mat(w.output, x).set_name("logits").set_output()
    return StepGraph(T, last_only and T > 1, tokens, pos, kv_idx, mask, logits)


def causal_mask(pos: np.ndarray, n_kv: int) -> np.ndarray:
    """(T, n_kv) F32: 0 where cache row j holds a position the query at pos[i] may see (j <= pos[i]), else -inf."""
    return np.where(np.arange(n_kv)[None, :] <= pos[:, None], np.float32(0), np.float32(-np.inf)).astype(np.float32)
