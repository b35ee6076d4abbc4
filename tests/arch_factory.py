"""Tiny random GGUF models of every supported architecture, written with gguf.GGUFWriter the way llama.cpp's converter
names and shapes the tensors, so that llama.cpp can run the same file (tests/test_architectures.py compares).

The shapes are chosen so that every weight row is a multiple of 256 (every K-quant fits) and, for gemma3, the head
size (key_length) differs from n_embd / n_head and two layers of different kinds (sliding, global) exist.
"""

from __future__ import annotations

import os

import gguf
import numpy as np
from gguf import GGMLQuantizationType as QT

from model_factory import _store as _store_as
from model_factory import add_tiny_tokenizer, tiny_vocab

# per architecture: what its tensors and keys look like (facts from llama.cpp's src/models/<arch>.cpp)
QK_NORM = {"qwen3", "gemma3", "qwen3moe"}
# attn_q_norm / attn_k_norm over the whole projection, not per head (olmoe: llama.cpp sizes k's by n_embd: Hk = H)
QK_NORM_FULL = {"olmo2", "olmoe"}
# the experts (n_expert, n_expert_used, n_ff_exp) written by default for the architectures that have no dense FFN
DEFAULT_EXPERTS = {"qwen3moe": (16, 4, 256), "olmoe": (8, 2, None)}
QKV_BIAS = {"qwen2"}
FUSED = {"phi3"}  # attn_qkv and ffn_up = [gate; up]
POST_NORMS = {"gemma3", "olmo2"}
NO_PRE_NORMS = {"olmo2"}  # no attn_norm / ffn_norm
UNTIED = {"olmo2"}  # llama.cpp requires output.weight
# keys a family's files carry, with values far from 1 so that a graph ignoring one fails (granite: llama.cpp
# requires logit_scale); `metadata` overrides them
ARCH_KEYS: dict[str, dict[str, object]] = {
    "granite": {"embedding_scale": 3.0, "residual_scale": 0.4, "attention.scale": 0.3, "logit_scale": 0.5}}
# control tokens of a family's vocabulary. phi3: llama.cpp's vocabulary loader (src/llama-vocab.cpp) keys a rule on
# general.name, whatever the architecture: a name containing "phi3" or "phi-3" (write_tiny names the file
# "tiny-phi3") makes it look up <s>, </s>, <unk> and <|endoftext|> by text, and it fails ("unordered_map::at")
# without one of them; Phi's turn tokens make the vocabulary Phi-like but llama.cpp does not need them
EXTRA_SPECIALS = {"phi3": ["<|end|>", "<|user|>", "<|assistant|>", "<|system|>", "<s>", "</s>", "<unk>"]}


def write_tiny(path: str | os.PathLike[str], arch: str, *, seed: int = 0, n_embd: int = 256, n_layer: int = 2,
               n_head: int = 4, n_head_kv: int = 2, head_dim: int | None = None, n_ff: int = 512,
               weight_type: QT = QT.F32, embd_type: QT = QT.F32, output_type: QT | None = None,
               n_ctx_train: int = 512, rope_base: float = 10000.0, n_swa: int = 0,
               swa_pattern: int | None = None, rope_base_swa: float | None = None,
               final_softcap: float = 0.0, extra_tensors: dict[str, np.ndarray] | None = None,
               n_rot: int | None = None, rope_scaling: tuple[str, float] | None = None,
               attn_bias: bool = False, replace: dict[str, np.ndarray] | None = None,
               metadata: dict[str, object] | None = None, n_expert: int = 0, n_expert_used: int = 0,
               n_ff_exp: int | None = None) -> str:
    """Write a random `arch` model to `path`; return the path. output_type None ties the head to the embedding.
    n_swa > 0 writes `attention.sliding_window` (gemma3: local layers; llama: every layer). extra_tensors are
    written as they are (to test refusals). n_rot < head size rotates only the first n_rot dims of each head
    (partial rotary); rope_scaling = (type, factor) writes `rope.scaling.type` and `.factor`; attn_bias adds biases
    to the q, k, v and output projections. `replace` writes the given arrays (as they are) in place of those tensors,
    and `metadata` overrides keys (`{arch}.` is prefixed but to general.* and tokenizer.*), both to test refusals.
    n_expert > 0 writes a mixture-of-experts FFN (ffn_gate_inp, ffn_{gate,up,down}_exps of n_ff rows, or of n_ff_exp
    rows written as `expert_feed_forward_length`) with `expert_count` and `expert_used_count` (DEFAULT_EXPERTS for
    the architectures that need them)."""
    if not n_expert and arch in DEFAULT_EXPERTS:
        n_expert, n_expert_used, n_ff_exp = DEFAULT_EXPERTS[arch]
    if arch == "olmoe":  # llama.cpp sizes its k norm by n_embd: as many k heads as q heads
        n_head_kv = n_head
    rng = np.random.default_rng(seed)
    tokens, types, merges = tiny_vocab()
    extra = EXTRA_SPECIALS.get(arch, [])
    tokens, types = tokens + extra, types + [3] * len(extra)
    V, E, H, Hk, F = len(tokens), n_embd, n_head, n_head_kv, n_ff
    D = head_dim or E // H
    path = os.fspath(path)
    w = gguf.GGUFWriter(path, arch)

    def _store(w: gguf.GGUFWriter, name: str, data: np.ndarray, qtype: QT) -> np.ndarray:
        if replace and name in replace:
            w.add_tensor(name, replace[name])
            return replace[name]
        return _store_as(w, name, data, qtype)

    w.add_context_length(n_ctx_train)
    w.add_embedding_length(E)
    w.add_block_count(n_layer)
    w.add_feed_forward_length(F)
    w.add_head_count(H)
    w.add_head_count_kv(Hk)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_rope_freq_base(rope_base)
    w.add_rope_dimension_count(n_rot or D)
    if rope_scaling is not None:
        w.add_rope_scaling_type(gguf.RopeScalingType(rope_scaling[0]))
        w.add_rope_scaling_factor(rope_scaling[1])
    if head_dim:
        w.add_key_length(D)
        w.add_value_length(D)
    if n_swa:
        w.add_sliding_window(n_swa)
    if swa_pattern is not None:
        w.add_uint32(f"{arch}.attention.sliding_window_pattern", swa_pattern)
    if rope_base_swa is not None:
        w.add_float32(f"{arch}.rope.freq_base_swa", rope_base_swa)
    if final_softcap:
        w.add_final_logit_softcapping(final_softcap)
    if n_expert:
        w.add_expert_count(n_expert)
        w.add_expert_used_count(n_expert_used)
        if n_ff_exp is not None:
            w.add_expert_feed_forward_length(n_ff_exp)
    w.add_vocab_size(V)
    w.add_name(f"tiny-{arch}")
    add_tiny_tokenizer(w, tokens, types, merges)

    def rnd(*shape: int, scale: float | None = None) -> np.ndarray:
        s = scale if scale is not None else 1.0 / np.sqrt(shape[-1])
        return (rng.standard_normal(shape) * s).astype(np.float32)

    def norm(name: str, n: int) -> None:
        _store(w, name, 1.0 + 0.1 * rnd(n, scale=1.0), QT.F32)

    def mat(name: str, rows: int, cols: int, qtype: QT = weight_type) -> None:
        _store(w, name, rnd(rows, cols), qtype)

    _store(w, "token_embd.weight", rnd(V, E, scale=1.0), embd_type)
    norm("output_norm.weight", E)
    if output_type is not None or arch in UNTIED:
        mat("output.weight", V, E, weight_type if output_type is None else output_type)
    nq, nk = H * D, Hk * D
    for i in range(n_layer):
        p = f"blk.{i}."
        if arch not in NO_PRE_NORMS:
            norm(p + "attn_norm.weight", E)
        if arch in FUSED:
            mat(p + "attn_qkv.weight", nq + 2 * nk, E)
        else:
            mat(p + "attn_q.weight", nq, E)
            mat(p + "attn_k.weight", nk, E)
            mat(p + "attn_v.weight", nk, E)
        if arch in QKV_BIAS or attn_bias:
            for t, n in (("q", nq), ("k", nk), ("v", nk)):
                _store(w, p + f"attn_{t}.bias", rnd(n, scale=0.5), QT.F32)
        if arch in QK_NORM or arch in QK_NORM_FULL:
            norm(p + "attn_q_norm.weight", nq if arch in QK_NORM_FULL else D)
            norm(p + "attn_k_norm.weight", nk if arch in QK_NORM_FULL else D)
        mat(p + "attn_output.weight", E, nq)
        if attn_bias:
            _store(w, p + "attn_output.bias", rnd(E, scale=0.5), QT.F32)
        if arch not in NO_PRE_NORMS:
            norm(p + "ffn_norm.weight", E)
        if n_expert:
            Fx = n_ff_exp or F
            mat(p + "ffn_gate_inp.weight", n_expert, E, QT.F32)  # the router: F32, as llama.cpp's converter keeps it
            _store(w, p + "ffn_gate_exps.weight", rnd(n_expert, Fx, E), weight_type)
            _store(w, p + "ffn_up_exps.weight", rnd(n_expert, Fx, E), weight_type)
            _store(w, p + "ffn_down_exps.weight", rnd(n_expert, E, Fx), weight_type)
        elif arch in FUSED:
            mat(p + "ffn_up.weight", 2 * F, E)
        else:
            mat(p + "ffn_gate.weight", F, E)
            mat(p + "ffn_up.weight", F, E)
        if not n_expert:
            mat(p + "ffn_down.weight", E, F)
        if arch in POST_NORMS:
            norm(p + "post_attention_norm.weight", E)
            norm(p + "post_ffw_norm.weight", E)
    for name, data in (extra_tensors or {}).items():
        w.add_tensor(name, data)
    for key, value in {**ARCH_KEYS.get(arch, {}), **(metadata or {})}.items():  # GGUFWriter keeps the last value
        key = key if key.startswith(("general.", "tokenizer.")) else f"{arch}.{key}"
        if isinstance(value, str):
            w.add_string(key, value)
        elif isinstance(value, bool):
            w.add_bool(key, value)
        elif isinstance(value, list | tuple):  # an array of the elements' type (bool, int, float, str)
            w.add_array(key, list(value))
        elif isinstance(value, float):
            w.add_float32(key, value)
        else:
            w.add_uint32(key, int(value))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
