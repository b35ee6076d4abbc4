"""What ggml_py needs to know to run a GGUF file's `general.architecture`.

An `Architecture` says how to read a family's hyper-parameters, which tensors each layer has, and how a layer is
computed from the shared blocks (blocks.py). Most families are data (a `DenseSpec` in specs.py); one with graph code
of its own is a module (gemma3.py). families.py is the registry; see docs/models.md for adding one.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ggml_py.ir.symbolic import Dim
from ggml_py.models.blocks import LayerFn, StepGraph, build_step
from ggml_py.models.hparams import HParams
from ggml_py.models.kv_cache import KVCache
from ggml_py.models.weights import Layer, TensorReader, Weights, model_tensors, rope_freqs_tensor


@dataclass(frozen=True)
class Architecture:
    """name: the GGUF `general.architecture`. hparams(meta, path, n_vocab) reads the `<name>.*` keys.
    layer_tensors(reader, hp, i) loads block i's weights. layer: the graph of one block. unsupported: tensor names
    the graph does not implement, refused at load (name -> what it is). chat_template: used when the file has
    none (Jinja, rendered in the tokenizer's sandbox). rope_freqs: the family reads llama 3's optional rope
    frequency factors (`rope_freqs.weight`)."""

    name: str
    hparams: Callable[[dict[str, Any], str, int], HParams]
    layer_tensors: Callable[[TensorReader, HParams, int], Layer]
    layer: LayerFn
    unsupported: dict[str, str] = field(default_factory=dict)
    chat_template: str | None = None
    rope_freqs: bool = False

    def load_weights(self, gf: Any, hp: HParams) -> Weights:
        """Wrap the GGUF tensors as ggml_py weights (zero-copy views of the memory map), checking names, shapes
        and types."""
        r = TensorReader(gf)
        r.refuse(self.unsupported)
        layers = [self.layer_tensors(r, hp, i) for i in range(hp.n_layer)]
        w = model_tensors(r, hp, layers)
        w.rope_freqs = rope_freqs_tensor(r, hp) if self.rope_freqs else None
        return w

    def build_step(self, hp: HParams, w: Weights, cache: KVCache, n_tokens: Dim, n_kv: Dim,
                   last_only: bool = False, n_out: Dim | None = None, layers: range | None = None,
                   embd: bool = False) -> StepGraph:
        return build_step(hp, w, cache, self.layer, n_tokens, n_kv, last_only, n_out, layers, embd)
