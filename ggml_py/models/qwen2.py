"""The qwen2 architecture (Qwen 2, Qwen 2.5), as llama.cpp's src/models/qwen2.cpp: the llama block with biases on the
q, k and v projections and NeoX RoPE (the halves of each head rotate: HF's layout, which the converter keeps)."""

from __future__ import annotations

from typing import Any

from .. import ops
from .architecture import Architecture
from .blocks import pre_norm_layer
from .hparams import HParams, read_hparams
from .weights import Layer, TensorReader, attention_tensors, ffn_tensors

NAME = "qwen2"


def hparams(meta: dict[str, Any], path: str, n_vocab: int) -> HParams:
    return read_hparams(meta, NAME, path, n_vocab, rope_mode=ops.ROPE_NEOX)


def layer_tensors(r: TensorReader, hp: HParams, i: int) -> Layer:
    return Layer(**attention_tensors(r, hp, i), **ffn_tensors(r, hp, i))  # type: ignore[arg-type]


ARCHITECTURE = Architecture(
    name=NAME, hparams=hparams, layer_tensors=layer_tensors, layer=pre_norm_layer("silu"),
    unsupported={"output.bias": "a bias on the output head"},
)
