"""The 32-element block types Q4_0, Q4_1, Q5_0, Q5_1, Q8_0 (gguf.quants' semantics, bit for bit)."""

from __future__ import annotations

import numpy as np

from ggml_py.formats.quants.blocks import (
    f16_bytes,
    f16_field,
    f32,
    inverse_or_zero,
    pack_nibbles,
    round_half_away,
    unpack_nibbles,
)


def deq_q4_0(b: np.ndarray) -> np.ndarray:
    q = unpack_nibbles(b[:, 2:]).reshape(-1, 32).astype(np.float32)
    q -= 8
    return f16_field(b, 0) * q


def deq_q4_1(b: np.ndarray) -> np.ndarray:
    q = unpack_nibbles(b[:, 4:]).reshape(-1, 32).astype(np.float32)
    return f16_field(b, 0) * q + f16_field(b, 2)


def q5_values(qh: np.ndarray, qs: np.ndarray) -> np.ndarray:
    # qh is a little-endian uint32 whose bit j is the 5th bit of element j
    high = np.unpackbits(qh, axis=1, bitorder="little")
    return unpack_nibbles(qs).reshape(-1, 32) | (high << np.uint8(4))


def deq_q5_0(b: np.ndarray) -> np.ndarray:
    q = q5_values(b[:, 2:6], b[:, 6:]).astype(np.float32)
    q -= 16
    return f16_field(b, 0) * q


def deq_q5_1(b: np.ndarray) -> np.ndarray:
    q = q5_values(b[:, 4:8], b[:, 8:]).astype(np.float32)
    return f16_field(b, 0) * q + f16_field(b, 2)


def deq_q8_0(b: np.ndarray) -> np.ndarray:
    return b[:, 2:].view(np.int8).astype(np.float32) * f16_field(b, 0)


def trunc_levels(v: np.ndarray, top: int) -> np.ndarray:
    """C's `MIN(top, (int)v)` for v >= 0. Cast before clipping, like gguf, so that degenerate blocks (a subnormal
    scale whose inverse overflows) produce the same bytes as gguf on the same platform."""
    return np.trunc(v).astype(np.uint8).clip(0, top)


def signed_absmax(x: np.ndarray) -> np.ndarray:
    """Per block, the value of largest magnitude with its sign (first one on ties), shape (n, 1)."""
    return np.take_along_axis(x, np.abs(x).argmax(axis=1)[:, None], axis=1)


def q_q4_0(x: np.ndarray) -> np.ndarray:
    d = signed_absmax(x) / f32(-8)
    q = trunc_levels(x * inverse_or_zero(d) + f32(8.5), 15)
    return np.concatenate([f16_bytes(d), pack_nibbles(q[:, :16], q[:, 16:])], axis=1)


def q_q4_1(x: np.ndarray) -> np.ndarray:
    lo = x.min(axis=1, keepdims=True)
    d = (x.max(axis=1, keepdims=True) - lo) / f32(15)
    q = trunc_levels((x - lo) * inverse_or_zero(d) + f32(0.5), 15)
    return np.concatenate([f16_bytes(d), f16_bytes(lo), pack_nibbles(q[:, :16], q[:, 16:])], axis=1)


def q5_pack(q: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    qh = np.packbits(q >> np.uint8(4), axis=1, bitorder="little")
    return qh, pack_nibbles(q[:, :16], q[:, 16:])


def q_q5_0(x: np.ndarray) -> np.ndarray:
    d = signed_absmax(x) / f32(-16)
    q = trunc_levels(x * inverse_or_zero(d) + f32(16.5), 31)
    return np.concatenate([f16_bytes(d), *q5_pack(q)], axis=1)


def q_q5_1(x: np.ndarray) -> np.ndarray:
    lo = x.min(axis=1, keepdims=True)
    d = (x.max(axis=1, keepdims=True) - lo) / f32(31)
    q = trunc_levels((x - lo) * inverse_or_zero(d) + f32(0.5), 31)
    return np.concatenate([f16_bytes(d), f16_bytes(lo), *q5_pack(q)], axis=1)


def q_q8_0(x: np.ndarray) -> np.ndarray:
    d = np.abs(x).max(axis=1, keepdims=True) / f32(127)
    q = round_half_away(x * inverse_or_zero(d)).astype(np.int8)
    return np.concatenate([f16_bytes(d), q.view(np.uint8)], axis=1)
