"""The dense families that are declarative specs with options of their own (granite's muP scales and rope switch,
olmo2's post-norms, full-width q/k norms and sliding window, smollm3's rope-less layers) against llama.cpp on tiny
random files (tests/arch_factory.py): 320 positions of the prompt logits on a 512-token context, judged by KL and
top-1 (llamacpp_peer.kl_top1) on every backend, for F32 files and Q4_K / Q8_0 copies.

Each case also runs its spec with the option it exercises switched off: the logits must then be far from
llama.cpp's, so the comparison above would catch a graph that ignores the option."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Any

import numpy as np
import pytest
from arch_factory import write_tiny
from gguf import GGMLQuantizationType as QT

from ggml_py import load_model
from ggml_py.errors import ModelError
from ggml_py.ir import ops
from ggml_py.ir.tensor import Tensor
from ggml_py.models.blocks import StepBuilder
from ggml_py.models.families import architectures
from ggml_py.models.specs import DENSE, MupScales

import llamacpp_peer
from conftest import available_backends
from model_factory import nmse

pytestmark = pytest.mark.skipif(not llamacpp_peer.available(), reason=llamacpp_peer.NOT_AVAILABLE)

BACKENDS = available_backends()
N_POS = 320
N_CTX = 512
MAX_KL = 1e-4  # F32 files: mean KL(llama.cpp || ours)
# quantized copies: the prompt-logits NMSE bound of the dense types (test_architectures.WEIGHTS), and top-1 on most
# rows where llama.cpp is clear (both round activations to 8 bits their own way)
QUANT_NMSE = 5e-3
QUANT_TOP1 = 0.9
OFF_KL = 1e-3  # the family's option switched off: at least ten times the F32 bound away from llama.cpp


def _spec_without(**fields: Any) -> Callable[[pytest.MonkeyPatch, str], None]:
    """Registers the architecture's spec with `fields` replaced (the option switched off)."""
    def patch(mp: pytest.MonkeyPatch, arch: str) -> None:
        spec = next(s for s in DENSE if s.name == arch)
        mp.setitem(architectures(), arch, replace(spec, **fields).architecture())
    return patch


def _per_head_qk_norms(mp: pytest.MonkeyPatch, arch: str) -> None:
    """olmo2's q/k norm weights applied head by head (per-head statistics) instead of over the whole projection."""
    def qk_norm(self: StepBuilder, x: Tensor, w: Tensor) -> Tensor:
        return ops.mul(ops.rms_norm(x, self.hp.rms_eps), ops.reshape(w, x.shape[1:]))
    mp.setattr(StepBuilder, "qk_norm", qk_norm)


_MUP = {"embedding_scale": 3.0, "residual_scale": 0.4, "logit_scale": 0.5}
# name -> (architecture, write_tiny's arguments, what switches the exercised option off)
CASES = {
    # embedding_scale 3, residual_scale 0.4, attention.scale 0.3, logit_scale 0.5 (arch_factory.ARCH_KEYS)
    "granite": ("granite", dict(n_layer=4), _spec_without(mup=None)),
    "olmo2": ("olmo2", dict(n_layer=4), _per_head_qk_norms),
    # Olmo 3 style: layers 0-2 slide over 48 positions, 3 is global; linear rope scaling 2 on the global layer only
    "olmo2-window": ("olmo2", dict(n_layer=4, n_swa=48, rope_scaling=("linear", 2.0)),
                     _spec_without(sliding_window=None)),
    # layer 3 without rope (llama.cpp's fixed step of 4)
    "smollm3": ("smollm3", dict(n_layer=4), _spec_without(no_rope_step=0)),
    # granite's graph; an attention.scale in the file is not minicpm's (llama.cpp reads none)
    "minicpm": ("minicpm", dict(n_layer=4, metadata=_MUP | {"attention.scale": 0.3}), _spec_without(mup=MupScales())),
    # no keys: llama.cpp's defaults, embedding 12, residual 1.4/sqrt(4), logits divided by 256/512
    "minicpm-defaults": ("minicpm", dict(n_layer=4, n_embd=512),
                         _spec_without(mup=MupScales(attention_scale=False, defaults=lambda hp: (1.0, 1.0, 1.0)))),
}
WTYPES = (QT.F32, QT.Q4_K, QT.Q8_0)


def _ours(path: str, backend: str, ids: list[int]) -> np.ndarray:
    with load_model(path, backends=[backend], n_ctx=N_CTX, progress=False) as m:
        return m.eval(ids)


@pytest.fixture(scope="module")
def llama_cpp(tmp_path_factory):
    """(path, ids, llama.cpp's logits) per (case, weight type), written and run once for the module."""
    tmp = tmp_path_factory.mktemp("dense_specs")
    cache: dict[tuple[str, QT], tuple[str, list[int], np.ndarray]] = {}

    def get(case: str, wtype: QT) -> tuple[str, list[int], np.ndarray]:
        if (case, wtype) not in cache:
            arch, kw, _ = CASES[case]
            # untied head: a random tied embedding makes near one-hot softmaxes whose KL says nothing
            path = write_tiny(tmp / f"{case}_{wtype.name}.gguf", arch, seed=11, weight_type=wtype,
                              output_type=wtype, n_ctx_train=N_CTX, **kw)
            with load_model(path, backends=["numpy"], n_ctx=N_CTX, progress=False) as m:
                ids = np.random.default_rng(1).integers(3, m.n_vocab, N_POS).tolist()
            ref = llamacpp_peer.prompt_logits(path, ids, tmp / f"{case}_{wtype.name}.npy", n_ctx=N_CTX)
            cache[case, wtype] = path, ids, ref
        return cache[case, wtype]

    return get


@pytest.mark.parametrize("wtype", WTYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", CASES)
def test_logits_match_llama_cpp(case, backend, wtype, llama_cpp):
    path, ids, ref = llama_cpp(case, wtype)
    ours = _ours(path, backend, ids)
    mean_kl, max_kl, agree, clear = llamacpp_peer.kl_top1(ours, ref)
    what = (f"{case} {wtype.name} on {backend}: mean KL {mean_kl:.2e} (max {max_kl:.2e}), top-1 {agree}/{clear}, "
            f"NMSE {nmse(ours, ref):.2e}")
    print(what)
    assert clear >= N_POS // 4, what  # enough rows where llama.cpp is clear for top-1 to mean something
    if wtype == QT.F32:
        assert mean_kl <= MAX_KL and agree == clear, what
    else:
        assert nmse(ours, ref) <= QUANT_NMSE and agree >= QUANT_TOP1 * clear, what


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("arch", ["internlm2", "ernie4_5", "exaone"])
def test_families_that_are_another_specs_graph(arch, backend, tmp_path):
    """internlm2 and ernie4_5 (llama's graph) and exaone (qwen2's) under their own names, F32 untied."""
    path = write_tiny(tmp_path / f"{arch}.gguf", arch, seed=11, n_layer=4, output_type=QT.F32, n_ctx_train=N_CTX)
    ids = np.random.default_rng(1).integers(3, 280, N_POS).tolist()
    ref = llamacpp_peer.prompt_logits(path, ids, tmp_path / "ref.npy", n_ctx=N_CTX)
    mean_kl, max_kl, agree, clear = llamacpp_peer.kl_top1(_ours(path, backend, ids), ref)
    what = f"{arch} on {backend}: mean KL {mean_kl:.2e} (max {max_kl:.2e}), top-1 {agree}/{clear}"
    print(what)
    assert mean_kl <= MAX_KL and agree == clear and clear >= N_POS // 4, what


@pytest.mark.parametrize("case", CASES)
def test_the_option_matters(case, llama_cpp, monkeypatch):
    """The case's option switched off puts the logits far from llama.cpp's: the test above can fail."""
    arch, _, switch_off = CASES[case]
    path, ids, ref = llama_cpp(case, QT.F32)
    switch_off(monkeypatch, arch)
    mean_kl, *_ = llamacpp_peer.kl_top1(_ours(path, "numpy", ids), ref)
    print(f"{case} with its option off: mean KL {mean_kl:.2e}")
    assert mean_kl > OFF_KL, f"{case} with its option off: mean KL {mean_kl:.2e}"


def test_granite_without_rope_is_refused(tmp_path):
    """llama.cpp's granite reads rope.scaling.finetuned false as "no rope in any layer"; refused here."""
    path = write_tiny(tmp_path / "g.gguf", "granite", metadata={"rope.scaling.finetuned": False})
    with pytest.raises(ModelError, match=r"granite\.rope\.scaling\.finetuned false .*not supported"):
        load_model(path, backends=["numpy"], progress=False)


def test_hyper_parameters_as_read(llama_cpp):
    """What the specs read from the cases' files."""
    def hp(case: str):
        with load_model(llama_cpp(case, QT.F32)[0], backends=["numpy"], progress=False) as m:
            return m.hparams

    g = hp("granite")
    assert (g.embd_scale, g.residual_scale, g.attn_scale, g.logit_scale) == pytest.approx((3.0, 0.4, 0.3, 2.0))
    assert all(g.uses_rope(i) for i in range(4))
    assert [hp("smollm3").uses_rope(i) for i in range(4)] == [True, True, True, False]
    m = hp("minicpm")
    assert (m.embd_scale, m.residual_scale, m.attn_scale, m.logit_scale) == pytest.approx((3.0, 0.4, 0.125, 2.0))
    d = hp("minicpm-defaults")
    assert (d.embd_scale, d.residual_scale, d.logit_scale) == pytest.approx((12.0, 0.7, 2.0))
    w = hp("olmo2-window")
    assert [w.is_swa(i) for i in range(4)] == [True, True, True, False] and w.n_swa == 48
    assert [w.rope(i) for i in (0, 3)] == [(10000.0, 1.0), (10000.0, 0.5)]
