"""Sampler: llama.cpp order (logit bias, penalties, top-k, top-p, min-p, temperature, dist), reproducibility,
validation."""

from __future__ import annotations

import numpy as np
import pytest

from ggml_py.errors import GgmlPyError
from ggml_py.models.sampling import Sampler, SamplingError


@pytest.fixture
def logits() -> np.ndarray:
    return np.random.default_rng(0).normal(0, 3, size=1000).astype(np.float32)


def test_greedy_is_argmax(logits):
    s = Sampler(temperature=0.0)
    assert s.sample(logits, []) == int(np.argmax(logits))
    # greedy ignores the other filters and the rng
    s2 = Sampler(temperature=0, top_k=0, top_p=1.0, min_p=0.0, seed=5)
    assert all(s2.sample(logits, []) == int(np.argmax(logits)) for _ in range(5))


def test_same_seed_same_sequence(logits):
    a = Sampler(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, seed=42)
    b = Sampler(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, seed=42)
    c = Sampler(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, seed=43)
    sa = [a.sample(logits, []) for _ in range(50)]
    sb = [b.sample(logits, []) for _ in range(50)]
    sc = [c.sample(logits, []) for _ in range(50)]
    assert sa == sb
    assert sa != sc
    assert len(set(sa)) > 5  # it really samples
    a.reseed()
    assert [a.sample(logits, []) for _ in range(50)] == sa


def test_top_k_1_is_greedy(logits):
    s = Sampler(temperature=1.5, top_k=1, top_p=1.0, min_p=0.0, seed=1)
    assert {s.sample(logits, []) for _ in range(20)} == {int(np.argmax(logits))}


def test_top_k_limits_support(logits):
    s = Sampler(temperature=5.0, top_k=3, top_p=1.0, min_p=0.0, seed=2)
    top3 = set(np.argsort(-logits)[:3].tolist())
    got = {s.sample(logits, []) for _ in range(200)}
    assert got <= top3 and len(got) == 3


def test_small_top_p_is_argmax(logits):
    s = Sampler(temperature=2.0, top_k=0, top_p=1e-6, min_p=0.0, seed=3)
    assert {s.sample(logits, []) for _ in range(20)} == {int(np.argmax(logits))}


def test_top_p_keeps_smallest_set_reaching_p():
    x = np.log(np.array([0.5, 0.3, 0.15, 0.05], dtype=np.float32))
    ids, p = Sampler(temperature=1.0, top_k=0, top_p=0.8, min_p=0.0).candidates(x)
    assert ids.tolist() == [0, 1]  # 0.5 + 0.3 reaches 0.8
    ids, _ = Sampler(temperature=1.0, top_k=0, top_p=0.81, min_p=0.0).candidates(x)
    assert ids.tolist() == [0, 1, 2]
    np.testing.assert_allclose(p, [0.5 / 0.8, 0.3 / 0.8], rtol=1e-6)


def test_min_p_filters():
    x = np.log(np.array([0.4, 0.3, 0.2, 0.06, 0.04], dtype=np.float32))
    ids, _ = Sampler(temperature=1.0, top_k=0, top_p=1.0, min_p=0.2).candidates(x)
    # threshold 0.2 * 0.4 = 0.08: 0.06 and 0.04 go
    assert ids.tolist() == [0, 1, 2]
    s = Sampler(temperature=10.0, top_k=0, top_p=1.0, min_p=0.2, seed=0)
    assert {s.sample(x, []) for _ in range(300)} == {0, 1, 2}


def test_filters_before_temperature():
    # a high temperature flattens the survivors but does not revive filtered tokens (llama.cpp's order)
    x = np.log(np.array([0.4, 0.3, 0.2, 0.06, 0.04], dtype=np.float32))
    ids, p = Sampler(temperature=100.0, top_k=0, top_p=1.0, min_p=0.2).candidates(x)
    assert ids.tolist() == [0, 1, 2]
    assert p.max() - p.min() < 0.01


def test_repeat_penalty_lowers_repeated_token():
    x = np.array([2.0, 1.9, -1.0, -1.1], dtype=np.float32)
    greedy = Sampler(temperature=0, repeat_penalty=1.5)
    assert greedy.sample(x, []) == 0
    assert greedy.sample(x, [0]) == 1  # 2.0 / 1.5 < 1.9
    # negative logits are multiplied: the penalty always makes a token less likely
    x2 = np.array([-1.0, -1.2], dtype=np.float32)
    assert greedy.sample(x2, [0]) == 1
    # the window: only the last repeat_last_n tokens count
    windowed = Sampler(temperature=0, repeat_penalty=1.5, repeat_last_n=2)
    assert windowed.sample(x, [0, 3, 3]) == 0
    assert Sampler(temperature=0, repeat_penalty=1.5, repeat_last_n=-1).sample(x, [0, 3, 3]) == 1
    assert Sampler(temperature=0, repeat_penalty=1.5, repeat_last_n=0).sample(x, [0]) == 0
    # probabilities move the same way when sampling
    ids, p = Sampler(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, repeat_penalty=1.3).candidates(x, [0])
    _, p0 = Sampler(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0).candidates(x, [])
    assert p[ids.tolist().index(0)] < p0[0]


def test_frequency_and_presence_penalties():
    x = np.array([1.0, 0.9], dtype=np.float32)
    assert Sampler(temperature=0, frequency_penalty=0.05).sample(x, [0]) == 0
    assert Sampler(temperature=0, frequency_penalty=0.05).sample(x, [0, 0, 0]) == 1
    assert Sampler(temperature=0, presence_penalty=0.2).sample(x, [0]) == 1


def test_logit_bias_is_added_first(logits):
    """OpenAI's logit_bias: added to the logits before the penalties and filters; the caller's array is untouched."""
    order = np.argsort(logits)[::-1]
    best, tenth = int(order[0]), int(order[9])
    before = logits.copy()
    assert Sampler(temperature=0, logit_bias={tenth: 100}).sample(logits) == tenth
    assert Sampler(temperature=0, logit_bias={best: -100.0}).sample(logits) == int(order[1])
    # a token pulled into the top by its bias survives top_k
    s = Sampler(temperature=1.0, top_k=1, min_p=0.0, logit_bias={int(order[500]): 100}, seed=3)
    assert s.sample(logits) == int(order[500])
    np.testing.assert_array_equal(logits, before)
    assert not Sampler(temperature=0, logit_bias={1: 1.0}).needs_only_top(40)
    with pytest.raises(SamplingError, match="vocabulary has 1000"):
        Sampler(logit_bias={1000: 1.0}).sample(logits)
    for bad in ({-1: 1.0}, {1.5: 1.0}, {1: float("nan")}, {1: "x"}):
        with pytest.raises(SamplingError, match="logit_bias"):
            Sampler(logit_bias=bad)


def test_input_not_modified_and_dtypes(logits):
    before = logits.copy()
    Sampler(seed=1, repeat_penalty=1.2).sample(logits, [1, 2, 3])
    np.testing.assert_array_equal(logits, before)
    assert isinstance(Sampler(seed=1).sample(logits.astype(np.float16), []), int)
    assert isinstance(Sampler(seed=1).sample(logits.astype(np.float64), np.array([1, 2])), int)


def test_masked_logits():
    x = np.full(10, -np.inf, dtype=np.float32)
    x[7] = 0.0
    x[3] = -0.5
    s = Sampler(temperature=1.0, seed=0)
    assert {s.sample(x, []) for _ in range(50)} <= {3, 7}


def test_defaults_sample_reasonably(logits):
    s = Sampler(seed=7)
    top40 = set(np.argsort(-logits)[:40].tolist())
    assert all(s.sample(logits, []) in top40 for _ in range(100))


@pytest.mark.parametrize(
    "kwargs",
    [
        {"temperature": -0.1},
        {"temperature": float("nan")},
        {"top_p": 0.0},
        {"top_p": 1.01},
        {"top_p": -0.5},
        {"top_k": -1},
        {"top_k": 2.5},
        {"min_p": -0.01},
        {"min_p": 1.5},
        {"repeat_penalty": 0.0},
        {"repeat_penalty": -1.0},
        {"repeat_last_n": -2},
        {"seed": -1},
        {"seed": "x"},
    ],
)
def test_bad_values_raise(kwargs):
    with pytest.raises(SamplingError) as ei:
        Sampler(**kwargs)
    assert isinstance(ei.value, ValueError) and isinstance(ei.value, GgmlPyError)


@pytest.mark.parametrize(
    "bad",
    [np.zeros((2, 3), np.float32), np.zeros(0, np.float32), np.array([1, 2, 3]), np.array([np.nan, 1.0])],
)
def test_bad_logits_raise(bad):
    with pytest.raises(SamplingError):
        Sampler(seed=0).sample(bad, [])


# -- sampling from a step's candidates (the graph's TOP_K output) ------------------------------------------------
def _top(x: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """The TOP_K op's contract, written independently: NaN first, then largest first, the lower id on ties."""
    order = sorted(range(x.size), key=lambda i: (not np.isnan(x[i]), -x[i] if not np.isnan(x[i]) else 0.0, i))[:k]
    ids = np.array(order, np.int32)
    return ids, x[ids].astype(np.float32)


@pytest.mark.parametrize("kw", [dict(temperature=0.0), dict(temperature=0.8, top_k=40, top_p=0.95, min_p=0.05),
                                dict(temperature=1.5, top_k=5, top_p=1.0, min_p=0.0),
                                dict(temperature=1.0, top_k=64, top_p=0.5, min_p=0.0),
                                dict(temperature=0.7, top_k=1)])
def test_candidates_give_the_same_draws_as_the_whole_logits(kw):
    """With no penalty and top_k within the candidates, sampling from the best 64 (ids, logits) draws exactly
    the tokens sampling from all logits draws, seed for seed, ties included (logits from a small set of values)."""
    rng = np.random.default_rng(7)
    for trial in range(40):
        x = (rng.integers(-20, 21, 500) / 4).astype(np.float32) if trial % 2 else rng.normal(0, 3, 500).astype(
            np.float32)
        full, cand = Sampler(seed=trial, **kw), Sampler(seed=trial, **kw)
        assert cand.needs_only_top(64)
        ids, vals = _top(x, 64)
        assert [full.sample(x) for _ in range(20)] == [cand.sample_candidates(ids, vals) for _ in range(20)]


def test_candidates_are_refused_when_the_sampler_needs_more():
    assert not Sampler(repeat_penalty=1.1).needs_only_top(64)
    assert not Sampler(frequency_penalty=0.5).needs_only_top(64)
    assert Sampler(repeat_penalty=1.1, repeat_last_n=0).needs_only_top(64)
    assert not Sampler(top_k=0).needs_only_top(64)  # all tokens
    assert not Sampler(top_k=65).needs_only_top(64)
    assert Sampler(top_k=0, temperature=0).needs_only_top(64)


def test_candidates_report_nan_and_infinite_logits():
    x = np.zeros(100, np.float32)
    x[70] = np.nan  # NaN ranks first in TOP_K's order, so the candidates show it
    with pytest.raises(SamplingError, match="NaN"):
        Sampler(seed=0).sample_candidates(*_top(x, 64))
    x[70] = np.inf
    with pytest.raises(SamplingError, match="finite"):
        Sampler(seed=0).sample_candidates(*_top(x, 64))
    with pytest.raises(SamplingError, match="as many"):
        Sampler(seed=0).sample_candidates(np.arange(3), np.zeros(2))
