"""The 4-bit non-linear types IQ4_NL and IQ4_XS (ggml's quantize_iq4_{nl,xs} without an importance matrix)."""

from __future__ import annotations

import numpy as np

from ggml_py.formats.quants.blocks import (
    GROUP_MAX_EPS,
    f16_bytes,
    f16_field,
    f32,
    inverse_or_zero,
    pack_nibbles,
    unpack_nibbles,
)
from ggml_py.formats.quants.kquants import nearest_int_bits

# ggml's kvalues_iq4nl: the 16 int8 levels both IQ4 types index with 4-bit codes
IQ4_VALUES = np.array([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113], dtype=np.int8)
IQ4_LEVELS = IQ4_VALUES.astype(np.float32)
IQ4_NTRY = 7  # scale candidates either side of the first guess (quantize_iq4_nl / quantize_iq4_xs)


def iq4_decode(qs: np.ndarray, scale: np.ndarray) -> np.ndarray:
    """qs (n, k, 16) code bytes (per 32 elements: low nibbles, then high nibbles), scale (n, k) float32."""
    n, k, _ = qs.shape
    q = IQ4_LEVELS[unpack_nibbles(qs.reshape(n * k, 16)).reshape(n, k, 32)]
    q *= scale[:, :, None]
    return q.reshape(n, k * 32)


def iq4_xs_scales(b: np.ndarray) -> np.ndarray:
    """The 8 six-bit sub-block scales (n, 8) uint8, still offset by 32: low nibbles in bytes 4-7 (even sub-block
    low, odd high), top two bits of sub-block j at bits 2j of the uint16 at byte 2."""
    low = unpack_nibbles(b[:, 4:8]).transpose(0, 2, 1).reshape(-1, 8)
    high = (np.ascontiguousarray(b[:, 2:4]).view(np.uint16) >> np.arange(0, 16, 2, dtype=np.uint16)) & np.uint16(3)
    return low | (high.astype(np.uint8) << np.uint8(4))


def deq_iq4_nl(b: np.ndarray) -> np.ndarray:
    return iq4_decode(b[:, None, 2:18], f16_field(b, 0))


def deq_iq4_xs(b: np.ndarray) -> np.ndarray:
    sc = iq4_xs_scales(b).astype(np.float32)
    sc -= 32
    return iq4_decode(b[:, 8:136].reshape(-1, 8, 16), f16_field(b, 0) * sc)


# The levels are integers, so the first level above v is the first above floor(v): for floor(v) in [-128, 127], the
# index of the upper of the two levels around it (1 below the lowest level, 15 from the highest on).
_IQ4_UPPER = np.searchsorted(IQ4_LEVELS, np.arange(-128, 128, dtype=np.float32), side="right").clip(1, 15)
_IQ4_UPPER = _IQ4_UPPER.astype(np.uint8)


def iq4_index(v: np.ndarray) -> np.ndarray:
    """ggml's best_index_int8 over the IQ4 levels: the nearest level, the upper one on ties (and for NaN). Beyond
    the ends the comparison below picks the end level itself (C returns it early), with the same float32 rounding
    of `x - lower < upper - x` as C's (a table lookup: 6x faster than a search)."""
    t = np.floor(v)
    np.clip(t, -128, 127, out=t)
    t[np.isnan(t)] = 127  # C's search ends on the last level for NaN
    hi = _IQ4_UPPER[t.astype(np.int16) + 128]
    return hi - ((v - IQ4_LEVELS[hi - 1]) < (IQ4_LEVELS[hi] - v)).view(np.uint8)


def iq4_fit(x: np.ndarray) -> np.ndarray:
    """The scale quantize_row_iq4_nl_impl picks for each 32-element sub-block (no importance matrix: weights x^2).

    x: (32, m), element axis first (C's sequential sums). A first guess maps the largest |x| to the -127 end, then
    ntry scales either side are tried; the one maximising sum(w q x)^2 / sum(w q^2) wins (strictly, in order)."""
    f = f32
    m = x.shape[1]
    ax = np.abs(x)
    ax = np.where(np.isnan(ax), f(0), ax)  # C's `fabsf(x) > amax` never takes a NaN
    imax = ax.argmax(axis=0)
    cols = np.arange(m)
    amax, mx = ax[imax, cols], x[imax, cols]
    w = x * x

    def sums(iscale: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        q = IQ4_LEVELS[iq4_index(iscale * x)]
        wq = w * q
        return (wq * x).sum(axis=0), (wq * q).sum(axis=0)

    sumqx, sumq2 = sums(f(1) / (-mx / IQ4_LEVELS[0]))
    d = np.where(sumq2 > 0, sumqx / sumq2, f(0))
    best = d * sumqx
    for itry in range(-IQ4_NTRY, IQ4_NTRY + 1):
        sumqx, sumq2 = sums(f(itry + int(IQ4_VALUES[0])) / mx)
        better = (sumq2 > 0) & (sumqx * sumqx > best * sumq2)
        d = np.where(better, sumqx / sumq2, d)
        best = np.where(better, d * sumqx, best)
    return np.where(amax < GROUP_MAX_EPS, f(0), d)


def iq4_pack(codes: np.ndarray) -> np.ndarray:
    """(n, k, 32) codes to (n, 16 k) bytes: element j in the low nibble of byte j, element 16 + j in its high one."""
    n = codes.shape[0]
    return pack_nibbles(codes[:, :, :16], codes[:, :, 16:]).reshape(n, -1)


def q_iq4_nl(x: np.ndarray) -> np.ndarray:
    d = iq4_fit(np.ascontiguousarray(x.T))[:, None]
    codes = iq4_index(inverse_or_zero(d) * x)  # C requantizes with the float scale, not the stored f16 one
    return np.concatenate([f16_bytes(d), iq4_pack(codes[:, None, :])], axis=1)


def q_iq4_xs(x: np.ndarray) -> np.ndarray:
    """quantize_iq4_xs: 8 sub-blocks of 32 fitted as IQ4_NL, their scales then quantized to 6 bits (offset 32)
    against one f16 super-scale d = -max/32, where max is the (first) scale of largest magnitude."""
    f = f32
    n = x.shape[0]
    scales = iq4_fit(np.ascontiguousarray(x.reshape(n * 8, 32).T)).reshape(n, 8)
    ascale = np.abs(scales)
    imax = np.where(np.isnan(ascale), f(0), ascale).argmax(axis=1)[:, None]
    max_scale = np.take_along_axis(scales, imax, axis=1)
    max_scale = np.where(np.take_along_axis(ascale, imax, axis=1) > 0, max_scale, f(0))
    d = -max_scale / f(32)  # -0.0 for an all-zero block, stored as such
    ls = np.clip(nearest_int_bits(inverse_or_zero(d) * scales), -32, 31)
    dl = d * ls.astype(np.float32)
    codes = iq4_index(inverse_or_zero(dl)[:, :, None] * x.reshape(n, 8, 32))
    ls = (ls + 32).astype(np.uint8)
    high = (ls >> np.uint8(4)).astype(np.uint16) << np.arange(0, 16, 2, dtype=np.uint16)
    scales_h = np.bitwise_or.reduce(high, axis=1, keepdims=True).view(np.uint8)
    scales_l = pack_nibbles(ls[:, 0::2], ls[:, 1::2])
    return np.concatenate([f16_bytes(d), scales_h, scales_l, iq4_pack(codes)], axis=1)
