// FLASH_ATTN_EXT: softmax(q k^T * scale [softcap] + slope * mask) v with an online softmax over tiles of 8 keys.
// ggml layout: q [D, Nq, H, B] F32, k [D, Nkv, Hk, B] F16/F32, v [Dv, Nkv, Hk, B] F16/F32, mask [Nkv, >=Nq, *, *]
// F16/F32 (optional), dst [Dv, H, Nq, B] F32. fp: scale, max_bias, softcap. Rows whose every key is masked give 0.
#include "isa.h"

namespace gp {
namespace GP_NS {

GP_INLINE float alibi_slope_fa(float max_bias, int64_t h, int64_t n_head) {
    if (max_bias <= 0.0f) return 1.0f;
    const uint32_t n_log2 = 1u << (uint32_t)floor(log2((double)n_head));
    const float m0 = powf(2.0f, -max_bias / (float)n_log2);
    const float m1 = powf(2.0f, -(max_bias / 2.0f) / (float)n_log2);
    return (uint32_t)h < n_log2 ? powf(m0, (float)(h + 1)) : powf(m1, (float)(2 * (h - n_log2) + 1));
}

GP_INLINE float load_elem(const uint8_t* p, int type) {
    return type == T_F16 ? fp16_to_fp32(*(const uint16_t*)p) : *(const float*)p;
}

#if GP_AVX2
// The 8 horizontal sums of part[0..7] as one vector: lane t = sum of the lanes of part[t].
GP_INLINE __m256 hsum_lanes8(const __m256* part) {
    __m256 t0 = _mm256_hadd_ps(part[0], part[1]);
    const __m256 t1 = _mm256_hadd_ps(part[2], part[3]);
    __m256 t2 = _mm256_hadd_ps(part[4], part[5]);
    const __m256 t3 = _mm256_hadd_ps(part[6], part[7]);
    t0 = _mm256_hadd_ps(t0, t1);
    t2 = _mm256_hadd_ps(t2, t3);
    return _mm256_add_ps(_mm256_permute2f128_ps(t0, t2, 0x20), _mm256_permute2f128_ps(t0, t2, 0x31));
}
#endif

#if GP_AVX2
// Prefetch the key and value rows [t0, t1) (kbytes / vbytes each): a decode step reads strided rows of a cache that
// is cold after the weights' stream, whose latency the hardware prefetcher does not hide.
GP_INLINE void prefetch_kv_rows(const uint8_t* kb, int64_t ks, int64_t kbytes, const uint8_t* vb, int64_t vs,
                                int64_t vbytes, int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
        for (int64_t o = 0; o < kbytes; o += 64) _mm_prefetch((const char*)(kb + t * ks + o), _MM_HINT_T0);
        for (int64_t o = 0; o < vbytes; o += 64) _mm_prefetch((const char*)(vb + t * vs + o), _MM_HINT_T0);
    }
}

GP_INLINE __m256 load8(const uint8_t* p, bool f16) {
    return f16 ? load_f16x8((const uint16_t*)p) : _mm256_loadu_ps((const float*)p);
}

// One query row against keys [0, Nkv): the online softmax over tiles of 8 keys. DV8 > 0: Dv = 8 * DV8, the output
// accumulated in registers; DV8 == 0: any Dv that is a multiple of 8, accumulated in out[0..Dv), which the caller
// zeroes. Returns the softmax denominator S; the unnormalised output is left in out[0..Dv) and the running maximum in
// *m_out. The two forms differ only in the order of two sums, each kept as it was so that results do not change: a
// key's q.k (DV8 > 0: two partial sums over alternate blocks of 8; DV8 == 0: one) and S (DV8 > 0: a tile's
// probabilities summed in a register, then added; DV8 == 0: added one by one).
template <int DV8>
static double fa_row_tiles(const float* qf, int64_t D, const uint8_t* kb, int64_t ks, bool kf16, const uint8_t* vb,
                           int64_t vs, bool vf16, int64_t Nkv, const uint8_t* mp, int64_t ms_stride, int mtype,
                           float slope, float scale, float softcap, int64_t Dv, float* out, float* m_out) {
    constexpr bool regs = DV8 > 0;
    __m256 acc[regs ? DV8 : 1];
    if constexpr (regs) {
        for (int i = 0; i < DV8; ++i) acc[i] = _mm256_setzero_ps();
        Dv = 8 * DV8;
    }
    float M = -INFINITY;
    double S = 0.0;
    const int64_t es = kf16 ? 2 : 4;
    const int64_t kbytes = D * es, vbytes = Dv * (vf16 ? 2 : 4);
    for (int64_t j0 = 0; j0 < Nkv; j0 += 8) {
        const int64_t nt = imin(8, Nkv - j0);
        prefetch_kv_rows(kb, ks, kbytes, vb, vs, vbytes, j0 + 16, imin(j0 + 24, Nkv));  // the tile after next
        alignas(32) float mv[8];
        bool any = false;
        for (int t = 0; t < 8; ++t) {
            if (t < nt) {
                mv[t] = mp ? slope * load_elem(mp + (j0 + t) * ms_stride, mtype) : 0.0f;
                any |= mv[t] != -INFINITY;
            } else {
                mv[t] = -INFINITY;
            }
        }
        if (!any) continue;
        __m256 part[8];
        for (int t = 0; t < 8; ++t) {
            part[t] = _mm256_setzero_ps();
            if (mv[t] == -INFINITY) continue;
            const uint8_t* kr = kb + (j0 + t) * ks;
            if constexpr (regs) {
                __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps();
                int64_t i = 0;
                for (; i + 16 <= D; i += 16) {
                    a0 = _mm256_fmadd_ps(_mm256_loadu_ps(qf + i), load8(kr + i * es, kf16), a0);
                    a1 = _mm256_fmadd_ps(_mm256_loadu_ps(qf + i + 8), load8(kr + (i + 8) * es, kf16), a1);
                }
                for (; i < D; i += 8) a0 = _mm256_fmadd_ps(_mm256_loadu_ps(qf + i), load8(kr + i * es, kf16), a0);
                part[t] = _mm256_add_ps(a0, a1);
            } else if (kf16) {
                for (int64_t i = 0; i < D; i += 8)
                    part[t] = _mm256_fmadd_ps(_mm256_loadu_ps(qf + i), load_f16x8((const uint16_t*)kr + i), part[t]);
            } else {
                for (int64_t i = 0; i < D; i += 8)
                    part[t] = _mm256_fmadd_ps(_mm256_loadu_ps(qf + i), _mm256_loadu_ps((const float*)kr + i), part[t]);
            }
        }
        __m256 sc = hsum_lanes8(part);
        sc = _mm256_mul_ps(sc, _mm256_set1_ps(scale));
        if (softcap != 0.0f) sc = _mm256_mul_ps(_mm256_set1_ps(softcap), tanh_ps(sc));
        const __m256 vmv = _mm256_load_ps(mv);
        sc = _mm256_add_ps(sc, vmv);
        // masked lanes: -inf (the product above is finite there)
        sc = _mm256_blendv_ps(sc, _mm256_set1_ps(-INFINITY), _mm256_cmp_ps(vmv, _mm256_set1_ps(-INFINITY), _CMP_EQ_OQ));
        const float mt = hmax(sc);
        if (!(mt > -INFINITY)) continue;
        if (mt > M) {
            const float msc = M == -INFINITY ? 0.0f : expf(M - mt);
            M = mt;
            S *= msc;
            const __m256 vms = _mm256_set1_ps(msc);
            if constexpr (regs) {
                for (int i = 0; i < DV8; ++i) acc[i] = _mm256_mul_ps(acc[i], vms);
            } else {
                for (int64_t i = 0; i < Dv; i += 8)
                    _mm256_storeu_ps(out + i, _mm256_mul_ps(_mm256_loadu_ps(out + i), vms));
            }
        }
        const __m256 p = exp_ps(_mm256_sub_ps(sc, _mm256_set1_ps(M)));
        alignas(32) float pv[8];
        _mm256_store_ps(pv, p);
        if constexpr (regs) S += (double)hsum(p);
        for (int t = 0; t < 8; ++t) {
            if (pv[t] == 0.0f) continue;
            if constexpr (!regs) S += pv[t];
            const __m256 w = _mm256_set1_ps(pv[t]);
            const uint8_t* vr = vb + (j0 + t) * vs;
            if constexpr (regs) {
                if (vf16) {
                    for (int i = 0; i < DV8; ++i)
                        acc[i] = _mm256_fmadd_ps(w, load_f16x8((const uint16_t*)vr + 8 * i), acc[i]);
                } else {
                    for (int i = 0; i < DV8; ++i)
                        acc[i] = _mm256_fmadd_ps(w, _mm256_loadu_ps((const float*)vr + 8 * i), acc[i]);
                }
            } else if (vf16) {
                for (int64_t i = 0; i < Dv; i += 8)
                    _mm256_storeu_ps(out + i, _mm256_fmadd_ps(w, load_f16x8((const uint16_t*)vr + i),
                                                              _mm256_loadu_ps(out + i)));
            } else {
                for (int64_t i = 0; i < Dv; i += 8)
                    _mm256_storeu_ps(out + i, _mm256_fmadd_ps(w, _mm256_loadu_ps((const float*)vr + i),
                                                              _mm256_loadu_ps(out + i)));
            }
        }
    }
    if constexpr (regs)
        for (int i = 0; i < DV8; ++i) _mm256_storeu_ps(out + 8 * i, acc[i]);
    *m_out = M;
    return S;
}

// fa_row_tiles for the G query heads that share one KV head (one query row, keys [0, Nkv)): each block of 8 key or
// value elements is converted from F16 once and used by all G heads, which cuts the conversions, the larger part of
// the per-key work, to 1/G. qf: G x D floats; head g's partial result (acc[Dv], M, pad, S) goes to out + g * ostride.
template <int DV8, int G>
static void fa_rows_gqa(const float* qf, int64_t D, const uint8_t* kb, int64_t ks, bool kf16, const uint8_t* vb,
                        int64_t vs, bool vf16, int64_t Nkv, const uint8_t* mp, int64_t ms_stride, int mtype,
                        const float* slope, float scale, float softcap, float* out, int64_t ostride) {
    alignas(32) float acc[G][DV8 * 8];
    float M[G];
    double S[G];
    for (int g = 0; g < G; ++g) {
        for (int i = 0; i < DV8 * 8; ++i) acc[g][i] = 0.0f;
        M[g] = -INFINITY;
        S[g] = 0.0;
    }
    const int64_t kes = kf16 ? 2 : 4, ves = vf16 ? 2 : 4;
    const int64_t kbytes = D * kes, vbytes = DV8 * 8 * ves;
    for (int64_t j0 = 0; j0 < Nkv; j0 += 8) {
        const int64_t nt = imin(8, Nkv - j0);
        prefetch_kv_rows(kb, ks, kbytes, vb, vs, vbytes, j0 + 16, imin(j0 + 24, Nkv));  // the tile after next
        alignas(32) float mraw[8];
        bool any = false;
        for (int t = 0; t < 8; ++t) {
            mraw[t] = t >= nt ? -INFINITY : (mp ? load_elem(mp + (j0 + t) * ms_stride, mtype) : 0.0f);
            any |= mraw[t] != -INFINITY;
        }
        if (!any) continue;
        __m256 part[G][8];
        for (int t = 0; t < 8; ++t) {
            __m256 a[G];
            for (int g = 0; g < G; ++g) a[g] = _mm256_setzero_ps();
            if (mraw[t] != -INFINITY) {
                const uint8_t* kr = kb + (j0 + t) * ks;
                for (int64_t i = 0; i < D; i += 8) {
                    const __m256 kv = load8(kr + i * kes, kf16);
                    for (int g = 0; g < G; ++g) a[g] = _mm256_fmadd_ps(_mm256_loadu_ps(qf + g * D + i), kv, a[g]);
                }
            }
            for (int g = 0; g < G; ++g) part[g][t] = a[g];
        }
        const __m256 vmr = _mm256_load_ps(mraw);
        const __m256 masked = _mm256_cmp_ps(vmr, _mm256_set1_ps(-INFINITY), _CMP_EQ_OQ);
        const __m256 mzero = _mm256_blendv_ps(vmr, _mm256_setzero_ps(), masked);
        alignas(32) float pv[G][8];
        for (int g = 0; g < G; ++g) {
            __m256 sc = _mm256_mul_ps(hsum_lanes8(part[g]), _mm256_set1_ps(scale));
            if (softcap != 0.0f) sc = _mm256_mul_ps(_mm256_set1_ps(softcap), tanh_ps(sc));
            sc = _mm256_fmadd_ps(_mm256_set1_ps(slope[g]), mzero, sc);
            sc = _mm256_blendv_ps(sc, _mm256_set1_ps(-INFINITY), masked);
            const float mt = hmax(sc);
            if (!(mt > -INFINITY)) {  // nothing of this tile for this head (as fa_row_tiles)
                _mm256_store_ps(pv[g], _mm256_setzero_ps());
                continue;
            }
            if (mt > M[g]) {
                const float msc = M[g] == -INFINITY ? 0.0f : expf(M[g] - mt);
                M[g] = mt;
                S[g] *= msc;
                const __m256 vms = _mm256_set1_ps(msc);
                for (int i = 0; i < DV8; ++i)
                    _mm256_store_ps(acc[g] + 8 * i, _mm256_mul_ps(_mm256_load_ps(acc[g] + 8 * i), vms));
            }
            const __m256 p = exp_ps(_mm256_sub_ps(sc, _mm256_set1_ps(M[g])));
            _mm256_store_ps(pv[g], p);
            S[g] += (double)hsum(p);
        }
        for (int i = 0; i < DV8; ++i) {
            __m256 a[G];
            for (int g = 0; g < G; ++g) a[g] = _mm256_load_ps(acc[g] + 8 * i);
            for (int t = 0; t < 8; ++t) {
                if (mraw[t] == -INFINITY) continue;  // a masked row may hold anything (never written)
                const __m256 vv = load8(vb + (j0 + t) * vs + 8 * i * ves, vf16);
                for (int g = 0; g < G; ++g) a[g] = _mm256_fmadd_ps(_mm256_broadcast_ss(&pv[g][t]), vv, a[g]);
            }
            for (int g = 0; g < G; ++g) _mm256_store_ps(acc[g] + 8 * i, a[g]);
        }
    }
    for (int g = 0; g < G; ++g) {
        float* pg = out + g * ostride;
        memcpy(pg, acc[g], sizeof(float) * DV8 * 8);
        pg[DV8 * 8] = M[g];
        memcpy(pg + DV8 * 8 + 2, &S[g], sizeof(double));
    }
}

// fa_rows_gqa for Dv in {32, 64, 128} and G in {2, 3, 4} (the caller's condition)
static void fa_rows_group(int64_t G, const float* qf, int64_t D, const uint8_t* kb, int64_t ks, bool kf16,
                          const uint8_t* vb, int64_t vs, bool vf16, int64_t Nkv, const uint8_t* mp, int64_t ms_stride,
                          int mtype, const float* slope, float scale, float softcap, int64_t Dv, float* out,
                          int64_t ostride) {
#define GP_FA_GQA(DV8, GG)                                                                                          \
    if (Dv == DV8 * 8 && G == GG) {                                                                                 \
        fa_rows_gqa<DV8, GG>(qf, D, kb, ks, kf16, vb, vs, vf16, Nkv, mp, ms_stride, mtype, slope, scale, softcap,   \
                             out, ostride);                                                                         \
        return;                                                                                                     \
    }
    GP_FA_GQA(4, 2) GP_FA_GQA(4, 3) GP_FA_GQA(4, 4)
    GP_FA_GQA(8, 2) GP_FA_GQA(8, 3) GP_FA_GQA(8, 4)
    GP_FA_GQA(16, 2) GP_FA_GQA(16, 3) GP_FA_GQA(16, 4)
#undef GP_FA_GQA
}

// fa_row_tiles: accumulators in registers for Dv in {32, 64, 128}, in out[] (zeroed by the caller) for other Dv
static double fa_row(const float* qf, int64_t D, const uint8_t* kb, int64_t ks, bool kf16, const uint8_t* vb,
                     int64_t vs, bool vf16, int64_t Nkv, const uint8_t* mp, int64_t ms_stride, int mtype, float slope,
                     float scale, float softcap, int64_t Dv, float* out, float* m_out) {
#define GP_FA_ROW(DV8)                                                                                               \
    return fa_row_tiles<DV8>(qf, D, kb, ks, kf16, vb, vs, vf16, Nkv, mp, ms_stride, mtype, slope, scale, softcap, Dv, \
                             out, m_out)
    if (Dv == 32) GP_FA_ROW(4);
    if (Dv == 64) GP_FA_ROW(8);
    if (Dv == 128) GP_FA_ROW(16);
    GP_FA_ROW(0);
#undef GP_FA_ROW
}
#endif

#if GP_AVX2
// All G query heads that share one KV head, for one query row: each tile of 8 keys and values is converted to F32
// once and used by every head (GQA). scratch: 8*D + 8*Dv + G*(D + Dv) floats + G*2 doubles.
static void fa_group(const Node& n, int64_t iq, int64_t hk, int64_t b, float* scratch) {
    const Tensor& dst = n.dst;
    const Tensor& q = n.src[0];
    const Tensor& k = n.src[1];
    const Tensor& v = n.src[2];
    const bool has_mask = n.has[3];
    const Tensor& mk = n.src[3];
    const int64_t D = q.ne[0], H = q.ne[2], Nkv = k.ne[1], Hk = k.ne[2], Dv = v.ne[0];
    const int64_t G = H / Hk;
    float scale = n.params.f[GGML_PY_P_FLASH_ATTN_EXT_SCALE];
    const float max_bias = n.params.f[GGML_PY_P_FLASH_ATTN_EXT_MAX_BIAS];
    const float softcap = n.params.f[GGML_PY_P_FLASH_ATTN_EXT_SOFTCAP];
    if (softcap != 0.0f) scale /= softcap;
    float* kt = scratch;              // 8 x D
    float* vt = kt + 8 * D;           // 8 x Dv
    float* qs = vt + 8 * Dv;          // G x D
    float* acc = qs + G * D;          // G x Dv
    float* Ms = acc + G * Dv;         // G
    double* Ss = (double*)(((uintptr_t)(Ms + G) + 7) & ~(uintptr_t)7);  // G
    float slope[64];
    const int64_t h0 = hk * G;
    for (int64_t g = 0; g < G; ++g) {
        const uint8_t* qp = q.data + iq * q.nb[1] + (h0 + g) * q.nb[2] + b * q.nb[3];
        for (int64_t i = 0; i < D; ++i) qs[g * D + i] = *(const float*)(qp + i * q.nb[0]);
        for (int64_t i = 0; i < Dv; ++i) acc[g * Dv + i] = 0.0f;
        Ms[g] = -INFINITY;
        Ss[g] = 0.0;
        if (g < 64) slope[g] = alibi_slope_fa(max_bias, h0 + g, H);
    }
    const uint8_t* kb = k.data + hk * k.nb[2] + b * k.nb[3];
    const uint8_t* vb = v.data + hk * v.nb[2] + b * v.nb[3];
    const bool kf = k.type == T_F16, vf = v.type == T_F16;
    const uint8_t* mp = has_mask ? mk.data + iq * mk.nb[1] + (h0 % mk.ne[2]) * mk.nb[2] + (b % mk.ne[3]) * mk.nb[3]
                                 : nullptr;
    for (int64_t j0 = 0; j0 < Nkv; j0 += 8) {
        const int64_t nt = imin(8, Nkv - j0);
        alignas(32) float mraw[8];
        bool any = false;
        for (int t = 0; t < 8; ++t) {
            if (t < nt) {
                mraw[t] = mp ? load_elem(mp + (j0 + t) * mk.nb[0], mk.type) : 0.0f;
                any |= mraw[t] != -INFINITY;
            } else {
                mraw[t] = -INFINITY;
            }
        }
        if (!any) continue;
        for (int t = 0; t < 8; ++t) {  // convert the tile (masked keys: zeros)
            float* kd = kt + t * D;
            float* vd = vt + t * Dv;
            if (mraw[t] == -INFINITY) {
                for (int64_t i = 0; i < D; i += 8) _mm256_storeu_ps(kd + i, _mm256_setzero_ps());
                for (int64_t i = 0; i < Dv; i += 8) _mm256_storeu_ps(vd + i, _mm256_setzero_ps());
                continue;
            }
            const uint8_t* kr = kb + (j0 + t) * k.nb[1];
            const uint8_t* vr = vb + (j0 + t) * v.nb[1];
            for (int64_t i = 0; i < D; i += 8) _mm256_storeu_ps(kd + i, load8(kr + i * (kf ? 2 : 4), kf));
            for (int64_t i = 0; i < Dv; i += 8) _mm256_storeu_ps(vd + i, load8(vr + i * (vf ? 2 : 4), vf));
        }
        const __m256 vmr = _mm256_load_ps(mraw);
        const __m256 masked = _mm256_cmp_ps(vmr, _mm256_set1_ps(-INFINITY), _CMP_EQ_OQ);
        for (int64_t g = 0; g < G; ++g) {
            const float* qg = qs + g * D;
            __m256 part[8];
            for (int t = 0; t < 8; ++t) {
                const float* kd = kt + t * D;
                __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps();
                int64_t i = 0;
                for (; i + 16 <= D; i += 16) {
                    a0 = _mm256_fmadd_ps(_mm256_loadu_ps(qg + i), _mm256_loadu_ps(kd + i), a0);
                    a1 = _mm256_fmadd_ps(_mm256_loadu_ps(qg + i + 8), _mm256_loadu_ps(kd + i + 8), a1);
                }
                for (; i < D; i += 8) a0 = _mm256_fmadd_ps(_mm256_loadu_ps(qg + i), _mm256_loadu_ps(kd + i), a0);
                part[t] = _mm256_add_ps(a0, a1);
            }
            __m256 sc = hsum_lanes8(part);
            sc = _mm256_mul_ps(sc, _mm256_set1_ps(scale));
            if (softcap != 0.0f) sc = _mm256_mul_ps(_mm256_set1_ps(softcap), tanh_ps(sc));
            const float sl = g < 64 ? slope[g] : alibi_slope_fa(max_bias, h0 + g, H);
            sc = _mm256_add_ps(sc, _mm256_mul_ps(_mm256_set1_ps(sl), _mm256_blendv_ps(vmr, _mm256_setzero_ps(), masked)));
            sc = _mm256_blendv_ps(sc, _mm256_set1_ps(-INFINITY), masked);
            const float mt = hmax(sc);
            if (!(mt > -INFINITY)) continue;
            float* ag = acc + g * Dv;
            if (mt > Ms[g]) {
                const float msc = Ms[g] == -INFINITY ? 0.0f : expf(Ms[g] - mt);
                Ms[g] = mt;
                Ss[g] *= msc;
                const __m256 vms = _mm256_set1_ps(msc);
                for (int64_t i = 0; i < Dv; i += 8) _mm256_storeu_ps(ag + i, _mm256_mul_ps(_mm256_loadu_ps(ag + i), vms));
            }
            const __m256 p = exp_ps(_mm256_sub_ps(sc, _mm256_set1_ps(Ms[g])));
            Ss[g] += (double)hsum(p);
            alignas(32) float pv[8];
            _mm256_store_ps(pv, p);
            const __m256 p0 = _mm256_set1_ps(pv[0]), p1 = _mm256_set1_ps(pv[1]), p2 = _mm256_set1_ps(pv[2]),
                         p3 = _mm256_set1_ps(pv[3]), p4 = _mm256_set1_ps(pv[4]), p5 = _mm256_set1_ps(pv[5]),
                         p6 = _mm256_set1_ps(pv[6]), p7 = _mm256_set1_ps(pv[7]);
            for (int64_t i = 0; i < Dv; i += 8) {
                __m256 a = _mm256_loadu_ps(ag + i);
                __m256 x = _mm256_mul_ps(p0, _mm256_loadu_ps(vt + i));
                x = _mm256_fmadd_ps(p1, _mm256_loadu_ps(vt + Dv + i), x);
                x = _mm256_fmadd_ps(p2, _mm256_loadu_ps(vt + 2 * Dv + i), x);
                x = _mm256_fmadd_ps(p3, _mm256_loadu_ps(vt + 3 * Dv + i), x);
                a = _mm256_add_ps(a, x);
                __m256 y = _mm256_mul_ps(p4, _mm256_loadu_ps(vt + 4 * Dv + i));
                y = _mm256_fmadd_ps(p5, _mm256_loadu_ps(vt + 5 * Dv + i), y);
                y = _mm256_fmadd_ps(p6, _mm256_loadu_ps(vt + 6 * Dv + i), y);
                y = _mm256_fmadd_ps(p7, _mm256_loadu_ps(vt + 7 * Dv + i), y);
                _mm256_storeu_ps(ag + i, _mm256_add_ps(a, y));
            }
        }
    }
    for (int64_t g = 0; g < G; ++g) {
        const float inv = Ss[g] == 0.0 ? 0.0f : (float)(1.0 / Ss[g]);
        uint8_t* op = dst.data + (h0 + g) * dst.nb[1] + iq * dst.nb[2] + b * dst.nb[3];
        const float* ag = acc + g * Dv;
        for (int64_t i = 0; i < Dv; ++i) *(float*)(op + i * dst.nb[0]) = ag[i] * inv;
    }
}
#endif

void k_flash_attn_ext(Node& n, int phase, int ith, int nth, const ExecCtx& ctx) {
    const Tensor& dst = n.dst;
    const Tensor& q = n.src[0];
    const Tensor& k = n.src[1];
    const Tensor& v = n.src[2];
    const bool has_mask = n.has[3];
    const Tensor& mk = n.src[3];
    const int64_t D = q.ne[0], Nq = q.ne[1], H = q.ne[2], B = q.ne[3];
    const int64_t Nkv = k.ne[1], Hk = k.ne[2], Dv = v.ne[0];
    const int64_t rep = H / Hk;
    float scale = n.params.f[GGML_PY_P_FLASH_ATTN_EXT_SCALE];
    const float max_bias = n.params.f[GGML_PY_P_FLASH_ATTN_EXT_MAX_BIAS];
    const float softcap = n.params.f[GGML_PY_P_FLASH_ATTN_EXT_SOFTCAP];
    if (softcap != 0.0f) scale /= softcap;

#if GP_AVX2
    const bool groupable = (D % 8) == 0 && (Dv % 8) == 0 && k.nb[0] == type_size(k.type) &&
                           v.nb[0] == type_size(v.type);
    const int64_t gunits = Nq * Hk * B;
    // the grouped-heads kernels read one mask for the heads of a group: the mask must not differ by head
    const bool one_mask = !has_mask || mk.ne[2] == 1;
    if (n.n_phases == 2 && groupable && (Dv == 32 || Dv == 64 || Dv == 128)) {
        // few query rows and KV heads (a decode step): split the keys too, so that both threads have work however
        // few heads there are ("flash decoding"). Phase 0: each (query row, head, range of keys) leaves its partial
        // result (acc[Dv], M, S) in the shared scratch; phase 1 merges a head's ranges.
        const int64_t nch = fa_key_chunks(Nkv), chunk = ((Nkv + nch - 1) / nch + 7) & ~(int64_t)7;
        const int64_t heads = Nq * H * B;
        float* parts = (float*)ctx.wdata;
        const bool kf = k.type == T_F16, vf = v.type == T_F16;
        if (phase == 0 && rep >= 2 && rep <= 4 && one_mask) {
            // the heads sharing a KV head together (fa_rows_gqa): units are (range, query row, KV head), range-major
            float* qf = (float*)ctx.thread_scratch(ith);
            int64_t u0, u1;
            split_range(gunits * nch, ith, nth, &u0, &u1);
            for (int64_t u = u0; u < u1; ++u) {
                const int64_t gu = u % gunits, c = u / gunits;
                const int64_t hk = gu % Hk, iq = (gu / Hk) % Nq, b = gu / (Hk * Nq), h0 = hk * rep;
                const int64_t jb = imin(Nkv, c * chunk), je = imin(Nkv, jb + chunk);
                float slope[4];
                for (int64_t g = 0; g < rep; ++g) {
                    const uint8_t* qp = q.data + iq * q.nb[1] + (h0 + g) * q.nb[2] + b * q.nb[3];
                    for (int64_t i = 0; i < D; ++i) qf[g * D + i] = *(const float*)(qp + i * q.nb[0]);
                    slope[g] = alibi_slope_fa(max_bias, h0 + g, H);
                }
                const uint8_t* mp = has_mask ? mk.data + iq * mk.nb[1] + (b % mk.ne[3]) * mk.nb[3] + jb * mk.nb[0]
                                             : nullptr;
                const int64_t hu0 = (b * Nq + iq) * H + h0;  // as phase 1 numbers the heads
                fa_rows_group(rep, qf, D, k.data + hk * k.nb[2] + b * k.nb[3] + jb * k.nb[1], k.nb[1], kf,
                              v.data + hk * v.nb[2] + b * v.nb[3] + jb * v.nb[1], v.nb[1], vf, je - jb, mp,
                              has_mask ? mk.nb[0] : 0, mk.type, slope, scale, softcap, Dv,
                              parts + (hu0 * nch + c) * FA_PART(Dv), nch * FA_PART(Dv));
            }
            return;
        }
        if (phase == 0) {
            float* qf = (float*)ctx.thread_scratch(ith);
            int64_t u0, u1;
            split_range(heads * nch, ith, nth, &u0, &u1);
            for (int64_t u = u0; u < u1; ++u) {
                // range-major: a thread takes whole ranges of keys for every head, so the cache rows (all KV heads
                // side by side) are read once, in order, and the heads sharing them find them in cache (head-major
                // order was 4-6% slower per decode step at a 1000-token context)
                const int64_t hu = u % heads, c = u / heads;
                const int64_t h = hu % H, iq = (hu / H) % Nq, b = hu / (H * Nq), hk = h / rep;
                const int64_t jb = imin(Nkv, c * chunk), je = imin(Nkv, jb + chunk);
                float* pg = parts + (hu * nch + c) * FA_PART(Dv);  // phase 1 reads a head's ranges side by side
                const uint8_t* qp = q.data + iq * q.nb[1] + h * q.nb[2] + b * q.nb[3];
                for (int64_t i = 0; i < D; ++i) qf[i] = *(const float*)(qp + i * q.nb[0]);
                const uint8_t* mp = has_mask ? mk.data + iq * mk.nb[1] + (h % mk.ne[2]) * mk.nb[2] +
                                                   (b % mk.ne[3]) * mk.nb[3] + jb * mk.nb[0]
                                             : nullptr;
                const double S = fa_row(qf, D, k.data + hk * k.nb[2] + b * k.nb[3] + jb * k.nb[1], k.nb[1], kf,
                                        v.data + hk * v.nb[2] + b * v.nb[3] + jb * v.nb[1], v.nb[1], vf, je - jb, mp,
                                        has_mask ? mk.nb[0] : 0, mk.type, alibi_slope_fa(max_bias, h, H), scale,
                                        softcap, Dv, pg, pg + Dv);
                memcpy(pg + Dv + 2, &S, sizeof(double));
            }
            return;
        }
        int64_t u0, u1;
        split_range(heads, ith, nth, &u0, &u1);
        float* acc = (float*)ctx.thread_scratch(ith);
        for (int64_t hu = u0; hu < u1; ++hu) {  // one head of one query row: merge its ranges
            const int64_t h = hu % H, iq = (hu / H) % Nq, b = hu / (H * Nq);
            const float* p0 = parts + hu * nch * FA_PART(Dv);
            float M = -INFINITY;
            for (int64_t c = 0; c < nch; ++c) M = fmaxf(M, p0[c * FA_PART(Dv) + Dv]);
            for (int64_t i = 0; i < Dv; ++i) acc[i] = 0.0f;
            double S = 0.0;
            for (int64_t c = 0; c < nch && M > -INFINITY; ++c) {
                const float* pg = p0 + c * FA_PART(Dv);
                if (!(pg[Dv] > -INFINITY)) continue;  // every key of this range masked
                const float w = expf(pg[Dv] - M);
                double s;
                memcpy(&s, pg + Dv + 2, sizeof(double));
                S += s * w;
                const __m256 vw = _mm256_set1_ps(w);
                for (int64_t i = 0; i < Dv; i += 8)
                    _mm256_storeu_ps(acc + i, _mm256_fmadd_ps(vw, _mm256_loadu_ps(pg + i), _mm256_loadu_ps(acc + i)));
            }
            const float inv = S == 0.0 ? 0.0f : (float)(1.0 / S);
            uint8_t* op = dst.data + h * dst.nb[1] + iq * dst.nb[2] + b * dst.nb[3];
            for (int64_t i = 0; i < Dv; ++i) *(float*)(op + i * dst.nb[0]) = acc[i] * inv;
        }
        return;
    }
    if (phase != n.n_phases - 1) return;  // the split-key phase runs only with the vector kernels
    // grouped heads (one conversion of each key/value tile for all heads sharing it) when there are enough groups
    // to keep every thread busy
    if (rep >= 2 && gunits >= 8 && groupable && one_mask) {
        int64_t g0, g1;
        split_range(gunits, ith, nth, &g0, &g1);
        for (int64_t u = g0; u < g1; ++u)
            fa_group(n, (u / Hk) % Nq, u % Hk, u / (Hk * Nq), (float*)ctx.thread_scratch(ith));
        return;
    }
#else
    if (phase != n.n_phases - 1) return;
#endif
    const int64_t units = Nq * H * B;
    int64_t u0, u1;
    split_range(units, ith, nth, &u0, &u1);
    float* acc = (float*)ctx.thread_scratch(ith);
    float* qf = acc + ((Dv + 15) & ~15);
    float* kt = qf + ((D + 15) & ~15);  // one converted row (strided/generic path)

#if GP_AVX2
    const bool vec = (D % 8) == 0 && (Dv % 8) == 0 && k.nb[0] == type_size(k.type) &&
                     v.nb[0] == type_size(v.type);
#endif
    for (int64_t u = u0; u < u1; ++u) {
        const int64_t h = u % H, iq = (u / H) % Nq, b = u / (H * Nq);
        const int64_t hk = h / rep;
        const uint8_t* qp = q.data + iq * q.nb[1] + h * q.nb[2] + b * q.nb[3];
        for (int64_t i = 0; i < D; ++i) qf[i] = *(const float*)(qp + i * q.nb[0]);
        const uint8_t* kb = k.data + hk * k.nb[2] + b * k.nb[3];
        const uint8_t* vb = v.data + hk * v.nb[2] + b * v.nb[3];
        const uint8_t* mp = has_mask ? mk.data + iq * mk.nb[1] + (h % mk.ne[2]) * mk.nb[2] + (b % mk.ne[3]) * mk.nb[3]
                                     : nullptr;
        const float slope = alibi_slope_fa(max_bias, h, H);
        for (int64_t i = 0; i < Dv; ++i) acc[i] = 0.0f;
        float M = -INFINITY;
        double S = 0.0;
#if GP_AVX2
        if (vec) {
            const bool kf = k.type == T_F16, vf = v.type == T_F16;
            const int64_t ms = has_mask ? mk.nb[0] : 0;
            float m_unused;
            S = fa_row(qf, D, kb, k.nb[1], kf, vb, v.nb[1], vf, Nkv, mp, ms, mk.type, slope, scale, softcap, Dv, acc,
                       &m_unused);
        } else
#endif
        {
            for (int64_t j = 0; j < Nkv; ++j) {
                const float mvj = mp ? slope * load_elem(mp + j * mk.nb[0], mk.type) : 0.0f;
                if (mvj == -INFINITY) continue;
                const uint8_t* kr = kb + j * k.nb[1];
                double s = 0.0;
                for (int64_t i = 0; i < D; ++i) s += (double)qf[i] * load_elem(kr + i * k.nb[0], k.type);
                float sf = (float)s * scale;
                if (softcap != 0.0f) sf = softcap * tanhf(sf);
                sf += mvj;
                float w;
                if (sf > M) {
                    const float ms = M == -INFINITY ? 0.0f : expf(M - sf);
                    M = sf;
                    S *= ms;
                    for (int64_t i = 0; i < Dv; ++i) acc[i] *= ms;
                    w = 1.0f;
                } else {
                    w = expf(sf - M);
                }
                S += w;
                const uint8_t* vr = vb + j * v.nb[1];
                for (int64_t i = 0; i < Dv; ++i) kt[i] = load_elem(vr + i * v.nb[0], v.type);
                for (int64_t i = 0; i < Dv; ++i) acc[i] += w * kt[i];
            }
        }
        const float inv = S == 0.0 ? 0.0f : (float)(1.0 / S);
        uint8_t* op = dst.data + h * dst.nb[1] + iq * dst.nb[2] + b * dst.nb[3];
        for (int64_t i = 0; i < Dv; ++i) *(float*)(op + i * dst.nb[0]) = acc[i] * inv;
    }
}

}  // namespace GP_NS
}  // namespace gp
