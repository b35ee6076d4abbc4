"""ggml_py.formats.quants against gguf.quants (bit for bit) and, for the K-quant and IQ4 quantizers gguf lacks, against
a literal scalar transliteration of ggml's reference C (quantize_row_q{2,3,4,5,6}_K_ref, quantize_iq4_{nl,xs}) plus
round-trip error bounds."""

from __future__ import annotations

import time

import gguf
import gguf.quants as gq
import numpy as np
import pytest

from ggml_py.errors import ShapeError
from ggml_py.formats import quants
from ggml_py.ir import dtypes

GT = gguf.GGMLQuantizationType
# gguf warns on the degenerate blocks we feed it on purpose (subnormal / NaN scales); ours must stay silent
pytestmark = [
    pytest.mark.filterwarnings("ignore::RuntimeWarning:gguf.quants"),
    pytest.mark.filterwarnings("error::RuntimeWarning:ggml_py.formats.quants"),
]

BLOCK_TYPES = ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "IQ4_NL", "IQ4_XS"]
FLOAT_TYPES = ["F32", "F16", "BF16"]
LEGACY_TYPES = ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0"]  # gguf can quantize these
K_TYPES = ["Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "IQ4_NL", "IQ4_XS"]  # gguf raises NotImplementedError for these
# Byte offsets of the f16 fields (d, and m/dmin) inside one block.
F16_FIELDS = {"Q4_0": [0], "Q4_1": [0, 2], "Q5_0": [0], "Q5_1": [0, 2], "Q8_0": [0],
              "Q2_K": [80, 82], "Q3_K": [108], "Q4_K": [0, 2], "Q5_K": [0, 2], "Q6_K": [208],
              "IQ4_NL": [0], "IQ4_XS": [0]}  # fmt: skip

F = np.float32


def sizes(name: str) -> tuple[int, int]:
    return gguf.GGML_QUANT_SIZES[GT[name]]


def assert_bits_equal(ours: np.ndarray, ref: np.ndarray) -> None:
    """Same shape, dtype and bits; any NaN matches any NaN (payloads are not specified)."""
    assert ours.shape == ref.shape
    assert ours.dtype == ref.dtype
    if ours.dtype.kind != "f":
        np.testing.assert_array_equal(ours, ref)
        return
    nan_o, nan_r = np.isnan(ours), np.isnan(ref)
    np.testing.assert_array_equal(nan_o, nan_r)
    uint = np.dtype(f"u{ours.dtype.itemsize}")
    np.testing.assert_array_equal(ours[~nan_o].view(uint), ref[~nan_r].view(uint))


def gguf_dequantize(raw: np.ndarray, name: str) -> np.ndarray:
    with np.errstate(all="ignore"):
        return gq.dequantize(raw, GT[name])


def random_blocks(rng: np.random.Generator, name: str, shape: tuple[int, ...]) -> np.ndarray:
    """Random block bytes of shape (*shape, type_size) whose f16 fields are finite (zeros, subnormals, large)."""
    _, ts = sizes(name)
    raw = rng.integers(0, 256, size=(*shape, ts), dtype=np.uint8)
    for off in F16_FIELDS[name]:
        n = int(np.prod(shape))
        v = rng.standard_normal(n) * 10.0 ** rng.uniform(-7, 3.5, n)
        v[rng.random(n) < 0.05] = 0.0
        raw[..., off : off + 2] = v.astype(np.float16).reshape(*shape, 1).view(np.uint8)
    return raw


def rows_of_blocks(raw: np.ndarray) -> np.ndarray:
    """(..., blocks_per_row, type_size) -> (..., row_bytes)."""
    return raw.reshape(*raw.shape[:-2], -1)


def sample_data(rng: np.random.Generator, rows: int, cols: int) -> np.ndarray:
    """Rows of varied character: scaled gaussians, zeros, constants, ties, tiny, huge, one-sided, spikes."""
    x = rng.standard_normal((rows, cols)) * 10.0 ** rng.uniform(-3, 3, (rows, 1))
    kinds = [
        np.zeros(cols),
        np.full(cols, 0.75),
        np.full(cols, -3.0),
        rng.integers(-8, 9, cols).astype(np.float64),  # exact ties after scaling
        rng.integers(-3, 4, cols) * 0.5,
        rng.standard_normal(cols) * 1e-6,
        rng.standard_normal(cols) * 1e-41,  # float32 subnormals
        rng.standard_normal(cols) * 1e4,
        np.abs(rng.standard_normal(cols)),
        -np.abs(rng.standard_normal(cols)) - 1.0,
        np.where(rng.random(cols) < 0.02, 100.0, rng.standard_normal(cols) * 0.01),
    ]
    for i, k in enumerate(kinds[: rows // 2]):
        x[2 * i + 1] = k
    return x.astype(np.float32)


# ------------------------------------------------------------------------------------------------------ dequantize


@pytest.mark.parametrize("name", BLOCK_TYPES)
@pytest.mark.parametrize("shape", [(1, 1), (7, 3), (2, 3, 2), (5,)], ids=str)
def test_dequantize_matches_gguf(rng, name, shape):
    raw = rows_of_blocks(random_blocks(rng, name, shape))  # shape = (*rows, blocks per row); (5,) is one 1-D row
    ours = quants.dequantize(raw, name)
    assert_bits_equal(ours, gguf_dequantize(raw, name))
    bs, ts = sizes(name)
    assert ours.shape == (*raw.shape[:-1], raw.shape[-1] // ts * bs)


@pytest.mark.parametrize("name", BLOCK_TYPES + FLOAT_TYPES)
def test_dequantize_random_bytes_matches_gguf(rng, name):
    """Unconstrained bytes: scale fields may be inf/NaN; results must still agree (NaN where gguf has NaN)."""
    _, ts = sizes(name)
    raw = rng.integers(0, 256, size=(9, 4 * ts * (8 if ts <= 4 else 1)), dtype=np.uint8)
    with np.errstate(all="ignore"):
        assert_bits_equal(quants.dequantize(raw, name), gguf_dequantize(raw, name))


@pytest.mark.parametrize("name", ["Q2_K", "Q3_K", "IQ4_NL", "IQ4_XS"])
def test_dequantize_low_bit_k_extremes(rng, name):
    """Uniform byte patterns (every scale / min / level at 0, at its top, alternating) under extreme finite f16
    scales: max, -max, smallest subnormal, +-0, one; every combination, bit for bit against gguf."""
    _, ts = sizes(name)
    fills = [np.zeros(ts, np.uint8), np.full(ts, 0xFF, np.uint8), np.full(ts, 0xAA, np.uint8),
             np.full(ts, 0x55, np.uint8), rng.integers(0, 256, ts, dtype=np.uint8)]  # fmt: skip
    scales = np.array([65504.0, -65504.0, 2.0**-24, 0.0, -0.0, 1.0], np.float16)
    blocks = []
    for fill in fills:
        for pair in np.stack(np.meshgrid(scales, scales), axis=-1).reshape(-1, 2):
            b = fill.copy()
            for off, v in zip(F16_FIELDS[name], pair):
                b[off : off + 2] = np.array([v], np.float16).view(np.uint8)
            blocks.append(b)
    raw = np.stack(blocks).reshape(-1, 4 * ts)  # several blocks per row
    assert_bits_equal(quants.dequantize(raw, name), gguf_dequantize(raw, name))


@pytest.mark.parametrize("name", LEGACY_TYPES + ["BF16"])
def test_dequantize_of_gguf_quantized(rng, name):
    x = sample_data(rng, 23, 96)
    raw = gq.quantize(x, GT[name])
    assert_bits_equal(quants.dequantize(raw, name), gguf_dequantize(raw, name))


@pytest.mark.parametrize("name", ["F16", "BF16", "F32"])
def test_dequantize_float_types_accept_typed_arrays(rng, name):
    x = sample_data(rng, 5, 8)
    raw = quants.quantize(x, name)  # float16 / uint8 / float32
    assert_bits_equal(quants.dequantize(raw, name), gguf_dequantize(raw, name))
    if name == "BF16":
        # an extension over gguf (which wants bytes): raw uint16 bit patterns are accepted too
        assert_bits_equal(quants.dequantize(raw.view(np.uint16), name), gguf_dequantize(raw, name))


def test_dequantize_non_contiguous_rows(rng):
    raw = rows_of_blocks(random_blocks(rng, "Q4_K", (8, 2)))
    strided = raw[::2]
    assert not strided.flags.c_contiguous
    assert_bits_equal(quants.dequantize(strided, "Q4_K"), gguf_dequantize(np.ascontiguousarray(strided), "Q4_K"))


def test_dequantize_empty():
    _, ts = sizes("Q6_K")
    out = quants.dequantize(np.zeros((0, 2 * ts), np.uint8), "Q6_K")
    assert out.shape == (0, 512) and out.dtype == np.float32


# -------------------------------------------------------------------------------------------------------- quantize


@pytest.mark.parametrize("name", LEGACY_TYPES + FLOAT_TYPES)
@pytest.mark.parametrize("shape", [(23, 64), (2, 3, 96), (32,), (1, 256)], ids=str)
def test_quantize_matches_gguf(rng, name, shape):
    x = sample_data(rng, int(np.prod(shape[:-1])), shape[-1]).reshape(shape)
    ours = quants.quantize(x, name)
    assert_bits_equal(ours, gq.quantize(x, GT[name]))


@pytest.mark.parametrize("name", LEGACY_TYPES + FLOAT_TYPES)
def test_quantize_float64_and_strided_input(rng, name):
    x = sample_data(rng, 14, 128).astype(np.float64)
    assert_bits_equal(quants.quantize(x, name), gq.quantize(x, GT[name]))
    view = x[::2, :64]
    assert_bits_equal(quants.quantize(view, name), gq.quantize(np.ascontiguousarray(view), GT[name]))


def test_bf16_special_values():
    vals = np.array(
        [0.0, -0.0, 1.0, -1.0, np.inf, -np.inf, np.nan, -np.nan, 3.4e38, -3.4e38, 1e-40, -1e-45,
         1.0 + 2.0**-8, 1.0 + 3 * 2.0**-8, 1.0 + 2.0**-8 + 2.0**-20, 65504.0, 1.2e-38],
        dtype=np.float32,
    )  # fmt: skip
    bits = vals.view(np.uint32)
    extra = np.array([0x7F800001, 0xFFC00001, 0x7FFFFFFF, 0x7F7FFFFF, 0x00008000, 0x00018000], np.uint32)
    x = np.concatenate([bits, extra]).view(np.float32)
    ours = quants.quantize(x, "BF16")
    assert_bits_equal(ours, gq.quantize(x, GT.BF16))
    assert_bits_equal(quants.dequantize(ours, "BF16"), gguf_dequantize(ours, "BF16"))
    back = quants.dequantize(ours, "BF16")
    assert np.isnan(back[6]) and np.isposinf(back[4]) and back[12] == 1.0 and back[13] == 1.0 + 2.0**-6


def test_quantize_empty():
    out = quants.quantize(np.zeros((0, 64), np.float32), "Q8_0")
    assert out.shape == (0, 68) and out.dtype == np.uint8


# ------------------------------------------------------------------------ K-quant quantize (ggml reference algorithm)


def nearest_int(v: np.float32) -> int:
    return int(np.rint(v))  # ggml's magic-number rounding is round-half-even


def nearest_int_bits(v) -> int:
    """ggml's nearest_int exactly (also outside its asserted range): float32 add of 1.5*2**23, low mantissa bits."""
    i = int(np.array([F(v) + F(12582912)], np.float32).view(np.int32)[0])
    return (i & 0x007FFFFF) - 0x00400000


def ref_make_qkx2(x, w, nmax, rmin, rdelta, nstep, use_mad=False):
    """make_qkx2_quants, transliterated line by line in float32 scalars."""
    n = len(x)
    mn, mx = x[0], x[0]
    sum_w = w[0]
    sum_x = sum_w * x[0]
    for i in range(1, n):
        if x[i] < mn:
            mn = x[i]
        if x[i] > mx:
            mx = x[i]
        sum_w += w[i]
        sum_x += w[i] * x[i]
    if mn > 0:
        mn = F(0)
    if mx == mn:
        return [0] * n, F(0), -mn
    iscale = F(nmax) / (mx - mn)
    scale = F(1) / iscale
    L = [max(0, min(nmax, nearest_int_bits(iscale * (x[i] - mn)))) for i in range(n)]
    best = F(0)
    for i in range(n):
        diff = scale * F(L[i]) + mn - x[i]
        best += w[i] * (abs(diff) if use_mad else diff * diff)
    for step in range(nstep + 1):
        iscale = (F(rmin) + F(rdelta) * F(step) + F(nmax)) / (mx - mn)
        laux = [max(0, min(nmax, nearest_int_bits(iscale * (x[i] - mn)))) for i in range(n)]
        sum_l, sum_l2, sum_xl = F(0), F(0), F(0)
        for i in range(n):
            l = F(laux[i])
            sum_l += w[i] * l
            sum_l2 += w[i] * l * l
            sum_xl += w[i] * l * x[i]
        det = sum_w * sum_l2 - sum_l * sum_l
        if det > 0:
            this_scale = (sum_w * sum_xl - sum_x * sum_l) / det
            this_min = (sum_l2 * sum_x - sum_l * sum_xl) / det
            if this_min > 0:
                this_min = F(0)
                this_scale = sum_xl / sum_l2
            cur = F(0)
            for i in range(n):
                diff = this_scale * F(laux[i]) + this_min - x[i]
                cur += w[i] * (abs(diff) if use_mad else diff * diff)
            if cur < best:
                L, best, scale, mn = laux, cur, this_scale, this_min
    return L, scale, -mn


def ref_q45_k_block(x: np.ndarray, nmax: int) -> bytes:
    """quantize_row_q4_K_ref (nmax=15) / quantize_row_q5_K_ref (nmax=31) for one block."""
    rmin, nstep = (-1.0, 20) if nmax == 15 else (-0.5, 15)
    x = [F(v) for v in x]
    L, scales, mins = [0] * 256, [], []
    for j in range(8):
        xs = x[32 * j : 32 * j + 32]
        sum_x2 = F(0)
        for v in xs:
            sum_x2 += v * v
        av_x = np.sqrt(sum_x2 / F(32))
        w = [av_x + abs(v) for v in xs]
        lj, s, m = ref_make_qkx2(xs, w, nmax, rmin, 0.1, nstep)
        L[32 * j : 32 * j + 32] = lj
        scales.append(s)
        mins.append(m)
    max_scale, max_min = F(0), F(0)
    for j in range(8):
        if scales[j] > max_scale:
            max_scale = scales[j]
        if mins[j] > max_min:
            max_min = mins[j]
    inv_scale = F(63) / max_scale if max_scale > 0 else F(0)
    inv_min = F(63) / max_min if max_min > 0 else F(0)
    sc = [0] * 12
    for j in range(8):
        ls = min(63, nearest_int(inv_scale * scales[j]) & 0xFF)
        lm = min(63, nearest_int(inv_min * mins[j]) & 0xFF)
        if j < 4:
            sc[j] = ls
            sc[j + 4] = lm
        else:
            sc[j + 4] = (ls & 0xF) | ((lm & 0xF) << 4)
            sc[j - 4] |= (ls >> 4) << 6
            sc[j] |= (lm >> 4) << 6
    d16 = np.float16(max_scale / F(63))
    dmin16 = np.float16(max_min / F(63))
    for j in range(8):
        if j < 4:
            s, m = sc[j] & 63, sc[j + 4] & 63
        else:
            s = (sc[j + 4] & 0xF) | ((sc[j - 4] >> 6) << 4)
            m = (sc[j + 4] >> 4) | ((sc[j] >> 6) << 4)
        d = F(d16) * F(s)
        if not d:
            continue
        dm = F(dmin16) * F(m)
        for i in range(32):
            L[32 * j + i] = max(0, min(nmax, nearest_int((x[32 * j + i] + dm) / d)))
    qh = [0] * 32
    qs = []
    for n in range(0, 256, 64):
        for j in range(32):
            l1, l2 = L[n + j], L[n + j + 32]
            if l1 > 15:
                l1 -= 16
                qh[j] |= 1 << (n // 32)
            if l2 > 15:
                l2 -= 16
                qh[j] |= 2 << (n // 32)
            qs.append(l1 | (l2 << 4))
    head = d16.tobytes() + dmin16.tobytes() + bytes(sc)
    return head + (bytes(qh) if nmax == 31 else b"") + bytes(qs)


def pack_crumbs_ref(L) -> list[int]:
    return [L[j + l] | (L[j + l + 32] << 2) | (L[j + l + 64] << 4) | (L[j + l + 96] << 6)
            for j in (0, 128) for l in range(32)]  # fmt: skip


def ref_q2_k_block(x: np.ndarray) -> bytes:
    """quantize_row_q2_K_ref for one block."""
    x = [F(v) for v in x]
    L, scales, mins = [0] * 256, [], []
    max_scale, max_min = F(0), F(0)
    for j in range(16):
        xs = x[16 * j : 16 * j + 16]
        lj, sc, mn = ref_make_qkx2(xs, [abs(v) for v in xs], 3, -0.5, 0.1, 15, use_mad=True)
        L[16 * j : 16 * j + 16] = lj
        scales.append(sc)
        mins.append(mn)
        if sc > max_scale:
            max_scale = sc
        if mn > max_min:
            max_min = mn
    sc = [0] * 16
    if max_scale > 0:
        iscale = F(15) / max_scale
        sc = [nearest_int_bits(iscale * s) & 0xFF for s in scales]
    d16 = np.float16(max_scale / F(15)) if max_scale > 0 else np.float16(0)
    if max_min > 0:
        iscale = F(15) / max_min
        sc = [(sc[j] | (nearest_int_bits(iscale * mins[j]) << 4)) & 0xFF for j in range(16)]
    dmin16 = np.float16(max_min / F(15)) if max_min > 0 else np.float16(0)
    for j in range(16):
        d = F(d16) * F(sc[j] & 0xF)
        if not d:
            continue
        dm = F(dmin16) * F(sc[j] >> 4)
        for i in range(16):
            L[16 * j + i] = max(0, min(3, nearest_int_bits((x[16 * j + i] + dm) / d)))
    return bytes(sc) + bytes(pack_crumbs_ref(L)) + d16.tobytes() + dmin16.tobytes()


def ref_make_q3(x, nmax):
    """make_q3_quants(do_rmse=true), transliterated in float32 scalars."""
    n = len(x)
    mx, amax = F(0), F(0)
    for v in x:
        if abs(v) > amax:
            amax, mx = abs(v), v
    if amax < F(1e-15):
        return [0] * n, F(0)
    iscale = F(-nmax) / mx
    sumlx, suml2 = F(0), F(0)
    L = []
    for v in x:
        l = max(-nmax, min(nmax - 1, nearest_int_bits(iscale * v)))
        L.append(l)
        w = v * v
        sumlx += w * v * F(l)
        suml2 += w * F(l) * F(l)
    for _ in range(5):
        n_changed = 0
        for i in range(n):
            w = x[i] * x[i]
            slx = sumlx - w * x[i] * F(L[i])
            if slx > 0:
                sl2 = suml2 - w * F(L[i]) * F(L[i])
                new_l = max(-nmax, min(nmax - 1, nearest_int_bits(x[i] * sl2 / slx)))
                if new_l != L[i]:
                    slx += w * x[i] * F(new_l)
                    sl2 += w * F(new_l) * F(new_l)
                    if sl2 > 0 and slx * slx * suml2 > sumlx * sumlx * sl2:
                        L[i], sumlx, suml2 = new_l, slx, sl2
                        n_changed += 1
        if not n_changed:
            break
    return [l + nmax for l in L], (sumlx / suml2 if suml2 > 0 else F(0))


def ref_q3_k_block(x: np.ndarray) -> bytes:
    """quantize_row_q3_K_ref for one block."""
    x = [F(v) for v in x]
    L, scales = [0] * 256, []
    max_scale, amax = F(0), F(0)
    for j in range(16):
        lj, s = ref_make_q3(x[16 * j : 16 * j + 16], 4)
        L[16 * j : 16 * j + 16] = lj
        scales.append(s)
        if abs(s) > amax:
            amax, max_scale = abs(s), s
    sc = [0] * 12
    if max_scale:
        iscale = F(-32) / max_scale
        for j in range(16):
            l = ((nearest_int_bits(iscale * scales[j]) + 128) & 0xFF) - 128  # int8_t
            l = max(-32, min(31, l)) + 32
            if j < 8:
                sc[j] = l & 0xF
            else:
                sc[j - 8] |= (l & 0xF) << 4
            sc[j % 4 + 8] |= (l >> 4) << (2 * (j // 4))
        d16 = np.float16(F(1) / iscale)
    else:
        d16 = np.float16(0)
    for j in range(16):
        s = sc[j] & 0xF if j < 8 else sc[j - 8] >> 4
        s = (s | (((sc[8 + j % 4] >> (2 * (j // 4))) & 3) << 4)) - 32
        d = F(d16) * F(s)
        if not d:
            continue
        for i in range(16):
            L[16 * j + i] = max(-4, min(3, nearest_int_bits(x[16 * j + i] / d))) + 4
    hmask = [0] * 32
    for j in range(256):
        if L[j] > 3:
            hmask[j % 32] |= 1 << (j // 32)
            L[j] -= 4
    return bytes(hmask) + bytes(pack_crumbs_ref(L)) + bytes(sc) + d16.tobytes()


def ref_make_qx(x, nmax):
    """make_qx_quants(rmse_type=1, qw=NULL), transliterated in float32 scalars."""
    n = len(x)
    mx, amax = F(0), F(0)
    for v in x:
        if abs(v) > amax:
            amax, mx = abs(v), v
    if amax < F(1e-15):
        return [0] * n, F(0)
    iscale = F(-nmax) / mx
    sumlx, suml2 = F(0), F(0)
    L = []
    for v in x:
        l = max(-nmax, min(nmax - 1, nearest_int(iscale * v)))
        L.append(l + nmax)
        w = v * v
        sumlx += w * v * F(l)
        suml2 += w * F(l) * F(l)
    scale = sumlx / suml2 if suml2 else F(0)
    best = scale * sumlx
    for step in range(-9, 10):
        if step == 0:
            continue
        iscale = -(F(nmax) + F(0.1) * F(step)) / mx
        sumlx, suml2 = F(0), F(0)
        for v in x:
            l = max(-nmax, min(nmax - 1, nearest_int(iscale * v)))
            w = v * v
            sumlx += w * v * F(l)
            suml2 += w * F(l) * F(l)
        if suml2 > 0 and sumlx * sumlx > best * suml2:
            L = [nmax + max(-nmax, min(nmax - 1, nearest_int(iscale * v)))
                 for v in x]  # fmt: skip
            scale = sumlx / suml2
            best = scale * sumlx
    return L, scale


def ref_q6_k_block(x: np.ndarray) -> bytes:
    """quantize_row_q6_K_ref for one block."""
    x = [F(v) for v in x]
    L, scales = [0] * 256, []
    max_scale, max_abs = F(0), F(0)
    for ib in range(16):
        lb, s = ref_make_qx(x[16 * ib : 16 * ib + 16], 32)
        L[16 * ib : 16 * ib + 16] = lb
        scales.append(s)
        if abs(s) > max_abs:
            max_abs, max_scale = abs(s), s
    if max_abs < F(1e-15):
        return bytes(210)
    iscale = F(-128) / max_scale
    d16 = np.float16(F(1) / iscale)
    sc = [min(127, nearest_int(iscale * s)) for s in scales]
    for j in range(16):
        d = F(d16) * F(sc[j])
        if not d:
            continue
        for i in range(16):
            L[16 * j + i] = max(-32, min(31, nearest_int(x[16 * j + i] / d))) + 32
    ql, qh = [0] * 128, [0] * 64
    for h in range(2):
        j = 128 * h
        for l in range(32):
            q1, q2, q3, q4 = (L[j + l + 32 * k] for k in range(4))
            ql[64 * h + l] = (q1 & 0xF) | ((q3 & 0xF) << 4)
            ql[64 * h + l + 32] = (q2 & 0xF) | ((q4 & 0xF) << 4)
            qh[32 * h + l] = (q1 >> 4) | ((q2 >> 4) << 2) | ((q3 >> 4) << 4) | ((q4 >> 4) << 6)
    return bytes(ql) + bytes(qh) + np.array(sc, np.int8).tobytes() + d16.tobytes()


IQ4_VALUES = [-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113]


def ref_iq4_index(x) -> int:
    """best_index_int8: bisection over the 16 levels, then the nearer neighbour (the upper one on ties)."""
    if x <= IQ4_VALUES[0]:
        return 0
    if x >= IQ4_VALUES[15]:
        return 15
    lo, hi = 0, 15
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if x < IQ4_VALUES[mid]:
            hi = mid
        else:
            lo = mid
    return hi - 1 if x - F(IQ4_VALUES[hi - 1]) < F(IQ4_VALUES[hi]) - x else hi


def ref_iq4_scale(xb, ntry=7):
    """quantize_row_iq4_nl_impl's scale search for one 32-element sub-block, weights x*x."""
    amax, mx = F(0), F(0)
    for v in xb:
        if abs(v) > amax:
            amax, mx = abs(v), v
    if amax < F(1e-15):
        return F(0)

    def sums(iscale):
        sqx, sq2 = F(0), F(0)
        for v in xb:
            q = F(IQ4_VALUES[ref_iq4_index(iscale * v)])
            sqx += v * v * q * v
            sq2 += v * v * q * q
        return sqx, sq2

    sqx, sq2 = sums(F(1) / (-mx / F(-127)))
    d = sqx / sq2 if sq2 > 0 else F(0)
    best = d * sqx
    for itry in range(-ntry, ntry + 1):
        sqx, sq2 = sums(F(itry - 127) / mx)
        if sq2 > 0 and sqx * sqx > best * sq2:
            d = sqx / sq2
            best = d * sqx
    return d


def ref_iq4_pack(L) -> bytes:
    return bytes(L[32 * i + j] | (L[32 * i + 16 + j] << 4) for i in range(len(L) // 32) for j in range(16))


def ref_iq4_nl_blocks(x) -> bytes:
    out = b""
    for ib in range(len(x) // 32):
        xb = x[32 * ib : 32 * ib + 32]
        d = ref_iq4_scale(xb)
        inv = F(1) / d if d else F(0)
        out += np.float16(d).tobytes() + ref_iq4_pack([ref_iq4_index(inv * v) for v in xb])
    return out


def ref_iq4_xs_block(x) -> bytes:
    scales = [ref_iq4_scale(x[32 * ib : 32 * ib + 32]) for ib in range(8)]
    amax, max_scale = F(0), F(0)
    for s in scales:
        if abs(s) > amax:
            amax, max_scale = abs(s), s
    d = -max_scale / F(32)
    inv = F(1) / d if d else F(0)
    L, scales_h, scales_l = [], 0, [0] * 4
    for ib in range(8):
        ls = max(-32, min(31, nearest_int_bits(inv * scales[ib])))
        dl = d * F(ls)
        idl = F(1) / dl if dl else F(0)
        L += [ref_iq4_index(idl * v) for v in x[32 * ib : 32 * ib + 32]]
        scales_l[ib // 2] |= ((ls + 32) & 0xF) << (4 * (ib % 2))
        scales_h |= ((ls + 32) >> 4) << (2 * ib)
    return np.float16(d).tobytes() + np.uint16(scales_h).tobytes() + bytes(scales_l) + ref_iq4_pack(L)


def reference_k(x: np.ndarray, name: str) -> np.ndarray:
    blocks = x.reshape(-1, 256)
    fn = {"Q2_K": ref_q2_k_block, "Q3_K": ref_q3_k_block, "Q4_K": lambda b: ref_q45_k_block(b, 15),
          "Q5_K": lambda b: ref_q45_k_block(b, 31), "Q6_K": ref_q6_k_block,
          "IQ4_NL": ref_iq4_nl_blocks, "IQ4_XS": ref_iq4_xs_block}  # fmt: skip
    out = b"".join(fn[name](b) for b in blocks)
    return np.frombuffer(out, np.uint8).reshape(*x.shape[:-1], -1)


def k_test_blocks(rng: np.random.Generator) -> np.ndarray:
    blocks = [
        rng.standard_normal(256),
        rng.standard_normal(256) * 1e-3 + 0.5,
        np.abs(rng.standard_normal(256)) + 2.0,  # all positive: min clamps to 0
        -np.abs(rng.standard_normal(256)),
        np.zeros(256),
        np.concatenate([np.zeros(64), rng.standard_normal(192)]),  # zero sub-blocks
        np.where(rng.random(256) < 0.03, 50.0, rng.standard_normal(256)),
        rng.integers(-4, 5, 256) * 0.25,
        np.full(256, -1.5),
        rng.standard_normal(256) * 1e-20,
    ]
    return np.stack(blocks).astype(np.float32)


def test_gguf_cannot_quantize_k_types():
    """Documents why the K-quants are checked against our own reference below."""
    for name in K_TYPES:
        with pytest.raises(NotImplementedError):
            gq.quantize(np.zeros((1, 256), np.float32), GT[name])


@pytest.mark.parametrize("name", K_TYPES)
def test_k_quantize_matches_scalar_reference(rng, name):
    x = k_test_blocks(rng)
    ours = quants.quantize(x, name)
    ref = reference_k(x, name)
    assert ours.shape == ref.shape == (x.shape[0], dtypes.get(name).row_size(256))
    for i in range(x.shape[0]):
        np.testing.assert_array_equal(ours[i], ref[i], err_msg=f"block {i}")


def low_bit_extreme_blocks(rng: np.random.Generator) -> np.ndarray:
    """Blocks at the edges of float32 for Q2_K/Q3_K: huge (x**2 and x**3 overflow inside the C search), tiny and
    subnormal (scales overflow), f16-overflowing super-scales, ties, and sub-blocks of wildly different size."""
    mixed = rng.standard_normal(256) * np.repeat(10.0 ** rng.integers(-4, 5, 16), 16)
    blocks = [
        rng.standard_normal(256) * 1e4,
        rng.standard_normal(256) * 1e6,  # Q2_K's d = range/45 overflows f16 to inf
        rng.standard_normal(256) * 1e30,
        np.full(256, 3e38),
        rng.standard_normal(256) * 1e-30,
        rng.standard_normal(256) * 1e-41,  # float32 subnormals
        np.full(256, 0.75),
        np.full(256, -0.75),
        np.round(rng.standard_normal(256) * 3),
        mixed,
        -np.abs(rng.standard_normal(256)) * np.where(rng.random(256) < 0.05, 100.0, 1.0),
    ]
    return np.stack(blocks).astype(np.float32)


# Q4_K / Q5_K reach NaN levels on these blocks, which the scalar reference cannot convert to int; their extremes are
# checked against llama.cpp's own quantizer (tests/test_quants_vs_llamacpp.py's huge row)
@pytest.mark.parametrize("name", ["Q2_K", "Q3_K", "Q6_K", "IQ4_NL", "IQ4_XS"])
def test_k_quantize_extremes_match_scalar_reference(rng, name):
    x = np.concatenate([low_bit_extreme_blocks(rng), sample_data(rng, 22, 256)])
    with np.errstate(all="ignore"):  # the scalar reference overflows where C does
        ref = reference_k(x, name)
    ours = quants.quantize(x, name)
    for i in range(x.shape[0]):
        np.testing.assert_array_equal(ours[i], ref[i], err_msg=f"block {i}")


# Bounds on the per-row relative RMSE (sqrt of the row's NMSE). Measured maxima on this data (the rng fixture):
# Q2_K 0.318 (NMSE 0.101; 2.625 bits per weight is coarse), Q3_K 0.158 (NMSE 0.025), Q4_K 0.077, Q5_K 0.039,
# Q6_K 0.019, IQ4_NL 0.080, IQ4_XS 0.080.
@pytest.mark.parametrize(
    "name,max_rel_rmse",
    [("Q2_K", 0.36), ("Q3_K", 0.19), ("Q4_K", 0.09), ("Q5_K", 0.045), ("Q6_K", 0.022), ("IQ4_NL", 0.09),
     ("IQ4_XS", 0.09)],  # fmt: skip
)
def test_k_quantize_round_trip(rng, name, max_rel_rmse):
    # magnitudes where the f16 super-scale keeps full precision (below ~1e-3 it goes subnormal: a format limit)
    x = (rng.standard_normal((33, 512)) * 10.0 ** rng.uniform(-2, 4, (33, 1))).astype(np.float32)
    raw = quants.quantize(x, name)
    assert raw.dtype == np.uint8 and raw.shape == (33, dtypes.get(name).row_size(512))
    back = quants.dequantize(raw, name)
    assert_bits_equal(back, gguf_dequantize(raw, name))  # the bytes are a valid encoding as gguf reads them
    rel = np.sqrt(np.mean((back - x) ** 2, axis=1) / np.mean(x**2, axis=1))
    assert rel.max() < max_rel_rmse, rel.max()


@pytest.mark.parametrize("name", ["Q2_K", "Q3_K"])
def test_low_bit_k_requantize_is_stable(rng, name):
    """Quantizing dequantized values again. Q2_K's levels are a fixed point (measured: identical bytes on every
    row); make_q3_quants' rmse refinement may pick a different scale, but the second pass moves the values far less
    than the first one's error (measured: at most 0.12 of the row's first-pass NMSE, max 0.0029 against ~0.023)."""
    x = (rng.standard_normal((33, 512)) * 10.0 ** rng.uniform(-2, 4, (33, 1))).astype(np.float32)
    raw = quants.quantize(x, name)
    back = quants.dequantize(raw, name)
    raw2 = quants.quantize(back, name)
    back2 = quants.dequantize(raw2, name)
    if name == "Q2_K":
        np.testing.assert_array_equal(raw2, raw)
    nmse_first = np.sum((back - x) ** 2, axis=1) / np.sum(x**2, axis=1)
    nmse_again = np.sum((back2 - back) ** 2, axis=1) / np.sum(back**2, axis=1)
    assert (nmse_again <= 0.5 * nmse_first).all(), (nmse_again.max(), nmse_first.min())


@pytest.mark.parametrize("name", K_TYPES)
def test_k_quantize_shapes_and_zeros(rng, name):
    x = sample_data(rng, 6, 512).reshape(2, 3, 512)
    raw = quants.quantize(x, name)
    assert raw.shape == (2, 3, dtypes.get(name).row_size(512))
    np.testing.assert_array_equal(raw.reshape(6, -1), quants.quantize(x.reshape(6, 512), name))
    zeros = quants.dequantize(quants.quantize(np.zeros((3, 256), np.float32), name), name)
    assert not zeros.any()


# ------------------------------------------------------------------------------------------- types, errors, helpers


@pytest.mark.parametrize("spec", [GT.Q4_K, 12, "Q4_K", "q4_k", dtypes.Q4_K])
def test_qtype_spellings(rng, spec):
    raw = rows_of_blocks(random_blocks(rng, "Q4_K", (3, 2)))
    assert_bits_equal(quants.dequantize(raw, spec), gguf_dequantize(raw, "Q4_K"))
    x = sample_data(rng, 3, 256)
    np.testing.assert_array_equal(quants.quantize(x, spec), quants.quantize(x, "Q4_K"))


@pytest.mark.parametrize("spec", ["Q8_K", "I32", "Q8_1", "I8", GT.IQ2_XXS, GT.IQ3_S, GT.Q8_K])
def test_unsupported_types_raise_not_implemented(spec):
    name = spec if isinstance(spec, str) else spec.name
    with pytest.raises(NotImplementedError, match=name):
        quants.quantize(np.zeros((2, 256), np.float32), spec)
    with pytest.raises(NotImplementedError, match=name):
        quants.dequantize(np.zeros((2, 292), np.uint8), spec)


def test_unknown_type_is_value_error():
    with pytest.raises(ValueError):
        quants.quantize(np.zeros(32, np.float32), "Q9_Z")


def test_shape_errors():
    with pytest.raises(ShapeError):
        quants.quantize(np.zeros((2, 48), np.float32), "Q8_0")
    with pytest.raises(ShapeError):
        quants.quantize(np.zeros((2, 128), np.float32), "Q6_K")
    with pytest.raises(ShapeError):
        quants.dequantize(np.zeros((2, 35), np.uint8), "Q8_0")
    with pytest.raises(ShapeError):
        quants.dequantize(np.zeros((2, 7), np.uint8), "F32")


def test_supported_type_lists():
    assert set(quants.DEQUANTIZABLE) == {dtypes.get(n) for n in BLOCK_TYPES + FLOAT_TYPES}
    assert set(quants.QUANTIZABLE) == {dtypes.get(n) for n in BLOCK_TYPES + FLOAT_TYPES}


@pytest.mark.parametrize("name", BLOCK_TYPES + FLOAT_TYPES)
def test_rows_helpers(rng, name):
    x = sample_data(rng, 5, 512)
    raw = quants.quantize_rows(x, name)
    t = dtypes.get(name)
    assert raw.dtype == np.uint8 and raw.shape == (5, t.row_size(512))
    back = quants.dequantize_rows(raw, name, 512)
    assert back.dtype == np.float32 and back.shape == (5, 512)
    assert_bits_equal(back, quants.dequantize(quants.quantize(x, name), name))
    with pytest.raises(ShapeError):
        quants.dequantize_rows(raw, name, 256)
    with pytest.raises(ShapeError):
        quants.dequantize_rows(raw, name, 500)


def test_dequantize_speed_q4_k(rng):
    """A 4096x4096 Q4_K weight must dequantize well under a second (typically ~0.3 s); generous bound for CI."""
    raw = rows_of_blocks(random_blocks(rng, "Q4_K", (4096, 16)))
    quants.dequantize(raw[:16], "Q4_K")
    t0 = time.perf_counter()
    out = quants.dequantize(raw, "Q4_K")
    elapsed = time.perf_counter() - t0
    assert out.shape == (4096, 4096)
    assert elapsed < 2.0, f"{elapsed:.2f}s"
