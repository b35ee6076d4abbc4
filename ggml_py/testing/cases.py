"""The conformance cases by op family, and their selection (`cases`); what a case is: case.py."""


from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

from ggml_py.ir import ops, schema
from ggml_py.ir.dtypes import (
    BF16,
    F16,
    F32,
    I32,
    I64,
    Q4_0,
    Q4_1,
    Q4_K,
    Q8_0,
    DType,
)  # fmt: skip
from ggml_py.ir.symbolic import sym
from ggml_py.ir.tensor import Tensor
from ggml_py.testing.case import (
    ALL_OPS,
    CONVERT_MAX_NMSE,
    DEFAULT_MAX_NMSE,
    FLASH_ATTN_MAX_NMSE,
    MUL_MAT_FLOAT_MAX_NMSE,
    MUL_MAT_MAX_NMSE,
    SOFT_MAX_MAX_NMSE,
    WEIGHT_TYPES,
    Case,
    Ctx,
    layout_text,
    shape_text,
)
from ggml_py.testing.edge_cases import edge_cases
from ggml_py.testing.view_cases import view_cases

__all__ = ["all_cases", "cases"]


# -- case families ------------------------------------------------------------------------------------------------
def _binary_cases() -> list[Case]:
    fns = {op: getattr(ops, op.lower()) for op in schema.BINARY_OPS}
    shapes: list[tuple[tuple[int, ...], tuple[int, ...], str, str]] = [
        ((1,), (1,), "cont", "cont"),
        ((7,), (7,), "cont", "cont"),
        ((4097,), (4097,), "cont", "cont"),
        ((3, 33), (3, 33), "cont", "cont"),
        ((2, 3, 4, 33), (1, 1, 1, 33), "cont", "cont"),
        ((2, 3, 4, 33), (2, 1, 4, 1), "cont", "cont"),
        ((2, 3, 4, 33), (1, 3, 1, 33), "cont", "cont"),
        ((7, 33), (7, 1), "cont", "cont"),
        ((7, 33), (33,), "cont", "cont"),
        ((4, 6, 33), (2, 3, 33), "cont", "cont"),  # ggml tiling: b repeats, this is not numpy broadcasting
        ((6, 10), (3, 5), "cont", "cont"),
        ((5, 7, 33), (1, 7, 33), "perm", "cont"),
        ((7, 33), (7, 33), "cont", "trans"),
        ((7, 33), (1, 33), "view", "cont"),
        ((7, 33), (7, 33), "reshape", "view"),
    ]
    out = []
    for op, fn in fns.items():
        for sa, sb, la, lb in shapes:
            lo, hi = (0.5, 1.5) if op == "DIV" else (-1.0, 1.0)  # keep the divisor away from zero

            def make(c: Ctx, fn=fn, sa=sa, sb=sb, la=la, lb=lb, lo=lo, hi=hi) -> Tensor:
                return fn(c.layout(sa, la), c.layout(sb, lb, lo=lo, hi=hi))

            lay = "" if la == lb == "cont" else f",layout=({la},{lb})"
            out.append(Case(op, f"a={shape_text(sa)},b={shape_text(sb)}{lay}", "F32", make))
    return out


_UNARY_RANGES = {"SQRT": (0.1, 2.0), "LOG": (0.1, 2.0), "EXP": (-2.0, 2.0)}
# Inputs whose results IEEE arithmetic fixes exactly (zeros, infinities, NaNs), for ops where that is unambiguous.
_SPECIALS = np.array([0.0, -0.0, 1.0, -1.0, np.inf, -np.inf, np.nan, 100.0, -100.0, 1e-30], dtype=np.float32)
# RELU follows ggml (x > 0 ? x : 0): relu(NaN) is 0 on every ggml backend, so it is 0 here too.
_SPECIAL_OPS = ("SQR", "SQRT", "NEG", "ABS", "EXP", "LOG", "TANH", "RELU")


def _unary_cases() -> list[Case]:
    fns = {op: getattr(ops, op.lower()) for op in schema.UNARY_OPS}
    layouts = [((1,), "cont"), ((7,), "cont"), ((33,), "cont"), ((4097,), "cont"), ((2, 3, 5, 33), "cont"),
               ((5, 7, 33), "perm"), ((7, 33), "view")]
    out = []
    for op, fn in fns.items():
        lo, hi = _UNARY_RANGES.get(op, (-3.0, 3.0))
        for shape, how in layouts:
            def make(c: Ctx, fn=fn, shape=shape, how=how, lo=lo, hi=hi) -> Tensor:
                return fn(c.layout(shape, how, lo=lo, hi=hi))

            out.append(Case(op, f"shape={shape_text(shape)}" + layout_text(how), "F32", make))
        if op in _SPECIAL_OPS:
            def make_sp(c: Ctx, fn=fn) -> Tensor:
                return fn(c.input(np.concatenate([_SPECIALS, c.uniform((23,), -2, 2)])))

            out.append(Case(op, "shape=[33],values=0,-0,±inf,nan,±100", "F32", make_sp,
                            note="non-finite results must appear at the same positions"))
    for shape, how, s, b in [((33,), "cont", 0.5, 0.0), ((7, 4097), "cont", -2.25, 0.75),
                             ((5, 7, 33), "perm", 1.5, -1.0)]:
        def make_scale(c: Ctx, shape=shape, how=how, s=s, b=b) -> Tensor:
            return ops.scale(c.layout(shape, how), s, b)

        out.append(Case("SCALE", f"shape={shape_text(shape)},s={s},b={b}" + layout_text(how),
                        "F32", make_scale))
    for shape, how, lo, hi in [((33,), "cont", -0.5, 0.5), ((7, 4097), "cont", -0.1, 0.9),
                               ((5, 7, 33), "perm", 0.0, 0.25)]:
        def make_clamp(c: Ctx, shape=shape, how=how, lo=lo, hi=hi) -> Tensor:
            return ops.clamp(c.layout(shape, how), lo, hi)

        out.append(Case("CLAMP", f"shape={shape_text(shape)},min={lo},max={hi}" + layout_text(how),
                        "F32", make_clamp))
    return out


def _glu_cases() -> list[Case]:
    out = []
    for op, fn in ((op, getattr(ops, op.lower())) for op in schema.GLU_OPS):
        for shape, split, how in [((7, 66), False, "cont"), ((2, 3, 34), False, "cont"), ((7, 33), True, "cont"),
                                  ((5, 7, 33), True, "perm"), ((1, 4097), True, "cont")]:
            def make(c: Ctx, fn=fn, shape=shape, split=split, how=how) -> Tensor:
                a = c.layout(shape, how, lo=-3, hi=3)
                return fn(a, c.rand(shape)) if split else fn(a)

            desc = f"shape={shape_text(shape)}," + ("split" if split else "fused") + layout_text(how)
            out.append(Case(op, desc, "F32", make))
    return out


def _norm_cases() -> list[Case]:
    out = []
    for op, fn in (("NORM", ops.norm), ("RMS_NORM", ops.rms_norm)):
        for shape, how, eps in [((33,), "cont", 1e-5), ((7, 33), "cont", 1e-6), ((2, 3, 4097), "cont", 1e-5),
                                ((5, 1), "cont", 1e-6), ((5, 7, 33), "perm", 1e-6), ((7, 33), "view", 1e-5)]:
            def make(c: Ctx, fn=fn, shape=shape, how=how, eps=eps) -> Tensor:
                return fn(c.layout(shape, how), eps)

            out.append(Case(op, f"shape={shape_text(shape)},eps={eps:g}" + layout_text(how),
                            "F32", make))
    for op, fn in (("SUM_ROWS", ops.sum_rows), ("MEAN", ops.mean)):
        for shape, how in [((1,), "cont"), ((33,), "cont"), ((7, 4097), "cont"), ((2, 3, 4, 33), "cont"),
                           ((5, 7, 33), "perm")]:
            def make_r(c: Ctx, fn=fn, shape=shape, how=how) -> Tensor:
                return fn(c.layout(shape, how))

            out.append(Case(op, f"shape={shape_text(shape)}" + layout_text(how), "F32", make_r))
    for shape, how in [((1,), "cont"), ((33,), "cont"), ((7, 33), "cont"), ((4, 4097), "cont"), ((5, 7, 33), "trans")]:
        def make_a(c: Ctx, shape=shape, how=how) -> Tensor:
            rows = int(np.prod(shape[:-1])) if len(shape) > 1 else 1
            # distinct values in every row: the index of the maximum is unambiguous
            vals = np.stack([c.rng.permutation(shape[-1]) for _ in range(rows)]).astype(np.float32)
            vals = (vals / shape[-1] - 0.5).reshape(shape)
            if how == "trans":
                return ops.argmax(ops.transpose(c.input(np.ascontiguousarray(np.swapaxes(vals, -1, -2)))))
            return ops.argmax(c.input(vals))

        out.append(Case("ARGMAX", f"shape={shape_text(shape)}" + layout_text(how), "F32", make_a,
                        max_nmse=0.0))
    # many ties (values from a small set), -inf and NaN: the order is fully specified (lower index first on ties,
    # NaN first), so the indices must match exactly; the long rows span several of a kernel's chunks
    for shape, k, how, kind in [((1,), 1, "cont", "distinct"), ((33,), 5, "cont", "ties"),
                                ((7, 33), 33, "cont", "ties"), ((3, 49157), 64, "cont", "distinct"),
                                ((2, 20000), 40, "cont", "ties"),
                                ((4, 100), 7, "cont", "special"), ((5, 7, 33), 4, "trans", "ties")]:
        def make_k(c: Ctx, shape=shape, k=k, how=how, kind=kind) -> Tensor:
            if kind == "distinct":
                vals = c.uniform(shape)
            else:
                vals = c.rng.integers(-3, 4, size=shape).astype(np.float32)
                if kind == "special":
                    flat = vals.reshape(-1)
                    flat[c.rng.choice(flat.size, flat.size // 4, replace=False)] = np.nan
                    flat[c.rng.choice(flat.size, flat.size // 8, replace=False)] = -np.inf
            if how == "trans":
                return ops.top_k(ops.transpose(c.input(np.ascontiguousarray(np.swapaxes(vals, -1, -2)))), k)
            return ops.top_k(c.input(vals), k)

        out.append(Case("TOP_K", f"shape={shape_text(shape)},k={k},{kind}" + layout_text(how), "F32", make_k,
                        max_nmse=0.0))
    return out


def _mul_mat_cases() -> list[Case]:
    out = []

    def add(t: DType, sa: tuple[int, ...], sb: tuple[int, ...], how_b: str = "cont", how_a: str = "cont") -> None:
        def make(c: Ctx, t=t, sa=sa, sb=sb, how_a=how_a, how_b=how_b) -> Tensor:
            if how_a == "perm_outer":  # a weight viewed with its two outer dims swapped (as K in attention)
                w = c.weight((sa[1], sa[0], *sa[2:]), t)
                a = ops.permute(w, (1, 0, *range(2, len(sa))))
            else:
                a = c.weight(sa, t)
            return ops.mul_mat(a, c.layout(sb, how_b))

        lay = "" if how_a == how_b == "cont" else f",layout=({how_a},{how_b})"
        thr = MUL_MAT_FLOAT_MAX_NMSE if t in (F32, F16, BF16) else MUL_MAT_MAX_NMSE
        out.append(Case("MUL_MAT", f"a={shape_text(sa)},b={shape_text(sb)}{lay}", f"{t.name},F32", make, max_nmse=thr))

    for t in WEIGHT_TYPES:
        k = 256
        add(t, (33, k), (1, k))  # GEMV: one row
        add(t, (33, k), (7, k))  # several rows
        add(t, (2, 1, 16, k), (2, 3, 5, k))  # batched, a broadcast over dim 1
        add(t, (2, 16, k), (4, 5, k))  # each matrix of a serves two consecutive matrices of b (ggml)
        add(t, (16, k), (7, k), how_b="trans")  # non-contiguous b
    for t in (F32, F16, BF16):
        add(t, (7, 33), (1, 33))  # odd inner size
        add(t, (7, 33), (5, 33))
        add(t, (7, 4097), (3, 4097))
    for t in (F32, F16):
        add(t, (2, 16, 64), (2, 5, 64), how_a="perm_outer")
        add(t, (1, 64), (7, 64))  # a single weight row
    add(F32, (3, 64), (2, 3, 64), how_b="reshape")
    add(Q8_0, (1, 64), (7, 64))
    return out


def _mul_mat_id_cases() -> list[Case]:
    """The expert-routed product: every weight type, b shared by the k slots (S = 1) or one row per slot, an expert
    twice in one token (ggml allows it), experts no token chose, many tokens on one expert, a strided b, a symbolic
    token count bound below its maximum."""
    out = []

    def add(t: DType, E: int, M: int, ids: np.ndarray, S: int, how_b: str = "cont", bound: int = 0) -> None:
        T, k = ids.shape
        K = 256

        def make(c: Ctx, t=t, E=E, M=M, ids=ids, S=S, how_b=how_b, bound=bound) -> Tensor:
            w = c.weight((E, M, K), t)
            if bound:
                n_tok = sym(f"n_tok{len(c.inputs)}", bound)
                b = c.input(c.uniform((T, S, K)), shape=(n_tok, S, K))
                return ops.mul_mat_id(w, b, c.input(ids, I32, shape=(n_tok, k)))
            return ops.mul_mat_id(w, c.layout((T, S, K), how_b), c.input(ids, I32))

        rows = sorted({"".join(map(str, r)) for r in ids}) if T > 8 else ["".join(map(str, r)) for r in ids]
        what = f"E={E},M={M},T={T},ids={'/'.join(rows)},S={S}"
        what += layout_text(how_b) + (f",T<={bound}" if bound else "")
        thr = MUL_MAT_FLOAT_MAX_NMSE if t in (F32, F16, BF16) else MUL_MAT_MAX_NMSE
        out.append(Case("MUL_MAT_ID", what, f"{t.name},F32,I32", make, max_nmse=thr))

    mixed = np.array([[0, 3], [3, 1], [2, 0], [1, 3], [3, 2]], np.int32)
    for t in WEIGHT_TYPES:
        add(t, 4, 16, mixed, 1)  # the gate/up form: each token's one row for its k experts
        add(t, 4, 16, mixed, 2)  # the down form: one row per slot
        add(t, 4, 40, mixed[:1], 2)  # one token (decode); M not a multiple of 16
    for t in (F32, F16, Q8_0, Q4_K):
        add(t, 4, 16, np.array([[1, 1], [2, 2], [1, 0]], np.int32), 2)  # an expert twice within a token
        add(t, 8, 16, np.array([[5, 0], [0, 5], [5, 0]], np.int32), 1)  # 6 of 8 experts unused
        add(t, 4, 24, np.tile(np.array([[2, 1]], np.int32), (40, 1)), 2)  # many tokens on two experts
        add(t, 4, 16, mixed, 2, how_b="view")  # b a strided window of a larger input
        add(t, 4, 16, mixed, 1, bound=9)  # a symbolic token count, 5 of at most 9
    for t in (Q4_0, Q8_0, Q4_K):
        add(t, 4, 20, mixed, 2)  # 20 rows per expert: groups of 8 would straddle experts (simd keeps them unpacked)
    return out


def _mask(c: Ctx, rows: int, cols: int, t: DType, causal: bool) -> Tensor:
    m = c.uniform((rows, cols))
    if causal:  # the last `rows` keys are the queries' own positions
        past = cols - rows
        m = np.where(np.arange(cols)[None, :] > past + np.arange(rows)[:, None], -np.inf, 0.0).astype(np.float32)
    return c.input(m, t)


def _softmax_cases() -> list[Case]:
    out = []
    specs = [  # shape, layout, mask (type, rows, causal, per-head) or None, scale, max_bias
        ((1,), "cont", None, 1.0, 0.0),
        ((33,), "cont", None, 1.0, 0.0),
        ((7, 4097), "cont", None, 0.3, 0.0),
        ((2, 3, 4, 33), "cont", None, 1.0, 0.0),
        ((5, 7, 33), "perm", None, 1.0, 0.0),
        ((4, 7, 33), "cont", (F32, 8, False, False), 0.125, 0.0),
        ((4, 7, 33), "cont", (F16, 8, False, False), 0.125, 0.0),
        ((4, 7, 33), "cont", (F32, 7, True, False), 1.0, 0.0),
        ((4, 7, 33), "cont", (F16, 7, True, False), 1.0, 0.0),
        ((6, 7, 33), "cont", (F32, 7, False, False), 0.5, 8.0),  # ALiBi, 6 heads (not a power of two)
        ((6, 7, 33), "cont", (F16, 8, True, False), 0.5, 8.0),
        ((2, 4, 7, 33), "cont", (F32, 7, False, True), 1.0, 0.0),  # one mask per head, repeated over the batch
        ((2, 4, 7, 33), "cont", (F16, 7, False, True), 1.0, 8.0),
        ((3, 4097), "cont", (F16, 3, False, False), 1.0, 0.0),
        ((4, 7, 33), "perm_outer", (F32, 7, False, False), 0.7, 0.0),
    ]
    for shape, how, mask, scale, max_bias in specs:
        def make(c: Ctx, shape=shape, how=how, mask=mask, scale=scale, max_bias=max_bias) -> Tensor:
            x = c.layout(shape, how, lo=-4, hi=4)
            m = None
            if mask is not None:
                mt, rows, causal, per_head = mask
                if per_head:
                    m = c.input(c.uniform((shape[-3], rows, shape[-1])), mt)
                else:
                    m = _mask(c, rows, shape[-1], mt, causal)
            return ops.soft_max(x, m, scale=scale, max_bias=max_bias)

        desc = f"shape={shape_text(shape)},scale={scale},max_bias={max_bias}"
        types = "F32"
        if mask is not None:
            mt, rows, causal, per_head = mask
            mshape = (shape[-3], rows, shape[-1]) if per_head else (rows, shape[-1])
            desc += f",mask={shape_text(mshape)}" + (",causal" if causal else "")
            types = f"F32,{mt.name}"
        if how != "cont":
            desc += f",layout={how}"
        out.append(Case("SOFT_MAX", desc, types, make, max_nmse=SOFT_MAX_MAX_NMSE))
    for shape, n_past in [((7, 7), 0), ((3, 5, 10), 5), ((2, 3, 4, 33), 2), ((7, 33), 26)]:
        def make_d(c: Ctx, shape=shape, n_past=n_past) -> Tensor:
            return ops.diag_mask_inf(c.rand(shape), n_past)

        out.append(Case("DIAG_MASK_INF", f"shape={shape_text(shape)},n_past={n_past}", "F32", make_d))
    return out


# Rope scalings (ggml_rope_ext's extra parameters), each chosen so that a kernel ignoring it fails by far: frequency
# factors of 1..32 (llama 3), YaRN's ramp falling across pairs 0..13 (n_ctx_orig 256) or 15..21 (betas 8 and 2 at
# n_ctx_orig 4096: correction dims other than the default betas'), a fractional ext_factor, an attn_factor alone.
_ROPE_SCALINGS: list[dict[str, float | int | bool]] = [
    dict(freq_factors=True),
    dict(ext_factor=1.0, n_ctx_orig=256),
    dict(ext_factor=1.0, beta_fast=8.0, beta_slow=2.0, n_ctx_orig=4096),
    dict(ext_factor=0.5, attn_factor=0.9, n_ctx_orig=1024, freq_factors=True),
    dict(attn_factor=0.7),
]


def _rope_cases() -> list[Case]:
    out = []
    plain: list[dict[str, float | int | bool]] = [{}]
    for mode in (ops.ROPE_NORMAL, ops.ROPE_NEOX):
        for shape, n_dims, base, fscale, how, scalings in [
            ((1, 4, 64), 64, 10000.0, 1.0, "cont", plain),  # one token (decode)
            ((7, 4, 64), 64, 10000.0, 1.0, "cont", plain),
            ((7, 3, 128), 64, 500000.0, 0.25, "cont", plain),  # partial rotation, scaled positions
            ((5, 2, 66), 32, 10000.0, 1.0, "cont", plain),  # odd head size, the tail passes through
            ((2, 7, 2, 64), 64, 10000.0, 1.0, "cont", plain),  # batch dim
            ((7, 4, 64), 64, 10000.0, 1.0, "perm_outer", plain),  # (H, T, D) memory seen as (T, H, D)
            ((7, 4, 64), 64, 10000.0, 0.25, "cont", _ROPE_SCALINGS),
            ((5, 2, 96), 64, 500000.0, 0.125, "perm_outer", _ROPE_SCALINGS[:4]),  # partial rotation too
        ]:
            for extra in scalings:
                def make(c: Ctx, shape=shape, n_dims=n_dims, base=base, fscale=fscale, how=how, mode=mode,
                         extra=extra) -> Tensor:
                    x = c.layout(shape, how)
                    pos = c.input(c.rng.integers(0, 512, shape[-3]).astype(np.int32), I32)
                    kw = {k: v for k, v in extra.items() if k != "freq_factors"}
                    ff = c.rand((n_dims // 2,), lo=1.0, hi=32.0) if extra.get("freq_factors") else None
                    return ops.rope(x, pos, n_dims, mode=mode, freq_base=base, freq_scale=fscale, freq_factors=ff,
                                    **kw)  # type: ignore[arg-type]

                desc = (f"shape={shape_text(shape)},n_dims={n_dims},mode={mode},freq_base={base:g},freq_scale={fscale}"
                        + "".join(f",{k}={v:g}" if k != "freq_factors" else ",freq_factors" for k, v in extra.items())
                        + layout_text(how))
                out.append(Case("ROPE", desc, "F32,I32,F32" if extra.get("freq_factors") else "F32,I32", make))
    return out


def _flash_attn_cases() -> list[Case]:
    out = []
    specs = [  # (B or None, H, Hk, Nq, Nkv, D, Dv, mask (type, rows, causal) or None, max_bias, softcap)
        (1, 4, 4, 1, 33, 64, 64, None, 0.0, 0.0),
        (1, 4, 1, 7, 33, 64, 64, (F16, 8, False), 0.0, 0.0),  # multi-query
        (1, 8, 2, 7, 256, 64, 64, (F16, 7, True), 0.0, 0.0),  # grouped-query, causal
        (None, 4, 2, 1, 7, 128, 128, (F32, 1, False), 0.0, 0.0),  # 3-D operands, F32 mask
        (1, 6, 3, 7, 33, 64, 64, (F16, 8, False), 8.0, 0.0),  # ALiBi
        (1, 4, 4, 7, 33, 64, 64, (F16, 7, True), 0.0, 20.0),  # logit softcap
        (1, 4, 2, 5, 33, 64, 32, (F32, 5, False), 0.0, 0.0),  # value head size differs
        (2, 4, 2, 7, 33, 64, 64, (F16, 7, True), 0.0, 0.0),  # batch of two
        (1, 9, 3, 1, 1000, 64, 64, (F16, 1, False), 0.0, 0.0),  # a decode step over a long cache (keys split)
        (1, 8, 2, 2, 701, 64, 64, (F16, 2, True), 0.0, 0.0),  # two queries, an odd key count
    ]
    for kvt in (F16, F32):
        for b, h, hk, nq, nkv, d, dv, mask, max_bias, softcap in specs:
            def make(c: Ctx, b=b, h=h, hk=hk, nq=nq, nkv=nkv, d=d, dv=dv, mask=mask, max_bias=max_bias,
                     softcap=softcap, kvt=kvt) -> Tensor:
                lead = () if b is None else (b,)
                q = c.rand((*lead, h, nq, d))
                k = c.rand((*lead, hk, nkv, d), kvt)
                v = c.rand((*lead, hk, nkv, dv), kvt)
                m = None if mask is None else _mask(c, mask[1], nkv, mask[0], mask[2])
                return ops.flash_attn_ext(q, k, v, m, scale=1.0 / np.sqrt(d), max_bias=max_bias, softcap=softcap)

            lead = "" if b is None else f"{b},"
            desc = f"q=[{lead}{h},{nq},{d}],kv=[{lead}{hk},{nkv},{d}|{dv}]"
            types = f"F32,{kvt.name}"
            if mask is not None:
                desc += f",mask={shape_text((mask[1], nkv))}" + (",causal" if mask[2] else "")
                types += f",{mask[0].name}"
            if max_bias:
                desc += f",max_bias={max_bias}"
            if softcap:
                desc += f",softcap={softcap}"
            out.append(Case("FLASH_ATTN_EXT", desc, types, make, max_nmse=FLASH_ATTN_MAX_NMSE))
    # Queries whose every key is masked: ggml's CPU kernel divides by the softmax sum only when it is not 0, so such
    # a row is all zeros (not NaN). Rows 0 and 5 (of 7) are fully masked, the others see a causal window.
    for kvt, mt, nkv in ((F16, F16, 33), (F32, F32, 256)):
        def make_fm(c: Ctx, kvt=kvt, mt=mt, nkv=nkv) -> Tensor:
            q = c.rand((1, 4, 7, 64))
            k = c.rand((1, 2, nkv, 64), kvt)
            v = c.rand((1, 2, nkv, 64), kvt)
            m = np.where(np.arange(nkv)[None, :] > nkv - 7 + np.arange(7)[:, None], -np.inf, 0.0)
            m[[0, 5], :] = -np.inf
            return ops.flash_attn_ext(q, k, v, c.input(m.astype(np.float32), mt), scale=0.125)

        out.append(Case("FLASH_ATTN_EXT", f"q=[1,4,7,64],kv=[1,2,{nkv},64|64],mask=[7,{nkv}],rows 0 and 5 fully masked",
                        f"F32,{kvt.name},{mt.name}", make_fm, max_nmse=FLASH_ATTN_MAX_NMSE,
                        note="a fully masked row is zeros, as in ggml"))
    # A decode step behind a sliding window (the first 600 of 1000 keys masked: whole ranges of keys see nothing),
    # and one whose every key is masked (zeros)
    for first, what in ((600, "keys 0..599 masked"), (1000, "every key masked")):
        def make_win(c: Ctx, first=first) -> Tensor:
            q = c.rand((1, 9, 1, 64))
            k = c.rand((1, 3, 1000, 64), F16)
            v = c.rand((1, 3, 1000, 64), F16)
            m = np.where(np.arange(1000)[None, :] < first, -np.inf, 0.0).astype(np.float32)
            return ops.flash_attn_ext(q, k, v, c.input(m, F16), scale=0.125)

        out.append(Case("FLASH_ATTN_EXT", f"q=[1,9,1,64],kv=[1,3,1000,64|64],mask=[1,1000],{what}", "F32,F16,F16",
                        make_win, max_nmse=FLASH_ATTN_MAX_NMSE))
    return out


def _rows_cases() -> list[Case]:
    out = []
    for t in (*WEIGHT_TYPES, I32):
        cols = 256 if t.block_size == 256 else 64 if t.is_quantized else 33
        specs = [((13, cols), (5,))]
        if t in (F32, F16, Q4_0, Q8_0, Q4_K, I32):
            specs.append(((2, 13, cols), (2, 4)))
        if t is F32:
            specs.append(((4097, 7), (1,)))
        for sa, si in specs:
            def make(c: Ctx, t=t, sa=sa, si=si) -> Tensor:
                if t is I32:
                    a = c.input(c.rng.integers(-1000, 1000, sa).astype(np.int32), I32)
                elif t is F32:
                    a = c.rand(sa)
                else:
                    a = c.weight(sa, t)  # embeddings are weights
                idx = c.input(c.rng.integers(0, sa[-2], si).astype(np.int32), I32)
                return ops.get_rows(a, idx)

            exact = not t.is_quantized
            out.append(Case("GET_ROWS", f"a={shape_text(sa)},idx={shape_text(si)}", f"{t.name},I32", make,
                            max_nmse=0.0 if exact else DEFAULT_MAX_NMSE))
    for t, it in [(F32, I32), (F32, I64), (F16, I32), (F16, I64), (BF16, I32), (Q8_0, I64), (Q4_0, I32),
                  (Q4_1, I64)]:
        cols = 64 if t.is_quantized else 33

        def make_s(c: Ctx, t=t, it=it, cols=cols) -> Tensor:
            dst = c.rand((9, cols), t)
            rows = c.rand((3, cols))
            idx = c.input(c.rng.permutation(9)[:3].astype(it.np_dtype), it)
            return ops.set_rows(dst, rows, idx)

        out.append(Case("SET_ROWS", f"dst=[9,{cols}],rows=[3,{cols}]", f"{t.name},F32,{it.name}", make_s,
                        max_nmse=CONVERT_MAX_NMSE[t.name], note="conversion threshold of the destination type"))
    return out


def _copy_cases() -> list[Case]:
    out = []

    def thr(src: DType, dst: DType) -> float:
        return 0.0 if src is dst or dst is F32 else CONVERT_MAX_NMSE[dst.name]

    pairs = [(F32, F32), (F16, F16), (F16, F32), (F32, F16)]
    pairs += [(F32, t) for t in ops.CPY_DST_TYPES if t not in (F32, F16)]  # every conversion CPY writes
    for src, dst in pairs:
        cols = 2 * dst.block_size if dst.is_quantized else 33

        def make(c: Ctx, src=src, dst=dst, cols=cols) -> Tensor:
            return ops.cpy(c.rand((7, cols), src), c.rand((7, cols), dst))

        out.append(Case("CPY", f"shape=[7,{cols}]", f"{src.name}->{dst.name}", make, max_nmse=thr(src, dst)))
    for dst in (F16, Q8_0, F32):
        def make_cast(c: Ctx, dst=dst) -> Tensor:
            return ops.cast(c.rand((5, 64)), dst)

        out.append(Case("CPY", "shape=[5,64],new tensor", f"F32->{dst.name}", make_cast, max_nmse=thr(F32, dst)))
    for src, dst in [(F32, F32), (F32, F16), (F16, F32)]:
        def make_p(c: Ctx, src=src, dst=dst) -> Tensor:
            return ops.cpy(c.layout((7, 33), "trans", src), c.rand((7, 33), dst))

        out.append(Case("CPY", "shape=[7,33],layout=trans", f"{src.name}->{dst.name}", make_p, max_nmse=thr(src, dst)))

    def make_slot(c: Ctx) -> Tensor:  # a KV-cache write: rows 5..7 of a (16, 64) cache
        cache = c.rand((16, 64), F16)
        slot = ops.view(cache, (3, 64), strides=cache.strides, offset=5 * cache.strides[0])
        return ops.cpy(c.rand((3, 64)), slot)

    out.append(Case("CPY", "src=[3,64],dst=view rows 5..7 of [16,64]", "F32->F16", make_slot,
                    max_nmse=CONVERT_MAX_NMSE["F16"]))

    def make_flat(c: Ctx) -> Tensor:
        return ops.cpy(c.rand((7, 33)), c.rand((231,)))

    out.append(Case("CPY", "src=[7,33],dst=[231]", "F32->F32", make_flat, max_nmse=0.0))

    # the contiguous one is the base of CONT's view cases (view_cases.py)
    for shape, how, t in [((7, 33), "cont", F32), ((7, 33), "trans", F32), ((2, 3, 4, 33), "perm", F32),
                          ((7, 33), "view", F32), ((5, 7, 33), "perm_outer", F16), ((7, 33), "trans", I32)]:
        def make_c(c: Ctx, shape=shape, how=how, t=t) -> Tensor:
            if t is I32:
                x = c.input(c.rng.integers(-1000, 1000, shape[::-1]).astype(np.int32), I32)
                return ops.cont(ops.transpose(x))
            return ops.cont(c.layout(shape, how, t))

        out.append(Case("CONT", f"shape={shape_text(shape)},layout={how}", t.name, make_c, max_nmse=0.0))
    for sa, sb, axis, how in [((7,), (33,), 0, "cont"), ((2, 3, 4, 7), (2, 3, 4, 33), 3, "cont"),
                              ((1, 3, 4, 7), (2, 3, 4, 7), 0, "cont"), ((2, 1, 4, 7), (2, 5, 4, 7), 1, "cont"),
                              ((3, 4, 7), (3, 1, 7), 1, "cont"), ((7, 5), (7, 33), 1, "trans")]:
        def make_cat(c: Ctx, sa=sa, sb=sb, axis=axis, how=how) -> Tensor:
            return ops.concat(c.rand(sa), c.layout(sb, how), axis)

        out.append(Case("CONCAT", f"a={shape_text(sa)},b={shape_text(sb)},axis={axis}" + layout_text(how),
                        "F32", make_cat, max_nmse=0.0))
    for sa, so, how in [((1,), (4097,), "cont"), ((1, 33), (7, 33), "cont"), ((2, 1, 3), (4, 5, 3), "cont"),
                        ((3, 1, 1, 7), (6, 2, 3, 7), "cont"), ((5, 7), (10, 7), "trans")]:
        def make_r(c: Ctx, sa=sa, so=so, how=how) -> Tensor:
            return ops.repeat(c.layout(sa, how), so)

        out.append(Case("REPEAT", f"a={shape_text(sa)},shape={shape_text(so)}" + layout_text(how), "F32",
                        make_r, max_nmse=0.0))
    for sa, pads, how in [((3, 33), (1, 7), "cont"), ((2, 3, 4, 5), (0, 1, 2, 3), "cont"), ((1,), (4096,), "cont"),
                          ((5, 7, 33), (1, 0, 2), "perm")]:
        def make_pad(c: Ctx, sa=sa, pads=pads, how=how) -> Tensor:
            return ops.pad(c.layout(sa, how), pads)

        out.append(Case("PAD", f"a={shape_text(sa)},pads={shape_text(pads)}" + layout_text(how), "F32",
                        make_pad, max_nmse=0.0))
    return out


_FAMILIES: tuple[Callable[[], list[Case]], ...] = (
    _rows_cases, _binary_cases, _unary_cases, _glu_cases, _norm_cases, _mul_mat_cases, _mul_mat_id_cases,
    _softmax_cases, _rope_cases, _flash_attn_cases, _copy_cases, edge_cases,
)
_ALL: list[Case] | None = None


def all_cases() -> list[Case]:
    """Every case of the kit (made once; cheap: no data exists until a case is built)."""
    global _ALL
    if _ALL is None:
        made = [c for fam in _FAMILIES for c in fam()]
        made += view_cases(made)  # every source in the layouts the schema says it accepts
        ids = [c.id for c in made]
        dup = {i for i in ids if ids.count(i) > 1}
        if dup:
            raise AssertionError(f"duplicate conformance case ids: {sorted(dup)}")
        _ALL = made
    return list(_ALL)


def cases(filter: str | Callable[[Case], bool] | None = None, *,  # noqa: A002
          op: str | Sequence[str] | None = None) -> list[Case]:
    """The kit's cases, optionally selected.

    filter: a substring of the case id (`OP[TYPES](CASE)`, case-insensitive) or a predicate on Case.
    op: one ggml op name or several (comma-separated or a sequence), matched exactly (case-insensitive).
    """
    out = all_cases()
    if op is not None:
        names = [o.strip().upper() for o in (op.split(",") if isinstance(op, str) else op) if o.strip()]
        unknown = [o for o in names if o not in ALL_OPS]
        if unknown:
            raise ValueError(f"unknown op(s) {', '.join(unknown)}; the kit covers {', '.join(ALL_OPS)}")
        out = [c for c in out if c.op in names]
    if isinstance(filter, str):
        sub = filter.lower()
        out = [c for c in out if sub in c.id.lower()]
    elif filter is not None:
        out = [c for c in out if filter(c)]
    return out
