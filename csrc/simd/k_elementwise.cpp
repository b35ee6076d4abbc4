// Elementwise kernels: the binary family with ggml's tiling broadcast, the unary family with SCALE and CLAMP, and the
// GLU family. Each op's math is a specialisation of BinaryOp / UnaryOp / GluOp below; the dispatchers instantiate
// the kernels for every op of the schema's lists (GGML_PY_OPS_BINARY, _UNARY, _GLU in the ABI header), so an op of a
// family without its specialisation here is a compile error that names it.
#include <type_traits>

#include "isa.h"

namespace gp {
namespace GP_NS {

// row r of a tensor (r counts rows over dims 1..3)
GP_INLINE uint8_t* row_ptr(const Tensor& t, int64_t i1, int64_t i2, int64_t i3) {
    return t.data + i1 * t.nb[1] + i2 * t.nb[2] + i3 * t.nb[3];
}

// The math of one op: `f` on one float and, at avx2 and up, `v` on 8 (optional for the unary family: LOG has none).
// `defined` is what the dispatchers' static_asserts read; an op without a specialisation gets the primary template.
template <int OP> struct BinaryOp { static constexpr bool defined = false; };
template <int OP> struct UnaryOp { static constexpr bool defined = false; };
template <int OP> struct GluOp { static constexpr bool defined = false; };

#define GP_OPFN static GP_TINLINE

// ---------------------------------------------------------------------------------------------------------------
// binary

template <> struct BinaryOp<GGML_PY_OP_ADD> {
    static constexpr bool defined = true;
    GP_OPFN float f(float a, float b) { return a + b; }
#if GP_AVX2
    GP_OPFN __m256 v(__m256 a, __m256 b) { return _mm256_add_ps(a, b); }
#endif
};
template <> struct BinaryOp<GGML_PY_OP_SUB> {
    static constexpr bool defined = true;
    GP_OPFN float f(float a, float b) { return a - b; }
#if GP_AVX2
    GP_OPFN __m256 v(__m256 a, __m256 b) { return _mm256_sub_ps(a, b); }
#endif
};
template <> struct BinaryOp<GGML_PY_OP_MUL> {
    static constexpr bool defined = true;
    GP_OPFN float f(float a, float b) { return a * b; }
#if GP_AVX2
    GP_OPFN __m256 v(__m256 a, __m256 b) { return _mm256_mul_ps(a, b); }
#endif
};
template <> struct BinaryOp<GGML_PY_OP_DIV> {
    static constexpr bool defined = true;
    GP_OPFN float f(float a, float b) { return a / b; }
#if GP_AVX2
    GP_OPFN __m256 v(__m256 a, __m256 b) { return _mm256_div_ps(a, b); }
#endif
};

template <class Op>
static void bin_row(float* d, const float* a, const float* b, int64_t n) {
    int64_t i = 0;
#if GP_AVX2
    for (; i + 8 <= n; i += 8) _mm256_storeu_ps(d + i, Op::v(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i)));
#endif
    for (; i < n; ++i) d[i] = Op::f(a[i], b[i]);
}
template <class Op>
static void bin_row_scalar_b(float* d, const float* a, float b, int64_t n) {
    int64_t i = 0;
#if GP_AVX2
    const __m256 vb = _mm256_set1_ps(b);
    for (; i + 8 <= n; i += 8) _mm256_storeu_ps(d + i, Op::v(_mm256_loadu_ps(a + i), vb));
#endif
    for (; i < n; ++i) d[i] = Op::f(a[i], b);
}

template <class Op>
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
                bin_row<Op>(dp, ap, bp, ne0);
            } else if (nb0 == 1) {
                bin_row_scalar_b<Op>(dp, ap, bp[0], ne0);
            } else {
                for (int64_t j = 0; j < ne0; j += nb0) bin_row<Op>(dp + j, ap + j, bp, nb0);
            }
        } else {
            for (int64_t i = 0; i < ne0; ++i) {
                const float x = *(const float*)((const uint8_t*)ap + i * a.nb[0]);
                const float y = *(const float*)((const uint8_t*)bp + (i % b.ne[0]) * b.nb[0]);
                *(float*)((uint8_t*)dp + i * d.nb[0]) = Op::f(x, y);
            }
        }
    }
}

void k_binary(Node& n, int phase, int ith, int nth, const ExecCtx& ctx) {
    (void)phase;
    (void)ctx;
    switch (n.op) {
#define GP_BINARY(NAME)                                                                                             \
    case GGML_PY_OP_##NAME:                                                                                         \
        static_assert(BinaryOp<GGML_PY_OP_##NAME>::defined,                                                         \
                      #NAME " (binary family): no math for it in k_elementwise.cpp, specialise BinaryOp<GGML_PY_OP_" \
                      #NAME ">");                                                                                   \
        binary_impl<BinaryOp<GGML_PY_OP_##NAME>>(n, ith, nth);                                                      \
        return;
        GGML_PY_OPS_BINARY(GP_BINARY)
#undef GP_BINARY
        default: no_kernel_case("k_binary", n.op);
    }
}

// ---------------------------------------------------------------------------------------------------------------
// unary: the unary family, SCALE (p = s, b) and CLAMP (p = min, max)

static_assert(GGML_PY_P_SCALE_S == 0 && GGML_PY_P_SCALE_B == 1 && GGML_PY_P_CLAMP_MIN == 0 &&
              GGML_PY_P_CLAMP_MAX == 1, "SCALE/CLAMP param slots");

template <> struct UnaryOp<GGML_PY_OP_SCALE> {
    static constexpr bool defined = true;
    GP_OPFN float f(float x, const float* p) { return x * p[0] + p[1]; }
#if GP_AVX2
    GP_OPFN __m256 v(__m256 x, const float* p) {
        return _mm256_add_ps(_mm256_mul_ps(x, _mm256_set1_ps(p[0])), _mm256_set1_ps(p[1]));
    }
#endif
};
template <> struct UnaryOp<GGML_PY_OP_SQR> {
    static constexpr bool defined = true;
    GP_OPFN float f(float x, const float*) { return x * x; }
#if GP_AVX2
    GP_OPFN __m256 v(__m256 x, const float*) { return _mm256_mul_ps(x, x); }
#endif
};
template <> struct UnaryOp<GGML_PY_OP_SQRT> {
    static constexpr bool defined = true;
    GP_OPFN float f(float x, const float*) { return sqrtf(x); }
#if GP_AVX2
    GP_OPFN __m256 v(__m256 x, const float*) { return _mm256_sqrt_ps(x); }
#endif
};
template <> struct UnaryOp<GGML_PY_OP_NEG> {
    static constexpr bool defined = true;
    GP_OPFN float f(float x, const float*) { return -x; }
#if GP_AVX2
    GP_OPFN __m256 v(__m256 x, const float*) { return _mm256_xor_ps(x, _mm256_set1_ps(-0.0f)); }
#endif
};
template <> struct UnaryOp<GGML_PY_OP_ABS> {
    static constexpr bool defined = true;
    GP_OPFN float f(float x, const float*) { return fabsf(x); }
#if GP_AVX2
    GP_OPFN __m256 v(__m256 x, const float*) { return _mm256_andnot_ps(_mm256_set1_ps(-0.0f), x); }
#endif
};
template <> struct UnaryOp<GGML_PY_OP_EXP> {
    static constexpr bool defined = true;
    GP_OPFN float f(float x, const float*) { return expf(x); }
#if GP_AVX2
    GP_OPFN __m256 v(__m256 x, const float*) { return exp_ps(x); }
#endif
};
template <> struct UnaryOp<GGML_PY_OP_LOG> {  // no vector form: logf per element at every level
    static constexpr bool defined = true;
    GP_OPFN float f(float x, const float*) { return logf(x); }
};
template <> struct UnaryOp<GGML_PY_OP_SILU> {
    static constexpr bool defined = true;
    GP_OPFN float f(float x, const float*) { return silu_f(x); }
#if GP_AVX2
    GP_OPFN __m256 v(__m256 x, const float*) { return silu_ps(x); }
#endif
};
template <> struct UnaryOp<GGML_PY_OP_GELU> {
    static constexpr bool defined = true;
    GP_OPFN float f(float x, const float*) { return gelu_f(x); }
#if GP_AVX2
    GP_OPFN __m256 v(__m256 x, const float*) { return gelu_ps(x); }
#endif
};
template <> struct UnaryOp<GGML_PY_OP_RELU> {
    static constexpr bool defined = true;
    GP_OPFN float f(float x, const float*) { return x > 0.0f ? x : 0.0f; }
#if GP_AVX2
    GP_OPFN __m256 v(__m256 x, const float*) {
        return _mm256_and_ps(x, _mm256_cmp_ps(x, _mm256_setzero_ps(), _CMP_GT_OQ));
    }
#endif
};
template <> struct UnaryOp<GGML_PY_OP_TANH> {
    static constexpr bool defined = true;
    GP_OPFN float f(float x, const float*) { return tanhf(x); }
#if GP_AVX2
    GP_OPFN __m256 v(__m256 x, const float*) { return tanh_ps(x); }
#endif
};
template <> struct UnaryOp<GGML_PY_OP_SIGMOID> {
    static constexpr bool defined = true;
    GP_OPFN float f(float x, const float*) { return sigmoid_f(x); }
#if GP_AVX2
    GP_OPFN __m256 v(__m256 x, const float*) { return sigmoid_ps(x); }
#endif
};
#if GP_AVX2
// erfc(z) in 8 lanes: for a = |z|, erfc(a) = t * exp(-a^2 + P(t)) with t = 1 / (1 + a/2) and P of degree 9, least
// squares fitted (5e-8 in double) on a in [0, 10], beyond which float erfc is 0; erfc(-a) = 2 - erfc(a). NaN stays NaN.
// What limits it is the float rounding of the exponent -a^2 + P(t): GELU_ERF's relative error measured 5e-7 for
// x in [-2, 2], 2e-6 down to -4, 6e-6 down to -8 (values < 1e-15), more only among float denormals.
GP_INLINE __m256 erfc_ps(__m256 z) {
    const __m256 one = _mm256_set1_ps(1.0f);
    const __m256 a = _mm256_andnot_ps(_mm256_set1_ps(-0.0f), z);
    const __m256 t = _mm256_div_ps(one, _mm256_fmadd_ps(_mm256_set1_ps(0.5f), a, one));
    __m256 p = _mm256_set1_ps(1.449302137e-01f);
    p = _mm256_fmadd_ps(p, t, _mm256_set1_ps(-6.808272004e-01f));
    p = _mm256_fmadd_ps(p, t, _mm256_set1_ps(1.156733751e+00f));
    p = _mm256_fmadd_ps(p, t, _mm256_set1_ps(-6.962519288e-01f));
    p = _mm256_fmadd_ps(p, t, _mm256_set1_ps(-8.028043061e-02f));
    p = _mm256_fmadd_ps(p, t, _mm256_set1_ps(1.267585438e-03f));
    p = _mm256_fmadd_ps(p, t, _mm256_set1_ps(3.460279852e-02f));
    p = _mm256_fmadd_ps(p, t, _mm256_set1_ps(3.866403997e-01f));
    p = _mm256_fmadd_ps(p, t, _mm256_set1_ps(9.986327887e-01f));
    p = _mm256_fmadd_ps(p, t, _mm256_set1_ps(-1.265447974e+00f));
    const __m256 r = _mm256_mul_ps(t, exp_ps(_mm256_fnmadd_ps(a, a, p)));  // t * exp(p - a^2)
    const __m256 neg = _mm256_cmp_ps(z, _mm256_setzero_ps(), _CMP_LT_OQ);
    return _mm256_blendv_ps(r, _mm256_sub_ps(_mm256_set1_ps(2.0f), r), neg);
}
#endif
// exact GELU as 0.5 x erfc(-x / sqrt(2)) (= 0.5 x (1 + erf(x / sqrt(2))), without the cancellation for x < 0)
template <> struct UnaryOp<GGML_PY_OP_GELU_ERF> {
    static constexpr bool defined = true;
    GP_OPFN float f(float x, const float*) { return (float)(0.5 * (double)x * erfc(-(double)x * M_SQRT1_2)); }
#if GP_AVX2
    GP_OPFN __m256 v(__m256 x, const float*) {
        const __m256 z = _mm256_mul_ps(x, _mm256_set1_ps(-0.70710678118654752f));
        return _mm256_mul_ps(_mm256_mul_ps(_mm256_set1_ps(0.5f), x), erfc_ps(z));
    }
#endif
};
template <> struct UnaryOp<GGML_PY_OP_CLAMP> {
    static constexpr bool defined = true;
    GP_OPFN float f(float x, const float* p) { return x < p[0] ? p[0] : (x > p[1] ? p[1] : x); }
#if GP_AVX2
    GP_OPFN __m256 v(__m256 x, const float* p) {
        return _mm256_min_ps(_mm256_set1_ps(p[1]), _mm256_max_ps(_mm256_set1_ps(p[0]), x));
    }
#endif
};

// whether Op has a vector form
template <class Op, class = void>
struct HasVec : std::false_type {};
#if GP_AVX2
template <class Op>
struct HasVec<Op, decltype((void)Op::v(_mm256_setzero_ps(), (const float*)nullptr))> : std::true_type {};
#endif
static_assert(HasVec<UnaryOp<GGML_PY_OP_SQR>>::value == (GP_AVX2 != 0) && !HasVec<UnaryOp<GGML_PY_OP_LOG>>::value,
              "HasVec sees the vector forms");

template <class Op>
static void un_row(float* d, const float* s, int64_t n, const float* p) {
    int64_t i = 0;
#if GP_AVX2
    if constexpr (HasVec<Op>::value) {
        for (; i + 8 <= n; i += 8) _mm256_storeu_ps(d + i, Op::v(_mm256_loadu_ps(s + i), p));
    }
#endif
    for (; i < n; ++i) d[i] = Op::f(s[i], p);
}

template <int OP>
static void unary_impl(Node& n, int ith, int nth) {
    using Op = UnaryOp<OP>;
    const Tensor& d = n.dst;
    const Tensor& a = n.src[0];
    const int64_t nr = nrows(d), ne0 = d.ne[0];
    int64_t r0, r1;
    if (!my_rows(nr, ne0, ith, nth, &r0, &r1, op_is_transcendental(OP) ? 1024 : 4096)) return;
    const float* p = n.params.f;
    const bool contig = d.nb[0] == 4 && a.nb[0] == 4;
    for (int64_t r = r0; r < r1; ++r) {
        const int64_t i1 = r % d.ne[1], i2 = (r / d.ne[1]) % d.ne[2], i3 = r / (d.ne[1] * d.ne[2]);
        float* dp = (float*)row_ptr(d, i1, i2, i3);
        const float* ap = (const float*)row_ptr(a, i1, i2, i3);
        if (contig) {
            un_row<Op>(dp, ap, ne0, p);
        } else {
            for (int64_t i = 0; i < ne0; ++i) {
                const float x = *(const float*)((const uint8_t*)ap + i * a.nb[0]);
                *(float*)((uint8_t*)dp + i * d.nb[0]) = Op::f(x, p);
            }
        }
    }
}

void k_unary(Node& n, int phase, int ith, int nth, const ExecCtx& ctx) {
    (void)phase;
    (void)ctx;
    switch (n.op) {
#define GP_UNARY(NAME)                                                                                              \
    case GGML_PY_OP_##NAME:                                                                                         \
        static_assert(UnaryOp<GGML_PY_OP_##NAME>::defined,                                                          \
                      #NAME " (unary family): no math for it in k_elementwise.cpp, specialise UnaryOp<GGML_PY_OP_"   \
                      #NAME ">");                                                                                   \
        unary_impl<GGML_PY_OP_##NAME>(n, ith, nth);                                                                 \
        return;
        GGML_PY_OPS_UNARY(GP_UNARY)
        GP_UNARY(SCALE)
        GP_UNARY(CLAMP)
#undef GP_UNARY
        default: no_kernel_case("k_unary", n.op);
    }
}

// ---------------------------------------------------------------------------------------------------------------
// GLU: dst = act(gate) * value; gate/value from src0 halves (first half gates) or src0/src1.

template <> struct GluOp<GGML_PY_OP_SWIGLU> {
    static constexpr bool defined = true;
    GP_OPFN float f(float x) { return silu_f(x); }
#if GP_AVX2
    GP_OPFN __m256 v(__m256 x) { return silu_ps(x); }
#endif
};
template <> struct GluOp<GGML_PY_OP_GEGLU> {
    static constexpr bool defined = true;
    GP_OPFN float f(float x) { return gelu_f(x); }
#if GP_AVX2
    GP_OPFN __m256 v(__m256 x) { return gelu_ps(x); }
#endif
};

template <class Op>
static void glu_row(float* d, const float* g, const float* v, int64_t n) {
    int64_t i = 0;
#if GP_AVX2
    for (; i + 8 <= n; i += 8) {
        __m256 a = Op::v(_mm256_loadu_ps(g + i));
        _mm256_storeu_ps(d + i, _mm256_mul_ps(a, _mm256_loadu_ps(v + i)));
    }
#endif
    for (; i < n; ++i) d[i] = Op::f(g[i]) * v[i];
}

template <class Op>
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
            glu_row<Op>(dp, (const float*)gp, (const float*)vp, nc);
        } else {
            const int64_t gs = a.nb[0], vs = b.nb[0];
            for (int64_t i = 0; i < nc; ++i) {
                const float g = *(const float*)(gp + i * gs);
                const float v = *(const float*)(vp + i * vs);
                *(float*)((uint8_t*)dp + i * d.nb[0]) = Op::f(g) * v;
            }
        }
    }
}

void k_glu(Node& n, int phase, int ith, int nth, const ExecCtx& ctx) {
    (void)phase;
    (void)ctx;
    switch (n.op) {
#define GP_GLU(NAME)                                                                                                \
    case GGML_PY_OP_##NAME:                                                                                         \
        static_assert(GluOp<GGML_PY_OP_##NAME>::defined,                                                            \
                      #NAME " (GLU family): no activation for it in k_elementwise.cpp, specialise GluOp<GGML_PY_OP_" \
                      #NAME ">");                                                                                   \
        glu_impl<GluOp<GGML_PY_OP_##NAME>>(n, ith, nth);                                                            \
        return;
        GGML_PY_OPS_GLU(GP_GLU)
#undef GP_GLU
        default: no_kernel_case("k_glu", n.op);
    }
}

#undef GP_OPFN

}  // namespace GP_NS
}  // namespace gp
