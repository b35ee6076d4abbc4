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
    "rope-scaling-longrope": ("phi3", dict(rope_scaling=("longrope", 4.0)),
                              r"rope scaling type 'longrope' is not supported", None),
    "rope-scaling-unknown": ("qwen2", dict(metadata={"rope.scaling.type": "ntk"}),
                             r"rope scaling type 'ntk' is not supported", None),
    # llama 3's frequency factors: one per rotated pair (32 here), F32 (ggml's rope asserts F32 when it computes)
    "rope-freqs-wrong-length": ("llama", dict(extra_tensors={"rope_freqs.weight": np.ones(D, np.float32)}),
                                r"tensor 'rope_freqs.weight' has shape \[64\], expected \[32\]", True),
    "rope-freqs-f16": ("llama", dict(extra_tensors={"rope_freqs.weight": np.ones(D // 2, np.float16)}),
                       r"tensor 'rope_freqs.weight' has type F16", None),
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
    # every division by a hyper-parameter is guarded: a ModelError naming the key, not a ZeroDivisionError
    "gemma3-62-layers-narrower-than-heads": ("gemma3", dict(head_dim=128, metadata={"block_count": 62,
                                                                                    "embedding_length": 2}),
                                             r"embedding_length 2 is smaller than attention.head_count 4", None),
    "rope-scaling-factor-tiny": ("llama", dict(rope_scaling=("linear", 1e-39)),
                                 r"rope scaling factor \S+ is too small to divide by", False),
    "softcap-tiny": ("gemma3", dict(final_softcap=1e-39), r"final_logit_softcapping \S+ is too small to divide by",
                     None),
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


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "phi3", "granite", "olmo2", "smollm3", "minicpm"])
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
    """Where llama.cpp's loader checks the same thing it refuses the file too (True); a tiny factor it runs (we refuse
    what we cannot divide by: False); None: not compared (llama.cpp asserts, at load or when it computes, or its phi3
    loader differs)."""
    names = [n for n, (_, _, _, peer) in REFUSED.items() if peer is not None]
    refused = llamacpp_peer.run(_WORKER, [files[n] for n in names])
    assert dict(zip(names, refused)) == {n: REFUSED[n][3] for n in names}


# -- metadata arrays ------------------------------------------------------------------------------------------------
# GGUF arrays arrive as read-only numpy arrays of the file's element type (strings and nested arrays as lists):
# every key models/ reads must take such a value as a value (a per-layer array, a pattern) or refuse it with
# ModelError, never with numpy's "truth value of an array is ambiguous" or a TypeError.
def _ro(a: np.ndarray) -> np.ndarray:
    a.flags.writeable = False
    return a


ARRAYS = {
    "bool": _ro(np.array([True, False])),
    "int8": _ro(np.array([2, 2], np.int8)),
    "uint16-varying": _ro(np.array([2, 1], np.uint16)),
    "int64": _ro(np.array([8, 8], np.int64)),
    "uint64": _ro(np.array([1, 0], np.uint64)),
    "float32": _ro(np.array([1.0, 0.5], np.float32)),
    "float64-uniform": _ro(np.array([2.0, 2.0], np.float64)),
    "empty": _ro(np.zeros(0, np.int32)),
    "nested": [_ro(np.array([1, 2], np.int32)), _ro(np.array([1], np.int32))],
    "strings": ["a", "b"],
}
# every key models/ reads from a file: the core keys, the optional ones, the tokenizer's
ARCH_KEYS = ("context_length", "embedding_length", "block_count", "feed_forward_length", "attention.head_count",
             "attention.head_count_kv", "attention.key_length", "attention.value_length",
             "attention.layer_norm_rms_epsilon", "rope.freq_base", "rope.dimension_count", "rope.scaling.type",
             "rope.scaling.factor", "rope.scale_linear", "rope.scaling.original_context_length",
             "rope.scaling.attn_factor", "attention.sliding_window",
             "attention.sliding_window_pattern", "rope.freq_base_swa", "final_logit_softcapping")
TOKENIZER_KEYS = ("tokenizer.ggml.model", "tokenizer.ggml.pre", "tokenizer.ggml.tokens", "tokenizer.ggml.scores",
                  "tokenizer.ggml.token_type", "tokenizer.ggml.merges", "tokenizer.ggml.bos_token_id",
                  "tokenizer.ggml.eos_token_id", "tokenizer.ggml.add_bos_token", "tokenizer.ggml.add_space_prefix",
                  "tokenizer.ggml.fim_pad_token_id", "tokenizer.chat_template", "general.name")


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_array_values_of_every_key_are_read_or_refused_with_model_error(arch, tmp_path):
    from ggml_py.formats.gguf import open_gguf
    from ggml_py.models import get_architecture
    from ggml_py.models.tokenizer import Tokenizer

    path = write_tiny(tmp_path / "t.gguf", arch, seed=1, n_swa=8 if arch == "gemma3" else 0)
    with open_gguf(path) as gf:
        meta = dict(gf.metadata)
    a = get_architecture(arch, path)
    outcomes = {}
    for key in (*(f"{arch}.{k}" for k in ARCH_KEYS), *TOKENIZER_KEYS):
        for name, value in ARRAYS.items():
            m = {**meta, key: value}
            try:
                a.hparams(m, path, V)
                Tokenizer.from_metadata(m)
                outcomes[key, name] = "read"
            except ModelError:
                outcomes[key, name] = "refused"
            except Exception as e:  # noqa: BLE001 - the point: nothing but ModelError
                outcomes[key, name] = f"{type(e).__name__}: {e}"
    bad = {k: v for k, v in outcomes.items() if v not in ("read", "refused")}
    assert not bad, "\n".join(f"{k}: {v[:100]}" for k, v in bad.items())
    # uniform integer arrays of any width are per-layer values; a pattern takes booleans and integers
    assert outcomes[f"{arch}.attention.head_count_kv", "int64"] == "refused"  # 8 is no divisor of 4 heads
    assert outcomes[f"{arch}.context_length", "int8"] == outcomes[f"{arch}.context_length", "int64"] == "read"
    assert outcomes[f"{arch}.block_count", "uint16-varying"] == "refused"
    if arch == "gemma3":
        for name in ("bool", "uint64", "int8"):
            assert outcomes["gemma3.attention.sliding_window_pattern", name] == "read", name
        for name in ("float32", "nested", "strings", "empty"):  # llama.cpp refuses a float array too
            assert outcomes["gemma3.attention.sliding_window_pattern", name] == "refused", name


# numbers a hostile file may hold in any key models/ reads (0, the extremes of uint32 and float32, 62 layers: the
# gemma3 27B layout divides by embedding_length // head_count)
HOSTILE_NUMBERS = (0, 1, 2, 3, 62, 2**32 - 1, -1, 1e-39, 1e-45, 3.4e38, float("nan"), float("inf"), -0.0)


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_hostile_numbers_in_every_key_are_read_or_refused_with_model_error(arch, tmp_path):
    from ggml_py.formats.gguf import open_gguf
    from ggml_py.models import get_architecture

    path = write_tiny(tmp_path / "t.gguf", arch, seed=1, n_swa=8 if arch == "gemma3" else 0)
    with open_gguf(path) as gf:
        meta = dict(gf.metadata)
    a = get_architecture(arch, path)
    bad = {}
    for key in (f"{arch}.{k}" for k in ARCH_KEYS):
        for value in HOSTILE_NUMBERS:
            for extra in ({}, {f"{arch}.block_count": 62}):  # alone, and with the 27B layout
                try:
                    a.hparams({**meta, **extra, key: value}, path, V)
                except ModelError:
                    pass
                except Exception as e:  # noqa: BLE001 - the point: nothing but ModelError
                    bad[key, value, bool(extra)] = f"{type(e).__name__}: {e}"
    assert not bad, "\n".join(f"{k}: {v[:100]}" for k, v in bad.items())
