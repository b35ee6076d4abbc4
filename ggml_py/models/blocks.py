"""The shared blocks of a decoder-only transformer step, written once for every architecture: the step's inputs,
the embedding, RMS norms, q/k/v projections (separate or fused, with optional biases and per-head norms), RoPE,
attention over the KV cache (causal or sliding-window mask), gated FFNs (separate or fused gate/up), the output head.

An architecture's module arranges these blocks into one layer (`LayerFn`); `build_step` runs the layers between the
embedding and the head. Shapes are in numpy order: activations are (T, features), T the step's tokens.

`n_kv` (the cache rows attention reads) is normally the symbol `sym("n_kv", n_ctx)` so that one prepared plan serves
every position; the mask inputs `(T, n_kv)` bind it. A sliding window is a second mask input, never a rebuild.
The batched decoder (batch.py) also makes T symbolic and selects the rows whose logits are wanted with an `out_idx`
input (GET_ROWS before the last layer's FFN), so one plan serves any mix of sequences and prefill chunks.
With `embd`, the step ends at the output norm: its output is the normed hidden states (embed.py pools them).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from ggml_py.ir import dtypes, ops
from ggml_py.ir.symbolic import Dim
from ggml_py.ir.tensor import Tensor, input
from ggml_py.models.hparams import HParams
from ggml_py.models.kv_cache import KVCache, causal_mask
from ggml_py.models.moe import moe_ffn
from ggml_py.models.weights import Layer, Weights

# How many candidates a one-token step hands to the sampler without the whole logits (llama.cpp's default top_k is 40)
TOP_CANDIDATES = 64


@dataclass
class StepGraph:
    """The tensors of one built forward step: its inputs and the logits output."""

    n_tokens: int
    last_only: bool
    tokens: Tensor | None  # None on a pipeline stage that does not start at the embedding
    pos: Tensor
    kv_idx: Tensor
    # a pipeline stage before the last: its hidden states (T, n_embd) instead; with `embd`, the hidden states after
    # the output norm (rows as the logits' would be), named "embd"
    logits: Tensor
    mask: Tensor | None  # causal; None when every layer slides
    mask_swa: Tensor | None = None  # causal within the sliding window; None without sliding layers
    n_swa: int = 0
    out_idx: Tensor | None = None  # rows whose logits are computed (batched steps), (n_out,) I32
    # a one-row step's TOP_CANDIDATES best token ids (largest logit first) and their logits, for a sampler that
    # needs no more: reading them instead of the whole vocabulary's logits saves the host a copy per token
    top_ids: Tensor | None = None
    top_logits: Tensor | None = None
    hidden: Tensor | None = None  # a pipeline stage after the first: its input hidden states (T, n_embd)

    def outputs(self) -> list[Tensor]:
        return [t for t in (self.logits, self.top_ids, self.top_logits) if t is not None]

    def masks(self, pos: np.ndarray, n_kv: int, zeros: np.ndarray) -> list[tuple[Tensor, np.ndarray]]:
        """The values of the mask inputs for queries at `pos` over `n_kv` cache rows. `zeros` is a (1, >= n_kv)
        zero row, the causal mask of any one-token step (it sees every row), kept to allocate nothing per token."""
        out = []
        if self.mask is not None:
            out.append((self.mask, zeros[:, :n_kv] if len(pos) == 1 else causal_mask(pos, n_kv)))
        if self.mask_swa is not None:
            out.append((self.mask_swa, causal_mask(pos, n_kv, self.n_swa)))
        return out


def _bias(x: Tensor, b: Tensor | None) -> Tensor:
    return x if b is None else ops.add(x, b)


class StepBuilder:
    """Builds one forward step over `n_tokens` new tokens attending to the first `n_kv` cache rows."""

    def __init__(self, hp: HParams, w: Weights, cache: KVCache, n_tokens: Dim, n_kv: Dim, last_only: bool,
                 n_out: Dim | None = None) -> None:
        self.hp, self.w, self.cache, self.T, self.n_kv = hp, w, cache, n_tokens, n_kv
        self.last_only = last_only and n_out is None and isinstance(n_tokens, int) and n_tokens > 1
        # rows to keep on the last layer (the logits wanted), or None for all rows (or the last one: last_only)
        self.out_idx = input((n_out,), dtypes.I32, name="out_idx") if n_out is not None else None
        self.tokens = input((n_tokens,), dtypes.I32, name="tokens")
        self.pos = input((n_tokens,), dtypes.I32, name="pos")
        self.kv_idx = input((n_tokens,), dtypes.I32, name="kv_idx")  # cache rows to write
        self._masks: dict[bool, Tensor] = {}
        self._hidden: Tensor | None = None
        self._tokens_used: Tensor | None = None

    def mask(self, swa: bool) -> Tensor:
        """The (T, n_kv) F32 mask input, made on first use: causal, or causal within the sliding window."""
        if swa not in self._masks:
            self._masks[swa] = input((self.T, self.n_kv), dtypes.F32, name="kq_mask_swa" if swa else "kq_mask")
        return self._masks[swa]

    # -- blocks ------------------------------------------------------------------------------------------------------
    def embed(self) -> Tensor:
        """(T, E): rows of token_embd (any weight type, dequantized row by row by get_rows), times embd_scale."""
        self._tokens_used = self.tokens
        x = ops.get_rows(self.w.tok_embd, self.tokens)
        return x if self.hp.embd_scale == 1.0 else ops.scale(x, self.hp.embd_scale)

    def norm(self, x: Tensor, w: Tensor) -> Tensor:
        return ops.mul(ops.rms_norm(x, self.hp.rms_eps), w)

    def qk_norm(self, x: Tensor, w: Tensor) -> Tensor:
        """RMS norm of q or k (T, heads, D): per head when the weight has D values, else over the whole projection
        (olmo2's norms span all heads)."""
        T, n, D = x.shape
        if w.shape[-1] == D:
            return self.norm(x, w)
        return ops.reshape(self.norm(ops.reshape(x, (T, n * D)), w), (T, n, D))

    def residual(self, x: Tensor, out: Tensor, post_norm: Tensor | None) -> Tensor:
        """x + out: the block's output `out` RMS-normed first when it has a post-norm, and multiplied by the
        model's residual scale (granite)."""
        if post_norm is not None:
            out = self.norm(out, post_norm)
        if self.hp.residual_scale != 1.0:
            out = ops.scale(out, self.hp.residual_scale)
        return ops.add(x, out)

    def linear(self, w: Tensor, x: Tensor, b: Tensor | None = None) -> Tensor:
        return _bias(ops.mul_mat(w, x), b)

    def qkv(self, ly: Layer, h: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """q (T, H, D), k (T, Hk, D), v (T, Hk*Dv) from separate or fused projections."""
        hp, T = self.hp, self.T
        nq, nk, nv = hp.n_head * hp.head_dim, hp.n_head_kv * hp.head_dim, hp.n_head_kv * hp.head_dim_v
        if ly.wqkv is not None:
            qkv = self.linear(ly.wqkv, h, ly.bqkv)  # (T, nq + nk + nv): columns [q | k | v]
            row = (nq + nk + nv) * 4
            q = ops.cont(ops.view(qkv, (T, nq), (row, 4), 0))
            k = ops.cont(ops.view(qkv, (T, nk), (row, 4), nq * 4))
            v = ops.cont(ops.view(qkv, (T, nv), (row, 4), (nq + nk) * 4))
        else:
            assert ly.wq is not None and ly.wk is not None and ly.wv is not None
            q = self.linear(ly.wq, h, ly.bq)
            k = self.linear(ly.wk, h, ly.bk)
            v = self.linear(ly.wv, h, ly.bv)
        return ops.reshape(q, (T, hp.n_head, hp.head_dim)), ops.reshape(k, (T, hp.n_head_kv, hp.head_dim)), v

    def attention(self, ly: Layer, il: int, h: Tensor) -> Tensor:
        """Self-attention of layer il on the normed input h, before the output projection: (T, H*Dv).

        q/k: RMS norm (when the layer has one), then RoPE (the layer's base and scale, the model's frequency
        factors and YaRN parameters, as llama.cpp's ggml_rope_ext calls; none on a rope-less layer); k and v are
        written into the cache rows kv_idx, and attention reads a view of the written cache (so the write is
        ordered before the read by the graph itself) of its first n_kv rows as (Hk, n_kv, D): heads are slices of
        a row. flash_attn_ext reads the F16 cache directly and groups heads without copies.
        """
        hp, T, n_kv = self.hp, self.T, self.n_kv
        Hk, D, Dv = hp.n_head_kv, hp.head_dim, hp.head_dim_v
        q, k, v = self.qkv(ly, h)
        if ly.q_norm is not None:
            q = self.qk_norm(q, ly.q_norm)
        if ly.k_norm is not None:
            k = self.qk_norm(k, ly.k_norm)
        if hp.uses_rope(il):
            base, fscale = hp.rope(il)
            q, k = (ops.rope(t, self.pos, hp.n_rot, hp.rope_mode, base, fscale, self.w.rope_freqs,
                             **hp.rope_yarn.rope_args()) for t in (q, k))
        es = self.cache.dtype.type_size
        k_all = ops.set_rows(self.cache.k[il], ops.reshape(k, (T, Hk * D)), self.kv_idx)
        v_all = ops.set_rows(self.cache.v[il], v, self.kv_idx)
        kv_k = ops.view(k_all, (Hk, n_kv, D), (D * es, Hk * D * es, es))
        kv_v = ops.view(v_all, (Hk, n_kv, Dv), (Dv * es, Hk * Dv * es, es))
        att = ops.flash_attn_ext(ops.permute(q, (1, 0, 2)), kv_k, kv_v, self.mask(hp.is_swa(il)),
                                 scale=hp.attn_scale)  # (T, H, Dv)
        return ops.reshape(att, (T, hp.n_head * Dv))

    def keep_last(self, il: int, *ts: Tensor) -> tuple[Tensor, ...]:
        """On the last layer of a last-only step, the last row of each (T, n) tensor; with an `out_idx` input, the
        rows it names; else the tensors unchanged. Only those tokens' logits are wanted, so the rest of the layer
        and the head run on those rows alone (llama.cpp's inp_out_ids)."""
        if il != self.hp.n_layer - 1:
            return ts
        if self.out_idx is not None:
            return tuple(ops.get_rows(t, self.out_idx) for t in ts)
        if not self.last_only:
            return ts
        T = self.T
        return tuple(ops.view(t, (1, t.shape[-1]), offset=(T - 1) * t.shape[-1] * 4) for t in ts)

    def ffn(self, ly: Layer, h: Tensor, act: str = "silu") -> Tensor:
        """down(act(gate(h)) * up(h)); act is "silu" (SwiGLU) or "gelu" (GeGLU, tanh approximation). Without a
        separate gate, `up` holds [gate; up] and the first half of its output gates the second. A layer with
        experts routes each token through its chosen experts' SwiGLU FFNs instead (moe.py)."""
        if ly.gate_inp is not None:
            return moe_ffn(self.hp, ly, h)
        assert ly.up is not None and ly.down is not None
        glu = ops.swiglu if act == "silu" else ops.geglu
        if ly.gate is None:
            ff = glu(ops.mul_mat(ly.up, h))
        else:
            ff = glu(ops.mul_mat(ly.gate, h), ops.mul_mat(ly.up, h))
        return ops.mul_mat(ly.down, ff)

    def hidden_in(self) -> Tensor:
        """(T, E) F32: a pipeline stage's input, the hidden states the stage before it computed."""
        self._hidden = input((self.T, self.hp.n_embd), dtypes.F32, name="hidden")
        return self._hidden

    def hidden_out(self, x: Tensor) -> StepGraph:
        """The StepGraph of a pipeline stage before the last: its output is the hidden states x (T, E)."""
        x = x.set_name("hidden_out").set_output()
        return StepGraph(self.T, False, self._tokens_used, self.pos, self.kv_idx, x, self._masks.get(False),
                         self._masks.get(True), self.hp.n_swa, None, hidden=self._hidden)

    def finish(self, x: Tensor, embd: bool = False) -> StepGraph:
        """The final norm, the head (token_embd when tied) and the optional soft cap; the StepGraph. With `embd`,
        the final norm alone: its output is the normed hidden states (llama.cpp's "result_norm", what it pools
        into embeddings), and no head is computed."""
        hp = self.hp
        normed = self.norm(x, self.w.output_norm)
        if embd:
            return StepGraph(self.T, self.last_only, self._tokens_used, self.pos, self.kv_idx,
                             normed.set_name("embd").set_output(), self._masks.get(False), self._masks.get(True),
                             hp.n_swa, self.out_idx, hidden=self._hidden)
        logits = ops.mul_mat(self.w.output, normed)
        if hp.logit_scale != 1.0:
            logits = ops.scale(logits, hp.logit_scale)
        if hp.final_softcap > 0:
            c = hp.final_softcap
            logits = ops.scale(ops.tanh(ops.scale(logits, 1.0 / c)), c)
        logits = logits.set_name("logits").set_output()
        top_ids = top_logits = None
        rows, n_vocab = logits.shape
        if isinstance(rows, int) and rows == 1:
            top_ids = ops.top_k(logits, min(TOP_CANDIDATES, n_vocab)).set_name("top_ids").set_output()
            top_logits = ops.get_rows(ops.reshape(logits, (n_vocab, 1)), ops.reshape(top_ids, (top_ids.shape[-1],)))
            top_logits = top_logits.set_name("top_logits").set_output()
        return StepGraph(self.T, self.last_only, self._tokens_used, self.pos, self.kv_idx, logits,
                         self._masks.get(False), self._masks.get(True), hp.n_swa, self.out_idx, top_ids, top_logits,
                         self._hidden)


# One transformer block of an architecture: (builder, its weights, layer index, input x (T, E)) -> output x.
LayerFn = Callable[[StepBuilder, Layer, int, Tensor], Tensor]


def build_step(hp: HParams, w: Weights, cache: KVCache, layer: LayerFn, n_tokens: Dim, n_kv: Dim,
               last_only: bool = False, n_out: Dim | None = None, layers: range | None = None,
               embd: bool = False) -> StepGraph:
    """The graph of one forward step: embedding, the architecture's `layer` for every block, the head.

    Inputs: tokens (T,) I32, pos (T,) I32, kv_idx (T,) I32, the mask(s) (T, n_kv) F32, and with `n_out` out_idx
    (n_out,) I32. Output: logits (T, n_vocab), (1, n_vocab) for the last token only when `last_only`, or
    (n_out, n_vocab) for the rows out_idx names.

    `layers`, a range of the blocks, makes a pipeline stage: one that does not start at block 0 takes the hidden
    states (T, n_embd) as its input `hidden` instead of the tokens, and one that does not end at the last block
    outputs its hidden states (`hidden_out`) instead of the logits.

    `embd`: the step outputs the hidden states after the output norm, (T, n_embd) or (n_out, n_embd), instead of
    the logits (no head: what embeddings are pooled from, embed.py).
    """
    layers = range(hp.n_layer) if layers is None else layers
    b = StepBuilder(hp, w, cache, n_tokens, n_kv, last_only, n_out if layers.stop == hp.n_layer else None)
    x = b.embed() if layers.start == 0 else b.hidden_in()
    for il in layers:
        x = layer(b, w.layers[il], il, x)
    return b.finish(x, embd) if layers.stop == hp.n_layer else b.hidden_out(x)


def _pre_norm(b: StepBuilder, x: Tensor, w: Tensor | None) -> Tensor:
    return x if w is None else b.norm(x, w)


def dense_layer(act: str = "silu") -> LayerFn:
    """The decoder block of every dense family, shaped by the norms its weights have:
    x += post_norm(wo(attention(pre_norm(x)))); x += post_norm(ffn(pre_norm(x))), each norm where the layer has
    one: pre-norms only (llama, qwen2, qwen3, phi3, granite, smollm3), post-norms only (olmo2), both (gemma3)."""

    def layer(b: StepBuilder, ly: Layer, il: int, x: Tensor) -> Tensor:
        att = b.attention(ly, il, _pre_norm(b, x, ly.attn_norm))
        att, x = b.keep_last(il, att, x)
        x = b.residual(x, b.linear(ly.wo, att, ly.bo), ly.attn_post_norm)
        return b.residual(x, b.ffn(ly, _pre_norm(b, x, ly.ffn_norm), act), ly.ffn_post_norm)

    return layer
