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

import numpy as np

from ggml_py.errors import ShapeError
from ggml_py.formats.quants.blocks import Kernel, map_blocks
from ggml_py.formats.quants.iq4 import deq_iq4_nl, deq_iq4_xs, q_iq4_nl, q_iq4_xs
from ggml_py.formats.quants.kquants import (
    deq_q2_k,
    deq_q3_k,
    deq_q4_k,
    deq_q5_k,
    deq_q6_k,
    q_q2_k,
    q_q3_k,
    q_q4_k,
    q_q5_k,
    q_q6_k,
)
from ggml_py.formats.quants.legacy import (
    deq_q4_0,
    deq_q4_1,
    deq_q5_0,
    deq_q5_1,
    deq_q8_0,
    q_q4_0,
    q_q4_1,
    q_q5_0,
    q_q5_1,
    q_q8_0,
)
from ggml_py.ir import dtypes
from ggml_py.ir.dtypes import (
    BF16,
    F16,
    F32,
    IQ4_NL,
    IQ4_XS,
    Q2_K,
    Q3_K,
    Q4_0,
    Q4_1,
    Q4_K,
    Q5_0,
    Q5_1,
    Q5_K,
    Q6_K,
    Q8_0,
    DType,
)

QType = DType | int | str  # also gguf.GGMLQuantizationType (an IntEnum)

# ---------------------------------------------------------------------------------------------------------- tables

DEQUANT: dict[DType, Kernel] = {
    Q4_0: deq_q4_0, Q4_1: deq_q4_1, Q5_0: deq_q5_0, Q5_1: deq_q5_1, Q8_0: deq_q8_0,
    Q2_K: deq_q2_k, Q3_K: deq_q3_k, Q4_K: deq_q4_k, Q5_K: deq_q5_k, Q6_K: deq_q6_k,
    IQ4_NL: deq_iq4_nl, IQ4_XS: deq_iq4_xs,
}  # fmt: skip
QUANT: dict[DType, Kernel] = {
    Q4_0: q_q4_0, Q4_1: q_q4_1, Q5_0: q_q5_0, Q5_1: q_q5_1, Q8_0: q_q8_0,
    Q2_K: q_q2_k, Q3_K: q_q3_k, Q4_K: q_q4_k, Q5_K: q_q5_k, Q6_K: q_q6_k,
    IQ4_NL: q_iq4_nl, IQ4_XS: q_iq4_xs,
}  # fmt: skip

QUANTIZABLE: tuple[DType, ...] = (F32, F16, BF16, *QUANT)
DEQUANTIZABLE: tuple[DType, ...] = (F32, F16, BF16, *DEQUANT)


def resolve(qtype: QType) -> DType:
    try:
        return dtypes.get(qtype)
    except ValueError:
        name = getattr(qtype, "name", None)
        if isinstance(qtype, int) and isinstance(name, str):  # a gguf enum member ggml_py does not model
            raise NotImplementedError(f"type {name} is not supported by ggml_py.formats.quants") from None
        raise


def bf16_bits(x: np.ndarray) -> np.ndarray:
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
    t = resolve(qtype)
    data = np.asarray(data)
    if t is F32:
        return data.astype(np.float32, copy=False)
    if t is F16:
        return data.astype(np.float16, copy=False)
    if t is not BF16 and t not in QUANT:
        raise NotImplementedError(f"quantization to {t.name} is not implemented")
    if data.ndim == 0 or data.shape[-1] % t.block_size:
        raise ShapeError(
            f"cannot quantize shape {data.shape} to {t.name}: last dimension must be a multiple of {t.block_size}"
        )
    x = np.ascontiguousarray(data, dtype=np.float32)
    out_shape = (*x.shape[:-1], x.shape[-1] // t.block_size * t.type_size)
    if t is BF16:
        return bf16_bits(x).view(np.uint8).reshape(out_shape)
    blocks = x.reshape(-1, t.block_size)
    return map_blocks(QUANT[t], blocks, t.type_size, np.uint8, t.block_size).reshape(out_shape)


def dequantize(data: np.ndarray, qtype: QType) -> np.ndarray:
    """Decode raw rows of `qtype` to float32, as gguf.quants.dequantize does.

    `data` is read as bytes (any dtype; typically uint8 of shape (..., row bytes)); the result has the element shape
    (..., n). For F32 the result may be a view of `data`.
    """
    t = resolve(qtype)
    if t is not F32 and t is not F16 and t is not BF16 and t not in DEQUANT:
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
    return map_blocks(DEQUANT[t], blocks, t.block_size, np.float32, t.block_size).reshape(out_shape)


def quantize_rows(data: np.ndarray, qtype: QType) -> np.ndarray:
    """Like `quantize`, but always the raw storage: uint8 of shape (..., row bytes), also for F32 and F16."""
    t = resolve(qtype)
    out = quantize(data, t)
    if t is F32 or t is F16:
        if out.ndim == 0:
            raise ShapeError(f"cannot quantize a 0-d array to {t.name} rows")
        out = np.ascontiguousarray(out).view(np.uint8)
    return out


def dequantize_rows(raw: np.ndarray, qtype: QType, n_cols: int) -> np.ndarray:
    """Raw rows (..., row_size(n_cols)) of `qtype` to float32 (..., n_cols), checking the row size."""
    t = resolve(qtype)
    try:
        row_bytes = t.row_size(n_cols)
    except ValueError as e:
        raise ShapeError(str(e)) from None
    nbytes = raw.shape[-1] * raw.dtype.itemsize if raw.ndim else 0
    if nbytes != row_bytes:
        raise ShapeError(f"{t.name} rows of {n_cols} elements take {row_bytes} bytes, got {nbytes}")
    return dequantize(raw, t)
