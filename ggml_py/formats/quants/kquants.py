"""The K-quants Q2_K..Q6_K: 256-element super-blocks; the quantizers follow ggml's quantize_row_q*_K_ref in C's
float32 operation order."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from ggml_py.formats.quants.blocks import CRUMB_SHIFTS, GROUP_MAX_EPS, f16_field, f32, pack_nibbles, unpack_nibbles


def crumbs(qs: np.ndarray) -> np.ndarray:
    """Q2_K/Q3_K low bits: (n, 64) bytes to (n, 256) 2-bit values in element order.

    Each 32-byte half covers 128 elements; bits 2j..2j+1 of byte l of half h belong to element 128h + 32j + l."""
    n = qs.shape[0]
    return ((qs.reshape(n, 2, 1, 32) >> CRUMB_SHIFTS[None, None, :, None]) & np.uint8(3)).reshape(n, 256)


def pack_crumbs(levels: np.ndarray) -> np.ndarray:
    """Inverse of crumbs: (n, 256) values in [0, 3] to the (n, 64) byte field."""
    n = levels.shape[0]
    parts = levels.reshape(n, 2, 4, 32) << CRUMB_SHIFTS[None, None, :, None]
    return np.bitwise_or.reduce(parts, axis=2).reshape(n, 64)


def q3k_scales(s: np.ndarray) -> np.ndarray:
    """Unpack Q3_K's 12-byte field into 16 six-bit scales (n, 16) uint8, still offset by 32.

    Low nibbles: bytes 0-7 (scales 0-7), then their high nibbles (scales 8-15); the top two bits of scale j sit at
    bits 2*(j//4) of byte 8 + j%4."""
    low = np.concatenate([s[:, :8] & np.uint8(0x0F), s[:, :8] >> np.uint8(4)], axis=1)
    high = (s[:, None, 8:12] >> CRUMB_SHIFTS[None, :, None]) & np.uint8(3)
    return low | (high.reshape(-1, 16) << np.uint8(4))


def deq_q2_k(b: np.ndarray) -> np.ndarray:
    # layout: scales[16] (low nibble scale, high nibble min), qs[64], d, dmin
    n = b.shape[0]
    sc = b[:, :16]
    dl = (f16_field(b, 80) * (sc & np.uint8(0x0F)).astype(np.float32))[:, :, None]
    ml = (f16_field(b, 82) * (sc >> np.uint8(4)).astype(np.float32))[:, :, None]
    q = crumbs(b[:, 16:80]).astype(np.float32).reshape(n, 16, 16)
    q *= dl
    q -= ml
    return q.reshape(n, 256)


def deq_q3_k(b: np.ndarray) -> np.ndarray:
    # layout: hmask[32], qs[64], scales[12], d; a clear hmask bit means "subtract 4"
    n = b.shape[0]
    high = np.unpackbits(b[:, None, :32], axis=1, count=8, bitorder="little").reshape(n, 256)  # bit k: elems 32k+l
    q = (crumbs(b[:, 32:96]) | (high << np.uint8(2))).astype(np.float32)
    q -= 4
    sc = q3k_scales(b[:, 96:108]).astype(np.float32)
    sc -= 32
    dl = f16_field(b, 108) * sc
    q = q.reshape(n, 16, 16)
    q *= dl[:, :, None]
    return q.reshape(n, 256)


def k4_scales(s: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Unpack the 12-byte Q4_K/Q5_K field into 8 six-bit scales and 8 six-bit mins, each (n, 8) uint8."""
    a, b, c = s[:, 0:4], s[:, 4:8], s[:, 8:12]
    sc = np.concatenate([a & np.uint8(63), (c & np.uint8(0x0F)) | ((a >> np.uint8(6)) << np.uint8(4))], axis=1)
    mn = np.concatenate([b & np.uint8(63), (c >> np.uint8(4)) | ((b >> np.uint8(6)) << np.uint8(4))], axis=1)
    return sc, mn


def k4_scales_bytes(ls: np.ndarray, lm: np.ndarray) -> np.ndarray:
    """Inverse of k4_scales: (n, 8) six-bit scales and mins to the 12-byte field."""
    hi6 = np.uint8(6)
    return np.concatenate(
        [
            ls[:, :4] | ((ls[:, 4:] >> np.uint8(4)) << hi6),
            lm[:, :4] | ((lm[:, 4:] >> np.uint8(4)) << hi6),
            pack_nibbles(ls[:, 4:], lm[:, 4:]),
        ],
        axis=1,
    )


def k_affine(b: np.ndarray, q: np.ndarray) -> np.ndarray:
    """Q4_K/Q5_K: value = (d*scale) * q - dmin*min, per 32-element sub-block; q is (n, 8, 32) float32."""
    sc, mn = k4_scales(b[:, 4:16])
    scale = (f16_field(b, 0) * sc.astype(np.float32))[:, :, None]
    offset = (f16_field(b, 2) * mn.astype(np.float32))[:, :, None]
    q *= scale
    q -= offset
    return q.reshape(-1, 256)


def deq_q4_k(b: np.ndarray) -> np.ndarray:
    # each 32-byte group holds two sub-blocks: low nibbles, then high nibbles
    q = unpack_nibbles(b[:, 16:144].reshape(-1, 32)).reshape(-1, 8, 32).astype(np.float32)
    return k_affine(b, q)


def deq_q5_k(b: np.ndarray) -> np.ndarray:
    low = unpack_nibbles(b[:, 48:176].reshape(-1, 32)).reshape(-1, 8, 32)
    # bit k of qh byte l is the 5th bit of element 32*k + l
    high = np.unpackbits(b[:, None, 16:48], axis=1, count=8, bitorder="little")
    return k_affine(b, (low | (high << np.uint8(4))).astype(np.float32))


def deq_q6_k(b: np.ndarray) -> np.ndarray:
    n = b.shape[0]
    # per 128-element half: ql bytes 0-31 / 32-63 hold quarters 0,1 (low nibbles) and 2,3 (high nibbles)
    low = unpack_nibbles(b[:, :128].reshape(n * 2, 64)).reshape(n, 2, 4, 32)
    qh = b[:, 128:192].reshape(n, 2, 1, 32)
    high = (qh >> np.array([0, 2, 4, 6], dtype=np.uint8)[None, None, :, None]) & np.uint8(3)
    q = (low | (high << np.uint8(4))).astype(np.float32).reshape(n, 16, 16)
    q -= 32
    scale = f16_field(b, 208) * b[:, 192:208].view(np.int8).astype(np.float32)
    q *= scale[:, :, None]
    return q.reshape(n, 256)


def nearest_even(v: np.ndarray) -> np.ndarray:
    """ggml's nearest_int (round half to even), kept as float32."""
    return np.rint(v)


def nearest_int_bits(v: np.ndarray) -> np.ndarray:
    """ggml's nearest_int bit for bit, as int32: add 1.5 * 2**23 in float32 and read the low mantissa bits.

    Equals round-half-to-even inside C's asserted range |v| <= 4194303; outside it (huge ratios from tiny scales)
    this reproduces what a release build of ggml computes, where np.rint would not."""
    bits = (np.asarray(v, dtype=np.float32) + f32(12582912)).view(np.int32)
    return (bits & np.int32(0x007FFFFF)) - np.int32(0x00400000)


def make_qkx2(
    x: np.ndarray, w: np.ndarray, nmax: int, rmin: float, rdelta: float, nstep: int, use_mad: bool = False
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """ggml's make_qkx2_quants for m sub-blocks at once; the error is weighted |diff| if use_mad, else diff^2.

    x, w: (k, m), element axis first so that `sum(axis=0)` accumulates in C's sequential order.
    Returns levels L (k, m) float32 in [0, nmax], scale (m,) and the (non-negative) min (m,).
    """
    f = f32
    mx = x.max(axis=0)
    lo = np.minimum(x.min(axis=0), f(0))
    sum_w = w.sum(axis=0)
    sum_x = (w * x).sum(axis=0)
    flat = mx == lo

    iscale = f(nmax) / (mx - lo)
    scale = f(1) / iscale
    # exact nearest_int: for degenerate (subnormal-range) sub-blocks iscale overflows and C's bit trick decides
    levels = np.clip(nearest_int_bits(iscale * (x - lo)), 0, nmax).astype(np.float32)
    dist = np.abs if use_mad else np.square
    best = (w * dist(scale * levels + lo - x)).sum(axis=0)
    cur_min = lo
    for step in range(nstep + 1):
        # C updates `min` when a step wins, and later steps measure from it; so do we
        iscale = (f(rmin) + f(rdelta) * f(step) + f(nmax)) / (mx - cur_min)
        laux = np.clip(nearest_int_bits(iscale * (x - cur_min)), 0, nmax).astype(np.float32)
        wl = w * laux
        sum_l = wl.sum(axis=0)
        sum_l2 = (wl * laux).sum(axis=0)
        sum_xl = (wl * x).sum(axis=0)
        det = sum_w * sum_l2 - sum_l * sum_l
        this_scale = (sum_w * sum_xl - sum_x * sum_l) / det
        this_min = (sum_l2 * sum_x - sum_l * sum_xl) / det
        pos = this_min > 0
        this_min = np.where(pos, f(0), this_min)
        this_scale = np.where(pos, sum_xl / sum_l2, this_scale)
        err = (w * dist(this_scale * laux + this_min - x)).sum(axis=0)
        better = (det > 0) & (err < best)
        levels = np.where(better, laux, levels)
        best = np.where(better, err, best)
        scale = np.where(better, this_scale, scale)
        cur_min = np.where(better, this_min, cur_min)
    levels = np.where(flat, f(0), levels)
    scale = np.where(flat, f(0), scale)
    the_min = np.where(flat, -lo, -cur_min)
    return levels, scale, the_min


def as_u8(v: np.ndarray) -> np.ndarray:
    """C's float -> int -> uint8_t conversion (wraps modulo 256)."""
    return (v.astype(np.int64) & 0xFF).astype(np.uint8)


def quant_k_affine(x: np.ndarray, nmax: int, rmin: float, rdelta: float, nstep: int) -> tuple[np.ndarray, ...]:
    """Shared part of quantize_row_q4_K_ref / q5_K_ref: returns d, dmin (f16 bytes), scales field, levels (n,8,32)."""
    f = f32
    n = x.shape[0]
    xs = np.ascontiguousarray(x.reshape(n * 8, 32).T)
    av_x = np.sqrt(np.square(xs).sum(axis=0) / f(32))
    w = av_x + np.abs(xs)
    levels, scales, mins = make_qkx2(xs, w, nmax, rmin, rdelta, nstep)
    levels = levels.T.reshape(n, 8, 32)
    scales = scales.reshape(n, 8)
    mins = mins.reshape(n, 8)

    max_scale = np.maximum(scales.max(axis=1, keepdims=True), f(0))
    max_min = np.maximum(mins.max(axis=1, keepdims=True), f(0))
    inv_scale = np.where(max_scale > 0, f(63) / max_scale, f(0))
    inv_min = np.where(max_min > 0, f(63) / max_min, f(0))
    ls = np.minimum(as_u8(nearest_even(inv_scale * scales)), np.uint8(63))
    lm = np.minimum(as_u8(nearest_even(inv_min * mins)), np.uint8(63))
    d16 = (max_scale / f(63)).astype(np.float16)
    dmin16 = (max_min / f(63)).astype(np.float16)

    d = (d16.astype(np.float32) * ls.astype(np.float32))[:, :, None]
    dm = (dmin16.astype(np.float32) * lm.astype(np.float32))[:, :, None]
    requant = np.clip(nearest_even((x.reshape(n, 8, 32) + dm) / d), 0, nmax)
    levels = np.where(d == 0, levels, requant).astype(np.uint8)  # C skips sub-blocks whose scale is 0
    return d16.view(np.uint8), dmin16.view(np.uint8), k4_scales_bytes(ls, lm), levels


def q_q4_k(x: np.ndarray) -> np.ndarray:
    d, dmin, scales, levels = quant_k_affine(x, 15, -1.0, 0.1, 20)
    pairs = levels.reshape(-1, 4, 2, 32)
    qs = pack_nibbles(pairs[:, :, 0], pairs[:, :, 1]).reshape(-1, 128)
    return np.concatenate([d, dmin, scales, qs], axis=1)


def q_q5_k(x: np.ndarray) -> np.ndarray:
    d, dmin, scales, levels = quant_k_affine(x, 31, -0.5, 0.1, 15)
    qh = np.packbits(levels >> np.uint8(4), axis=1, bitorder="little").reshape(-1, 32)
    pairs = levels.reshape(-1, 4, 2, 32)
    qs = pack_nibbles(pairs[:, :, 0], pairs[:, :, 1]).reshape(-1, 128)
    return np.concatenate([d, dmin, scales, qh, qs], axis=1)


def by_sub_block16(x: np.ndarray, fit: Callable[..., tuple[np.ndarray, ...]], *args: Any) -> tuple[np.ndarray, ...]:
    """Run a sub-block fitter over the 16 sub-blocks of 16 elements of every 256-block of x (n, 256). The fitter
    takes them element axis first, (16, n * 16); its levels come back as (n, 16, 16), its other outputs as (n, 16)."""
    n = x.shape[0]
    levels, *rest = fit(np.ascontiguousarray(x.reshape(n * 16, 16).T), *args)
    return (levels.T.reshape(n, 16, 16), *(r.reshape(n, 16) for r in rest))


def q_q2_k(x: np.ndarray) -> np.ndarray:
    """quantize_row_q2_K_ref: 16 sub-blocks of 16, each an affine 2-bit fit; 4-bit scales and mins per sub-block."""
    f = f32
    n = x.shape[0]
    levels, scales, mins = by_sub_block16(x, lambda xs: make_qkx2(xs, np.abs(xs), 3, -0.5, 0.1, 15, use_mad=True))

    # C starts both maxima at 0 and takes strictly larger values: never -0.0, never negative, NaNs skipped (fmax)
    max_scale = np.fmax.reduce(scales, axis=1, keepdims=True)
    max_scale = np.where(max_scale > 0, max_scale, f(0))
    max_min = np.fmax.reduce(mins, axis=1, keepdims=True)
    max_min = np.where(max_min > 0, max_min, f(0))
    # C stores the int unclamped into a uint8 (wraps) and ORs the min's nibble above it
    ls = np.where(max_scale > 0, nearest_int_bits((f(15) / max_scale) * scales), 0)
    lm = np.where(max_min > 0, nearest_int_bits((f(15) / max_min) * mins), 0)
    sc = ((ls & 0xFF) | ((lm << 4) & 0xFF)).astype(np.uint8)
    d16 = (max_scale / f(15)).astype(np.float16)
    dmin16 = (max_min / f(15)).astype(np.float16)

    d = d16.astype(np.float32) * (sc & np.uint8(0x0F)).astype(np.float32)
    dm = dmin16.astype(np.float32) * (sc >> np.uint8(4)).astype(np.float32)
    xb = x.reshape(n, 16, 16)
    requant = np.clip(nearest_int_bits((xb + dm[:, :, None]) / d[:, :, None]), 0, 3)
    # C keeps make_qkx2's levels in sub-blocks whose decoded scale is 0
    levels = np.where((d == 0)[:, :, None], levels, requant).astype(np.uint8).reshape(n, 256)
    return np.concatenate([sc, pack_crumbs(levels), d16.view(np.uint8), dmin16.view(np.uint8)], axis=1)


def make_q3(x: np.ndarray, nmax: int) -> tuple[np.ndarray, np.ndarray]:
    """ggml's make_q3_quants with do_rmse=true, for m sub-blocks at once.

    x: (k, m), element axis first. Returns levels (k, m) int32 in [0, 2*nmax) and the scale (m,). The refinement
    visits elements in order and each accepted change feeds the next decision (Gauss-Seidel), so the element loop
    stays a Python loop over vectors of m; sums are kept in C's sequential order."""
    f = f32
    k, m = x.shape
    ax = np.abs(x)
    imax = ax.argmax(axis=0)  # first maximum, as C's strict '>'
    cols = np.arange(m)
    amax = ax[imax, cols]
    mx = x[imax, cols]
    iscale = f(-nmax) / mx
    lv = np.clip(nearest_int_bits(iscale * x), -nmax, nmax - 1)
    w = x * x
    wx = w * x
    sumlx = np.zeros(m, np.float32)
    suml2 = np.zeros(m, np.float32)
    for i in range(k):
        li = lv[i].astype(np.float32)
        sumlx += wx[i] * li
        suml2 += w[i] * li * li
    for _ in range(5):
        changed = False
        for i in range(k):
            li = lv[i].astype(np.float32)
            slx = sumlx - wx[i] * li
            sl2 = suml2 - w[i] * li * li
            new_l = np.clip(nearest_int_bits(x[i] * sl2 / slx), -nmax, nmax - 1)
            nl = new_l.astype(np.float32)
            slx_new = slx + wx[i] * nl
            sl2_new = sl2 + w[i] * nl * nl
            take = (slx > 0) & (new_l != lv[i]) & (sl2_new > 0)
            take &= slx_new * slx_new * suml2 > sumlx * sumlx * sl2_new
            if take.any():
                changed = True
                lv[i] = np.where(take, new_l, lv[i])
                sumlx = np.where(take, slx_new, sumlx)
                suml2 = np.where(take, sl2_new, suml2)
        if not changed:  # an unchanged pass leaves the state as it was, so later passes change nothing either
            break
    zero = amax < GROUP_MAX_EPS
    scale = np.where(suml2 > 0, sumlx / suml2, f(0))
    return np.where(zero, 0, lv + nmax), np.where(zero, f(0), scale)


def q_q3_k(x: np.ndarray) -> np.ndarray:
    """quantize_row_q3_K_ref: 16 sub-blocks of 16 with symmetric 3-bit levels, 6-bit signed scales."""
    f = f32
    n = x.shape[0]
    levels, scales = by_sub_block16(x, make_q3, 4)

    # C keeps the first scale of strictly largest |scale| above 0: a NaN scale (float32 overflow of x**3 in
    # make_q3_quants for |x| > ~1e19) never wins, where argmax would pick it
    ascale = np.abs(scales)
    imax = np.where(np.isnan(ascale), f(0), ascale).argmax(axis=1)[:, None]
    max_scale = np.take_along_axis(scales, imax, axis=1)
    max_scale = np.where(np.take_along_axis(ascale, imax, axis=1) > 0, max_scale, f(0))
    nonzero = max_scale != 0
    iscale = f(-32) / max_scale
    l8 = ((nearest_int_bits(iscale * scales) + 128) & 0xFF) - 128  # C assigns the int to an int8_t
    ls = np.where(nonzero, np.clip(l8, -32, 31) + 32, 0).astype(np.uint8)
    high = (ls >> np.uint8(4)).reshape(n, 4, 4) << CRUMB_SHIFTS[None, :, None]
    sc = np.concatenate(
        [pack_nibbles(ls[:, :8], ls[:, 8:]), np.bitwise_or.reduce(high, axis=1)], axis=1
    )  # the inverse of q3k_scales
    d16 = np.where(nonzero, f(1) / iscale, f(0)).astype(np.float16)

    # requantize with the scales as stored (C decodes them back from the bytes)
    d = d16.astype(np.float32) * (q3k_scales(sc).astype(np.float32) - f(32))
    xb = x.reshape(n, 16, 16)
    requant = np.clip(nearest_int_bits(xb / d[:, :, None]), -4, 3) + 4
    # sub-blocks whose decoded scale is 0 keep make_q3_quants' levels
    levels = np.where((d == 0)[:, :, None], levels, requant).astype(np.uint8).reshape(n, 256)
    # level bit 2 goes to hmask: byte l, bit k for element 32k + l
    hmask = np.packbits(levels.reshape(n, 8, 32) >> np.uint8(2), axis=1, bitorder="little").reshape(n, 32)
    return np.concatenate([hmask, pack_crumbs(levels & np.uint8(3)), sc, d16.view(np.uint8)], axis=1)


def make_qx(x: np.ndarray, nmax: int) -> tuple[np.ndarray, np.ndarray]:
    """ggml's make_qx_quants with rmse_type=1 and no importance weights, for m sub-blocks at once.

    x: (k, m), element axis first (sequential sums as in C). Returns levels (k, m) float32 in [0, 2*nmax) and scale.
    """
    f = f32
    m = x.shape[1]
    ax = np.abs(x)
    imax = ax.argmax(axis=0)
    amax = ax[imax, np.arange(m)]
    mx = x[imax, np.arange(m)]
    w = x * x
    wx = w * x

    def trial(iscale: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        lv = np.clip(nearest_even(iscale * x), -nmax, nmax - 1)
        return lv, (wx * lv).sum(axis=0), (w * lv * lv).sum(axis=0)

    lv, sumlx, suml2 = trial(f(-nmax) / mx)
    levels = lv + f(nmax)
    scale = np.where(suml2 != 0, sumlx / suml2, f(0))
    best = scale * sumlx
    for step in range(-9, 10):
        if step == 0:
            continue
        lv, sumlx, suml2 = trial(-(f(nmax) + f(0.1) * f(step)) / mx)
        better = (suml2 > 0) & (sumlx * sumlx > best * suml2)
        levels = np.where(better, lv + f(nmax), levels)
        scale = np.where(better, sumlx / suml2, scale)
        best = np.where(better, scale * sumlx, best)
    zero = amax < GROUP_MAX_EPS
    return np.where(zero, f(0), levels), np.where(zero, f(0), scale)


def q_q6_k(x: np.ndarray) -> np.ndarray:
    f = f32
    n = x.shape[0]
    levels, scales = by_sub_block16(x, make_qx, 32)

    # C keeps the first scale of strictly largest |scale| above 0: a NaN scale (x**3 overflowing float32 for
    # |x| > ~1e19) never wins, and a block whose scales are all NaN or ~0 is written as zeros
    ascale = np.abs(scales)
    ascale = np.where(np.isnan(ascale), f(0), ascale)
    imax = ascale.argmax(axis=1)[:, None]
    max_scale = np.take_along_axis(scales, imax, axis=1)
    zero_block = np.take_along_axis(ascale, imax, axis=1) < GROUP_MAX_EPS
    iscale = f(-128) / max_scale
    d16 = (f(1) / iscale).astype(np.float16)
    # nearest_int's bits where a scale or d is inf or NaN (C computes on: such a block's levels come out as 32)
    sc = np.minimum(nearest_int_bits(iscale * scales), 127).astype(np.int8)
    d = (d16.astype(np.float32) * sc.astype(np.float32))[:, :, None]
    requant = np.clip(nearest_int_bits(x.reshape(n, 16, 16) / d), -32, 31) + 32
    levels = np.where(d == 0, levels, requant).astype(np.uint8).reshape(n, 2, 4, 32)

    ql = pack_nibbles(levels[:, :, 0:2], levels[:, :, 2:4]).reshape(n, 128)
    shifts = np.array([0, 2, 4, 6], dtype=np.uint8)[None, None, :, None]
    qh = np.bitwise_or.reduce((levels >> np.uint8(4)) << shifts, axis=2).reshape(n, 64)
    out = np.concatenate([ql, qh, sc.view(np.uint8), d16.view(np.uint8)], axis=1)
    out[zero_block[:, 0]] = 0  # C memsets an all-zero block
    return out
