"""Tensor element types: plain scalars and ggml's block-quantized formats.

Ids are ggml's (`gguf.GGMLQuantizationType` values) so GGUF files map directly.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class DType:
    name: str
    ggml_id: int
    block_size: int  # elements per block (1 for scalar types)
    type_size: int  # bytes per block
    np_dtype: np.dtype | None  # numpy storage type for scalar types, None for quantized

    @property
    def is_quantized(self) -> bool:
        return self.block_size > 1

    def row_size(self, n: int) -> int:
        """Bytes taken by `n` consecutive elements (n must be a multiple of the block size)."""
        if n % self.block_size:
            raise ValueError(f"{self.name}: row of {n} elements is not a multiple of the block size {self.block_size}")
        return n // self.block_size * self.type_size

    def __repr__(self) -> str:
        return self.name


F32 = DType("F32", 0, 1, 4, np.dtype(np.float32))
F16 = DType("F16", 1, 1, 2, np.dtype(np.float16))
Q4_0 = DType("Q4_0", 2, 32, 18, None)
Q4_1 = DType("Q4_1", 3, 32, 20, None)
Q5_0 = DType("Q5_0", 6, 32, 22, None)
Q5_1 = DType("Q5_1", 7, 32, 24, None)
Q8_0 = DType("Q8_0", 8, 32, 34, None)
Q8_1 = DType("Q8_1", 9, 32, 36, None)
Q2_K = DType("Q2_K", 10, 256, 84, None)
Q3_K = DType("Q3_K", 11, 256, 110, None)
Q4_K = DType("Q4_K", 12, 256, 144, None)
Q5_K = DType("Q5_K", 13, 256, 176, None)
Q6_K = DType("Q6_K", 14, 256, 210, None)
Q8_K = DType("Q8_K", 15, 256, 292, None)
IQ4_NL = DType("IQ4_NL", 20, 32, 18, None)
IQ4_XS = DType("IQ4_XS", 23, 256, 136, None)
I8 = DType("I8", 24, 1, 1, np.dtype(np.int8))
I16 = DType("I16", 25, 1, 2, np.dtype(np.int16))
I32 = DType("I32", 26, 1, 4, np.dtype(np.int32))
I64 = DType("I64", 27, 1, 8, np.dtype(np.int64))
BF16 = DType("BF16", 30, 1, 2, np.dtype(np.uint16))  # stored as raw 16-bit patterns

ALL: tuple[DType, ...] = (
    F32, F16, BF16, I8, I16, I32, I64, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q8_1, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, Q8_K,
    IQ4_NL, IQ4_XS,
)  # fmt: skip
# Block types ggml_py computes with: quants.py (de)quantizes every one of them. Q8_1 / Q8_K are only ggml's
# activation formats for its dot products and stay out.
QUANTIZED: tuple[DType, ...] = (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, IQ4_NL, IQ4_XS)
# Types a weight of mul_mat / get_rows may have.
WEIGHT_TYPES: tuple[DType, ...] = (F32, F16, BF16, *QUANTIZED)
FLOAT_TYPES: tuple[DType, ...] = (F32, F16, BF16)
INT_TYPES: tuple[DType, ...] = (I8, I16, I32, I64)

_BY_NAME = {t.name: t for t in ALL}
_BY_ID = {t.ggml_id: t for t in ALL}


def get(spec: object) -> DType:
    """Resolve a DType from a DType, a name ('Q4_K', 'f32'), a ggml id, a gguf enum, or a numpy dtype."""
    if isinstance(spec, DType):
        return spec
    if isinstance(spec, str):
        t = _BY_NAME.get(spec.upper())
        if t is None:
            raise ValueError(f"unknown type {spec!r}; known: {', '.join(_BY_NAME)}")
        return t
    if isinstance(spec, int) and not isinstance(spec, bool):  # also IntEnum such as gguf.GGMLQuantizationType
        t = _BY_ID.get(int(spec))
        if t is None:
            raise ValueError(f"unknown ggml type id {int(spec)}")
        return t
    try:
        npd = np.dtype(spec)  # type: ignore[call-overload]
    except TypeError:
        raise ValueError(f"cannot interpret {spec!r} as a ggml_py type") from None
    for t in (F32, F16, I8, I16, I32, I64):
        if t.np_dtype == npd:
            return t
    raise ValueError(f"numpy dtype {npd} has no ggml_py type")


def from_ggml_id(type_id: int) -> DType | None:
    """The DType for a ggml type id, or None where ggml_py does not know it."""
    return _BY_ID.get(type_id)
