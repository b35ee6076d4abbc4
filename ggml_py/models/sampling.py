"""Token sampling in llama.cpp's default order: logit bias -> penalties -> top-k -> top-p -> min-p -> temperature ->
dist.

The filters act on the logits before temperature (as llama.cpp's default chain does), so temperature changes how
the surviving tokens are weighted, not which tokens survive. ``temperature == 0`` is greedy argmax (after the
penalties). Random draws come from a ``numpy.random.Generator`` seeded with ``seed``: the same seed and the same
logits give the same sequence (the numbers differ from llama.cpp's, which uses ``std::mt19937``).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import numpy as np

from ggml_py.errors import GgmlPyError

__all__ = ["Sampler", "SamplingError"]


class SamplingError(GgmlPyError, ValueError):
    """Bad sampler parameters or logits."""


def _finite(name: str, value: float) -> float:
    try:
        v = float(value)
    except (TypeError, ValueError):
        raise SamplingError(f"{name} must be a number, got {value!r}") from None
    if not math.isfinite(v):
        raise SamplingError(f"{name} must be finite, got {value!r}")
    return v


def _int(name: str, value: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int | np.integer):
        raise SamplingError(f"{name} must be an integer, got {value!r}")
    return int(value)


class Sampler:
    """Samples one token id from a logits vector.

    - ``temperature``: 0 = greedy; > 0 divides the logits (after filtering).
    - ``top_k``: keep the k most likely tokens; 0 disables.
    - ``top_p``: keep the smallest most-likely set whose probability reaches p, in (0, 1]; 1 disables.
    - ``min_p``: drop tokens less likely than ``min_p`` times the most likely one, in [0, 1]; 0 disables.
    - ``repeat_penalty``: in [1e-6, 1e6]; tokens among the last ``repeat_last_n`` of ``history`` get their logit
      divided by it (multiplied when negative); 1 disables. ``repeat_last_n``: 0 disables, -1 means the whole history.
    - ``frequency_penalty``/``presence_penalty``: subtracted per occurrence / once, over the same window.
    - ``seed``: int >= 0 for reproducible draws, None for fresh entropy.
    - ``logit_bias``: ``{token id: bias}`` added to those tokens' logits before everything else (OpenAI's
      ``logit_bias``; the caller bounds the values, the ids must be within the logits).
    """

    def __init__(
        self,
        temperature: float = 0.8,
        top_k: int = 40,
        top_p: float = 0.95,
        min_p: float = 0.05,
        repeat_penalty: float = 1.0,
        repeat_last_n: int = 64,
        seed: int | None = None,
        frequency_penalty: float = 0.0,
        presence_penalty: float = 0.0,
        logit_bias: Mapping[int, float] | None = None,
    ) -> None:
        self.temperature = _finite("temperature", temperature)
        if self.temperature < 0:
            raise SamplingError(f"temperature must be >= 0, got {temperature}")
        self.top_k = _int("top_k", top_k)
        if self.top_k < 0:
            raise SamplingError(f"top_k must be >= 0 (0 disables it), got {top_k}")
        self.top_p = _finite("top_p", top_p)
        if not 0.0 < self.top_p <= 1.0:
            raise SamplingError(f"top_p must be in (0, 1], got {top_p}")
        self.min_p = _finite("min_p", min_p)
        if not 0.0 <= self.min_p <= 1.0:
            raise SamplingError(f"min_p must be in [0, 1], got {min_p}")
        self.repeat_penalty = _finite("repeat_penalty", repeat_penalty)
        # beyond these the effect has long saturated (a penalised logit is 1e6x larger or smaller than the rest),
        # and near the ends of the float range dividing by it overflows to inf (NaN probabilities)
        if not 1e-6 <= self.repeat_penalty <= 1e6:
            raise SamplingError(f"repeat_penalty must be in [1e-6, 1e6] (1 disables it), got {repeat_penalty}")
        self.repeat_last_n = _int("repeat_last_n", repeat_last_n)
        if self.repeat_last_n < -1:
            raise SamplingError(f"repeat_last_n must be >= -1 (-1 = whole history), got {repeat_last_n}")
        self.frequency_penalty = _finite("frequency_penalty", frequency_penalty)
        self.presence_penalty = _finite("presence_penalty", presence_penalty)
        if seed is not None:
            seed = _int("seed", seed)
            if seed < 0:
                raise SamplingError(f"seed must be >= 0 or None, got {seed}")
        self.seed = seed
        self._rng = np.random.default_rng(seed)
        self.logit_bias = dict(logit_bias or {})
        for k, v in self.logit_bias.items():
            if _int("logit_bias token id", k) < 0:
                raise SamplingError(f"logit_bias token ids must be >= 0, got {k}")
            _finite(f"logit_bias[{k}]", v)
        self._bias_ids = np.fromiter(self.logit_bias, dtype=np.int64, count=len(self.logit_bias))
        self._bias = np.fromiter(self.logit_bias.values(), dtype=np.float64, count=len(self.logit_bias))

    def reseed(self, seed: int | None = None) -> None:
        """Restart the random stream (from ``seed``, or from the constructor's seed when None)."""
        self._rng = np.random.default_rng(self.seed if seed is None else seed)

    def __repr__(self) -> str:
        return (
            f"Sampler(temperature={self.temperature}, top_k={self.top_k}, top_p={self.top_p}, min_p={self.min_p}, "
            f"repeat_penalty={self.repeat_penalty}, repeat_last_n={self.repeat_last_n}, seed={self.seed})"
        )

    # -- steps ----------------------------------------------------------------------------------------------------

    def _add_bias(self, x: np.ndarray) -> np.ndarray:
        if self._bias_ids.size == 0:
            return x
        if int(self._bias_ids.max()) >= x.shape[0]:
            raise SamplingError(f"logit_bias names token {int(self._bias_ids.max())}; the vocabulary has "
                                f"{x.shape[0]} tokens")
        x[self._bias_ids] += self._bias  # x is the sampler's own float64 copy; the ids are unique
        return x

    def _penalize(self, x: np.ndarray, history: Sequence[int]) -> np.ndarray:
        n = self.repeat_last_n
        if n == 0 or len(history) == 0:
            return x
        if self.repeat_penalty == 1.0 and self.frequency_penalty == 0.0 and self.presence_penalty == 0.0:
            return x
        recent = np.asarray(history if n == -1 else history[-n:], dtype=np.int64).ravel()
        recent = recent[(recent >= 0) & (recent < x.shape[0])]
        if recent.size == 0:
            return x
        ids, counts = np.unique(recent, return_counts=True)
        v = x[ids]
        v = np.where(v <= 0, v * self.repeat_penalty, v / self.repeat_penalty)
        v = v - counts * self.frequency_penalty - self.presence_penalty
        x = x.copy()
        x[ids] = v
        return x

    def candidates(self, logits: np.ndarray, history: Sequence[int] = ()) -> tuple[np.ndarray, np.ndarray]:
        """The surviving token ids (most likely first) and their probabilities after all steps but the draw."""
        x = self._add_bias(self._check_logits(logits))
        x = self._penalize(x, history)
        if self.temperature == 0:
            i = int(np.argmax(x))
            return np.array([i]), np.array([1.0])
        n = x.shape[0]
        if 0 < self.top_k < n:
            # the k largest, the lower index first among equal values at the cut (as the graph's TOP_K op)
            kth = -np.partition(-x, self.top_k - 1)[self.top_k - 1]
            above = np.flatnonzero(x > kth)
            ids = np.concatenate([above, np.flatnonzero(x == kth)[: self.top_k - above.size]])
        else:
            ids = np.arange(n)
        vals = x[ids]
        order = np.lexsort((ids, -vals))  # largest first, the lower id first on ties (as TOP_K orders them)
        return self._filter(ids[order], vals[order])

    def needs_only_top(self, k: int) -> bool:
        """True when the k best tokens (ids and logits) are all this sampler needs: greedy, or top_k in 1..k, and
        no penalty and no logit bias (they change logits outside the top)."""
        if self.logit_bias:
            return False
        if self.repeat_last_n != 0 and (self.repeat_penalty != 1.0 or self.frequency_penalty != 0.0
                                        or self.presence_penalty != 0.0):
            return False
        return self.temperature == 0 or 0 < self.top_k <= k

    def sample_candidates(self, ids: np.ndarray, logits: np.ndarray) -> int:
        """One token id from a step's best tokens: `ids` with their `logits`, largest first (the lower id first on
        ties, as a step's TOP_K output); the same draw as sample() on the whole logits when needs_only_top()."""
        ids = np.asarray(ids).reshape(-1)
        x = np.asarray(logits, dtype=np.float64).reshape(-1)
        if ids.size == 0 or ids.shape != x.shape:
            raise SamplingError(f"candidates need as many ids as logits, got {ids.shape} and {x.shape}")
        if np.isnan(x[0]):  # NaN ranks first, so one anywhere in the logits shows here
            raise SamplingError("logits contain NaN")
        if not np.isfinite(x[0]):
            raise SamplingError("logits have no finite maximum (all -inf, or +inf present)")
        if self.temperature == 0:
            return int(ids[0])
        k = self.top_k if 0 < self.top_k < ids.size else ids.size
        return self._draw(*self._filter(ids[:k].astype(np.int64), x[:k]))

    def _filter(self, ids: np.ndarray, vals: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """top-p, min-p and temperature on candidates sorted most likely first; returns the survivors with their
        probabilities."""
        if self.top_p < 1.0 and ids.size > 1:
            p = np.exp(vals - vals[0])
            cum = np.cumsum(p)
            keep = int(np.searchsorted(cum, self.top_p * cum[-1], side="left")) + 1
            ids, vals = ids[:keep], vals[:keep]
        if self.min_p > 0.0 and ids.size > 1:
            keep = max(1, int(np.count_nonzero(vals >= vals[0] + math.log(self.min_p))))
            ids, vals = ids[:keep], vals[:keep]
        z = (vals - vals[0]) / self.temperature
        p = np.exp(z)
        return ids, p / p.sum()

    def sample(self, logits: np.ndarray, history: Sequence[int] = ()) -> int:
        """One token id. ``history`` is the token sequence so far (prompt and generated), for the penalties."""
        return self._draw(*self.candidates(logits, history))

    def _draw(self, ids: np.ndarray, p: np.ndarray) -> int:
        if ids.size == 1:
            return int(ids[0])
        cum = np.cumsum(p)
        r = self._rng.random() * cum[-1]
        k = min(int(np.searchsorted(cum, r, side="right")), ids.size - 1)
        return int(ids[k])

    @staticmethod
    def _check_logits(logits: np.ndarray) -> np.ndarray:
        x = np.asarray(logits)
        if x.ndim != 1 or x.shape[0] == 0:
            raise SamplingError(f"logits must be a non-empty 1-D array (n_vocab,), got shape {x.shape}")
        if not np.issubdtype(x.dtype, np.floating):
            raise SamplingError(f"logits must be floating point, got {x.dtype}")
        x = x.astype(np.float64)
        if np.isnan(x).any():
            raise SamplingError("logits contain NaN")
        if not np.isfinite(x.max()):
            raise SamplingError("logits have no finite maximum (all -inf, or +inf present)")
        return x
