"""What a conformance case is: one small graph, seeded random inputs, an NMSE threshold (the families: cases.py).

Each case names its op (ggml's upper-case name), a case string with the shapes and params (numpy order, see
docs/architecture.md), a types string, and a builder. `Case.build()` makes a fresh graph and its input values; the
data depend only on the case id, so a case is reproducible however the list is filtered.

Thresholds (NMSE = Σ(ref−out)²/Σref², see runner.py) follow ggml's test-backend-ops: 1e-7 by default, 5e-4 for
MUL_MAT of block-quantized weights and FLASH_ATTN_EXT (backends may quantize activations or use F16 accumulators),
but 1e-10 for MUL_MAT of F32/F16/BF16 weights (exact products summed in F32: activations must not be rounded),
1e-6 for SOFT_MAX, and 0 for
pure data movement (copies to the same type, CONT, CONCAT, REPEAT, PAD, GET_ROWS of non-quantized rows), ARGMAX and
integer results. Conversions to a narrower type (CPY, SET_ROWS) use `CONVERT_MAX_NMSE`: about a quarter of the
format's own round-trip error on uniform(-1, 1) data. That accepts a converter that differs from the reference only
at rounding ties or by computing with a reciprocal, and rejects a different rounding rule (truncation) or scale rule,
which measure 2-5x the round-trip error.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from ggml_py.formats.quants import quantize
from ggml_py.ir import ops, schema
from ggml_py.ir.dtypes import (
    BF16,
    F16,
    F32,
    I32,
    I64,
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
)  # fmt: skip
from ggml_py.ir.symbolic import Dim, evaluate
from ggml_py.ir.tensor import PARAM, Tensor
from ggml_py.ir.tensor import input as _input
from ggml_py.ir.tensor import weight as _weight

__all__ = ["ALL_OPS", "CONVERT_MAX_NMSE", "RELAYOUTS", "WEIGHT_TYPES", "Built", "Case", "Ctx", "bound_values", "encode",
           "layout_text", "shape_text"]

# Every op the kit covers: every compute op of the schema (view ops are exercised as inputs of these).
ALL_OPS: tuple[str, ...] = schema.COMPUTE_OPS

DEFAULT_MAX_NMSE = schema.NMSE_DEFAULT
MUL_MAT_MAX_NMSE = schema.OPS["MUL_MAT"].max_nmse
MUL_MAT_FLOAT_MAX_NMSE = schema.OPS["MUL_MAT"].max_nmse_float or MUL_MAT_MAX_NMSE
FLASH_ATTN_MAX_NMSE = schema.OPS["FLASH_ATTN_EXT"].max_nmse
SOFT_MAX_MAX_NMSE = schema.OPS["SOFT_MAX"].max_nmse

# Converting F32 values to a narrower type (see the module docstring for why these values).
CONVERT_MAX_NMSE: dict[str, float] = {
    "F32": 0.0, "F16": 1e-7, "BF16": 1e-6, "Q8_0": 5e-6, "Q5_0": 2.5e-4, "Q5_1": 2.5e-4, "Q4_0": 1e-3, "Q4_1": 1e-3,
    # round trips measured on uniform(-1, 1) rows of 256: Q6_K 1.75e-4, Q5_K 7.6e-4, Q4_K 3.0e-3, Q3_K 1.6e-2,
    # Q2_K 5.4e-2
    "Q6_K": 5e-5, "Q5_K": 2e-4, "Q4_K": 7.5e-4, "Q3_K": 4e-3, "Q2_K": 1.5e-2,
}  # fmt: skip

WEIGHT_TYPES: tuple[DType, ...] = (
    F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, IQ4_NL, IQ4_XS,
)  # fmt: skip


@dataclass
class Built:
    """A case's graph: its output tensors and the values of its inputs (raw bytes for BF16/quantized inputs)."""

    outputs: list[Tensor]
    inputs: list[tuple[Tensor, np.ndarray]]


@dataclass(frozen=True)
class Case:
    """One conformance case. `build()` returns a fresh graph with seeded input values."""

    op: str
    case: str
    types: str
    make: Callable[[Ctx], Tensor | Sequence[Tensor]] = field(repr=False, compare=False)
    max_nmse: float = DEFAULT_MAX_NMSE
    note: str = ""
    # a graph with symbolic dims is prepared once and computed at each of these symbol values in turn, every input
    # cut to the bound shape (the leading part of the values made at the upper bounds): as a model's plan is
    bindings: tuple[Mapping[str, int], ...] = field(default=(), compare=False)

    @property
    def id(self) -> str:
        return f"{self.op}[{self.types}]({self.case})"

    def limit(self, precision: str = "exact") -> float:
        """The NMSE a backend of this precision tier (schema.PRECISION_TIERS) may reach: a "reduced" backend is
        held to the op's max_nmse where the case uses its max_nmse_float (MUL_MAT of float weights)."""
        op = schema.OPS[self.op]
        if precision == "reduced" and op.max_nmse_float is not None and self.max_nmse == op.max_nmse_float:
            return max(self.max_nmse, op.max_nmse)
        return self.max_nmse

    @property
    def seed(self) -> int:
        return zlib.crc32(self.id.encode())

    def build(self) -> Built:
        ctx = Ctx(np.random.default_rng(self.seed))
        out = self.make(ctx)
        outs = [out] if isinstance(out, Tensor) else list(out)
        return Built(outs, ctx.inputs)

    def __str__(self) -> str:
        return self.id


# -- data helpers -------------------------------------------------------------------------------------------------
def encode(values: np.ndarray, t: DType) -> np.ndarray:
    """Float values in the storage of type t: a typed array for F32/F16/I32/I64, raw uint8 rows otherwise
    (BF16 and block types, made by ggml_py.formats.quants.quantize)."""
    if t in (F32, F16, I32, I64):
        return np.ascontiguousarray(values, dtype=t.np_dtype)
    return np.ascontiguousarray(quantize(np.ascontiguousarray(values, dtype=np.float32), t), dtype=np.uint8)


# How a source the kit lays out anew (view_cases.py) is stored: "window", its rows inside wider rows of a larger input
# (one unit before each, two after: nb[1] larger than a row; in 3 or more dims a row more per matrix, so that nb[2]
# is not ne[1] * nb[1] either); "transposed", the transpose of a contiguous input with its last two dims swapped
# (nb[0] is a row's length); "strided", a 1-D source at every other element (nb[0] twice the element size). A unit is
# an element, or a block of a quantized type.
RELAYOUTS = ("window", "transposed", "strided")


class Ctx:
    """What a case builder uses: a seeded generator and helpers that make inputs and weights with data.

    `views` maps the index of a leaf (the inputs and weights in the order the builder makes them) to one of
    RELAYOUTS: that leaf is made as a view of other storage holding the same values (`made_views` keeps it). A `dry`
    context makes leaves without data, to see a case's graph cheaply (`leaves`)."""

    def __init__(self, rng: np.random.Generator, views: Mapping[int, str] | None = None, dry: bool = False) -> None:
        self.rng = rng
        self.inputs: list[tuple[Tensor, np.ndarray]] = []
        self._n = 0
        self.views = dict(views or {})
        self.dry = dry
        self.leaves: list[Tensor] = []
        self.made_views: dict[int, Tensor] = {}

    def _leaf(self, x: Tensor) -> Tensor:
        self.leaves.append(x)
        return x

    def uniform(self, shape: Sequence[int], lo: float = -1.0, hi: float = 1.0) -> np.ndarray:
        return self.rng.uniform(lo, hi, tuple(shape)).astype(np.float32)

    def _name(self, name: str) -> str:
        self._n += 1
        return f"{name or 'in'}{self._n}"

    def input(self, values: np.ndarray, t: DType = F32, name: str = "", shape: Sequence[Dim] | None = None) -> Tensor:
        """An input of type t holding `values` (converted/quantized as needed). `shape` may have symbolic dims
        (F32/F16/I32 only): `values` then hold the input at the symbols' upper bounds in a case with bindings, or at
        the size a compute binds them to (a symbol bound below its maximum by the values written)."""
        shape = values.shape if shape is None else tuple(shape)
        if self.dry:
            return self._leaf(_input(shape, t, name=self._name(name)))
        how = self.views.get(len(self.leaves))
        if how is not None:
            return self._leaf(self._relaid(encode(values, t), tuple(values.shape), t, how, name, weight=False))
        x = _input(shape, t, name=self._name(name))
        self.inputs.append((x, encode(values, t).reshape(-1).view(np.uint8)
                            if t.is_quantized or t is BF16 else encode(values, t)))
        return self._leaf(x)

    def rand(self, shape: Sequence[int], t: DType = F32, lo: float = -1.0, hi: float = 1.0, name: str = "") -> Tensor:
        return self.input(self.uniform(shape, lo, hi), t, name)

    def weight(self, shape: Sequence[int], t: DType, lo: float = -1.0, hi: float = 1.0, name: str = "") -> Tensor:
        """A weight (PARAM) of type t: random floats quantized with ggml_py.formats.quants.quantize."""
        values = self.uniform(shape, lo, hi)
        if self.dry:
            return self._leaf(Tensor(tuple(shape), t, name=self._name(name or "w"), flags=PARAM))
        data = encode(values, t)
        how = self.views.get(len(self.leaves))
        if how is not None:
            return self._leaf(self._relaid(data, tuple(shape), t, how, name or "w", weight=True))
        if t.is_quantized or t is BF16:
            return self._leaf(_weight(data.reshape(-1).view(np.uint8), t, shape=shape, name=self._name(name or "w")))
        return self._leaf(_weight(data, t, name=self._name(name or "w")))

    def _relaid(self, data: np.ndarray, shape: tuple[int, ...], t: DType, how: str, name: str,
                weight: bool) -> Tensor:
        """A view of logical `shape` whose elements are `data` (encoded in type t) inside storage laid out `how`
        (RELAYOUTS); the storage is a new input (or weight) and holds, besides, other values of the same data,
        so that a kernel reading the storage as if it were the view gets valid numbers, only the wrong ones."""
        ts, bs = t.type_size, t.block_size
        units = np.ascontiguousarray(data).reshape(-1).view(np.uint8).reshape(*shape[:-1], shape[-1] // bs, ts)
        n = units.shape[-2]
        if how == "window":
            store = units[..., [n - 1, *range(n), 0, 1 % n], :]
            sshape = (*shape[:-1], shape[-1] + 3 * bs)
            if len(shape) >= 3:  # a row more per matrix: nb[2] is not ne[1] * nb[1] either
                store = np.concatenate([store, store[..., :1, :, :]], axis=-3)
                sshape = (*shape[:-2], shape[-2] + 1, sshape[-1])
        elif how == "transposed" and len(shape) >= 2 and bs == 1:
            store = np.swapaxes(units, -2, -3)
            sshape = (*shape[:-2], shape[-1], shape[-2])
        elif how == "strided" and len(shape) == 1 and bs == 1:
            store = np.stack([units, np.roll(units, 1, axis=0)], axis=1)
            sshape = (2 * shape[0],)
        else:
            raise ValueError(f"cannot lay out a {t}{list(shape)} source as {how!r}")
        raw = np.ascontiguousarray(store).reshape(-1)
        typed = t in (F32, F16, I32, I64)
        if weight:
            base = (_weight(raw.view(t.np_dtype).reshape(sshape), t, name=self._name(name)) if typed
                    else _weight(raw, t, shape=sshape, name=self._name(name)))
        else:
            base = _input(sshape, t, name=self._name(name))
            self.inputs.append((base, raw.view(t.np_dtype).reshape(sshape) if typed else raw))
        if how == "window":  # the view starts at the row's first unit of the storage's first row
            v = ops.view(base, shape, strides=base.strides, offset=ts)
        elif how == "transposed":
            v = ops.transpose(base)
        else:
            v = ops.view(base, shape, strides=(2 * ts,), offset=0)
        self.made_views[len(self.leaves)] = v
        return v

    def layout(self, shape: Sequence[int], how: str, t: DType = F32, lo: float = -1.0, hi: float = 1.0) -> Tensor:
        """An operand of logical `shape` with a given memory layout.

        how: "cont" (contiguous input), "perm" (a permuted view, innermost dim not contiguous), "perm_outer"
        (outer dims permuted, rows contiguous), "trans" (a transposed view), "view" (a strided window at an offset of
        a larger input), "reshape" (a reshaped input).
        """
        shape = tuple(shape)
        n = len(shape)
        if how == "cont":
            return self.rand(shape, t, lo, hi)
        if how in ("perm", "perm_outer", "trans"):
            if how == "trans" or n < 3:
                axes = list(range(n))
                if n >= 2:
                    axes[-1], axes[-2] = axes[-2], axes[-1]
            elif how == "perm":
                axes = [*range(1, n), 0]  # the first dim of the base becomes innermost
            else:
                axes = [*range(1, n - 1), 0, n - 1]
            base = [0] * n
            for i, a in enumerate(axes):
                base[a] = shape[i]
            x = self.rand(base, t, lo, hi)
            return ops.transpose(x) if how == "trans" else ops.permute(x, axes)
        if how == "view":  # window of a larger tensor: two extra rows before, padding after each row
            pad = 3
            outer = shape[:-1] or (1,)
            big = (*outer[:-1], outer[-1] + 2, shape[-1] + pad)
            x = self.rand(big, t, lo, hi)
            es = t.type_size
            strides = list(x.strides)
            v = ops.view(x, (*outer, shape[-1]), strides=strides, offset=2 * strides[-2] + es)
            return v if len(shape) > 1 else ops.view(v, shape, strides=[es], offset=0)
        if how == "reshape":
            total = int(np.prod(shape))
            return ops.reshape(self.rand((total,), t, lo, hi), shape)
        raise ValueError(f"unknown layout {how!r}")


def bound_values(t: Tensor, values: np.ndarray, binding: Mapping[str, int]) -> np.ndarray:
    """An input's values for one binding of a symbolic case: the leading part of the upper-bound values."""
    if not binding or not t.is_symbolic:  # no bindings: the values bind the symbols themselves
        return values
    return np.ascontiguousarray(values[tuple(slice(0, evaluate(d, binding)) for d in t.shape)])


def shape_text(shape: Sequence[int]) -> str:
    return "[" + ",".join(str(int(d)) for d in shape) + "]"


def layout_text(how: str) -> str:
    return "" if how == "cont" else f",layout={how}"
