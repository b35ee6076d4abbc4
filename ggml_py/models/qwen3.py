"""The qwen3 architecture, as llama.cpp's src/models/qwen3.cpp: the llama block without biases, with a per-head RMS
norm of q and of k (attn_q_norm, attn_k_norm) before NeoX RoPE."""

from __future__ import annotations

from typing import Any

from .. import ops
from .architecture import Architecture
from .blocks import pre_norm_layer
from .hparams import HParams, read_hparams
from .weights import Layer, TensorReader, attention_tensors, ffn_tensors

NAME = "qwen3"


def hparams(meta: dict[str, Any], path: str, n_vocab: int) -> HParams:
    return read_hparams(meta, NAME, path, n_vocab, rope_mode=ops.ROPE_NEOX)


def layer_tensors(r: TensorReader, hp: HParams, i: int) -> Layer:
    return Layer(**attention_tensors(r, hp, i, qk_norm=True), **ffn_tensors(r, hp, i))  # type: ignore[arg-type]


ARCHITECTURE = Architecture(name=NAME, hparams=hparams, layer_tensors=layer_tensors, layer=pre_norm_layer("silu"))
