"""The model loader's refusals: a GGUF file whose hyper-parameters or tensors ggml_py cannot run correctly is refused
with a ModelError naming the file and the reason, before any graph is built. Each refused file differs from a tiny
model that loads (tests/arch_factory.py) by that one key or tensor; where llama.cpp refuses the same file too, the
test says so (a file it runs that we refuse would be a gap, and is named here)."""

from __future__ import annotations

import numpy as np
import pytest
from arch_factory import write_tiny

from ggml_py import load_model
from ggml_py.errors import ModelError

import llamacpp_peer
from model_factory import tiny_vocab

E, H, D, F = 256, 4, 64, 512  # write_tiny's defaults: n_embd, n_head, head size, n_ff
V = len(tiny_vocab()[0])  # the tiny tokenizer's tokens (284)

# name -> (architecture, write_tiny options, the error's message (regex), does llama.cpp refuse it too)
REFUSED = {
    "rope-scaling-yarn": ("llama", dict(rope_scaling=("yarn", 4.0)), r"rope scaling type 'yarn' is not supported",
                          False),
    "rope-scaling-longrope": ("phi3", dict(rope_scaling=("longrope", 4.0)),
                              r"rope scaling type 'longrope' is not supported", None),
    "rope-dims-odd": ("llama", dict(n_rot=31), r"rope.dimension_count 31 must be even and at most the head size 64",
                      True),
    "rope-dims-over-head": ("phi3", dict(n_rot=96), r"rope.dimension_count 96 must be even", None),
    "heads-not-multiple-of-kv": ("llama", dict(metadata={"attention.head_count_kv": 3}),
                                 r"head_count 4 is not a multiple of head_count_kv 3", True),
    "q-wrong-shape": ("llama", dict(replace={"blk.0.attn_q.weight": np.zeros((E - 32, E), np.float32)}),
                      r"tensor 'blk.0.attn_q.weight' has shape .*expected", True),
    "ffn-down-transposed": ("qwen3", dict(replace={"blk.1.ffn_down.weight": np.zeros((F, E), np.float32)}),
                            r"tensor 'blk.1.ffn_down.weight' has shape .*expected", True),
    "norm-f16": ("llama", dict(replace={"blk.0.attn_norm.weight": np.ones(E, np.float16)}),
                 r"tensor 'blk.0.attn_norm.weight' has type F16", None),
    "bias-wrong-length": ("qwen2", dict(replace={"blk.0.attn_k.bias": np.zeros(E, np.float32)}),
                          r"tensor 'blk.0.attn_k.bias' has shape", True),
    # llama.cpp makes token_embd (and output) exactly {n_embd, tokens in the tokenizer}: more rows would let sampling
    # pick ids no token stands for; `<arch>.vocab_size` is not what it checks against (written equal to the rows here)
    "embedding-more-rows-than-tokens": ("llama", dict(replace={"token_embd.weight": np.zeros((V + 5, E), np.float32)},
                                                      metadata={"vocab_size": V + 5}),
                                        rf"the tokenizer has {V} tokens but 'token_embd.weight' has {V + 5} rows",
                                        True),
    "embedding-fewer-rows-than-tokens": ("gemma3",
                                         dict(replace={"token_embd.weight": np.zeros((V - 5, E), np.float32)}),
                                         rf"the tokenizer has {V} tokens but 'token_embd.weight' has {V - 5} rows",
                                         True),
    "output-bias": ("qwen2", dict(extra_tensors={"output.bias": np.zeros(284, np.float32)}),
                    r"output.bias.*not supported", None),
}

_WORKER = """
import llama_cpp


def run(paths):
    out = []
    for p in paths:
        try:
            llama_cpp.Llama(model_path=p, n_ctx=32, verbose=False, n_threads=1)
            out.append(False)
        except Exception:
            out.append(True)
    return out
"""


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, str]:
    d = tmp_path_factory.mktemp("refused")
    return {name: write_tiny(d / f"{name}.gguf", arch, seed=1, **opts) for name, (arch, opts, _, _) in REFUSED.items()}


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "phi3"])
def test_the_unmodified_tiny_model_loads(arch, tmp_path):
    with load_model(write_tiny(tmp_path / "ok.gguf", arch, seed=1), backends=["numpy"], n_ctx=16) as m:
        assert m.eval(m.tokenize("the cat")).shape[1] == m.n_vocab


@pytest.mark.parametrize("name", list(REFUSED))
def test_refused_with_the_reason(files, name):
    path = files[name]
    with pytest.raises(ModelError, match=REFUSED[name][2]) as ei:
        load_model(path, backends=["numpy"], n_ctx=16)
    assert path in str(ei.value)


@pytest.mark.skipif(not llamacpp_peer.available(), reason=llamacpp_peer.NOT_AVAILABLE)
def test_llama_cpp_refuses_the_same_files(files):
    """Where llama.cpp's loader checks the same thing it refuses the file too (True); yarn it runs (we refuse a
    scaling we would compute wrongly: False); None: not compared (llama.cpp asserts or its phi3 loader differs)."""
    names = [n for n, (_, _, _, peer) in REFUSED.items() if peer is not None]
    refused = llamacpp_peer.run(_WORKER, [files[n] for n in names])
    assert dict(zip(names, refused)) == {n: REFUSED[n][3] for n in names}
