"""The lazy Tensor node: shape, type, layout, op and sources. No data until a plan runs it."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any

import numpy as np

from ggml_py.errors import ShapeError
from ggml_py.ir import dtypes
from ggml_py.ir.dtypes import DType
from ggml_py.ir.symbolic import Dim, Sym, dim, upper

MAX_DIMS = 4
_MAX_BYTES = 2**48  # 256 TiB: beyond any machine's memory, and far from int64 overflow in byte offsets

# flags
INPUT = 1  # written by the user before compute (set_input)
OUTPUT = 2  # read by the user after compute; never reused by the allocator
PARAM = 4  # a weight: has host data, lives in a persistent buffer shared by every plan
STATE = 8  # persistent tensor without initial data (e.g. a KV cache); zeroed once, kept across computes and plans

_ids = itertools.count()



def contiguous_strides(shape: Sequence[Dim], dtype: DType) -> tuple[Dim, ...]:
    """Byte strides of a dense tensor in numpy order (ggml's nb reversed)."""
    if not shape:
        return ()
    strides: list[Dim] = [dtype.type_size]
    inner = shape[-1]
    if dtype.is_quantized:
        if not isinstance(inner, int):
            raise ShapeError(f"{dtype}: the innermost dimension of a quantized tensor cannot be symbolic")
        row: Dim = dtype.row_size(inner)
    else:
        row = inner * dtype.type_size
    outer = shape[:-1]
    for k, d in enumerate(reversed(outer)):
        strides.append(row)
        if k < len(outer) - 1:  # the outermost dim's size is in no stride (so (n_tok, n_kv), both symbolic, works)
            row = row * d
    return tuple(reversed(strides))


def nbytes_upper(shape: Sequence[Dim], strides: Sequence[Dim], dtype: DType) -> int:
    """Bytes spanned by a tensor with every symbol at its bound (ggml_nbytes)."""
    if not shape:
        return dtype.type_size
    ups = [upper(d) for d in shape]
    if any(d == 0 for d in ups):
        return 0
    size = dtype.row_size(ups[-1]) if dtype.is_quantized else (ups[-1] - 1) * upper(strides[-1]) + dtype.type_size
    for d, s in zip(ups[:-1], strides[:-1]):
        size += (d - 1) * upper(s)
    return size


class Tensor:
    """A node of a lazy graph. Create tensors with the functions of `ggml_py.ir.ops` / `ggml_py` (input, weight,
    ...)."""

    __slots__ = (
        "id", "shape", "dtype", "strides", "op", "src", "params", "name", "flags", "view_src", "view_offs", "data",
        "_static", "__weakref__",
    )

    def __init__(
        self,
        shape: Sequence[int | Sym | Dim],
        dtype: DType | str,
        *,
        op: str | None = None,
        src: Sequence[Tensor | None] = (),
        params: dict[str, Any] | None = None,
        name: str = "",
        flags: int = 0,
        view_src: Tensor | None = None,
        view_offs: Dim = 0,
        strides: Sequence[Dim] | None = None,
        data: np.ndarray | None = None,
    ) -> None:
        self.id = next(_ids)
        self.dtype = dtypes.get(dtype)
        shp = tuple(dim(d) for d in shape)
        if len(shp) > MAX_DIMS:
            raise ShapeError(f"{op or 'tensor'}: at most {MAX_DIMS} dimensions, got shape {shp}")
        if any(isinstance(d, int) and d < 0 for d in shp):
            raise ShapeError(f"{op or 'tensor'}: negative dimension in shape {shp}")
        if self.dtype.is_quantized and shp and isinstance(shp[-1], int) and shp[-1] % self.dtype.block_size:
            raise ShapeError(
                f"{op or 'tensor'}: innermost dimension {shp[-1]} of a {self.dtype} tensor is not a multiple of "
                f"its block size {self.dtype.block_size}"
            )
        n = 1
        for d in shp:
            n *= upper(d)
        n = n * self.dtype.type_size // self.dtype.block_size
        if n >= _MAX_BYTES:  # no allocator can satisfy it; refused here rather than by a backend's bad_alloc
            raise ShapeError(f"{op or 'tensor'}: shape {list(shp)} of {self.dtype} would take {n} bytes, more than "
                             f"2^{_MAX_BYTES.bit_length() - 1}")
        self.shape: tuple[Dim, ...] = shp
        self.strides: tuple[Dim, ...] = tuple(strides) if strides is not None else contiguous_strides(shp, self.dtype)
        self.op = op
        self.src: tuple[Tensor | None, ...] = tuple(src)
        self.params: dict[str, Any] = dict(params or {})
        self.name = name or (f"{op.lower()}_{self.id}" if op else f"leaf_{self.id}")
        self.flags = flags
        # A view aliases the memory of its root at a byte offset; the allocator never gives it memory of its own.
        if view_src is not None and view_src.view_src is not None:
            view_offs = view_src.view_offs + view_offs
            view_src = view_src.view_src
        self.view_src = view_src
        self.view_offs = view_offs
        self.data = data
        self._static: dict[str, Any] = {}  # persistent placement of PARAM/STATE tensors, per buffer type name

    # -- properties -----------------------------------------------------------------------------------------
    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def is_leaf(self) -> bool:
        return self.op is None

    @property
    def is_view(self) -> bool:
        return self.view_src is not None

    @property
    def is_symbolic(self) -> bool:
        return any(not isinstance(d, int) for d in (*self.shape, *self.strides, self.view_offs))

    @property
    def nbytes(self) -> int:
        """Bytes spanned with every symbolic dimension at its upper bound."""
        return nbytes_upper(self.shape, self.strides, self.dtype)

    def numel(self) -> Dim:
        n: Dim = 1
        for d in self.shape:
            n = n * d
        return n

    def is_contiguous(self) -> bool:
        return tuple(self.strides) == contiguous_strides(self.shape, self.dtype)

    def set_name(self, name: str) -> Tensor:
        self.name = name
        return self

    def set_output(self) -> Tensor:
        self.flags |= OUTPUT
        return self

    def __repr__(self) -> str:
        what = self.op or ("weight" if self.flags & PARAM else "state" if self.flags & STATE else "input")
        return f"Tensor({self.name!r}, {what}, {list(self.shape)}, {self.dtype})"

    # Operator sugar (+, -, *, /, unary -, @) is attached by ggml_py.ir.ops, which builds the nodes: a tensor does
    # not know the ops.


def _leaf(shape: Sequence[int | Sym | Dim], dtype: DType | str, name: str, flags: int,
          data: np.ndarray | None = None) -> Tensor:
    return Tensor(shape, dtype, name=name, flags=flags, data=data)


def input(shape: Sequence[int | Sym | Dim], dtype: DType | str = dtypes.F32, name: str = "") -> Tensor:  # noqa: A001
    """A graph input: written with `plan.set_input(name, array)` before each compute."""
    return _leaf(shape, dtype, name, INPUT)


def state(shape: Sequence[int], dtype: DType | str = dtypes.F32, name: str = "") -> Tensor:
    """A persistent tensor (e.g. a KV cache): zeroed once, kept across computes and across plans."""
    return _leaf(shape, dtype, name, STATE)


def weight(data: np.ndarray, dtype: DType | str | None = None, shape: Sequence[int] | None = None,
           name: str = "") -> Tensor:
    """A constant weight with host data.

    Scalar types: `data` is an array of that type and shape. Quantized types: `data` holds the raw blocks
    (uint8, any shape with the right byte count) and `shape` gives the element shape.
    """
    t = dtypes.get(dtype) if dtype is not None else dtypes.get(data.dtype)
    if t.is_quantized or t is dtypes.BF16:
        if shape is None:
            raise ShapeError(f"weight {name!r}: a {t} weight needs its element shape")
        shp = tuple(int(d) for d in shape)
    else:
        shp = tuple(data.shape) if shape is None else tuple(int(d) for d in shape)
        data = np.asarray(data, dtype=t.np_dtype)
    w = Tensor(shp, t, name=name, flags=PARAM)
    if data.nbytes != w.nbytes:
        raise ShapeError(f"weight {name!r}: {data.nbytes} bytes of data for a {t} tensor of shape {shp} "
                         f"which needs {w.nbytes}")
    w.data = data
    return w
