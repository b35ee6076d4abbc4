"""What the block formats share: field access, nibble/crumb packing, C-like rounding, chunked mapping."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

f32 = np.float32
NIBBLE_SHIFTS = np.array([0, 4], dtype=np.uint8)
CRUMB_SHIFTS = np.array([0, 2, 4, 6], dtype=np.uint8)
# Elements per chunk when mapping a block kernel: bounds the temporaries and keeps them cache-sized.
CHUNK_ELEMS = 1 << 18
GROUP_MAX_EPS = f32(1e-15)

Kernel = Callable[[np.ndarray], np.ndarray]


# ---------------------------------------------------------------------------------------------------------- helpers


def f16_field(blocks: np.ndarray, off: int) -> np.ndarray:
    """The little-endian f16 at byte `off` of each block, as float32 of shape (n, 1)."""
    return np.ascontiguousarray(blocks[:, off : off + 2]).view(np.float16).astype(np.float32)


def f16_bytes(v: np.ndarray) -> np.ndarray:
    """float32 (n, 1) to its f16 encoding, (n, 2) uint8 (numpy's cast rounds to nearest even, as ggml does)."""
    return np.ascontiguousarray(v, dtype=np.float32).astype(np.float16).view(np.uint8)


def unpack_nibbles(qs: np.ndarray) -> np.ndarray:
    """(n, k) bytes to (n, 2, k) 4-bit values: all low nibbles first, then all high nibbles (ggml's order)."""
    return (qs[:, None, :] >> NIBBLE_SHIFTS[None, :, None]) & np.uint8(0x0F)


def pack_nibbles(lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
    return (lo & np.uint8(0x0F)) | (hi << np.uint8(4))


def round_half_away(v: np.ndarray) -> np.ndarray:
    """C's roundf (ties away from zero); np.rint would round ties to even. inf gives NaN, as in gguf."""
    a = np.abs(v)
    f = np.floor(a)
    return np.sign(v) * (f + np.floor(2 * (a - f)))


def inverse_or_zero(d: np.ndarray) -> np.ndarray:
    """1/d, 0 where d is 0 (ggml's `d ? 1.0f/d : 0.0f`)."""
    with np.errstate(divide="ignore"):
        return np.where(d == 0, f32(0), f32(1) / d)


def map_blocks(kernel: Kernel, blocks: np.ndarray, width: int, dtype: type, block_elems: int) -> np.ndarray:
    """Apply a (n, a) -> (n, width) block kernel over chunks of blocks (vectorised within a chunk)."""
    n = blocks.shape[0]
    out = np.empty((n, width), dtype=dtype)
    step = max(1, CHUNK_ELEMS // block_elems)
    with np.errstate(all="ignore"):  # NaN/inf inputs give garbage blocks, as in ggml, not warnings
        for s in range(0, n, step):
            out[s : s + step] = kernel(blocks[s : s + step])
    return out
