"""Tiny random llama models written with gguf.GGUFWriter, and an independent numpy reference forward pass.

The weights are drawn in Hugging Face's layout (q_proj rows grouped as [first half | second half] of each head,
rotated with `rotate_half`), then written the way llama.cpp's convert_hf_to_gguf.py writes them: the rows of Q and K
are permuted per head so that ggml's adjacent-pair RoPE (mode 0) reproduces HF's rotation. The reference below runs
HF's formulation on the un-permuted weights, so it checks the graph builder, the permutation convention, the KV cache
and the attention end to end without sharing any code with ggml_py.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import gguf
import numpy as np
from gguf import GGMLQuantizationType as QT

from ggml_py.models.tokenizer import _bytes_to_unicode

CHATML = ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + "
          "'<|im_end|>\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
MERGES = ["Ġ t", "h e", "Ġt he", "i n", "Ġ a", "e r", "o n", "Ġ s", "r e", "a t", "e n", "o r", "Ġ o", "Ġ w",
          "i s", "Ġ c", "e s", "a n", "Ġ b", "l l", "Ġ i", "Ġi s", "Ġ f", "o u", "e d"]


def _byte_chars() -> list[str]:
    """GPT-2's byte characters in byte order (the tokenizer's table, whose ids tests/test_tokenizer.py checks
    against llama.cpp)."""
    table = _bytes_to_unicode()
    return [table[b] for b in range(256)]


def tiny_vocab() -> tuple[list[str], list[int], list[str]]:
    """A GPT-2 style byte-level BPE vocabulary: 3 control tokens, the 256 byte characters, one token per merge."""
    tokens = list(SPECIALS) + _byte_chars() + [m.replace(" ", "") for m in MERGES]
    types = [3] * len(SPECIALS) + [1] * (len(tokens) - len(SPECIALS))
    return tokens, types, list(MERGES)



def add_tiny_tokenizer(w: gguf.GGUFWriter, tokens: list[str], types: list[int], merges: list[str]) -> None:
    """A tiny_vocab()-style GPT-2 BPE tokenizer (BOS 0, EOS 2, no BOS added) with the ChatML template."""
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("gpt-2")  # llama.cpp's name, so llama.cpp loads these models too
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    w.add_bos_token_id(0)
    w.add_eos_token_id(2)
    w.add_add_bos_token(False)
    w.add_chat_template(CHATML)

def hf_to_gguf_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """convert_hf_to_gguf.py's LlamaModel.permute: per head, interleave the two halves of the rows."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


@dataclass
class TinyLlama:
    path: str
    n_vocab: int
    n_embd: int
    n_layer: int
    n_head: int
    n_head_kv: int
    n_ff: int
    n_ctx_train: int
    rms_eps: float
    rope_base: float
    hf: dict[str, np.ndarray] = field(default_factory=dict)  # float64 weights in HF layout, as stored (dequantized)


def _store(w: gguf.GGUFWriter, name: str, data: np.ndarray, qtype: QT, skip: tuple[str, ...] = ()) -> np.ndarray:
    """Write `data` (float32) as `qtype`; return the values as stored (float64)."""
    data = np.ascontiguousarray(data, dtype=np.float32)
    if name in skip:
        return data.astype(np.float64)
    if qtype == QT.F32:
        w.add_tensor(name, data)
        return data.astype(np.float64)
    if qtype == QT.F16:
        h = data.astype(np.float16)
        w.add_tensor(name, h)
        return h.astype(np.float64)
    try:
        q = gguf.quants.quantize(data, qtype)
    except NotImplementedError:  # gguf cannot make K-quants or IQ4: take ggml_py's bytes, still decoded by gguf below
        from ggml_py.formats.quants import quantize

        q = quantize(data, int(qtype))
    w.add_tensor(name, q, raw_dtype=qtype)
    return gguf.quants.dequantize(q, qtype).reshape(data.shape).astype(np.float64)


def write_tiny_llama(path: str | os.PathLike[str], *, n_embd: int = 64, n_layer: int = 2, n_head: int = 4,
                     n_head_kv: int = 2, n_ff: int = 96, n_ctx_train: int = 256, seed: int = 0,
                     weight_type: QT = QT.F32, embd_type: QT = QT.Q8_0, output_type: QT | None = None,
                     arch: str = "llama", tokenizer: bool = True, rope_base: float = 10000.0,
                     rms_eps: float = 1e-5, skip: tuple[str, ...] = ()) -> TinyLlama:
    """Write a random llama GGUF. output_type None ties the output head to the token embedding (as SmolLM2);
    tensors named in `skip` are left out (to test loading errors)."""
    rng = np.random.default_rng(seed)
    tokens, types, merges = tiny_vocab()
    V, E, H, Hk, F = len(tokens), n_embd, n_head, n_head_kv, n_ff
    D = E // H
    path = os.fspath(path)
    w = gguf.GGUFWriter(path, arch)
    a = arch
    w.add_context_length(n_ctx_train)
    w.add_embedding_length(E)
    w.add_block_count(n_layer)
    w.add_feed_forward_length(F)
    w.add_head_count(H)
    w.add_head_count_kv(Hk)
    w.add_layer_norm_rms_eps(rms_eps)
    w.add_rope_freq_base(rope_base)
    w.add_rope_dimension_count(D)
    w.add_vocab_size(V)
    w.add_name(f"tiny-{a}")
    if tokenizer:
        add_tiny_tokenizer(w, tokens, types, merges)

    def rnd(*shape: int, scale: float | None = None) -> np.ndarray:
        s = scale if scale is not None else 1.0 / np.sqrt(shape[-1])
        return (rng.standard_normal(shape) * s).astype(np.float32)

    m = TinyLlama(path, V, E, n_layer, H, Hk, F, n_ctx_train, rms_eps, rope_base)

    def store(name: str, data: np.ndarray, qtype: QT) -> np.ndarray:
        return _store(w, name, data, qtype, skip)

    m.hf["embed"] = store("token_embd.weight", rnd(V, E, scale=1.0), embd_type)
    m.hf["norm"] = store("output_norm.weight", 1.0 + 0.1 * rnd(E, scale=1.0), QT.F32)
    if output_type is not None:
        m.hf["lm_head"] = store("output.weight", rnd(V, E), output_type)
    else:
        m.hf["lm_head"] = m.hf["embed"]
    for i in range(n_layer):
        p = f"blk.{i}."
        m.hf[p + "attn_norm"] = store(p + "attn_norm.weight", 1.0 + 0.1 * rnd(E, scale=1.0), QT.F32)
        q, k = rnd(H * D, E), rnd(Hk * D, E)
        # quantization is per row, so permuting rows commutes with it: store permute(q), keep q as stored
        m.hf[p + "q"] = store(p + "attn_q.weight", hf_to_gguf_permute(q, H), weight_type)
        m.hf[p + "q"] = hf_to_gguf_unpermute(m.hf[p + "q"], H)
        m.hf[p + "k"] = hf_to_gguf_unpermute(store(p + "attn_k.weight", hf_to_gguf_permute(k, Hk),
                                                    weight_type), Hk)
        m.hf[p + "v"] = store(p + "attn_v.weight", rnd(Hk * D, E), weight_type)
        m.hf[p + "o"] = store(p + "attn_output.weight", rnd(E, H * D), weight_type)
        m.hf[p + "ffn_norm"] = store(p + "ffn_norm.weight", 1.0 + 0.1 * rnd(E, scale=1.0), QT.F32)
        m.hf[p + "gate"] = store(p + "ffn_gate.weight", rnd(F, E), weight_type)
        m.hf[p + "up"] = store(p + "ffn_up.weight", rnd(F, E), weight_type)
        m.hf[p + "down"] = store(p + "ffn_down.weight", rnd(E, F), weight_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return m


def hf_to_gguf_unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    """Inverse of hf_to_gguf_permute."""
    return w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


# -- reference forward pass (HF LlamaForCausalLM semantics, float64) -----------------------------------------------
def _rms(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * w


def _rotate_half(x: np.ndarray) -> np.ndarray:
    h = x.shape[-1] // 2
    return np.concatenate([-x[..., h:], x[..., :h]], axis=-1)


def reference_logits(m: TinyLlama, ids: list[int] | np.ndarray) -> np.ndarray:
    """Logits of every position for the token sequence `ids` starting at position 0 (float64)."""
    ids = np.asarray(ids)
    T, E, H, Hk = len(ids), m.n_embd, m.n_head, m.n_head_kv
    D = E // H
    inv = m.rope_base ** (-np.arange(0, D, 2) / D)
    ang = np.arange(T)[:, None] * inv[None, :]
    cos = np.cos(np.concatenate([ang, ang], -1))[:, None, :]  # (T, 1, D)
    sin = np.sin(np.concatenate([ang, ang], -1))[:, None, :]
    causal = np.triu(np.full((T, T), -np.inf), 1)
    x = m.hf["embed"][ids]
    for i in range(m.n_layer):
        p = f"blk.{i}."
        h = _rms(x, m.hf[p + "attn_norm"], m.rms_eps)
        q = (h @ m.hf[p + "q"].T).reshape(T, H, D)
        k = (h @ m.hf[p + "k"].T).reshape(T, Hk, D)
        v = (h @ m.hf[p + "v"].T).reshape(T, Hk, D)
        q = q * cos + _rotate_half(q) * sin
        k = k * cos + _rotate_half(k) * sin
        rep = H // Hk
        k = np.repeat(k, rep, axis=1)  # HF repeat_kv: query head j uses kv head j // rep
        v = np.repeat(v, rep, axis=1)
        s = np.einsum("thd,shd->hts", q, k) / np.sqrt(D) + causal
        s = np.exp(s - s.max(-1, keepdims=True))
        s /= s.sum(-1, keepdims=True)
        att = np.einsum("hts,shd->thd", s, v).reshape(T, H * D)
        x = x + att @ m.hf[p + "o"].T
        h = _rms(x, m.hf[p + "ffn_norm"], m.rms_eps)
        g, u = h @ m.hf[p + "gate"].T, h @ m.hf[p + "up"].T
        x = x + (g / (1 + np.exp(-g)) * u) @ m.hf[p + "down"].T
    return _rms(x, m.hf["norm"], m.rms_eps) @ m.hf["lm_head"].T


def nmse(a: np.ndarray, ref: np.ndarray) -> float:
    a, ref = np.asarray(a, np.float64), np.asarray(ref, np.float64)
    return float(((a - ref) ** 2).sum() / (ref ** 2).sum())
