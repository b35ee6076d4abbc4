"""The kit's edge cases: what the ordinary cases (cases.py) leave out and real plugins got wrong.

- special values for binary ops: every pair of zeros (±0), ±1, ±inf, NaN, large and tiny values, so that a divisor
  of 0, inf - inf and NaN propagate as IEEE arithmetic (and numpy) say;
- extreme parameters of the norms: eps 0, 1e-4 and 0.1 on tiny (1e-4) and huge (1e8) data, and rows of zeros,
  which give 0 (not NaN) only with the eps applied;
- symbolic dimensions: one plan computed at several bound values of its symbols in turn, larger and smaller than
  the last, as a model's plan is every step (a plugin that computes at the upper bound, or keeps a size from the
  first compute, reads rows that are not there).
"""

from __future__ import annotations

import numpy as np

from ggml_py.ir import ops, schema
from ggml_py.ir.dtypes import F16, F32, I32, Q8_0
from ggml_py.ir.symbolic import sym
from ggml_py.ir.tensor import Tensor
from ggml_py.testing.case import FLASH_ATTN_MAX_NMSE, MUL_MAT_FLOAT_MAX_NMSE, MUL_MAT_MAX_NMSE, Case, Ctx

# binary operands: every pair of these (a over rows, b over columns)
_BINARY_SPECIALS = np.array([0.0, -0.0, 1.0, -1.0, np.inf, -np.inf, np.nan, 3e38, -2.5, 1e-30], dtype=np.float32)


def _binary_special_cases() -> list[Case]:
    out = []
    n = len(_BINARY_SPECIALS)
    for op in schema.BINARY_OPS:
        fn = getattr(ops, op.lower())

        def make(c: Ctx, fn=fn) -> Tensor:
            a = np.repeat(_BINARY_SPECIALS, n).reshape(n, n)
            b = np.tile(_BINARY_SPECIALS, n).reshape(n, n)
            return fn(c.input(a), c.input(b))

        def make_row(c: Ctx, fn=fn) -> Tensor:  # b one row, tiled over a's rows
            return fn(c.input(np.repeat(_BINARY_SPECIALS, n).reshape(n, n)), c.input(_BINARY_SPECIALS[None, :]))

        out.append(Case(op, "specials: every pair of 0,-0,1,-1,inf,-inf,nan,3e38,-2.5,1e-30", "F32", make))
        out.append(Case(op, "specials: b one row of 0,-0,1,-1,inf,-inf,nan,3e38,-2.5,1e-30", "F32", make_row))
    return out


def _norm_edge_cases() -> list[Case]:
    out = []
    for op, fn in (("NORM", ops.norm), ("RMS_NORM", ops.rms_norm)):
        for eps in (0.0, 1e-4, 0.1):
            for scale in (1e-4, 1e8):
                def make(c: Ctx, fn=fn, eps=eps, scale=scale) -> Tensor:
                    x = c.uniform((6, 33)) * np.float32(scale)
                    if eps > 0:
                        x[2] = 0.0  # a row of zeros: 0 with eps, 0/0 without
                    return fn(c.input(x), eps)

                zeros = ",row 2 zeros" if eps > 0 else ""
                out.append(Case(op, f"shape=[6,33],eps={eps:g},data=uniform(-{scale:g},{scale:g}){zeros}", "F32",
                                make))
    return out


# symbol values computed in turn: up, down, the bound, the smallest
_T = sym("T", 9)
_N = sym("n_kv", 40)
_T_VALUES = (4, 9, 1, 6)
_TN_VALUES = ((3, 17), (9, 40), (1, 5), (5, 33))


def _t_bindings() -> tuple[dict[str, int], ...]:
    return tuple({"T": t} for t in _T_VALUES)


def _tn_bindings() -> tuple[dict[str, int], ...]:
    return tuple({"T": t, "n_kv": n} for t, n in _TN_VALUES)


def _symbolic_cases() -> list[Case]:
    out = []
    desc_t = "T in " + ",".join(map(str, _T_VALUES))
    desc_tn = "(T,n_kv) in " + ",".join(f"({t},{n})" for t, n in _TN_VALUES)

    def add(c: Ctx) -> Tensor:
        return ops.add(c.input(c.uniform((9, 33)), shape=(_T, 33)), c.rand((33,)))

    def rms_norm(c: Ctx) -> Tensor:
        return ops.rms_norm(c.input(c.uniform((9, 33)), shape=(_T, 33)), 1e-6)

    def sum_rows(c: Ctx) -> Tensor:  # a reduction over the symbolic dim
        return ops.sum_rows(c.input(c.uniform((4, 40)), shape=(4, _N)))

    def get_rows(c: Ctx) -> Tensor:
        idx = c.rng.integers(0, 20, 9).astype(np.int32)
        return ops.get_rows(c.rand((20, 33)), c.input(idx, I32, shape=(_T,)))

    def rope(c: Ctx) -> Tensor:
        pos = c.rng.integers(0, 512, 9).astype(np.int32)
        return ops.rope(c.input(c.uniform((9, 4, 64)), shape=(_T, 4, 64)), c.input(pos, I32, shape=(_T,)), 64)

    def soft_max(c: Ctx) -> Tensor:  # the (T, n_kv) scores and mask of an attention step
        x = c.input(c.uniform((9, 40), -4, 4), shape=(_T, _N))
        return ops.soft_max(x, c.input(c.uniform((9, 40)), shape=(_T, _N)), scale=0.5)

    def add_transposed(c: Ctx) -> Tensor:  # b's row stride is the symbol: wrong at any other binding
        return ops.add(c.input(c.uniform((9, 33)), shape=(_T, 33)),
                       ops.transpose(c.input(c.uniform((33, 9)), shape=(33, _T))))

    for op, make, desc, b in (("ADD", add, desc_t, _t_bindings()), ("RMS_NORM", rms_norm, desc_t, _t_bindings()),
                              ("ADD", add_transposed, f"b transposed from [33,T], {desc_t}", _t_bindings()),
                              ("SUM_ROWS", sum_rows, "n_kv in 17,40,5,33", _tn_bindings()),
                              ("GET_ROWS", get_rows, desc_t, _t_bindings()),
                              ("ROPE", rope, desc_t, _t_bindings()),
                              ("SOFT_MAX", soft_max, desc_tn, _tn_bindings())):
        types = {"GET_ROWS": "F32,I32", "ROPE": "F32,I32"}.get(op, "F32")
        mask = ",mask=[T,n_kv]" if op == "SOFT_MAX" else ""
        out.append(Case(op, f"symbolic: {desc}{mask}", types, make, max_nmse=schema.OPS[op].max_nmse, bindings=b))

    for wt in (F32, F16, Q8_0):
        def mul_mat(c: Ctx, wt=wt) -> Tensor:
            return ops.mul_mat(c.weight((16, 64), wt), c.input(c.uniform((9, 64)), shape=(_T, 64)))

        out.append(Case("MUL_MAT", f"symbolic: w=[16,64],b=[T,64],{desc_t}", f"{wt.name},F32", mul_mat,
                        max_nmse=MUL_MAT_MAX_NMSE if wt.is_quantized else MUL_MAT_FLOAT_MAX_NMSE,
                        bindings=_t_bindings()))

    def mul_mat_k(c: Ctx) -> Tensor:  # the sum runs over the symbol (attention's scores times V)
        return ops.mul_mat(c.input(c.uniform((16, 40)), shape=(16, _N)), c.input(c.uniform((9, 40)), shape=(_T, _N)))

    out.append(Case("MUL_MAT", f"symbolic: a=[16,n_kv],b=[T,n_kv],{desc_tn}", "F32,F32", mul_mat_k,
                    max_nmse=MUL_MAT_FLOAT_MAX_NMSE, bindings=_tn_bindings()))

    def flash_attn(c: Ctx) -> Tensor:
        """A model's attention step: T queries over the first n_kv rows of an F16 cache of 40 (Hk=2, D=64), read
        through a view whose row count is the symbol, and a (T, n_kv) mask."""
        hk, d = 2, 64
        cache_k = c.rand((40, hk * d), F16)
        cache_v = c.rand((40, hk * d), F16)
        es = F16.type_size
        k = ops.view(cache_k, (hk, _N, d), (d * es, hk * d * es, es))
        v = ops.view(cache_v, (hk, _N, d), (d * es, hk * d * es, es))
        q = c.input(c.uniform((4, 9, d)), shape=(4, _T, d))
        m = c.input(c.uniform((9, 40)), F16, shape=(_T, _N))
        return ops.flash_attn_ext(q, k, v, m, scale=0.125)

    out.append(Case("FLASH_ATTN_EXT", f"symbolic: q=[4,T,64],kv=view of [40,128] as [2,n_kv,64],{desc_tn}",
                    "F32,F16,F16", flash_attn, max_nmse=FLASH_ATTN_MAX_NMSE, bindings=_tn_bindings()))
    return out


def edge_cases() -> list[Case]:
    return [*_binary_special_cases(), *_norm_edge_cases(), *_symbolic_cases()]
