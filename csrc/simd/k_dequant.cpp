// Dequantization of every block type to F32 rows (GET_ROWS, the F32 GEMM's weight panels, tests).
#include "blocks.h"
#include "isa.h"

namespace gp {
namespace GP_NS {

// ===============================================================================================================
// dequantization

static void deq_q4_0(const blk_q4_0* x, float* y, int64_t nb) {
    for (int64_t i = 0; i < nb; ++i) {
        const float d = fp16_to_fp32(x[i].d);
#if GP_AVX2
        __m128i q = _mm_loadu_si128((const __m128i*)x[i].qs);
        __m128i lo = _mm_and_si128(q, _mm_set1_epi8(0x0f));
        __m128i hi = _mm_and_si128(_mm_srli_epi16(q, 4), _mm_set1_epi8(0x0f));
        const __m256 vd = _mm256_set1_ps(d);
        const __m256 off = _mm256_set1_ps(-8.0f);
        __m128i parts[2] = {lo, hi};
        for (int h = 0; h < 2; ++h) {
            __m256 a = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(parts[h]));
            __m256 b = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(parts[h], 8)));
            _mm256_storeu_ps(y + 32 * i + 16 * h, _mm256_mul_ps(_mm256_add_ps(a, off), vd));
            _mm256_storeu_ps(y + 32 * i + 16 * h + 8, _mm256_mul_ps(_mm256_add_ps(b, off), vd));
        }
#else
        for (int j = 0; j < 16; ++j) {
            y[32 * i + j] = (float)((x[i].qs[j] & 0x0f) - 8) * d;
            y[32 * i + j + 16] = (float)((x[i].qs[j] >> 4) - 8) * d;
        }
#endif
    }
}

static void deq_q4_1(const blk_q4_1* x, float* y, int64_t nb) {
    for (int64_t i = 0; i < nb; ++i) {
        const float d = fp16_to_fp32(x[i].d), m = fp16_to_fp32(x[i].m);
#if GP_AVX2
        __m128i q = _mm_loadu_si128((const __m128i*)x[i].qs);
        __m128i lo = _mm_and_si128(q, _mm_set1_epi8(0x0f));
        __m128i hi = _mm_and_si128(_mm_srli_epi16(q, 4), _mm_set1_epi8(0x0f));
        const __m256 vd = _mm256_set1_ps(d), vm = _mm256_set1_ps(m);
        __m128i parts[2] = {lo, hi};
        for (int h = 0; h < 2; ++h) {
            __m256 a = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(parts[h]));
            __m256 b = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(parts[h], 8)));
            _mm256_storeu_ps(y + 32 * i + 16 * h, _mm256_add_ps(_mm256_mul_ps(a, vd), vm));
            _mm256_storeu_ps(y + 32 * i + 16 * h + 8, _mm256_add_ps(_mm256_mul_ps(b, vd), vm));
        }
#else
        for (int j = 0; j < 16; ++j) {
            y[32 * i + j] = (float)(x[i].qs[j] & 0x0f) * d + m;
            y[32 * i + j + 16] = (float)(x[i].qs[j] >> 4) * d + m;
        }
#endif
    }
}

static void deq_q5_0(const blk_q5_0* x, float* y, int64_t nb) {
    for (int64_t i = 0; i < nb; ++i) {
        const float d = fp16_to_fp32(x[i].d);
        uint32_t qh;
        memcpy(&qh, x[i].qh, 4);
        for (int j = 0; j < 16; ++j) {
            const int h0 = ((qh >> j) << 4) & 0x10;
            const int h1 = (qh >> (j + 12)) & 0x10;
            y[32 * i + j] = (float)(((x[i].qs[j] & 0x0f) | h0) - 16) * d;
            y[32 * i + j + 16] = (float)(((x[i].qs[j] >> 4) | h1) - 16) * d;
        }
    }
}

static void deq_q5_1(const blk_q5_1* x, float* y, int64_t nb) {
    for (int64_t i = 0; i < nb; ++i) {
        const float d = fp16_to_fp32(x[i].d), m = fp16_to_fp32(x[i].m);
        uint32_t qh;
        memcpy(&qh, x[i].qh, 4);
        for (int j = 0; j < 16; ++j) {
            const int h0 = ((qh >> j) << 4) & 0x10;
            const int h1 = (qh >> (j + 12)) & 0x10;
            y[32 * i + j] = (float)((x[i].qs[j] & 0x0f) | h0) * d + m;
            y[32 * i + j + 16] = (float)((x[i].qs[j] >> 4) | h1) * d + m;
        }
    }
}

static void deq_q8_0(const blk_q8_0* x, float* y, int64_t nb) {
    for (int64_t i = 0; i < nb; ++i) {
        const float d = fp16_to_fp32(x[i].d);
#if GP_AVX2
        const __m256 vd = _mm256_set1_ps(d);
        for (int h = 0; h < 4; ++h) {
            __m128i q = _mm_loadl_epi64((const __m128i*)(x[i].qs + 8 * h));
            _mm256_storeu_ps(y + 32 * i + 8 * h, _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q)), vd));
        }
#else
        for (int j = 0; j < 32; ++j) y[32 * i + j] = (float)x[i].qs[j] * d;
#endif
    }
}

static void deq_q2_K(const blk_q2_K* x, float* y, int64_t nb) {
    for (int64_t i = 0; i < nb; ++i) {
        const float d = fp16_to_fp32(x[i].d), dmin = fp16_to_fp32(x[i].dmin);
        float* out = y + 256 * i;
        for (int h = 0; h < 2; ++h) {
            const uint8_t* q = x[i].qs + 32 * h;
            for (int s = 0; s < 4; ++s) {
                for (int half = 0; half < 2; ++half) {
                    const int g = 8 * h + 2 * s + half;
                    const float dl = d * (float)(x[i].scales[g] & 0x0f);
                    const float ml = dmin * (float)(x[i].scales[g] >> 4);
                    const uint8_t* qq = q + 16 * half;
                    float* o = out + 16 * g;
#if GP_AVX2
                    const __m256 vd = _mm256_set1_ps(dl), vm = _mm256_set1_ps(ml);
                    for (int l = 0; l < 16; l += 8) {
                        __m256i b = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)(qq + l)));
                        b = _mm256_and_si256(_mm256_srli_epi32(b, 2 * s), _mm256_set1_epi32(3));
                        _mm256_storeu_ps(o + l, _mm256_sub_ps(_mm256_mul_ps(vd, _mm256_cvtepi32_ps(b)), vm));
                    }
#else
                    for (int l = 0; l < 16; ++l) o[l] = dl * (float)((qq[l] >> (2 * s)) & 3) - ml;
#endif
                }
            }
        }
    }
}

static void deq_q3_K(const blk_q3_K* x, float* y, int64_t nb) {
    for (int64_t i = 0; i < nb; ++i) {
        const float d = fp16_to_fp32(x[i].d);
        int8_t sc[16];
        unpack_q3_scales(x[i].scales, sc);
        float* out = y + 256 * i;
        for (int h = 0; h < 2; ++h) {
            const uint8_t* q = x[i].qs + 32 * h;
            for (int s = 0; s < 4; ++s) {
                const int j = 4 * h + s;  // 32-element chunk: its third bits are bit j of hmask[0..31]
                for (int half = 0; half < 2; ++half) {
                    const int g = 2 * j + half;
                    const float dl = d * (float)sc[g];
                    const uint8_t* qq = q + 16 * half;
                    const uint8_t* hm = x[i].hmask + 16 * half;
                    float* o = out + 16 * g;
#if GP_AVX2
                    const __m256 vd = _mm256_set1_ps(dl);
                    for (int l = 0; l < 16; l += 8) {
                        __m256i b = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)(qq + l)));
                        __m256i hb = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)(hm + l)));
                        b = _mm256_and_si256(_mm256_srli_epi32(b, 2 * s), _mm256_set1_epi32(3));
                        hb = _mm256_slli_epi32(_mm256_and_si256(_mm256_srli_epi32(hb, j), _mm256_set1_epi32(1)), 2);
                        b = _mm256_sub_epi32(_mm256_or_si256(b, hb), _mm256_set1_epi32(4));
                        _mm256_storeu_ps(o + l, _mm256_mul_ps(vd, _mm256_cvtepi32_ps(b)));
                    }
#else
                    for (int l = 0; l < 16; ++l) {
                        const int v = (int)((qq[l] >> (2 * s)) & 3) - (((hm[l] >> j) & 1) ? 0 : 4);
                        o[l] = dl * (float)v;
                    }
#endif
                }
            }
        }
    }
}

static void deq_q4_K(const blk_q4_K* x, float* y, int64_t nb) {
    for (int64_t i = 0; i < nb; ++i) {
        const float d = fp16_to_fp32(x[i].d), dmin = fp16_to_fp32(x[i].dmin);
        uint8_t sm[16];
        unpack_k_scales(x[i].scales, sm);
        const uint8_t* q = x[i].qs;
        float* out = y + 256 * i;
        for (int c = 0; c < 4; ++c) {
            const float d1 = d * sm[2 * c], m1 = dmin * sm[8 + 2 * c];
            const float d2 = d * sm[2 * c + 1], m2 = dmin * sm[8 + 2 * c + 1];
#if GP_AVX2
            const __m256 vd1 = _mm256_set1_ps(d1), vm1 = _mm256_set1_ps(m1);
            const __m256 vd2 = _mm256_set1_ps(d2), vm2 = _mm256_set1_ps(m2);
            for (int l = 0; l < 32; l += 8) {
                __m256i b = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)(q + l)));
                __m256 lo = _mm256_cvtepi32_ps(_mm256_and_si256(b, _mm256_set1_epi32(0x0f)));
                __m256 hi = _mm256_cvtepi32_ps(_mm256_srli_epi32(b, 4));
                _mm256_storeu_ps(out + l, _mm256_sub_ps(_mm256_mul_ps(vd1, lo), vm1));
                _mm256_storeu_ps(out + 32 + l, _mm256_sub_ps(_mm256_mul_ps(vd2, hi), vm2));
            }
#else
            for (int l = 0; l < 32; ++l) out[l] = d1 * (float)(q[l] & 0x0f) - m1;
            for (int l = 0; l < 32; ++l) out[32 + l] = d2 * (float)(q[l] >> 4) - m2;
#endif
            q += 32;
            out += 64;
        }
    }
}

static void deq_q5_K(const blk_q5_K* x, float* y, int64_t nb) {
    for (int64_t i = 0; i < nb; ++i) {
        const float d = fp16_to_fp32(x[i].d), dmin = fp16_to_fp32(x[i].dmin);
        uint8_t sm[16];
        unpack_k_scales(x[i].scales, sm);
        const uint8_t* ql = x[i].qs;
        const uint8_t* qh = x[i].qh;
        float* out = y + 256 * i;
        uint8_t u1 = 1, u2 = 2;
        for (int c = 0; c < 4; ++c) {
            const float d1 = d * sm[2 * c], m1 = dmin * sm[8 + 2 * c];
            const float d2 = d * sm[2 * c + 1], m2 = dmin * sm[8 + 2 * c + 1];
            for (int l = 0; l < 32; ++l) out[l] = d1 * (float)((ql[l] & 0x0f) + (qh[l] & u1 ? 16 : 0)) - m1;
            for (int l = 0; l < 32; ++l) out[32 + l] = d2 * (float)((ql[l] >> 4) + (qh[l] & u2 ? 16 : 0)) - m2;
            ql += 32;
            out += 64;
            u1 <<= 2;
            u2 <<= 2;
        }
    }
}

static void deq_q6_K(const blk_q6_K* x, float* y, int64_t nb) {
    for (int64_t i = 0; i < nb; ++i) {
        const float d = fp16_to_fp32(x[i].d);
        const uint8_t* ql = x[i].ql;
        const uint8_t* qh = x[i].qh;
        const int8_t* sc = x[i].scales;
        float* out = y + 256 * i;
        for (int h = 0; h < 2; ++h) {
#if GP_AVX2
            // 8 columns l.. of each of the four 32-element quarters; the scale changes every 16 columns
            const __m256i m4 = _mm256_set1_epi32(0x0f), m2 = _mm256_set1_epi32(3), off = _mm256_set1_epi32(32);
            for (int l = 0; l < 32; l += 8) {
                const int is = l / 16;
                const __m256i a = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)(ql + l)));
                const __m256i b = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)(ql + l + 32)));
                const __m256i hb = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)(qh + l)));
                const __m256i q[4] = {
                    _mm256_or_si256(_mm256_and_si256(a, m4), _mm256_slli_epi32(_mm256_and_si256(hb, m2), 4)),
                    _mm256_or_si256(_mm256_and_si256(b, m4),
                                    _mm256_slli_epi32(_mm256_and_si256(_mm256_srli_epi32(hb, 2), m2), 4)),
                    _mm256_or_si256(_mm256_srli_epi32(a, 4),
                                    _mm256_slli_epi32(_mm256_and_si256(_mm256_srli_epi32(hb, 4), m2), 4)),
                    _mm256_or_si256(_mm256_srli_epi32(b, 4), _mm256_slli_epi32(_mm256_srli_epi32(hb, 6), 4))};
                for (int t = 0; t < 4; ++t) {
                    const __m256 ds = _mm256_set1_ps(d * (float)sc[is + 2 * t]);
                    const __m256 v = _mm256_cvtepi32_ps(_mm256_sub_epi32(q[t], off));
                    _mm256_storeu_ps(out + l + 32 * t, _mm256_mul_ps(ds, v));
                }
            }
#else
            for (int l = 0; l < 32; ++l) {
                const int is = l / 16;
                const int q1 = (int)((ql[l] & 0x0f) | (((qh[l] >> 0) & 3) << 4)) - 32;
                const int q2 = (int)((ql[l + 32] & 0x0f) | (((qh[l] >> 2) & 3) << 4)) - 32;
                const int q3 = (int)((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) - 32;
                const int q4 = (int)((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) - 32;
                out[l] = d * (float)sc[is] * (float)q1;
                out[l + 32] = d * (float)sc[is + 2] * (float)q2;
                out[l + 64] = d * (float)sc[is + 4] * (float)q3;
                out[l + 96] = d * (float)sc[is + 6] * (float)q4;
            }
#endif
            out += 128;
            ql += 64;
            qh += 32;
            sc += 8;
        }
    }
}

// 32 elements of an IQ4 block: y = dl * iq4_values[q]
static void deq_iq4_32(const uint8_t* qs, float dl, float* y) {
#if GP_AVX2
    const __m128i t = _mm_loadu_si128((const __m128i*)qs);
    const __m128i m4 = _mm_set1_epi8(0x0f);
    const __m128i tab = _mm_load_si128((const __m128i*)iq4_values);
    const __m128i v[2] = {_mm_shuffle_epi8(tab, _mm_and_si128(t, m4)),
                          _mm_shuffle_epi8(tab, _mm_and_si128(_mm_srli_epi16(t, 4), m4))};
    const __m256 vd = _mm256_set1_ps(dl);
    for (int h = 0; h < 2; ++h) {
        _mm256_storeu_ps(y + 16 * h, _mm256_mul_ps(vd, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(v[h]))));
        _mm256_storeu_ps(y + 16 * h + 8,
                         _mm256_mul_ps(vd, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(v[h], 8)))));
    }
#else
    for (int j = 0; j < 16; ++j) {
        y[j] = dl * (float)iq4_values[qs[j] & 0x0f];
        y[j + 16] = dl * (float)iq4_values[qs[j] >> 4];
    }
#endif
}

static void deq_iq4_nl(const blk_iq4_nl* x, float* y, int64_t nb) {
    for (int64_t i = 0; i < nb; ++i) deq_iq4_32(x[i].qs, fp16_to_fp32(x[i].d), y + 32 * i);
}

static void deq_iq4_xs(const blk_iq4_xs* x, float* y, int64_t nb) {
    for (int64_t i = 0; i < nb; ++i) {
        const float d = fp16_to_fp32(x[i].d);
        const uint64_t sc = iq4_xs_scales(x + i);
        for (int j = 0; j < 8; ++j)
            deq_iq4_32(x[i].qs + 16 * j, d * (float)((int)((sc >> (8 * j)) & 63) - 32), y + 256 * i + 32 * j);
    }
}

void dequantize_row(int type, const void* src, float* dst, int64_t n) {
    switch (type) {
        case T_F32: memcpy(dst, src, (size_t)n * 4); return;
        case T_F16: {
            const uint16_t* s = (const uint16_t*)src;
            int64_t i = 0;
#if GP_AVX2
            for (; i + 8 <= n; i += 8) _mm256_storeu_ps(dst + i, load_f16x8(s + i));
#endif
            for (; i < n; ++i) dst[i] = fp16_to_fp32(s[i]);
            return;
        }
        case T_BF16: {
            const uint16_t* s = (const uint16_t*)src;
            int64_t i = 0;
#if GP_AVX2
            for (; i + 8 <= n; i += 8) _mm256_storeu_ps(dst + i, load_bf16x8(s + i));
#endif
            for (; i < n; ++i) dst[i] = bf16_to_fp32(s[i]);
            return;
        }
        case T_Q4_0: deq_q4_0((const blk_q4_0*)src, dst, n / 32); return;
        case T_Q4_1: deq_q4_1((const blk_q4_1*)src, dst, n / 32); return;
        case T_Q5_0: deq_q5_0((const blk_q5_0*)src, dst, n / 32); return;
        case T_Q5_1: deq_q5_1((const blk_q5_1*)src, dst, n / 32); return;
        case T_Q8_0: deq_q8_0((const blk_q8_0*)src, dst, n / 32); return;
        case T_Q2_K: deq_q2_K((const blk_q2_K*)src, dst, n / 256); return;
        case T_Q3_K: deq_q3_K((const blk_q3_K*)src, dst, n / 256); return;
        case T_Q4_K: deq_q4_K((const blk_q4_K*)src, dst, n / 256); return;
        case T_Q5_K: deq_q5_K((const blk_q5_K*)src, dst, n / 256); return;
        case T_Q6_K: deq_q6_K((const blk_q6_K*)src, dst, n / 256); return;
        case T_IQ4_NL: deq_iq4_nl((const blk_iq4_nl*)src, dst, n / 32); return;
        case T_IQ4_XS: deq_iq4_xs((const blk_iq4_xs*)src, dst, n / 256); return;
        default: return;
    }
}

}  // namespace GP_NS
}  // namespace gp
