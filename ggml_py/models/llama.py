"""The llama architecture (SmolLM2, TinyLlama, Llama 2/3, Mistral-style llama GGUFs), as llama.cpp's
src/models/llama.cpp:

    x = get_rows(token_embd, tokens)
    per layer:  x = x + wo(attention(rms_norm(x) * attn_norm))      q/k/v (+ optional biases), rope mode 0
                x = x + down(silu(gate(h)) * up(h)),  h = rms_norm(x) * ffn_norm
    logits = (rms_norm(x) * output_norm) @ output                    output = token_embd when tied

RoPE mode: llama.cpp gives LLM_ARCH_LLAMA `LLAMA_ROPE_TYPE_NORM`. HF checkpoints rotate halves (neox style), but
`convert_hf_to_gguf.py` permutes the rows of Q and K per head so that ggml's adjacent-pair rotation gives the same
result; a GGUF llama model must therefore be run with mode 0 (tests/model_factory.py reproduces that permutation).

Sliding window (Mistral v0.1 style): when the file has `llama.attention.sliding_window`, every layer attends to the
last `sliding_window` positions only. llama.cpp ignores that key for this architecture (it attends to everything),
so on prompts longer than the window the two differ: ggml_py follows the model's own configuration.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from .. import ops
from .architecture import Architecture
from .blocks import pre_norm_layer
from .hparams import HParams, Meta, read_hparams
from .weights import Layer, TensorReader, attention_tensors, ffn_tensors

NAME = "llama"


def hparams(meta: dict[str, Any], path: str, n_vocab: int) -> HParams:
    hp = read_hparams(meta, NAME, path, n_vocab, rope_mode=ops.ROPE_NORMAL)
    m = Meta(meta, NAME, path)
    if m.get("attention.sliding_window"):  # absent or 0: no window
        # every layer slides, with the model's one rope
        hp = replace(hp, n_swa=m.int_key("attention.sliding_window"), swa_layers=(True,) * hp.n_layer,
                     rope_freq_base_swa=hp.rope_freq_base, rope_freq_scale_swa=hp.rope_freq_scale)
    return hp


def layer_tensors(r: TensorReader, hp: HParams, i: int) -> Layer:
    return Layer(**attention_tensors(r, hp, i), **ffn_tensors(r, hp, i))  # type: ignore[arg-type]


ARCHITECTURE = Architecture(
    name=NAME, hparams=hparams, layer_tensors=layer_tensors, layer=pre_norm_layer("silu"),
    unsupported={"rope_freqs.weight": "rope frequency factors (llama 3.1 style rope scaling)"},
)
