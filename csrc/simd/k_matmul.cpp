// MUL_MAT: dst[M, N, b2, b3] = src1[K, N, b2, b3] . src0[K, M, b2/r2, b3/r3]^T (weights repeated as ggml).
//
// Integer path (quantized weights, every row count unless GGML_PY_SIMD_GEMM_ROWS[_X8] set a threshold): activations
// quantized once per row in phase 0 (A32 blocks for the 32-element types, A256 = Q8_K granularity for the
// K-quants), then integer dot products per row; work: chunks of weight rows, handed out by an atomic counter.
// GEMM path (float weights at every row count): BLIS-like packed F32 GEMM (6x16 micro tiles, K blocked by 256);
// weights of any type are dequantized while their panel is packed, so every weight is decoded once per block of up to
// GEMM_MC activation rows. A row's result is the same bits whatever the row count and the threads: each path sums
// every element in one order of its own, and the thread split only decides who computes which weight rows.
#include "isa.h"

namespace gp {
namespace GP_NS {

// ---------------------------------------------------------------------------------------------------------------
// packing

// 16 x kc panel from rows of floats: out[k*16 + r] = rows[r][k]; missing rows are zero.
static void pack_w_panel(const float* const* rows, int nr, int64_t kc, float* out) {
#if GP_AVX2
    if (nr == 16) {
        int64_t k = 0;
        for (; k + 8 <= kc; k += 8) {
            for (int h = 0; h < 2; ++h) {
                __m256 r0 = _mm256_loadu_ps(rows[8 * h + 0] + k), r1 = _mm256_loadu_ps(rows[8 * h + 1] + k);
                __m256 r2 = _mm256_loadu_ps(rows[8 * h + 2] + k), r3 = _mm256_loadu_ps(rows[8 * h + 3] + k);
                __m256 r4 = _mm256_loadu_ps(rows[8 * h + 4] + k), r5 = _mm256_loadu_ps(rows[8 * h + 5] + k);
                __m256 r6 = _mm256_loadu_ps(rows[8 * h + 6] + k), r7 = _mm256_loadu_ps(rows[8 * h + 7] + k);
                __m256 t0 = _mm256_unpacklo_ps(r0, r1), t1 = _mm256_unpackhi_ps(r0, r1);
                __m256 t2 = _mm256_unpacklo_ps(r2, r3), t3 = _mm256_unpackhi_ps(r2, r3);
                __m256 t4 = _mm256_unpacklo_ps(r4, r5), t5 = _mm256_unpackhi_ps(r4, r5);
                __m256 t6 = _mm256_unpacklo_ps(r6, r7), t7 = _mm256_unpackhi_ps(r6, r7);
                __m256 s0 = _mm256_shuffle_ps(t0, t2, 0x44), s1 = _mm256_shuffle_ps(t0, t2, 0xee);
                __m256 s2 = _mm256_shuffle_ps(t1, t3, 0x44), s3 = _mm256_shuffle_ps(t1, t3, 0xee);
                __m256 s4 = _mm256_shuffle_ps(t4, t6, 0x44), s5 = _mm256_shuffle_ps(t4, t6, 0xee);
                __m256 s6 = _mm256_shuffle_ps(t5, t7, 0x44), s7 = _mm256_shuffle_ps(t5, t7, 0xee);
                float* o = out + k * 16 + 8 * h;
                _mm256_storeu_ps(o + 0 * 16, _mm256_permute2f128_ps(s0, s4, 0x20));
                _mm256_storeu_ps(o + 1 * 16, _mm256_permute2f128_ps(s1, s5, 0x20));
                _mm256_storeu_ps(o + 2 * 16, _mm256_permute2f128_ps(s2, s6, 0x20));
                _mm256_storeu_ps(o + 3 * 16, _mm256_permute2f128_ps(s3, s7, 0x20));
                _mm256_storeu_ps(o + 4 * 16, _mm256_permute2f128_ps(s0, s4, 0x31));
                _mm256_storeu_ps(o + 5 * 16, _mm256_permute2f128_ps(s1, s5, 0x31));
                _mm256_storeu_ps(o + 6 * 16, _mm256_permute2f128_ps(s2, s6, 0x31));
                _mm256_storeu_ps(o + 7 * 16, _mm256_permute2f128_ps(s3, s7, 0x31));
            }
        }
        for (; k < kc; ++k)
            for (int r = 0; r < 16; ++r) out[k * 16 + r] = rows[r][k];
        return;
    }
#endif
    for (int64_t k = 0; k < kc; ++k) {
        for (int r = 0; r < nr; ++r) out[k * 16 + r] = rows[r][k];
        for (int r = nr; r < 16; ++r) out[k * 16 + r] = 0.0f;
    }
}

#if GP_AVX2
// Row r (0..7) of an 8-row group of a repacked Q4_K / Q5_K / Q6_K weight, columns [pc, pc + kc) (multiples of 256),
// as floats, element by element from the record layout of common.h. Only a GEMM forced onto these weights
// (GGML_PY_SIMD_GEMM_ROWS_X8) reads it: their products take the integer path at every row count.
static void dequant_x8_row_k(int type, const uint8_t* group, int r, int64_t pc, int64_t kc, float* out) {
    const int64_t size = 8 * repack_row_bytes(type, 256);
    for (int64_t s = pc / 256; s < (pc + kc) / 256; ++s, out += 256) {
        const uint8_t* p = group + s * size;
        if (type == T_Q6_K) {
            const float d = fp16_to_fp32(((const uint16_t*)(p + X8Q6_D))[r]);
            for (int j = 0; j < 16; ++j) {
                const float dl = d * (float)(int8_t)p[x8q6_sc(j, r)];
                const uint8_t* u = p + x8q6_sub(j);
                for (int e = 0; e < 16; ++e) {
                    const int lo = (u[32 * (e / 8) + 4 * r + (e & 3)] >> (e & 4)) & 0x0f;
                    const int hi = (u[64 + 4 * r + (e & 3)] >> (2 * (e / 4))) & 3;
                    out[16 * j + e] = dl * (float)((lo | (hi << 4)) - 32);
                }
            }
            continue;
        }
        const bool five = type == T_Q5_K;
        const float d = fp16_to_fp32(((const uint16_t*)(p + X8K_D))[r]);
        const float dmin = fp16_to_fp32(((const uint16_t*)(p + X8K_DMIN))[r]);
        for (int j = 0; j < 8; ++j) {
            const float d1 = d * (float)p[X8K_SC + 8 * j + r], m1 = dmin * (float)p[X8K_MIN + 8 * j + r];
            for (int t = 0; t < 32; ++t) {
                const int c = t / 8, i = t & 3, high = (t & 4) != 0;
                const uint8_t* u = p + x8k_sub(five, j);
                int q = (u[32 * c + 4 * r + i] >> (4 * high)) & 0x0f;
                if (five) q |= ((u[128 + 4 * r + i] >> (2 * c + high)) & 1) << 4;
                out[32 * j + t] = d1 * (float)q - m1;
            }
        }
    }
}

// Row r (0..7) of an 8-row group of a repacked weight, columns [pc, pc + kc) (multiples of the block), as floats:
// the records of the 32-element types' blocks hold row r's quants as 4-byte pieces at 32c + 4r (see common.h).
static void dequant_x8_row(int type, const uint8_t* group, int r, int64_t pc, int64_t kc, float* out) {
    if (weight_uses_a256(type)) return dequant_x8_row_k(type, group, r, pc, kc, out);
    const int64_t size = 8 * (int64_t)type_size(type);
    for (int64_t b = pc / 32; b < (pc + kc) / 32; ++b, out += 32) {
        const uint8_t* rec = group + b * size;
        if (type == T_Q8_0) {
            const __m256 vd = _mm256_set1_ps(fp16_to_fp32(((const uint16_t*)(rec + 256))[r]));
            for (int h = 0; h < 4; ++h) {  // pieces 2h and 2h+1: elements 8h..8h+7
                uint32_t piece[2];
                memcpy(&piece[0], rec + 32 * (2 * h) + 4 * r, 4);
                memcpy(&piece[1], rec + 32 * (2 * h + 1) + 4 * r, 4);
                const __m128i v = _mm_loadl_epi64((const __m128i*)piece);
                _mm256_storeu_ps(out + 8 * h, _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(v)), vd));
            }
            continue;
        }
        const bool five = type == T_Q5_0 || type == T_Q5_1;
        const int64_t doff = five ? 160 : 128;
        const float d = fp16_to_fp32(((const uint16_t*)(rec + doff))[r]);
        float m;  // w = d q + m
        if (type == T_Q4_1 || type == T_Q5_1) m = fp16_to_fp32(((const uint16_t*)(rec + doff + 16))[r]);
        else m = (five ? -16.0f : -8.0f) * d;
        uint32_t piece[4];
        for (int c = 0; c < 4; ++c) memcpy(&piece[c], rec + 32 * c + 4 * r, 4);
        const __m128i v = _mm_loadu_si128((const __m128i*)piece);
        __m128i lo = _mm_and_si128(v, _mm_set1_epi8(0x0f));
        __m128i hi = _mm_and_si128(_mm_srli_epi16(v, 4), _mm_set1_epi8(0x0f));
        if (five) {  // piece c's fifth bits: bits 2c (low nibbles' elements) and 2c+1 (high) of row r's qh word
            uint32_t qh;
            memcpy(&qh, rec + 128 + 4 * r, 4);
            const __m128i hq = _mm_srlv_epi32(_mm_set1_epi32((int)qh), _mm_setr_epi32(0, 2, 4, 6));
            lo = _mm_or_si128(lo, _mm_and_si128(_mm_slli_epi16(hq, 4), _mm_set1_epi8(0x10)));
            hi = _mm_or_si128(hi, _mm_and_si128(_mm_slli_epi16(hq, 3), _mm_set1_epi8(0x10)));
        }
        // piece c: elements 8c..8c+3 in lo, 8c+4..8c+7 in hi
        const __m128i e01 = _mm_unpacklo_epi32(lo, hi), e23 = _mm_unpackhi_epi32(lo, hi);
        const __m256 vd = _mm256_set1_ps(d), vm = _mm256_set1_ps(m);
        const __m128i parts[4] = {e01, _mm_srli_si128(e01, 8), e23, _mm_srli_si128(e23, 8)};
        for (int c = 0; c < 4; ++c)
            _mm256_storeu_ps(out + 8 * c, _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(parts[c])), vd, vm));
    }
}
#endif

// The B panel of weight rows [m, m + nr) (nr <= 16, m a multiple of 16) x columns [pc, pc + kc), as floats 16 per
// column: read in place from a p16 repacked F32 weight, else made in `wp` (16 * kc floats; tmp: as many). The rows of
// a repacked weight's whole groups are read from the repacked copy (x8: decoded records; p16: converted panels), so
// the file's copy of those rows is never read again and its memory can be given back (get_repacked).
static const float* weight_panel(const Tensor& w, const uint8_t* wbase, const uint8_t* rp, int64_t m, int nr,
                                 int64_t pc, int64_t kc, float* wp, float* tmp) {
#if GP_AVX2  // scalar plans don't repack
    const int gr = rp ? repack_group_rows(w.type) : 0;
    const int64_t full = gr ? (w.ne[1] / gr) * gr : 0, group = gr * repack_row_bytes(w.type, w.ne[0]);
    if (gr == 16 && m < full) {  // p16: this panel's columns are contiguous
        const uint8_t* src = rp + (m / 16) * group + pc * 16 * type_size(w.type);
        if (w.type == T_F32) return (const float*)src;
        for (int64_t i = 0; i < 16 * kc; i += 8)
            _mm256_storeu_ps(wp + i, w.type == T_F16 ? load_f16x8((const uint16_t*)src + i)
                                                     : load_bf16x8((const uint16_t*)src + i));
        return wp;
    }
#endif
    const int64_t col_off = row_bytes(w.type, pc);
    const float* rows[16];
    for (int r = 0; r < nr; ++r) {
        const int64_t row = m + r;
#if GP_AVX2
        if (gr == 8 && row < full) {
            dequant_x8_row(w.type, rp + (row / 8) * group, (int)(row % 8), pc, kc, tmp + r * kc);
            rows[r] = tmp + r * kc;
            continue;
        }
#endif
        const uint8_t* src = wbase + row * w.nb[1] + col_off;
        if (w.type == T_F32) {
            rows[r] = (const float*)src;
        } else {
            dequantize_row(w.type, src, tmp + r * kc, kc);
            rows[r] = tmp + r * kc;
        }
    }
    pack_w_panel(rows, nr, kc, wp);
    return wp;
}

#if GP_AVX2
// 8x8 transpose of r[0..7] in place
GP_INLINE void transpose8(__m256* r) {
    __m256 t0 = _mm256_unpacklo_ps(r[0], r[1]), t1 = _mm256_unpackhi_ps(r[0], r[1]);
    __m256 t2 = _mm256_unpacklo_ps(r[2], r[3]), t3 = _mm256_unpackhi_ps(r[2], r[3]);
    __m256 t4 = _mm256_unpacklo_ps(r[4], r[5]), t5 = _mm256_unpackhi_ps(r[4], r[5]);
    __m256 t6 = _mm256_unpacklo_ps(r[6], r[7]), t7 = _mm256_unpackhi_ps(r[6], r[7]);
    __m256 s0 = _mm256_shuffle_ps(t0, t2, 0x44), s1 = _mm256_shuffle_ps(t0, t2, 0xee);
    __m256 s2 = _mm256_shuffle_ps(t1, t3, 0x44), s3 = _mm256_shuffle_ps(t1, t3, 0xee);
    __m256 s4 = _mm256_shuffle_ps(t4, t6, 0x44), s5 = _mm256_shuffle_ps(t4, t6, 0xee);
    __m256 s6 = _mm256_shuffle_ps(t5, t7, 0x44), s7 = _mm256_shuffle_ps(t5, t7, 0xee);
    r[0] = _mm256_permute2f128_ps(s0, s4, 0x20);
    r[1] = _mm256_permute2f128_ps(s1, s5, 0x20);
    r[2] = _mm256_permute2f128_ps(s2, s6, 0x20);
    r[3] = _mm256_permute2f128_ps(s3, s7, 0x20);
    r[4] = _mm256_permute2f128_ps(s0, s4, 0x31);
    r[5] = _mm256_permute2f128_ps(s1, s5, 0x31);
    r[6] = _mm256_permute2f128_ps(s2, s6, 0x31);
    r[7] = _mm256_permute2f128_ps(s3, s7, 0x31);
}
#endif

// Pack activation rows [n0, n0+nc) x cols [pc, pc+kc) into 6-row panels: out[k*6 + i]. `out` needs 8 floats of
// slack after each panel (the vector path writes 8 lanes where 6 are meant and the next store covers the rest).
static void pack_acts(const Tensor& x, const uint8_t* xbase, int64_t n0, int64_t nc, int64_t pc, int64_t kc,
                      float* ap) {
    for (int64_t p = 0; p < nc; p += GEMM_MR) {
        const int nr = (int)imin(GEMM_MR, nc - p);
        float* o = ap + p * kc;
        const uint8_t* rows[GEMM_MR];
        for (int i = 0; i < nr; ++i) rows[i] = xbase + (n0 + p + i) * x.nb[1] + pc * x.nb[0];
        int64_t k = 0;
#if GP_AVX2
        if (x.nb[0] == 4 && nr == GEMM_MR) {
            for (; k + 8 <= kc; k += 8) {
                __m256 r[8];
                for (int i = 0; i < 6; ++i) r[i] = _mm256_loadu_ps((const float*)rows[i] + k);
                r[6] = r[7] = _mm256_setzero_ps();
                transpose8(r);
                for (int j = 0; j < 8; ++j) _mm256_storeu_ps(o + (k + j) * GEMM_MR, r[j]);
            }
        }
#endif
        if (x.nb[0] == 4) {
            for (; k < kc; ++k) {
                for (int i = 0; i < nr; ++i) o[k * GEMM_MR + i] = ((const float*)rows[i])[k];
                for (int i = nr; i < GEMM_MR; ++i) o[k * GEMM_MR + i] = 0.0f;
            }
        } else {
            for (; k < kc; ++k) {
                for (int i = 0; i < nr; ++i) o[k * GEMM_MR + i] = *(const float*)(rows[i] + k * x.nb[0]);
                for (int i = nr; i < GEMM_MR; ++i) o[k * GEMM_MR + i] = 0.0f;
            }
        }
    }
}

// ---------------------------------------------------------------------------------------------------------------
// micro kernel: C[MR x nr] (+)= A[kc x MR] . B[kc x 16]; A packed GEMM_MR per column, B 16 per column (packed
// floats, or a p16 panel in the weight's type BT); C rows are dst rows (stride ldc bytes). Each element of C is one
// chain of FMAs over the block's columns, added to C after the first block: the same for every MR, so a row's
// result does not depend on how many rows share the product (nor on the panel coming packed or in place).

#if GP_AVX2
template <int BT>
GP_TINLINE __m256 load_b(const void* b, int64_t i) {
    if constexpr (BT == T_F16) return load_f16x8((const uint16_t*)b + i);
    else if constexpr (BT == T_BF16) return load_bf16x8((const uint16_t*)b + i);
    else return _mm256_loadu_ps((const float*)b + i);
}
#endif

template <int MR, int BT>
static void micro(int64_t kc, const float* GP_RESTRICT A, const void* GP_RESTRICT B, uint8_t* C, int64_t ldc,
                  bool acc, int nr) {
    float t[MR * 16];
#if GP_AVX2
    __m256 c0[MR], c1[MR];
    for (int i = 0; i < MR; ++i) c0[i] = c1[i] = _mm256_setzero_ps();
#pragma GCC unroll 4
    for (int64_t k = 0; k < kc; ++k) {
        const __m256 b0 = load_b<BT>(B, 16 * k), b1 = load_b<BT>(B, 16 * k + 8);
        const float* a = A + GEMM_MR * k;
        for (int i = 0; i < MR; ++i) {
            const __m256 av = _mm256_broadcast_ss(a + i);
            c0[i] = _mm256_fmadd_ps(av, b0, c0[i]);
            c1[i] = _mm256_fmadd_ps(av, b1, c1[i]);
        }
    }
    if (nr == 16) {
        for (int i = 0; i < MR; ++i) {
            float* c = (float*)(C + i * ldc);
            if (acc) {
                _mm256_storeu_ps(c, _mm256_add_ps(_mm256_loadu_ps(c), c0[i]));
                _mm256_storeu_ps(c + 8, _mm256_add_ps(_mm256_loadu_ps(c + 8), c1[i]));
            } else {
                _mm256_storeu_ps(c, c0[i]);
                _mm256_storeu_ps(c + 8, c1[i]);
            }
        }
        return;
    }
    for (int i = 0; i < MR; ++i) {
        _mm256_storeu_ps(t + 16 * i, c0[i]);
        _mm256_storeu_ps(t + 16 * i + 8, c1[i]);
    }
#else
    static_assert(BT == T_F32, "p16 panels are read in place at avx2 and up only");
    for (int i = 0; i < MR * 16; ++i) t[i] = 0.0f;
    for (int64_t k = 0; k < kc; ++k) {
        const float* b = (const float*)B + 16 * k;
        const float* a = A + GEMM_MR * k;
        for (int i = 0; i < MR; ++i) {
            const float ai = a[i];
            for (int j = 0; j < 16; ++j) t[16 * i + j] += ai * b[j];
        }
    }
#endif
    for (int i = 0; i < MR; ++i) {
        float* c = (float*)(C + i * ldc);
        if (acc) {
            for (int j = 0; j < nr; ++j) c[j] += t[16 * i + j];
        } else {
            for (int j = 0; j < nr; ++j) c[j] = t[16 * i + j];
        }
    }
}

#if GP_AVX2
// micro<1, BT> on two whole panels side by side (one activation row): each element the same one chain of FMAs,
// but four chains in flight instead of two, so a decode step's float product is not bound by the FMA latency
template <int BT>
static void micro_pair(int64_t kc, const float* GP_RESTRICT A, const void* GP_RESTRICT B0,
                       const void* GP_RESTRICT B1, uint8_t* C, bool acc) {
    __m256 c00 = _mm256_setzero_ps(), c01 = _mm256_setzero_ps(), c10 = _mm256_setzero_ps(), c11 = _mm256_setzero_ps();
#pragma GCC unroll 4
    for (int64_t k = 0; k < kc; ++k) {
        const __m256 av = _mm256_broadcast_ss(A + GEMM_MR * k);
        c00 = _mm256_fmadd_ps(av, load_b<BT>(B0, 16 * k), c00);
        c01 = _mm256_fmadd_ps(av, load_b<BT>(B0, 16 * k + 8), c01);
        c10 = _mm256_fmadd_ps(av, load_b<BT>(B1, 16 * k), c10);
        c11 = _mm256_fmadd_ps(av, load_b<BT>(B1, 16 * k + 8), c11);
    }
    float* c = (float*)C;
    const __m256 r[4] = {c00, c01, c10, c11};
    for (int j = 0; j < 4; ++j)
        _mm256_storeu_ps(c + 8 * j, acc ? _mm256_add_ps(_mm256_loadu_ps(c + 8 * j), r[j]) : r[j]);
}
#endif

template <int BT>
static void micro_rows(int mr, int64_t kc, const float* A, const void* B, uint8_t* C, int64_t ldc, bool acc, int nr) {
    switch (mr) {
        case 1: return micro<1, BT>(kc, A, B, C, ldc, acc, nr);
        case 2: return micro<2, BT>(kc, A, B, C, ldc, acc, nr);
        case 3: return micro<3, BT>(kc, A, B, C, ldc, acc, nr);
        case 4: return micro<4, BT>(kc, A, B, C, ldc, acc, nr);
        case 5: return micro<5, BT>(kc, A, B, C, ldc, acc, nr);
        default: return micro<6, BT>(kc, A, B, C, ldc, acc, nr);
    }
}

// ---------------------------------------------------------------------------------------------------------------

GP_INLINE bool mm_gemv(const Node& n) { return n.src[1].ne[1] < gemm_min_rows(n.src[0].type); }

static void gemm_unit(const Node& n, int64_t b2, int64_t b3, int64_t m0, int64_t m1, float* scratch) {
    const Tensor& w = n.src[0];
    const Tensor& x = n.src[1];
    const Tensor& d = n.dst;
    const int64_t K = w.ne[0], N = x.ne[1];
    const int64_t r2 = x.ne[2] / w.ne[2], r3 = x.ne[3] / w.ne[3];
    const uint8_t* wbase = w.data + (b2 / r2) * w.nb[2] + (b3 / r3) * w.nb[3];
    const uint8_t* xbase = x.data + b2 * x.nb[2] + b3 * x.nb[3];
    uint8_t* dbase = d.data + b2 * d.nb[2] + b3 * d.nb[3];
    if (N <= GEMM_MR) {
        // Few rows (decode): one weight panel at a time over all of K, each streamed once, in order; C stays in
        // L1. A p16 panel is read in place, converted as loaded. The same micro-kernel calls per element as below.
        float* wp = scratch;                           // 16 x GEMM_KC
        float* tmp = wp + 16 * GEMM_KC;                // 16 x GEMM_KC
        float* ap = tmp + 16 * GEMM_KC;                // GEMM_MR x K (+ the packing slack)
        pack_acts(x, xbase, 0, N, 0, K, ap);
#if GP_AVX2
        const bool p16 = n.repack && repack_group_rows(w.type) == 16;
        const int64_t full = p16 ? (w.ne[1] / 16) * 16 : 0, group = 16 * repack_row_bytes(w.type, K);
#endif
        for (int64_t m = m0; m < m1; m += 16) {
            const int nr = (int)imin(16, m1 - m);
            uint8_t* C = dbase + m * 4;
#if GP_AVX2
            if (N == 1 && p16 && m + 32 <= imin(full, m1)) {  // two whole in-place panels at once
                const int64_t es = type_size(w.type);
                const uint8_t* B0 = n.repack + (m / 16) * group;
                for (int64_t pc = 0; pc < K; pc += GEMM_KC) {
                    const int64_t kc = imin(GEMM_KC, K - pc);
                    const uint8_t* b0 = B0 + pc * 16 * es;
                    const uint8_t* b1 = B0 + group + pc * 16 * es;
                    if (w.type == T_F16) micro_pair<T_F16>(kc, ap + pc * GEMM_MR, b0, b1, C, pc > 0);
                    else if (w.type == T_BF16) micro_pair<T_BF16>(kc, ap + pc * GEMM_MR, b0, b1, C, pc > 0);
                    else micro_pair<T_F32>(kc, ap + pc * GEMM_MR, b0, b1, C, pc > 0);
                }
                m += 16;
                continue;
            }
#endif
            for (int64_t pc = 0; pc < K; pc += GEMM_KC) {
                const int64_t kc = imin(GEMM_KC, K - pc);
#if GP_AVX2
                if (m < full && w.type != T_F32) {
                    const uint8_t* B = n.repack + (m / 16) * group + pc * 16 * 2;
                    if (w.type == T_F16) micro_rows<T_F16>((int)N, kc, ap + pc * GEMM_MR, B, C, d.nb[1], pc > 0, nr);
                    else micro_rows<T_BF16>((int)N, kc, ap + pc * GEMM_MR, B, C, d.nb[1], pc > 0, nr);
                    continue;
                }
#endif
                const float* B = weight_panel(w, wbase, n.repack, m, nr, pc, kc, wp, tmp);
                micro_rows<T_F32>((int)N, kc, ap + pc * GEMM_MR, B, C, d.nb[1], pc > 0, nr);
            }
        }
        return;
    }
    float* wp = scratch;                                   // GEMM_NC x GEMM_KC
    float* ap = wp + (size_t)GEMM_NC * GEMM_KC;            // GEMM_MC x GEMM_KC (rounded to panels)
    float* tmp = ap + (size_t)(GEMM_MC + GEMM_MR) * GEMM_KC + 64;  // 16 x GEMM_KC (after the packing slack)
    const int64_t mc = m1 - m0;
    const float* panels[GEMM_NC / 16];
    for (int64_t pc = 0; pc < K; pc += GEMM_KC) {
        const int64_t kc = imin(GEMM_KC, K - pc);
        for (int64_t jr = 0; jr < mc; jr += 16)
            panels[jr / 16] =
                weight_panel(w, wbase, n.repack, m0 + jr, (int)imin(16, mc - jr), pc, kc, wp + jr * kc, tmp);
        for (int64_t ic = 0; ic < N; ic += GEMM_MC) {
            const int64_t nc = imin(GEMM_MC, N - ic);
            pack_acts(x, xbase, ic, nc, pc, kc, ap);
            for (int64_t jr = 0; jr < mc; jr += 16) {
                const int nr = (int)imin(16, mc - jr);
                const float* B = panels[jr / 16];
                for (int64_t ir = 0; ir < nc; ir += GEMM_MR) {
                    const int mr = (int)imin(GEMM_MR, nc - ir);
                    uint8_t* C = dbase + (ic + ir) * d.nb[1] + (m0 + jr) * 4;
                    micro_rows<T_F32>(mr, kc, ap + ir * kc, B, C, d.nb[1], pc > 0, nr);
                }
            }
        }
    }
}

// The GEMM of the F32 rows of x by weight rows [m0, m1) of the 2-D weight w into d (as MUL_MAT: d's row stride
// nb[1], column m at m * 4): MUL_MAT_ID runs each expert's block of rows through it, with its result per element
// the same as MUL_MAT's for any row count.
void gemm_rows(const Tensor& w, const Tensor& x, const Tensor& d, int64_t m0, int64_t m1, float* scratch) {
    Node n;
    n.op = GGML_PY_OP_MUL_MAT;
    n.src[0] = w;
    n.src[1] = x;
    n.dst = d;
    gemm_unit(n, 0, 0, m0, m1, scratch);
}

// A quantized matrix-vector product (few activation rows, quantized in phase 0 into ctx.wdata) is cut into chunks of
// weight rows (multiples of 8 when the weight is repacked); with several activation rows, a chunk small enough to
// stay in L2 for all of them. A unit is one chunk of one batch entry.
// About 4 chunks per thread: each is a longer contiguous read that the hardware prefetcher follows. With 8, SmolLM2
// decode at 2 threads was 10-18% slower (interleaved A/B on Q4_0/Q6_K, contexts 16 and 1000; the same at 1 thread).
enum { GEMV_UNITS_PER_THREAD = 4 };

static int64_t gemv_chunk_rows(const Node& n, int nth) {
    const Tensor& w = n.src[0];
    const int64_t M = w.ne[1], N = n.src[1].ne[1];
    const int64_t per = (int64_t)nth * GEMV_UNITS_PER_THREAD;
    int64_t chunk = (M + per - 1) / per;
    if (N > 1) chunk = imin(chunk, imax(16, (int64_t)(256 * 1024) / imax(1, w.nb[1])));
    // repacked, several rows: whole pairs of 8-row groups, which the VNNI kernels take two at a time (a chunk of 5
    // groups left one to the 256-bit kernel: ffn_down's 2048 x 8192 Q6_K, 128 rows, a Zen 4: 132 -> 139-143 GMAC/s a
    // thread); one row (a decode step) runs one group at a time
    const int64_t align = n.repack ? (N > 1 ? 16 : 8) : 4;
    return imax(16, (chunk + align - 1) & ~(align - 1));
}

static int64_t gemv_units(const Node& n, int nth) {
    const int64_t chunk = gemv_chunk_rows(n, nth);
    return (n.src[0].ne[1] + chunk - 1) / chunk * n.src[1].ne[2] * n.src[1].ne[3];
}

static void gemv_unit(const Node& n, int64_t u, int nth, size_t ars, const ExecCtx& ctx) {
    const Tensor& w = n.src[0];
    const Tensor& x = n.src[1];
    const Tensor& d = n.dst;
    const int64_t K = w.ne[0], M = w.ne[1], N = x.ne[1], B2 = x.ne[2];
    const int64_t r2 = B2 / w.ne[2], r3 = x.ne[3] / w.ne[3];
    const int64_t chunk = gemv_chunk_rows(n, nth), nchunks = (M + chunk - 1) / chunk;
    const int64_t c = u % nchunks, bb = u / nchunks;
    const int64_t b2 = bb % B2, b3 = bb / B2;
    const int64_t m0 = c * chunk, m1 = imin(M, m0 + chunk);
    const uint8_t* wbase = w.data + (b2 / r2) * w.nb[2] + (b3 / r3) * w.nb[3];
    const uint8_t* arow0 = ctx.wdata + (size_t)((b3 * B2 + b2) * N) * ars;
    float* out0 = (float*)(d.data + b2 * d.nb[2] + b3 * d.nb[3]);
    int64_t m = m0;
#if GP_AVX2
    // the repacked groups of 8 rows: the activation rows together
    const int64_t full = n.repack ? (M / 8) * 8 : 0;
    if (m < full) {
        const int64_t me = imin(m1, full);
        gemv_x8(w.type, n.repack + m * repack_row_bytes(w.type, K), (me - m) / 8, arow0, ars, (int)N, K, out0 + m,
                (size_t)d.nb[1]);
        m = me;
    }
#endif
    if (m < m1)
        gemv_rows(w.type, wbase + m * w.nb[1], w.nb[1], m1 - m, arow0, ars, (int)N, K, out0 + m, (size_t)d.nb[1]);
}

void k_mul_mat(Node& n, int phase, int ith, int nth, const ExecCtx& ctx) {
    const Tensor& w = n.src[0];
    const Tensor& x = n.src[1];
    const int64_t K = w.ne[0], M = w.ne[1], N = x.ne[1];
    const int64_t B2 = x.ne[2], B3 = x.ne[3];
    const bool quant = type_is_quant(w.type);
    const bool gemv = mm_gemv(n);
    const int compute_phase = n.n_phases - 1;

    if (gemv && quant) {
        const bool k256 = weight_uses_a256(w.type);
        const size_t ars = k256 ? a256_row_size(K) : a32_row_size(K);
        if (phase == 0) {  // quantize all activation rows
            const int64_t rows = N * B2 * B3;
            int64_t q0, q1;
            int ith2 = ith, nth2 = nth;
            if (!my_rows(rows, K, ith2, nth2, &q0, &q1, 8192)) return;
            float* tmp = (float*)ctx.thread_scratch(ith);
            for (int64_t r = q0; r < q1; ++r) {
                const int64_t i1 = r % N, i2 = (r / N) % B2, i3 = r / (N * B2);
                const uint8_t* xp = x.data + i1 * x.nb[1] + i2 * x.nb[2] + i3 * x.nb[3];
                const float* xf = (const float*)xp;
                if (x.nb[0] != 4) {
                    for (int64_t k = 0; k < K; ++k) tmp[k] = *(const float*)(xp + k * x.nb[0]);
                    xf = tmp;
                }
                uint8_t* arow = ctx.wdata + (size_t)r * ars;
                if (k256) quantize_a256(xf, arow, K);
                else quantize_a32(xf, arow, K);
            }
            return;
        }
        // phase 1: the weight rows of this product (and of the products grouped with it, which read the same
        // activations: see Plan::group_gemvs) as one pool of chunks
        int64_t units = 0;
        for (const Node* g = &n; g; g = g->group_next) units += gemv_units(*g, nth);
        for (;;) {
            int64_t u = n.counter->fetch_add(1, std::memory_order_relaxed);
            if (u >= units) break;
            const Node* g = &n;
            for (int64_t gu; u >= (gu = gemv_units(*g, nth)); g = g->group_next) u -= gu;
            gemv_unit(*g, u, nth, ars, ctx);
        }
        return;
    }
    if (phase != compute_phase) return;

    // GEMM: units = (batch, block of weight rows); a few rows (decode) take about as many blocks as the GEMV
    const int64_t per = (int64_t)nth * (N <= GEMM_MR ? GEMV_UNITS_PER_THREAD : 2);
    int64_t nc_rows = (M + per - 1) / per;
    nc_rows = (nc_rows + 15) & ~(int64_t)15;
    if (nc_rows > GEMM_NC) nc_rows = GEMM_NC;
    if (nc_rows < 16) nc_rows = 16;
    const int64_t nblk = (M + nc_rows - 1) / nc_rows;
    const int64_t units = nblk * B2 * B3;
    float* scratch = (float*)ctx.thread_scratch(ith);
    for (;;) {
        const int64_t u = n.counter->fetch_add(1, std::memory_order_relaxed);
        if (u >= units) break;
        const int64_t c = u % nblk, bb = u / nblk;
        const int64_t m0 = c * nc_rows, m1 = imin(M, m0 + nc_rows);
        gemm_unit(n, bb % B2, bb / B2, m0, m1, scratch);
    }
}

}  // namespace GP_NS
}  // namespace gp
