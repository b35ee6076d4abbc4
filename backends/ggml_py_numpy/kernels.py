"""The reference math of every op, in vectorised numpy. Reductions accumulate in float64.

Each kernel takes the node and its sources as numpy arrays (float32 for float types, raw uint8 rows for quantized
ones, already dequantized where noted) and returns the result as an array of the node's logical shape.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np

from ggml_py.formats.quants import quantize
from ggml_py.ir import dtypes
from ggml_py.ir.tensor import Tensor

Arr = np.ndarray
Kernel = Callable[[Tensor, list, tuple[int, ...]], Arr]  # (node, sources, concrete output shape)

SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)


def tile_to(b: Arr, shape: tuple[int, ...]) -> Arr:
    """ggml's repeat of b over a larger shape (each dim of b divides the target)."""
    b = b.reshape((1,) * (len(shape) - b.ndim) + b.shape)
    if all(x in (1, y) for x, y in zip(b.shape, shape)):
        return np.broadcast_to(b, shape)
    return np.tile(b, tuple(y // x for x, y in zip(b.shape, shape)))


def repeat_outer(a: Arr, outer: tuple[int, ...]) -> Arr:
    """mul_mat's broadcast: each matrix of a is used for outer[i]/a.outer[i] consecutive matrices of b."""
    a = a.reshape((1,) * (len(outer) + 2 - a.ndim) + a.shape)
    for axis, (x, y) in enumerate(zip(a.shape[:-2], outer)):
        if x != y:
            a = np.repeat(a, y // x, axis=axis)
    return a


def f32(x: Arr) -> Arr:
    return x.astype(np.float32, copy=False)


def gelu(x: Arr) -> Arr:
    return f32(0.5 * x * (1.0 + np.tanh(SQRT_2_OVER_PI * x * (1.0 + 0.044715 * x * x))))


_erfc = np.vectorize(math.erfc, otypes=[np.float64])  # numpy has no erf; math's is exact to double


def gelu_erf(x: Arr) -> Arr:
    """0.5 x (1 + erf(x / sqrt(2))), written with erfc so that large negative x keep their relative precision."""
    x64 = x.astype(np.float64)
    return f32(0.5 * x64 * _erfc(-x64 / math.sqrt(2.0)))


def silu(x: Arr) -> Arr:
    return f32(x / (1.0 + np.exp(-x.astype(np.float64))))


def bf16_to_f32(bits: Arr) -> Arr:
    return (bits.astype(np.uint32) << 16).view(np.float32)


def f32_to_bf16(x: Arr) -> Arr:
    """Round to nearest even; NaN stays a (quiet) NaN."""
    u = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32).astype(np.uint64)
    rounded = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)
    nan = np.isnan(x)
    if nan.any():
        rounded = np.where(nan, ((u >> 16) | 64).astype(np.uint16), rounded)
    return rounded


def convert(x: Arr, t: dtypes.DType) -> Arr:
    """Float32 values to the storage of type t (raw rows for quantized types)."""
    if t is dtypes.F32:
        return f32(x)
    if t is dtypes.F16:
        return x.astype(np.float16)
    if t is dtypes.BF16:
        return f32_to_bf16(x)
    if t.is_quantized:
        return quantize(np.ascontiguousarray(x, dtype=np.float32), t)
    return x.astype(t.np_dtype)


def _binary(fn: Callable[[Arr, Arr], Arr]) -> Kernel:
    return lambda n, s, o: f32(fn(s[0], tile_to(s[1], s[0].shape)))


def _unary(fn: Callable[[Arr], Arr]) -> Kernel:
    return lambda n, s, o: f32(fn(s[0]))


def _glu(act: Callable[[Arr], Arr]) -> Kernel:
    def k(n: Tensor, s: list, o: tuple[int, ...]) -> Arr:
        a, b = s[0], s[1]
        if b is None:
            h = a.shape[-1] // 2
            a, b = a[..., :h], a[..., h:]
        return f32(act(a) * b)

    return k


def norm(n: Tensor, s: list, o: tuple[int, ...]) -> Arr:
    x = s[0].astype(np.float64)
    x = x - x.mean(axis=-1, keepdims=True)
    return f32(x / np.sqrt((x * x).mean(axis=-1, keepdims=True) + n.params["eps"]))


def rms_norm(n: Tensor, s: list, o: tuple[int, ...]) -> Arr:
    x = s[0].astype(np.float64)
    return f32(x / np.sqrt((x * x).mean(axis=-1, keepdims=True) + n.params["eps"]))


def mul_mat(n: Tensor, s: list, o: tuple[int, ...]) -> Arr:
    a, b = s[0], s[1]  # a already float32 (dequantized)
    a = repeat_outer(a, b.shape[:-2])
    return f32(np.matmul(b, np.swapaxes(a, -1, -2)))


def mul_mat_id(n: Tensor, s: list, o: tuple[int, ...]) -> Arr:
    """Each expert's product over the (token, slot) pairs routed to it. s[0] is indexed by expert only (an array, or
    the backend's per-expert view of a large quantized weight)."""
    experts, b, ids = s
    n_expert = n.src[0].shape[0]  # type: ignore[union-attr]
    if ids.size and (ids.min() < 0 or ids.max() >= n_expert):
        from ggml_py.errors import BackendError

        bad = int(ids[(ids < 0) | (ids >= n_expert)].flat[0])
        raise BackendError(f"MUL_MAT_ID: expert id {bad} out of range 0..{n_expert - 1}")
    out = np.zeros(o, np.float32)
    for e in np.unique(ids):
        t, i = np.nonzero(ids == e)
        out[t, i] = np.matmul(b[t, i % b.shape[1]], np.swapaxes(experts[int(e)], -1, -2))
    return out


def alibi_slopes(n_head: int, max_bias: float) -> Arr:
    if max_bias <= 0:
        return np.ones(n_head)
    n_log2 = 2 ** int(math.floor(math.log2(n_head)))
    m0 = 2.0 ** (-max_bias / n_log2)
    m1 = 2.0 ** (-max_bias / 2.0 / n_log2)
    h = np.arange(n_head)
    return np.where(h < n_log2, m0 ** (h + 1), m1 ** (2 * (h - n_log2) + 1))


def _masked_scores(x: Arr, mask: Arr | None, scale: float, max_bias: float) -> Arr:
    x = x.astype(np.float64) * scale
    if mask is not None:
        m = mask[..., : x.shape[-2], :].astype(np.float64)
        m = tile_to(m, x.shape) if m.ndim > 2 else np.broadcast_to(m, x.shape)
        if max_bias > 0:
            m = m * alibi_slopes(x.shape[-3], max_bias)[:, None, None]
        x = x + m
    return x


def softmax64(x: Arr) -> Arr:
    mx = np.max(x, axis=-1, keepdims=True)
    mx = np.where(np.isfinite(mx), mx, 0.0)
    e = np.exp(x - mx)
    return e / e.sum(axis=-1, keepdims=True)


def soft_max(n: Tensor, s: list, o: tuple[int, ...]) -> Arr:
    x = _masked_scores(s[0], s[1], n.params["scale"], n.params["max_bias"])
    return f32(softmax64(x))


def diag_mask_inf(n: Tensor, s: list, o: tuple[int, ...]) -> Arr:
    x = s[0].copy()
    rows, cols = x.shape[-2], x.shape[-1]
    masked = np.arange(cols)[None, :] > (n.params["n_past"] + np.arange(rows)[:, None])
    x[..., masked] = -np.inf
    return x


def yarn_corr_dims(n_dims: int, n_ctx_orig: int, base: float, beta_fast: float,
                   beta_slow: float) -> tuple[float, float]:
    """The pairs between which YaRN's ramp falls from extrapolation to interpolation (ggml_rope_yarn_corr_dims): the
    pair whose wavelength fits `beta` times into the original context, for beta_fast (floored, at least 0) and for
    beta_slow (ceiled, at most n_dims - 1). A 0 context gives log(0) = -inf, as in ggml's float math."""
    with np.errstate(divide="ignore", invalid="ignore"):
        betas = np.array([beta_fast, beta_slow], dtype=np.float64)
        d = n_dims * np.log(np.float64(n_ctx_orig) / (betas * 2.0 * np.pi)) / (2.0 * np.log(np.float64(base)))
    return max(0.0, float(np.floor(d[0]))), min(n_dims - 1.0, float(np.ceil(d[1])))


def rope_angles(n: Tensor, pos: Arr, ff: Arr | None) -> tuple[Arr, float]:
    """Each token's angle per rotated pair (T, n_dims/2) and the factor on cos and sin, as ggml's rope_yarn computes
    them (in float64): theta_extrap = pos * base^(-2i/n_dims) / ff[i], theta_interp = freq_scale * theta_extrap; with
    ext_factor, a ramp over the correction dims mixes them and the magnitude grows by 1 + 0.1 ln(1/freq_scale)."""
    p = n.params
    nd = p["n_dims"]
    i = np.arange(nd // 2, dtype=np.float64)
    extrap = pos.astype(np.float64)[:, None] * (np.float64(p["freq_base"]) ** (-2.0 * i / nd))[None, :]
    if ff is not None:
        extrap = extrap / ff.astype(np.float64)[None, :]
    theta = extrap * p["freq_scale"]
    mscale = float(p["attn_factor"])
    if p["ext_factor"] != 0.0:
        low, high = yarn_corr_dims(nd, p["n_ctx_orig"], p["freq_base"], p["beta_fast"], p["beta_slow"])
        mix = (1.0 - np.clip((i - low) / max(0.001, high - low), 0.0, 1.0)) * p["ext_factor"]
        theta = theta * (1.0 - mix) + extrap * mix
        with np.errstate(divide="ignore"):
            mscale *= 1.0 + 0.1 * float(-np.log(np.float64(p["freq_scale"])))
    return theta, mscale


def rope(n: Tensor, s: list, o: tuple[int, ...]) -> Arr:
    x, pos, ff = s[0].astype(np.float64), s[1], s[2]
    nd = n.params["n_dims"]
    half = nd // 2
    theta, mscale = rope_angles(n, pos, ff)  # (T, half)
    cos = (np.cos(theta) * mscale)[:, None, :]  # broadcast over heads
    sin = (np.sin(theta) * mscale)[:, None, :]
    out = x.copy()
    if n.params["mode"] == 2:  # neox: rotate first half against second half
        x0, x1 = x[..., :half], x[..., half:nd]
        out[..., :half] = x0 * cos - x1 * sin
        out[..., half:nd] = x0 * sin + x1 * cos
    else:  # normal: adjacent pairs
        x0, x1 = x[..., 0:nd:2], x[..., 1:nd:2]
        out[..., 0:nd:2] = x0 * cos - x1 * sin
        out[..., 1:nd:2] = x0 * sin + x1 * cos
    return f32(out)


def flash_attn_ext(n: Tensor, s: list, o: tuple[int, ...]) -> Arr:
    q, k, v, mask = s
    p = n.params
    q = q.astype(np.float64)
    rep = q.shape[-3] // k.shape[-3]
    k = np.repeat(k.astype(np.float64), rep, axis=-3)
    v = np.repeat(v.astype(np.float64), rep, axis=-3)
    sc = np.matmul(q, np.swapaxes(k, -1, -2)) * p["scale"]
    if p["softcap"]:
        sc = p["softcap"] * np.tanh(sc / p["softcap"])
    sc = _masked_scores(sc, mask, 1.0, p["max_bias"])
    # ggml divides by the row's sum only when it is not 0: a query whose keys are all masked gets zeros, not NaN
    mx = np.max(sc, axis=-1, keepdims=True)
    e = np.exp(sc - np.where(np.isfinite(mx), mx, 0.0))
    den = e.sum(axis=-1, keepdims=True)
    out = np.matmul(e / np.where(den == 0, 1.0, den), v)  # (..., H, Nq, Dv)
    return f32(np.swapaxes(out, -2, -3))


def get_rows(n: Tensor, s: list, o: tuple[int, ...]) -> Arr:
    a, idx = s  # a float32 (dequantized) or int32
    rows = a.shape[-2]
    if idx.size and (idx.min() < 0 or idx.max() >= rows):  # numpy would wrap -1 to the last row
        from ggml_py.errors import BackendError

        bad = int(idx[(idx < 0) | (idx >= rows)].flat[0])
        raise BackendError(f"GET_ROWS: row index {bad} out of range 0..{rows - 1}")
    if a.ndim == 2:
        return a[idx]
    return np.take_along_axis(a, idx[..., None].astype(np.intp), axis=-2)


def concat(n: Tensor, s: list, o: tuple[int, ...]) -> Arr:
    return np.concatenate([s[0], s[1]], axis=n.params["axis"])


def pad(n: Tensor, s: list, o: tuple[int, ...]) -> Arr:
    return np.pad(s[0], [(0, p) for p in n.params["pads"]])


def argmax(n: Tensor, s: list, o: tuple[int, ...]) -> Arr:
    return np.argmax(s[0], axis=-1).astype(np.int32).reshape(o)


def _top_row(x: Arr, k: int) -> Arr:
    nan = np.flatnonzero(np.isnan(x))  # NaN first, in index order
    if nan.size >= k:
        return nan[:k]
    rest = k - nan.size
    idx = np.flatnonzero(~np.isnan(x))
    v = x[idx]
    if rest < v.size:  # the rest largest; at the cut, the lower indices of equal values
        kth = -np.partition(-v, rest - 1)[rest - 1]
        above = idx[v > kth]
        idx = np.concatenate([above, idx[v == kth][: rest - above.size]])
    order = np.lexsort((idx, -x[idx]))  # largest first, the lower index first on ties
    return np.concatenate([nan, idx[order]])


def top_k(n: Tensor, s: list, o: tuple[int, ...]) -> Arr:
    x = s[0]
    rows = x.reshape(-1, x.shape[-1])
    return np.stack([_top_row(r, n.params["k"]) for r in rows]).astype(np.int32).reshape(o)


KERNELS: dict[str, Kernel] = {
    "ADD": _binary(np.add),
    "SUB": _binary(np.subtract),
    "MUL": _binary(np.multiply),
    "DIV": _binary(np.divide),
    "SCALE": lambda n, s, o: f32(s[0] * np.float32(n.params["s"]) + np.float32(n.params["b"])),
    "SQR": _unary(np.square),
    "SQRT": _unary(np.sqrt),
    "NEG": _unary(np.negative),
    "ABS": _unary(np.abs),
    "EXP": _unary(np.exp),
    "LOG": _unary(np.log),
    "SILU": _unary(silu),
    "GELU": _unary(gelu),
    "RELU": _unary(lambda x: np.where(x > 0, x, np.float32(0))),  # ggml: x > 0 ? x : 0, so relu(NaN) = 0
    "TANH": _unary(np.tanh),
    "SIGMOID": _unary(lambda x: 1.0 / (1.0 + np.exp(-x.astype(np.float64)))),
    "GELU_ERF": _unary(gelu_erf),
    "CLAMP": lambda n, s, o: np.clip(s[0], n.params["min"], n.params["max"]),
    "SWIGLU": _glu(silu),
    "GEGLU": _glu(gelu),
    "NORM": norm,
    "RMS_NORM": rms_norm,
    "SUM_ROWS": lambda n, s, o: f32(s[0].astype(np.float64).sum(axis=-1, keepdims=True)),
    "MEAN": lambda n, s, o: f32(s[0].astype(np.float64).mean(axis=-1, keepdims=True)),
    "ARGMAX": argmax,
    "TOP_K": top_k,
    "MUL_MAT": mul_mat,
    "MUL_MAT_ID": mul_mat_id,
    "SOFT_MAX": soft_max,
    "DIAG_MASK_INF": diag_mask_inf,
    "ROPE": rope,
    "FLASH_ATTN_EXT": flash_attn_ext,
    "GET_ROWS": get_rows,
    "CONCAT": concat,
    "REPEAT": lambda n, s, o: np.array(tile_to(s[0], o)),
    "PAD": pad,
    "CONT": lambda n, s, o: s[0],
    "CPY": lambda n, s, o: s[0],
    "SET_ROWS": lambda n, s, o: s[1],  # written row-wise by the executor
}
