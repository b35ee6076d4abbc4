"""The KV cache (one K and one V tensor per layer) and the attention masks over it.

Row r of every layer's cache holds position r of the (single) sequence. Sliding-window layers keep all rows too and
mask the ones outside their window: the window is in the mask's values, an input, so one prepared plan serves every
position (llama.cpp instead keeps a smaller ring-buffer cache for those layers).
"""

from __future__ import annotations

import numpy as np

from .. import dtypes
from ..dtypes import DType
from ..errors import ModelError
from ..tensor import state
from .hparams import HParams


class KVCache:
    """One K and one V tensor per layer: (n_ctx, n_head_kv * head_dim) rows, persistent STATE tensors shared by
    every plan."""

    def __init__(self, hp: HParams, n_ctx: int, kv_type: DType) -> None:
        if kv_type not in (dtypes.F16, dtypes.F32):
            raise ModelError(f"KV cache type {kv_type} is not supported (supported: F16, F32)")
        self.n_ctx = n_ctx
        self.dtype = kv_type
        self.k = [state((n_ctx, hp.n_head_kv * hp.head_dim), kv_type, name=f"cache_k.{i}")
                  for i in range(hp.n_layer)]
        self.v = [state((n_ctx, hp.n_head_kv * hp.head_dim_v), kv_type, name=f"cache_v.{i}")
                  for i in range(hp.n_layer)]

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in (*self.k, *self.v))

    @staticmethod
    def nbytes_for(hp: HParams, n_ctx: int, kv_type: DType) -> int:
        """What a cache for these parameters will allocate (before making one)."""
        return hp.n_layer * n_ctx * hp.n_head_kv * (hp.head_dim + hp.head_dim_v) * kv_type.type_size


def causal_mask(pos: np.ndarray, n_kv: int, window: int = 0) -> np.ndarray:
    """(T, n_kv) F32: 0 where cache row j holds a position the query at pos[i] may see, else -inf.

    Causal: j <= pos[i]. With a sliding window of `window` > 0 also pos[i] - j < window (llama.cpp's standard SWA:
    a key `window` or more positions back is masked).
    """
    j = np.arange(n_kv)[None, :]
    p = pos[:, None]
    ok = j <= p
    if window > 0:
        ok &= p - j < window
    return np.where(ok, np.float32(0), np.float32(-np.inf)).astype(np.float32)
