"""Graph-building ops: each validates its operands at once and returns a lazy Tensor.

Shapes are numpy order (last dim innermost); see docs/ops.md for every op's shape rule.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from ggml_py.errors import ShapeError
from ggml_py.ir import dtypes, schema
from ggml_py.ir.dtypes import F16, F32, I32, I64, DType
from ggml_py.ir.symbolic import Dim, dim, upper
from ggml_py.ir.tensor import Tensor, contiguous_strides, nbytes_upper

ELEMENTWISE_UNARY = schema.UNARY_OPS
ELEMENTWISE_BINARY = schema.BINARY_OPS

ROPE_NORMAL = 0
ROPE_NEOX = 2

# Types a CPY may write (besides F32/F16/BF16, F32 may be quantized on the way).
CPY_DST_TYPES: tuple[DType, ...] = (F32, F16, dtypes.BF16, dtypes.Q8_0, dtypes.Q4_0, dtypes.Q4_1, dtypes.Q5_0,
                                    dtypes.Q5_1, dtypes.Q2_K, dtypes.Q3_K, dtypes.Q4_K, dtypes.Q5_K, dtypes.Q6_K)


def _fail(op: str, msg: str, *ts: Tensor) -> ShapeError:
    desc = ", ".join(f"{t.name} {list(t.shape)} {t.dtype}" for t in ts)
    return ShapeError(f"{op}: {msg} (operands: {desc})")


def _need_type(op: str, t: Tensor, allowed: Sequence[DType], role: str = "operand") -> None:
    if t.dtype not in allowed:
        raise _fail(op, f"{role} {t.name!r} has type {t.dtype}, expected one of {', '.join(map(str, allowed))}", t)


def _node(op: str, shape: Sequence[Dim], dtype: DType, src: Sequence[Tensor | None], **params: object) -> Tensor:
    # the schema says which parameters a node of this op carries; a builder that disagrees is a bug here
    assert tuple(params) == schema.OPS[op].param_names, (op, tuple(params))
    return Tensor(shape, dtype, op=op, src=src, params=params)


def _pad4(shape: Sequence[Dim]) -> tuple[Dim, ...]:
    return (1,) * (4 - len(shape)) + tuple(shape)


def can_repeat(b: Sequence[Dim], a: Sequence[Dim]) -> bool:
    """True if `b` tiles `a`: every dim of b divides the matching dim of a (ggml_can_repeat)."""
    if len(b) > len(a):
        return False
    for x, y in zip(_pad4(b), _pad4(a)):
        if x == y or x == 1:
            continue
        if isinstance(x, int) and isinstance(y, int) and x > 0 and y % x == 0:
            continue
        return False
    return True


# -- elementwise ---------------------------------------------------------------------------------------------
def _binary(op: str, a: Tensor, b: Tensor) -> Tensor:
    _need_type(op, a, (F32,))
    _need_type(op, b, (F32,))
    if not can_repeat(b.shape, a.shape):
        raise _fail(op, f"second operand shape {list(b.shape)} does not tile first operand shape {list(a.shape)}",
                    a, b)
    return _node(op, a.shape, F32, (a, b))


def add(a: Tensor, b: Tensor) -> Tensor:
    return _binary("ADD", a, b)


def sub(a: Tensor, b: Tensor) -> Tensor:
    return _binary("SUB", a, b)


def mul(a: Tensor, b: Tensor) -> Tensor:
    return _binary("MUL", a, b)


def div(a: Tensor, b: Tensor) -> Tensor:
    return _binary("DIV", a, b)


def _unary(op: str, a: Tensor, **params: object) -> Tensor:
    _need_type(op, a, (F32,))
    return _node(op, a.shape, F32, (a,), **params)


def scale(a: Tensor, s: float, b: float = 0.0) -> Tensor:
    """a * s + b."""
    return _unary("SCALE", a, s=float(s), b=float(b))


def _unary_builder(o: schema.OpDef) -> Callable[[Tensor], Tensor]:
    def build(a: Tensor) -> Tensor:
        return _unary(o.name, a)

    build.__name__ = build.__qualname__ = o.name.lower()
    build.__doc__ = f"{o.name}, elementwise: {o.doc.replace('`', '')}."
    return build


# The unary family's builders come from the schema: ops.<name in lower case>(a) for each of its OpDefs (sqr, sqrt,
# neg, abs, exp, log, silu, gelu, ...; `python -m ggml_py.ir.schema ops` lists them with their formulas).
for _o in schema.OPS_LIST:
    if _o.family == "unary":
        globals()[_o.name.lower()] = _unary_builder(_o)
del _o


def clamp(a: Tensor, min: float, max: float) -> Tensor:  # noqa: A002
    if min > max:
        raise _fail("CLAMP", f"min {min} > max {max}", a)
    return _unary("CLAMP", a, min=float(min), max=float(max))


def _glu(op: str, a: Tensor, b: Tensor | None) -> Tensor:
    _need_type(op, a, (F32,))
    if b is None:
        n = a.shape[-1]
        if not isinstance(n, int) or n % 2:
            raise _fail(op, f"without a second operand the last dim must be even, got {n}", a)
        return _node(op, (*a.shape[:-1], n // 2), F32, (a, None))
    _need_type(op, b, (F32,))
    if tuple(a.shape) != tuple(b.shape):
        raise _fail(op, "gate and value must have the same shape", a, b)
    return _node(op, a.shape, F32, (a, b))


def swiglu(a: Tensor, b: Tensor | None = None) -> Tensor:
    """silu(a) * b; without b, the first half of a's last dim gates the second half."""
    return _glu("SWIGLU", a, b)


def geglu(a: Tensor, b: Tensor | None = None) -> Tensor:
    """gelu(a) * b; without b, the first half of a's last dim gates the second half."""
    return _glu("GEGLU", a, b)


# -- reductions and norms --------------------------------------------------------------------------------------
def norm(a: Tensor, eps: float = 1e-5) -> Tensor:
    """(x - mean) / sqrt(var + eps) over the last dim."""
    return _unary("NORM", a, eps=float(eps))


def rms_norm(a: Tensor, eps: float = 1e-6) -> Tensor:
    """x / sqrt(mean(x²) + eps) over the last dim."""
    return _unary("RMS_NORM", a, eps=float(eps))


def sum_rows(a: Tensor) -> Tensor:
    _need_type("SUM_ROWS", a, (F32,))
    return _node("SUM_ROWS", (*a.shape[:-1], 1), F32, (a,))


def mean(a: Tensor) -> Tensor:
    _need_type("MEAN", a, (F32,))
    return _node("MEAN", (*a.shape[:-1], 1), F32, (a,))


def argmax(a: Tensor) -> Tensor:
    """Index of the largest element of each row (first on ties), I32, shape a.shape[:-1]."""
    _need_type("ARGMAX", a, (F32,))
    if a.ndim < 1:
        raise _fail("ARGMAX", "needs at least one dimension", a)
    return _node("ARGMAX", a.shape[:-1] or (1,), I32, (a,))


def top_k(a: Tensor, k: int) -> Tensor:
    """Indices of the k largest elements of each row, I32, shape (..., k): largest first, the lower index first on
    ties, NaN counted as the largest (as in ARGMAX, so a sampler sees it). With GET_ROWS of the values, a sampler
    reads k candidates instead of a whole vocabulary."""
    _need_type("TOP_K", a, (F32,))
    if a.ndim < 1:
        raise _fail("TOP_K", "needs at least one dimension", a)
    n = a.shape[-1] if a.ndim else 0
    if isinstance(k, bool) or not isinstance(k, int) or k < 1 or (isinstance(n, int) and k > n):
        raise _fail("TOP_K", f"k must be an integer in 1..{n}, got {k!r}", a)
    return _node("TOP_K", (*a.shape[:-1], k), I32, (a,), k=k)


# -- matrix product ------------------------------------------------------------------------------------------
def mul_mat(a: Tensor, b: Tensor) -> Tensor:
    """ggml's mul_mat: a (..., M, K) weight of any supported type, b (..., N, K) F32 -> (..., N, M) F32 = b @ aᵀ."""
    _need_type("MUL_MAT", a, dtypes.WEIGHT_TYPES, "first operand (weight)")
    _need_type("MUL_MAT", b, (F32,), "second operand")
    if a.ndim < 2 or b.ndim < 2:
        raise _fail("MUL_MAT", "both operands need at least 2 dimensions", a, b)
    if a.shape[-1] != b.shape[-1]:
        raise _fail("MUL_MAT", f"inner dimensions differ: {a.shape[-1]} vs {b.shape[-1]}", a, b)
    if not can_repeat(a.shape[:-2], b.shape[:-2]):
        raise _fail("MUL_MAT", "outer dims of the first operand must divide those of the second", a, b)
    return _node("MUL_MAT", (*b.shape[:-2], b.shape[-2], a.shape[-2]), F32, (a, b))


def mul_mat_id(as_: Tensor, b: Tensor, ids: Tensor) -> Tensor:
    """ggml's mul_mat_id, the expert-routed product: as_ (E, M, K) one weight matrix per expert (any weight type),
    b (T, S, K) F32, ids (T, k) I32 (each token's k experts, 0..E-1; S divides k: slot i reads b[t, i % S], so
    S = 1 hands every expert the same row) -> (T, k, M) F32 with row (t, i) = b[t, i % S] @ as_[ids[t, i]]ᵀ.
    An id may repeat within a token (that slot simply computes the same product again); ids outside 0..E-1 are
    an error at compute time."""
    op = "MUL_MAT_ID"
    _need_type(op, as_, dtypes.WEIGHT_TYPES, "first operand (expert weights)")
    _need_type(op, b, (F32,), "second operand")
    _need_type(op, ids, (I32,), "ids")
    if as_.ndim != 3 or b.ndim != 3 or ids.ndim != 2:
        raise _fail(op, "expected as (E, M, K), b (T, S, K) and ids (T, k)", as_, b, ids)
    if as_.shape[-1] != b.shape[-1]:
        raise _fail(op, f"inner dimensions differ: {as_.shape[-1]} vs {b.shape[-1]}", as_, b)
    if b.shape[0] != ids.shape[0]:
        raise _fail(op, "b and ids must have one row per token (dim 0)", b, ids)
    s, k = b.shape[1], ids.shape[1]
    if not (isinstance(s, int) and isinstance(k, int) and s > 0 and k % s == 0):
        raise _fail(op, f"b's rows per token ({s}) must divide the experts per token ({k})", b, ids)
    return _node(op, (b.shape[0], k, as_.shape[1]), F32, (as_, b, ids))


# -- attention pieces ---------------------------------------------------------------------------------------
def soft_max(a: Tensor, mask: Tensor | None = None, scale: float = 1.0, max_bias: float = 0.0) -> Tensor:
    """softmax(a * scale + slope * mask) over the last dim; mask (rows >= a's rows, same cols) F32 or F16.

    With max_bias > 0 the mask is scaled per head (dim -3) by ALiBi slopes.
    """
    _need_type("SOFT_MAX", a, (F32,))
    if mask is not None:
        _need_type("SOFT_MAX", mask, (F32, F16), "mask")
        ok = mask.ndim >= 2 and mask.shape[-1] == a.shape[-1] and a.ndim >= 2
        if ok:
            mr, ar = mask.shape[-2], a.shape[-2]
            ok = mr == ar or (isinstance(mr, int) and isinstance(ar, int) and mr >= ar)
            ok = ok and can_repeat(mask.shape[:-2], a.shape[:-2])
        if not ok:
            raise _fail("SOFT_MAX", "mask must have the same number of columns and at least as many rows", a, mask)
    if max_bias > 0 and a.ndim < 3:
        raise _fail("SOFT_MAX", "max_bias (ALiBi) needs a head dimension (dim -3)", a)
    return _node("SOFT_MAX", a.shape, F32, (a, mask), scale=float(scale), max_bias=float(max_bias))


def diag_mask_inf(a: Tensor, n_past: int) -> Tensor:
    """Set a[..., i, j] = -inf where j > n_past + i (causal mask)."""
    _need_type("DIAG_MASK_INF", a, (F32,))
    if a.ndim < 2:
        raise _fail("DIAG_MASK_INF", "needs at least 2 dimensions", a)
    return _node("DIAG_MASK_INF", a.shape, F32, (a,), n_past=int(n_past))


def rope(a: Tensor, pos: Tensor, n_dims: int, mode: int = ROPE_NORMAL, freq_base: float = 10000.0,
         freq_scale: float = 1.0, freq_factors: Tensor | None = None, ext_factor: float = 0.0,
         attn_factor: float = 1.0, beta_fast: float = 32.0, beta_slow: float = 1.0, n_ctx_orig: int = 0) -> Tensor:
    """Rotary position embedding of a (..., T, H, D) with positions pos (T,) I32 (ggml's rope_ext).

    mode 0 rotates adjacent pairs, mode 2 (neox) rotates the halves of the first n_dims; the rest passes through.
    freq_factors (n_dims/2,) F32 divides each pair's angle (llama 3 rope scaling). YaRN: with ext_factor != 0 each
    pair mixes the interpolated angle (scaled by freq_scale) and the extrapolated one by a ramp between the correction
    dims that beta_fast, beta_slow and n_ctx_orig give; attn_factor scales cos and sin (docs/ops.md). Without
    ext_factor, beta_fast, beta_slow and n_ctx_orig do nothing and the node keeps their defaults, so a graph's key does
    not depend on them and a plugin of ABI 2.0/2.1 may compute it.
    """
    _need_type("ROPE", a, (F32,))
    _need_type("ROPE", pos, (I32,), "positions")
    if a.ndim < 3 or pos.ndim != 1 or pos.shape[0] != a.shape[-3]:
        raise _fail("ROPE", "a must be (..., T, H, D) and positions (T,)", a, pos)
    d = a.shape[-1]
    if mode not in (ROPE_NORMAL, ROPE_NEOX):
        raise _fail("ROPE", f"mode {mode} is not supported (0 normal, 2 neox)", a)
    if not isinstance(d, int) or n_dims <= 0 or n_dims % 2 or n_dims > d:
        raise _fail("ROPE", f"n_dims {n_dims} must be even and at most the head size {d}", a)
    if freq_factors is not None:
        _need_type("ROPE", freq_factors, (F32,), "freq_factors")
        if freq_factors.shape != (n_dims // 2,):
            raise _fail("ROPE", f"freq_factors must be ({n_dims // 2},): one per rotated pair", a, freq_factors)
    if not ext_factor:
        beta_fast, beta_slow, n_ctx_orig = 32.0, 1.0, 0
    return _node("ROPE", a.shape, F32, (a, pos, freq_factors), n_dims=int(n_dims), mode=int(mode),
                 freq_base=float(freq_base), freq_scale=float(freq_scale), ext_factor=float(ext_factor),
                 attn_factor=float(attn_factor), beta_fast=float(beta_fast), beta_slow=float(beta_slow),
                 n_ctx_orig=int(n_ctx_orig))


def flash_attn_ext(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None = None, scale: float = 1.0,
                   max_bias: float = 0.0, softcap: float = 0.0) -> Tensor:
    """softmax(q kᵀ * scale + mask) v with grouped heads.

    q (B, H, Nq, D) F32, k (B, Hk, Nkv, D), v (B, Hk, Nkv, Dv) F16 or F32, H a multiple of Hk, mask (>= Nq, Nkv).
    Result (B, Nq, H, Dv) F32: heads and queries swapped, as ggml, so a reshape gives (Nq, H*Dv). 3-D operands
    (no B) give (Nq, H, Dv).
    """
    op = "FLASH_ATTN_EXT"
    _need_type(op, q, (F32,), "q")
    _need_type(op, k, (F16, F32), "k")
    _need_type(op, v, (F16, F32), "v")
    if not (q.ndim == k.ndim == v.ndim) or q.ndim not in (3, 4):
        raise _fail(op, "q, k, v must all be 3-D (H, N, D) or 4-D (B, H, N, D)", q, k, v)
    if q.shape[-1] != k.shape[-1] or k.shape[-2] != v.shape[-2] or k.shape[-3] != v.shape[-3]:
        raise _fail(op, "head sizes of q and k, or lengths/heads of k and v, differ", q, k, v)
    h, hk = q.shape[-3], k.shape[-3]
    if not (isinstance(h, int) and isinstance(hk, int) and hk > 0 and h % hk == 0):
        raise _fail(op, f"q heads {h} must be a multiple of k heads {hk}", q, k)
    if q.ndim == 4 and q.shape[0] != k.shape[0]:
        raise _fail(op, "batch sizes differ", q, k)
    if mask is not None:
        _need_type(op, mask, (F16, F32), "mask")
        mr, nq = mask.shape[-2], q.shape[-2]
        rows_ok = mr == nq or (isinstance(mr, int) and isinstance(nq, int) and mr >= nq)
        if mask.ndim != 2 or mask.shape[-1] != k.shape[-2] or not rows_ok:
            raise _fail(op, "mask must be 2-D (>= Nq, Nkv)", q, k, mask)
    shape = (*q.shape[:-3], q.shape[-2], h, v.shape[-1])
    return _node(op, shape, F32, (q, k, v, mask), scale=float(scale), max_bias=float(max_bias),
                 softcap=float(softcap))


# -- rows ----------------------------------------------------------------------------------------------------
def get_rows(a: Tensor, idx: Tensor) -> Tensor:
    """Rows of a (..., R, C) picked by idx (..., n) I32 -> (..., n, C) F32 (dequantized)."""
    _need_type("GET_ROWS", a, (*dtypes.WEIGHT_TYPES, I32), "source")
    _need_type("GET_ROWS", idx, (I32,), "indices")
    if a.ndim < 2 or idx.ndim < 1 or idx.ndim != a.ndim - 1 or tuple(idx.shape[:-1]) != tuple(a.shape[:-2]):
        raise _fail("GET_ROWS", "a must be (..., R, C) and idx (..., n) with the same leading dims", a, idx)
    out_t = I32 if a.dtype is I32 else F32
    return _node("GET_ROWS", (*idx.shape, a.shape[-1]), out_t, (a, idx))


def set_rows(dst: Tensor, src: Tensor, idx: Tensor) -> Tensor:
    """Write rows src (n, C) F32 into dst (R, C) at rows idx (n,) I32/I64; returns dst's memory (a view of it)."""
    _need_type("SET_ROWS", dst, (F32, F16, dtypes.BF16, dtypes.Q8_0, dtypes.Q4_0, dtypes.Q4_1), "destination")
    _need_type("SET_ROWS", src, (F32,), "rows")
    _need_type("SET_ROWS", idx, (I32, I64), "indices")
    if dst.ndim != 2 or src.ndim != 2 or idx.ndim != 1 or src.shape[1] != dst.shape[1] or idx.shape[0] != src.shape[0]:
        raise _fail("SET_ROWS", "expected dst (R, C), rows (n, C), idx (n,)", dst, src, idx)
    return Tensor(dst.shape, dst.dtype, op="SET_ROWS", src=(dst, src, idx), view_src=dst, strides=dst.strides)


# -- copies and layout ------------------------------------------------------------------------------------------
def _check_conversion(a: Tensor, to: DType, *others: Tensor) -> None:
    """The conversions CPY implements: from F32 or F16 to CPY_DST_TYPES, quantizing only from F32."""
    _need_type("CPY", a, (F32, F16), "source")
    if to not in CPY_DST_TYPES or (to.is_quantized and a.dtype is not F32):
        raise _fail("CPY", f"cannot convert {a.dtype} to {to}", a, *others)


def cpy(a: Tensor, b: Tensor) -> Tensor:
    """Copy a into the memory of b (converting type); returns a view of b. Same element count required."""
    _check_conversion(a, b.dtype, b)
    if a.numel() != b.numel():
        raise _fail("CPY", "element counts differ", a, b)
    return Tensor(b.shape, b.dtype, op="CPY", src=(a, b), view_src=b, strides=b.strides)


def cast(a: Tensor, dtype: DType | str) -> Tensor:
    """A contiguous copy of a in another type (F32 <-> F16, F32 -> BF16 or a quantized type)."""
    t = dtypes.get(dtype)
    _check_conversion(a, t)
    return _node("CPY", a.shape, t, (a, None))


def cont(a: Tensor) -> Tensor:
    """A contiguous copy of a (which may be a permuted or strided view)."""
    _need_type("CONT", a, (F32, F16, I32))
    return _node("CONT", a.shape, a.dtype, (a,))


def _view_node(op: str, a: Tensor, shp: Sequence[Dim], strides: Sequence[Dim], offs: Dim,
               **params: object) -> Tensor:
    return Tensor(shp, a.dtype, op=op, src=(a,), params=params, view_src=a, view_offs=offs, strides=strides)


def view(a: Tensor, shape: Sequence[int | Dim], strides: Sequence[int | Dim] | None = None,
         offset: int | Dim = 0) -> Tensor:
    """A view of a's memory at a byte offset with the given shape and byte strides (contiguous if omitted)."""
    shp = tuple(dim(d) for d in shape)
    st = tuple(dim(s) for s in strides) if strides is not None else contiguous_strides(shp, a.dtype)
    if len(st) != len(shp):
        raise _fail("VIEW", f"{len(shp)} dims but {len(st)} strides", a)
    if a.dtype.is_quantized and st and st[-1] != a.dtype.type_size:
        raise _fail("VIEW", "a view of a quantized tensor must keep whole contiguous rows", a)
    off = dim(offset)
    if isinstance(off, int) and off < 0 or any(isinstance(s, int) and s < 0 for s in st):
        raise _fail("VIEW", "negative offset or stride", a)
    if nbytes_upper(shp, st, a.dtype) + upper(off) > a.nbytes:
        raise _fail("VIEW", f"view shape {list(shp)} strides {list(st)} offset {off} runs past the "
                    f"{a.nbytes} bytes of its source", a)
    return _view_node("VIEW", a, shp, st, off, offset=off)


def reshape(a: Tensor, shape: Sequence[int | Dim]) -> Tensor:
    """Same memory, new shape; a must be contiguous. One dim may be -1."""
    if not a.is_contiguous():
        raise _fail("RESHAPE", "source must be contiguous (use cont first)", a)
    shp = [dim(d) if not (isinstance(d, int) and d == -1) else -1 for d in shape]
    if shp.count(-1) > 1:
        raise _fail("RESHAPE", "at most one dimension may be -1", a)
    if -1 in shp:
        known: Dim = 1
        for d in shp:
            if d != -1:
                known = known * d
        total = a.numel()
        if not (isinstance(known, int) and isinstance(total, int)) or known == 0 or total % known:
            raise _fail("RESHAPE", f"cannot infer -1 in {shape}", a)
        shp[shp.index(-1)] = total // known
    n: Dim = 1
    for d in shp:
        n = n * d
    if n != a.numel():
        raise _fail("RESHAPE", f"cannot reshape {a.numel()} elements into shape {list(shape)}", a)
    if a.dtype.is_quantized and shp[-1] != a.shape[-1]:
        raise _fail("RESHAPE", "the row length of a quantized tensor cannot change", a)
    return _view_node("RESHAPE", a, shp, contiguous_strides(shp, a.dtype), 0, shape=tuple(shp))


def permute(a: Tensor, axes: Sequence[int]) -> Tensor:
    """numpy-style transpose: result.shape[i] = a.shape[axes[i]]."""
    ax = [int(x) % a.ndim if a.ndim else int(x) for x in axes]
    if sorted(ax) != list(range(a.ndim)):
        raise _fail("PERMUTE", f"axes {list(axes)} are not a permutation of {a.ndim} dims", a)
    if a.dtype.is_quantized and ax[-1] != a.ndim - 1:
        raise _fail("PERMUTE", "the row dimension of a quantized tensor must stay innermost", a)
    return _view_node("PERMUTE", a, [a.shape[i] for i in ax], [a.strides[i] for i in ax], 0, axes=tuple(ax))


def transpose(a: Tensor) -> Tensor:
    """Swap the last two dims."""
    if a.ndim < 2:
        raise _fail("TRANSPOSE", "needs at least 2 dimensions", a)
    ax = list(range(a.ndim))
    ax[-1], ax[-2] = ax[-2], ax[-1]
    return _view_node("TRANSPOSE", a, [a.shape[i] for i in ax], [a.strides[i] for i in ax], 0)


def concat(a: Tensor, b: Tensor, axis: int = 0) -> Tensor:
    _need_type("CONCAT", a, (F32,))
    _need_type("CONCAT", b, (F32,))
    if a.ndim != b.ndim or not -a.ndim <= axis < a.ndim:
        raise _fail("CONCAT", f"operands must have the same rank and axis {axis} must exist", a, b)
    ax = axis % a.ndim
    if any(x != y for i, (x, y) in enumerate(zip(a.shape, b.shape)) if i != ax):
        raise _fail("CONCAT", f"shapes differ outside axis {ax}", a, b)
    shape = list(a.shape)
    shape[ax] = a.shape[ax] + b.shape[ax]
    return _node("CONCAT", shape, F32, (a, b), axis=ax)


def repeat(a: Tensor, shape: Sequence[int]) -> Tensor:
    """Tile a to `shape` (each dim of a divides the target)."""
    _need_type("REPEAT", a, (F32,))
    shp = tuple(dim(d) for d in shape)
    if not can_repeat(a.shape, shp):
        raise _fail("REPEAT", f"shape {list(a.shape)} does not tile {list(shp)}", a)
    return _node("REPEAT", shp, F32, (a,))


def pad(a: Tensor, pads: Sequence[int]) -> Tensor:
    """Zero-pad each dim at its end by pads[i] (numpy order, one entry per dim)."""
    _need_type("PAD", a, (F32,))
    if len(pads) != a.ndim or any(int(p) < 0 for p in pads):
        raise _fail("PAD", f"pads {list(pads)} must be {a.ndim} non-negative ints", a)
    return _node("PAD", [d + int(p) for d, p in zip(a.shape, pads)], F32, (a,), pads=tuple(int(p) for p in pads))


def _times(a: Tensor, other: Tensor | float) -> Tensor:
    return scale(a, float(other)) if isinstance(other, (int, float)) else mul(a, other)


def _negate(a: Tensor) -> Tensor:
    return _unary("NEG", a)


def _matmul(x: Tensor, w: Tensor) -> Tensor:
    """`x @ w` computes x · wᵀ as ggml's mul_mat(w, x): w is (M, K), x is (N, K)."""
    return mul_mat(w, x)


# Operator sugar on every Tensor: attached here, where the nodes are built (tensor.py does not import ops).
Tensor.__add__ = add  # type: ignore[assignment]
Tensor.__sub__ = sub  # type: ignore[assignment]
Tensor.__mul__ = _times  # type: ignore[assignment]
Tensor.__truediv__ = div  # type: ignore[assignment]
Tensor.__neg__ = _negate  # type: ignore[assignment]
Tensor.__matmul__ = _matmul  # type: ignore[assignment]
