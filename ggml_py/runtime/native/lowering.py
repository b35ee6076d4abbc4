"""Lowering: ggml_py tensors and nodes written into the ABI's structs (ggml order, affine symbolic dims, op params)."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from ggml_py.errors import BackendError
from ggml_py.ir import schema
from ggml_py.ir.symbolic import Expr, upper
from ggml_py.ir.tensor import INPUT, OUTPUT, PARAM, STATE, Tensor
from ggml_py.runtime.native.abi import const, ffi


# -- lowering ----------------------------------------------------------------------------------------------------------
def _flags(t: Tensor) -> int:
    root = t.view_src if t.view_src is not None else t
    return (t.flags | root.flags) & (INPUT | OUTPUT | PARAM | STATE)


def ggml_layout(shape: Sequence[Any], strides: Sequence[Any], itemsize: int) -> tuple[list[Any], list[Any]]:
    """ne/nb (ints or affine expressions) in ggml order: numpy order reversed, padded to MAX_DIMS with dims of 1
    whose stride continues the last one (a 0-d tensor is one element)."""
    ne, nb = list(reversed(shape)) or [1], list(reversed(strides)) or [itemsize]
    while len(ne) < schema.MAX_DIMS:
        try:
            nb.append(nb[-1] * ne[-1])
        except ValueError:  # two symbolic dims (e.g. a mask (n_tok, n_kv)): any stride serves a dim of size 1
            nb.append(upper(nb[-1]) * upper(ne[-1]))
        ne.append(1)
    return ne, nb


def _write_layout(tc: Any, shape: Sequence[int], strides: Sequence[int], itemsize: int) -> None:
    ne, nb = ggml_layout(shape, strides, itemsize)
    for k in range(schema.MAX_DIMS):
        tc.ne[k] = ne[k]
        tc.nb[k] = nb[k]


def upper_layout(t: Tensor) -> tuple[tuple[int, ...], tuple[int, ...]]:
    return tuple(upper(d) for d in t.shape), tuple(upper(s) for s in t.strides)


def write_tensor(tc: Any, t: Tensor, shape: Sequence[int], strides: Sequence[int], data: int) -> None:
    root = t.view_src if t.view_src is not None else t
    tc.type = t.dtype.ggml_id
    tc.flags = _flags(t)
    tc.id = root.id + 1
    _write_layout(tc, shape, strides, t.dtype.type_size)
    tc.data = ffi().cast("void *", data)


def write_affine(ac: Any, value: Any, index: Mapping[str, int], what: str) -> None:
    e = Expr.of(value)
    if len(e.terms) > const("GGML_PY_MAX_TERMS"):
        raise BackendError(f"{what}: {e} has more symbolic terms than the C ABI carries")
    ac.c = e.const
    ac.n_terms = len(e.terms)
    for k, (s, c) in enumerate(e.terms):
        ac.sym[k] = index[s.name]
        ac.coef[k] = c


def _write_params(nc: Any, n: Tensor) -> None:
    for slot, is_float, value in schema.get(n.op).encode(n.params, n.ndim):
        if isinstance(value, Expr):
            raise BackendError(f"{n.op} ({n.name}): op param {value} is symbolic, which the C ABI cannot carry")
        if is_float:
            nc.params.f[slot] = value
        else:
            nc.params.i[slot] = int(value)


def write_node(nc: Any, n: Tensor, tensor_of: Callable[[Tensor], Any]) -> None:
    nc.op = schema.ABI_IDS[n.op or ""]
    nc.dst = tensor_of(n)
    last = 0
    for j, s in enumerate(n.src):
        if s is not None:
            nc.src[j] = tensor_of(s)
            last = j + 1
    nc.n_src = last
    _write_params(nc, n)
