"""The architecture registry: what ggml_py needs to know to run a GGUF file's `general.architecture`.

Each architecture is one module (llama.py, gemma3.py, ...) that defines an `Architecture`: how to read its
hyper-parameters, which tensors each layer has, and how a layer is computed from the shared blocks (blocks.py).
Adding one is one module plus its line in `_MODULES` (and its tests); see docs/models.md.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ..errors import ModelError
from ..symbolic import Dim
from .blocks import LayerFn, StepGraph, build_step
from .hparams import HParams
from .kv_cache import KVCache
from .weights import Layer, TensorReader, Weights, model_tensors


@dataclass(frozen=True)
class Architecture:
    """name: the GGUF `general.architecture`. hparams(meta, path, n_vocab) reads the `<name>.*` keys.
    layer_tensors(reader, hp, i) loads block i's weights. layer: the graph of one block. unsupported: tensor names
    the graph does not implement, refused at load (name -> what it is). chat_template: used when the file has
    none (Jinja, rendered in the tokenizer's sandbox)."""

    name: str
    hparams: Callable[[dict[str, Any], str, int], HParams]
    layer_tensors: Callable[[TensorReader, HParams, int], Layer]
    layer: LayerFn
    unsupported: dict[str, str] = field(default_factory=dict)
    chat_template: str | None = None

    def load_weights(self, gf: Any, hp: HParams) -> Weights:
        """Wrap the GGUF tensors as ggml_py weights (zero-copy views of the memory map), checking names, shapes
        and types."""
        r = TensorReader(gf)
        r.refuse(self.unsupported)
        layers = [self.layer_tensors(r, hp, i) for i in range(hp.n_layer)]
        return model_tensors(r, hp, layers)

    def build_step(self, hp: HParams, w: Weights, cache: KVCache, n_tokens: Dim, n_kv: Dim,
                   last_only: bool = False, n_out: Dim | None = None) -> StepGraph:
        return build_step(hp, w, cache, self.layer, n_tokens, n_kv, last_only, n_out)


_MODULES = ("llama", "qwen2", "qwen3", "phi3", "gemma3")  # one module per architecture, named as in GGUF
_registry: dict[str, Architecture] = {}


def architectures() -> dict[str, Architecture]:
    """Every supported architecture by name (modules imported on first use)."""
    if not _registry:
        for name in _MODULES:
            arch = importlib.import_module(f"{__package__}.{name}").ARCHITECTURE
            _registry[arch.name] = arch
    return _registry


def get_architecture(name: str | None, path: str = "") -> Architecture:
    """The architecture called `name`; ModelError listing the supported ones if there is none."""
    archs = architectures()
    if name not in archs:
        where = f"{path}: " if path else ""
        raise ModelError(f"{where}architecture {name!r} is not supported; supported: {', '.join(sorted(archs))}")
    return archs[name]
