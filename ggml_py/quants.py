"""ggml's block-quantized formats in vectorised numpy, with the semantics of `gguf.quants`.

`quantize(data, qtype)` takes floats whose last dimension is a multiple of the block size and returns uint8 rows
(last dimension = bytes per row); `dequantize(raw, qtype)` turns such rows back into float32 of the element shape.
As in gguf, F32 and F16 are plain casts/views (quantize returns float32/float16 arrays for them); use `quantize_rows`
to always get raw bytes.

Results are bit-identical to gguf for everything gguf implements (all dequantizers here; quantizers of
BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0). gguf cannot quantize the K-quants and IQ4_NL/IQ4_XS; ours follow ggml's
reference quantizers (`quantize_row_q{2,3,4,5,6}_K_ref`; for the IQ4 types `quantize_iq4_{nl,xs}` without an
importance matrix, as llama-quantize runs them), keeping C's float32 operation order (sums run sequentially over the
element axis) and no fused multiply-add: Q2_K, Q3_K, IQ4_NL and IQ4_XS match ggml-quants.c built with -O2 for
baseline x86-64 byte for byte; a build with FMA contraction (-march=native) rounds differently and gives other
(equally valid) Q2_K bytes.
No gguf import here: the core does its own math.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from . import dtypes
from .dtypes import BF16, F16, F32, IQ4_NL, IQ4_XS, Q2_K, Q3_K, Q4_0, Q4_1, Q4_K, Q5_0, Q5_1, Q5_K, Q6_K, Q8_0, DType
from .errors import ShapeError

QType = DType | int | str  # also gguf.GGMLQuantizationType (an IntEnum)

__all__ = ["DEQUANTIZABLE", "QUANTIZABLE", "QType", "dequantize", "dequantize_rows", "quantize", "quantize_rows"]

_f32 = np.float32
_NIBBLE_SHIFTS = np.array([0, 4], dtype=np.uint8)
_CRUMB_SHIFTS = np.array([0, 2, 4, 6], dtype=np.uint8)
# Elements per chunk when mapping a block kernel: bounds the temporaries and keeps them cache-sized.
_CHUNK_ELEMS = 1 << 18
_GROUP_MAX_EPS = _f32(1e-15)

Kernel = Callable[[np.ndarray], np.ndarray]


# ---------------------------------------------------------------------------------------------------------- helpers


def _f16_field(blocks: np.ndarray, off: int) -> np.ndarray:
    """The little-endian f16 at byte `off` of each block, as float32 of shape (n, 1)."""
    return np.ascontiguousarray(blocks[:, off : off + 2]).view(np.float16).astype(np.float32)


def _f16_bytes(v: np.ndarray) -> np.ndarray:
    """float32 (n, 1) to its f16 encoding, (n, 2) uint8 (numpy's cast rounds to nearest even, as ggml does)."""
    return np.ascontiguousarray(v, dtype=np.float32).astype(np.float16).view(np.uint8)


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """(n, k) bytes to (n, 2, k) 4-bit values: all low nibbles first, then all high nibbles (ggml's order)."""
    return (qs[:, None, :] >> _NIBBLE_SHIFTS[None, :, None]) & np.uint8(0x0F)


def _pack_nibbles(lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
    return (lo & np.uint8(0x0F)) | (hi << np.uint8(4))


def _round_half_away(v: np.ndarray) -> np.ndarray:
    """C's roundf (ties away from zero); np.rint would round ties to even. inf gives NaN, as in gguf."""
    a = np.abs(v)
    f = np.floor(a)
    return np.sign(v) * (f + np.floor(2 * (a - f)))


def _inverse(d: np.ndarray) -> np.ndarray:
    """1/d, 0 where d is 0 (ggml's `d ? 1.0f/d : 0.0f`)."""
    with np.errstate(divide="ignore"):
        return np.where(d == 0, _f32(0), _f32(1) / d)


def _map_blocks(kernel: Kernel, blocks: np.ndarray, width: int, dtype: type, block_elems: int) -> np.ndarray:
    """Apply a (n, a) -> (n, width) block kernel over chunks of blocks (vectorised within a chunk)."""
    n = blocks.shape[0]
    out = np.empty((n, width), dtype=dtype)
    step = max(1, _CHUNK_ELEMS // block_elems)
    with np.errstate(all="ignore"):  # NaN/inf inputs give garbage blocks, as in ggml, not warnings
        for s in range(0, n, step):
            out[s : s + step] = kernel(blocks[s : s + step])
    return out


# ------------------------------------------------------------------------------------------- legacy 32-element types


def _deq_q4_0(b: np.ndarray) -> np.ndarray:
    q = _nibbles(b[:, 2:]).reshape(-1, 32).astype(np.float32)
    q -= 8
    return _f16_field(b, 0) * q


def _deq_q4_1(b: np.ndarray) -> np.ndarray:
    q = _nibbles(b[:, 4:]).reshape(-1, 32).astype(np.float32)
    return _f16_field(b, 0) * q + _f16_field(b, 2)


def _q5_values(qh: np.ndarray, qs: np.ndarray) -> np.ndarray:
    # qh is a little-endian uint32 whose bit j is the 5th bit of element j
    high = np.unpackbits(qh, axis=1, bitorder="little")
    return _nibbles(qs).reshape(-1, 32) | (high << np.uint8(4))


def _deq_q5_0(b: np.ndarray) -> np.ndarray:
    q = _q5_values(b[:, 2:6], b[:, 6:]).astype(np.float32)
    q -= 16
    return _f16_field(b, 0) * q


def _deq_q5_1(b: np.ndarray) -> np.ndarray:
    q = _q5_values(b[:, 4:8], b[:, 8:]).astype(np.float32)
    return _f16_field(b, 0) * q + _f16_field(b, 2)


def _deq_q8_0(b: np.ndarray) -> np.ndarray:
    return b[:, 2:].view(np.int8).astype(np.float32) * _f16_field(b, 0)


def _levels(v: np.ndarray, top: int) -> np.ndarray:
    """C's `MIN(top, (int)v)` for v >= 0. Cast before clipping, like gguf, so that degenerate blocks (a subnormal
    scale whose inverse overflows) produce the same bytes as gguf on the same platform."""
    return np.trunc(v).astype(np.uint8).clip(0, top)


def _signed_absmax(x: np.ndarray) -> np.ndarray:
    """Per block, the value of largest magnitude with its sign (first one on ties), shape (n, 1)."""
    return np.take_along_axis(x, np.abs(x).argmax(axis=1)[:, None], axis=1)


def _q_q4_0(x: np.ndarray) -> np.ndarray:
    d = _signed_absmax(x) / _f32(-8)
    q = _levels(x * _inverse(d) + _f32(8.5), 15)
    return np.concatenate([_f16_bytes(d), _pack_nibbles(q[:, :16], q[:, 16:])], axis=1)


def _q_q4_1(x: np.ndarray) -> np.ndarray:
    lo = x.min(axis=1, keepdims=True)
    d = (x.max(axis=1, keepdims=True) - lo) / _f32(15)
    q = _levels((x - lo) * _inverse(d) + _f32(0.5), 15)
    return np.concatenate([_f16_bytes(d), _f16_bytes(lo), _pack_nibbles(q[:, :16], q[:, 16:])], axis=1)


def _q5_pack(q: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    qh = np.packbits(q >> np.uint8(4), axis=1, bitorder="little")
    return qh, _pack_nibbles(q[:, :16], q[:, 16:])


def _q_q5_0(x: np.ndarray) -> np.ndarray:
    d = _signed_absmax(x) / _f32(-16)
    q = _levels(x * _inverse(d) + _f32(16.5), 31)
    return np.concatenate([_f16_bytes(d), *_q5_pack(q)], axis=1)


def _q_q5_1(x: np.ndarray) -> np.ndarray:
    lo = x.min(axis=1, keepdims=True)
    d = (x.max(axis=1, keepdims=True) - lo) / _f32(31)
    q = _levels((x - lo) * _inverse(d) + _f32(0.5), 31)
    return np.concatenate([_f16_bytes(d), _f16_bytes(lo), *_q5_pack(q)], axis=1)


def _q_q8_0(x: np.ndarray) -> np.ndarray:
    d = np.abs(x).max(axis=1, keepdims=True) / _f32(127)
    q = _round_half_away(x * _inverse(d)).astype(np.int8)
    return np.concatenate([_f16_bytes(d), q.view(np.uint8)], axis=1)


# ----------------------------------------------------------------------------------------------------------- K-quants


def _crumbs(qs: np.ndarray) -> np.ndarray:
    """Q2_K/Q3_K low bits: (n, 64) bytes to (n, 256) 2-bit values in element order.

    Each 32-byte half covers 128 elements; bits 2j..2j+1 of byte l of half h belong to element 128h + 32j + l."""
    n = qs.shape[0]
    return ((qs.reshape(n, 2, 1, 32) >> _CRUMB_SHIFTS[None, None, :, None]) & np.uint8(3)).reshape(n, 256)


def _pack_crumbs(levels: np.ndarray) -> np.ndarray:
    """Inverse of _crumbs: (n, 256) values in [0, 3] to the (n, 64) byte field."""
    n = levels.shape[0]
    parts = levels.reshape(n, 2, 4, 32) << _CRUMB_SHIFTS[None, None, :, None]
    return np.bitwise_or.reduce(parts, axis=2).reshape(n, 64)


def _q3k_scales(s: np.ndarray) -> np.ndarray:
    """Unpack Q3_K's 12-byte field into 16 six-bit scales (n, 16) uint8, still offset by 32.

    Low nibbles: bytes 0-7 (scales 0-7), then their high nibbles (scales 8-15); the top two bits of scale j sit at
    bits 2*(j//4) of byte 8 + j%4."""
    low = np.concatenate([s[:, :8] & np.uint8(0x0F), s[:, :8] >> np.uint8(4)], axis=1)
    high = (s[:, None, 8:12] >> _CRUMB_SHIFTS[None, :, None]) & np.uint8(3)
    return low | (high.reshape(-1, 16) << np.uint8(4))


def _deq_q2_k(b: np.ndarray) -> np.ndarray:
    # layout: scales[16] (low nibble scale, high nibble min), qs[64], d, dmin
    n = b.shape[0]
    sc = b[:, :16]
    dl = (_f16_field(b, 80) * (sc & np.uint8(0x0F)).astype(np.float32))[:, :, None]
    ml = (_f16_field(b, 82) * (sc >> np.uint8(4)).astype(np.float32))[:, :, None]
    q = _crumbs(b[:, 16:80]).astype(np.float32).reshape(n, 16, 16)
    q *= dl
    q -= ml
    return q.reshape(n, 256)


def _deq_q3_k(b: np.ndarray) -> np.ndarray:
    # layout: hmask[32], qs[64], scales[12], d; a clear hmask bit means "subtract 4"
    n = b.shape[0]
    high = np.unpackbits(b[:, None, :32], axis=1, count=8, bitorder="little").reshape(n, 256)  # bit k: elems 32k+l
    q = (_crumbs(b[:, 32:96]) | (high << np.uint8(2))).astype(np.float32)
    q -= 4
    sc = _q3k_scales(b[:, 96:108]).astype(np.float32)
    sc -= 32
    dl = _f16_field(b, 108) * sc
    q = q.reshape(n, 16, 16)
    q *= dl[:, :, None]
    return q.reshape(n, 256)


def _k4_scales(s: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Unpack the 12-byte Q4_K/Q5_K field into 8 six-bit scales and 8 six-bit mins, each (n, 8) uint8."""
    a, b, c = s[:, 0:4], s[:, 4:8], s[:, 8:12]
    sc = np.concatenate([a & np.uint8(63), (c & np.uint8(0x0F)) | ((a >> np.uint8(6)) << np.uint8(4))], axis=1)
    mn = np.concatenate([b & np.uint8(63), (c >> np.uint8(4)) | ((b >> np.uint8(6)) << np.uint8(4))], axis=1)
    return sc, mn


def _k4_scales_bytes(ls: np.ndarray, lm: np.ndarray) -> np.ndarray:
    """Inverse of _k4_scales: (n, 8) six-bit scales and mins to the 12-byte field."""
    hi6 = np.uint8(6)
    return np.concatenate(
        [
            ls[:, :4] | ((ls[:, 4:] >> np.uint8(4)) << hi6),
            lm[:, :4] | ((lm[:, 4:] >> np.uint8(4)) << hi6),
            _pack_nibbles(ls[:, 4:], lm[:, 4:]),
        ],
        axis=1,
    )


def _k_affine(b: np.ndarray, q: np.ndarray) -> np.ndarray:
    """Q4_K/Q5_K: value = (d*scale) * q - dmin*min, per 32-element sub-block; q is (n, 8, 32) float32."""
    sc, mn = _k4_scales(b[:, 4:16])
    scale = (_f16_field(b, 0) * sc.astype(np.float32))[:, :, None]
    offset = (_f16_field(b, 2) * mn.astype(np.float32))[:, :, None]
    q *= scale
    q -= offset
    return q.reshape(-1, 256)


def _deq_q4_k(b: np.ndarray) -> np.ndarray:
    # each 32-byte group holds two sub-blocks: low nibbles, then high nibbles
    q = _nibbles(b[:, 16:144].reshape(-1, 32)).reshape(-1, 8, 32).astype(np.float32)
    return _k_affine(b, q)


def _deq_q5_k(b: np.ndarray) -> np.ndarray:
    low = _nibbles(b[:, 48:176].reshape(-1, 32)).reshape(-1, 8, 32)
    # bit k of qh byte l is the 5th bit of element 32*k + l
    high = np.unpackbits(b[:, None, 16:48], axis=1, count=8, bitorder="little")
    return _k_affine(b, (low | (high << np.uint8(4))).astype(np.float32))


def _deq_q6_k(b: np.ndarray) -> np.ndarray:
    n = b.shape[0]
    # per 128-element half: ql bytes 0-31 / 32-63 hold quarters 0,1 (low nibbles) and 2,3 (high nibbles)
    low = _nibbles(b[:, :128].reshape(n * 2, 64)).reshape(n, 2, 4, 32)
    qh = b[:, 128:192].reshape(n, 2, 1, 32)
    high = (qh >> np.array([0, 2, 4, 6], dtype=np.uint8)[None, None, :, None]) & np.uint8(3)
    q = (low | (high << np.uint8(4))).astype(np.float32).reshape(n, 16, 16)
    q -= 32
    scale = _f16_field(b, 208) * b[:, 192:208].view(np.int8).astype(np.float32)
    q *= scale[:, :, None]
    return q.reshape(n, 256)


def _nearest(v: np.ndarray) -> np.ndarray:
    """ggml's nearest_int (round half to even), kept as float32."""
    return np.rint(v)


def _nearest_int(v: np.ndarray) -> np.ndarray:
    """ggml's nearest_int bit for bit, as int32: add 1.5 * 2**23 in float32 and read the low mantissa bits.

    Equals round-half-to-even inside C's asserted range |v| <= 4194303; outside it (huge ratios from tiny scales)
    this reproduces what a release build of ggml computes, where np.rint would not."""
    bits = (np.asarray(v, dtype=np.float32) + _f32(12582912)).view(np.int32)
    return (bits & np.int32(0x007FFFFF)) - np.int32(0x00400000)


def _make_qkx2(
    x: np.ndarray, w: np.ndarray, nmax: int, rmin: float, rdelta: float, nstep: int, use_mad: bool = False
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """ggml's make_qkx2_quants for m sub-blocks at once; the error is weighted |diff| if use_mad, else diff^2.

    x, w: (k, m), element axis first so that `sum(axis=0)` accumulates in C's sequential order.
    Returns levels L (k, m) float32 in [0, nmax], scale (m,) and the (non-negative) min (m,).
    """
    f = _f32
    mx = x.max(axis=0)
    lo = np.minimum(x.min(axis=0), f(0))
    sum_w = w.sum(axis=0)
    sum_x = (w * x).sum(axis=0)
    flat = mx == lo

    iscale = f(nmax) / (mx - lo)
    scale = f(1) / iscale
    # exact nearest_int: for degenerate (subnormal-range) sub-blocks iscale overflows and C's bit trick decides
    levels = np.clip(_nearest_int(iscale * (x - lo)), 0, nmax).astype(np.float32)
    dist = np.abs if use_mad else np.square
    best = (w * dist(scale * levels + lo - x)).sum(axis=0)
    cur_min = lo
    for step in range(nstep + 1):
        # C updates `min` when a step wins, and later steps measure from it; so do we
        iscale = (f(rmin) + f(rdelta) * f(step) + f(nmax)) / (mx - cur_min)
        laux = np.clip(_nearest_int(iscale * (x - cur_min)), 0, nmax).astype(np.float32)
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


def _as_u8(v: np.ndarray) -> np.ndarray:
    """C's float -> int -> uint8_t conversion (wraps modulo 256)."""
    return (v.astype(np.int64) & 0xFF).astype(np.uint8)


def _quant_k_affine(x: np.ndarray, nmax: int, rmin: float, rdelta: float, nstep: int) -> tuple[np.ndarray, ...]:
    """Shared part of quantize_row_q4_K_ref / q5_K_ref: returns d, dmin (f16 bytes), scales field, levels (n,8,32)."""
    f = _f32
    n = x.shape[0]
    xs = np.ascontiguousarray(x.reshape(n * 8, 32).T)
    av_x = np.sqrt(np.square(xs).sum(axis=0) / f(32))
    w = av_x + np.abs(xs)
    levels, scales, mins = _make_qkx2(xs, w, nmax, rmin, rdelta, nstep)
    levels = levels.T.reshape(n, 8, 32)
    scales = scales.reshape(n, 8)
    mins = mins.reshape(n, 8)

    max_scale = np.maximum(scales.max(axis=1, keepdims=True), f(0))
    max_min = np.maximum(mins.max(axis=1, keepdims=True), f(0))
    inv_scale = np.where(max_scale > 0, f(63) / max_scale, f(0))
    inv_min = np.where(max_min > 0, f(63) / max_min, f(0))
    ls = np.minimum(_as_u8(_nearest(inv_scale * scales)), np.uint8(63))
    lm = np.minimum(_as_u8(_nearest(inv_min * mins)), np.uint8(63))
    d16 = (max_scale / f(63)).astype(np.float16)
    dmin16 = (max_min / f(63)).astype(np.float16)

    d = (d16.astype(np.float32) * ls.astype(np.float32))[:, :, None]
    dm = (dmin16.astype(np.float32) * lm.astype(np.float32))[:, :, None]
    requant = np.clip(_nearest((x.reshape(n, 8, 32) + dm) / d), 0, nmax)
    levels = np.where(d == 0, levels, requant).astype(np.uint8)  # C skips sub-blocks whose scale is 0
    return d16.view(np.uint8), dmin16.view(np.uint8), _k4_scales_bytes(ls, lm), levels


def _q_q4_k(x: np.ndarray) -> np.ndarray:
    d, dmin, scales, levels = _quant_k_affine(x, 15, -1.0, 0.1, 20)
    pairs = levels.reshape(-1, 4, 2, 32)
    qs = _pack_nibbles(pairs[:, :, 0], pairs[:, :, 1]).reshape(-1, 128)
    return np.concatenate([d, dmin, scales, qs], axis=1)


def _q_q5_k(x: np.ndarray) -> np.ndarray:
    d, dmin, scales, levels = _quant_k_affine(x, 31, -0.5, 0.1, 15)
    qh = np.packbits(levels >> np.uint8(4), axis=1, bitorder="little").reshape(-1, 32)
    pairs = levels.reshape(-1, 4, 2, 32)
    qs = _pack_nibbles(pairs[:, :, 0], pairs[:, :, 1]).reshape(-1, 128)
    return np.concatenate([d, dmin, scales, qh, qs], axis=1)


def _by_sub_block16(x: np.ndarray, fit: Callable[..., tuple[np.ndarray, ...]], *args: Any) -> tuple[np.ndarray, ...]:
    """Run a sub-block fitter over the 16 sub-blocks of 16 elements of every 256-block of x (n, 256). The fitter
    takes them element axis first, (16, n * 16); its levels come back as (n, 16, 16), its other outputs as (n, 16)."""
    n = x.shape[0]
    levels, *rest = fit(np.ascontiguousarray(x.reshape(n * 16, 16).T), *args)
    return (levels.T.reshape(n, 16, 16), *(r.reshape(n, 16) for r in rest))


def _q_q2_k(x: np.ndarray) -> np.ndarray:
    """quantize_row_q2_K_ref: 16 sub-blocks of 16, each an affine 2-bit fit; 4-bit scales and mins per sub-block."""
    f = _f32
    n = x.shape[0]
    levels, scales, mins = _by_sub_block16(x, lambda xs: _make_qkx2(xs, np.abs(xs), 3, -0.5, 0.1, 15, use_mad=True))

    # C starts both maxima at 0 and takes strictly larger values: never -0.0, never negative, NaNs skipped (fmax)
    max_scale = np.fmax.reduce(scales, axis=1, keepdims=True)
    max_scale = np.where(max_scale > 0, max_scale, f(0))
    max_min = np.fmax.reduce(mins, axis=1, keepdims=True)
    max_min = np.where(max_min > 0, max_min, f(0))
    # C stores the int unclamped into a uint8 (wraps) and ORs the min's nibble above it
    ls = np.where(max_scale > 0, _nearest_int((f(15) / max_scale) * scales), 0)
    lm = np.where(max_min > 0, _nearest_int((f(15) / max_min) * mins), 0)
    sc = ((ls & 0xFF) | ((lm << 4) & 0xFF)).astype(np.uint8)
    d16 = (max_scale / f(15)).astype(np.float16)
    dmin16 = (max_min / f(15)).astype(np.float16)

    d = d16.astype(np.float32) * (sc & np.uint8(0x0F)).astype(np.float32)
    dm = dmin16.astype(np.float32) * (sc >> np.uint8(4)).astype(np.float32)
    xb = x.reshape(n, 16, 16)
    requant = np.clip(_nearest_int((xb + dm[:, :, None]) / d[:, :, None]), 0, 3)
    # C keeps make_qkx2's levels in sub-blocks whose decoded scale is 0
    levels = np.where((d == 0)[:, :, None], levels, requant).astype(np.uint8).reshape(n, 256)
    return np.concatenate([sc, _pack_crumbs(levels), d16.view(np.uint8), dmin16.view(np.uint8)], axis=1)


def _make_q3(x: np.ndarray, nmax: int) -> tuple[np.ndarray, np.ndarray]:
    """ggml's make_q3_quants with do_rmse=true, for m sub-blocks at once.

    x: (k, m), element axis first. Returns levels (k, m) int32 in [0, 2*nmax) and the scale (m,). The refinement
    visits elements in order and each accepted change feeds the next decision (Gauss-Seidel), so the element loop
    stays a Python loop over vectors of m; sums are kept in C's sequential order."""
    f = _f32
    k, m = x.shape
    ax = np.abs(x)
    imax = ax.argmax(axis=0)  # first maximum, as C's strict '>'
    cols = np.arange(m)
    amax = ax[imax, cols]
    mx = x[imax, cols]
    iscale = f(-nmax) / mx
    lv = np.clip(_nearest_int(iscale * x), -nmax, nmax - 1)
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
            new_l = np.clip(_nearest_int(x[i] * sl2 / slx), -nmax, nmax - 1)
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
    zero = amax < _GROUP_MAX_EPS
    scale = np.where(suml2 > 0, sumlx / suml2, f(0))
    return np.where(zero, 0, lv + nmax), np.where(zero, f(0), scale)


def _q_q3_k(x: np.ndarray) -> np.ndarray:
    """quantize_row_q3_K_ref: 16 sub-blocks of 16 with symmetric 3-bit levels, 6-bit signed scales."""
    f = _f32
    n = x.shape[0]
    levels, scales = _by_sub_block16(x, _make_q3, 4)

    # C keeps the first scale of strictly largest |scale| above 0: a NaN scale (float32 overflow of x**3 in
    # make_q3_quants for |x| > ~1e19) never wins, where argmax would pick it
    ascale = np.abs(scales)
    imax = np.where(np.isnan(ascale), f(0), ascale).argmax(axis=1)[:, None]
    max_scale = np.take_along_axis(scales, imax, axis=1)
    max_scale = np.where(np.take_along_axis(ascale, imax, axis=1) > 0, max_scale, f(0))
    nonzero = max_scale != 0
    iscale = f(-32) / max_scale
    l8 = ((_nearest_int(iscale * scales) + 128) & 0xFF) - 128  # C assigns the int to an int8_t
    ls = np.where(nonzero, np.clip(l8, -32, 31) + 32, 0).astype(np.uint8)
    high = (ls >> np.uint8(4)).reshape(n, 4, 4) << _CRUMB_SHIFTS[None, :, None]
    sc = np.concatenate(
        [_pack_nibbles(ls[:, :8], ls[:, 8:]), np.bitwise_or.reduce(high, axis=1)], axis=1
    )  # the inverse of _q3k_scales
    d16 = np.where(nonzero, f(1) / iscale, f(0)).astype(np.float16)

    # requantize with the scales as stored (C decodes them back from the bytes)
    d = d16.astype(np.float32) * (_q3k_scales(sc).astype(np.float32) - f(32))
    xb = x.reshape(n, 16, 16)
    requant = np.clip(_nearest_int(xb / d[:, :, None]), -4, 3) + 4
    # sub-blocks whose decoded scale is 0 keep make_q3_quants' levels
    levels = np.where((d == 0)[:, :, None], levels, requant).astype(np.uint8).reshape(n, 256)
    # level bit 2 goes to hmask: byte l, bit k for element 32k + l
    hmask = np.packbits(levels.reshape(n, 8, 32) >> np.uint8(2), axis=1, bitorder="little").reshape(n, 32)
    return np.concatenate([hmask, _pack_crumbs(levels & np.uint8(3)), sc, d16.view(np.uint8)], axis=1)


def _make_qx(x: np.ndarray, nmax: int) -> tuple[np.ndarray, np.ndarray]:
    """ggml's make_qx_quants with rmse_type=1 and no importance weights, for m sub-blocks at once.

    x: (k, m), element axis first (sequential sums as in C). Returns levels (k, m) float32 in [0, 2*nmax) and scale.
    """
    f = _f32
    m = x.shape[1]
    ax = np.abs(x)
    imax = ax.argmax(axis=0)
    amax = ax[imax, np.arange(m)]
    mx = x[imax, np.arange(m)]
    w = x * x
    wx = w * x

    def trial(iscale: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        lv = np.clip(_nearest(iscale * x), -nmax, nmax - 1)
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
    zero = amax < _GROUP_MAX_EPS
    return np.where(zero, f(0), levels), np.where(zero, f(0), scale)


def _q_q6_k(x: np.ndarray) -> np.ndarray:
    f = _f32
    n = x.shape[0]
    levels, scales = _by_sub_block16(x, _make_qx, 32)

    imax = np.abs(scales).argmax(axis=1)[:, None]
    max_scale = np.take_along_axis(scales, imax, axis=1)
    zero_block = np.abs(max_scale) < _GROUP_MAX_EPS
    iscale = f(-128) / max_scale
    d16 = (f(1) / iscale).astype(np.float16)
    sc = np.clip(_nearest(iscale * scales), -128, 127).astype(np.int8)
    d = (d16.astype(np.float32) * sc.astype(np.float32))[:, :, None]
    requant = np.clip(_nearest(x.reshape(n, 16, 16) / d), -32, 31) + f(32)
    levels = np.where(d == 0, levels, requant).astype(np.uint8).reshape(n, 2, 4, 32)

    ql = _pack_nibbles(levels[:, :, 0:2], levels[:, :, 2:4]).reshape(n, 128)
    shifts = np.array([0, 2, 4, 6], dtype=np.uint8)[None, None, :, None]
    qh = np.bitwise_or.reduce((levels >> np.uint8(4)) << shifts, axis=2).reshape(n, 64)
    out = np.concatenate([ql, qh, sc.view(np.uint8), d16.view(np.uint8)], axis=1)
    out[zero_block[:, 0]] = 0  # C memsets an all-zero block
    return out


# ---------------------------------------------------------------------------------------- 4-bit non-linear (IQ4)

# ggml's kvalues_iq4nl: the 16 int8 levels both IQ4 types index with 4-bit codes
_IQ4_VALUES = np.array([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113], dtype=np.int8)
_IQ4_LEVELS = _IQ4_VALUES.astype(np.float32)
_IQ4_NTRY = 7  # scale candidates either side of the first guess (quantize_iq4_nl / quantize_iq4_xs)


def _iq4_decode(qs: np.ndarray, scale: np.ndarray) -> np.ndarray:
    """qs (n, k, 16) code bytes (per 32 elements: low nibbles, then high nibbles), scale (n, k) float32."""
    n, k, _ = qs.shape
    q = _IQ4_LEVELS[_nibbles(qs.reshape(n * k, 16)).reshape(n, k, 32)]
    q *= scale[:, :, None]
    return q.reshape(n, k * 32)


def _iq4_xs_scales(b: np.ndarray) -> np.ndarray:
    """The 8 six-bit sub-block scales (n, 8) uint8, still offset by 32: low nibbles in bytes 4-7 (even sub-block
    low, odd high), top two bits of sub-block j at bits 2j of the uint16 at byte 2."""
    low = _nibbles(b[:, 4:8]).transpose(0, 2, 1).reshape(-1, 8)
    high = (np.ascontiguousarray(b[:, 2:4]).view(np.uint16) >> np.arange(0, 16, 2, dtype=np.uint16)) & np.uint16(3)
    return low | (high.astype(np.uint8) << np.uint8(4))


def _deq_iq4_nl(b: np.ndarray) -> np.ndarray:
    return _iq4_decode(b[:, None, 2:18], _f16_field(b, 0))


def _deq_iq4_xs(b: np.ndarray) -> np.ndarray:
    sc = _iq4_xs_scales(b).astype(np.float32)
    sc -= 32
    return _iq4_decode(b[:, 8:136].reshape(-1, 8, 16), _f16_field(b, 0) * sc)


def _iq4_index(v: np.ndarray) -> np.ndarray:
    """ggml's best_index_int8 over the IQ4 levels: the nearest level, the upper one on ties (and for NaN)."""
    hi = np.searchsorted(_IQ4_LEVELS, v, side="right").clip(1, 15)  # NaN sorts last: 15, as C's search ends
    lo_v, hi_v = _IQ4_LEVELS[hi - 1], _IQ4_LEVELS[hi]
    idx = np.where(v - lo_v < hi_v - v, hi - 1, hi)
    return np.where(v <= _IQ4_LEVELS[0], 0, np.where(v >= _IQ4_LEVELS[15], 15, idx)).astype(np.uint8)


def _iq4_fit(x: np.ndarray) -> np.ndarray:
    """The scale quantize_row_iq4_nl_impl picks for each 32-element sub-block (no importance matrix: weights x^2).

    x: (32, m), element axis first (C's sequential sums). A first guess maps the largest |x| to the -127 end, then
    ntry scales either side are tried; the one maximising sum(w q x)^2 / sum(w q^2) wins (strictly, in order)."""
    f = _f32
    m = x.shape[1]
    ax = np.abs(x)
    ax = np.where(np.isnan(ax), f(0), ax)  # C's `fabsf(x) > amax` never takes a NaN
    imax = ax.argmax(axis=0)
    cols = np.arange(m)
    amax, mx = ax[imax, cols], x[imax, cols]
    w = x * x

    def sums(iscale: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        q = _IQ4_LEVELS[_iq4_index(iscale * x)]
        wq = w * q
        return (wq * x).sum(axis=0), (wq * q).sum(axis=0)

    sumqx, sumq2 = sums(f(1) / (-mx / _IQ4_LEVELS[0]))
    d = np.where(sumq2 > 0, sumqx / sumq2, f(0))
    best = d * sumqx
    for itry in range(-_IQ4_NTRY, _IQ4_NTRY + 1):
        sumqx, sumq2 = sums(f(itry + int(_IQ4_VALUES[0])) / mx)
        better = (sumq2 > 0) & (sumqx * sumqx > best * sumq2)
        d = np.where(better, sumqx / sumq2, d)
        best = np.where(better, d * sumqx, best)
    return np.where(amax < _GROUP_MAX_EPS, f(0), d)


def _iq4_pack(codes: np.ndarray) -> np.ndarray:
    """(n, k, 32) codes to (n, 16 k) bytes: element j in the low nibble of byte j, element 16 + j in its high one."""
    n = codes.shape[0]
    return _pack_nibbles(codes[:, :, :16], codes[:, :, 16:]).reshape(n, -1)


def _q_iq4_nl(x: np.ndarray) -> np.ndarray:
    d = _iq4_fit(np.ascontiguousarray(x.T))[:, None]
    codes = _iq4_index(_inverse(d) * x)  # C requantizes with the float scale, not the stored f16 one
    return np.concatenate([_f16_bytes(d), _iq4_pack(codes[:, None, :])], axis=1)


def _q_iq4_xs(x: np.ndarray) -> np.ndarray:
    """quantize_iq4_xs: 8 sub-blocks of 32 fitted as IQ4_NL, their scales then quantized to 6 bits (offset 32)
    against one f16 super-scale d = -max/32, where max is the (first) scale of largest magnitude."""
    f = _f32
    n = x.shape[0]
    scales = _iq4_fit(np.ascontiguousarray(x.reshape(n * 8, 32).T)).reshape(n, 8)
    ascale = np.abs(scales)
    imax = np.where(np.isnan(ascale), f(0), ascale).argmax(axis=1)[:, None]
    max_scale = np.take_along_axis(scales, imax, axis=1)
    max_scale = np.where(np.take_along_axis(ascale, imax, axis=1) > 0, max_scale, f(0))
    d = -max_scale / f(32)  # -0.0 for an all-zero block, stored as such
    ls = np.clip(_nearest_int(_inverse(d) * scales), -32, 31)
    dl = d * ls.astype(np.float32)
    codes = _iq4_index(_inverse(dl)[:, :, None] * x.reshape(n, 8, 32))
    ls = (ls + 32).astype(np.uint8)
    high = (ls >> np.uint8(4)).astype(np.uint16) << np.arange(0, 16, 2, dtype=np.uint16)
    scales_h = np.bitwise_or.reduce(high, axis=1, keepdims=True).view(np.uint8)
    scales_l = _pack_nibbles(ls[:, 0::2], ls[:, 1::2])
    return np.concatenate([_f16_bytes(d), scales_h, scales_l, _iq4_pack(codes)], axis=1)


# ---------------------------------------------------------------------------------------------------------- tables

_DEQUANT: dict[DType, Kernel] = {
    Q4_0: _deq_q4_0, Q4_1: _deq_q4_1, Q5_0: _deq_q5_0, Q5_1: _deq_q5_1, Q8_0: _deq_q8_0,
    Q2_K: _deq_q2_k, Q3_K: _deq_q3_k, Q4_K: _deq_q4_k, Q5_K: _deq_q5_k, Q6_K: _deq_q6_k,
    IQ4_NL: _deq_iq4_nl, IQ4_XS: _deq_iq4_xs,
}  # fmt: skip
_QUANT: dict[DType, Kernel] = {
    Q4_0: _q_q4_0, Q4_1: _q_q4_1, Q5_0: _q_q5_0, Q5_1: _q_q5_1, Q8_0: _q_q8_0,
    Q2_K: _q_q2_k, Q3_K: _q_q3_k, Q4_K: _q_q4_k, Q5_K: _q_q5_k, Q6_K: _q_q6_k,
    IQ4_NL: _q_iq4_nl, IQ4_XS: _q_iq4_xs,
}  # fmt: skip

QUANTIZABLE: tuple[DType, ...] = (F32, F16, BF16, *_QUANT)
DEQUANTIZABLE: tuple[DType, ...] = (F32, F16, BF16, *_DEQUANT)


def _resolve(qtype: QType) -> DType:
    try:
        return dtypes.get(qtype)
    except ValueError:
        name = getattr(qtype, "name", None)
        if isinstance(qtype, int) and isinstance(name, str):  # a gguf enum member ggml_py does not model
            raise NotImplementedError(f"type {name} is not supported by ggml_py.quants") from None
        raise


def _bf16_bits(x: np.ndarray) -> np.ndarray:
    """float32 to bfloat16 bit patterns, rounding to nearest even; NaNs stay (quiet) NaNs. As ggml's fp32_to_bf16."""
    u = x.view(np.uint32)
    rounded = (u.astype(np.uint64) + (0x7FFF + ((u >> np.uint32(16)) & np.uint32(1)))) >> np.uint64(16)
    nan = (u & np.uint32(0x7FFFFFFF)) > np.uint32(0x7F800000)
    return np.where(nan, (u >> np.uint32(16)) | np.uint32(0x40), rounded).astype(np.uint16)


# ------------------------------------------------------------------------------------------------------------ API


def quantize(data: np.ndarray, qtype: QType) -> np.ndarray:
    """Quantize floats to `qtype`, as gguf.quants.quantize does.

    Block types and BF16 return uint8 of shape (..., row bytes); F32 / F16 return the data cast to float32 / float16.
    The last dimension must be a multiple of the block size.
    """
    t = _resolve(qtype)
    data = np.asarray(data)
    if t is F32:
        return data.astype(np.float32, copy=False)
    if t is F16:
        return data.astype(np.float16, copy=False)
    if t is not BF16 and t not in _QUANT:
        raise NotImplementedError(f"quantization to {t.name} is not implemented")
    if data.ndim == 0 or data.shape[-1] % t.block_size:
        raise ShapeError(
            f"cannot quantize shape {data.shape} to {t.name}: last dimension must be a multiple of {t.block_size}"
        )
    x = np.ascontiguousarray(data, dtype=np.float32)
    out_shape = (*x.shape[:-1], x.shape[-1] // t.block_size * t.type_size)
    if t is BF16:
        return _bf16_bits(x).view(np.uint8).reshape(out_shape)
    blocks = x.reshape(-1, t.block_size)
    return _map_blocks(_QUANT[t], blocks, t.type_size, np.uint8, t.block_size).reshape(out_shape)


def dequantize(data: np.ndarray, qtype: QType) -> np.ndarray:
    """Decode raw rows of `qtype` to float32, as gguf.quants.dequantize does.

    `data` is read as bytes (any dtype; typically uint8 of shape (..., row bytes)); the result has the element shape
    (..., n). For F32 the result may be a view of `data`.
    """
    t = _resolve(qtype)
    if t is not F32 and t is not F16 and t is not BF16 and t not in _DEQUANT:
        raise NotImplementedError(f"dequantization of {t.name} is not implemented")
    raw = np.ascontiguousarray(data)
    if raw.ndim == 0:
        raise ShapeError(f"cannot dequantize a 0-d array as {t.name}")
    raw = raw.view(np.uint8)
    if raw.shape[-1] % t.type_size:
        raise ShapeError(
            f"cannot dequantize rows of {raw.shape[-1]} bytes as {t.name}: not a multiple of {t.type_size}"
        )
    if t is F32:
        return raw.view(np.float32)
    if t is F16:
        return raw.view(np.float16).astype(np.float32)
    if t is BF16:
        return (raw.view(np.uint16).astype(np.uint32) << np.uint32(16)).view(np.float32)
    out_shape = (*raw.shape[:-1], raw.shape[-1] // t.type_size * t.block_size)
    blocks = raw.reshape(-1, t.type_size)
    return _map_blocks(_DEQUANT[t], blocks, t.block_size, np.float32, t.block_size).reshape(out_shape)


def quantize_rows(data: np.ndarray, qtype: QType) -> np.ndarray:
    """Like `quantize`, but always the raw storage: uint8 of shape (..., row bytes), also for F32 and F16."""
    t = _resolve(qtype)
    out = quantize(data, t)
    if t is F32 or t is F16:
        if out.ndim == 0:
            raise ShapeError(f"cannot quantize a 0-d array to {t.name} rows")
        out = np.ascontiguousarray(out).view(np.uint8)
    return out


def dequantize_rows(raw: np.ndarray, qtype: QType, n_cols: int) -> np.ndarray:
    """Raw rows (..., row_size(n_cols)) of `qtype` to float32 (..., n_cols), checking the row size."""
    t = _resolve(qtype)
    try:
        row_bytes = t.row_size(n_cols)
    except ValueError as e:
        raise ShapeError(str(e)) from None
    nbytes = raw.shape[-1] * raw.dtype.itemsize if raw.ndim else 0
    if nbytes != row_bytes:
        raise ShapeError(f"{t.name} rows of {n_cols} elements take {row_bytes} bytes, got {nbytes}")
    return dequantize(raw, t)
