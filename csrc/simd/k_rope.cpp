// ROPE (normal and neox), ggml layout: src/dst ne = [head_dim, n_head, n_tokens, batch], positions I32 [n_tokens],
// optional frequency factors F32 [n_dims/2] (src[2]). As ggml's rope_yarn: pair i's extrapolated angle is
// pos * freq_base^(-2i/n_dims) / factor[i], the interpolated one freq_scale times that; with ext_factor != 0 a ramp
// between YaRN's correction dims (from beta_fast, beta_slow, n_ctx_orig) mixes the two and cos, sin grow by
// 1 + 0.1 ln(1/freq_scale); attn_factor scales cos and sin. Angles are computed in double, once per token and thread.
#include "isa.h"

namespace gp {
namespace GP_NS {

void k_rope(Node& n, int phase, int ith, int nth, const ExecCtx& ctx) {
    (void)phase;
    const Tensor& d = n.dst;
    const Tensor& a = n.src[0];
    const Tensor& pos = n.src[1];
    const int64_t ne0 = a.ne[0];
    const int64_t nr = nrows(a);
    int64_t r0, r1;
    if (!my_rows(nr, ne0, ith, nth, &r0, &r1, 2048)) return;
    const int n_dims = n.params.i[GGML_PY_P_ROPE_N_DIMS];
    const bool neox = (n.params.i[GGML_PY_P_ROPE_MODE] & 2) != 0;
    const int half = n_dims / 2;
    const double base = n.params.f[GGML_PY_P_ROPE_FREQ_BASE];
    const double fscale = n.params.f[GGML_PY_P_ROPE_FREQ_SCALE];
    const double theta_scale = pow(base, -2.0 / (double)n_dims);
    const double ext = n.params.f[GGML_PY_P_ROPE_EXT_FACTOR];
    double mscale = n.params.f[GGML_PY_P_ROPE_ATTN_FACTOR];
    double low = 0.0, high = 0.0;  // YaRN's correction dims (ggml_rope_yarn_corr_dims), used when ext != 0
    if (ext != 0.0) {
        const double n_orig = (double)n.params.i[GGML_PY_P_ROPE_N_CTX_ORIG];
        const double two_pi = 6.283185307179586476925;
        auto corr_dim = [&](double beta) { return n_dims * log(n_orig / (beta * two_pi)) / (2.0 * log(base)); };
        low = fmax(0.0, floor(corr_dim(n.params.f[GGML_PY_P_ROPE_BETA_FAST])));
        high = fmin(n_dims - 1.0, ceil(corr_dim(n.params.f[GGML_PY_P_ROPE_BETA_SLOW])));
        mscale *= 1.0 + 0.1 * log(1.0 / fscale);
    }
    const Tensor* ff = n.has[2] ? &n.src[2] : nullptr;
    // cache: normal mode: cos and signed sin duplicated per pair (n_dims each); neox: cos, sin (half each)
    float* cc = (float*)ctx.thread_scratch(ith);
    float* ss = cc + n_dims;
    int64_t cached_t = -1;
    const bool contig = a.nb[0] == 4 && d.nb[0] == 4;
    for (int64_t r = r0; r < r1; ++r) {
        const int64_t i1 = r % a.ne[1], i2 = (r / a.ne[1]) % a.ne[2], i3 = r / (a.ne[1] * a.ne[2]);
        if (i2 != cached_t) {
            const double p = (double)*(const int32_t*)(pos.data + i2 * pos.nb[0]);
            double inv = 1.0;
            for (int i = 0; i < half; ++i) {
                double extrap = p * inv;
                if (ff) extrap /= (double)*(const float*)(ff->data + i * ff->nb[0]);
                double th = extrap * fscale;
                if (ext != 0.0) {
                    const double mix = (1.0 - fmin(1.0, fmax(0.0, (i - low) / fmax(0.001, high - low)))) * ext;
                    th = th * (1.0 - mix) + extrap * mix;
                }
                const float c = (float)(cos(th) * mscale), s = (float)(sin(th) * mscale);
                if (neox) {
                    cc[i] = c;
                    ss[i] = s;
                } else {
                    cc[2 * i] = c;
                    cc[2 * i + 1] = c;
                    ss[2 * i] = -s;
                    ss[2 * i + 1] = s;
                }
                inv *= theta_scale;
            }
            cached_t = i2;
        }
        const uint8_t* sp = a.data + i1 * a.nb[1] + i2 * a.nb[2] + i3 * a.nb[3];
        uint8_t* dp = d.data + i1 * d.nb[1] + i2 * d.nb[2] + i3 * d.nb[3];
        if (contig) {
            const float* x = (const float*)sp;
            float* y = (float*)dp;
            if (neox) {
                int i = 0;
#if GP_AVX2
                for (; i + 8 <= half; i += 8) {
                    __m256 x0 = _mm256_loadu_ps(x + i), x1 = _mm256_loadu_ps(x + half + i);
                    __m256 c = _mm256_loadu_ps(cc + i), s = _mm256_loadu_ps(ss + i);
                    __m256 o0 = _mm256_sub_ps(_mm256_mul_ps(x0, c), _mm256_mul_ps(x1, s));
                    __m256 o1 = _mm256_add_ps(_mm256_mul_ps(x0, s), _mm256_mul_ps(x1, c));
                    _mm256_storeu_ps(y + i, o0);
                    _mm256_storeu_ps(y + half + i, o1);
                }
#endif
                for (; i < half; ++i) {
                    const float x0 = x[i], x1 = x[half + i];
                    y[i] = x0 * cc[i] - x1 * ss[i];
                    y[half + i] = x0 * ss[i] + x1 * cc[i];
                }
            } else {
                int i = 0;
#if GP_AVX2
                for (; i + 8 <= n_dims; i += 8) {
                    __m256 v = _mm256_loadu_ps(x + i);
                    __m256 sw = _mm256_permute_ps(v, 0xb1);
                    __m256 o = _mm256_add_ps(_mm256_mul_ps(v, _mm256_loadu_ps(cc + i)),
                                             _mm256_mul_ps(sw, _mm256_loadu_ps(ss + i)));
                    _mm256_storeu_ps(y + i, o);
                }
#endif
                for (; i < n_dims; i += 2) {
                    const float x0 = x[i], x1 = x[i + 1];
                    y[i] = x0 * cc[i] + x1 * ss[i];
                    y[i + 1] = x1 * cc[i + 1] + x0 * ss[i + 1];
                }
            }
            if (y != x && n_dims < ne0) memmove(y + n_dims, x + n_dims, (size_t)(ne0 - n_dims) * 4);
        } else {
            const int64_t s0 = a.nb[0], d0 = d.nb[0];
#define XA(i) (*(const float*)(sp + (int64_t)(i) * s0))
#define YD(i) (*(float*)(dp + (int64_t)(i) * d0))
            if (neox) {
                for (int i = 0; i < half; ++i) {
                    const float x0 = XA(i), x1 = XA(half + i);
                    YD(i) = x0 * cc[i] - x1 * ss[i];
                    YD(half + i) = x0 * ss[i] + x1 * cc[i];
                }
            } else {
                for (int i = 0; i < n_dims; i += 2) {
                    const float x0 = XA(i), x1 = XA(i + 1);
                    YD(i) = x0 * cc[i] + x1 * ss[i];
                    YD(i + 1) = x1 * cc[i + 1] + x0 * ss[i + 1];
                }
            }
            for (int64_t i = n_dims; i < ne0; ++i) YD(i) = XA(i);
#undef XA
#undef YD
        }
    }
}

}  // namespace GP_NS
}  // namespace gp
