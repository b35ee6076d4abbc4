"""Model features against llama.cpp on tiny random GGUF files (tests/arch_factory.py), on every backend: linear
RoPE scaling (`rope.scaling.type = linear`, positions divided by the factor), partial rotary embeddings
(`rope.dimension_count` smaller than the head: only the first dims of each head rotate) and biases on the q, k, v
and output projections.

llama.cpp refuses partial rotary for llama (n_rot must equal the head size) and asserts on it for qwen2/qwen3, so
partial rotary is compared on phi3 (NEOX rope) and gemma3; our llama files with it are checked elsewhere against the
numpy reference only where it exists."""

from __future__ import annotations

import numpy as np
import pytest
from arch_factory import write_tiny

from ggml_py import load_model

import llamacpp_peer
from conftest import available_backends
from model_factory import nmse

pytestmark = pytest.mark.skipif(not llamacpp_peer.available(), reason=llamacpp_peer.NOT_AVAILABLE)

BACKENDS = available_backends()
PROMPT = "Hello there, the cat is on the mat. <|im_end|> and so on, and on, and on"
GEMMA = dict(head_dim=128, n_swa=8, swa_pattern=2, rope_base=1e6, rope_base_swa=10000.0)

# name -> (architecture, write_tiny options of the feature, options that stay the same without it)
FEATURES = {
    "llama-linear-rope-4": ("llama", dict(rope_scaling=("linear", 4.0)), {}),
    "qwen2-linear-rope-2.5": ("qwen2", dict(rope_scaling=("linear", 2.5)), {}),
    "gemma3-linear-rope-8": ("gemma3", dict(rope_scaling=("linear", 8.0)), GEMMA),
    "phi3-partial-rotary-32-of-64": ("phi3", dict(n_rot=32), {}),
    "gemma3-partial-rotary-64-of-128": ("gemma3", dict(n_rot=64), GEMMA),
    "llama-qkvo-biases": ("llama", dict(attn_bias=True), {}),
}
# F32 weights: measured NMSE against llama.cpp 1e-8 to 3e-8 on both backends
MAX_NMSE = 1e-6
# the feature must move the logits far more than that, or the comparison would not show it is implemented (gemma3's
# global layer has rope base 1e6: scaling it moves the logits least, NMSE ~4e-4)
MIN_EFFECT = 100 * MAX_NMSE



def _ours(path: str, backend: str, ids: list[int] | None = None) -> tuple[np.ndarray, list[int]]:
    with load_model(path, backends=[backend], n_ctx=64, progress=False) as m:
        ids = ids if ids is not None else m.tokenize(PROMPT)
        return m.eval(ids), ids


@pytest.mark.parametrize("name", list(FEATURES))
def test_feature_logits_match_llama_cpp(name, tmp_path):
    arch, feature, common = FEATURES[name]
    path = write_tiny(tmp_path / f"{name}.gguf", arch, seed=4, **common, **feature)
    _, ids = _ours(path, "numpy")
    out = tmp_path / "llama_cpp.npy"
    llamacpp_peer.run(llamacpp_peer.PROMPT_LOGITS_WORKER, path, ids, str(out))
    ref = np.load(out)
    for b in BACKENDS:
        ours, _ = _ours(path, b, ids)
        err = nmse(ours, ref)
        assert err < MAX_NMSE, f"{name} on {b}: NMSE {err:.2e} against llama.cpp"
    if "bias" not in name:  # the same weights without the key: the feature changes the result
        plain = write_tiny(tmp_path / "plain.gguf", arch, seed=4, **common)
        without, _ = _ours(plain, BACKENDS[0], ids)
        assert nmse(without, ref) > MIN_EFFECT, f"{name}: the feature hardly changes the logits"
