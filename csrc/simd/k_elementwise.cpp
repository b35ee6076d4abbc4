// Elementwise kernels: binary ops with ggml's tiling broadcast, unary ops, SCALE, CLAMP and the GLU family.
#include "isa.h"

namespace gp {
namespace GP_NS {

// row r of a tensor (r counts rows over dims 1..3)
GP_INLINE uint8_t* row_ptr(const Tensor& t, int64_t i1, int64_t i2, int64_t i3) {
    return t.data + i1 * t.nb[1] + i2 * t.nb[2] + i3 * t.nb[3];
}

// ---------------------------------------------------------------------------------------------------------------
// binary

template <int OP>
GP_INLINE float bin_f(float a, float b) {
    if (OP == GGML_PY_OP_ADD) return a + b;
    if (OP == GGML_PY_OP_SUB) return a - b;
    if (OP == GGML_PY_OP_MUL) return a * b;
    return a / b;
}
#if GP_AVX2
template <int OP>
GP_INLINE __m256 bin_v(__m256 a, __m256 b) {
    if (OP == GGML_PY_OP_ADD) return _mm256_add_ps(a, b);
    if (OP == GGML_PY_OP_SUB) return _mm256_sub_ps(a, b);
    if (OP == GGML_PY_OP_MUL) return _mm256_mul_ps(a, b);
    return _mm256_div_ps(a, b);
}
#endif

template <int OP>
static void bin_row(float* d, const float* a, const float* b, int64_t n) {
    int64_t i = 0;
#if GP_AVX2
    for (; i + 8 <= n; i += 8) _mm256_storeu_ps(d + i, bin_v<OP>(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i)));
#endif
    for (; i < n; ++i) d[i] = bin_f<OP>(a[i], b[i]);
}
template <int OP>
static void bin_row_scalar_b(float* d, const float* a, float b, int64_t n) {
    int64_t i = 0;
#if GP_AVX2
    const __m256 vb = _mm256_set1_ps(b);
    for (; i + 8 <= n; i += 8) _mm256_storeu_ps(d + i, bin_v<OP>(_mm256_loadu_ps(a + i), vb));
#endif
    for (; i < n; ++i) d[i] = bin_f<OP>(a[i], b);
}

template <int OP>
static void binary_impl(Node& n, int ith, int nth) {
    const Tensor& d = n.dst;
    const Tensor& a = n.src[0];
    const Tensor& b = n.src[1];
    const int64_t nr = nrows(d), ne0 = d.ne[0];
    int64_t r0, r1;
    if (!my_rows(nr, ne0, ith, nth, &r0, &r1)) return;
    const bool contig = d.nb[0] == 4 && a.nb[0] == 4 && b.nb[0] == 4;
    for (int64_t r = r0; r < r1; ++r) {
        const int64_t i1 = r % d.ne[1], i2 = (r / d.ne[1]) % d.ne[2], i3 = r / (d.ne[1] * d.ne[2]);
        float* dp = (float*)row_ptr(d, i1, i2, i3);
        const float* ap = (const float*)row_ptr(a, i1, i2, i3);
        const float* bp = (const float*)row_ptr(b, i1 % b.ne[1], i2 % b.ne[2], i3 % b.ne[3]);
        if (contig) {
            const int64_t nb0 = b.ne[0];
            if (nb0 == ne0) {
                bin_row<OP>(dp, ap, bp, ne0);
            } else if (nb0 == 1) {
                bin_row_scalar_b<OP>(dp, ap, bp[0], ne0);
            } else {
                for (int64_t j = 0; j < ne0; j += nb0) bin_row<OP>(dp + j, ap + j, bp, nb0);
            }
        } else {
            for (int64_t i = 0; i < ne0; ++i) {
                const float x = *(const float*)((const uint8_t*)ap + i * a.nb[0]);
                const float y = *(const float*)((const uint8_t*)bp + (i % b.ne[0]) * b.nb[0]);
                *(float*)((uint8_t*)dp + i * d.nb[0]) = bin_f<OP>(x, y);
            }
        }
    }
}

void k_binary(Node& n, int phase, int ith, int nth, const ExecCtx& ctx) {
    (void)phase;
    (void)ctx;
    switch (n.op) {
        case GGML_PY_OP_ADD: binary_impl<GGML_PY_OP_ADD>(n, ith, nth); break;
        case GGML_PY_OP_SUB: binary_impl<GGML_PY_OP_SUB>(n, ith, nth); break;
        case GGML_PY_OP_MUL: binary_impl<GGML_PY_OP_MUL>(n, ith, nth); break;
        case GGML_PY_OP_DIV: binary_impl<GGML_PY_OP_DIV>(n, ith, nth); break;
        default: break;
    }
}

// ---------------------------------------------------------------------------------------------------------------
// unary

template <int OP>
GP_INLINE float un_f(float x, const float* p) {
    switch (OP) {
        case GGML_PY_OP_SCALE: return x * p[0] + p[1];
        case GGML_PY_OP_SQR: return x * x;
        case GGML_PY_OP_SQRT: return sqrtf(x);
        case GGML_PY_OP_NEG: return -x;
        case GGML_PY_OP_ABS: return fabsf(x);
        case GGML_PY_OP_EXP: return expf(x);
        case GGML_PY_OP_LOG: return logf(x);
        case GGML_PY_OP_SILU: return silu_f(x);
        case GGML_PY_OP_GELU: return gelu_f(x);
        case GGML_PY_OP_RELU: return x > 0.0f ? x : 0.0f;
        case GGML_PY_OP_TANH: return tanhf(x);
        case GGML_PY_OP_SIGMOID: return sigmoid_f(x);
        case GGML_PY_OP_CLAMP: return x < p[0] ? p[0] : (x > p[1] ? p[1] : x);
        default: return x;
    }
}

#if GP_AVX2
template <int OP>
GP_INLINE __m256 un_v(__m256 x, const float* p) {
    switch (OP) {
        case GGML_PY_OP_SCALE: return _mm256_add_ps(_mm256_mul_ps(x, _mm256_set1_ps(p[0])), _mm256_set1_ps(p[1]));
        case GGML_PY_OP_SQR: return _mm256_mul_ps(x, x);
        case GGML_PY_OP_SQRT: return _mm256_sqrt_ps(x);
        case GGML_PY_OP_NEG: return _mm256_xor_ps(x, _mm256_set1_ps(-0.0f));
        case GGML_PY_OP_ABS: return _mm256_andnot_ps(_mm256_set1_ps(-0.0f), x);
        case GGML_PY_OP_EXP: return exp_ps(x);
        case GGML_PY_OP_SILU: return silu_ps(x);
        case GGML_PY_OP_GELU: return gelu_ps(x);
        case GGML_PY_OP_RELU: return _mm256_and_ps(x, _mm256_cmp_ps(x, _mm256_setzero_ps(), _CMP_GT_OQ));
        case GGML_PY_OP_TANH: return tanh_ps(x);
        case GGML_PY_OP_SIGMOID: return sigmoid_ps(x);
        case GGML_PY_OP_CLAMP: return _mm256_min_ps(_mm256_set1_ps(p[1]), _mm256_max_ps(_mm256_set1_ps(p[0]), x));
        default: return x;
    }
}
#endif

template <int OP>
static void un_row(float* d, const float* s, int64_t n, const float* p) {
    int64_t i = 0;
#if GP_AVX2
    if (OP != GGML_PY_OP_LOG) {
        for (; i + 8 <= n; i += 8) _mm256_storeu_ps(d + i, un_v<OP>(_mm256_loadu_ps(s + i), p));
    }
#endif
    for (; i < n; ++i) d[i] = un_f<OP>(s[i], p);
}

template <int OP>
static void unary_impl(Node& n, int ith, int nth) {
    const Tensor& d = n.dst;
    const Tensor& a = n.src[0];
    const int64_t nr = nrows(d), ne0 = d.ne[0];
    int64_t r0, r1;
    if (!my_rows(nr, ne0, ith, nth, &r0, &r1, OP == GGML_PY_OP_EXP || OP == GGML_PY_OP_SILU || OP == GGML_PY_OP_GELU ? 1024 : 4096)) return;
    // SCALE (s, b) and CLAMP (min, max) read their two float params as p[0], p[1]
    static_assert(GGML_PY_P_SCALE_S == 0 && GGML_PY_P_SCALE_B == 1 && GGML_PY_P_CLAMP_MIN == 0 &&
                  GGML_PY_P_CLAMP_MAX == 1, "SCALE/CLAMP param slots");
    const float* p = n.params.f;
    const bool contig = d.nb[0] == 4 && a.nb[0] == 4;
    for (int64_t r = r0; r < r1; ++r) {
        const int64_t i1 = r % d.ne[1], i2 = (r / d.ne[1]) % d.ne[2], i3 = r / (d.ne[1] * d.ne[2]);
        float* dp = (float*)row_ptr(d, i1, i2, i3);
        const float* ap = (const float*)row_ptr(a, i1, i2, i3);
        if (contig) {
            un_row<OP>(dp, ap, ne0, p);
        } else {
            for (int64_t i = 0; i < ne0; ++i) {
                const float x = *(const float*)((const uint8_t*)ap + i * a.nb[0]);
                *(float*)((uint8_t*)dp + i * d.nb[0]) = un_f<OP>(x, p);
            }
        }
    }
}

void k_unary(Node& n, int phase, int ith, int nth, const ExecCtx& ctx) {
    (void)phase;
    (void)ctx;
    switch (n.op) {
        case GGML_PY_OP_SCALE: unary_impl<GGML_PY_OP_SCALE>(n, ith, nth); break;
        case GGML_PY_OP_SQR: unary_impl<GGML_PY_OP_SQR>(n, ith, nth); break;
        case GGML_PY_OP_SQRT: unary_impl<GGML_PY_OP_SQRT>(n, ith, nth); break;
        case GGML_PY_OP_NEG: unary_impl<GGML_PY_OP_NEG>(n, ith, nth); break;
        case GGML_PY_OP_ABS: unary_impl<GGML_PY_OP_ABS>(n, ith, nth); break;
        case GGML_PY_OP_EXP: unary_impl<GGML_PY_OP_EXP>(n, ith, nth); break;
        case GGML_PY_OP_LOG: unary_impl<GGML_PY_OP_LOG>(n, ith, nth); break;
        case GGML_PY_OP_SILU: unary_impl<GGML_PY_OP_SILU>(n, ith, nth); break;
        case GGML_PY_OP_GELU: unary_impl<GGML_PY_OP_GELU>(n, ith, nth); break;
        case GGML_PY_OP_RELU: unary_impl<GGML_PY_OP_RELU>(n, ith, nth); break;
        case GGML_PY_OP_TANH: unary_impl<GGML_PY_OP_TANH>(n, ith, nth); break;
        case GGML_PY_OP_SIGMOID: unary_impl<GGML_PY_OP_SIGMOID>(n, ith, nth); break;
        case GGML_PY_OP_CLAMP: unary_impl<GGML_PY_OP_CLAMP>(n, ith, nth); break;
        default: break;
    }
}

// ---------------------------------------------------------------------------------------------------------------
// GLU: dst = act(gate) * value; gate/value from src0 halves (first half gates) or src0/src1.

template <int OP>
static void glu_row(float* d, const float* g, const float* v, int64_t n) {
    int64_t i = 0;
#if GP_AVX2
    for (; i + 8 <= n; i += 8) {
        __m256 x = _mm256_loadu_ps(g + i);
        __m256 a = OP == GGML_PY_OP_SWIGLU ? silu_ps(x) : gelu_ps(x);
        _mm256_storeu_ps(d + i, _mm256_mul_ps(a, _mm256_loadu_ps(v + i)));
    }
#endif
    for (; i < n; ++i) d[i] = (OP == GGML_PY_OP_SWIGLU ? silu_f(g[i]) : gelu_f(g[i])) * v[i];
}

template <int OP>
static void glu_impl(Node& n, int ith, int nth) {
    const Tensor& d = n.dst;
    const Tensor& a = n.src[0];
    const bool two = n.has[1];
    const Tensor& b = two ? n.src[1] : n.src[0];
    const int64_t nr = nrows(d), nc = d.ne[0];
    int64_t r0, r1;
    if (!my_rows(nr, nc, ith, nth, &r0, &r1, 1024)) return;
    const bool contig = d.nb[0] == 4 && a.nb[0] == 4 && b.nb[0] == 4;
    for (int64_t r = r0; r < r1; ++r) {
        const int64_t i1 = r % d.ne[1], i2 = (r / d.ne[1]) % d.ne[2], i3 = r / (d.ne[1] * d.ne[2]);
        float* dp = (float*)row_ptr(d, i1, i2, i3);
        const uint8_t* gp = row_ptr(a, i1, i2, i3);
        const uint8_t* vp = two ? row_ptr(b, i1, i2, i3) : gp + nc * a.nb[0];
        if (contig) {
            glu_row<OP>(dp, (const float*)gp, (const float*)vp, nc);
        } else {
            const int64_t gs = a.nb[0], vs = b.nb[0];
            for (int64_t i = 0; i < nc; ++i) {
                const float g = *(const float*)(gp + i * gs);
                const float v = *(const float*)(vp + i * vs);
                *(float*)((uint8_t*)dp + i * d.nb[0]) = (OP == GGML_PY_OP_SWIGLU ? silu_f(g) : gelu_f(g)) * v;
            }
        }
    }
}

void k_glu(Node& n, int phase, int ith, int nth, const ExecCtx& ctx) {
    (void)phase;
    (void)ctx;
    if (n.op == GGML_PY_OP_SWIGLU) glu_impl<GGML_PY_OP_SWIGLU>(n, ith, nth);
    else glu_impl<GGML_PY_OP_GEGLU>(n, ith, nth);
}

}  // namespace GP_NS
}  // namespace gp
