// Block formats: dequantization, ggml's reference quantization, activation quantization for MUL_MAT, and the
// integer dot products of weight rows with quantized activation rows (the GEMV path).
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

// ===============================================================================================================
// ggml's reference quantization (bit-exact with ggml-quants.c / gguf.quants; compiled with -ffp-contract=off)

// The first of the 32 values with the largest magnitude, sign kept (Q4_0 / Q5_0 scale from it).
static float signed_absmax32(const float* x) {
    float amax = 0.0f, max = 0.0f;
    for (int j = 0; j < 32; ++j)
        if (amax < fabsf(x[j])) {
            amax = fabsf(x[j]);
            max = x[j];
        }
    return max;
}

// Smallest and largest of 32 values (Q4_1 / Q5_1).
static void min_max32(const float* x, float* min, float* max) {
    *min = INFINITY;
    *max = -INFINITY;
    for (int j = 0; j < 32; ++j) {
        if (x[j] < *min) *min = x[j];
        if (x[j] > *max) *max = x[j];
    }
}

static void q_q8_0(const float* x, blk_q8_0* y, int64_t nb) {
    for (int64_t i = 0; i < nb; ++i) {
        float amax = 0.0f;
        for (int j = 0; j < 32; ++j) amax = fmaxf_(amax, fabsf(x[32 * i + j]));
        const float d = amax / 127.0f;
        const float id = d != 0.0f ? 1.0f / d : 0.0f;
        y[i].d = fp32_to_fp16(d);
        for (int j = 0; j < 32; ++j) y[i].qs[j] = (int8_t)roundf(x[32 * i + j] * id);
    }
}

static void q_q4_0(const float* x, blk_q4_0* y, int64_t nb) {
    for (int64_t i = 0; i < nb; ++i) {
        const float max = signed_absmax32(x + 32 * i);
        const float d = max / -8.0f;
        const float id = d != 0.0f ? 1.0f / d : 0.0f;
        y[i].d = fp32_to_fp16(d);
        for (int j = 0; j < 16; ++j) {
            const float x0 = x[32 * i + j] * id;
            const float x1 = x[32 * i + 16 + j] * id;
            int a = (int)(int8_t)(x0 + 8.5f), b = (int)(int8_t)(x1 + 8.5f);
            a = a > 15 ? 15 : a;
            b = b > 15 ? 15 : b;
            y[i].qs[j] = (uint8_t)((uint8_t)a | ((uint8_t)b << 4));
        }
    }
}

static void q_q4_1(const float* x, blk_q4_1* y, int64_t nb) {
    for (int64_t i = 0; i < nb; ++i) {
        float min, max;
        min_max32(x + 32 * i, &min, &max);
        const float d = (max - min) / 15.0f;
        const float id = d != 0.0f ? 1.0f / d : 0.0f;
        y[i].d = fp32_to_fp16(d);
        y[i].m = fp32_to_fp16(min);
        for (int j = 0; j < 16; ++j) {
            const float x0 = (x[32 * i + j] - min) * id;
            const float x1 = (x[32 * i + 16 + j] - min) * id;
            int a = (int)(int8_t)(x0 + 0.5f), b = (int)(int8_t)(x1 + 0.5f);
            a = a > 15 ? 15 : a;
            b = b > 15 ? 15 : b;
            y[i].qs[j] = (uint8_t)((uint8_t)a | ((uint8_t)b << 4));
        }
    }
}

static void q_q5_0(const float* x, blk_q5_0* y, int64_t nb) {
    for (int64_t i = 0; i < nb; ++i) {
        const float max = signed_absmax32(x + 32 * i);
        const float d = max / -16.0f;
        const float id = d != 0.0f ? 1.0f / d : 0.0f;
        y[i].d = fp32_to_fp16(d);
        uint32_t qh = 0;
        for (int j = 0; j < 16; ++j) {
            const float x0 = x[32 * i + j] * id;
            const float x1 = x[32 * i + 16 + j] * id;
            int a = (int)(int8_t)(x0 + 16.5f), b = (int)(int8_t)(x1 + 16.5f);
            a = a > 31 ? 31 : a;
            b = b > 31 ? 31 : b;
            y[i].qs[j] = (uint8_t)((a & 0x0f) | ((b & 0x0f) << 4));
            qh |= (uint32_t)((a & 0x10) >> 4) << j;
            qh |= (uint32_t)((b & 0x10) >> 4) << (j + 16);
        }
        memcpy(y[i].qh, &qh, 4);
    }
}

static void q_q5_1(const float* x, blk_q5_1* y, int64_t nb) {
    for (int64_t i = 0; i < nb; ++i) {
        float min, max;
        min_max32(x + 32 * i, &min, &max);
        const float d = (max - min) / 31.0f;
        const float id = d != 0.0f ? 1.0f / d : 0.0f;
        y[i].d = fp32_to_fp16(d);
        y[i].m = fp32_to_fp16(min);
        uint32_t qh = 0;
        for (int j = 0; j < 16; ++j) {
            const float x0 = (x[32 * i + j] - min) * id;
            const float x1 = (x[32 * i + 16 + j] - min) * id;
            const uint8_t a = (uint8_t)(x0 + 0.5f), b = (uint8_t)(x1 + 0.5f);
            y[i].qs[j] = (uint8_t)((a & 0x0f) | ((b & 0x0f) << 4));
            qh |= (uint32_t)((a & 0x10) >> 4) << j;
            qh |= (uint32_t)((b & 0x10) >> 4) << (j + 16);
        }
        memcpy(y[i].qh, &qh, 4);
    }
}

void quantize_row_ref(int type, const float* src, void* dst, int64_t n) {
    switch (type) {
        case T_Q8_0: q_q8_0(src, (blk_q8_0*)dst, n / 32); return;
        case T_Q4_0: q_q4_0(src, (blk_q4_0*)dst, n / 32); return;
        case T_Q4_1: q_q4_1(src, (blk_q4_1*)dst, n / 32); return;
        case T_Q5_0: q_q5_0(src, (blk_q5_0*)dst, n / 32); return;
        case T_Q5_1: q_q5_1(src, (blk_q5_1*)dst, n / 32); return;
        default: return;
    }
}

void convert_row_from_f32(int type, const float* src, void* dst, int64_t n) {
    switch (type) {
        case T_F32: memmove(dst, src, (size_t)n * 4); return;
        case T_F16: {
            uint16_t* d = (uint16_t*)dst;
            int64_t i = 0;
#if GP_AVX2
            for (; i + 8 <= n; i += 8) store_f16x8(d + i, _mm256_loadu_ps(src + i));
#endif
            for (; i < n; ++i) d[i] = fp32_to_fp16(src[i]);
            return;
        }
        case T_BF16: {
            uint16_t* d = (uint16_t*)dst;
            for (int64_t i = 0; i < n; ++i) d[i] = fp32_to_bf16(src[i]);
            return;
        }
        default: quantize_row_ref(type, src, dst, n); return;
    }
}

// ===============================================================================================================
// activation quantization (MUL_MAT): A32 (Q8_0/Q8_1 granularity) and A256 (Q8_K granularity), see common.h

void quantize_a32(const float* x, uint8_t* row, int64_t k) {
    const int64_t nb = k / 32;
    int8_t* qs = (int8_t*)row;
    float* dd = (float*)(row + k);
    float* ss = dd + nb;
    for (int64_t b = 0; b < nb; ++b) {
        const float* xb = x + 32 * b;
#if GP_AVX2
        __m256 v0 = _mm256_loadu_ps(xb), v1 = _mm256_loadu_ps(xb + 8);
        __m256 v2 = _mm256_loadu_ps(xb + 16), v3 = _mm256_loadu_ps(xb + 24);
        const __m256 sgn = _mm256_set1_ps(-0.0f);
        __m256 m = _mm256_max_ps(_mm256_max_ps(_mm256_andnot_ps(sgn, v0), _mm256_andnot_ps(sgn, v1)),
                                 _mm256_max_ps(_mm256_andnot_ps(sgn, v2), _mm256_andnot_ps(sgn, v3)));
        const float amax = hmax(m);
        const float d = amax / 127.0f;
        const float id = amax != 0.0f ? 127.0f / amax : 0.0f;
        const __m256 vid = _mm256_set1_ps(id);
        __m256i q0 = _mm256_cvtps_epi32(_mm256_mul_ps(v0, vid));
        __m256i q1 = _mm256_cvtps_epi32(_mm256_mul_ps(v1, vid));
        __m256i q2 = _mm256_cvtps_epi32(_mm256_mul_ps(v2, vid));
        __m256i q3 = _mm256_cvtps_epi32(_mm256_mul_ps(v3, vid));
        const int sum = hsum_i32(_mm256_add_epi32(_mm256_add_epi32(q0, q1), _mm256_add_epi32(q2, q3)));
        __m256i p = _mm256_packs_epi16(_mm256_packs_epi32(q0, q1), _mm256_packs_epi32(q2, q3));
        p = _mm256_permutevar8x32_epi32(p, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
        _mm256_storeu_si256((__m256i*)(qs + 32 * b), p);
#else
        float amax = 0.0f;
        for (int j = 0; j < 32; ++j) amax = fmaxf_(amax, fabsf(xb[j]));
        const float d = amax / 127.0f;
        const float id = amax != 0.0f ? 127.0f / amax : 0.0f;
        int sum = 0;
        for (int j = 0; j < 32; ++j) {
            int q = (int)nearbyintf(xb[j] * id);
            q = q > 127 ? 127 : (q < -127 ? -127 : q);
            qs[32 * b + j] = (int8_t)q;
            sum += q;
        }
#endif
        dd[b] = d;
        ss[b] = d * (float)sum;
    }
}

void quantize_a256(const float* x, uint8_t* row, int64_t k) {
    const int64_t nb = k / 256;
    int8_t* qs = (int8_t*)row;
    float* dd = (float*)(row + k);
    int16_t* bs = (int16_t*)(dd + nb);
    for (int64_t b = 0; b < nb; ++b) {
        const float* xb = x + 256 * b;
        float amax = 0.0f;
#if GP_AVX2
        {
            const __m256 sgn = _mm256_set1_ps(-0.0f);
            __m256 m = _mm256_setzero_ps();
            for (int j = 0; j < 256; j += 8) m = _mm256_max_ps(m, _mm256_andnot_ps(sgn, _mm256_loadu_ps(xb + j)));
            amax = hmax(m);
        }
#else
        for (int j = 0; j < 256; ++j) amax = fmaxf_(amax, fabsf(xb[j]));
#endif
        const float d = amax / 127.0f;
        const float id = amax != 0.0f ? 127.0f / amax : 0.0f;
        int8_t* q = qs + 256 * b;
#if GP_AVX2
        const __m256 vid = _mm256_set1_ps(id);
        for (int j = 0; j < 256; j += 32) {
            __m256i q0 = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(xb + j), vid));
            __m256i q1 = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(xb + j + 8), vid));
            __m256i q2 = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(xb + j + 16), vid));
            __m256i q3 = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(xb + j + 24), vid));
            bs[16 * b + j / 16] = (int16_t)hsum_i32(_mm256_add_epi32(q0, q1));
            bs[16 * b + j / 16 + 1] = (int16_t)hsum_i32(_mm256_add_epi32(q2, q3));
            __m256i p = _mm256_packs_epi16(_mm256_packs_epi32(q0, q1), _mm256_packs_epi32(q2, q3));
            p = _mm256_permutevar8x32_epi32(p, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
            _mm256_storeu_si256((__m256i*)(q + j), p);
        }
#else
        for (int g = 0; g < 16; ++g) {
            int s = 0;
            for (int j = 0; j < 16; ++j) {
                int v = (int)nearbyintf(xb[16 * g + j] * id);
                v = v > 127 ? 127 : (v < -127 ? -127 : v);
                q[16 * g + j] = (int8_t)v;
                s += v;
            }
            bs[16 * b + g] = (int16_t)s;
        }
#endif
        dd[b] = d;
    }
}

// ===============================================================================================================
// dot products: weight rows x quantized activation rows

#if GP_AVX2
GP_INLINE __m256i bits_to_bytes(uint32_t x) {  // byte j = 0xff where bit j of x is set
    const __m256i shuf = _mm256_setr_epi64x(0x0000000000000000LL, 0x0101010101010101LL, 0x0202020202020202LL,
                                            0x0303030303030303LL);
    __m256i v = _mm256_shuffle_epi8(_mm256_set1_epi32((int)x), shuf);
    v = _mm256_or_si256(v, _mm256_set1_epi64x(0x7fbfdfeff7fbfdfeLL));
    return _mm256_cmpeq_epi8(v, _mm256_set1_epi64x(-1));
}
GP_INLINE __m256i nibbles32(const uint8_t* qs) {  // 16 bytes -> 32 values: low nibbles then high nibbles
    __m128i t = _mm_loadu_si128((const __m128i*)qs);
    __m256i b = _mm256_insertf128_si256(_mm256_castsi128_si256(t), _mm_srli_epi16(t, 4), 1);
    return _mm256_and_si256(b, _mm256_set1_epi8(0x0f));
}
GP_INLINE __m256 mul_sum_us8(__m256i u, __m256i s) {  // sum of u8*s8 in 8 i32 lanes as float
    __m256i p = _mm256_maddubs_epi16(u, s);
    return _mm256_cvtepi32_ps(_mm256_madd_epi16(p, _mm256_set1_epi16(1)));
}
GP_INLINE __m256 mul_sum_ss8(__m256i a, __m256i b) {  // signed x signed
    __m256i ax = _mm256_sign_epi8(a, a);
    __m256i sb = _mm256_sign_epi8(b, a);
    return mul_sum_us8(ax, sb);
}

// Decode one 32-element block of weight type T to (unsigned values, d, m) with w = d*q + m.
template <int T>
GP_TINLINE __m256i dec32(const uint8_t* blk, float* d, float* m);
template <>
GP_TINLINE __m256i dec32<T_Q4_0>(const uint8_t* blk, float* d, float* m) {
    const blk_q4_0* b = (const blk_q4_0*)blk;
    *d = fp16_to_fp32(b->d);
    *m = -8.0f * *d;
    return nibbles32(b->qs);
}
template <>
GP_TINLINE __m256i dec32<T_Q4_1>(const uint8_t* blk, float* d, float* m) {
    const blk_q4_1* b = (const blk_q4_1*)blk;
    int dm_bits;
    memcpy(&dm_bits, blk, 4);
    __m128 dm = _mm_cvtph_ps(_mm_cvtsi32_si128(dm_bits));
    *d = _mm_cvtss_f32(dm);
    *m = _mm_cvtss_f32(_mm_movehdup_ps(dm));
    return nibbles32(b->qs);
}
template <>
GP_TINLINE __m256i dec32<T_Q5_0>(const uint8_t* blk, float* d, float* m) {
    const blk_q5_0* b = (const blk_q5_0*)blk;
    *d = fp16_to_fp32(b->d);
    *m = -16.0f * *d;
    uint32_t qh;
    memcpy(&qh, b->qh, 4);
    __m256i hb = _mm256_and_si256(bits_to_bytes(qh), _mm256_set1_epi8(0x10));
    return _mm256_or_si256(nibbles32(b->qs), hb);
}
template <>
GP_TINLINE __m256i dec32<T_Q5_1>(const uint8_t* blk, float* d, float* m) {
    const blk_q5_1* b = (const blk_q5_1*)blk;
    *d = fp16_to_fp32(b->d);
    *m = fp16_to_fp32(b->m);
    uint32_t qh;
    memcpy(&qh, b->qh, 4);
    __m256i hb = _mm256_and_si256(bits_to_bytes(qh), _mm256_set1_epi8(0x10));
    return _mm256_or_si256(nibbles32(b->qs), hb);
}

template <int T>
struct Blk;
template <> struct Blk<T_Q4_0> { enum { size = 18 }; };
template <> struct Blk<T_Q4_1> { enum { size = 20 }; };
template <> struct Blk<T_Q5_0> { enum { size = 22 }; };
template <> struct Blk<T_Q5_1> { enum { size = 24 }; };
template <> struct Blk<T_Q8_0> { enum { size = 34 }; };

// One weight row (unsigned-with-offset types) against one A32 activation row. Rows are read one at a time, in
// order: reading 4 rows side by side (activations loaded once for all) measured slower, 0.44-0.61 of stream against
// 0.59-0.76, as the hardware prefetcher follows one stream per thread better than four short ones.
template <int T>
static float dot_u32(const uint8_t* w, const uint8_t* act, int64_t k) {
    const int64_t nb = k / 32;
    const auto [aq, ad, as] = a32_parts(act, k);
    __m256 acc = _mm256_setzero_ps();
    float summ = 0.0f;
    for (int64_t b = 0; b < nb; ++b) {
        const __m256i av = _mm256_loadu_si256((const __m256i*)(aq + 32 * b));
        float d, m;
        const __m256i wv = dec32<T>(w + b * Blk<T>::size, &d, &m);
        acc = _mm256_fmadd_ps(mul_sum_us8(wv, av), _mm256_set1_ps(d * ad[b]), acc);
        summ += m * as[b];
    }
    return hsum(acc) + summ;
}

GP_INLINE __m256i iq4_lookup(const uint8_t* qs) {  // 16 bytes of 4-bit indices -> 32 table values (int8)
    return _mm256_shuffle_epi8(_mm256_broadcastsi128_si256(_mm_load_si128((const __m128i*)iq4_values)),
                               nibbles32(qs));
}

static float dot_q8_0(const uint8_t* w, const uint8_t* act, int64_t k) {
    const int64_t nb = k / 32;
    const int8_t* aq = (const int8_t*)act;
    const float* ad = (const float*)(act + k);
    __m256 acc = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; ++b) {
        const blk_q8_0* blk = (const blk_q8_0*)(w + b * 34);
        const __m256i av = _mm256_loadu_si256((const __m256i*)(aq + 32 * b));
        const __m256i wv = _mm256_loadu_si256((const __m256i*)blk->qs);
        acc = _mm256_fmadd_ps(mul_sum_ss8(wv, av), _mm256_set1_ps(fp16_to_fp32(blk->d) * ad[b]), acc);
    }
    return hsum(acc);
}

// broadcast i16 lane `lane` of a 128-bit vector of 8 i16 to all 16 lanes of a 256-bit vector
GP_INLINE __m256i bcast_i16(__m256i v2, int lane) {
    const __m256i idx = _mm256_set1_epi16((short)(0x0100 * (2 * lane + 1) + 2 * lane));
    return _mm256_shuffle_epi8(v2, idx);
}

// Q4_K against A256
static float dot_q4_K(const uint8_t* w, const uint8_t* act, int64_t k) {
    const int64_t nb = k / 256;
    const auto [aq, ad, bs] = a256_parts(act, k);
    __m256 acc = _mm256_setzero_ps();
    float summ = 0.0f;
    const __m256i m4 = _mm256_set1_epi8(0x0f);
    for (int64_t i = 0; i < nb; ++i) {
        const __m128i pairs = _mm_hadd_epi16(_mm_loadu_si128((const __m128i*)(bs + 16 * i)),
                                             _mm_loadu_si128((const __m128i*)(bs + 16 * i + 8)));
        const int8_t* a = aq + 256 * i;
        __m256i av[8];
        for (int j = 0; j < 8; ++j) av[j] = _mm256_loadu_si256((const __m256i*)(a + 32 * j));
        const blk_q4_K* x = (const blk_q4_K*)(w + i * 144);
        const float d = fp16_to_fp32(x->d) * ad[i];
        const float dmin = fp16_to_fp32(x->dmin) * ad[i];
        uint8_t sm[16];
        unpack_k_scales(x->scales, sm);
        const __m128i sm16 = _mm_cvtepu8_epi16(_mm_loadl_epi64((const __m128i*)sm));
        const __m128i mins = _mm_cvtepu8_epi16(_mm_loadl_epi64((const __m128i*)(sm + 8)));
        __m128i pm = _mm_madd_epi16(mins, pairs);
        pm = _mm_add_epi32(pm, _mm_shuffle_epi32(pm, 0x4e));
        pm = _mm_add_epi32(pm, _mm_shuffle_epi32(pm, 0xb1));
        summ -= dmin * (float)_mm_cvtsi128_si32(pm);
        const __m256i sc2 = _mm256_broadcastsi128_si256(sm16);
        __m256i sumi = _mm256_setzero_si256();
        for (int c = 0; c < 4; ++c) {
            const __m256i q = _mm256_loadu_si256((const __m256i*)(x->qs + 32 * c));
            const __m256i lo = _mm256_and_si256(q, m4);
            const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(q, 4), m4);
            const __m256i p0 = _mm256_madd_epi16(_mm256_maddubs_epi16(lo, av[2 * c]), bcast_i16(sc2, 2 * c));
            const __m256i p1 = _mm256_madd_epi16(_mm256_maddubs_epi16(hi, av[2 * c + 1]), bcast_i16(sc2, 2 * c + 1));
            sumi = _mm256_add_epi32(sumi, _mm256_add_epi32(p0, p1));
        }
        acc = _mm256_fmadd_ps(_mm256_set1_ps(d), _mm256_cvtepi32_ps(sumi), acc);
    }
    return hsum(acc) + summ;
}

// Q2_K / Q3_K rows against A256 activations. The 16 group scales are
// widened to i16 with the even groups in the low 128-bit lane and the odd ones in the high lane, so one in-lane
// broadcast gives the scales of a 32-element chunk (groups 2j, 2j+1 = the two halves of a maddubs result).
GP_INLINE __m256i even_odd_i16(__m128i v8, bool is_signed) {
    const __m128i deint = _mm_setr_epi8(0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15);
    const __m128i t = _mm_shuffle_epi8(v8, deint);
    return is_signed ? _mm256_cvtepi8_epi16(t) : _mm256_cvtepu8_epi16(t);
}

static float dot_q2_K(const uint8_t* w, const uint8_t* act, int64_t k) {
    const int64_t nb = k / 256;
    const auto [aq, ad, bs] = a256_parts(act, k);
    __m256 acc = _mm256_setzero_ps();
    const __m256i m3 = _mm256_set1_epi8(3);
    const __m128i m4 = _mm_set1_epi8(0x0f);
    for (int64_t i = 0; i < nb; ++i) {
        const int8_t* a = aq + 256 * i;
        const __m256i bsv = _mm256_loadu_si256((const __m256i*)(bs + 16 * i));
        const blk_q2_K* x = (const blk_q2_K*)(w + i * 84);
        const __m128 dd = _mm_mul_ps(_mm_cvtph_ps(_mm_cvtsi32_si128((int)(x->d | (uint32_t)x->dmin << 16))),
                                     _mm_set1_ps(ad[i]));
        const __m128i raw = _mm_loadu_si128((const __m128i*)x->scales);
        const __m256i mins = _mm256_cvtepu8_epi16(_mm_and_si128(_mm_srli_epi16(raw, 4), m4));
        const __m256i mi = _mm256_madd_epi16(mins, bsv);  // 8 partial sums of min * bsum
        const __m256i sc = even_odd_i16(_mm_and_si128(raw, m4), false);
        __m256i sumi = _mm256_setzero_si256();
        for (int h = 0; h < 2; ++h) {
            const __m256i Q = _mm256_loadu_si256((const __m256i*)(x->qs + 32 * h));
            for (int s = 0; s < 4; ++s) {
                const __m256i q = _mm256_and_si256(_mm256_srli_epi16(Q, 2 * s), m3);
                const __m256i p = _mm256_maddubs_epi16(q, _mm256_loadu_si256((const __m256i*)(a + 32 * (4 * h + s))));
                sumi = _mm256_add_epi32(sumi, _mm256_madd_epi16(p, bcast_i16(sc, 4 * h + s)));
            }
        }
        const __m256 d = _mm256_broadcastss_ps(dd);
        const __m256 dmin = _mm256_broadcastss_ps(_mm_movehdup_ps(dd));
        acc = _mm256_fmadd_ps(d, _mm256_cvtepi32_ps(sumi), acc);
        acc = _mm256_fnmadd_ps(dmin, _mm256_cvtepi32_ps(mi), acc);
    }
    return hsum(acc);
}

static float dot_q3_K(const uint8_t* w, const uint8_t* act, int64_t k) {
    const int64_t nb = k / 256;
    const auto [aq, ad, bs] = a256_parts(act, k);
    __m256 acc = _mm256_setzero_ps();
    const __m256i m3 = _mm256_set1_epi8(3);
    const __m256i one = _mm256_set1_epi8(1);
    for (int64_t i = 0; i < nb; ++i) {
        const int8_t* a = aq + 256 * i;
        const __m256i bsv = _mm256_loadu_si256((const __m256i*)(bs + 16 * i));
        const blk_q3_K* x = (const blk_q3_K*)(w + i * 110);
        const float d = fp16_to_fp32(x->d) * ad[i];
        uint32_t u[4];  // built in registers: a byte-wise store then a 16-byte load would stall forwarding
        q3_scales_u32(x->scales, u);
        const __m128i sc128 = _mm_sub_epi8(_mm_setr_epi32((int)u[0], (int)u[1], (int)u[2], (int)u[3]),
                                           _mm_set1_epi8(32));
        const __m256i sc = even_odd_i16(sc128, true);
        // the quants are taken as q + 4 (0..7): subtract 4 * sum(scale * bsum) afterwards
        __m256i sumi = _mm256_slli_epi32(_mm256_madd_epi16(_mm256_cvtepi8_epi16(sc128), bsv), 2);
        sumi = _mm256_sub_epi32(_mm256_setzero_si256(), sumi);
        const __m256i H = _mm256_loadu_si256((const __m256i*)x->hmask);
        for (int h = 0; h < 2; ++h) {
            const __m256i Q = _mm256_loadu_si256((const __m256i*)(x->qs + 32 * h));
            for (int s = 0; s < 4; ++s) {
                const int j = 4 * h + s;
                const __m256i hb = _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(H, j), one), 2);
                const __m256i q = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(Q, 2 * s), m3), hb);
                const __m256i p = _mm256_maddubs_epi16(q, _mm256_loadu_si256((const __m256i*)(a + 32 * j)));
                sumi = _mm256_add_epi32(sumi, _mm256_madd_epi16(p, bcast_i16(sc, j)));
            }
        }
        acc = _mm256_fmadd_ps(_mm256_set1_ps(d), _mm256_cvtepi32_ps(sumi), acc);
    }
    return hsum(acc);
}

static float dot_q5_K(const uint8_t* w, const uint8_t* act, int64_t k) {
    const int64_t nb = k / 256;
    const auto [aq, ad, bs] = a256_parts(act, k);
    __m256 acc = _mm256_setzero_ps();
    float summ = 0.0f;
    const __m256i m4 = _mm256_set1_epi8(0x0f);
    const __m256i one = _mm256_set1_epi8(1);
    for (int64_t i = 0; i < nb; ++i) {
        const blk_q5_K* x = (const blk_q5_K*)(w + i * 176);
        const float d = fp16_to_fp32(x->d) * ad[i];
        const float dmin = fp16_to_fp32(x->dmin) * ad[i];
        uint8_t sm[16];
        unpack_k_scales(x->scales, sm);
        __m128i b0 = _mm_loadu_si128((const __m128i*)(bs + 16 * i));
        __m128i b1 = _mm_loadu_si128((const __m128i*)(bs + 16 * i + 8));
        __m128i pairs = _mm_hadd_epi16(b0, b1);
        __m128i mins = _mm_cvtepu8_epi16(_mm_loadl_epi64((const __m128i*)(sm + 8)));
        __m128i pm = _mm_madd_epi16(mins, pairs);
        pm = _mm_add_epi32(pm, _mm_shuffle_epi32(pm, 0x4e));
        pm = _mm_add_epi32(pm, _mm_shuffle_epi32(pm, 0xb1));
        summ -= dmin * (float)_mm_cvtsi128_si32(pm);
        const __m256i hb = _mm256_loadu_si256((const __m256i*)x->qh);
        __m256i sumi = _mm256_setzero_si256();
        const int8_t* a = aq + 256 * i;
        for (int c = 0; c < 4; ++c) {
            __m256i q = _mm256_loadu_si256((const __m256i*)(x->qs + 32 * c));
            __m256i h0 = _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(hb, 2 * c), one), 4);
            __m256i h1 = _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(hb, 2 * c + 1), one), 4);
            __m256i lo = _mm256_or_si256(_mm256_and_si256(q, m4), h0);
            __m256i hi = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(q, 4), m4), h1);
            __m256i a0 = _mm256_loadu_si256((const __m256i*)(a + 64 * c));
            __m256i a1 = _mm256_loadu_si256((const __m256i*)(a + 64 * c + 32));
            __m256i p0 = _mm256_madd_epi16(_mm256_maddubs_epi16(lo, a0), _mm256_set1_epi16(sm[2 * c]));
            __m256i p1 = _mm256_madd_epi16(_mm256_maddubs_epi16(hi, a1), _mm256_set1_epi16(sm[2 * c + 1]));
            sumi = _mm256_add_epi32(sumi, _mm256_add_epi32(p0, p1));
        }
        acc = _mm256_fmadd_ps(_mm256_set1_ps(d), _mm256_cvtepi32_ps(sumi), acc);
    }
    return hsum(acc) + summ;
}

static float dot_q6_K(const uint8_t* w, const uint8_t* act, int64_t k) {
    const int64_t nb = k / 256;
    const auto [aq, ad, bs] = a256_parts(act, k);
    __m256 acc = _mm256_setzero_ps();
    const __m256i m4 = _mm256_set1_epi8(0x0f);
    const __m256i m2 = _mm256_set1_epi8(3);
    for (int64_t i = 0; i < nb; ++i) {
        const blk_q6_K* x = (const blk_q6_K*)(w + i * 210);
        const float d = fp16_to_fp32(x->d) * ad[i];
        // 32 * sum(sc * bsum)
        __m256i sc16 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i*)x->scales));
        __m256i bsv = _mm256_loadu_si256((const __m256i*)(bs + 16 * i));
        const int corr = hsum_i32(_mm256_madd_epi16(sc16, bsv));
        __m256i sumi = _mm256_setzero_si256();
        const int8_t* a = aq + 256 * i;
        for (int h = 0; h < 2; ++h) {
            const uint8_t* ql = x->ql + 64 * h;
            const __m256i L0 = _mm256_loadu_si256((const __m256i*)ql);
            const __m256i L1 = _mm256_loadu_si256((const __m256i*)(ql + 32));
            const __m256i H = _mm256_loadu_si256((const __m256i*)(x->qh + 32 * h));
            __m256i q[4];
            q[0] = _mm256_or_si256(_mm256_and_si256(L0, m4), _mm256_slli_epi16(_mm256_and_si256(H, m2), 4));
            q[1] = _mm256_or_si256(_mm256_and_si256(L1, m4),
                                   _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(H, 2), m2), 4));
            q[2] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(L0, 4), m4),
                                   _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(H, 4), m2), 4));
            q[3] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(L1, 4), m4),
                                   _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(H, 6), m2), 4));
            const int8_t* sc = x->scales + 8 * h;
            for (int j = 0; j < 4; ++j) {
                __m256i av = _mm256_loadu_si256((const __m256i*)(a + 128 * h + 32 * j));
                __m256i p = _mm256_maddubs_epi16(q[j], av);
                __m256i s = _mm256_setr_m128i(_mm_set1_epi16(sc[2 * j]), _mm_set1_epi16(sc[2 * j + 1]));
                sumi = _mm256_add_epi32(sumi, _mm256_madd_epi16(p, s));
            }
        }
        sumi = _mm256_sub_epi32(sumi, _mm256_setr_epi32(32 * corr, 0, 0, 0, 0, 0, 0, 0));
        acc = _mm256_fmadd_ps(_mm256_set1_ps(d), _mm256_cvtepi32_ps(sumi), acc);
    }
    return hsum(acc);
}

// Two IQ4 16-byte code fields in the two lanes of q against 64 activations (a0: the first field's 32 elements, a1:
// the second's), regrouped to match the nibbles (low: elements 0..15, high: 16..31). The i16 pair products of each
// half: a pair reaches 2 * 127 * 127, so the halves can only be added as i32.
struct Iq4Halves {
    __m256i lo, hi;
};
GP_INLINE Iq4Halves iq4_pair_products(__m256i q, __m256i a0, __m256i a1) {
    const __m256i m4 = _mm256_set1_epi8(0x0f);
    const __m256i tab = _mm256_broadcastsi128_si256(_mm_load_si128((const __m128i*)iq4_values));
    const __m256i lo = _mm256_shuffle_epi8(tab, _mm256_and_si256(q, m4));
    const __m256i hi = _mm256_shuffle_epi8(tab, _mm256_and_si256(_mm256_srli_epi16(q, 4), m4));
    const __m256i alo = _mm256_permute2x128_si256(a0, a1, 0x20);
    const __m256i ahi = _mm256_permute2x128_si256(a0, a1, 0x31);
    return {_mm256_maddubs_epi16(_mm256_sign_epi8(alo, alo), _mm256_sign_epi8(lo, alo)),
            _mm256_maddubs_epi16(_mm256_sign_epi8(ahi, ahi), _mm256_sign_epi8(hi, ahi))};
}

// IQ4_NL against A32, one row: two blocks per step, their 16-byte code fields in the two lanes of one register
// (low nibbles: elements 0..15 of each block, high nibbles 16..31; the activations are regrouped to match). Decode
// reads the rows in order: a streaming read the hardware prefetcher follows, which 4 interleaved rows are not.
static float dot_iq4_nl(const uint8_t* w, const uint8_t* act, int64_t k) {
    const int64_t nb = k / 32;
    const auto [aq, ad, as] = a32_parts(act, k);
    (void)as;
    const __m256i ones = _mm256_set1_epi16(1);
    __m256 acc = _mm256_setzero_ps();
    int64_t b = 0;
    for (; b + 2 <= nb; b += 2) {
        const blk_iq4_nl* x = (const blk_iq4_nl*)(w + b * 18);
        const __m256i q = _mm256_inserti128_si256(_mm256_castsi128_si256(_mm_loadu_si128((const __m128i*)x[0].qs)),
                                                  _mm_loadu_si128((const __m128i*)x[1].qs), 1);
        const Iq4Halves pp = iq4_pair_products(q, _mm256_loadu_si256((const __m256i*)(aq + 32 * b)),
                                               _mm256_loadu_si256((const __m256i*)(aq + 32 * b + 32)));
        const __m256i s = _mm256_add_epi32(_mm256_madd_epi16(pp.lo, ones), _mm256_madd_epi16(pp.hi, ones));
        const __m256 d = _mm256_set_m128(_mm_set1_ps(fp16_to_fp32(x[1].d) * ad[b + 1]),
                                         _mm_set1_ps(fp16_to_fp32(x[0].d) * ad[b]));
        acc = _mm256_fmadd_ps(d, _mm256_cvtepi32_ps(s), acc);
    }
    if (b < nb) {  // an odd block count
        const blk_iq4_nl* x = (const blk_iq4_nl*)(w + b * 18);
        const __m256i av = _mm256_loadu_si256((const __m256i*)(aq + 32 * b));
        acc = _mm256_fmadd_ps(mul_sum_ss8(av, iq4_lookup(x->qs)), _mm256_set1_ps(fp16_to_fp32(x->d) * ad[b]), acc);
    }
    return hsum(acc);
}

// IQ4_XS against A256, one row (as IQ4_NL: in order): two 32-element sub-blocks per 32-byte load. The low nibbles
// hold elements 0..15 of sub-block 2p (low lane) and 2p+1 (high lane), the high nibbles elements 16..31: the
// activations are regrouped the same way, and the scales (even sub-blocks in the low lane, odd in the high one)
// applied by one madd per half.
static float dot_iq4_xs(const uint8_t* w, const uint8_t* act, int64_t k) {
    const int64_t nb = k / 256;
    const auto [aq, ad, bs] = a256_parts(act, k);
    (void)bs;
    __m256 acc = _mm256_setzero_ps();
    for (int64_t i = 0; i < nb; ++i) {
        const int8_t* a = aq + 256 * i;
        const blk_iq4_xs* x = (const blk_iq4_xs*)(w + i * 136);
        const __m128i sc8 = _mm_sub_epi8(_mm_cvtsi64_si128((long long)iq4_xs_scales(x)), _mm_set1_epi8(32));
        const __m256i sc = even_odd_i16(sc8, true);
        __m256i sumi = _mm256_setzero_si256();
        for (int p = 0; p < 4; ++p) {
            const Iq4Halves pp = iq4_pair_products(_mm256_loadu_si256((const __m256i*)(x->qs + 32 * p)),
                                                   _mm256_loadu_si256((const __m256i*)(a + 64 * p)),
                                                   _mm256_loadu_si256((const __m256i*)(a + 64 * p + 32)));
            const __m256i s = bcast_i16(sc, p);
            sumi = _mm256_add_epi32(sumi, _mm256_add_epi32(_mm256_madd_epi16(pp.lo, s), _mm256_madd_epi16(pp.hi, s)));
        }
        acc = _mm256_fmadd_ps(_mm256_set1_ps(fp16_to_fp32(x->d) * ad[i]), _mm256_cvtepi32_ps(sumi), acc);
    }
    return hsum(acc);
}

#else  // scalar

template <int T>
static float dot32_scalar(const uint8_t* w, const uint8_t* act, int64_t k) {
    const int64_t nb = k / 32;
    const auto [aq, ad, as] = a32_parts(act, k);
    float acc = 0.0f, summ = 0.0f;
    for (int64_t b = 0; b < nb; ++b) {
        const int8_t* a = aq + 32 * b;
        int q[32];
        float d = 0.0f, m = 0.0f;
        if (T == T_Q8_0) {
            const blk_q8_0* x = (const blk_q8_0*)(w + b * 34);
            d = fp16_to_fp32(x->d);
            for (int j = 0; j < 32; ++j) q[j] = x->qs[j];
        } else if (T == T_IQ4_NL) {
            const blk_iq4_nl* x = (const blk_iq4_nl*)(w + b * 18);
            d = fp16_to_fp32(x->d);
            for (int j = 0; j < 16; ++j) { q[j] = iq4_values[x->qs[j] & 0x0f]; q[j + 16] = iq4_values[x->qs[j] >> 4]; }
        } else if (T == T_Q4_0 || T == T_Q4_1) {
            const uint8_t* qs;
            if (T == T_Q4_0) {
                const blk_q4_0* x = (const blk_q4_0*)(w + b * 18);
                d = fp16_to_fp32(x->d); m = -8.0f * d; qs = x->qs;
            } else {
                const blk_q4_1* x = (const blk_q4_1*)(w + b * 20);
                d = fp16_to_fp32(x->d); m = fp16_to_fp32(x->m); qs = x->qs;
            }
            for (int j = 0; j < 16; ++j) { q[j] = qs[j] & 0x0f; q[j + 16] = qs[j] >> 4; }
        } else {
            const uint8_t* qs;
            uint32_t qh;
            if (T == T_Q5_0) {
                const blk_q5_0* x = (const blk_q5_0*)(w + b * 22);
                d = fp16_to_fp32(x->d); m = -16.0f * d; qs = x->qs; memcpy(&qh, x->qh, 4);
            } else {
                const blk_q5_1* x = (const blk_q5_1*)(w + b * 24);
                d = fp16_to_fp32(x->d); m = fp16_to_fp32(x->m); qs = x->qs; memcpy(&qh, x->qh, 4);
            }
            for (int j = 0; j < 16; ++j) {
                q[j] = (qs[j] & 0x0f) | (((qh >> j) & 1) << 4);
                q[j + 16] = (qs[j] >> 4) | (((qh >> (j + 16)) & 1) << 4);
            }
        }
        int s = 0;
        for (int j = 0; j < 32; ++j) s += q[j] * a[j];
        acc += (float)s * (d * ad[b]);
        summ += m * as[b];
    }
    return acc + summ;
}

// Q2_K / Q3_K: one 32-element chunk (two groups of 16) per step, in plain loops the compiler vectorises.
static float dot_q2_K_scalar(const uint8_t* w, const uint8_t* act, int64_t k) {
    const int64_t nb = k / 256;
    const auto [aq, ad, bs] = a256_parts(act, k);
    float acc = 0.0f;
    for (int64_t i = 0; i < nb; ++i) {
        const blk_q2_K* x = (const blk_q2_K*)(w + i * 84);
        int sumi = 0, summ = 0;
        for (int j = 0; j < 8; ++j) {
            const uint8_t* q = x->qs + 32 * (j / 4);
            const int8_t* a = aq + 256 * i + 32 * j;
            const int sh = 2 * (j % 4);
            int s0 = 0, s1 = 0;
#pragma GCC unroll 1  // else fully unrolled before the vectoriser sees the loop
            for (int l = 0; l < 16; ++l) s0 += (int)((q[l] >> sh) & 3) * (int)a[l];
#pragma GCC unroll 1
            for (int l = 16; l < 32; ++l) s1 += (int)((q[l] >> sh) & 3) * (int)a[l];
            sumi += (x->scales[2 * j] & 0x0f) * s0 + (x->scales[2 * j + 1] & 0x0f) * s1;
        }
        for (int g = 0; g < 16; ++g) summ += (x->scales[g] >> 4) * bs[16 * i + g];
        acc += fp16_to_fp32(x->d) * ad[i] * (float)sumi - fp16_to_fp32(x->dmin) * ad[i] * (float)summ;
    }
    return acc;
}

static float dot_q3_K_scalar(const uint8_t* w, const uint8_t* act, int64_t k) {
    const int64_t nb = k / 256;
    const int8_t* aq = (const int8_t*)act;
    const float* ad = (const float*)(act + k);
    float acc = 0.0f;
    for (int64_t i = 0; i < nb; ++i) {
        const blk_q3_K* x = (const blk_q3_K*)(w + i * 110);
        int8_t sc[16];
        unpack_q3_scales(x->scales, sc);
        int sumi = 0;
        for (int j = 0; j < 8; ++j) {
            const uint8_t* q = x->qs + 32 * (j / 4);
            const uint8_t* hm = x->hmask;
            const int8_t* a = aq + 256 * i + 32 * j;
            const int sh = 2 * (j % 4);
            int s0 = 0, s1 = 0;
#pragma GCC unroll 1  // else fully unrolled before the vectoriser sees the loop
            for (int l = 0; l < 16; ++l)
                s0 += ((int)((q[l] >> sh) & 3) + 4 * (int)((hm[l] >> j) & 1) - 4) * (int)a[l];
#pragma GCC unroll 1
            for (int l = 16; l < 32; ++l)
                s1 += ((int)((q[l] >> sh) & 3) + 4 * (int)((hm[l] >> j) & 1) - 4) * (int)a[l];
            sumi += sc[2 * j] * s0 + sc[2 * j + 1] * s1;
        }
        acc += fp16_to_fp32(x->d) * ad[i] * (float)sumi;
    }
    return acc;
}

static float dot_iq4_xs_scalar(const uint8_t* w, const uint8_t* act, int64_t k) {
    const int64_t nb = k / 256;
    const int8_t* aq = (const int8_t*)act;
    const float* ad = (const float*)(act + k);
    float acc = 0.0f;
    for (int64_t i = 0; i < nb; ++i) {
        const blk_iq4_xs* x = (const blk_iq4_xs*)(w + i * 136);
        const uint64_t sc = iq4_xs_scales(x);
        int sumi = 0;
        for (int j = 0; j < 8; ++j) {
            const uint8_t* q = x->qs + 16 * j;
            const int8_t* a = aq + 256 * i + 32 * j;
            int s = 0;
            for (int l = 0; l < 16; ++l) s += iq4_values[q[l] & 0x0f] * a[l] + iq4_values[q[l] >> 4] * a[l + 16];
            sumi += ((int)((sc >> (8 * j)) & 63) - 32) * s;
        }
        acc += fp16_to_fp32(x->d) * ad[i] * (float)sumi;
    }
    return acc;
}

static float dot_qK_scalar(int type, const uint8_t* w, const uint8_t* act, int64_t k) {
    const int64_t nb = k / 256;
    const auto [aq, ad, bs] = a256_parts(act, k);
    float acc = 0.0f;
    for (int64_t i = 0; i < nb; ++i) {
        const int8_t* a = aq + 256 * i;
        const int16_t* b = bs + 16 * i;
        if (type == T_Q6_K) {
            const blk_q6_K* x = (const blk_q6_K*)(w + i * 210);
            int sumi = 0;
            for (int h = 0; h < 2; ++h) {
                const uint8_t* ql = x->ql + 64 * h;
                const uint8_t* qh = x->qh + 32 * h;
                const int8_t* sc = x->scales + 8 * h;
                const int8_t* ah = a + 128 * h;
                for (int l = 0; l < 32; ++l) {
                    const int is = l / 16;
                    const int q1 = (int)((ql[l] & 0x0f) | (((qh[l] >> 0) & 3) << 4)) - 32;
                    const int q2 = (int)((ql[l + 32] & 0x0f) | (((qh[l] >> 2) & 3) << 4)) - 32;
                    const int q3 = (int)((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) - 32;
                    const int q4 = (int)((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) - 32;
                    sumi += sc[is] * q1 * ah[l] + sc[is + 2] * q2 * ah[l + 32] + sc[is + 4] * q3 * ah[l + 64] +
                            sc[is + 6] * q4 * ah[l + 96];
                }
            }
            acc += fp16_to_fp32(x->d) * ad[i] * (float)sumi;
            continue;
        }
        const uint8_t* qs;
        const uint8_t* qh = nullptr;
        const uint8_t* scales;
        float d, dmin;
        if (type == T_Q4_K) {
            const blk_q4_K* x = (const blk_q4_K*)(w + i * 144);
            d = fp16_to_fp32(x->d); dmin = fp16_to_fp32(x->dmin); qs = x->qs; scales = x->scales;
        } else {
            const blk_q5_K* x = (const blk_q5_K*)(w + i * 176);
            d = fp16_to_fp32(x->d); dmin = fp16_to_fp32(x->dmin); qs = x->qs; scales = x->scales; qh = x->qh;
        }
        uint8_t sm[16];
        unpack_k_scales(scales, sm);
        int sumi = 0, summ = 0;
        for (int c = 0; c < 4; ++c) {
            int s0 = 0, s1 = 0;
            for (int l = 0; l < 32; ++l) {
                int lo = qs[32 * c + l] & 0x0f, hi = qs[32 * c + l] >> 4;
                if (qh) {
                    lo |= ((qh[l] >> (2 * c)) & 1) << 4;
                    hi |= ((qh[l] >> (2 * c + 1)) & 1) << 4;
                }
                s0 += lo * a[64 * c + l];
                s1 += hi * a[64 * c + 32 + l];
            }
            sumi += s0 * sm[2 * c] + s1 * sm[2 * c + 1];
            summ += sm[8 + 2 * c] * (b[4 * c] + b[4 * c + 1]) + sm[8 + 2 * c + 1] * (b[4 * c + 2] + b[4 * c + 3]);
        }
        acc += d * ad[i] * (float)sumi - dmin * ad[i] * (float)summ;
    }
    return acc;
}
#endif

float vec_dot_w(int type, const void* w, const uint8_t* act, int64_t k) {
    const uint8_t* wb = (const uint8_t*)w;
#if GP_AVX2
    switch (type) {
        case T_Q4_0: return dot_u32<T_Q4_0>(wb, act, k);
        case T_Q4_1: return dot_u32<T_Q4_1>(wb, act, k);
        case T_Q5_0: return dot_u32<T_Q5_0>(wb, act, k);
        case T_Q5_1: return dot_u32<T_Q5_1>(wb, act, k);
        case T_Q8_0: return dot_q8_0(wb, act, k);
        case T_Q2_K: return dot_q2_K(wb, act, k);
        case T_Q3_K: return dot_q3_K(wb, act, k);
        case T_Q4_K: return dot_q4_K(wb, act, k);
        case T_Q5_K: return dot_q5_K(wb, act, k);
        case T_Q6_K: return dot_q6_K(wb, act, k);
        case T_IQ4_NL: return dot_iq4_nl(wb, act, k);
        case T_IQ4_XS: return dot_iq4_xs(wb, act, k);
        default: return 0.0f;
    }
#else
    switch (type) {
        case T_Q4_0: return dot32_scalar<T_Q4_0>(wb, act, k);
        case T_Q4_1: return dot32_scalar<T_Q4_1>(wb, act, k);
        case T_Q5_0: return dot32_scalar<T_Q5_0>(wb, act, k);
        case T_Q5_1: return dot32_scalar<T_Q5_1>(wb, act, k);
        case T_Q8_0: return dot32_scalar<T_Q8_0>(wb, act, k);
        case T_Q2_K: return dot_q2_K_scalar(wb, act, k);
        case T_Q3_K: return dot_q3_K_scalar(wb, act, k);
        case T_Q4_K: case T_Q5_K: case T_Q6_K: return dot_qK_scalar(type, wb, act, k);
        case T_IQ4_NL: return dot32_scalar<T_IQ4_NL>(wb, act, k);
        case T_IQ4_XS: return dot_iq4_xs_scalar(wb, act, k);
        default: return 0.0f;
    }
#endif
}

void gemv_rows(int type, const uint8_t* w, int64_t ws, int64_t nr, const uint8_t* act, int64_t k, float* out) {
    for (int64_t r = 0; r < nr; ++r) out[r] = vec_dot_w(type, w + r * ws, act, k);
}

// ===============================================================================================================
// GEMV on interleaved weights: 8 rows in the 8 lanes of one register, no horizontal sums. AVX2 and up only: at
// scalar, the interleaved layout made GEMV slower (Q4_K 3.5 -> 1.3 GB/s), so plans don't repack there.

#if GP_AVX2
// Chunk c (0..3) of an x8 record's qs[128] (Q4_1's layout, also each Q4_K/Q5_K sub-block's): 8 row lanes x 4
// elements, the low nibbles in lo and the high ones in hi; with Five, the fifth bits 2c and 2c+1 of h (shifted down
// by 2c: h is consumed two bits per chunk) as bit 4.
template <bool Five>
static inline void unpack_x8_q45(const uint8_t* qs, int c, __m256i& h, __m256i& lo, __m256i& hi) {
    const __m256i m4 = _mm256_set1_epi8(0x0f);
    const __m256i L = _mm256_loadu_si256((const __m256i*)(qs + 32 * c));
    lo = _mm256_and_si256(L, m4);
    hi = _mm256_and_si256(_mm256_srli_epi16(L, 4), m4);
    if constexpr (Five) {
        const __m256i bit4 = _mm256_set1_epi8(0x10);
        lo = _mm256_or_si256(lo, _mm256_and_si256(_mm256_slli_epi16(h, 4), bit4));
        hi = _mm256_or_si256(hi, _mm256_and_si256(_mm256_slli_epi16(h, 3), bit4));
        h = _mm256_srli_epi16(h, 2);
    }
}

// output row r of rows `ostride` bytes apart
static inline float* out_row(float* out, int r, size_t ostride) { return (float*)((uint8_t*)out + r * ostride); }

// AVX512-VNNI's vpdpbusd: acc + the sums of 4 unsigned x signed byte products per 32-bit lane, exact, in one
// instruction where maddubs + madd take two and a 16-bit intermediate. Written in asm because the avx512 level is
// compiled without VNNI (a CPU with AVX-512 but no VNNI runs it); the kernels take it only where the CPU has it.
// Their integer sums are exact either way (the 16-bit ones never saturate), so each result is bit-identical.
#if GP_AVX512
static const bool kVnni = cpu_has_avx512_vnni();
static inline __m256i dpbusd(__m256i acc, __m256i u, __m256i s) {
    asm("vpdpbusd %2, %1, %0" : "+v"(acc) : "v"(u), "v"(s));
    return acc;
}
#else
static inline __m256i dpbusd(__m256i acc, __m256i, __m256i) { return acc; }  // never instantiated below avx512
#endif

// Q4_K / Q5_K x8 (common.h). Q5_K's fifth bit makes the quants 0..31, so one 16-bit sum holds only two of a
// sub-block's four chunks (2 x 2 x 31 x 127 < 2^15): it takes two madds with the scale where Q4_K takes one.
// R activation rows share each record's unpacking; every row's result is the same whatever R.
template <bool Five, int R>
static void gemv_x8_q45_K(const uint8_t* rec, int64_t ngroups, const uint8_t* act, size_t astride, int64_t k,
                          float* out, size_t ostride) {
    constexpr int64_t size = Five ? 1440 : 1184, meta = Five ? 1280 : 1024;
    const int64_t nb = k / 256;
    A256Parts a[R];
    for (int r = 0; r < R; ++r) a[r] = a256_parts(act + r * astride, k);
    for (int64_t g = 0; g < ngroups; ++g) {
        const uint8_t* p = rec + g * nb * size;
        __m256 acc[R];
        for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
        for (int64_t s = 0; s < nb; ++s, p += size) {
            __m256i sumi[R], mi[R];
            for (int r = 0; r < R; ++r) sumi[r] = mi[r] = _mm256_setzero_si256();
            for (int j = 0; j < 8; ++j) {
                const uint8_t* q = p + 128 * j;
                _mm_prefetch((const char*)(q + 2 * size), _MM_HINT_T0);
                _mm_prefetch((const char*)(q + 2 * size + 64), _MM_HINT_T0);
                __m256i h = Five ? _mm256_loadu_si256((const __m256i*)(p + 1024 + 32 * j)) : _mm256_setzero_si256();
                __m256i s16[R][2];
                for (int r = 0; r < R; ++r) s16[r][0] = s16[r][1] = _mm256_setzero_si256();
                for (int c = 0; c < 4; ++c) {
                    __m256i lo, hi;
                    unpack_x8_q45<Five>(q, c, h, lo, hi);
                    for (int r = 0; r < R; ++r) {
                        const int32_t* a32 = (const int32_t*)(a[r].qs + 256 * s) + 8 * j + 2 * c;
                        __m256i& t = s16[r][Five ? c / 2 : 0];
                        t = _mm256_add_epi16(t, _mm256_maddubs_epi16(lo, _mm256_set1_epi32(a32[0])));
                        t = _mm256_add_epi16(t, _mm256_maddubs_epi16(hi, _mm256_set1_epi32(a32[1])));
                    }
                }
                const __m256i sc = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)(p + meta + 8 * j)));
                const __m256i sc2 = _mm256_or_si256(sc, _mm256_slli_epi32(sc, 16));
                const __m256i mn = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)(p + meta + 64 + 8 * j)));
                for (int r = 0; r < R; ++r) {
                    sumi[r] = _mm256_add_epi32(sumi[r], _mm256_madd_epi16(s16[r][0], sc2));
                    if constexpr (Five) sumi[r] = _mm256_add_epi32(sumi[r], _mm256_madd_epi16(s16[r][1], sc2));
                    const int16_t* b = a[r].bsums + 16 * s;
                    const int pair = (int)b[2 * j] + (int)b[2 * j + 1];
                    mi[r] = _mm256_add_epi32(mi[r], _mm256_madd_epi16(mn, _mm256_set1_epi32(pair & 0xffff)));
                }
            }
            const __m256 dw = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(p + meta + 128)));
            const __m256 mw = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(p + meta + 144)));
            for (int r = 0; r < R; ++r) {
                const __m256 vda = _mm256_set1_ps(a[r].d[s]);
                acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sumi[r]), _mm256_mul_ps(dw, vda), acc[r]);
                acc[r] = _mm256_fnmadd_ps(_mm256_cvtepi32_ps(mi[r]), _mm256_mul_ps(mw, vda), acc[r]);
            }
        }
        for (int r = 0; r < R; ++r) _mm256_storeu_ps(out_row(out, r, ostride) + 8 * g, acc[r]);
    }
}

// Q6_K x8 (common.h): the unsigned 6-bit quants enter maddubs as they are (0..63, so two maddubs results still fit
// in i16); their -32 offset is applied through the activations' 16-sums, as the row kernel does. R activation rows
// share each record's unpacking; every row's integer sums, hence its result, are the same whatever R.
template <int R>
static void gemv_x8_q6_K(const uint8_t* rec, int64_t ngroups, const uint8_t* act, size_t astride, int64_t k,
                         float* out, size_t ostride) {
    const int64_t nb = k / 256;
    A256Parts a[R];
    for (int r = 0; r < R; ++r) a[r] = a256_parts(act + r * astride, k);
    const __m256i m4 = _mm256_set1_epi8(0x0f);
    const __m256i m30 = _mm256_set1_epi8(0x30);
    // i32 lane r = (scale of sub-block 2p, scale of 2p+1) as i16 -> both halves the first / the second
    const __m256i dup0 = _mm256_setr_epi8(0, 1, 0, 1, 4, 5, 4, 5, 8, 9, 8, 9, 12, 13, 12, 13,
                                          0, 1, 0, 1, 4, 5, 4, 5, 8, 9, 8, 9, 12, 13, 12, 13);
    const __m256i dup1 = _mm256_setr_epi8(2, 3, 2, 3, 6, 7, 6, 7, 10, 11, 10, 11, 14, 15, 14, 15,
                                          2, 3, 2, 3, 6, 7, 6, 7, 10, 11, 10, 11, 14, 15, 14, 15);
    for (int64_t g = 0; g < ngroups; ++g) {
        const uint8_t* p = rec + g * nb * 1680;
        __m256 acc[R];
        for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
        for (int64_t s = 0; s < nb; ++s, p += 1680) {
            __m256i sumi[R];
            for (int r = 0; r < R; ++r) sumi[r] = _mm256_setzero_si256();
            for (int jp = 0; jp < 8; ++jp) {  // pairs of sub-blocks: 192 bytes of quants, 16 bytes of scales
                const uint8_t* q = p + 192 * jp;
                _mm_prefetch((const char*)(q + 3360), _MM_HINT_T0);
                _mm_prefetch((const char*)(q + 3360 + 64), _MM_HINT_T0);
                _mm_prefetch((const char*)(q + 3360 + 128), _MM_HINT_T0);
                if (jp < 3) _mm_prefetch((const char*)(p + 3360 + 1536 + 64 * jp), _MM_HINT_T0);
                const __m256i sc2 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i*)(p + 1536 + 16 * jp)));
                for (int r = 0; r < R; ++r) {  // the offset: -32 x scale x the activations' 16-sums
                    int32_t bpair;  // the two sub-blocks' sums, as one i16 pair
                    memcpy(&bpair, a[r].bsums + 16 * s + 2 * jp, 4);
                    const __m256i mi = _mm256_madd_epi16(sc2, _mm256_set1_epi32(bpair));
                    sumi[r] = _mm256_sub_epi32(sumi[r], _mm256_slli_epi32(mi, 5));
                }
                for (int h = 0; h < 2; ++h) {
                    const uint8_t* u = q + 96 * h;
                    const int j = 2 * jp + h;
                    const __m256i L0 = _mm256_loadu_si256((const __m256i*)u);
                    const __m256i L1 = _mm256_loadu_si256((const __m256i*)(u + 32));
                    const __m256i H = _mm256_loadu_si256((const __m256i*)(u + 64));
                    const __m256i q0 = _mm256_or_si256(_mm256_and_si256(L0, m4),
                                                       _mm256_and_si256(_mm256_slli_epi16(H, 4), m30));
                    const __m256i q1 = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(L0, 4), m4),
                                                       _mm256_and_si256(_mm256_slli_epi16(H, 2), m30));
                    const __m256i q2 = _mm256_or_si256(_mm256_and_si256(L1, m4), _mm256_and_si256(H, m30));
                    const __m256i q3 = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(L1, 4), m4),
                                                       _mm256_and_si256(_mm256_srli_epi16(H, 2), m30));
                    const __m256i sc = _mm256_shuffle_epi8(sc2, h ? dup1 : dup0);
                    for (int r = 0; r < R; ++r) {
                        const int32_t* a32 = (const int32_t*)(a[r].qs + 256 * s) + 4 * j;
                        const __m256i s01 = _mm256_add_epi16(_mm256_maddubs_epi16(q0, _mm256_set1_epi32(a32[0])),
                                                             _mm256_maddubs_epi16(q1, _mm256_set1_epi32(a32[1])));
                        const __m256i s23 = _mm256_add_epi16(_mm256_maddubs_epi16(q2, _mm256_set1_epi32(a32[2])),
                                                             _mm256_maddubs_epi16(q3, _mm256_set1_epi32(a32[3])));
                        sumi[r] = _mm256_add_epi32(sumi[r], _mm256_madd_epi16(s01, sc));
                        sumi[r] = _mm256_add_epi32(sumi[r], _mm256_madd_epi16(s23, sc));
                    }
                }
            }
            const __m256 dw = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(p + 1664)));
            for (int r = 0; r < R; ++r)
                acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sumi[r]), _mm256_mul_ps(dw, _mm256_set1_ps(a[r].d[s])),
                                         acc[r]);
        }
        for (int r = 0; r < R; ++r) _mm256_storeu_ps(out_row(out, r, ostride) + 8 * g, acc[r]);
    }
}

// Q4_0 / Q4_1 / Q5_0 / Q5_1 x8 (common.h): the unsigned quants (Q5: the fifth bit ORed in as bit 4) against the
// activations; the offset (Q4_1/Q5_1: m, Q4_0: -8 d, Q5_0: -16 d) is applied through the activations' block sums.
// Q5's quants are 0..31, so one 16-bit sum holds two of the four chunks (4 x 2 x 31 x 127 < 2^15); Q4's hold all
// four (8 x 2 x 15 x 127).
template <int T, int R, bool Vnni>
static void gemv_x8_q45_01(const uint8_t* rec, int64_t ngroups, const uint8_t* act, size_t astride, int64_t k,
                           float* out, size_t ostride) {
    constexpr bool five = T == T_Q5_0 || T == T_Q5_1, has_m = T == T_Q4_1 || T == T_Q5_1;
    constexpr int64_t size = 8 * Blk<T>::size, doff = five ? 160 : 128;
    constexpr float offset = T == T_Q4_0 ? -8.0f : -16.0f;  // unused by Q4_1 / Q5_1
    const int64_t nb = k / 32;
    A32Parts a[R];
    for (int r = 0; r < R; ++r) a[r] = a32_parts(act + r * astride, k);
    const __m256i ones = _mm256_set1_epi16(1);
    for (int64_t g = 0; g < ngroups; ++g) {
        const uint8_t* p = rec + g * nb * size;
        __m256 acc[R], accm[R];
        for (int r = 0; r < R; ++r) acc[r] = accm[r] = _mm256_setzero_ps();
        for (int64_t b = 0; b < nb; ++b, p += size) {
            _mm_prefetch((const char*)(p + 8 * size), _MM_HINT_T0);
            _mm_prefetch((const char*)(p + 8 * size + 64), _MM_HINT_T0);
            _mm_prefetch((const char*)(p + 8 * size + 128), _MM_HINT_T0);
            __m256i h = five ? _mm256_loadu_si256((const __m256i*)(p + 128)) : _mm256_setzero_si256();
            __m256i s16[R][2];  // Vnni: s16[r][0] holds 32-bit sums
            for (int r = 0; r < R; ++r) s16[r][0] = s16[r][1] = _mm256_setzero_si256();
            for (int c = 0; c < 4; ++c) {  // the weights' quants unpacked once for the R activation rows
                __m256i lo, hi;
                unpack_x8_q45<five>(p, c, h, lo, hi);
                for (int r = 0; r < R; ++r) {
                    const int32_t* a32 = (const int32_t*)(a[r].qs + 32 * b);
                    if constexpr (Vnni) {
                        s16[r][0] = dpbusd(s16[r][0], lo, _mm256_set1_epi32(a32[2 * c]));
                        s16[r][0] = dpbusd(s16[r][0], hi, _mm256_set1_epi32(a32[2 * c + 1]));
                        continue;
                    }
                    __m256i& t = s16[r][five ? c / 2 : 0];
                    t = _mm256_add_epi16(t, _mm256_maddubs_epi16(lo, _mm256_set1_epi32(a32[2 * c])));
                    t = _mm256_add_epi16(t, _mm256_maddubs_epi16(hi, _mm256_set1_epi32(a32[2 * c + 1])));
                }
            }
            const __m256 dw = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(p + doff)));
            [[maybe_unused]] const __m256 mw =
                has_m ? _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(p + doff + 16))) : _mm256_setzero_ps();
            for (int r = 0; r < R; ++r) {  // per row, the same operations in the same order whatever R
                __m256i s32 = s16[r][0];
                if constexpr (!Vnni) s32 = _mm256_madd_epi16(s32, ones);
                if constexpr (five && !Vnni) s32 = _mm256_add_epi32(s32, _mm256_madd_epi16(s16[r][1], ones));
                const __m256 sf = _mm256_cvtepi32_ps(s32);
                if constexpr (has_m) {
                    acc[r] = _mm256_fmadd_ps(sf, _mm256_mul_ps(dw, _mm256_set1_ps(a[r].d[b])), acc[r]);
                    accm[r] = _mm256_fmadd_ps(mw, _mm256_set1_ps(a[r].s[b]), accm[r]);
                } else {  // d (ad s + offset as)
                    const __m256 t = _mm256_fmadd_ps(sf, _mm256_set1_ps(a[r].d[b]), _mm256_set1_ps(offset * a[r].s[b]));
                    acc[r] = _mm256_fmadd_ps(t, dw, acc[r]);
                }
            }
        }
        for (int r = 0; r < R; ++r) _mm256_storeu_ps(out_row(out, r, ostride) + 8 * g, _mm256_add_ps(acc[r], accm[r]));
    }
}

template <int R, bool Vnni>
static void gemv_x8_q8_0(const uint8_t* rec, int64_t ngroups, const uint8_t* act, size_t astride, int64_t k,
                         float* out, size_t ostride) {
    const int64_t nb = k / 32;
    A32Parts a[R];
    for (int r = 0; r < R; ++r) a[r] = a32_parts(act + r * astride, k);
    const __m256i ones = _mm256_set1_epi16(1);
    for (int64_t g = 0; g < ngroups; ++g) {
        const uint8_t* p = rec + g * nb * 272;
        __m256 acc[R];
        for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
        for (int64_t b = 0; b < nb; ++b, p += 272) {
            _mm_prefetch((const char*)(p + 2176), _MM_HINT_T0);
            _mm_prefetch((const char*)(p + 2176 + 64), _MM_HINT_T0);
            _mm_prefetch((const char*)(p + 2176 + 128), _MM_HINT_T0);
            _mm_prefetch((const char*)(p + 2176 + 192), _MM_HINT_T0);
            __m256i s32[R];
            for (int r = 0; r < R; ++r) s32[r] = _mm256_setzero_si256();
            for (int kk = 0; kk < 8; ++kk) {
                const __m256i w = _mm256_loadu_si256((const __m256i*)(p + 32 * kk));
                const __m256i aw = _mm256_sign_epi8(w, w);  // |w|, shared by the R rows
                for (int r = 0; r < R; ++r) {
                    const __m256i av = _mm256_set1_epi32(((const int32_t*)(a[r].qs + 32 * b))[kk]);
                    if constexpr (Vnni) {
                        s32[r] = dpbusd(s32[r], aw, _mm256_sign_epi8(av, w));
                        continue;
                    }
                    const __m256i pr = _mm256_maddubs_epi16(aw, _mm256_sign_epi8(av, w));
                    s32[r] = _mm256_add_epi32(s32[r], _mm256_madd_epi16(pr, ones));
                }
            }
            const __m256 dw = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(p + 256)));
            for (int r = 0; r < R; ++r)
                acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s32[r]), _mm256_mul_ps(dw, _mm256_set1_ps(a[r].d[b])), acc[r]);
        }
        for (int r = 0; r < R; ++r) _mm256_storeu_ps(out_row(out, r, ostride) + 8 * g, acc[r]);
    }
}

// R activation rows at once (consecutive rows `astride` bytes apart; outputs `ostride` bytes apart): each weight
// record is read and unpacked once for all of them; each row's result is bit-identical to a lone row's.
template <int R, bool Vnni>
static void gemv_x8_r(int type, const uint8_t* rec, int64_t ngroups, const uint8_t* act, size_t astride, int64_t k,
                      float* out, size_t ostride) {
    switch (type) {
        case T_Q4_0: gemv_x8_q45_01<T_Q4_0, R, Vnni>(rec, ngroups, act, astride, k, out, ostride); break;
        case T_Q4_1: gemv_x8_q45_01<T_Q4_1, R, Vnni>(rec, ngroups, act, astride, k, out, ostride); break;
        case T_Q5_0: gemv_x8_q45_01<T_Q5_0, R, Vnni>(rec, ngroups, act, astride, k, out, ostride); break;
        case T_Q5_1: gemv_x8_q45_01<T_Q5_1, R, Vnni>(rec, ngroups, act, astride, k, out, ostride); break;
        case T_Q8_0: gemv_x8_q8_0<R, Vnni>(rec, ngroups, act, astride, k, out, ostride); break;
        case T_Q4_K: gemv_x8_q45_K<false, R>(rec, ngroups, act, astride, k, out, ostride); break;
        case T_Q5_K: gemv_x8_q45_K<true, R>(rec, ngroups, act, astride, k, out, ostride); break;
        case T_Q6_K: gemv_x8_q6_K<R>(rec, ngroups, act, astride, k, out, ostride); break;
        default: break;
    }
}

template <bool Vnni>
static void gemv_x8_rows(int type, const uint8_t* rec, int64_t ngroups, const uint8_t* act, size_t astride, int nrows,
                         int64_t k, float* out, size_t ostride) {
    for (; nrows >= 4; nrows -= 4, act += 4 * astride, out = out_row(out, 4, ostride))
        gemv_x8_r<4, Vnni>(type, rec, ngroups, act, astride, k, out, ostride);
    if (nrows == 3) gemv_x8_r<3, Vnni>(type, rec, ngroups, act, astride, k, out, ostride);
    if (nrows == 2) gemv_x8_r<2, Vnni>(type, rec, ngroups, act, astride, k, out, ostride);
    if (nrows == 1) gemv_x8_r<1, Vnni>(type, rec, ngroups, act, astride, k, out, ostride);
}

void gemv_x8(int type, const uint8_t* rec, int64_t ngroups, const uint8_t* act, size_t astride, int nrows, int64_t k,
             float* out, size_t ostride) {
#if GP_AVX512
    if (kVnni) return gemv_x8_rows<true>(type, rec, ngroups, act, astride, nrows, k, out, ostride);
#endif
    gemv_x8_rows<false>(type, rec, ngroups, act, astride, nrows, k, out, ostride);
}
#endif  // GP_AVX2

// ===============================================================================================================
// float dots

float dot_f32(const float* a, const float* b, int64_t n) {
    int64_t i = 0;
#if GP_AVX2
    __m256 s0 = _mm256_setzero_ps(), s1 = _mm256_setzero_ps(), s2 = _mm256_setzero_ps(), s3 = _mm256_setzero_ps();
    for (; i + 32 <= n; i += 32) {
        s0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), s0);
        s1 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 8), _mm256_loadu_ps(b + i + 8), s1);
        s2 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 16), _mm256_loadu_ps(b + i + 16), s2);
        s3 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 24), _mm256_loadu_ps(b + i + 24), s3);
    }
    for (; i + 8 <= n; i += 8) s0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), s0);
    float s = hsum(_mm256_add_ps(_mm256_add_ps(s0, s1), _mm256_add_ps(s2, s3)));
#else
    double s = 0.0;
#endif
    for (; i < n; ++i) s += a[i] * b[i];
    return (float)s;
}

// F16 and BF16 rows against F32: one loop; only the 8-wide load and the scalar conversion differ.
template <bool BF16>
static float dot_half_f32(const uint16_t* a, const float* b, int64_t n) {
    int64_t i = 0;
#if GP_AVX2
    const auto load = [](const uint16_t* p) { return BF16 ? load_bf16x8(p) : load_f16x8(p); };
    __m256 s0 = _mm256_setzero_ps(), s1 = _mm256_setzero_ps();
    for (; i + 16 <= n; i += 16) {
        s0 = _mm256_fmadd_ps(load(a + i), _mm256_loadu_ps(b + i), s0);
        s1 = _mm256_fmadd_ps(load(a + i + 8), _mm256_loadu_ps(b + i + 8), s1);
    }
    for (; i + 8 <= n; i += 8) s0 = _mm256_fmadd_ps(load(a + i), _mm256_loadu_ps(b + i), s0);
    float s = hsum(_mm256_add_ps(s0, s1));
#else
    double s = 0.0;
#endif
    for (; i < n; ++i) s += (BF16 ? bf16_to_fp32(a[i]) : fp16_to_fp32(a[i])) * b[i];
    return (float)s;
}

float dot_f16_f32(const uint16_t* a, const float* b, int64_t n) { return dot_half_f32<false>(a, b, n); }
float dot_bf16_f32(const uint16_t* a, const float* b, int64_t n) { return dot_half_f32<true>(a, b, n); }

double stream_read(const uint8_t* p, size_t n) {
    size_t i = 0;
#if GP_AVX2
    __m256i s0 = _mm256_setzero_si256(), s1 = _mm256_setzero_si256();
    __m256i s2 = _mm256_setzero_si256(), s3 = _mm256_setzero_si256();
    for (; i + 128 <= n; i += 128) {
        s0 = _mm256_add_epi64(s0, _mm256_loadu_si256((const __m256i*)(p + i)));
        s1 = _mm256_add_epi64(s1, _mm256_loadu_si256((const __m256i*)(p + i + 32)));
        s2 = _mm256_add_epi64(s2, _mm256_loadu_si256((const __m256i*)(p + i + 64)));
        s3 = _mm256_add_epi64(s3, _mm256_loadu_si256((const __m256i*)(p + i + 96)));
    }
    __m256i s = _mm256_add_epi64(_mm256_add_epi64(s0, s1), _mm256_add_epi64(s2, s3));
    int64_t v[4];
    _mm256_storeu_si256((__m256i*)v, s);
    uint64_t acc = (uint64_t)v[0] + (uint64_t)v[1] + (uint64_t)v[2] + (uint64_t)v[3];
#else
    uint64_t acc = 0;
    for (; i + 8 <= n; i += 8) {
        uint64_t x;
        memcpy(&x, p + i, 8);
        acc += x;
    }
#endif
    for (; i < n; ++i) acc += p[i];
    return (double)(acc & 0xffffffu);
}

}  // namespace GP_NS
}  // namespace gp
