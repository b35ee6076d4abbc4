"""The sampler against llama.cpp's (llama-cpp-python's llama_sampler_* chain, run on the same logits): the same
surviving tokens with the same probabilities after penalties -> top-k -> top-p -> min-p -> temperature, the same
greedy pick, and draws whose distribution matches those probabilities on both sides (chi-square, fixed seeds).

Individual draws are not compared: llama.cpp draws with std::mt19937 and its own discrete distribution, ggml_py
with numpy's PCG64, so the same seed gives different sequences (docs/testing.md). Skipped with a reason where
llama.cpp is not available (tests/llamacpp_peer.py)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from ggml_py.models.sampling import Sampler

import llamacpp_peer

pytestmark = pytest.mark.skipif(not llamacpp_peer.available(), reason=llamacpp_peer.NOT_AVAILABLE)

WORKER = """
import ctypes
import numpy as np
import llama_cpp as L


def _array(logits):
    n = len(logits)
    data = (L.llama_token_data * n)()
    for i, x in enumerate(logits):
        data[i].id, data[i].logit, data[i].p = i, float(x), 0.0
    return data


def _chain(cfg, history, n_vocab, with_dist, seed):
    chain = L.llama_sampler_chain_init(L.llama_sampler_chain_default_params())
    n = cfg.get("repeat_last_n", 64)
    n = len(history) if n == -1 else n
    # the binding passes (n_vocab, last_n, ...) where llama.h now takes (last_n, ...): the same value in both ints
    L.llama_sampler_chain_add(chain, L.llama_sampler_init_penalties(n, n, cfg.get("repeat_penalty", 1.0),
                                                                    cfg.get("frequency_penalty", 0.0),
                                                                    cfg.get("presence_penalty", 0.0)))
    t = cfg.get("temperature", 0.8)
    if t <= 0:
        L.llama_sampler_chain_add(chain, L.llama_sampler_init_greedy())
    else:
        L.llama_sampler_chain_add(chain, L.llama_sampler_init_top_k(cfg.get("top_k", 40)))
        L.llama_sampler_chain_add(chain, L.llama_sampler_init_top_p(cfg.get("top_p", 0.95), 1))
        L.llama_sampler_chain_add(chain, L.llama_sampler_init_min_p(cfg.get("min_p", 0.05), 1))
        L.llama_sampler_chain_add(chain, L.llama_sampler_init_temp(t))
        if with_dist:
            L.llama_sampler_chain_add(chain, L.llama_sampler_init_dist(seed))
    for tok in history:
        L.llama_sampler_accept(chain, tok)
    return chain


def run(logits, cfgs, history, n_draws, seed):
    return {k: one(logits, c, history, n_draws, seed) for k, c in cfgs.items()}


def one(logits, cfg, history, n_draws, seed):
    # the chain's survivors (ids, logits after it, without the draw), then n_draws draws with `seed`
    n = len(logits)
    chain = _chain(cfg, history, n, False, seed)
    data = _array(logits)
    arr = L.llama_token_data_array(data=ctypes.cast(data, L.llama_token_data_p), size=n, selected=-1, sorted=False)
    L.llama_sampler_apply(chain, ctypes.byref(arr))
    surv = [(arr.data[i].id, arr.data[i].logit) for i in range(arr.size)]
    selected = arr.data[arr.selected].id if arr.selected >= 0 else None
    L.llama_sampler_free(chain)
    draws = []
    if n_draws:
        chain = _chain(cfg, history, n, True, seed)
        template = _array(logits)
        work = (L.llama_token_data * n)()
        size = ctypes.sizeof(template)
        for _ in range(n_draws):
            ctypes.memmove(work, template, size)
            arr = L.llama_token_data_array(data=ctypes.cast(work, L.llama_token_data_p), size=n, selected=-1,
                                           sorted=False)
            L.llama_sampler_apply(chain, ctypes.byref(arr))
            draws.append(int(arr.data[arr.selected].id))
        L.llama_sampler_free(chain)
    return {"ids": [int(i) for i, _ in surv], "logits": [float(x) for _, x in surv], "selected": selected,
            "draws": draws}
"""

N_VOCAB = 200
N_DRAWS = 4000
LOGITS = np.random.default_rng(7).normal(0.0, 2.5, N_VOCAB).astype(np.float32)
TOP = np.argsort(-LOGITS).tolist()
# the five most likely tokens, some of them several times (frequency penalty), and two unlikely ones
HISTORY = [TOP[0], TOP[1], 17, TOP[0], TOP[3], 99, TOP[0], TOP[2], TOP[1], 42]

FLAT = dict(top_k=0, top_p=1.0, min_p=0.0)
CONFIGS = {
    "temp_1": dict(temperature=1.0, **FLAT),
    "temp_0.5": dict(temperature=0.5, **FLAT),
    "temp_2": dict(temperature=2.0, **FLAT),
    "top_k_10": dict(temperature=1.0, top_k=10, top_p=1.0, min_p=0.0),
    "top_p_0.8": dict(temperature=1.0, top_k=0, top_p=0.8, min_p=0.0),
    "top_p_0.5_temp_1.7": dict(temperature=1.7, top_k=0, top_p=0.5, min_p=0.0),
    "min_p_0.1": dict(temperature=1.0, top_k=0, top_p=1.0, min_p=0.1),
    "repeat_penalty_last_4": dict(temperature=1.0, repeat_penalty=1.5, repeat_last_n=4, **FLAT),
    "repeat_penalty_all": dict(temperature=1.0, repeat_penalty=1.3, repeat_last_n=-1, **FLAT),
    "freq_presence": dict(temperature=1.0, repeat_penalty=1.1, frequency_penalty=0.4, presence_penalty=0.6,
                          repeat_last_n=64, **FLAT),
    "defaults": dict(),  # Sampler's: temperature 0.8, top_k 40, top_p 0.95, min_p 0.05
    "everything": dict(temperature=1.4, top_k=30, top_p=0.9, min_p=0.02, repeat_penalty=1.2, frequency_penalty=0.1,
                       presence_penalty=0.2, repeat_last_n=6),
}


def _full(s: Sampler) -> dict:
    return {k: getattr(s, k) for k in ("temperature", "top_k", "top_p", "min_p", "repeat_penalty", "repeat_last_n",
                                       "frequency_penalty", "presence_penalty")}


def _softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - x.max())
    return e / e.sum()


def chi2_critical(df: int, z: float = 3.719) -> float:
    """Upper chi-square quantile (Wilson-Hilferty); z = 3.719 is p = 1e-4."""
    h = 2.0 / (9.0 * df)
    return df * (1.0 - h + z * math.sqrt(h)) ** 3


def chi2(draws: list[int], ids: np.ndarray, probs: np.ndarray) -> tuple[float, float]:
    """(statistic, critical value) of `draws` against the distribution (ids, probs); bins expected < 5 pooled."""
    n = len(draws)
    index = {int(t): i for i, t in enumerate(ids)}
    assert all(d in index for d in draws), f"drew tokens outside the candidates: {set(draws) - set(index)}"
    obs = np.bincount([index[d] for d in draws], minlength=len(ids)).astype(float)
    exp = probs * n
    big = exp >= 5
    o = np.append(obs[big], obs[~big].sum())
    e = np.append(exp[big], exp[~big].sum())
    keep = e > 0
    o, e = o[keep], e[keep]
    df = max(1, len(e) - 1)
    return float(((o - e) ** 2 / e).sum()), chi2_critical(df)


@pytest.fixture(scope="module")
def peer() -> dict[str, dict]:
    """llama.cpp's chain on every config, in one worker run."""
    cfgs = {k: _full(Sampler(**c)) for k, c in CONFIGS.items()}
    return llamacpp_peer.run(WORKER, LOGITS.tolist(), cfgs, HISTORY, N_DRAWS, 1234)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_candidates_match_llama_cpp(peer, name):
    ref = peer[name]
    ids, p = Sampler(**CONFIGS[name]).candidates(LOGITS, HISTORY)
    assert sorted(ids.tolist()) == sorted(ref["ids"]), f"{name}: the surviving tokens differ"
    ref_p = dict(zip(ref["ids"], _softmax(np.array(ref["logits"], np.float64))))
    np.testing.assert_allclose(p, [ref_p[int(i)] for i in ids], rtol=2e-5, atol=1e-9, err_msg=name)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_draws_follow_the_distribution_on_both_sides(peer, name):
    s = Sampler(seed=1234, **CONFIGS[name])
    ids, p = s.candidates(LOGITS, HISTORY)
    ours = [s.sample(LOGITS, HISTORY) for _ in range(N_DRAWS)]
    theirs = peer[name]["draws"]
    for who, draws in (("ggml_py", ours), ("llama.cpp", theirs)):
        stat, crit = chi2(draws, ids, p)
        assert stat < crit, f"{name}: {who}'s draws do not follow the candidates' probabilities " \
                            f"(chi2 {stat:.1f} >= {crit:.1f})"
    # both sides put the same share of draws on the most likely token (4000 draws: a few standard errors)
    top = int(ids[0])
    sd = math.sqrt(p[0] * (1 - p[0]) / N_DRAWS)
    share = [np.mean(np.array(d) == top) for d in (ours, theirs)]
    assert abs(share[0] - share[1]) < 6 * sd + 1e-9, (name, share, float(p[0]))


@pytest.mark.parametrize("penalty", [1.0, 1.5, 3.0])
def test_greedy_matches_llama_cpp(penalty):
    cfg = dict(temperature=0.0, repeat_penalty=penalty, repeat_last_n=-1)
    ref = llamacpp_peer.run(WORKER, LOGITS.tolist(), {"g": _full(Sampler(**cfg))}, HISTORY, 0, 0)["g"]
    assert Sampler(**cfg).sample(LOGITS, HISTORY) == ref["selected"]
    if penalty == 3.0:  # the penalty changes the pick: the comparison covers it
        assert ref["selected"] != TOP[0]
