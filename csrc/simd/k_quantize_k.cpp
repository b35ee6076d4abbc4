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

#if GP_AVX2
// make_qkx2 for 8 sub-blocks of 32 at once, sub-block j in lane j: every lane runs the scalar code's operations in
// its order (sequential sums over the elements, the same divisions, nearest_int's bits, blends where C branches), so
// the results are the same bits (tests/test_quants_vs_llamacpp.py compares every level with llama.cpp). x[i], w[i]:
// element i of the 8 sub-blocks; L[i]: its level per lane.
GP_INLINE __m256i nearest_int8(__m256 v) {
    const __m256i t = _mm256_castps_si256(_mm256_add_ps(v, _mm256_set1_ps(12582912.f)));
    return _mm256_sub_epi32(_mm256_and_si256(t, _mm256_set1_epi32(0x007fffff)), _mm256_set1_epi32(0x00400000));
}
static void make_qkx2_x8(const __m256* x, const __m256* w, int nmax, float rmin, float rdelta, int nstep,
                         __m256i* L, __m256* scale_out, __m256* the_min_out) {
    constexpr int n = 32;
    const __m256 zero = _mm256_setzero_ps();
    const __m256i top = _mm256_set1_epi32(nmax), izero = _mm256_setzero_si256();
    __m256 min = x[0], max = x[0], sum_w = w[0], sum_x = _mm256_mul_ps(w[0], x[0]);
    for (int i = 1; i < n; ++i) {
        min = _mm256_min_ps(x[i], min);  // (x < min) ? x : min, as C's `if (x < min) min = x`, NaN included
        max = _mm256_max_ps(x[i], max);
        sum_w = _mm256_add_ps(sum_w, w[i]);
        sum_x = _mm256_add_ps(sum_x, _mm256_mul_ps(w[i], x[i]));
    }
    min = _mm256_blendv_ps(min, zero, _mm256_cmp_ps(min, zero, _CMP_GT_OQ));
    const __m256 flat = _mm256_cmp_ps(max, min, _CMP_EQ_OQ);
    const __m256 min0 = min;
    const __m256 range = _mm256_sub_ps(max, min);
    __m256 iscale = _mm256_div_ps(_mm256_set1_ps((float)nmax), range);
    __m256 scale = _mm256_div_ps(_mm256_set1_ps(1.f), iscale);
    __m256 best = zero;
    for (int i = 0; i < n; ++i) {
        L[i] = _mm256_max_epi32(_mm256_min_epi32(nearest_int8(_mm256_mul_ps(iscale, _mm256_sub_ps(x[i], min))), top),
                                izero);
        __m256 diff = _mm256_sub_ps(_mm256_add_ps(_mm256_mul_ps(scale, _mm256_cvtepi32_ps(L[i])), min), x[i]);
        best = _mm256_add_ps(best, _mm256_mul_ps(w[i], _mm256_mul_ps(diff, diff)));
    }
    __m256i Laux[n];
    for (int is = 0; is <= nstep; ++is) {
        // C's float expression, then per lane over max - min (min moves in the lanes where a step won)
        iscale = _mm256_div_ps(_mm256_set1_ps(rmin + rdelta * is + nmax), _mm256_sub_ps(max, min));
        __m256 sum_l = zero, sum_l2 = zero, sum_xl = zero;
        for (int i = 0; i < n; ++i) {
            Laux[i] = _mm256_max_epi32(
                _mm256_min_epi32(nearest_int8(_mm256_mul_ps(iscale, _mm256_sub_ps(x[i], min))), top), izero);
            const __m256 wl = _mm256_mul_ps(w[i], _mm256_cvtepi32_ps(Laux[i]));
            sum_l = _mm256_add_ps(sum_l, wl);
            sum_l2 = _mm256_add_ps(sum_l2, _mm256_mul_ps(wl, _mm256_cvtepi32_ps(Laux[i])));
            sum_xl = _mm256_add_ps(sum_xl, _mm256_mul_ps(wl, x[i]));
        }
        const __m256 D = _mm256_sub_ps(_mm256_mul_ps(sum_w, sum_l2), _mm256_mul_ps(sum_l, sum_l));
        __m256 this_scale = _mm256_div_ps(_mm256_sub_ps(_mm256_mul_ps(sum_w, sum_xl), _mm256_mul_ps(sum_x, sum_l)), D);
        __m256 this_min = _mm256_div_ps(_mm256_sub_ps(_mm256_mul_ps(sum_l2, sum_x), _mm256_mul_ps(sum_l, sum_xl)), D);
        const __m256 pos = _mm256_cmp_ps(this_min, zero, _CMP_GT_OQ);
        this_min = _mm256_blendv_ps(this_min, zero, pos);
        this_scale = _mm256_blendv_ps(this_scale, _mm256_div_ps(sum_xl, sum_l2), pos);
        __m256 err = zero;
        for (int i = 0; i < n; ++i) {
            __m256 diff = _mm256_sub_ps(
                _mm256_add_ps(_mm256_mul_ps(this_scale, _mm256_cvtepi32_ps(Laux[i])), this_min), x[i]);
            err = _mm256_add_ps(err, _mm256_mul_ps(w[i], _mm256_mul_ps(diff, diff)));
        }
        const __m256 better = _mm256_and_ps(_mm256_cmp_ps(D, zero, _CMP_GT_OQ), _mm256_cmp_ps(err, best, _CMP_LT_OQ));
        if (_mm256_movemask_ps(better) == 0) continue;
        const __m256i bi = _mm256_castps_si256(better);
        for (int i = 0; i < n; ++i) L[i] = _mm256_blendv_epi8(L[i], Laux[i], bi);
        best = _mm256_blendv_ps(best, err, better);
        scale = _mm256_blendv_ps(scale, this_scale, better);
        min = _mm256_blendv_ps(min, this_min, better);
    }
    // flat sub-blocks: levels 0, scale 0, the minimum as clamped
    const __m256i fi = _mm256_castps_si256(flat);
    for (int i = 0; i < n; ++i) L[i] = _mm256_andnot_si256(fi, L[i]);
    *scale_out = _mm256_blendv_ps(scale, zero, flat);
    *the_min_out = _mm256_xor_ps(_mm256_blendv_ps(min, min0, flat), _mm256_set1_ps(-0.0f));  // -min, as C
}
#endif

// make_qx_quants with rmse_type 1 and no importance weights: symmetric levels -nmax..nmax-1 (stored + nmax),
// weights x^2, the scale searched over 19 trials.
[[maybe_unused]] static float make_qx(int n, int nmax, const float* x, int8_t* L) {  // the scalar level's
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

#if GP_AVX2
// make_qx for 8 sub-blocks of 16 at once, sub-block j in lane j, each lane in the scalar code's order (as
// make_qkx2_x8). x[i]: element i of the 8 sub-blocks; L[i] gets its level + nmax per lane.
static __m256 make_qx_x8(const __m256* x, int nmax, __m256i* L) {
    constexpr int n = 16;
    const __m256 zero = _mm256_setzero_ps(), sign = _mm256_set1_ps(-0.0f);
    const __m256i lo = _mm256_set1_epi32(-nmax), hi = _mm256_set1_epi32(nmax - 1), off = _mm256_set1_epi32(nmax);
    __m256 max = zero, amax = zero, w[n], wx[n];
    for (int i = 0; i < n; ++i) {
        const __m256 ax = _mm256_andnot_ps(sign, x[i]);
        const __m256 gt = _mm256_cmp_ps(ax, amax, _CMP_GT_OQ);
        amax = _mm256_blendv_ps(amax, ax, gt);
        max = _mm256_blendv_ps(max, x[i], gt);
        w[i] = _mm256_mul_ps(x[i], x[i]);
        wx[i] = _mm256_mul_ps(w[i], x[i]);
    }
    const __m256 is_zero = _mm256_cmp_ps(amax, _mm256_set1_ps(GROUP_MAX_EPS), _CMP_LT_OQ);
    auto trial = [&](__m256 iscale, __m256i* lv, __m256* sumlx, __m256* suml2) {
        __m256 slx = zero, sl2 = zero;
        for (int i = 0; i < n; ++i) {
            lv[i] = _mm256_max_epi32(_mm256_min_epi32(nearest_int8(_mm256_mul_ps(iscale, x[i])), hi), lo);
            const __m256 l = _mm256_cvtepi32_ps(lv[i]);
            slx = _mm256_add_ps(slx, _mm256_mul_ps(wx[i], l));
            sl2 = _mm256_add_ps(sl2, _mm256_mul_ps(_mm256_mul_ps(w[i], l), l));
        }
        *sumlx = slx;
        *suml2 = sl2;
    };
    __m256 sumlx, suml2;
    trial(_mm256_div_ps(_mm256_set1_ps((float)-nmax), max), L, &sumlx, &suml2);
    __m256 scale = _mm256_blendv_ps(zero, _mm256_div_ps(sumlx, suml2), _mm256_cmp_ps(suml2, zero, _CMP_NEQ_UQ));
    __m256 best = _mm256_mul_ps(scale, sumlx);
    __m256i lv[n];
    for (int is = -9; is <= 9; ++is) {
        if (is == 0) continue;
        trial(_mm256_div_ps(_mm256_set1_ps(-(nmax + 0.1f * is)), max), lv, &sumlx, &suml2);
        const __m256 better = _mm256_and_ps(_mm256_cmp_ps(suml2, zero, _CMP_GT_OQ),
                                            _mm256_cmp_ps(_mm256_mul_ps(sumlx, sumlx), _mm256_mul_ps(best, suml2),
                                                          _CMP_GT_OQ));
        if (_mm256_movemask_ps(better) == 0) continue;
        const __m256i bi = _mm256_castps_si256(better);
        for (int i = 0; i < n; ++i) L[i] = _mm256_blendv_epi8(L[i], lv[i], bi);
        scale = _mm256_blendv_ps(scale, _mm256_div_ps(sumlx, suml2), better);
        best = _mm256_blendv_ps(best, _mm256_mul_ps(scale, sumlx), better);
    }
    const __m256i zi = _mm256_castps_si256(is_zero);
    for (int i = 0; i < n; ++i) L[i] = _mm256_andnot_si256(zi, _mm256_add_epi32(L[i], off));
    return _mm256_blendv_ps(scale, zero, is_zero);
}
#endif

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
    float mins[8], scales[8];
    for (int64_t i = 0; i < nb; ++i, x += QK) {
#if GP_AVX2
        {  // the 8 sub-blocks in the 8 lanes
            const __m256i idx = _mm256_setr_epi32(0, 32, 64, 96, 128, 160, 192, 224);
            const __m256 sign = _mm256_set1_ps(-0.0f);
            __m256 xv[32], wv[32], sv, mv;
            __m256i lv[32];
            __m256 sum_x2 = _mm256_setzero_ps();
            for (int l = 0; l < 32; ++l) {
                xv[l] = _mm256_i32gather_ps(x + l, idx, 4);
                sum_x2 = _mm256_add_ps(sum_x2, _mm256_mul_ps(xv[l], xv[l]));
            }
            const __m256 av_x = _mm256_sqrt_ps(_mm256_div_ps(sum_x2, _mm256_set1_ps(32.f)));
            for (int l = 0; l < 32; ++l) wv[l] = _mm256_add_ps(av_x, _mm256_andnot_ps(sign, xv[l]));
            make_qkx2_x8(xv, wv, NMAX, rmin, 0.1f, nstep, lv, &sv, &mv);
            _mm256_storeu_ps(scales, sv);
            _mm256_storeu_ps(mins, mv);
            alignas(32) int32_t lanes[8];
            for (int l = 0; l < 32; ++l) {
                _mm256_store_si256((__m256i*)lanes, lv[l]);
                for (int j = 0; j < 8; ++j) L[32 * j + l] = (uint8_t)lanes[j];
            }
        }
#else
        float w[32];
        for (int j = 0; j < 8; ++j) {
            float sum_x2 = 0;
            for (int l = 0; l < 32; ++l) sum_x2 += x[32 * j + l] * x[32 * j + l];
            const float av_x = sqrtf(sum_x2 / 32);
            for (int l = 0; l < 32; ++l) w[l] = av_x + fabsf(x[32 * j + l]);
            scales[j] = make_qkx2(32, NMAX, x + 32 * j, w, L + 32 * j, &mins[j], rmin, 0.1f, nstep, false);
        }
#endif
        float max_scale = 0, max_min = 0;
        for (int j = 0; j < 8; ++j) {
            if (scales[j] > max_scale) max_scale = scales[j];
            if (mins[j] > max_min) max_min = mins[j];
        }
        const float inv_scale = max_scale > 0 ? 63.f / max_scale : 0.f;
        const float inv_min = max_min > 0 ? 63.f / max_min : 0.f;
        uint8_t* s = y[i].scales;
        uint8_t packed[16];
        for (int j = 0; j < 8; ++j) {
            const uint8_t ls = (uint8_t)nearest_int(inv_scale * scales[j]);
            const uint8_t lm = (uint8_t)nearest_int(inv_min * mins[j]);
            packed[j] = ls < 63 ? ls : 63;
            packed[8 + j] = lm < 63 ? lm : 63;
        }
        pack_k_scales(packed, s);
        y[i].d = fp32_to_fp16(max_scale / 63.f);
        y[i].dmin = fp32_to_fp16(max_min / 63.f);
        uint8_t sm[16];
        unpack_k_scales(s, sm);  // the scales and mins as stored
        for (int j = 0; j < 8; ++j) {
            const float d = fp16_to_fp32(y[i].d) * sm[j];
            if (!d) continue;  // keeps make_qkx2's levels
            const float dm = fp16_to_fp32(y[i].dmin) * sm[8 + j];
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
#if GP_AVX2
        for (int g = 0; g < 2; ++g) {  // sub-blocks 8g .. 8g + 7 in the 8 lanes
            const __m256i idx = _mm256_setr_epi32(0, 16, 32, 48, 64, 80, 96, 112);
            __m256 xv[16];
            __m256i lv[16];
            for (int l = 0; l < 16; ++l) xv[l] = _mm256_i32gather_ps(x + 128 * g + l, idx, 4);
            _mm256_storeu_ps(scales + 8 * g, make_qx_x8(xv, 32, lv));
            alignas(32) int32_t lanes[8];
            for (int l = 0; l < 16; ++l) {
                _mm256_store_si256((__m256i*)lanes, lv[l]);
                for (int j = 0; j < 8; ++j) L[128 * g + 16 * j + l] = (int8_t)lanes[j];
            }
        }
#else
        for (int j = 0; j < 16; ++j) scales[j] = make_qx(16, 32, x + 16 * j, L + 16 * j);
#endif
        for (int j = 0; j < 16; ++j) {
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
