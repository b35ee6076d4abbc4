"""The statistics llama-perplexity prints, from logits: perplexity with its uncertainty, and the KL divergence of a
model's next-token distributions from a base model's (mean, percentiles, Δp, top-1 agreement).

Pure numpy, no model: `ggml_py/models/perplexity.py` evaluates the chunks, this module scores them. Every sum is
taken in float64 and every formula is llama-perplexity's (tools/perplexity/perplexity.cpp), so the figures can be
compared with its output line by line:

- perplexity = exp(mean NLL); its uncertainty = ppl * sqrt(var(NLL) / (n - 1)), var = mean(NLL²) - mean(NLL)²;
- KL(base || model) per position = Σ_v p_base(v) (log p_base(v) - log p_model(v)); its mean ± the same standard
  error; percentiles by linear interpolation between the sorted values (numpy's default method);
- Δp = p_model(token) - p_base(token) of the token that follows in the text; "same top p" = how often the two
  models' most likely tokens are the same.

One difference from llama.cpp, on purpose: llama.cpp stores the base log-probabilities as 16-bit integers over a range
of 16 below the row's maximum and leaves out of the KL sum tokens whose base probability is below e^-16; here the
base is kept as float16 log-probabilities of every token, renormalised before use, and the sum runs over the whole
vocabulary (the exact KL of the two stored distributions). The tail it adds is ~1e-4 of a KLD at most.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np

_ROWS = 64  # rows converted to float64 at a time: 64 x 49152 x 8 bytes = 25 MB of temporaries


def log_softmax(logits: np.ndarray) -> np.ndarray:
    """Row-wise log-probabilities of `logits` (n, n_vocab), float64, computed by blocks of rows."""
    x = np.asarray(logits)
    out = np.empty(x.shape, np.float64)
    for i in range(0, x.shape[0], _ROWS):
        r = x[i:i + _ROWS].astype(np.float64)
        r -= r.max(axis=1, keepdims=True)
        r -= np.log(np.exp(r).sum(axis=1, keepdims=True))
        out[i:i + _ROWS] = r
    return out


def token_nll(logprobs: np.ndarray, targets: np.ndarray) -> np.ndarray:
    """-log p(target) per row: the negative log-likelihood of the token that follows each position."""
    return -logprobs[np.arange(logprobs.shape[0]), np.asarray(targets)]


def mean_and_uncertainty(values: np.ndarray) -> tuple[float, float]:
    """Mean and its standard error, as llama-perplexity: sqrt((mean(x²) - mean(x)²) / (n - 1)); 0 for n <= 10 (it
    reports no spread on so few values) or a non-positive variance."""
    v = np.asarray(values, np.float64)
    n = v.size
    if n < 1:
        return 0.0, 0.0
    mean = float(v.sum() / n)
    var = float((v * v).sum() / n - mean * mean)
    return mean, math.sqrt(var / (n - 1)) if var > 0 and n > 10 else 0.0


def _covariance(a: np.ndarray, b: np.ndarray) -> float:
    """Covariance of the two means (llama-perplexity's, for the uncertainty of the log-ratio); 0 below 10 values."""
    n = a.size
    if n < 10:
        return 0.0
    return float(((a * b).sum() / n - (a.sum() / n) * (b.sum() / n)) / (n - 1))


def percentile(sorted_values: np.ndarray, fraction: float) -> float:
    """llama-perplexity's percentile: linear interpolation at fraction * (n - 1) of the sorted values."""
    return float(np.percentile(sorted_values, 100.0 * fraction))


@dataclass
class Perplexity:
    """Running perplexity over scored positions: add one chunk's NLLs at a time."""

    nll: list[np.ndarray] = field(default_factory=list)

    def add(self, nll: np.ndarray) -> None:
        self.nll.append(np.asarray(nll, np.float64))

    @property
    def count(self) -> int:
        return sum(a.size for a in self.nll)

    def values(self) -> np.ndarray:
        return np.concatenate(self.nll) if self.nll else np.zeros(0)

    def estimate(self) -> tuple[float, float]:
        """(perplexity, its uncertainty) so far. The uncertainty is llama-perplexity's "Final estimate" one: without
        its n > 10 rule, which only its KL-divergence tables apply."""
        v = self.values()
        if v.size == 0:
            return float("nan"), float("nan")
        mean = float(v.sum() / v.size)
        var = float((v * v).sum() / v.size - mean * mean)
        ppl = math.exp(mean)
        return ppl, ppl * math.sqrt(var / (v.size - 1)) if var > 0 and v.size > 1 else 0.0


@dataclass
class ChunkDivergence:
    """The per-position figures of one chunk against the base: the inputs of every KL statistic."""

    nll: np.ndarray  # -log p_model(next token)
    nll_base: np.ndarray  # -log p_base(next token)
    kld: np.ndarray  # KL(base || model) per position
    p_diff: np.ndarray  # p_model(next token) - p_base(next token)
    same_top: np.ndarray  # bool: the two most likely tokens agree


def divergence(logprobs: np.ndarray, base_logprobs: np.ndarray, targets: np.ndarray,
               base_nll: np.ndarray | None = None, base_top: np.ndarray | None = None) -> ChunkDivergence:
    """Compare this model's log-probabilities (n, n_vocab) with the base's (n, n_vocab, any float type: stored ones
    are renormalised so they are a distribution again) at the same positions, `targets` the tokens that follow.
    `base_nll` and `base_top`: the base's NLL of the next token and its most likely token per position when known
    exactly (float16 storage rounds the one and can tie the other)."""
    n = logprobs.shape[0]
    kld = np.empty(n, np.float64)
    # the base's NLL and top token from its stored log-probabilities only where they are not known exactly
    nll_base = np.empty(n, np.float64) if base_nll is None else np.asarray(base_nll, np.float64)
    top_base = np.empty(n, np.int64) if base_top is None else np.asarray(base_top)
    rows = np.arange(n)
    for i in range(0, n, _ROWS):
        b = base_logprobs[i:i + _ROWS].astype(np.float64)
        b -= np.log(np.exp(b).sum(axis=1, keepdims=True))
        q = logprobs[i:i + _ROWS]
        kld[i:i + _ROWS] = (np.exp(b) * (b - q)).sum(axis=1)
        if base_nll is None:
            r = rows[i:i + _ROWS]
            nll_base[i:i + _ROWS] = -b[r - i, targets[r]]
        if base_top is None:
            top_base[i:i + _ROWS] = b.argmax(axis=1)
    nll = token_nll(logprobs, targets)
    return ChunkDivergence(nll=nll, nll_base=nll_base, kld=np.maximum(kld, 0.0),
                           p_diff=np.exp(-nll) - np.exp(-nll_base), same_top=logprobs.argmax(axis=1) == top_base)


KLD_PERCENTILES = (("max", 1.0), ("p99.9", 0.999), ("p99", 0.99), ("p95", 0.95), ("p90", 0.90), ("median", 0.5),
                   ("p10", 0.10), ("p5", 0.05), ("p1", 0.01), ("p0.1", 0.001), ("min", 0.0))
DP_PERCENTILES = (("max", 1.0), ("p99.9", 0.999), ("p99", 0.99), ("p95", 0.95), ("p90", 0.90), ("p75", 0.75),
                  ("median", 0.5), ("p25", 0.25), ("p10", 0.10), ("p5", 0.05), ("p1", 0.01), ("p0.1", 0.001),
                  ("min", 0.0))


@dataclass
class Divergence:
    """Running KL-divergence statistics: add one chunk's ChunkDivergence at a time."""

    chunks: list[ChunkDivergence] = field(default_factory=list)

    def add(self, c: ChunkDivergence) -> None:
        self.chunks.append(c)

    def _cat(self, name: str) -> np.ndarray:
        return np.concatenate([getattr(c, name) for c in self.chunks]) if self.chunks else np.zeros(0)

    @property
    def count(self) -> int:
        return sum(c.kld.size for c in self.chunks)

    def running(self) -> dict[str, Any]:
        """The figures of llama-perplexity's per-chunk table, over all positions so far: PPL(Q), ln(PPL(Q)/PPL(base)),
        KL divergence, RMS Δp (fraction) and same top p (fraction), each as (value, uncertainty)."""
        nll, nll_base = self._cat("nll"), self._cat("nll_base")
        n = nll.size
        log_ppl, log_ppl_unc = mean_and_uncertainty(nll)
        log_base, log_base_unc = mean_and_uncertainty(nll_base)
        cov = _covariance(nll, nll_base)
        ratio_unc = math.sqrt(max(log_ppl_unc ** 2 + log_base_unc ** 2 - 2.0 * cov, 0.0))
        p_diff = self._cat("p_diff")
        mse, mse_unc = mean_and_uncertainty(p_diff * p_diff)
        rms = math.sqrt(mse)
        top = float(self._cat("same_top").mean()) if n else float("nan")
        return {
            "ppl": (math.exp(log_ppl), math.exp(log_ppl) * log_ppl_unc),
            "ln_ppl_ratio": (log_ppl - log_base, ratio_unc),
            "kld": mean_and_uncertainty(self._cat("kld")),
            "rms_dp": (rms, 0.5 / rms * mse_unc if rms > 0 else 0.0),
            "same_top": (top, math.sqrt(top * (1 - top) / (n - 1)) if n > 1 else 0.0),
        }

    def summary(self) -> dict[str, Any]:
        """Everything llama-perplexity prints after the table: perplexity statistics (Q and base, correlation,
        ratio, difference), KL-divergence statistics and token-probability (Δp) statistics. Fractions, not %."""
        nll, nll_base = self._cat("nll"), self._cat("nll_base")
        log_ppl, log_ppl_unc = mean_and_uncertainty(nll)
        log_base, log_base_unc = mean_and_uncertainty(nll_base)
        ppl, ppl_base = math.exp(log_ppl), math.exp(log_base)
        cov = _covariance(nll, nll_base)
        denom = log_ppl_unc * log_base_unc
        ln_ratio, ln_ratio_unc = log_ppl - log_base, math.sqrt(max(log_ppl_unc ** 2 + log_base_unc ** 2 - 2 * cov, 0))
        ppl_unc, base_unc = ppl * log_ppl_unc, ppl_base * log_base_unc
        diff_unc = math.sqrt(max(ppl_unc ** 2 + base_unc ** 2 - 2.0 * ppl * ppl_base * cov, 0.0))
        kld = np.sort(self._cat("kld"))
        p_diff = np.sort(self._cat("p_diff"))
        run = self.running()
        return {
            "count": int(kld.size),
            "ppl": {"value": ppl, "uncertainty": ppl_unc},
            "ppl_base": {"value": ppl_base, "uncertainty": base_unc},
            "ln_ppl_correlation": cov / denom if denom > 0 else float("nan"),
            "ln_ppl_ratio": {"value": ln_ratio, "uncertainty": ln_ratio_unc},
            "ppl_ratio": {"value": math.exp(ln_ratio), "uncertainty": math.exp(ln_ratio) * ln_ratio_unc},
            "ppl_diff": {"value": ppl - ppl_base, "uncertainty": diff_unc},
            "kld": {"mean": run["kld"][0], "uncertainty": run["kld"][1],
                    **{k: percentile(kld, f) for k, f in KLD_PERCENTILES}},
            "dp": {"mean": mean_and_uncertainty(p_diff)[0], "uncertainty": mean_and_uncertainty(p_diff)[1],
                   **{k: percentile(p_diff, f) for k, f in DP_PERCENTILES},
                   "rms": run["rms_dp"][0], "rms_uncertainty": run["rms_dp"][1]},
            "same_top": {"value": run["same_top"][0], "uncertainty": run["same_top"][1]},
        }
