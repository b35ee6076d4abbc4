// ggml's reference quantization of F32 rows to the K-quants Q2_K..Q6_K (quantize_row_q*_K_ref), bit-exact with
// ggml-quants.c and gguf.quants: the same float32 operations in the same order (sequential sums, compiled with
// -ffp-contract=off), ggml's nearest_int bit trick (which release builds apply beyond its asserted range too) and
// C's integer conversions (int to int8_t/uint8_t wrap). ggml_py.formats.quants.kquants is the same algorithm over
// numpy arrays; this one is what CPY (and so `ggml-py quantize`) runs.
#include "blocks.h"
#include "isa.h"

namespace gp {
namespace GP_NS {

static constexpr float GROUP_MAX_EPS = 1e-15f;
static constexpr int QK = 256;

// Round to nearest, ties to even, by adding 1.5 * 2^23 and reading the mantissa (ggml's nearest_int).
static inline int nearest_int(float v) {
    const float t = v + 12582912.f;
    int32_t i;
    memcpy(&i, &t, 4);
    return (i & 0x007fffff) - 0x00400000;
}
static inline int clampi(int v, int lo, int hi) { return v < lo ? lo : (v > hi ? hi : v); }

// make_qkx2_quants: an affine fit of n values to levels 0..nmax (weighted squared or absolute error), searched over
// nstep + 1 scales; returns the scale, *the_min the (non-negative) minimum to subtract.
static float make_qkx2(int n, int nmax, const float* x, const float* w, uint8_t* L, float* the_min, float rmin,
                       float rdelta, int nstep, bool use_mad) {
    float min = x[0], max = x[0];
    float sum_w = w[0], sum_x = sum_w * x[0];
    for (int i = 1; i < n; ++i) {
        if (x[i] < min) min = x[i];
        if (x[i] > max) max = x[i];
        sum_w += w[i];
        sum_x += w[i] * x[i];
    }
    if (min > 0) min = 0;
    if (max == min) {
        memset(L, 0, (size_t)n);
        *the_min = -min;
        return 0.f;
    }
    float iscale = nmax / (max - min);
    float scale = 1 / iscale;
    float best_error = 0;
    for (int i = 0; i < n; ++i) {
        L[i] = (uint8_t)clampi(nearest_int(iscale * (x[i] - min)), 0, nmax);
        float diff = scale * L[i] + min - x[i];
        diff = use_mad ? fabsf(diff) : diff * diff;
        best_error += w[i] * diff;
    }
    uint8_t Laux[32];
    for (int is = 0; is <= nstep; ++is) {
        iscale = (rmin + rdelta * is + nmax) / (max - min);
        float sum_l = 0, sum_l2 = 0, sum_xl = 0;
        for (int i = 0; i < n; ++i) {
            const int l = clampi(nearest_int(iscale * (x[i] - min)), 0, nmax);
            Laux[i] = (uint8_t)l;
            sum_l += w[i] * l;
            sum_l2 += w[i] * l * l;
            sum_xl += w[i] * l * x[i];
        }
        const float D = sum_w * sum_l2 - sum_l * sum_l;
        if (D > 0) {
            float this_scale = (sum_w * sum_xl - sum_x * sum_l) / D;
            float this_min = (sum_l2 * sum_x - sum_l * sum_xl) / D;
            if (this_min > 0) {
                this_min = 0;
                this_scale = sum_xl / sum_l2;
            }
            float cur_error = 0;
            for (int i = 0; i < n; ++i) {
                float diff = this_scale * Laux[i] + this_min - x[i];
                diff = use_mad ? fabsf(diff) : diff * diff;
                cur_error += w[i] * diff;
            }
            if (cur_error < best_error) {
                memcpy(L, Laux, (size_t)n);
                best_error = cur_error;
                scale = this_scale;
                min = this_min;
            }
        }
    }
    *the_min = -min;
    return scale;
}

// The value of largest magnitude, sign kept (the first of equals), and that magnitude.
static inline float signed_absmax(int n, const float* x, float* amax_out) {
    float max = 0, amax = 0;
    for (int i = 0; i < n; ++i) {
        const float ax = fabsf(x[i]);
        if (ax > amax) {
            amax = ax;
            max = x[i];
        }
    }
    *amax_out = amax;
    return max;
}

// make_qx_quants with rmse_type 1 and no importance weights: symmetric levels -nmax..nmax-1 (stored + nmax),
// weights x^2, the scale searched over 19 trials.
static float make_qx(int n, int nmax, const float* x, int8_t* L) {
    float amax;
    const float max = signed_absmax(n, x, &amax);
    if (amax < GROUP_MAX_EPS) {
        memset(L, 0, (size_t)n);
        return 0.f;
    }
    float iscale = -nmax / max;
    float sumlx = 0, suml2 = 0;
    for (int i = 0; i < n; ++i) {
        const int l = clampi(nearest_int(iscale * x[i]), -nmax, nmax - 1);
        L[i] = (int8_t)(l + nmax);
        const float w = x[i] * x[i];
        sumlx += w * x[i] * l;
        suml2 += w * l * l;
    }
    float scale = suml2 ? sumlx / suml2 : 0.0f;
    float best = scale * sumlx;
    for (int is = -9; is <= 9; ++is) {
        if (is == 0) continue;
        iscale = -(nmax + 0.1f * is) / max;
        sumlx = suml2 = 0;
        for (int i = 0; i < n; ++i) {
            const int l = clampi(nearest_int(iscale * x[i]), -nmax, nmax - 1);
            const float w = x[i] * x[i];
            sumlx += w * x[i] * l;
            suml2 += w * l * l;
        }
        if (suml2 > 0 && sumlx * sumlx > best * suml2) {
            for (int i = 0; i < n; ++i) L[i] = (int8_t)(nmax + clampi(nearest_int(iscale * x[i]), -nmax, nmax - 1));
            scale = sumlx / suml2;
            best = scale * sumlx;
        }
    }
    return scale;
}

// make_q3_quants with do_rmse: symmetric levels -nmax..nmax-1 (stored + nmax) refined element by element, each
// accepted change feeding the next decision, up to 5 passes.
static float make_q3(int n, int nmax, const float* x, int8_t* L) {
    float amax;
    const float max = signed_absmax(n, x, &amax);
    if (amax < GROUP_MAX_EPS) {
        memset(L, 0, (size_t)n);
        return 0.f;
    }
    const float iscale = -nmax / max;
    float sumlx = 0, suml2 = 0;
    for (int i = 0; i < n; ++i) {
        const int l = clampi(nearest_int(iscale * x[i]), -nmax, nmax - 1);
        L[i] = (int8_t)l;
        const float w = x[i] * x[i];
        sumlx += w * x[i] * l;
        suml2 += w * l * l;
    }
    for (int itry = 0; itry < 5; ++itry) {
        int n_changed = 0;
        for (int i = 0; i < n; ++i) {
            const float w = x[i] * x[i];
            float slx = sumlx - w * x[i] * L[i];
            if (slx > 0) {
                float sl2 = suml2 - w * L[i] * L[i];
                const int new_l = clampi(nearest_int(x[i] * sl2 / slx), -nmax, nmax - 1);
                if (new_l != L[i]) {
                    slx += w * x[i] * new_l;
                    sl2 += w * new_l * new_l;
                    if (sl2 > 0 && slx * slx * suml2 > sumlx * sumlx * sl2) {
                        L[i] = (int8_t)new_l;
                        sumlx = slx;
                        suml2 = sl2;
                        ++n_changed;
                    }
                }
            }
        }
        if (!n_changed) break;
    }
    for (int i = 0; i < n; ++i) L[i] = (int8_t)(L[i] + nmax);
    return sumlx / suml2;
}

// Four levels 0..3 of elements l, l + 32, l + 64, l + 96 of each 128 in one byte (Q2_K's and Q3_K's qs).
static inline void pack_crumbs(const uint8_t* L, uint8_t* qs) {
    for (int j = 0; j < QK; j += 128)
        for (int l = 0; l < 32; ++l)
            qs[j / 4 + l] = (uint8_t)(L[j + l] | (L[j + l + 32] << 2) | (L[j + l + 64] << 4) | (L[j + l + 96] << 6));
}

static void q_q2_K(const float* x, blk_q2_K* y, int64_t nb) {
    uint8_t L[QK];
    float w[16], mins[16], scales[16];
    for (int64_t i = 0; i < nb; ++i, x += QK) {
        float max_scale = 0, max_min = 0;
        for (int j = 0; j < 16; ++j) {
            for (int l = 0; l < 16; ++l) w[l] = fabsf(x[16 * j + l]);
            scales[j] = make_qkx2(16, 3, x + 16 * j, w, L + 16 * j, &mins[j], -0.5f, 0.1f, 15, true);
            if (scales[j] > max_scale) max_scale = scales[j];
            if (mins[j] > max_min) max_min = mins[j];
        }
        if (max_scale > 0) {
            const float iscale = 15.f / max_scale;
            for (int j = 0; j < 16; ++j) y[i].scales[j] = (uint8_t)nearest_int(iscale * scales[j]);
            y[i].d = fp32_to_fp16(max_scale / 15.f);
        } else {
            memset(y[i].scales, 0, 16);
            y[i].d = fp32_to_fp16(0.f);
        }
        if (max_min > 0) {
            const float iscale = 15.f / max_min;
            for (int j = 0; j < 16; ++j) y[i].scales[j] |= (uint8_t)((unsigned)nearest_int(iscale * mins[j]) << 4);
            y[i].dmin = fp32_to_fp16(max_min / 15.f);
        } else {
            y[i].dmin = fp32_to_fp16(0.f);
        }
        for (int j = 0; j < 16; ++j) {
            const float d = fp16_to_fp32(y[i].d) * (y[i].scales[j] & 0xF);
            if (!d) continue;  // keeps make_qkx2's levels
            const float dm = fp16_to_fp32(y[i].dmin) * (y[i].scales[j] >> 4);
            for (int l = 0; l < 16; ++l) L[16 * j + l] = (uint8_t)clampi(nearest_int((x[16 * j + l] + dm) / d), 0, 3);
        }
        pack_crumbs(L, y[i].qs);
    }
}

static void q_q3_K(const float* x, blk_q3_K* y, int64_t nb) {
    int8_t L[QK];
    float scales[16];
    for (int64_t i = 0; i < nb; ++i, x += QK) {
        float max_scale = 0, amax = 0;
        for (int j = 0; j < 16; ++j) {
            scales[j] = make_q3(16, 4, x + 16 * j, L + 16 * j);
            const float a = fabsf(scales[j]);
            if (a > amax) {
                amax = a;
                max_scale = scales[j];
            }
        }
        memset(y[i].scales, 0, 12);
        if (max_scale) {
            const float iscale = -32.f / max_scale;
            for (int j = 0; j < 16; ++j) {
                int8_t l = (int8_t)nearest_int(iscale * scales[j]);
                l = (int8_t)(clampi(l, -32, 31) + 32);
                if (j < 8) y[i].scales[j] = (uint8_t)(l & 0xF);
                else y[i].scales[j - 8] |= (uint8_t)((l & 0xF) << 4);
                l >>= 4;
                y[i].scales[j % 4 + 8] |= (uint8_t)(l << (2 * (j / 4)));
            }
            y[i].d = fp32_to_fp16(1 / iscale);
        } else {
            y[i].d = fp32_to_fp16(0.f);
        }
        int8_t sc[16];
        unpack_q3_scales(y[i].scales, sc);  // the scales as stored, less 32
        for (int j = 0; j < 16; ++j) {
            const float d = fp16_to_fp32(y[i].d) * sc[j];
            if (!d) continue;  // keeps make_q3's levels
            for (int l = 0; l < 16; ++l) L[16 * j + l] = (int8_t)(clampi(nearest_int(x[16 * j + l] / d), -4, 3) + 4);
        }
        memset(y[i].hmask, 0, 32);
        uint8_t low[QK];
        for (int j = 0; j < QK; ++j) {  // the third bit of element 32k + m is bit k of hmask[m]
            if (L[j] > 3) y[i].hmask[j % 32] |= (uint8_t)(1u << (j / 32));
            low[j] = (uint8_t)(L[j] & 3);
        }
        pack_crumbs(low, y[i].qs);
    }
}

// Q4_K / Q5_K: 8 sub-blocks of 32, each an affine fit weighted by rms + |x|; 6-bit scales and mins.
template <class B, int NMAX>
static void q_q45_K(const float* x, B* y, int64_t nb, float rmin, int nstep) {
    uint8_t L[QK];
    float w[32], mins[8], scales[8];
    for (int64_t i = 0; i < nb; ++i, x += QK) {
        float max_scale = 0, max_min = 0;
        for (int j = 0; j < 8; ++j) {
            float sum_x2 = 0;
            for (int l = 0; l < 32; ++l) sum_x2 += x[32 * j + l] * x[32 * j + l];
            const float av_x = sqrtf(sum_x2 / 32);
            for (int l = 0; l < 32; ++l) w[l] = av_x + fabsf(x[32 * j + l]);
            scales[j] = make_qkx2(32, NMAX, x + 32 * j, w, L + 32 * j, &mins[j], rmin, 0.1f, nstep, false);
            if (scales[j] > max_scale) max_scale = scales[j];
            if (mins[j] > max_min) max_min = mins[j];
        }
        const float inv_scale = max_scale > 0 ? 63.f / max_scale : 0.f;
        const float inv_min = max_min > 0 ? 63.f / max_min : 0.f;
        uint8_t* s = y[i].scales;
        for (int j = 0; j < 8; ++j) {
            uint8_t ls = (uint8_t)nearest_int(inv_scale * scales[j]);
            uint8_t lm = (uint8_t)nearest_int(inv_min * mins[j]);
            ls = ls < 63 ? ls : 63;
            lm = lm < 63 ? lm : 63;
            if (j < 4) {
                s[j] = ls;
                s[j + 4] = lm;
            } else {
                s[j + 4] = (uint8_t)((ls & 0xF) | ((lm & 0xF) << 4));
                s[j - 4] |= (uint8_t)((ls >> 4) << 6);
                s[j] |= (uint8_t)((lm >> 4) << 6);
            }
        }
        y[i].d = fp32_to_fp16(max_scale / 63.f);
        y[i].dmin = fp32_to_fp16(max_min / 63.f);
        for (int j = 0; j < 8; ++j) {
            const int sc = j < 4 ? s[j] & 63 : (s[j + 4] & 0xF) | ((s[j - 4] >> 6) << 4);
            const int m = j < 4 ? s[j + 4] & 63 : (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
            const float d = fp16_to_fp32(y[i].d) * sc;
            if (!d) continue;  // keeps make_qkx2's levels
            const float dm = fp16_to_fp32(y[i].dmin) * m;
            for (int l = 0; l < 32; ++l)
                L[32 * j + l] = (uint8_t)clampi(nearest_int((x[32 * j + l] + dm) / d), 0, NMAX);
        }
        uint8_t* q = y[i].qs;
        if constexpr (NMAX == 31) memset(y[i].qh, 0, 32);
        for (int j = 0; j < QK; j += 64, q += 32) {  // elements j + l and j + 32 + l share byte l (low, high nibble)
            for (int l = 0; l < 32; ++l) {
                const int l1 = L[j + l], l2 = L[j + l + 32];
                q[l] = (uint8_t)((l1 & 0xF) | ((l2 & 0xF) << 4));
                if constexpr (NMAX == 31)  // the fifth bits: elements j + l, j + 32 + l at bits j / 32, j / 32 + 1
                    y[i].qh[l] |= (uint8_t)(((l1 >> 4) << (j / 32)) | ((l2 >> 4) << (j / 32 + 1)));
            }
        }
    }
}

static void q_q6_K(const float* x, blk_q6_K* y, int64_t nb) {
    int8_t L[QK];
    float scales[16];
    for (int64_t i = 0; i < nb; ++i, x += QK) {
        float max_scale = 0, max_abs_scale = 0;
        for (int j = 0; j < 16; ++j) {
            scales[j] = make_qx(16, 32, x + 16 * j, L + 16 * j);
            const float a = fabsf(scales[j]);
            if (a > max_abs_scale) {
                max_abs_scale = a;
                max_scale = scales[j];
            }
        }
        if (max_abs_scale < GROUP_MAX_EPS) {
            memset(&y[i], 0, sizeof(blk_q6_K));
            continue;
        }
        const float iscale = -128.f / max_scale;
        y[i].d = fp32_to_fp16(1 / iscale);
        for (int j = 0; j < 16; ++j) {
            const int l = nearest_int(iscale * scales[j]);
            y[i].scales[j] = (int8_t)(l < 127 ? l : 127);
        }
        for (int j = 0; j < 16; ++j) {
            const float d = fp16_to_fp32(y[i].d) * y[i].scales[j];
            if (!d) continue;  // keeps make_qx's levels
            for (int l = 0; l < 16; ++l) L[16 * j + l] = (int8_t)(clampi(nearest_int(x[16 * j + l] / d), -32, 31) + 32);
        }
        uint8_t* ql = y[i].ql;
        uint8_t* qh = y[i].qh;
        for (int j = 0; j < QK; j += 128, ql += 64, qh += 32) {
            for (int l = 0; l < 32; ++l) {
                const int q1 = L[j + l], q2 = L[j + l + 32], q3 = L[j + l + 64], q4 = L[j + l + 96];
                ql[l] = (uint8_t)((q1 & 0xF) | ((q3 & 0xF) << 4));
                ql[l + 32] = (uint8_t)((q2 & 0xF) | ((q4 & 0xF) << 4));
                qh[l] = (uint8_t)((q1 >> 4) | ((q2 >> 4) << 2) | ((q3 >> 4) << 4) | ((q4 >> 4) << 6));
            }
        }
    }
}

void quantize_row_k_ref(int type, const float* src, void* dst, int64_t n) {
    const int64_t nb = n / QK;
    switch (type) {
        case T_Q2_K: q_q2_K(src, (blk_q2_K*)dst, nb); return;
        case T_Q3_K: q_q3_K(src, (blk_q3_K*)dst, nb); return;
        case T_Q4_K: q_q45_K<blk_q4_K, 15>(src, (blk_q4_K*)dst, nb, -1.f, 20); return;
        case T_Q5_K: q_q45_K<blk_q5_K, 31>(src, (blk_q5_K*)dst, nb, -0.5f, 15); return;
        case T_Q6_K: q_q6_K(src, (blk_q6_K*)dst, nb); return;
        default: return;
    }
}

}  // namespace GP_NS
}  // namespace gp
