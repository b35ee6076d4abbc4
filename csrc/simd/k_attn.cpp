// FLASH_ATTN_EXT: softmax(q k^T * scale [softcap] + slope * mask) v with an online softmax over tiles of 8 keys.
// ggml layout: q [D, Nq, H, B] F32, k [D, Nkv, Hk, B] F16/F32, v [Dv, Nkv, Hk, B] F16/F32, mask [Nkv, >=Nq, *, *]
// F16/F32 (optional), dst [Dv, H, Nq, B] F32. fp: scale, max_bias, softcap. Rows whose every key is masked give 0.
#include <type_traits>

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
// The factor by which a head's sums so far shrink when a tile raises its running maximum from M to Mn: exp(M - Mn),
// as exp_ps computes it lane by lane (0 from M = -inf), so that the heads that fa_softmax_steps8 takes eight at a
// time get the bits of those taken one at a time.
GP_INLINE float fa_rescale(float M, float Mn) {
    return M == -INFINITY ? 0.0f : _mm256_cvtss_f32(exp_ps(_mm256_set1_ps(M - Mn)));
}
#endif

#if GP_AVX2
// Prefetch the key and value rows [t0, t1) (kbytes / vbytes each) into L2: a decode step reads strided rows of a
// cache that is cold after the weights' stream. On Intel (a Xeon with AVX-512) the hardware prefetcher did not hide
// their latency: an L1 prefetch of the tile after next took one layer (32 KV heads of 64, 2000 keys, 2 threads)
// from 0.92 to 0.57 ms (L2 not measured there). On AMD every software prefetch made it slower: on an EPYC (Zen 3),
// L1 0.88 ms and L2 0.73 against 0.69 without; prefetching to L1, L2, L3 or non-temporally, 2 to 8 tiles ahead, all
// slower than none; SmolLM2-1.7B-shaped Q4_K_M decode at a 2000-token context, two rounds, attention per step
// 46.7 / 58.8 -> 30.7 / 30.9 ms at 1 thread (8.0 / 6.5 -> 11.1 / 11.0 tok/s), 28.8 / 21.7 -> 22.0 / 20.5 at 2: none
// there. On an EPYC Zen 4 (AVX-512 with VNNI, which Zen 3 lacks) the L2 prefetch helps again: 16 layers of the 1B
// shape (32 heads on 8 KV heads of 64, 2000 keys, 2 threads) 7.6-9.7 -> 5.4-6.7 ms; decode at a 2000-token context,
// attention per step 7.1-9.0 -> 4.6-7.3 ms (1B Q4_0), 18.4-19.9 -> 12.7-13.4 (1.7B Q4_K_M: 17.8-18.3 -> 22.9-25.8
// tok/s); four or eight tiles ahead instead of two, or into L1, measured no better.
static const bool kPrefetchKV = !cpu_is_amd() || cpu_has_avx512_vnni();
// cold: the caller's rows come from DRAM (a decode step's few query rows). A prefill's rows re-read each layer's
// keys, which stay cached: there the prefetch only cost (1.7B shape, 512 tokens, 1 thread: +12% attention time).
// Rows (all KV heads of a key) of a page or more are left to the hardware: a pass over the heads reads each row's
// page in address order, which its stream prefetcher follows. Zen 4, 1 thread, 2000 keys a layer from DRAM, 64
// elements a KV head: 32 KV heads (4 KB rows, SmolLM2-1.7B's) 0.87 ms a layer with the prefetch, 0.78-0.82 without;
// 16 KV heads (2 KB) 0.55-0.64 against 0.67-0.69 without, 8 (1 KB) 0.30 against 0.46-0.51, 4 0.16 against 0.24.
GP_INLINE void prefetch_kv_rows(bool cold, const uint8_t* kb, int64_t ks, int64_t kbytes, const uint8_t* vb,
                                int64_t vs, int64_t vbytes, int64_t t0, int64_t t1) {
    if (!cold || !kPrefetchKV) return;
    constexpr int64_t page = 4096;
    for (int64_t t = t0; t < t1; ++t) {
        if (ks < page)
            for (int64_t o = 0; o < kbytes; o += 64) _mm_prefetch((const char*)(kb + t * ks + o), _MM_HINT_T1);
        if (vs < page)
            for (int64_t o = 0; o < vbytes; o += 64) _mm_prefetch((const char*)(vb + t * vs + o), _MM_HINT_T1);
    }
}

GP_INLINE __m256 load8(const uint8_t* p, bool f16) {
    return f16 ? load_f16x8((const uint16_t*)p) : _mm256_loadu_ps((const float*)p);
}

// A row's visible tiles counted into chunks of FA_CHUNK_TILES, the one rule of every path and of the split's scan:
// next() for each visible tile, true when it starts a chunk (the first tile, then every FA_CHUNK_TILES-th).
struct FaChunks {
    int vis = 0;
    bool next() { return vis++ % FA_CHUNK_TILES == 0; }
    bool later() { return next() && vis > 1; }  // starts a chunk after the first: the one before it is complete
};

// A head's result so far (acc[Dv] unnormalised, M, S) merged with a chunk's: the one way chunks are combined,
// in chunk order, by every path (an empty total takes the chunk as it is).
GP_INLINE void fa_merge(float* acc, float* M, double* S, const float* acc_c, float M_c, double S_c, int64_t Dv) {
    if (!(M_c > -INFINITY)) return;
    if (!(*M > -INFINITY)) {
        memcpy(acc, acc_c, sizeof(float) * Dv);
        *M = M_c;
        *S = S_c;
        return;
    }
    const float Mn = fmaxf(*M, M_c);
    const float w = expf(*M - Mn), w_c = expf(M_c - Mn);
    *S = *S * (double)w + S_c * (double)w_c;
    const __m256 vw = _mm256_set1_ps(w), vw_c = _mm256_set1_ps(w_c);
    for (int64_t i = 0; i < Dv; i += 8)
        _mm256_storeu_ps(acc + i, _mm256_fmadd_ps(_mm256_loadu_ps(acc_c + i), vw_c,
                                                  _mm256_mul_ps(_mm256_loadu_ps(acc + i), vw)));
    *M = Mn;
}

// h query heads' results over a run of keys (acc[h][Dv] unnormalised, S as a double, M), laid out from p
struct FaState {
    float* acc;
    double* S;
    float* M;
    FaState(float* p, int64_t h, int64_t dv) : acc(p), S((double*)(p + h * dv)), M((float*)(S + h)) {}
    float* end(int64_t h) const { return M + h; }  // the floats after it
    void clear(int64_t g, int64_t dv) const {  // head g before its first key
        memset(acc + g * dv, 0, sizeof(float) * dv);
        M[g] = -INFINITY;
        S[g] = 0.0;
    }
};

// q.k for the 8 keys of a tile (masked keys: 0): two FMA chains over alternate blocks of 8 elements, then the 8
// horizontal sums. Every kernel computes a key's score this way.
GP_INLINE __m256 fa_scores8(const float* qf, int64_t D, const uint8_t* const* kr, int64_t kes, bool kf16) {
    __m256 part[8];
    for (int t = 0; t < 8; ++t) {
        __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps();
        if (kr[t]) {
            int64_t i = 0;
            for (; i + 16 <= D; i += 16) {
                a0 = _mm256_fmadd_ps(_mm256_loadu_ps(qf + i), load8(kr[t] + i * kes, kf16), a0);
                a1 = _mm256_fmadd_ps(_mm256_loadu_ps(qf + i + 8), load8(kr[t] + (i + 8) * kes, kf16), a1);
            }
            for (; i < D; i += 8) a0 = _mm256_fmadd_ps(_mm256_loadu_ps(qf + i), load8(kr[t] + i * kes, kf16), a0);
        }
        part[t] = _mm256_add_ps(a0, a1);
    }
    return hsum_lanes8(part);
}

// A tile's scores (raw q.k sums) to logits: scale, softcap, plus slope x mask; masked lanes -inf.
GP_INLINE __m256 fa_logits8(__m256 sc, float scale, float softcap, float slope, __m256 mask_raw) {
    const __m256 masked = _mm256_cmp_ps(mask_raw, _mm256_set1_ps(-INFINITY), _CMP_EQ_OQ);
    sc = _mm256_mul_ps(sc, _mm256_set1_ps(scale));
    if (softcap != 0.0f) sc = _mm256_mul_ps(_mm256_set1_ps(softcap), tanh_ps(sc));
    sc = _mm256_add_ps(sc, _mm256_mul_ps(_mm256_set1_ps(slope), _mm256_blendv_ps(mask_raw, _mm256_setzero_ps(), masked)));
    return _mm256_blendv_ps(sc, _mm256_set1_ps(-INFINITY), masked);
}

// The mask of keys [j0, j0 + 8) (past nkv: -inf); false if every one is masked (the tile is skipped: exactly as if
// its keys were not there).
GP_INLINE bool fa_tile_mask(const uint8_t* mp, int64_t ms_stride, int mtype, int64_t j0, int64_t nkv, float* mraw) {
    bool any = false;
    for (int t = 0; t < 8; ++t) {
        mraw[t] = j0 + t >= nkv ? -INFINITY : (mp ? load_elem(mp + (j0 + t) * ms_stride, mtype) : 0.0f);
        any |= mraw[t] != -INFINITY;
    }
    return any;
}

// Whether any of keys [j0, j0 + 8) is visible (fa_tile_mask's answer, without the values): 8 at once when the mask
// row is contiguous, as it is in every model's graph.
GP_INLINE bool fa_tile_visible(const uint8_t* mp, int64_t ms_stride, int mtype, int64_t j0, int64_t nkv) {
    if (!mp) return j0 < nkv;
    if (j0 + 8 <= nkv && mtype == T_F32 && ms_stride == 4) {
        const __m256 m = _mm256_loadu_ps((const float*)mp + j0);
        return _mm256_movemask_ps(_mm256_cmp_ps(m, _mm256_set1_ps(-INFINITY), _CMP_EQ_OQ)) != 0xFF;
    }
    if (j0 + 8 <= nkv && mtype == T_F16 && ms_stride == 2) {
        const __m128i m = _mm_loadu_si128((const __m128i*)((const uint16_t*)mp + j0));
        return _mm_movemask_epi8(_mm_cmpeq_epi16(m, _mm_set1_epi16((short)0xFC00))) != 0xFFFF;
    }
    alignas(32) float mraw[8];
    return fa_tile_mask(mp, ms_stride, mtype, j0, nkv, mraw);
}

// The first tile of each chunk of a mask row (FaChunks' rule) into starts[1..], their count into starts[0]
GP_INLINE void fa_chunk_starts(const uint8_t* mp, int64_t ms_stride, int mtype, int64_t nkv, int32_t* starts) {
    int32_t nch = 0;
    FaChunks chunks;
    for (int64_t t = 0; t < (nkv + 7) / 8; ++t)
        if (fa_tile_visible(mp, ms_stride, mtype, 8 * t, nkv) && chunks.next()) starts[1 + nch++] = (int32_t)t;
    starts[0] = nch;
}

// Chunk c's keys [*jb, *je): from its first visible tile to the next chunk's (or the end)
GP_INLINE void fa_chunk_keys(const int32_t* starts, int64_t c, int64_t nkv, int64_t* jb, int64_t* je) {
    *jb = 8 * (int64_t)starts[1 + c];
    *je = c + 1 < starts[0] ? 8 * (int64_t)starts[2 + c] : nkv;
}

// One head's softmax over keys [0, Nkv) (a whole row, or one chunk of it), its result merged into (tot, *M_tot,
// *S_tot) chunk by chunk: FA_CHUNK_TILES visible tiles of 8 keys each, an online softmax within a chunk. DV8 > 0:
// Dv = 8 * DV8, the chunk accumulated in registers; DV8 == 0: any Dv that is a multiple of 8, the chunk in cbuf[Dv].
template <int DV8>
static void fa_row_tiles(const float* qf, int64_t D, const uint8_t* kb, int64_t ks, bool kf16, const uint8_t* vb,
                         int64_t vs, bool vf16, int64_t Nkv, const uint8_t* mp, int64_t ms_stride, int mtype,
                         float slope, float scale, float softcap, int64_t Dv, float* cbuf, float* tot, float* M_tot,
                         double* S_tot, bool cold) {
    constexpr bool regs = DV8 > 0;
    __m256 acc[regs ? DV8 : 1];
    alignas(32) float spill[regs ? DV8 * 8 : 8];
    if constexpr (regs) Dv = 8 * DV8;
    float* const ca = regs ? spill : cbuf;  // the chunk's acc when merged
    float M = -INFINITY;
    double S = 0.0;
    FaChunks chunks;
    auto clear = [&]() {
        if constexpr (regs) {
            for (int i = 0; i < DV8; ++i) acc[i] = _mm256_setzero_ps();
        } else {
            for (int64_t i = 0; i < Dv; i += 8) _mm256_storeu_ps(cbuf + i, _mm256_setzero_ps());
        }
        M = -INFINITY;
        S = 0.0;
    };
    auto flush = [&]() {
        if constexpr (regs)
            for (int i = 0; i < DV8; ++i) _mm256_store_ps(spill + 8 * i, acc[i]);
        fa_merge(tot, M_tot, S_tot, ca, M, S, Dv);
    };
    clear();
    const int64_t es = kf16 ? 2 : 4;
    const int64_t kbytes = D * es, vbytes = Dv * (vf16 ? 2 : 4);
    for (int64_t j0 = 0; j0 < Nkv; j0 += 8) {
        prefetch_kv_rows(cold, kb, ks, kbytes, vb, vs, vbytes, j0 + 16, imin(j0 + 24, Nkv));  // the tile after next
        alignas(32) float mraw[8];
        if (!fa_tile_mask(mp, ms_stride, mtype, j0, Nkv, mraw)) continue;
        if (chunks.later()) {
            flush();
            clear();
        }
        const uint8_t* kr[8];
        for (int t = 0; t < 8; ++t) kr[t] = mraw[t] == -INFINITY ? nullptr : kb + (j0 + t) * ks;
        const __m256 sc = fa_logits8(fa_scores8(qf, D, kr, es, kf16), scale, softcap, slope, _mm256_load_ps(mraw));
        const float mt = hmax(sc);
        if (!(mt > -INFINITY)) continue;
        if (mt > M) {
            const float msc = fa_rescale(M, mt);
            M = mt;
            S *= msc;
            const __m256 vms = _mm256_set1_ps(msc);
            if constexpr (regs) {
                for (int i = 0; i < DV8; ++i) acc[i] = _mm256_mul_ps(acc[i], vms);
            } else {
                for (int64_t i = 0; i < Dv; i += 8)
                    _mm256_storeu_ps(cbuf + i, _mm256_mul_ps(_mm256_loadu_ps(cbuf + i), vms));
            }
        }
        const __m256 p = exp_ps(_mm256_sub_ps(sc, _mm256_set1_ps(M)));
        alignas(32) float pv[8];
        _mm256_store_ps(pv, p);
        S += (double)hsum(p);
        for (int t = 0; t < 8; ++t) {  // key by key, one FMA each (every kernel's order); masked keys skipped
            if (mraw[t] == -INFINITY) continue;
            const __m256 w = _mm256_set1_ps(pv[t]);
            const uint8_t* vr = vb + (j0 + t) * vs;
            if constexpr (regs) {
                for (int i = 0; i < DV8; ++i)
                    acc[i] = _mm256_fmadd_ps(w, load8(vr + 8 * i * (vf16 ? 2 : 4), vf16), acc[i]);
            } else {
                for (int64_t i = 0; i < Dv; i += 8)
                    _mm256_storeu_ps(cbuf + i, _mm256_fmadd_ps(w, load8(vr + i * (vf16 ? 2 : 4), vf16),
                                                               _mm256_loadu_ps(cbuf + i)));
            }
        }
    }
    if (chunks.vis) flush();
}

// A tile's step of one head's online softmax (fa_row_tiles'), from its 8 logits sc: its chunk state (acc[Dv] rescaled
// to a new maximum, M, S) updated, the keys' weights to pv[8] (all 0 when nothing of the tile is visible to the head).
template <int DV8>
GP_INLINE void fa_softmax_step(__m256 sc, float* acc, float* M, double* S, float* pv) {
    const float mt = hmax(sc);
    if (!(mt > -INFINITY)) {  // nothing of this tile for this head (as fa_row_tiles)
        _mm256_store_ps(pv, _mm256_setzero_ps());
        return;
    }
    if (mt > *M) {
        const float msc = fa_rescale(*M, mt);
        *M = mt;
        *S *= msc;
        const __m256 vms = _mm256_set1_ps(msc);
        for (int i = 0; i < DV8; ++i) _mm256_store_ps(acc + 8 * i, _mm256_mul_ps(_mm256_load_ps(acc + 8 * i), vms));
    }
    const __m256 p = exp_ps(_mm256_sub_ps(sc, _mm256_set1_ps(*M)));
    _mm256_store_ps(pv, p);
    *S += (double)hsum(p);
}

// Eight heads' softmax steps at once, lane by lane fa_softmax_step's arithmetic: their logits sc[8][8] become their
// keys' weights, their running maxima M and sums S move on, and msc gets the factor each head's sums so far take
// (fa_tile_values applies it as it loads them: the product fa_softmax_step stores). One step's chain (maximum,
// rescale, exp, sum) no longer waits on a branch per head. False, with nothing done, where a logit is NaN or a head
// sees none of the tile: fa_softmax_step then takes them one by one.
GP_INLINE bool fa_softmax_steps8(float (*sc)[8], float* M, double* S, float* msc) {
    __m256 s[8], nan = _mm256_setzero_ps();
    for (int i = 0; i < 8; ++i) {
        s[i] = _mm256_load_ps(sc[i]);
        nan = _mm256_or_ps(nan, _mm256_cmp_ps(s[i], s[i], _CMP_UNORD_Q));
    }
    // lane i: the maximum of s[i] (without NaNs, hmax's in any order)
    const __m256 t0 = _mm256_max_ps(_mm256_unpacklo_ps(s[0], s[1]), _mm256_unpackhi_ps(s[0], s[1]));
    const __m256 t1 = _mm256_max_ps(_mm256_unpacklo_ps(s[2], s[3]), _mm256_unpackhi_ps(s[2], s[3]));
    const __m256 t2 = _mm256_max_ps(_mm256_unpacklo_ps(s[4], s[5]), _mm256_unpackhi_ps(s[4], s[5]));
    const __m256 t3 = _mm256_max_ps(_mm256_unpacklo_ps(s[6], s[7]), _mm256_unpackhi_ps(s[6], s[7]));
    const __m256 u0 = _mm256_max_ps(_mm256_shuffle_ps(t0, t1, 0x44), _mm256_shuffle_ps(t0, t1, 0xee));
    const __m256 u1 = _mm256_max_ps(_mm256_shuffle_ps(t2, t3, 0x44), _mm256_shuffle_ps(t2, t3, 0xee));
    const __m256 mt = _mm256_max_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
    const __m256 ninf = _mm256_set1_ps(-INFINITY);
    if (_mm256_movemask_ps(nan) != 0 || _mm256_movemask_ps(_mm256_cmp_ps(mt, ninf, _CMP_GT_OQ)) != 0xff) return false;
    const __m256 Mo = _mm256_loadu_ps(M);
    const __m256 Mn = _mm256_blendv_ps(Mo, mt, _mm256_cmp_ps(mt, Mo, _CMP_GT_OQ));
    // fa_rescale(Mo, Mn); 1 exactly where the maximum stays (exp_ps(0))
    const __m256 f = _mm256_blendv_ps(exp_ps(_mm256_sub_ps(Mo, Mn)), _mm256_setzero_ps(),
                                      _mm256_cmp_ps(Mo, ninf, _CMP_EQ_OQ));
    _mm256_storeu_ps(M, Mn);
    _mm256_storeu_ps(msc, f);
    __m256 p[8];  // the weights exp(s[i] - Mn[i])
#if GP_AVX512
    for (int i = 0; i < 8; i += 2) {  // two heads a register: half the instructions of the steps' largest part
        const __m512i two = _mm512_setr_epi32(i, i, i, i, i, i, i, i, i + 1, i + 1, i + 1, i + 1, i + 1, i + 1, i + 1,
                                              i + 1);
        const __m512 e = exp512_ps(_mm512_sub_ps(_mm512_insertf32x8(_mm512_castps256_ps512(s[i]), s[i + 1], 1),
                                                 _mm512_permutexvar_ps(two, _mm512_castps256_ps512(Mn))));
        _mm512_storeu_ps(sc[i], e);
        p[i] = _mm512_castps512_ps256(e);
        p[i + 1] = _mm512_extractf32x8_ps(e, 1);
    }
#else
    for (int i = 0; i < 8; ++i) {
        p[i] = exp_ps(_mm256_sub_ps(s[i], _mm256_permutevar8x32_ps(Mn, _mm256_set1_epi32(i))));
        _mm256_store_ps(sc[i], p[i]);
    }
#endif
    const __m256d f0 = _mm256_cvtps_pd(_mm256_castps256_ps128(f)), f1 = _mm256_cvtps_pd(_mm256_extractf128_ps(f, 1));
    const __m256 vs = hsums8(p);  // *S = *S * msc + (double)hsum(p), as fa_softmax_step
    _mm256_storeu_pd(S, _mm256_add_pd(_mm256_mul_pd(_mm256_loadu_pd(S), f0),
                                      _mm256_cvtps_pd(_mm256_castps256_ps128(vs))));
    _mm256_storeu_pd(S + 4, _mm256_add_pd(_mm256_mul_pd(_mm256_loadu_pd(S + 4), f1),
                                          _mm256_cvtps_pd(_mm256_extractf128_ps(vs, 1))));
    return true;
}

// One tile of 8 keys for the G query heads that share one KV head, in three parts: fa_tile_scores, the partial sums
// of q.k (rows kt, ks bytes apart); a softmax step for each head (fa_logits8, fa_softmax_step); fa_tile_values, the
// values (rows vt) weighted into each head's chunk sums. Each block of 8 key or value elements is converted from F16
// once and used by all G heads, which cuts the conversions, the larger part of the per-key work, to 1/G; the
// arithmetic of each head is fa_row_tiles' (G = 1 included).
// Fixed: D == Dv and F16 keys and values (every model's decode), known at compile time, so the loops unroll fully.
// Full: every key of the tile visible (mraw all finite; most tiles), known at compile time: no key tested a head.
template <int DV8, int G, bool Fixed, bool Full = false>
GP_INLINE void fa_tile_scores(const float* qf, int64_t D, const uint8_t* kt, int64_t ks, bool kf16, const float* mraw,
                              __m256 (*part)[8]) {
    if constexpr (Fixed) {
        D = DV8 * 8;
        kf16 = true;
    }
    const int64_t kes = kf16 ? 2 : 4;
#if GP_AVX512
    // 16 elements a register, lanes 0-7 the first chain's blocks and 8-15 the second's, so each lane's FMAs and the
    // chains' sum are fa_scores8's: KT keys at a time for all G heads (16 sums in registers), each query block loaded
    // once for KT keys where 8 wide every FMA loaded its own (the 1B shape's decode attention, harness: -8%). One head
    // a KV head stays 8 wide: each F16 block feeds one FMA there, and Zen 4 converts 16 of them a cycle 8 wide, 12 16
    // wide (SmolLM2-1.7B's 32 heads, 128 keys from L2: 27 -> 22 us with the values below 8 wide too)
    if constexpr (Fixed && DV8 % 2 == 0 && G >= 2 && G <= 8) {
        bool all = true;
        if constexpr (!Full)
            for (int t = 0; t < 8; ++t) all &= mraw[t] != -INFINITY;
        if (all) {
            constexpr int KT = G <= 2 ? 8 : G <= 4 ? 4 : 2;  // keys a pass: a divisor of 8, G x KT <= 16 sums
            for (int t0 = 0; t0 < 8; t0 += KT) {
                __m512 a[G][KT];
                for (int g = 0; g < G; ++g)
                    for (int t = 0; t < KT; ++t) a[g][t] = _mm512_setzero_ps();
                for (int64_t i = 0; i < D; i += 16) {
                    __m512 kz[KT];
                    for (int t = 0; t < KT; ++t)
                        kz[t] = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(kt + (t0 + t) * ks + i * 2)));
                    for (int g = 0; g < G; ++g) {
                        const __m512 qz = _mm512_loadu_ps(qf + g * D + i);
                        for (int t = 0; t < KT; ++t) a[g][t] = _mm512_fmadd_ps(qz, kz[t], a[g][t]);
                    }
                }
                for (int g = 0; g < G; ++g)
                    for (int t = 0; t < KT; ++t)
                        part[g][t0 + t] = _mm256_add_ps(_mm512_castps512_ps256(a[g][t]),
                                                        _mm512_extractf32x8_ps(a[g][t], 1));
            }
            return;
        }
    }
#endif
    // one head's query in registers while its 8 keys pass (Fixed, one head of at most 64 elements)
    constexpr bool qregs = Fixed && G == 1 && DV8 <= 8;
    __m256 qv[qregs ? DV8 : 1];
    if constexpr (qregs)
        for (int i = 0; i < DV8; ++i) qv[i] = _mm256_loadu_ps(qf + 8 * i);
    for (int t = 0; t < 8; ++t) {  // fa_scores8's two chains, for G heads at once
        __m256 a0[G], a1[G];
        for (int g = 0; g < G; ++g) a0[g] = a1[g] = _mm256_setzero_ps();
        if (Full || mraw[t] != -INFINITY) {
            const uint8_t* kr = kt + t * ks;
            int64_t i = 0;
            for (; i + 16 <= D; i += 16) {
                const __m256 k0 = load8(kr + i * kes, kf16), k1 = load8(kr + (i + 8) * kes, kf16);
                if constexpr (qregs) {
                    a0[0] = _mm256_fmadd_ps(qv[i / 8], k0, a0[0]);
                    a1[0] = _mm256_fmadd_ps(qv[i / 8 + 1], k1, a1[0]);
                    continue;
                }
                for (int g = 0; g < G; ++g) {
                    a0[g] = _mm256_fmadd_ps(_mm256_loadu_ps(qf + g * D + i), k0, a0[g]);
                    a1[g] = _mm256_fmadd_ps(_mm256_loadu_ps(qf + g * D + i + 8), k1, a1[g]);
                }
            }
            for (; i < D; i += 8) {
                const __m256 k0 = load8(kr + i * kes, kf16);
                for (int g = 0; g < G; ++g) a0[g] = _mm256_fmadd_ps(_mm256_loadu_ps(qf + g * D + i), k0, a0[g]);
            }
        }
        for (int g = 0; g < G; ++g) part[g][t] = _mm256_add_ps(a0[g], a1[g]);
    }
}

// The values of a tile (rows vt, vs bytes apart) weighted by the G heads' weights pv into their chunk sums
// acc[g * Dv ...] (first times msc[g], where given), key by key in order; only the keys mraw shows (a masked row may
// hold anything: never read).
template <int DV8, int G, bool Fixed, bool Full = false>
GP_INLINE void fa_tile_values(const float (*pv)[8], const uint8_t* vt, int64_t vs, bool vf16, const float* mraw,
                              float* acc, const float* msc = nullptr) {
    constexpr int64_t Dv = DV8 * 8;
    if constexpr (Fixed) vf16 = true;
    const int64_t ves = vf16 ? 2 : 4;
    // NB blocks of 8 elements of the G heads' sums in registers at a time (8 registers), key by key inside, so that
    // the NB x G sums advance side by side (one block at a time was a chain of 8 dependent FMAs)
    int vis[8], nv = 0;  // the visible keys (Full: 0-7, a loop of 8 the compiler unrolls)
    if constexpr (!Full)
        for (int t = 0; t < 8; ++t)
            if (mraw[t] != -INFINITY) vis[nv++] = t;
    if constexpr (Full) nv = 8;
#if GP_AVX512
    if constexpr (Fixed && DV8 % 2 == 0 && G >= 2 && G <= 16) {  // 16 lanes, the same FMAs lane by lane (G = 1: above)
        constexpr int DZ = DV8 / 2, NZ = 16 / G < DZ ? 16 / G : DZ;
        for (int i0 = 0; i0 < DZ; i0 += NZ) {
            __m512 a[G][NZ];
            for (int g = 0; g < G; ++g)
                for (int i = 0; i < NZ; ++i)
                    a[g][i] = msc ? _mm512_mul_ps(_mm512_load_ps(acc + g * Dv + 16 * (i0 + i)), _mm512_set1_ps(msc[g]))
                                  : _mm512_load_ps(acc + g * Dv + 16 * (i0 + i));
            for (int u = 0; u < nv; ++u) {
                const int t = Full ? u : vis[u];
                __m512 vv[NZ];
                for (int i = 0; i < NZ; ++i)
                    vv[i] = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(vt + t * vs + 32 * (i0 + i))));
                for (int g = 0; g < G; ++g) {
                    const __m512 w = _mm512_set1_ps(pv[g][t]);
                    for (int i = 0; i < NZ; ++i) a[g][i] = _mm512_fmadd_ps(w, vv[i], a[g][i]);
                }
            }
            for (int g = 0; g < G; ++g)
                for (int i = 0; i < NZ; ++i) _mm512_store_ps(acc + g * Dv + 16 * (i0 + i), a[g][i]);
        }
        return;
    }
#endif
    constexpr int NB = G >= 8 ? 1 : 8 / G;
    for (int i0 = 0; i0 < DV8; i0 += NB) {
        constexpr int nb = NB < DV8 ? NB : DV8;
        __m256 a[G][nb];
        for (int g = 0; g < G; ++g)
            for (int i = 0; i < nb; ++i)
                a[g][i] = msc ? _mm256_mul_ps(_mm256_load_ps(acc + g * Dv + 8 * (i0 + i)), _mm256_set1_ps(msc[g]))
                              : _mm256_load_ps(acc + g * Dv + 8 * (i0 + i));
        for (int u = 0; u < nv; ++u) {
            const int t = Full ? u : vis[u];
            __m256 vv[nb];
            for (int i = 0; i < nb; ++i) vv[i] = load8(vt + t * vs + 8 * (i0 + i) * ves, vf16);
            for (int g = 0; g < G; ++g) {
                const __m256 w = _mm256_broadcast_ss(&pv[g][t]);
                for (int i = 0; i < nb; ++i) a[g][i] = _mm256_fmadd_ps(w, vv[i], a[g][i]);
            }
        }
        for (int g = 0; g < G; ++g)
            for (int i = 0; i < nb; ++i) _mm256_store_ps(acc + g * Dv + 8 * (i0 + i), a[g][i]);
    }
}

// One chunk of a decode step's keys (n of them, rows ks / vs bytes apart from kb / vb) for the NH KV heads [0, NH)
// of one query row (khs / vhs bytes apart within a row; G query heads each): tile by tile, every head's step before
// the next tile. A cache whose rows hold all KV heads side by side is so read as 8 rows advancing together; head by
// head over all keys, the reads were 128 bytes every 4 KB (SmolLM2-1.7B's 32 KV heads, 1000 keys, 2 threads: 0.92 ->
// 0.57-0.58 ms a layer from DRAM; without the prefetch of the tile after next 0.60-0.69, and SmolLM2-135M's decode
// at a 1000-token context 10% slower than head by head). Keys row by row (each head's accumulator in memory between
// keys) was 0.85 ms, and 15-20% slower for SmolLM2-135M.
// A tile goes in three passes over up to FA_TILE_HEADS heads: every head's logits, then every head's softmax step,
// then every head's values. Each step is a chain of dependent operations (maximum, exp, sums) that a head's scores
// and values cannot hide; side by side, independent, the steps of many heads overlap (one step a head and its values
// in turn, the next head's scores computed in between, left them 45% of the time: the 1B shape's 32 heads on 8, a
// 2000-key chunked decode, 1 thread, 0.53 -> 0.43 ms a layer; with fa_softmax_steps8 and the 16-wide scores and
// values 0.35-0.38, docs/simd.md). Each head's arithmetic is fa_row_tiles' over the same
// tiles, so the result is the same as head by head. The heads' chunk state (acc, M, S) is the caller's, set to 0,
// -inf, 0.
// R query rows at once (a prefill's consecutive rows whose chunks start at the same tiles; mask rows mrs bytes
// apart): a tile that every row sees whole is converted once for the R x G heads of a KV head, which share it as a
// group's heads do (the conversions, not the FMAs, bound a prefill's attention without GQA); a tile some row sees in
// part is taken row by row. Query h's state, query and slope are at index (hk * R + r) * G + g (one row: h).
template <int DV8, int G, int R, bool Fixed>
static void fa_chunk_heads_t(const float* qf, int64_t D, const uint8_t* kb, int64_t ks, int64_t khs, bool kf16,
                             const uint8_t* vb, int64_t vs, int64_t vhs, bool vf16, int64_t n, int64_t NH,
                             const uint8_t* mp, int64_t ms_stride, int64_t mrs, int mtype, const float* slope,
                             float scale, float softcap, float* acc, float* M, double* S, bool cold) {
    constexpr int64_t Dv = DV8 * 8;
    constexpr int GR = G * R;                                     // the query heads of one KV head
    constexpr int HB = FA_TILE_HEADS / GR > 0 ? FA_TILE_HEADS / GR : 1;  // KV heads a pass
    if constexpr (Fixed) D = Dv;
    const int64_t kbytes = Fixed ? 2 * Dv : D * (kf16 ? 2 : 4), vbytes = Fixed ? 2 * Dv : Dv * (vf16 ? 2 : 4);
    __m256 part[GR][8];
    alignas(32) float sc[HB * GR][8];  // the heads' logits, then their keys' weights
    alignas(32) float msc[HB * GR];    // the factor each head's sums so far take (fa_softmax_steps8)
    for (int64_t j0 = 0; j0 < n; j0 += 8) {
        alignas(32) float mraw[R][8];
        bool seen[R], any = false, whole = true;  // seen: row r sees a key of the tile; whole: every row every key
        for (int r = 0; r < R; ++r) {
            any |= seen[r] = fa_tile_mask(mp ? mp + r * mrs : nullptr, ms_stride, mtype, j0, n, mraw[r]);
            for (int t = 0; t < 8; ++t) whole &= mraw[r][t] != -INFINITY;
        }
        if (!any) continue;
        if (R > 1 && !whole) {  // some row sees part of the tile: each row's heads on their own
            for (int64_t hk = 0; hk < NH; ++hk)
                for (int r = 0; r < R; ++r) {
                    const int64_t h = (hk * R + r) * G;
                    if (!seen[r]) continue;
                    fa_tile_scores<DV8, G, Fixed>(qf + h * D, D, kb + hk * khs + j0 * ks, ks, kf16, mraw[r], part);
                    for (int g = 0; g < G; ++g)
                        fa_softmax_step<DV8>(fa_logits8(hsum_lanes8(part[g]), scale, softcap, slope[h + g],
                                                        _mm256_load_ps(mraw[r])),
                                             acc + (h + g) * Dv, M + h + g, S + h + g, sc[g]);
                    fa_tile_values<DV8, G, Fixed>(sc, vb + hk * vhs + j0 * vs, vs, vf16, mraw[r], acc + h * Dv);
                }
            continue;
        }
        // the passes, for a tile seen whole (Full: no key tested, a head at a time) or, one row, in part
        auto passes = [&](auto full) {
            constexpr bool Full = decltype(full)::value;
            for (int64_t hk0 = 0; hk0 < NH; hk0 += HB) {
                const int64_t nk = imin(HB, NH - hk0), h0 = hk0 * GR;
                for (int64_t i = 0; i < nk; ++i) {  // each head's logits (head g of a KV head: row g / G's mask)
                    fa_tile_scores<DV8, GR, Fixed, Full>(qf + (h0 + i * GR) * D, D, kb + (hk0 + i) * khs + j0 * ks,
                                                         ks, kf16, mraw[0], part);
                    for (int g = 0; g < GR; ++g)
                        _mm256_store_ps(sc[i * GR + g],
                                        fa_logits8(hsum_lanes8(part[g]), scale, softcap, slope[h0 + i * GR + g],
                                                   _mm256_load_ps(mraw[g / G])));
                }
                auto values = [&](int64_t i) {  // KV head hk0 + i's values, for its GR heads
                    const int64_t hk = hk0 + i;
                    prefetch_kv_rows(cold, kb + hk * khs, ks, kbytes, vb + hk * vhs, vs, vbytes, j0 + 16,
                                     imin(j0 + 24, n));
                    fa_tile_values<DV8, GR, Fixed, Full>(sc + i * GR, vb + hk * vhs + j0 * vs, vs, vf16, mraw[0],
                                                         acc + (h0 + i * GR) * Dv, msc + i * GR);
                };
                // each head's softmax step, its logits to its keys' weights, eight at a time where it can; a KV head's
                // values once its heads' steps are done, a group of steps behind (the last group's at the end), so that
                // the next steps' chains and these values' FMAs are in flight together
                const int64_t nh = nk * GR;
                int64_t done = 0;  // KV heads whose values are in
                for (int64_t i = 0; i < nh; i += 8) {
                    const int64_t e = imin(i + 8, nh);
                    if (e - i < 8 || !fa_softmax_steps8(sc + i, M + h0 + i, S + h0 + i, msc + i))
                        for (int64_t j = i; j < e; ++j) {
                            fa_softmax_step<DV8>(_mm256_load_ps(sc[j]), acc + (h0 + j) * Dv, M + h0 + j, S + h0 + j,
                                                 sc[j]);
                            msc[j] = 1.0f;
                        }
                    for (; done < nk && (done + 1) * GR <= (e == nh ? nh : i); ++done) values(done);
                }
            }
        };
        if (whole)
            passes(std::true_type{});
        else
            passes(std::false_type{});
    }
}

template <int DV8, int G>
static void fa_chunk_heads(const float* qf, int64_t D, const uint8_t* kb, int64_t ks, int64_t khs, bool kf16,
                           const uint8_t* vb, int64_t vs, int64_t vhs, bool vf16, int64_t n, int64_t NH,
                           const uint8_t* mp, int64_t ms_stride, int mtype, const float* slope, float scale,
                           float softcap, float* acc, float* M, double* S, bool cold) {
    if (D == DV8 * 8 && kf16 && vf16)
        fa_chunk_heads_t<DV8, G, 1, true>(qf, D, kb, ks, khs, kf16, vb, vs, vhs, vf16, n, NH, mp, ms_stride, 0, mtype,
                                          slope, scale, softcap, acc, M, S, cold);
    else
        fa_chunk_heads_t<DV8, G, 1, false>(qf, D, kb, ks, khs, kf16, vb, vs, vhs, vf16, n, NH, mp, ms_stride, 0,
                                           mtype, slope, scale, softcap, acc, M, S, cold);
}

// fa_chunk_heads for Dv in {32, 64, 128} and G in {1, 2, 3, 4}, one query row or (D == Dv, F16 keys and values)
// fa_block_rows(G) of them, mask rows mrs bytes apart; false for others
static bool fa_chunk_group(int64_t G, int64_t R, const float* qf, int64_t D, const uint8_t* kb, int64_t ks,
                           int64_t khs, bool kf16, const uint8_t* vb, int64_t vs, int64_t vhs, bool vf16, int64_t n,
                           int64_t NH, const uint8_t* mp, int64_t ms_stride, int64_t mrs, int mtype,
                           const float* slope, float scale, float softcap, int64_t Dv, float* acc, float* M, double* S,
                           bool cold) {
#define GP_FA_CH(DV8, GG)                                                                                           \
    if (Dv == DV8 * 8 && G == GG) {                                                                                 \
        constexpr int RB = fa_block_rows(GG);                                                                       \
        if (R == 1)                                                                                                 \
            fa_chunk_heads<DV8, GG>(qf, D, kb, ks, khs, kf16, vb, vs, vhs, vf16, n, NH, mp, ms_stride, mtype,       \
                                    slope, scale, softcap, acc, M, S, cold);                                        \
        else if (R == RB && D == Dv && kf16 && vf16)                                                                \
            fa_chunk_heads_t<DV8, GG, RB, true>(qf, D, kb, ks, khs, kf16, vb, vs, vhs, vf16, n, NH, mp, ms_stride,  \
                                                mrs, mtype, slope, scale, softcap, acc, M, S, cold);                \
        else                                                                                                        \
            return false;                                                                                           \
        return true;                                                                                                \
    }
    GP_FA_CH(4, 1) GP_FA_CH(4, 2) GP_FA_CH(4, 3) GP_FA_CH(4, 4)
    GP_FA_CH(8, 1) GP_FA_CH(8, 2) GP_FA_CH(8, 3) GP_FA_CH(8, 4)
    GP_FA_CH(16, 1) GP_FA_CH(16, 2) GP_FA_CH(16, 3) GP_FA_CH(16, 4)
#undef GP_FA_CH
    return false;
}

// fa_row_tiles: the chunk in registers for Dv in {32, 64, 128}, in cbuf[Dv] for other Dv. The head's result goes
// to tot[Dv], *M, *S (which the caller sets to -inf and 0).
static void fa_row(const float* qf, int64_t D, const uint8_t* kb, int64_t ks, bool kf16, const uint8_t* vb,
                   int64_t vs, bool vf16, int64_t Nkv, const uint8_t* mp, int64_t ms_stride, int mtype, float slope,
                   float scale, float softcap, int64_t Dv, float* cbuf, float* tot, float* M, double* S, bool cold) {
#define GP_FA_ROW(DV8)                                                                                               \
    return fa_row_tiles<DV8>(qf, D, kb, ks, kf16, vb, vs, vf16, Nkv, mp, ms_stride, mtype, slope, scale, softcap, Dv, \
                             cbuf, tot, M, S, cold)
    if (Dv == 32) GP_FA_ROW(4);
    if (Dv == 64) GP_FA_ROW(8);
    if (Dv == 128) GP_FA_ROW(16);
    GP_FA_ROW(0);
#undef GP_FA_ROW
}
#endif

// One KV head's keys and values: rows ks / vs bytes apart, F16 or F32 elements side by side.
struct FaKV {
    const uint8_t* kb;
    int64_t ks;
    bool kf16;
    const uint8_t* vb;
    int64_t vs;
    bool vf16;
};

#if GP_AVX2
// All G query heads that share one KV head, for one query row: each tile of 8 keys and values is converted to F32
// once and used by every head (GQA); each head's arithmetic is fa_row_tiles'. scratch: 8*D + 8*Dv + G*(D + 2*Dv)
// floats + 2*G floats + 2*G doubles.
static void fa_group(const Node& n, int64_t iq, int64_t hk, int64_t b, float* scratch, const FaKV& kv) {
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
    float* acc = qs + G * D;          // G x Dv: the chunk
    float* tot = acc + G * Dv;        // G x Dv: the chunks before it, merged
    float* Ms = tot + G * Dv;         // G
    float* Mt = Ms + G;               // G
    double* Ss = (double*)(((uintptr_t)(Mt + G) + 7) & ~(uintptr_t)7);  // G
    double* St = Ss + G;              // G
    float slope[64];
    const int64_t h0 = hk * G;
    FaChunks chunks;
    auto clear = [&]() {
        for (int64_t i = 0; i < G * Dv; i += 8) _mm256_storeu_ps(acc + i, _mm256_setzero_ps());
        for (int64_t g = 0; g < G; ++g) {
            Ms[g] = -INFINITY;
            Ss[g] = 0.0;
        }
    };
    auto flush = [&]() {
        for (int64_t g = 0; g < G; ++g) fa_merge(tot + g * Dv, Mt + g, St + g, acc + g * Dv, Ms[g], Ss[g], Dv);
    };
    for (int64_t g = 0; g < G; ++g) {
        const uint8_t* qp = q.data + iq * q.nb[1] + (h0 + g) * q.nb[2] + b * q.nb[3];
        for (int64_t i = 0; i < D; ++i) qs[g * D + i] = *(const float*)(qp + i * q.nb[0]);
        Mt[g] = -INFINITY;
        St[g] = 0.0;
        if (g < 64) slope[g] = alibi_slope_fa(max_bias, h0 + g, H);
    }
    clear();
    const uint8_t *kb = kv.kb, *vb = kv.vb;
    const bool kf = kv.kf16, vf = kv.vf16;
    const uint8_t* mp = has_mask ? mk.data + iq * mk.nb[1] + (h0 % mk.ne[2]) * mk.nb[2] + (b % mk.ne[3]) * mk.nb[3]
                                 : nullptr;
    for (int64_t j0 = 0; j0 < Nkv; j0 += 8) {
        alignas(32) float mraw[8];
        if (!fa_tile_mask(mp, has_mask ? mk.nb[0] : 0, mk.type, j0, Nkv, mraw)) continue;
        if (chunks.later()) {
            flush();
            clear();
        }
        for (int t = 0; t < 8; ++t) {  // convert the tile (masked keys: zeros, their scores 0 as fa_scores8's)
            float* kd = kt + t * D;
            float* vd = vt + t * Dv;
            if (mraw[t] == -INFINITY) {
                for (int64_t i = 0; i < D; i += 8) _mm256_storeu_ps(kd + i, _mm256_setzero_ps());
                continue;
            }
            const uint8_t* ks = kb + (j0 + t) * kv.ks;
            const uint8_t* vs = vb + (j0 + t) * kv.vs;
            for (int64_t i = 0; i < D; i += 8) _mm256_storeu_ps(kd + i, load8(ks + i * (kf ? 2 : 4), kf));
            for (int64_t i = 0; i < Dv; i += 8) _mm256_storeu_ps(vd + i, load8(vs + i * (vf ? 2 : 4), vf));
        }
        const __m256 vmr = _mm256_load_ps(mraw);
        for (int64_t g = 0; g < G; ++g) {
            const float sl = g < 64 ? slope[g] : alibi_slope_fa(max_bias, h0 + g, H);
            const float* qg = qs + g * D;
            __m256 part[8];
            for (int t = 0; t < 8; ++t) {  // fa_scores8's two chains, on the converted tile
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
            const __m256 sc = fa_logits8(hsum_lanes8(part), scale, softcap, sl, vmr);
            const float mt = hmax(sc);
            if (!(mt > -INFINITY)) continue;
            float* ag = acc + g * Dv;
            if (mt > Ms[g]) {
                const float msc = fa_rescale(Ms[g], mt);
                Ms[g] = mt;
                Ss[g] *= msc;
                const __m256 vms = _mm256_set1_ps(msc);
                for (int64_t i = 0; i < Dv; i += 8) _mm256_storeu_ps(ag + i, _mm256_mul_ps(_mm256_loadu_ps(ag + i), vms));
            }
            const __m256 p = exp_ps(_mm256_sub_ps(sc, _mm256_set1_ps(Ms[g])));
            Ss[g] += (double)hsum(p);
            alignas(32) float pv[8];
            _mm256_store_ps(pv, p);
            int nz[8], nn = 0;  // the unmasked keys, in order
            for (int t = 0; t < 8; ++t)
                if (mraw[t] != -INFINITY) nz[nn++] = t;
            __m256 w[8];
            for (int e = 0; e < nn; ++e) w[e] = _mm256_set1_ps(pv[nz[e]]);
            int64_t i = 0;
            for (; i + 64 <= Dv; i += 64) {  // eight blocks at a time: eight independent FMA chains
                __m256 a[8];
                for (int r = 0; r < 8; ++r) a[r] = _mm256_loadu_ps(ag + i + 8 * r);
                if (nn == 8) {  // the whole tile visible (most tiles): a fixed, unrolled loop
                    for (int e = 0; e < 8; ++e) {
                        const float* vr = vt + e * Dv + i;
                        for (int r = 0; r < 8; ++r) a[r] = _mm256_fmadd_ps(w[e], _mm256_loadu_ps(vr + 8 * r), a[r]);
                    }
                } else {
                    for (int e = 0; e < nn; ++e) {
                        const float* vr = vt + nz[e] * Dv + i;
                        for (int r = 0; r < 8; ++r) a[r] = _mm256_fmadd_ps(w[e], _mm256_loadu_ps(vr + 8 * r), a[r]);
                    }
                }
                for (int r = 0; r < 8; ++r) _mm256_storeu_ps(ag + i + 8 * r, a[r]);
            }
            for (; i < Dv; i += 8) {
                __m256 a = _mm256_loadu_ps(ag + i);
                for (int e = 0; e < nn; ++e) a = _mm256_fmadd_ps(w[e], _mm256_loadu_ps(vt + nz[e] * Dv + i), a);
                _mm256_storeu_ps(ag + i, a);
            }
        }
    }
    if (chunks.vis) flush();
    for (int64_t g = 0; g < G; ++g) {
        const float inv = St[g] == 0.0 ? 0.0f : (float)(1.0 / St[g]);
        uint8_t* op = dst.data + (h0 + g) * dst.nb[1] + iq * dst.nb[2] + b * dst.nb[3];
        const float* ag = tot + g * Dv;
        for (int64_t i = 0; i < Dv; ++i) *(float*)(op + i * dst.nb[0]) = Mt[g] > -INFINITY ? ag[i] * inv : 0.0f;
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
    // the vector kernels' condition: blocks of 8 elements, elements side by side
    const bool groupable = (D % 8) == 0 && (Dv % 8) == 0 && k.nb[0] == type_size(k.type) &&
                           v.nb[0] == type_size(v.type);
    float* const ts = (float*)ctx.thread_scratch(ith);
    const int64_t mstride = has_mask ? mk.nb[0] : 0;
    auto mask_of = [&](int64_t iq, int64_t h, int64_t b) -> const uint8_t* {
        return has_mask ? mk.data + iq * mk.nb[1] + (h % mk.ne[2]) * mk.nb[2] + (b % mk.ne[3]) * mk.nb[3] : nullptr;
    };
    // a head's result normalised into dst (0 where no key was visible: any false)
    auto out_head = [&](int64_t iq, int64_t h, int64_t b, const float* acc, double S, bool any) {
        const float inv = S == 0.0 ? 0.0f : (float)(1.0 / S);
        uint8_t* op = dst.data + h * dst.nb[1] + iq * dst.nb[2] + b * dst.nb[3];
        for (int64_t i = 0; i < Dv; ++i) *(float*)(op + i * dst.nb[0]) = any ? acc[i] * inv : 0.0f;
    };
    auto query_of = [&](int64_t iq, int64_t h, int64_t b, float* qf) {
        const uint8_t* qp = q.data + iq * q.nb[1] + h * q.nb[2] + b * q.nb[3];
        for (int64_t i = 0; i < D; ++i) qf[i] = *(const float*)(qp + i * q.nb[0]);
    };
    auto kv_of = [&](int64_t hk, int64_t b) {
        return FaKV{k.data + hk * k.nb[2] + b * k.nb[3], k.nb[1], k.type == T_F16,
                    v.data + hk * v.nb[2] + b * v.nb[3], v.nb[1], v.type == T_F16};
    };
    // one head of one query row, its result to dst: with the vector kernels (fa_row) when vec, else key by key in
    // double (any layout; kv's elements of k's and v's types, k.nb[0] / v.nb[0] apart)
    auto row_head = [&](int64_t iq, int64_t h, int64_t b, const FaKV& kv, bool vec) {
        float* acc = ts;
        float* qf = acc + ((Dv + 15) & ~15);
        float* kt = qf + ((D + 15) & ~15);  // fa_row's chunk, or one converted value row
        query_of(iq, h, b, qf);
        const uint8_t* mp = mask_of(iq, h, b);
        const float slope = alibi_slope_fa(max_bias, h, H);
        for (int64_t i = 0; i < Dv; ++i) acc[i] = 0.0f;
        float M = -INFINITY;
        double S = 0.0;
#if GP_AVX2
        if (vec) {
            fa_row(qf, D, kv.kb, kv.ks, kv.kf16, kv.vb, kv.vs, kv.vf16, Nkv, mp, mstride, mk.type,
                   slope, scale, softcap, Dv, kt, acc, &M, &S, Nq < FA_COPY_MIN_ROWS);
            if (!(M > -INFINITY)) S = 0.0;  // no key: acc was never written
        } else
#else
        (void)vec;
#endif
        {
            for (int64_t j = 0; j < Nkv; ++j) {
                const float mvj = mp ? slope * load_elem(mp + j * mk.nb[0], mk.type) : 0.0f;
                if (mvj == -INFINITY) continue;
                const uint8_t* kr = kv.kb + j * kv.ks;
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
                const uint8_t* vr = kv.vb + j * kv.vs;
                for (int64_t i = 0; i < Dv; ++i) kt[i] = load_elem(vr + i * v.nb[0], v.type);
                for (int64_t i = 0; i < Dv; ++i) acc[i] += w * kt[i];
            }
        }
        out_head(iq, h, b, acc, S, S != 0.0);
    };

#if GP_AVX2
    const int64_t gunits = Nq * Hk * B;
    // the grouped-heads kernels read one mask for the heads of a group: the mask must not differ by head
    const bool one_mask = !has_mask || mk.ne[2] == 1;
    if (n.n_phases == 2 && groupable && (Dv == 32 || Dv == 64 || Dv == 128)) {
        // few query rows and KV heads (a decode step): split the keys too, so that both threads have work however
        // few heads there are ("flash decoding"), at the chunks every path uses (FA_CHUNK_TILES visible tiles).
        // Phase 0 leaves each (query row, head, chunk)'s partial result in the shared scratch (empty for a chunk
        // past the row's last); phase 1 merges a head's chunks in order, as the other paths do as they go.
        const int64_t ntiles = (Nkv + 7) / 8, nchmax = (ntiles + FA_CHUNK_TILES - 1) / FA_CHUNK_TILES;
        const int64_t heads = Nq * H * B, Hm = has_mask ? mk.ne[2] : 1, mrows = B * Nq * Hm;
        float* parts = (float*)ctx.wdata;
        const bool kf = k.type == T_F16, vf = v.type == T_F16;
        if (phase == 0) {
            // where each mask row's chunks start (its count, then the first tile of each), found by this call for
            // the rows it needs, in its own scratch after the query rows and the chunk buffer
            int32_t* starts = (int32_t*)(ts + FA_SPLIT_FLOATS(D, Dv, H));
            for (int64_t r = 0; r < mrows; ++r) starts[r * (nchmax + 1)] = -1;
            auto table = [&](int64_t iq, int64_t h, int64_t b) -> const int32_t* {
                int32_t* tb = starts + ((b * Nq + iq) * Hm + h % Hm) * (nchmax + 1);
                if (tb[0] < 0) fa_chunk_starts(mask_of(iq, h, b), mstride, mk.type, Nkv, tb);
                return tb;
            };
            auto empty = [&](float* pg) {  // a chunk past the row's last: merging it changes nothing
                pg[Dv] = -INFINITY;
                const double zero = 0.0;
                memcpy(pg + Dv + 2, &zero, sizeof(double));
            };
            float* qf = ts;
            if (rep <= 4 && one_mask) {
                // a query row's chunk for a block of consecutive KV heads (all of them once there are enough chunks
                // to keep the threads busy) tile by tile, heads inner (fa_chunk_heads): units are (chunk, row,
                // head block), chunk-major, so each thread streams its own range of cache rows. One unit each: nth
                // already counts several units a thread (Plan::schedule_tasks), and a block of one head loses the
                // pipelining of its heads (at 4 units a thread, SmolLM2-1.7B's 32 heads at a 16-token context ran one
                // head a unit: 1.7-1.9 ms of attention a decode step at 2 threads, 1.0 ms with 4 heads a unit)
                const int64_t rows = Nq * B, per_row = nchmax * rows;
                const int64_t nhb = imin(Hk, imax(1, (nth + per_row - 1) / per_row)), hper = (Hk + nhb - 1) / nhb;
                const FaState st(qf + H * D, H, Dv);
                float* slope = st.end(H);
                int64_t u0, u1;
                split_range(per_row * nhb, ith, nth, &u0, &u1);
                for (int64_t u = u0; u < u1; ++u) {
                    const int64_t c = u / (rows * nhb), r = (u / nhb) % rows, hb = u % nhb;
                    const int64_t iq = r % Nq, b = r / Nq, hk0 = hb * hper, nh = imin(Hk, hk0 + hper) - hk0;
                    if (nh <= 0) continue;
                    const int64_t h0 = hk0 * rep, nq = nh * rep;
                    const int32_t* tb = table(iq, h0, b);
                    float* p0 = parts + (((b * Nq + iq) * H + h0) * nchmax + c) * FA_PART(Dv);  // head h0's part
                    if (c >= tb[0]) {
                        for (int64_t g = 0; g < nq; ++g) empty(p0 + g * nchmax * FA_PART(Dv));
                        continue;
                    }
                    int64_t jb, je;
                    fa_chunk_keys(tb, c, Nkv, &jb, &je);
                    for (int64_t g = 0; g < nq; ++g) {
                        query_of(iq, h0 + g, b, qf + g * D);
                        slope[g] = alibi_slope_fa(max_bias, h0 + g, H);
                        st.clear(g, Dv);
                    }
                    const uint8_t* mp = mask_of(iq, h0, b);
                    fa_chunk_group(rep, 1, qf, D, k.data + hk0 * k.nb[2] + b * k.nb[3] + jb * k.nb[1], k.nb[1],
                                   k.nb[2], kf, v.data + hk0 * v.nb[2] + b * v.nb[3] + jb * v.nb[1], v.nb[1], v.nb[2],
                                   vf, je - jb, nh, mp ? mp + jb * mk.nb[0] : nullptr, mstride, 0, mk.type, slope,
                                   scale, softcap, Dv, st.acc, st.M, st.S, true);
                    for (int64_t g = 0; g < nq; ++g) {  // each head's chunk merged into its empty part
                        float* pg = p0 + g * nchmax * FA_PART(Dv);
                        empty(pg);
                        double St = 0.0;
                        fa_merge(pg, pg + Dv, &St, st.acc + g * Dv, st.M[g], st.S[g], Dv);
                        memcpy(pg + Dv + 2, &St, sizeof(double));
                    }
                }
                return;
            }
            float* cbuf = qf + rep * D;
            int64_t u0, u1;
            split_range(heads * nchmax, ith, nth, &u0, &u1);
            for (int64_t u = u0; u < u1; ++u) {
                // chunk-major: a thread takes whole ranges of keys for every head, so the cache rows (all KV heads
                // side by side) are read once, in order, and the heads sharing them find them in cache (head-major
                // order was 4-6% slower per decode step at a 1000-token context)
                const int64_t hu = u % heads, c = u / heads;
                const int64_t h = hu % H, iq = (hu / H) % Nq, b = hu / (H * Nq), hk = h / rep;
                const int32_t* tb = table(iq, h, b);
                float* pg = parts + (hu * nchmax + c) * FA_PART(Dv);  // phase 1 reads a head's chunks side by side
                if (c >= tb[0]) {
                    empty(pg);
                    continue;
                }
                int64_t jb, je;
                fa_chunk_keys(tb, c, Nkv, &jb, &je);
                query_of(iq, h, b, qf);
                const uint8_t* mp = mask_of(iq, h, b);
                pg[Dv] = -INFINITY;
                double S = 0.0;
                fa_row(qf, D, k.data + hk * k.nb[2] + b * k.nb[3] + jb * k.nb[1], k.nb[1], kf,
                       v.data + hk * v.nb[2] + b * v.nb[3] + jb * v.nb[1], v.nb[1], vf, je - jb,
                       mp ? mp + jb * mk.nb[0] : nullptr, mstride, mk.type, alibi_slope_fa(max_bias, h, H), scale,
                       softcap, Dv, cbuf, pg, pg + Dv, &S, true);
                memcpy(pg + Dv + 2, &S, sizeof(double));
            }
            return;
        }
        int64_t u0, u1;
        split_range(heads, ith, nth, &u0, &u1);
        float* acc = ts;
        for (int64_t hu = u0; hu < u1; ++hu) {  // one head of one query row: merge its chunks, in order
            const int64_t h = hu % H, iq = (hu / H) % Nq, b = hu / (H * Nq);
            const float* p0 = parts + hu * nchmax * FA_PART(Dv);
            float M = -INFINITY;
            double S = 0.0;
            for (int64_t c = 0; c < nchmax; ++c) {
                const float* pg = p0 + c * FA_PART(Dv);
                double s;
                memcpy(&s, pg + Dv + 2, sizeof(double));
                fa_merge(acc, &M, &S, pg, pg[Dv], s, Dv);
            }
            out_head(iq, h, b, acc, S, M > -INFINITY);
        }
        return;
    }
    if (phase != n.n_phases - 1) return;  // the split-key phases run only with the vector kernels
    const bool grouped = rep >= 2 && groupable && one_mask;
    if (groupable && one_mask && rep <= 4 && Nq >= FA_COPY_MIN_ROWS && (Dv == 32 || Dv == 64 || Dv == 128)) {
        // many query rows (a prefill): each row over all KV heads in place, chunk by chunk, with the decode path's
        // kernel (fa_chunk_heads, which reads a row's heads side by side and pipelines them), its chunks merged in
        // order as the split decode path does: the same bits. With GQA twice the MACs a second of the per-row grouped
        // kernel over F32 copies (Llama-3.2-1B shape, 128 rows over 512 keys, 1 thread: 7.3 -> 14.2 GMAC/s); without
        // (SmolLM2-1.7B's 32 heads, a 512-token prompt in 128-row steps, 1 thread, a Zen 4) 274 -> 236 ms a step.
        // Rows go in blocks of fa_block_rows(rep) whose chunks start at the same tiles (all but a block that spans a
        // chunk's end under a causal mask), which share each tile's conversion (fa_chunk_heads_t): SmolLM2-1.7B's
        // shape (no GQA), Q6_K, a 512-token prompt in 128-row steps, 1 thread, three interleaved runs: attention
        // 232-272 ms a prompt one row at a time, 182-202 four rows a block, 164-168 eight.
        const bool fixed = D == Dv && k.type == T_F16 && v.type == T_F16;
        const int64_t RB = fixed ? fa_block_rows((int)rep) : 1, HB = RB * H;
        const int64_t nch = ((Nkv + 7) / 8 + FA_CHUNK_TILES - 1) / FA_CHUNK_TILES;
        float* qf = ts;
        const FaState st(qf + HB * D, HB, Dv), tot(ts + FA_SPLIT_FLOATS(D, Dv, HB), HB, Dv);  // a chunk's, the rows'
        float* slope = st.end(HB);
        int32_t* starts = (int32_t*)tot.end(HB);  // each row's chunk table, nch + 1 apart
        // units of a block of rows where there are enough blocks for every unit, else of a row
        const int64_t per = B * ((Nq + RB - 1) / RB) >= nth ? RB : 1, nu = (Nq + per - 1) / per;  // units a batch
        int64_t u0, u1;
        split_range(B * nu, ith, nth, &u0, &u1);
        for (int64_t u = u0; u < u1; ++u) {
            const int64_t b = u / nu, iq_end = imin(Nq, (u % nu + 1) * per);
            for (int64_t iq0 = u % nu * per, R; iq0 < iq_end; iq0 += R) {
                R = iq0 + RB <= iq_end ? RB : 1;
                for (int64_t i = 0; i < R; ++i)
                    fa_chunk_starts(mask_of(iq0 + i, 0, b), mstride, mk.type, Nkv, starts + i * (nch + 1));
                for (int64_t i = 1; i < R; ++i)
                    if (memcmp(starts, starts + i * (nch + 1), sizeof(int32_t) * (1 + starts[0])) != 0) R = 1;
                // query h of row iq0 + i where fa_chunk_heads_t takes it
                auto at = [&](int64_t h, int64_t i) { return (h / rep * R + i) * rep + h % rep; };
                for (int64_t i = 0; i < R; ++i)
                    for (int64_t h = 0; h < H; ++h) {
                        query_of(iq0 + i, h, b, qf + at(h, i) * D);
                        slope[at(h, i)] = alibi_slope_fa(max_bias, h, H);
                        tot.M[at(h, i)] = -INFINITY;
                        tot.S[at(h, i)] = 0.0;
                    }
                const uint8_t* mp = mask_of(iq0, 0, b);
                for (int64_t c = 0; c < starts[0]; ++c) {
                    int64_t jb, je;
                    fa_chunk_keys(starts, c, Nkv, &jb, &je);
                    for (int64_t h = 0; h < R * H; ++h) st.clear(h, Dv);
                    fa_chunk_group(rep, R, qf, D, k.data + b * k.nb[3] + jb * k.nb[1], k.nb[1], k.nb[2],
                                   k.type == T_F16, v.data + b * v.nb[3] + jb * v.nb[1], v.nb[1], v.nb[2],
                                   v.type == T_F16, je - jb, Hk, mp ? mp + jb * mk.nb[0] : nullptr, mstride, mk.nb[1],
                                   mk.type, slope, scale, softcap, Dv, st.acc, st.M, st.S, false);
                    for (int64_t h = 0; h < R * H; ++h)
                        fa_merge(tot.acc + h * Dv, tot.M + h, tot.S + h, st.acc + h * Dv, st.M[h], st.S[h], Dv);
                }
                for (int64_t i = 0; i < R; ++i)
                    for (int64_t h = 0; h < H; ++h) {
                        const int64_t x = at(h, i);
                        out_head(iq0 + i, h, b, tot.acc + x * Dv, tot.S[x], tot.M[x] > -INFINITY);
                    }
            }
        }
        return;
    }
    if (groupable && Nq >= FA_COPY_MIN_ROWS) {
        // many query rows that the path above does not take (more than 4 heads a KV head, a mask per head, another
        // Dv): units are (KV head, block of query rows), the rows inner; a thread converts its KV head's keys and
        // values to F32 once (FA_COPY_FLOATS), and its rows read them from there: the same values, the same results.
        // Read in place row by row, SmolLM2-1.7B's cache (32 heads of 64: a head's keys 4 KB apart, in the same cache
        // sets) made a 128-row prefill at 512 keys 1.8x slower than 31 heads.
        float* kc = ts + FA_TILE_FLOATS(D, Dv, H);
        float* vc = kc + Nkv * D;
        const FaKV copy{(const uint8_t*)kc, D * 4, false, (const uint8_t*)vc, Dv * 4, false};
        const int64_t heads = B * Hk, nrb = imax(1, imin(Nq, (8 * nth + heads - 1) / heads)), rbs = (Nq + nrb - 1) / nrb;
        int64_t u0, u1, have = -1;
        split_range(heads * nrb, ith, nth, &u0, &u1);
        for (int64_t u = u0; u < u1; ++u) {
            const int64_t hk = (u / nrb) % Hk, b = u / (nrb * Hk), r0 = (u % nrb) * rbs, r1 = imin(Nq, r0 + rbs);
            if (u / nrb != have) {
                const FaKV src = kv_of(hk, b);
                for (int64_t j = 0; j < Nkv; ++j) {
                    for (int64_t i = 0; i < D; i += 8)
                        _mm256_storeu_ps(kc + j * D + i, load8(src.kb + j * src.ks + i * (src.kf16 ? 2 : 4), src.kf16));
                    for (int64_t i = 0; i < Dv; i += 8)
                        _mm256_storeu_ps(vc + j * Dv + i, load8(src.vb + j * src.vs + i * (src.vf16 ? 2 : 4), src.vf16));
                }
                have = u / nrb;
            }
            for (int64_t iq = r0; iq < r1; ++iq) {
                if (grouped) {
                    fa_group(n, iq, hk, b, ts, copy);
                } else {
                    for (int64_t h = hk * rep; h < (hk + 1) * rep; ++h) row_head(iq, h, b, copy, true);
                }
            }
        }
        return;
    }
    // grouped heads (one conversion of each key/value tile for all heads sharing it) when there are enough groups
    // to keep every thread busy
    if (grouped && gunits >= 8) {
        int64_t g0, g1;
        split_range(gunits, ith, nth, &g0, &g1);
        for (int64_t u = g0; u < g1; ++u) {
            const int64_t hk = u % Hk, b = u / (Hk * Nq);
            fa_group(n, (u / Hk) % Nq, hk, b, ts, kv_of(hk, b));
        }
        return;
    }
#else
    if (phase != n.n_phases - 1) return;
#endif
    const int64_t units = Nq * H * B;
    int64_t u0, u1;
    split_range(units, ith, nth, &u0, &u1);
    for (int64_t u = u0; u < u1; ++u) {
        const int64_t h = u % H, iq = (u / H) % Nq, b = u / (H * Nq);
        row_head(iq, h, b, kv_of(h / rep, b), groupable);
    }
}

}  // namespace GP_NS
}  // namespace gp
