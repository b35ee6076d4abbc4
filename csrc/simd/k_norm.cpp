// Row kernels: NORM, RMS_NORM, SUM_ROWS, MEAN, ARGMAX, TOP_K, SOFT_MAX, DIAG_MASK_INF.
#include <algorithm>

#include "isa.h"

namespace gp {
namespace GP_NS {

GP_INLINE uint8_t* rowp(const Tensor& t, int64_t r) {
    const int64_t i1 = r % t.ne[1], i2 = (r / t.ne[1]) % t.ne[2], i3 = r / (t.ne[1] * t.ne[2]);
    return t.data + i1 * t.nb[1] + i2 * t.nb[2] + i3 * t.nb[3];
}

// load a row into contiguous floats if it is strided (tmp has room for n floats)
GP_INLINE const float* row_in(const uint8_t* p, int64_t stride, int64_t n, float* tmp) {
    if (stride == 4) return (const float*)p;
    for (int64_t i = 0; i < n; ++i) tmp[i] = *(const float*)(p + i * stride);
    return tmp;
}
GP_INLINE void row_out(uint8_t* p, int64_t stride, const float* v, int64_t n) {
    if (stride == 4) {
        if ((const void*)p != (const void*)v) memmove(p, v, (size_t)n * 4);
        return;
    }
    for (int64_t i = 0; i < n; ++i) *(float*)(p + i * stride) = v[i];
}

static double sum_f(const float* x, int64_t n) {
    int64_t i = 0;
    double s = 0.0;
#if GP_AVX2
    __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps();
    for (; i + 16 <= n; i += 16) {
        a0 = _mm256_add_ps(a0, _mm256_loadu_ps(x + i));
        a1 = _mm256_add_ps(a1, _mm256_loadu_ps(x + i + 8));
    }
    for (; i + 8 <= n; i += 8) a0 = _mm256_add_ps(a0, _mm256_loadu_ps(x + i));
    float l[8];
    _mm256_storeu_ps(l, _mm256_add_ps(a0, a1));
    for (int j = 0; j < 8; ++j) s += l[j];
#endif
    for (; i < n; ++i) s += x[i];
    return s;
}

static double sumsq_f(const float* x, int64_t n, float shift) {
    int64_t i = 0;
    double s = 0.0;
#if GP_AVX2
    const __m256 vs = _mm256_set1_ps(shift);
    __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps();
    for (; i + 16 <= n; i += 16) {
        __m256 v0 = _mm256_sub_ps(_mm256_loadu_ps(x + i), vs);
        __m256 v1 = _mm256_sub_ps(_mm256_loadu_ps(x + i + 8), vs);
        a0 = _mm256_fmadd_ps(v0, v0, a0);
        a1 = _mm256_fmadd_ps(v1, v1, a1);
    }
    for (; i + 8 <= n; i += 8) {
        __m256 v0 = _mm256_sub_ps(_mm256_loadu_ps(x + i), vs);
        a0 = _mm256_fmadd_ps(v0, v0, a0);
    }
    float l[8];
    _mm256_storeu_ps(l, _mm256_add_ps(a0, a1));
    for (int j = 0; j < 8; ++j) s += l[j];
#endif
    for (; i < n; ++i) {
        const double v = (double)x[i] - shift;
        s += v * v;
    }
    return s;
}

static void scale_shift_row(float* d, const float* x, int64_t n, float shift, float scale) {
    int64_t i = 0;
#if GP_AVX2
    const __m256 vs = _mm256_set1_ps(shift), vk = _mm256_set1_ps(scale);
    for (; i + 8 <= n; i += 8) _mm256_storeu_ps(d + i, _mm256_mul_ps(_mm256_sub_ps(_mm256_loadu_ps(x + i), vs), vk));
#endif
    for (; i < n; ++i) d[i] = (x[i] - shift) * scale;
}

static void norm_impl(Node& n, int ith, int nth, const ExecCtx& ctx, bool rms) {
    const Tensor& d = n.dst;
    const Tensor& a = n.src[0];
    const int64_t nr = nrows(d), ne0 = d.ne[0];
    int64_t r0, r1;
    if (!my_rows(nr, ne0, ith, nth, &r0, &r1)) return;
    static_assert(GGML_PY_P_NORM_EPS == GGML_PY_P_RMS_NORM_EPS, "one eps slot for both norms");
    const double eps = n.params.f[GGML_PY_P_NORM_EPS];
    float* tmp = (float*)ctx.thread_scratch(ith);
    for (int64_t r = r0; r < r1; ++r) {
        const float* x = row_in(rowp(a, r), a.nb[0], ne0, tmp);
        float mean = 0.0f;
        if (!rms) mean = (float)(sum_f(x, ne0) / (double)ne0);
        const double var = sumsq_f(x, ne0, mean) / (double)ne0;
        const float scale = (float)(1.0 / sqrt(var + eps));
        uint8_t* dp = rowp(d, r);
        if (d.nb[0] == 4) {
            scale_shift_row((float*)dp, x, ne0, mean, scale);
        } else {
            for (int64_t i = 0; i < ne0; ++i) *(float*)(dp + i * d.nb[0]) = (x[i] - mean) * scale;
        }
    }
}

void k_norm(Node& n, int phase, int ith, int nth, const ExecCtx& ctx) {
    (void)phase;
    norm_impl(n, ith, nth, ctx, false);
}
void k_rms_norm(Node& n, int phase, int ith, int nth, const ExecCtx& ctx) {
    (void)phase;
    norm_impl(n, ith, nth, ctx, true);
}

void k_sum_rows(Node& n, int phase, int ith, int nth, const ExecCtx& ctx) {
    (void)phase;
    const Tensor& d = n.dst;
    const Tensor& a = n.src[0];
    const int64_t nr = nrows(a), ne0 = a.ne[0];
    int64_t r0, r1;
    if (!my_rows(nr, ne0, ith, nth, &r0, &r1)) return;
    float* tmp = (float*)ctx.thread_scratch(ith);
    for (int64_t r = r0; r < r1; ++r) {
        const float* x = row_in(rowp(a, r), a.nb[0], ne0, tmp);
        double s = sum_f(x, ne0);
        if (n.op == GGML_PY_OP_MEAN) s /= (double)ne0;
        *(float*)rowp(d, r) = (float)s;
    }
}

// first index of the maximum; a NaN counts as the maximum (as numpy.argmax)
static int64_t argmax_row(const float* x, int64_t n) {
    int64_t i = 0;
#if GP_AVX2
    if (n >= 16) {
        __m256 m = _mm256_loadu_ps(x);
        __m256 nan = _mm256_cmp_ps(m, m, _CMP_UNORD_Q);
        for (i = 8; i + 8 <= n; i += 8) {
            __m256 v = _mm256_loadu_ps(x + i);
            m = _mm256_max_ps(m, v);
            nan = _mm256_or_ps(nan, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
        }
        float mv = hmax(m);
        bool has_nan = _mm256_movemask_ps(nan) != 0;
        for (int64_t j = i; j < n; ++j) {
            has_nan |= x[j] != x[j];
            mv = x[j] > mv ? x[j] : mv;
        }
        if (!has_nan) {
            const __m256 vm = _mm256_set1_ps(mv);
            int64_t j = 0;
            for (; j + 8 <= n; j += 8) {
                int mask = _mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(x + j), vm, _CMP_EQ_OQ));
                if (mask) return j + __builtin_ctz((unsigned)mask);
            }
            for (; j < n; ++j)
                if (x[j] == mv) return j;
            return 0;
        }
        i = 0;
    }
#endif
    int64_t best = 0;
    float bv = x[0];
    for (i = 1; i < n; ++i) {
        if (bv != bv) break;
        if (x[i] > bv || x[i] != x[i]) { bv = x[i]; best = i; }
    }
    return best;
}

void k_argmax(Node& n, int phase, int ith, int nth, const ExecCtx& ctx) {
    (void)phase;
    const Tensor& d = n.dst;
    const Tensor& a = n.src[0];
    const int64_t nr = nrows(a), ne0 = a.ne[0];
    int64_t r0, r1;
    if (!my_rows(nr, ne0, ith, nth, &r0, &r1)) return;
    int32_t* out = (int32_t*)d.data;
    float* tmp = (float*)ctx.thread_scratch(ith);
    for (int64_t r = r0; r < r1; ++r) {
        const float* x = row_in(rowp(a, r), a.nb[0], ne0, tmp);
        out[r] = (int32_t)argmax_row(x, ne0);
    }
}

// ---------------------------------------------------------------------------------------------------------------
// TOP_K: indices of the k largest of each row, largest first; the lower index first on ties; NaN above everything
// (as ARGMAX: a sampler reading the candidates sees a NaN row). One thread per row: values that may still make the
// top go to an unsorted buffer (4k entries, at least 256); when it is full, nth_element keeps the best k and the k-th of them
// sets the bar. Since indices only grow, what passes the bar is a NaN or strictly larger than the k-th kept value
// (nothing, once all k kept values are NaN). On a vocabulary of logits the bar rises fast: a few hundred values
// ever reach the buffer, and the scan is one vector compare per 8.

struct TopEntry {
    float v;
    int32_t i;
};

// a ranks before b
GP_INLINE bool top_before(const TopEntry& a, const TopEntry& b) {
    if (a.v != a.v) return b.v == b.v || a.i < b.i;  // NaN: before any number, and before a later NaN
    if (b.v != b.v) return false;
    return a.v > b.v || (a.v == b.v && a.i < b.i);
}

// TOP_K's buffer of candidates: 4k entries, at least 256 (a small k would raise the bar too often)
GP_INLINE int64_t top_buffer(int64_t k) { return k < 64 ? 256 : 4 * k; }

// the top min(k, n) of x[0..n), sorted, into out (int32 indices); buf: top_buffer(k) entries
static void top_row(const float* x, int64_t n, int64_t k, TopEntry* buf, int32_t* out) {
    const int64_t cap = top_buffer(k);
    int64_t cnt = 0, j = 0;
    bool have_bar = false;
    float bar = 0.0f;
    auto compact = [&] {
        std::nth_element(buf, buf + (k - 1), buf + cnt, top_before);
        cnt = k;
        bar = buf[k - 1].v;
        have_bar = true;
    };
    while (j < n) {
        if (!have_bar) {  // the buffer is not full yet: take everything
            const int64_t take = imin(n - j, cap - cnt);
            for (int64_t t = 0; t < take; ++t) buf[cnt + t] = {x[j + t], (int32_t)(j + t)};
            cnt += take;
            j += take;
            if (cnt == cap) compact();
            continue;
        }
        if (bar != bar) break;
#if GP_AVX2
        const __m256 vb = _mm256_set1_ps(bar);
        bool full = false;
        for (; j + 8 <= n && !full; j += 8) {
            unsigned m = (unsigned)_mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(x + j), vb, _CMP_NLE_UQ));
            while (m) {
                const int t = __builtin_ctz(m);
                m &= m - 1;
                buf[cnt++] = {x[j + t], (int32_t)(j + t)};
            }
            full = cnt > cap - 8;
        }
        if (full) {  // raise the bar and go on
            compact();
            continue;
        }
#endif
        for (; j < n && cnt < cap; ++j)
            if (!(x[j] <= bar)) buf[cnt++] = {x[j], (int32_t)j};
        if (cnt == cap) compact();
    }
    const int64_t m = imin(k, cnt);
    std::partial_sort(buf, buf + m, buf + cnt, top_before);
    for (int64_t t = 0; t < m; ++t) out[t] = buf[t].i;
}

void k_top_k(Node& n, int phase, int ith, int nth, const ExecCtx& ctx) {
    (void)phase;
    const Tensor& d = n.dst;
    const Tensor& a = n.src[0];
    const int64_t nr = nrows(a), ne0 = a.ne[0], k = d.ne[0];
    int64_t r0, r1;
    if (!my_rows(nr, ne0, ith, nth, &r0, &r1, 1 << 20)) return;  // a row's scan is fast: rows are the unit
    float* tmp = (float*)ctx.thread_scratch(ith);
    TopEntry* buf = (TopEntry*)(tmp + ((ne0 + 15) & ~(int64_t)15));
    for (int64_t r = r0; r < r1; ++r) {
        const float* x = row_in(rowp(a, r), a.nb[0], ne0, tmp);
        top_row(x, ne0, k, buf, (int32_t*)d.data + r * k);  // dst is contiguous (validated)
    }
}

// ---------------------------------------------------------------------------------------------------------------
// SOFT_MAX: softmax(x*scale + slope*mask) per row. params scale, max_bias.

static float max_row(const float* x, int64_t n) {
    int64_t i = 0;
    float m = -INFINITY;
#if GP_AVX2
    if (n >= 8) {
        __m256 v = _mm256_set1_ps(-INFINITY);
        for (; i + 8 <= n; i += 8) v = _mm256_max_ps(v, _mm256_loadu_ps(x + i));
        m = hmax(v);
    }
#endif
    for (; i < n; ++i) m = x[i] > m ? x[i] : m;
    return m;
}

// y = exp(x - m) in place, returns the sum
static double exp_sum_row(float* x, int64_t n, float m) {
    int64_t i = 0;
    double s = 0.0;
#if GP_AVX2
    const __m256 vm = _mm256_set1_ps(m);
    __m256 acc = _mm256_setzero_ps();
    for (; i + 8 <= n; i += 8) {
        __m256 e = exp_ps(_mm256_sub_ps(_mm256_loadu_ps(x + i), vm));
        _mm256_storeu_ps(x + i, e);
        acc = _mm256_add_ps(acc, e);
    }
    float l[8];
    _mm256_storeu_ps(l, acc);
    for (int j = 0; j < 8; ++j) s += l[j];
#endif
    for (; i < n; ++i) {
        const float e = expf(x[i] - m);
        x[i] = e;
        s += e;
    }
    return s;
}

static void scale_row(float* x, int64_t n, float k) {
    int64_t i = 0;
#if GP_AVX2
    const __m256 vk = _mm256_set1_ps(k);
    for (; i + 8 <= n; i += 8) _mm256_storeu_ps(x + i, _mm256_mul_ps(_mm256_loadu_ps(x + i), vk));
#endif
    for (; i < n; ++i) x[i] *= k;
}

GP_INLINE float alibi_slope(float max_bias, int64_t h, int64_t n_head) {
    if (max_bias <= 0.0f) return 1.0f;
    const uint32_t n_log2 = 1u << (uint32_t)floor(log2((double)n_head));
    const float m0 = powf(2.0f, -max_bias / (float)n_log2);
    const float m1 = powf(2.0f, -(max_bias / 2.0f) / (float)n_log2);
    return (uint32_t)h < n_log2 ? powf(m0, (float)(h + 1)) : powf(m1, (float)(2 * (h - n_log2) + 1));
}

void k_soft_max(Node& n, int phase, int ith, int nth, const ExecCtx& ctx) {
    (void)phase;
    const Tensor& d = n.dst;
    const Tensor& a = n.src[0];
    const bool has_mask = n.has[1];
    const Tensor& mk = n.src[1];
    const int64_t nr = nrows(a), ne0 = a.ne[0];
    int64_t r0, r1;
    if (!my_rows(nr, ne0, ith, nth, &r0, &r1, 2048)) return;
    const float scale = n.params.f[GGML_PY_P_SOFT_MAX_SCALE];
    const float max_bias = n.params.f[GGML_PY_P_SOFT_MAX_MAX_BIAS];
    float* tmp = (float*)ctx.thread_scratch(ith);
    for (int64_t r = r0; r < r1; ++r) {
        const int64_t i1 = r % a.ne[1], i2 = (r / a.ne[1]) % a.ne[2], i3 = r / (a.ne[1] * a.ne[2]);
        const uint8_t* sp = a.data + i1 * a.nb[1] + i2 * a.nb[2] + i3 * a.nb[3];
        uint8_t* dp = d.data + i1 * d.nb[1] + i2 * d.nb[2] + i3 * d.nb[3];
        float* w = d.nb[0] == 4 ? (float*)dp : tmp;
        const float slope = alibi_slope(max_bias, i2, a.ne[2]);
        // w = x * scale (+ slope * mask)
        if (a.nb[0] == 4) {
            const float* x = (const float*)sp;
            int64_t i = 0;
#if GP_AVX2
            const __m256 vs = _mm256_set1_ps(scale);
            for (; i + 8 <= ne0; i += 8) _mm256_storeu_ps(w + i, _mm256_mul_ps(_mm256_loadu_ps(x + i), vs));
#endif
            for (; i < ne0; ++i) w[i] = x[i] * scale;
        } else {
            for (int64_t i = 0; i < ne0; ++i) w[i] = *(const float*)(sp + i * a.nb[0]) * scale;
        }
        if (has_mask) {
            const uint8_t* mp = mk.data + i1 * mk.nb[1] + (i2 % mk.ne[2]) * mk.nb[2] + (i3 % mk.ne[3]) * mk.nb[3];
            if (mk.type == T_F16) {
                const uint16_t* m16 = (const uint16_t*)mp;
                (void)m16;
                int64_t i = 0;
#if GP_AVX2
                if (mk.nb[0] == 2) {
                    const __m256 vsl = _mm256_set1_ps(slope);
                    for (; i + 8 <= ne0; i += 8)
                        _mm256_storeu_ps(w + i, _mm256_add_ps(_mm256_loadu_ps(w + i),
                                                              _mm256_mul_ps(vsl, load_f16x8(m16 + i))));
                }
#endif
                for (; i < ne0; ++i) w[i] += slope * fp16_to_fp32(*(const uint16_t*)(mp + i * mk.nb[0]));
            } else {
                int64_t i = 0;
#if GP_AVX2
                if (mk.nb[0] == 4) {
                    const float* m32 = (const float*)mp;
                    const __m256 vsl = _mm256_set1_ps(slope);
                    for (; i + 8 <= ne0; i += 8)
                        _mm256_storeu_ps(w + i, _mm256_add_ps(_mm256_loadu_ps(w + i),
                                                              _mm256_mul_ps(vsl, _mm256_loadu_ps(m32 + i))));
                }
#endif
                for (; i < ne0; ++i) w[i] += slope * *(const float*)(mp + i * mk.nb[0]);
            }
        }
        const float mx = max_row(w, ne0);
        const double s = exp_sum_row(w, ne0, mx);
        scale_row(w, ne0, (float)(1.0 / s));
        if (w == tmp) row_out(dp, d.nb[0], w, ne0);
    }
}

void k_diag_mask_inf(Node& n, int phase, int ith, int nth, const ExecCtx& ctx) {
    (void)phase;
    (void)ctx;
    const Tensor& d = n.dst;
    const Tensor& a = n.src[0];
    const int64_t nr = nrows(a), ne0 = a.ne[0];
    int64_t r0, r1;
    if (!my_rows(nr, ne0, ith, nth, &r0, &r1)) return;
    const int64_t n_past = n.params.i[GGML_PY_P_DIAG_MASK_INF_N_PAST];
    for (int64_t r = r0; r < r1; ++r) {
        const int64_t i1 = r % a.ne[1];
        const uint8_t* sp = rowp(a, r);
        uint8_t* dp = rowp(d, r);
        for (int64_t i = 0; i < ne0; ++i) {
            const float v = *(const float*)(sp + i * a.nb[0]);
            *(float*)(dp + i * d.nb[0]) = i > n_past + i1 ? -INFINITY : v;
        }
    }
}

}  // namespace GP_NS
}  // namespace gp
