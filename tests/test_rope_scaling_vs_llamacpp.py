"""Rope scalings against llama.cpp on tiny random GGUF files (tests/arch_factory.py), 400 positions of which 336 lie
past the original context of 64: Llama 3.1-3.3's frequency factors (`rope_freqs.weight`, computed by the "llama3"
formula of llama.cpp's convert_hf_to_gguf.py) at factors 8 and 32, and YaRN on qwen2 (`rope.scaling.type = yarn`,
factor 4, `original_context_length` 64). Judged as llama-perplexity judges a quantization, on the positions past the
original context: the mean KL(llama.cpp || ours) and the top-1 token wherever llama.cpp's best two logits are at
least llamacpp_peer.NEAR_TIE apart, on every backend. Without the scaling the logits move far beyond the bound, so
the comparison shows the scaling is computed, not only carried."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
from arch_factory import write_tiny
from gguf import GGMLQuantizationType as QT

from ggml_py import load_model
from ggml_py.commands.info import describe

import llamacpp_peer
from conftest import available_backends
from model_factory import nmse, tiny_vocab

pytestmark = pytest.mark.skipif(not llamacpp_peer.available(), reason=llamacpp_peer.NOT_AVAILABLE)

BACKENDS = available_backends()
N_POS, N_CTX_ORIG, N_CTX = 400, 64, 512
HEAD_DIM, LLAMA3_BASE = 64, 500000.0


def llama3_factors(factor: float, old_ctx: int, low: float = 1.0, high: float = 4.0) -> np.ndarray:
    """Llama 3's rope factors per rotated pair, as the converter writes them: 1 for wavelengths shorter than
    old_ctx / high, `factor` for those longer than old_ctx / low, and in between a smooth blend of the two."""
    out = []
    for i in range(0, HEAD_DIM, 2):
        wavelen = 2 * math.pi * LLAMA3_BASE ** (i / HEAD_DIM)
        smooth = min(1.0, max(0.0, (old_ctx / wavelen - low) / (high - low)))
        out.append(1.0 / ((1 - smooth) / factor + smooth))
    return np.array(out, np.float32)


# name -> (architecture, write_tiny options of the scaling, options that stay without it)
SCALINGS = {
    "llama3-factor-8": ("llama", dict(extra_tensors={"rope_freqs.weight": llama3_factors(8.0, N_CTX_ORIG)}),
                        dict(rope_base=LLAMA3_BASE)),
    "llama3-factor-32": ("llama", dict(extra_tensors={"rope_freqs.weight": llama3_factors(32.0, N_CTX_ORIG)}),
                         dict(rope_base=LLAMA3_BASE)),
    "qwen2-yarn-4": ("qwen2", dict(rope_scaling=("yarn", 4.0),
                                   metadata={"rope.scaling.original_context_length": N_CTX_ORIG}),
                     dict(rope_base=1e6)),
}
# Mean KL over the positions past the original context. F32, measured: 2.3e-9 (llama3, both factors), 4.7e-9 (YaRN)
# on numpy and simd, top-1 all agree. Q8_0 5.0e-5..6.0e-5, Q4_K 1.0e-4..1.2e-4 (llama.cpp rounds the activations of
# quantized products to 8 bits): bounded with the quantized types' logit NMSE of test_architectures.py (5e-3; measured
# 1.0e-4..2.3e-4) and a KL 8x above the measured.
MAX_KL = {QT.F32: 1e-4, QT.Q8_0: 1e-3, QT.Q4_K: 1e-3}
MAX_NMSE = {QT.F32: 5e-4, QT.Q8_0: 5e-3, QT.Q4_K: 5e-3}
# without the scaling, measured mean KL 9.2e-3 (llama3-8), 1.0e-2 (llama3-32), 1.6e-2 (YaRN)
MIN_EFFECT = 10 * MAX_KL[QT.F32]


def _ids() -> list[int]:
    n_specials = 3  # tiny_vocab's control tokens come first
    rng = np.random.default_rng(11)
    return [int(t) for t in rng.integers(n_specials, len(tiny_vocab()[0]), N_POS)]


def _write(tmp_path: Path, name: str, wtype: QT, scaled: bool = True) -> str:
    """The file of scaling `name` with `wtype` weights, an untied head of the same type (a random tied embedding
    makes a one-hot softmax, whose KL says nothing) and a training context that allows N_POS positions."""
    arch, scaling, common = SCALINGS[name]
    return write_tiny(tmp_path / f"{name}-{wtype.name}{'' if scaled else '-plain'}.gguf", arch, seed=7,
                      weight_type=wtype, embd_type=wtype, output_type=wtype, n_ctx_train=N_CTX, **common,
                      **(scaling if scaled else {}))


def _ours(path: str, backend: str, ids: list[int]) -> np.ndarray:
    with load_model(path, backends=[backend], n_ctx=N_CTX, progress=False) as m:
        return m.eval(ids)


def _check(path: str, wtype: QT, tmp_path: Path) -> dict[str, np.ndarray]:
    """Our logits on every backend against llama.cpp's, past the original context; returns them by backend."""
    ids = _ids()
    ref = llamacpp_peer.prompt_logits(path, ids, tmp_path / "llama_cpp.npy", n_ctx=N_CTX)[N_CTX_ORIG:]
    out = {}
    for b in BACKENDS:
        out[b] = ours = _ours(path, b, ids)[N_CTX_ORIG:]
        kl, kl_max, agree, counted = llamacpp_peer.kl_top1(ours, ref)
        what = f"{Path(path).name} on {b}: mean KL {kl:.2e} (max {kl_max:.2e}), top-1 {agree}/{counted}"
        assert kl <= MAX_KL[wtype], what
        assert agree == counted >= N_POS // 4, what
        assert nmse(ours, ref) <= MAX_NMSE[wtype], f"{what}, NMSE {nmse(ours, ref):.2e}"
    return out


@pytest.mark.parametrize("name", list(SCALINGS))
def test_f32_logits_past_the_original_context_match_llama_cpp(name, tmp_path):
    path = _write(tmp_path, name, QT.F32)
    ours = _check(path, QT.F32, tmp_path)
    ref = np.load(tmp_path / "llama_cpp.npy")[N_CTX_ORIG:]
    without = _ours(_write(tmp_path, name, QT.F32, scaled=False), BACKENDS[0], _ids())[N_CTX_ORIG:]
    kl = llamacpp_peer.kl_top1(without, ref)[0]
    assert kl > MIN_EFFECT, f"{name}: the same weights without the scaling are only KL {kl:.2e} from llama.cpp"
    assert llamacpp_peer.kl_top1(ours[BACKENDS[0]], without)[0] > MIN_EFFECT


@pytest.mark.parametrize("wtype", [QT.Q8_0, QT.Q4_K], ids=lambda t: t.name)
@pytest.mark.parametrize("name", list(SCALINGS))
def test_quantized_copies_match_llama_cpp(name, wtype, tmp_path):
    _check(_write(tmp_path, name, wtype), wtype, tmp_path)


def test_the_scalings_reach_the_rope_nodes(tmp_path):
    """What the loader makes of the files (and `ggml-py info` shows): llama 3's factors as one weight shared by every
    layer's q and k rope; YaRN's parameters as llama.cpp derives them (attn_factor: its gain 1 + 0.1 ln 4 divided by
    the same gain, which the kernel applies itself, so 1 in float32)."""
    llama3, yarn = _write(tmp_path, "llama3-factor-8", QT.F32), _write(tmp_path, "qwen2-yarn-4", QT.F32)
    assert describe(llama3)["rope_freqs"] and describe(yarn)["hparams"]["rope_yarn"]["n_ctx_orig"] == N_CTX_ORIG
    with load_model(llama3, backends=["numpy"], n_ctx=N_CTX, progress=False) as m:
        ff = m.weights.rope_freqs
        assert ff is not None and ff.shape == (HEAD_DIM // 2,)
        np.testing.assert_array_equal(np.asarray(ff.data), llama3_factors(8.0, N_CTX_ORIG))
        assert m.hparams.rope_freq_scale == 1.0 and m.hparams.rope_yarn.ext_factor == 0.0
    with load_model(yarn, backends=["numpy"], n_ctx=N_CTX, progress=False) as m:
        assert m.weights.rope_freqs is None and m.hparams.rope_freq_scale == 0.25
        y = m.hparams.rope_yarn
        assert (y.ext_factor, y.attn_factor, y.beta_fast, y.beta_slow, y.n_ctx_orig) == (1.0, 1.0, 32.0, 1.0, 64)
