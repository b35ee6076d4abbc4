// Quantization: ggml's reference quantization of F32 rows (CPY/SET_ROWS destinations, tests) and the
// activation rows of MUL_MAT's integer path (A32 and A256, see common.h).
#include "blocks.h"
#include "isa.h"

namespace gp {
namespace GP_NS {

// ===============================================================================================================
// ggml's reference quantization (bit-exact with ggml-quants.c / gguf.quants; compiled with -ffp-contract=off)


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

// The code of one value of Q4_0 / Q4_1 / Q5_0 / Q5_1: v is x / d for the symmetric types, (x - min) / d for the
// others. ggml's expressions type for type: rounded by adding 0.5 (and the offset 2^(Bits-1) of the symmetric ones)
// and truncating through int8, clamped to the top code; Q5_1's reference truncates through uint8 without a clamp.
template <int Bits, bool Min>
GP_INLINE int q45_code(float v) {
    constexpr int top = (1 << Bits) - 1;
    if constexpr (Bits == 5 && Min) {
        return (uint8_t)(v + 0.5f);
    } else {
        const int q = (int)(int8_t)(v + (Min ? 0.5f : (float)(1 << (Bits - 1)) + 0.5f));
        return q > top ? top : q;
    }
}

// Q4_0 / Q4_1 / Q5_0 / Q5_1 (block B of Bits-bit codes; Min: with a minimum m, else symmetric). Per 32 values: the
// symmetric types take d = max / -2^(Bits-1) from the value of largest magnitude (sign kept), the others
// d = (max - min) / (2^Bits - 1) and m = min; codes of elements j and j + 16 share byte j of qs (low, high nibble),
// Q5's fifth bits go to qh (bit j, bit j + 16).
template <class B, int Bits, bool Min>
static void q_q45(const float* x, B* y, int64_t nb) {
    for (int64_t i = 0; i < nb; ++i) {
        const float* xb = x + 32 * i;
        float d, min = 0.0f;
        if constexpr (Min) {
            float max;
            min_max32(xb, &min, &max);
            d = (max - min) / (float)((1 << Bits) - 1);
            y[i].m = fp32_to_fp16(min);
        } else {
            float amax;
            d = signed_absmax(32, xb, &amax) / -(float)(1 << (Bits - 1));  // Q4_0 / Q5_0's scale
        }
        const float id = d != 0.0f ? 1.0f / d : 0.0f;
        y[i].d = fp32_to_fp16(d);
        uint32_t qh = 0;
        for (int j = 0; j < 16; ++j) {
            const float x0 = Min ? (xb[j] - min) * id : xb[j] * id;
            const float x1 = Min ? (xb[16 + j] - min) * id : xb[16 + j] * id;
            const int a = q45_code<Bits, Min>(x0), b = q45_code<Bits, Min>(x1);
            if constexpr (Bits == 4) {
                y[i].qs[j] = (uint8_t)((uint8_t)a | ((uint8_t)b << 4));
            } else {
                y[i].qs[j] = (uint8_t)((a & 0x0f) | ((b & 0x0f) << 4));
                qh |= (uint32_t)((a & 0x10) >> 4) << j;
                qh |= (uint32_t)((b & 0x10) >> 4) << (j + 16);
            }
        }
        if constexpr (Bits == 5) memcpy(y[i].qh, &qh, 4);
    }
}

void quantize_row_ref(int type, const float* src, void* dst, int64_t n) {
    switch (type) {
        case T_Q8_0: q_q8_0(src, (blk_q8_0*)dst, n / 32); return;
        case T_Q4_0: q_q45<blk_q4_0, 4, false>(src, (blk_q4_0*)dst, n / 32); return;
        case T_Q4_1: q_q45<blk_q4_1, 4, true>(src, (blk_q4_1*)dst, n / 32); return;
        case T_Q5_0: q_q45<blk_q5_0, 5, false>(src, (blk_q5_0*)dst, n / 32); return;
        case T_Q5_1: q_q45<blk_q5_1, 5, true>(src, (blk_q5_1*)dst, n / 32); return;
        default: quantize_row_k_ref(type, src, dst, n); return;
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
        // F32, where ggml's q8_0/q8_1 round both to F16: that rounding was measured to bring the logits no closer to
        // llama.cpp's and further from the exact ones (docs/simd.md, "The 32-block activation scale stays in F32")
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

}  // namespace GP_NS
}  // namespace gp
