"""The phi3 architecture (Phi-3, Phi-3.5, Phi-4 mini), as llama.cpp's src/models/phi3.cpp: the llama block with a
fused q/k/v projection (attn_qkv: rows [q; k; v]), a fused gate/up projection (ffn_up: rows [gate; up], 2 * n_ff)
and NeoX RoPE.

`phi3.attention.sliding_window` is ignored, as llama.cpp does (its converter does not describe Phi's window layout
correctly); the 128k-context files' rope factors (rope_factors_long/short, LongRoPE) are refused.
"""

from __future__ import annotations

from typing import Any

from .. import ops
from .architecture import Architecture
from .blocks import pre_norm_layer
from .hparams import HParams, read_hparams
from .weights import Layer, TensorReader, attention_tensors, ffn_tensors

NAME = "phi3"


def hparams(meta: dict[str, Any], path: str, n_vocab: int) -> HParams:
    return read_hparams(meta, NAME, path, n_vocab, rope_mode=ops.ROPE_NEOX)


def layer_tensors(r: TensorReader, hp: HParams, i: int) -> Layer:
    return Layer(**attention_tensors(r, hp, i),  # type: ignore[arg-type]
                 **ffn_tensors(r, hp, i, fused_gate_up=True))


ARCHITECTURE = Architecture(
    name=NAME, hparams=hparams, layer_tensors=layer_tensors, layer=pre_norm_layer("silu"),
    unsupported={"rope_factors_long.weight": "LongRoPE frequency factors (128k-context Phi-3)",
                 "rope_factors_short.weight": "LongRoPE frequency factors (128k-context Phi-3)",
                 "output.bias": "a bias on the output head"},
)
