// Per-ISA prelude of the kernel translation units. Each kernel source is compiled once per level with
// -DGP_LEVEL_<name> and that level's flags; everything it defines lives in namespace GP_NS (gp::scalar, gp::avx2,
// gp::avx512) so the copies never collide. Helpers here are `static inline` for the same reason.
#pragma once

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>

#include "common.h"

#if defined(GP_LEVEL_AVX512)
#define GP_NS avx512
#define GP_LEVEL_NAME "avx512"
#define GP_AVX2 1
#define GP_AVX512 1
#elif defined(GP_LEVEL_AVX2)
#define GP_NS avx2
#define GP_LEVEL_NAME "avx2"
#define GP_AVX2 1
#define GP_AVX512 0
#else
#define GP_NS scalar
#define GP_LEVEL_NAME "scalar"
#define GP_AVX2 0
#define GP_AVX512 0
#endif

#if GP_AVX2
#include <immintrin.h>
#endif

#if defined(__GNUC__)
#define GP_INLINE static inline __attribute__((always_inline))
#define GP_TINLINE inline __attribute__((always_inline))
#define GP_RESTRICT __restrict__
#else
#define GP_INLINE static inline
#define GP_TINLINE inline
#define GP_RESTRICT
#endif

namespace gp {
namespace GP_NS {

// ---------------------------------------------------------------------------------------------------------------
// scalar conversions

GP_INLINE uint32_t f2u(float f) { uint32_t u; memcpy(&u, &f, 4); return u; }
GP_INLINE float u2f(uint32_t u) { float f; memcpy(&f, &u, 4); return f; }

GP_INLINE float fp16_to_fp32(uint16_t h) {
#if GP_AVX2
    return _cvtsh_ss(h);
#else
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
    uint32_t exp = (h >> 10) & 0x1fu;
    uint32_t mant = h & 0x3ffu;
    uint32_t bits;
    if (exp == 0) {
        if (mant == 0) {
            bits = sign;
        } else {  // subnormal: normalise
            int e = -1;
            do { ++e; mant <<= 1; } while (!(mant & 0x400u));
            mant &= 0x3ffu;
            bits = sign | ((uint32_t)(127 - 15 - e) << 23) | (mant << 13);
        }
    } else if (exp == 31) {
        bits = sign | 0x7f800000u | (mant << 13);
    } else {
        bits = sign | ((exp + 112u) << 23) | (mant << 13);
    }
    return u2f(bits);
#endif
}

// The first of n values with the largest magnitude, sign kept, and that magnitude (0, 0 if all are 0 or NaN):
// the scale source of ggml's symmetric quantizers (Q4_0, Q5_0, make_qx_quants, make_q3_quants).
GP_INLINE float signed_absmax(int n, const float* x, float* amax_out) {
    float max = 0.0f, amax = 0.0f;
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

// Round to nearest even, overflow to inf, NaN kept (quiet).
GP_INLINE uint16_t fp32_to_fp16(float f) {
#if GP_AVX2
    return (uint16_t)_cvtss_sh(f, _MM_FROUND_TO_NEAREST_INT);
#else
    uint32_t x = f2u(f);
    uint32_t sign = (x >> 16) & 0x8000u;
    uint32_t ax = x & 0x7fffffffu;
    if (ax > 0x7f800000u) return (uint16_t)(sign | 0x7e00u | ((ax >> 13) & 0x3ffu));  // NaN
    if (ax >= 0x477ff000u) return (uint16_t)(sign | 0x7c00u);                          // rounds to >= 65520: inf
    if (ax < 0x38800000u) {  // result is subnormal in half (|f| < 2^-14)
        if (ax < 0x33000000u) return (uint16_t)sign;  // < 2^-25: rounds to 0
        uint32_t e = ax >> 23;
        uint32_t m = (ax & 0x7fffffu) | 0x800000u;
        uint32_t shift = 126u - e;  // 14 - (e - 127) + 13 - 1 ... puts the result in units of 2^-24
        // value = m * 2^(e-150); half subnormal unit = 2^-24 -> q = m >> (126 - e)
        uint32_t q = m >> shift;
        uint32_t rem = m & ((1u << shift) - 1u);
        uint32_t halfway = 1u << (shift - 1);
        if (rem > halfway || (rem == halfway && (q & 1u))) ++q;
        return (uint16_t)(sign | q);
    }
    // normal
    uint32_t e = (ax >> 23) - 112u;  // rebias 127 -> 15
    uint32_t m = ax & 0x7fffffu;
    uint32_t h = (e << 10) | (m >> 13);
    uint32_t rem = m & 0x1fffu;
    if (rem > 0x1000u || (rem == 0x1000u && (h & 1u))) ++h;  // may carry into the exponent: still correct
    return (uint16_t)(sign | h);
#endif
}

GP_INLINE float bf16_to_fp32(uint16_t h) { return u2f((uint32_t)h << 16); }
GP_INLINE uint16_t fp32_to_bf16(float f) {
    uint32_t u = f2u(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 64u);  // quiet NaN
    return (uint16_t)((u + (0x7fffu + ((u >> 16) & 1u))) >> 16);
}

GP_INLINE int64_t imin(int64_t a, int64_t b) { return a < b ? a : b; }
GP_INLINE int64_t imax(int64_t a, int64_t b) { return a > b ? a : b; }
GP_INLINE float fminf_(float a, float b) { return a < b ? a : b; }
GP_INLINE float fmaxf_(float a, float b) { return a > b ? a : b; }

// Split n items over nth threads: [*i0, *i1) for thread ith.
GP_INLINE void split_range(int64_t n, int ith, int nth, int64_t* i0, int64_t* i1) {
    int64_t per = (n + nth - 1) / nth;
    *i0 = imin(n, per * ith);
    *i1 = imin(n, *i0 + per);
}

// Small work runs on one thread (others only reach the barrier).
GP_INLINE bool take_small(int64_t work, int& ith, int& nth, int64_t threshold = 4096) {
    if (work < threshold && nth > 1) {
        if (ith != 0) return false;
        nth = 1;
    }
    return true;
}

// This thread's rows [*r0, *r1) of nr rows of ne0 elements; small work all on thread 0. False: none here.
GP_INLINE bool my_rows(int64_t nr, int64_t ne0, int& ith, int& nth, int64_t* r0, int64_t* r1,
                       int64_t threshold = 4096) {
    if (!take_small(nr * ne0, ith, nth, threshold)) return false;
    split_range(nr, ith, nth, r0, r1);
    return true;
}

GP_INLINE void set_error(const ExecCtx& ctx, const char* msg) {
    int expected = 0;
    if (ctx.error->compare_exchange_strong(expected, 1)) {
        size_t n = strlen(msg);
        if (n >= ERRMSG_LEN) n = ERRMSG_LEN - 1;
        memcpy(ctx.errmsg, msg, n);
        ctx.errmsg[n] = 0;
    }
}

// A kernel's dispatch switch reached an op it has no case for (the kernel table gave it an op of another kernel):
// a bug, stop loudly rather than compute something else.
[[noreturn]] GP_INLINE void no_kernel_case(const char* kernel, int op) {
    fprintf(stderr, "ggml_py simd (%s level): %s has no case for op %s (id %d)\n", GP_LEVEL_NAME, kernel, op_name(op),
            op);
    abort();
}

// Scalar math of the activations (double where cheap for accuracy).
GP_INLINE float gelu_f(float x) {
    const float c = 0.7978845608028654f;  // sqrt(2/pi)
    return 0.5f * x * (1.0f + tanhf(c * x * (1.0f + 0.044715f * x * x)));
}
GP_INLINE float silu_f(float x) { return (float)((double)x / (1.0 + exp(-(double)x))); }
GP_INLINE float sigmoid_f(float x) { return (float)(1.0 / (1.0 + exp(-(double)x))); }

#if GP_AVX2
// ---------------------------------------------------------------------------------------------------------------
// AVX2 helpers

GP_INLINE float hsum(__m256 v) {
    __m128 lo = _mm256_castps256_ps128(v);
    __m128 hi = _mm256_extractf128_ps(v, 1);
    lo = _mm_add_ps(lo, hi);
    __m128 sh = _mm_movehdup_ps(lo);
    __m128 s = _mm_add_ps(lo, sh);
    sh = _mm_movehl_ps(sh, s);
    s = _mm_add_ss(s, sh);
    return _mm_cvtss_f32(s);
}
// lane i: hsum(v[i]), bit for bit (the same additions: halves, then pairs, then the two pairs), without a store
// and reload of eight scalars
GP_INLINE __m256 hsums8(const __m256* v) {
    __m256 y[4];  // y[i]: v[2i]'s halves added (lanes 0-3), v[2i+1]'s (lanes 4-7)
    for (int i = 0; i < 4; ++i)
        y[i] = _mm256_add_ps(_mm256_permute2f128_ps(v[2 * i], v[2 * i + 1], 0x20),
                             _mm256_permute2f128_ps(v[2 * i], v[2 * i + 1], 0x31));
    const __m256 a = _mm256_hadd_ps(y[0], y[1]), b = _mm256_hadd_ps(y[2], y[3]);
    // hadd(a, b), lane by lane: v0 v2 v4 v6 v1 v3 v5 v7
    return _mm256_permutevar8x32_ps(_mm256_hadd_ps(a, b), _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
}
GP_INLINE float hmax(__m256 v) {
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    m = _mm_max_ss(m, _mm_movehdup_ps(m));
    return _mm_cvtss_f32(m);
}
GP_INLINE int hsum_i32(__m256i v) {
    __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4e));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xb1));
    return _mm_cvtsi128_si32(s);
}
GP_INLINE __m256 load_f16x8(const uint16_t* p) { return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)p)); }
GP_INLINE __m256 load_bf16x8(const uint16_t* p) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)p)), 16));
}
GP_INLINE void store_f16x8(uint16_t* p, __m256 v) {
    _mm_storeu_si128((__m128i*)p, _mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT));
}

// exp(x) with ~1 ulp error over the whole float range; exp(-inf) = 0, exp(inf) = inf, NaN stays NaN. The
// constants of exp_ps and of exp512_ps (which must give its bits lane by lane: attention mixes the two).
struct ExpPs {
    static constexpr float hi = 88.72283f, lo = -104.0f, log2e = 1.44269504088896341f;
    static constexpr float ln2_hi = 0.693359375f, ln2_lo = -2.12194440e-4f;  // ln 2 = ln2_hi + ln2_lo
    static constexpr float c[6] = {1.9875691500e-4f, 1.3981999507e-3f, 8.3334519073e-3f,
                                   4.1665795894e-2f, 1.6666665459e-1f, 5.0000001201e-1f};
};
GP_INLINE __m256 exp_ps(__m256 x0) {
    const __m256 hi = _mm256_set1_ps(ExpPs::hi);
    __m256 x = _mm256_min_ps(hi, _mm256_max_ps(_mm256_set1_ps(ExpPs::lo), x0));  // NaN passes (second operand)
    __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(ExpPs::log2e)),
                               _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(ExpPs::ln2_hi), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(ExpPs::ln2_lo), r);
    __m256 p = _mm256_set1_ps(ExpPs::c[0]);
    for (int i = 1; i < 6; ++i) p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(ExpPs::c[i]));
    __m256 r2 = _mm256_mul_ps(r, r);
    p = _mm256_fmadd_ps(p, r2, _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
    // 2^n as two factors, so that n down to -150 (subnormal results) and up to 128 stay representable
    __m256i ni = _mm256_cvtps_epi32(n);
    __m256i n1 = _mm256_srai_epi32(ni, 1);
    __m256i n2 = _mm256_sub_epi32(ni, n1);
    const __m256i bias = _mm256_set1_epi32(127);
    __m256 s1 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(n1, bias), 23));
    __m256 s2 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(n2, bias), 23));
    p = _mm256_mul_ps(_mm256_mul_ps(p, s1), s2);
    __m256 big = _mm256_cmp_ps(x0, hi, _CMP_GT_OQ);
    return _mm256_blendv_ps(p, _mm256_set1_ps(INFINITY), big);
}
#if GP_AVX512
// exp_ps over 16 lanes: lane by lane the same operations, so the same bits (and half the instructions)
GP_INLINE __m512 exp512_ps(__m512 x0) {
    const __m512 hi = _mm512_set1_ps(ExpPs::hi);
    const __m512 x = _mm512_min_ps(hi, _mm512_max_ps(_mm512_set1_ps(ExpPs::lo), x0));
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(ExpPs::log2e)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(ExpPs::ln2_hi), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(ExpPs::ln2_lo), r);
    __m512 p = _mm512_set1_ps(ExpPs::c[0]);
    for (int i = 1; i < 6; ++i) p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(ExpPs::c[i]));
    p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
    const __m512i ni = _mm512_cvtps_epi32(n), n1 = _mm512_srai_epi32(ni, 1), n2 = _mm512_sub_epi32(ni, n1);
    const __m512i bias = _mm512_set1_epi32(127);
    p = _mm512_mul_ps(_mm512_mul_ps(p, _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_add_epi32(n1, bias), 23))),
                      _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_add_epi32(n2, bias), 23)));
    return _mm512_mask_blend_ps(_mm512_cmp_ps_mask(x0, hi, _CMP_GT_OQ), p, _mm512_set1_ps(INFINITY));
}
#endif

GP_INLINE __m256 tanh_ps(__m256 x) {
    const __m256 sign_mask = _mm256_set1_ps(-0.0f);
    __m256 ax = _mm256_andnot_ps(sign_mask, x);
    __m256 sgn = _mm256_and_ps(sign_mask, x);
    // large: 1 - 2 / (exp(2|x|) + 1)
    __m256 e = exp_ps(_mm256_add_ps(ax, ax));
    __m256 big = _mm256_sub_ps(_mm256_set1_ps(1.0f),
                               _mm256_div_ps(_mm256_set1_ps(2.0f), _mm256_add_ps(e, _mm256_set1_ps(1.0f))));
    // small (|x| < 0.625): odd polynomial
    __m256 z = _mm256_mul_ps(x, x);
    __m256 p = _mm256_set1_ps(-5.70498872745e-3f);
    p = _mm256_fmadd_ps(p, z, _mm256_set1_ps(2.06390887954e-2f));
    p = _mm256_fmadd_ps(p, z, _mm256_set1_ps(-5.37397155531e-2f));
    p = _mm256_fmadd_ps(p, z, _mm256_set1_ps(1.33314422036e-1f));
    p = _mm256_fmadd_ps(p, z, _mm256_set1_ps(-3.33332819422e-1f));
    __m256 small = _mm256_fmadd_ps(_mm256_mul_ps(p, z), ax, ax);
    __m256 use_small = _mm256_cmp_ps(ax, _mm256_set1_ps(0.625f), _CMP_LT_OQ);
    __m256 r = _mm256_blendv_ps(big, small, use_small);
    return _mm256_or_ps(r, sgn);
}

GP_INLINE __m256 sigmoid_ps(__m256 x) {
    __m256 e = exp_ps(_mm256_sub_ps(_mm256_setzero_ps(), x));
    return _mm256_div_ps(_mm256_set1_ps(1.0f), _mm256_add_ps(_mm256_set1_ps(1.0f), e));
}
GP_INLINE __m256 silu_ps(__m256 x) {
    __m256 e = exp_ps(_mm256_sub_ps(_mm256_setzero_ps(), x));
    return _mm256_div_ps(x, _mm256_add_ps(_mm256_set1_ps(1.0f), e));
}
GP_INLINE __m256 gelu_ps(__m256 x) {
    const __m256 c = _mm256_set1_ps(0.7978845608028654f);
    __m256 x2 = _mm256_mul_ps(x, x);
    __m256 inner = _mm256_mul_ps(_mm256_mul_ps(c, x), _mm256_fmadd_ps(_mm256_set1_ps(0.044715f), x2,
                                                                     _mm256_set1_ps(1.0f)));
    __m256 t = tanh_ps(inner);
    return _mm256_mul_ps(_mm256_mul_ps(_mm256_set1_ps(0.5f), x), _mm256_add_ps(_mm256_set1_ps(1.0f), t));
}

// mask of the first n (0..8) lanes
GP_INLINE __m256i tail_mask(int64_t n) {
    const __m256i idx = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    return _mm256_cmpgt_epi32(_mm256_set1_epi32((int)n), idx);
}
#endif  // GP_AVX2

// ---------------------------------------------------------------------------------------------------------------
// declarations of the kernels of this level (defined in the k_*.cpp files)
void k_get_rows(Node&, int, int, int, const ExecCtx&);
void k_set_rows(Node&, int, int, int, const ExecCtx&);
void k_binary(Node&, int, int, int, const ExecCtx&);
void k_unary(Node&, int, int, int, const ExecCtx&);
void k_glu(Node&, int, int, int, const ExecCtx&);
void k_norm(Node&, int, int, int, const ExecCtx&);
void k_rms_norm(Node&, int, int, int, const ExecCtx&);
void k_mul_mat(Node&, int, int, int, const ExecCtx&);
void k_mul_mat_id(Node&, int, int, int, const ExecCtx&);
void k_soft_max(Node&, int, int, int, const ExecCtx&);
void k_rope(Node&, int, int, int, const ExecCtx&);
void k_diag_mask_inf(Node&, int, int, int, const ExecCtx&);
void k_flash_attn_ext(Node&, int, int, int, const ExecCtx&);
void k_cpy(Node&, int, int, int, const ExecCtx&);
void k_concat(Node&, int, int, int, const ExecCtx&);
void k_sum_rows(Node&, int, int, int, const ExecCtx&);
void k_argmax(Node&, int, int, int, const ExecCtx&);
void k_top_k(Node&, int, int, int, const ExecCtx&);
void k_repeat(Node&, int, int, int, const ExecCtx&);
void k_pad(Node&, int, int, int, const ExecCtx&);

// block formats: k_dequant.cpp
void dequantize_row(int type, const void* src, float* dst, int64_t n);
// k_quantize.cpp
void quantize_row_ref(int type, const float* src, void* dst, int64_t n);
void quantize_row_k_ref(int type, const float* src, void* dst, int64_t n);  // Q2_K..Q6_K (k_quantize_k.cpp)
void convert_row_from_f32(int type, const float* src, void* dst, int64_t n);  // F32/F16/BF16/quant dst
void quantize_a32(const float* x, uint8_t* row, int64_t k);
void quantize_a256(const float* x, uint8_t* row, int64_t k);
// k_dot.cpp: dot of one weight row with one activation row in the weight's vec_dot format
float vec_dot_w(int type, const void* w, const uint8_t* act, int64_t k);
// nr consecutive weight rows (stride wstride) against nact activation rows (astride bytes apart) -> nact output rows
// of nr (ostride bytes apart); each result is vec_dot_w's, whatever nact
void gemv_rows(int type, const uint8_t* w, int64_t wstride, int64_t nr, const uint8_t* act, size_t astride, int nact,
               int64_t k, float* out, size_t ostride);
#if GP_AVX2
// k_gemv_x8.cpp: ngroups groups of 8 repacked rows ("x8", see common.h) against nrows activation rows (astride
// bytes apart) -> out[8 * ngroups] per row, output rows ostride bytes apart
void gemv_x8(int type, const uint8_t* rec, int64_t ngroups, const uint8_t* act, size_t astride, int nrows, int64_t k,
             float* out, size_t ostride);
#endif
// k_matmul.cpp: the F32 GEMM of x's rows by weight rows [m0, m1) of a 2-D weight into d (scratch: as MUL_MAT's)
void gemm_rows(const Tensor& w, const Tensor& x, const Tensor& d, int64_t m0, int64_t m1, float* scratch);
// k_dot.cpp
double stream_read(const uint8_t* p, size_t n);

const KernelTable* table();

}  // namespace GP_NS
}  // namespace gp
