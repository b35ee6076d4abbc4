// GEMV of repacked ("x8", common.h) weights: Q4_0/Q4_1/Q5_0/Q5_1/Q8_0/Q4_K/Q5_K/Q6_K records against up to 4 (8
// for Q4_K/Q5_K/Q6_K) quantized activation rows at a time.
#include "blocks.h"
#include "isa.h"

namespace gp {
namespace GP_NS {

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

// An x8 Q4_K/Q5_K record's mins of sub-blocks 2jp and 2jp + 1 as an i16 pair per row lane (common.h)
static inline __m256i x8k_min_pairs(const uint8_t* rec, int jp) {
    return _mm256_cvtepu8_epi16(_mm_unpacklo_epi8(_mm_loadl_epi64((const __m128i*)(rec + X8K_MIN + 16 * jp)),
                                                  _mm_loadl_epi64((const __m128i*)(rec + X8K_MIN + 8 + 16 * jp))));
}

// How far ahead (bytes) the Q4_K / Q5_K kernel prefetches its records in a decode step's stream from DRAM. On an
// AMD EPYC (Zen 3, 2 vCPUs), against the two records (2.4 KB) used before: a 75 MB weight, six interleaved rounds,
// 1 thread 14.6-18.0 -> 19.2-21.9 GB/s, 2 threads 28.6-30.7 -> 30.1-34.4; SmolLM2-1.7B-shaped Q4_K_M decode, three
// rounds, 1 thread 11.7-13.4 -> 13.9-15.7 tok/s, 2 threads the same. The Q4_0 kernel, 8 KB instead of its 8 records
// (1.2 KB): a lone weight 10% faster too, but the 1.7B Q4_0 decode at 2 threads 10% slower (7 rounds): left as it
// was; Q6_K and Q8_0 were no faster at 4-16 KB (Q8_0 slower).
constexpr int64_t PREFETCH_AHEAD = 8192;
// On an EPYC Zen 4 (AMD with AVX512-VNNI; Zen 3 has none) the software prefetch of the one-row kernels only cost:
// `bench_gemv` (4096 x 4096, a weight per plan past the LLC, 1 thread, 5-6 interleaved rounds) without it Q4_K
// 23.6-24.9 -> 26.2-29.8 GB/s, Q5_K 11.4-13.1 -> 14.2-14.9, Q4_0 21.1-25.5 -> 27.8-31.5, Q4_1 22.5-27.5 -> 28.8-32.4,
// Q5_0 17.2-26.0 -> 29.7-32.2, Q8_0 25.4-27.7 -> 32.3-34.8 (Llama-3.2-1B-shaped decode, 4 rounds: Q4_0 28.2-30.4 ->
// 30.9-34.1 tok/s at 1 thread, 33.6-40.5 -> 37.2-48.7 at 2); the hardware prefetcher follows the one stream alone.
// Q6_K's went once its scales moved before its quants (common.h): a C harness timing this file's kernel against the
// previous build's, alternately, over 12 weights (113 MB) of 2048 x 8192 / 8192 x 2048, 1 thread, 10 rounds (paired
// median): with the prefetch 1.09-1.11x / 1.18x the old layout's speed, without it 1.26-1.27x / 1.15-1.29x.
static const bool kPrefetchX8 = !(cpu_is_amd() && cpu_has_avx512_vnni());

// the compiler may not move work across it: keeps each activation row's sums in one register, in source order (GCC
// otherwise reassociates the 16-bit adds into trees and spills the products of all rows)
static inline void keep(__m256i& v) { asm("" : "+x"(v)); }

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
// dpbusd against one 32-bit activation group the instruction broadcasts from memory itself ({1to8}; EVEX, so VL)
static inline __m256i dpbusd_bcst(__m256i acc, __m256i u, const int32_t* s) {
    asm("vpdpbusd %2%{1to8%}, %1, %0" : "+v"(acc) : "v"(u), "m"(*s));
    return acc;
}
#else
static inline __m256i dpbusd(__m256i acc, __m256i, __m256i) { return acc; }  // never instantiated below avx512
static inline __m256i dpbusd_bcst(__m256i acc, __m256i, const int32_t*) { return acc; }
#endif

#if GP_AVX512
// Two 256-bit halves as one 512-bit vector: lo in lanes 0-7 (32-bit), hi in 8-15.
static inline __m512i join256(__m256i lo, __m256i hi) { return _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1); }
static inline __m512i dpbusd512(__m512i acc, __m512i u, __m512i s) {
    asm("vpdpbusd %2, %1, %0" : "+v"(acc) : "v"(u), "v"(s));
    return acc;
}
// dpbusd512 against one 32-bit activation group broadcast from memory by the instruction itself ({1to16}), where
// the asm above takes a register and so a vpbroadcastd of its own per product. In the pair kernels' prefill (8192 x
// 2048 weights, 512 rows, a Zen 4): Q6_K 136 -> 152 GMAC/s a thread, Q4_K 133 -> 143, Q4_0 158 -> 166.
static inline __m512i dpbusd512_bcst(__m512i acc, __m512i u, const int32_t* s) {
    asm("vpdpbusd %2%{1to16%}, %1, %0" : "+v"(acc) : "v"(u), "m"(*s));
    return acc;
}

// Fifth bits for chunk c's low (Hi false) or high quants at bit 4 of each byte: h's bit 2c (2c + 1) moved there;
// the shift stays inside each byte for every bit 4 read.
template <bool Hi>
static inline __m512i fifth_bit_at_4(__m512i h, int c) {
    const int n = 4 - 2 * c - (Hi ? 1 : 0);
    return n > 0 ? _mm512_slli_epi16(h, n) : n < 0 ? _mm512_srli_epi16(h, -n) : h;
}

// unpack_x8_q45 for chunk c of two records at once: q's in the low half, q1's in the high half; with Five, h holds
// both records' fifth bits for all four chunks (each chunk's moved to bit 4 and ORed in by one vpternlog)
template <bool Five>
static inline void unpack_x8_q45_pair(const uint8_t* q, const uint8_t* q1, int c, const __m512i& h, __m512i& lo,
                                      __m512i& hi) {
    const __m512i m4 = _mm512_set1_epi8(0x0f);
    const __m512i L = join256(_mm256_loadu_si256((const __m256i*)(q + 32 * c)),
                              _mm256_loadu_si256((const __m256i*)(q1 + 32 * c)));
    lo = _mm512_and_si512(L, m4);
    hi = _mm512_and_si512(_mm512_srli_epi16(L, 4), m4);
    if constexpr (Five) {  // x | (bits & 0x10)
        const __m512i bit4 = _mm512_set1_epi8(0x10);
        lo = _mm512_ternarylogic_epi32(lo, fifth_bit_at_4<false>(h, c), bit4, 0xF8);
        hi = _mm512_ternarylogic_epi32(hi, fifth_bit_at_4<true>(h, c), bit4, 0xF8);
    }
}

// gemv_x8_q45_K's VNNI path for two groups of 8 rows at once (groups g and g + 1 in the low and high halves of
// 512-bit vectors): each record pair is unpacked with half the instructions and the activations' broadcasts serve
// both. Lane by lane, the same integer sums and float operations as the 8-row kernel, so the same bits per row.
// A sub-block's quants are unpacked once for all R rows (up to 8), then each row's products run; the mins are
// applied once per super-block.
template <bool Five, int R>
static void gemv_x8_q45_K_pair(const uint8_t* rec, const uint8_t* act, size_t astride, int64_t k, float* out,
                               size_t ostride) {
    constexpr int64_t size = x8k_size(Five);
    const int64_t nb = k / 256;
    A256Parts a[R];
    for (int r = 0; r < R; ++r) a[r] = a256_parts(act + r * astride, k);
    const uint8_t* p = rec;
    const uint8_t* p1 = rec + nb * size;  // the next group's records
    // bytes 2, 3 of each 32-bit lane from its bytes 0, 1 (the other bytes are masked off where it is used)
    const __m512i low_to_high = _mm512_broadcast_i32x4(_mm_setr_epi8(0, 0, 0, 1, 0, 0, 4, 5, 0, 0, 8, 9, 0, 0, 12, 13));
    __m512 acc[R];
    for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
    for (int64_t s = 0; s < nb; ++s, p += size, p1 += size) {
        __m512i sumi[R];
        for (int r = 0; r < R; ++r) sumi[r] = _mm512_setzero_si512();
        for (int j = 0; j < 8; ++j) {
            const uint8_t* q = p + x8k_sub(Five, j);
            const uint8_t* q1 = p1 + x8k_sub(Five, j);
            // the sub-block's quants unpacked once for the R rows, then each row's four chunks in a row
            __m512i lo[4], hi[4];
            const __m512i h = Five ? join256(_mm256_loadu_si256((const __m256i*)(q + 128)),
                                             _mm256_loadu_si256((const __m256i*)(q1 + 128)))
                                   : _mm512_setzero_si512();
            for (int c = 0; c < 4; ++c) unpack_x8_q45_pair<Five>(q, q1, c, h, lo[c], hi[c]);
            const __m128i sc8 = _mm_unpacklo_epi64(_mm_loadl_epi64((const __m128i*)(p + X8K_SC + 8 * j)),
                                                   _mm_loadl_epi64((const __m128i*)(p1 + X8K_SC + 8 * j)));
            const __m512i sc = _mm512_cvtepu8_epi32(sc8);
            const __m512i sc16 = Five ? sc : _mm512_or_si512(sc, _mm512_slli_epi32(sc, 16));  // (scale, scale)
            for (int r = 0; r < R; ++r) {
                const int32_t* a32 = (const int32_t*)(a[r].qs + 256 * s) + 8 * j;
                __m512i d = _mm512_setzero_si512();
                for (int c = 0; c < 2; ++c) {
                    d = dpbusd512_bcst(d, lo[c], a32 + 2 * c);
                    d = dpbusd512_bcst(d, hi[c], a32 + 2 * c + 1);
                }
                // Q4_K: each half of the sub-block (16 quants of 0..15 against activations of -127..127) sums within
                // an i16, so the halves go into the two i16s of a lane and one madd applies the scale to both, where
                // a 32-bit multiply takes two uops of the port the dot products need; Q5_K's halves do not fit
                __m512i d2 = Five ? d : _mm512_setzero_si512();
                for (int c = 2; c < 4; ++c) {
                    d2 = dpbusd512_bcst(d2, lo[c], a32 + 2 * c);
                    d2 = dpbusd512_bcst(d2, hi[c], a32 + 2 * c + 1);
                }
                if constexpr (Five)
                    sumi[r] = _mm512_add_epi32(sumi[r], _mm512_mullo_epi32(d2, sc));
                else  // lane: (low i16 of the first half's sum, low i16 of the second's)
                    sumi[r] = _mm512_add_epi32(sumi[r], _mm512_madd_epi16(_mm512_mask_shuffle_epi8(
                        d, (__mmask64)0xCCCCCCCCCCCCCCCCull, d2, low_to_high), sc16));
            }
        }
        // the mins, once per super-block: lane i16 pairs (min of sub-block 2jp, of 2jp + 1) against the
        // activations' 32-sums of those sub-blocks (gemv_x8_q45_K's scheme)
        __m512i mn2[4];
        for (int jp = 0; jp < 4; ++jp) mn2[jp] = join256(x8k_min_pairs(p, jp), x8k_min_pairs(p1, jp));
        const __m512 dws = _mm512_cvtph_ps(_mm256_inserti128_si256(
            _mm256_castsi128_si256(_mm_loadu_si128((const __m128i*)(p + X8K_D))),
            _mm_loadu_si128((const __m128i*)(p1 + X8K_D)), 1));
        const __m512 mws = _mm512_cvtph_ps(_mm256_inserti128_si256(
            _mm256_castsi128_si256(_mm_loadu_si128((const __m128i*)(p + X8K_DMIN))),
            _mm_loadu_si128((const __m128i*)(p1 + X8K_DMIN)), 1));
        for (int r = 0; r < R; ++r) {
            // i32 pairs of the 16-sums as i16 pairs: (s0+s1, s2+s3), (s4+s5, s6+s7) in e0, e1, e4, e5
            const __m256i b32 = _mm256_madd_epi16(_mm256_loadu_si256((const __m256i*)(a[r].bsums + 16 * s)),
                                                  _mm256_set1_epi16(1));
            alignas(32) int32_t b16[8];
            _mm256_store_si256((__m256i*)b16, _mm256_packs_epi32(b32, b32));
            __m512i mi = _mm512_madd_epi16(mn2[0], _mm512_set1_epi32(b16[0]));
            mi = _mm512_add_epi32(mi, _mm512_madd_epi16(mn2[1], _mm512_set1_epi32(b16[1])));
            mi = _mm512_add_epi32(mi, _mm512_madd_epi16(mn2[2], _mm512_set1_epi32(b16[4])));
            mi = _mm512_add_epi32(mi, _mm512_madd_epi16(mn2[3], _mm512_set1_epi32(b16[5])));
            const __m512 vda = _mm512_set1_ps(a[r].d[s]);
            acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sumi[r]), _mm512_mul_ps(dws, vda), acc[r]);
            acc[r] = _mm512_fnmadd_ps(_mm512_cvtepi32_ps(mi), _mm512_mul_ps(mws, vda), acc[r]);
        }
    }
    for (int r = 0; r < R; ++r) _mm512_storeu_ps(out_row(out, r, ostride), acc[r]);  // groups g and g + 1: 16 rows
}
#endif

// Q4_K / Q5_K x8 (common.h). Q5_K's fifth bit makes the quants 0..31, so one 16-bit sum holds only two of a
// sub-block's four chunks (2 x 2 x 31 x 127 < 2^15): it takes two madds with the scale where Q4_K takes one.
// With VNNI a sub-block's products go straight into 32-bit sums (vpdpbusd), then times its scale: the same integers
// as the 16-bit path, in half the instructions. R activation rows share each record's unpacking; every row's
// result is the same whatever R, with or without VNNI.
template <bool Five, int R, bool Vnni>
static void gemv_x8_q45_K(const uint8_t* rec, int64_t ngroups, const uint8_t* act, size_t astride, int64_t k,
                          float* out, size_t ostride) {
    constexpr int64_t size = x8k_size(Five);
    const int64_t nb = k / 256;
    A256Parts a[R];
    for (int r = 0; r < R; ++r) a[r] = a256_parts(act + r * astride, k);
    int64_t g = 0;
#if GP_AVX512
    // two groups at a time in 512-bit vectors (the same bits) for several activation rows, whose records come from
    // L2 after the first row: prefill of SmolLM2-1.7B-shaped Q4_K_M 128 tokens +23%, 512 +18%. Not for one row (a
    // decode step), whose records stream from DRAM: two streams a thread read 25-27 GB/s where one read 28-31.
    if constexpr (Vnni && R >= 2)
        for (; g + 1 < ngroups; g += 2)
            gemv_x8_q45_K_pair<Five, R>(rec + g * nb * size, act, astride, k, out + 8 * g, ostride);
#endif
    for (; g < ngroups; ++g) {
        const uint8_t* p = rec + g * nb * size;
        __m256 acc[R];
        for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
        for (int64_t s = 0; s < nb; ++s, p += size) {
            __m256i sumi[R];
            for (int r = 0; r < R; ++r) sumi[r] = _mm256_setzero_si256();
            // the record's mins and d, dmin before its quants, so that it is read in address order (the asm keeps
            // the compiler from sinking the loads to their use). A decode-like sequence of products from DRAM (C
            // harness, both builds alternately, rounds classed by a read loop around them): 1 thread Q4_K 26.3 ->
            // 27.5-28.2 GB/s, Q5_K 26.7 -> 29.2 (a loop: 29-31); 2 threads 31.0 -> 31.5 and 31.6 -> 32.8 (loop 32-33),
            // in the loop's fast state 46.8 -> 47.6 and 48.4 -> 51.0 (loop 55-59)
            __m256i mn2[4];
            for (int jp = 0; jp < 4; ++jp) mn2[jp] = x8k_min_pairs(p, jp);
            __m256 dw = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(p + X8K_D)));
            __m256 mw = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(p + X8K_DMIN)));
            if constexpr (R == 1) {
                asm("" : "+x"(mn2[0]), "+x"(mn2[1]), "+x"(mn2[2]), "+x"(mn2[3]));
                asm("" : "+x"(dw), "+x"(mw));
            }
            for (int j = 0; j < 8; ++j) {
                const uint8_t* q = p + x8k_sub(Five, j);
                if (kPrefetchX8) {
                    for (int64_t o = 0; o < x8k_sub_bytes(Five); o += 64)  // sub-block j's nibbles (and fifth bits)
                        _mm_prefetch((const char*)(q + PREFETCH_AHEAD + o), _MM_HINT_T0);
                    if (64 * j < X8K_META)  // the rest of that record: the scales (2t decode +3%)
                        _mm_prefetch((const char*)(p + PREFETCH_AHEAD + 64 * j), _MM_HINT_T0);
                }
                __m256i h = Five ? _mm256_loadu_si256((const __m256i*)(q + 128)) : _mm256_setzero_si256();
                __m256i s16[R][2];  // VNNI: s16[r][0] holds the 32-bit sums
                for (int r = 0; r < R; ++r) s16[r][0] = s16[r][1] = _mm256_setzero_si256();
                for (int c = 0; c < 4; ++c) {
                    __m256i lo, hi;
                    unpack_x8_q45<Five>(q, c, h, lo, hi);
                    for (int r = 0; r < R; ++r) {
                        const int32_t* a32 = (const int32_t*)(a[r].qs + 256 * s) + 8 * j + 2 * c;
                        if constexpr (Vnni) {
                            s16[r][0] = dpbusd_bcst(s16[r][0], lo, a32);
                            s16[r][0] = dpbusd_bcst(s16[r][0], hi, a32 + 1);
                            continue;
                        }
                        __m256i& t = s16[r][Five ? c / 2 : 0];
                        t = _mm256_add_epi16(t, _mm256_maddubs_epi16(lo, _mm256_set1_epi32(a32[0])));
                        t = _mm256_add_epi16(t, _mm256_maddubs_epi16(hi, _mm256_set1_epi32(a32[1])));
                        keep(t);
                    }
                }
                const __m256i sc = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)(p + X8K_SC + 8 * j)));
                const __m256i sc2 = _mm256_or_si256(sc, _mm256_slli_epi32(sc, 16));
                for (int r = 0; r < R; ++r) {
                    if constexpr (Vnni) {
                        sumi[r] = _mm256_add_epi32(sumi[r], _mm256_mullo_epi32(s16[r][0], sc));
                    } else {
                        sumi[r] = _mm256_add_epi32(sumi[r], _mm256_madd_epi16(s16[r][0], sc2));
                        if constexpr (Five) sumi[r] = _mm256_add_epi32(sumi[r], _mm256_madd_epi16(s16[r][1], sc2));
                    }
                }
            }
            // the mins, once per super-block: lane i16 pairs (min of sub-block 2jp, of 2jp + 1) against the
            // activations' 32-sums of those sub-blocks
            for (int r = 0; r < R; ++r) {
                // i32 pairs of the 16-sums as i16 pairs: (s0+s1, s2+s3), (s4+s5, s6+s7) in e0, e1, e4, e5
                const __m256i b32 = _mm256_madd_epi16(_mm256_loadu_si256((const __m256i*)(a[r].bsums + 16 * s)),
                                                      _mm256_set1_epi16(1));
                const __m256i b16 = _mm256_packs_epi32(b32, b32);
                __m256i mi = _mm256_madd_epi16(mn2[0], _mm256_permutevar8x32_epi32(b16, _mm256_set1_epi32(0)));
                mi = _mm256_add_epi32(mi, _mm256_madd_epi16(mn2[1], _mm256_permutevar8x32_epi32(b16, _mm256_set1_epi32(1))));
                mi = _mm256_add_epi32(mi, _mm256_madd_epi16(mn2[2], _mm256_permutevar8x32_epi32(b16, _mm256_set1_epi32(4))));
                mi = _mm256_add_epi32(mi, _mm256_madd_epi16(mn2[3], _mm256_permutevar8x32_epi32(b16, _mm256_set1_epi32(5))));
                const __m256 vda = _mm256_set1_ps(a[r].d[s]);
                acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sumi[r]), _mm256_mul_ps(dw, vda), acc[r]);
                acc[r] = _mm256_fnmadd_ps(_mm256_cvtepi32_ps(mi), _mm256_mul_ps(mw, vda), acc[r]);
            }
        }
        for (int r = 0; r < R; ++r) _mm256_storeu_ps(out_row(out, r, ostride) + 8 * g, acc[r]);
    }
}

#if GP_AVX512
// gemv_x8_q6_K's VNNI path for two groups of 8 rows at once (gemv_x8_q45_K_pair's scheme): lane by lane the same
// integer sums and float operations, so the same bits per row.
template <int R>
static void gemv_x8_q6_K_pair(const uint8_t* rec, const uint8_t* act, size_t astride, int64_t k, float* out,
                              size_t ostride) {
    const int64_t nb = k / 256;
    A256Parts a[R];
    for (int r = 0; r < R; ++r) a[r] = a256_parts(act + r * astride, k);
    const __m512i m4 = _mm512_set1_epi8(0x0f), m30 = _mm512_set1_epi8(0x30);
    const __m512i dup0 = _mm512_broadcast_i32x4(_mm_setr_epi8(0, 1, 0, 1, 4, 5, 4, 5, 8, 9, 8, 9, 12, 13, 12, 13));
    const __m512i dup1 = _mm512_broadcast_i32x4(_mm_setr_epi8(2, 3, 2, 3, 6, 7, 6, 7, 10, 11, 10, 11, 14, 15, 14, 15));
    const uint8_t* p = rec;
    const uint8_t* p1 = rec + nb * X8Q6_SIZE;
    __m512 acc[R];
    for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
    for (int64_t s = 0; s < nb; ++s, p += X8Q6_SIZE, p1 += X8Q6_SIZE) {
        __m512i sumi[R];
        for (int r = 0; r < R; ++r) sumi[r] = _mm512_setzero_si512();
        for (int jp = 0; jp < 8; ++jp) {
            const uint8_t* q = p + x8q6_sub(2 * jp);
            const uint8_t* q1 = p1 + x8q6_sub(2 * jp);
            const __m512i sc2 =
                join256(_mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i*)(p + X8Q6_SC + 16 * jp))),
                        _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i*)(p1 + X8Q6_SC + 16 * jp))));
            for (int h = 0; h < 2; ++h) {
                const uint8_t* u = q + X8Q6_SUB * h;
                const uint8_t* u1 = q1 + X8Q6_SUB * h;
                const int j = 2 * jp + h;
                const __m512i L0 = join256(_mm256_loadu_si256((const __m256i*)u), _mm256_loadu_si256((const __m256i*)u1));
                const __m512i L1 = join256(_mm256_loadu_si256((const __m256i*)(u + 32)),
                                           _mm256_loadu_si256((const __m256i*)(u1 + 32)));
                const __m512i H = join256(_mm256_loadu_si256((const __m256i*)(u + 64)),
                                          _mm256_loadu_si256((const __m256i*)(u1 + 64)));
                const __m512i q0 = _mm512_or_si512(_mm512_and_si512(L0, m4), _mm512_and_si512(_mm512_slli_epi16(H, 4), m30));
                const __m512i q1v = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(L0, 4), m4),
                                                    _mm512_and_si512(_mm512_slli_epi16(H, 2), m30));
                const __m512i q2 = _mm512_or_si512(_mm512_and_si512(L1, m4), _mm512_and_si512(H, m30));
                const __m512i q3 = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(L1, 4), m4),
                                                   _mm512_and_si512(_mm512_srli_epi16(H, 2), m30));
                const __m512i sc32 = _mm512_srai_epi32(_mm512_shuffle_epi8(sc2, h ? dup1 : dup0), 16);
                for (int r = 0; r < R; ++r) {
                    // the -32 offset enters as the sum's start, -32 x the activations' 16-sum: the same integer as
                    // the 256-bit kernel's, without its per-row multiply on the port the dot products need
                    const int32_t* a32 = (const int32_t*)(a[r].qs + 256 * s) + 4 * j;
                    __m512i d = dpbusd512_bcst(_mm512_set1_epi32(-32 * (int32_t)a[r].bsums[16 * s + j]), q0, a32);
                    d = dpbusd512_bcst(d, q1v, a32 + 1);
                    d = dpbusd512_bcst(d, q2, a32 + 2);
                    d = dpbusd512_bcst(d, q3, a32 + 3);
                    sumi[r] = _mm512_add_epi32(sumi[r], _mm512_mullo_epi32(d, sc32));
                }
            }
        }
        const __m512 dws = _mm512_cvtph_ps(_mm256_inserti128_si256(
            _mm256_castsi128_si256(_mm_loadu_si128((const __m128i*)(p + X8Q6_D))),
            _mm_loadu_si128((const __m128i*)(p1 + X8Q6_D)), 1));
        for (int r = 0; r < R; ++r)
            acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sumi[r]), _mm512_mul_ps(dws, _mm512_set1_ps(a[r].d[s])), acc[r]);
    }
    for (int r = 0; r < R; ++r) _mm512_storeu_ps(out_row(out, r, ostride), acc[r]);
}
#endif

// Q6_K x8 (common.h): the unsigned 6-bit quants enter maddubs as they are (0..63, so two maddubs results still fit
// in i16); their -32 offset is applied through the activations' 16-sums, as the row kernel does. With VNNI a
// sub-block's four chunks go into one 32-bit sum each (vpdpbusd), times the sub-block's scale. R activation rows
// share each record's unpacking; every row's integer sums, hence its result, are the same whatever R and path.
template <int R, bool Vnni>
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
    int64_t g = 0;
#if GP_AVX512
    if constexpr (Vnni && R >= 2)  // gemv_x8_q45_K's rule
        for (; g + 1 < ngroups; g += 2)
            gemv_x8_q6_K_pair<R>(rec + g * nb * X8Q6_SIZE, act, astride, k, out + 8 * g, ostride);
#endif
    for (; g < ngroups; ++g) {
        const uint8_t* p = rec + g * nb * X8Q6_SIZE;
        __m256 acc[R];
        for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
        for (int64_t s = 0; s < nb; ++s, p += X8Q6_SIZE) {
            __m256i sumi[R];
            for (int r = 0; r < R; ++r) sumi[r] = _mm256_setzero_si256();
            for (int jp = 0; jp < 8; ++jp) {  // pairs of sub-blocks: 192 bytes of quants, 16 bytes of scales
                const uint8_t* q = p + x8q6_sub(2 * jp);
                if (kPrefetchX8) {  // two records ahead
                    _mm_prefetch((const char*)(q + 2 * X8Q6_SIZE), _MM_HINT_T0);
                    _mm_prefetch((const char*)(q + 2 * X8Q6_SIZE + 64), _MM_HINT_T0);
                    _mm_prefetch((const char*)(q + 2 * X8Q6_SIZE + 128), _MM_HINT_T0);
                    if (jp < 2) _mm_prefetch((const char*)(p + 2 * X8Q6_SIZE + 64 * jp), _MM_HINT_T0);  // sc, d
                }
                const __m256i sc2 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i*)(p + X8Q6_SC + 16 * jp)));
                for (int r = 0; r < R; ++r) {  // the offset: -32 x scale x the activations' 16-sums
                    int32_t bpair;  // the two sub-blocks' sums, as one i16 pair
                    memcpy(&bpair, a[r].bsums + 16 * s + 2 * jp, 4);
                    const __m256i mi = _mm256_madd_epi16(sc2, _mm256_set1_epi32(bpair));
                    sumi[r] = _mm256_sub_epi32(sumi[r], _mm256_slli_epi32(mi, 5));
                }
                for (int h = 0; h < 2; ++h) {
                    const uint8_t* u = q + X8Q6_SUB * h;
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
                    if constexpr (Vnni) {
                        const __m256i sc32 = _mm256_srai_epi32(sc, 16);  // both halves hold it: sign-extend one
                        for (int r = 0; r < R; ++r) {
                            const int32_t* a32 = (const int32_t*)(a[r].qs + 256 * s) + 4 * j;
                            __m256i d = dpbusd_bcst(_mm256_setzero_si256(), q0, a32);
                            d = dpbusd_bcst(d, q1, a32 + 1);
                            d = dpbusd_bcst(d, q2, a32 + 2);
                            d = dpbusd_bcst(d, q3, a32 + 3);
                            sumi[r] = _mm256_add_epi32(sumi[r], _mm256_mullo_epi32(d, sc32));
                        }
                        continue;
                    }
                    for (int r = 0; r < R; ++r) {
                        const int32_t* a32 = (const int32_t*)(a[r].qs + 256 * s) + 4 * j;
                        const __m256i s01 = _mm256_add_epi16(_mm256_maddubs_epi16(q0, _mm256_set1_epi32(a32[0])),
                                                             _mm256_maddubs_epi16(q1, _mm256_set1_epi32(a32[1])));
                        const __m256i s23 = _mm256_add_epi16(_mm256_maddubs_epi16(q2, _mm256_set1_epi32(a32[2])),
                                                             _mm256_maddubs_epi16(q3, _mm256_set1_epi32(a32[3])));
                        sumi[r] = _mm256_add_epi32(sumi[r], _mm256_madd_epi16(s01, sc));
                        sumi[r] = _mm256_add_epi32(sumi[r], _mm256_madd_epi16(s23, sc));
                        keep(sumi[r]);
                    }
                }
            }
            const __m256 dw = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(p + X8Q6_D)));
            for (int r = 0; r < R; ++r)
                acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sumi[r]), _mm256_mul_ps(dw, _mm256_set1_ps(a[r].d[s])),
                                         acc[r]);
        }
        for (int r = 0; r < R; ++r) _mm256_storeu_ps(out_row(out, r, ostride) + 8 * g, acc[r]);
    }
}

#if GP_AVX512
// gemv_x8_q45_01's VNNI path for two groups of 8 rows at once (gemv_x8_q45_K_pair's scheme): the same bits per row.
template <int T, int R>
static void gemv_x8_q45_01_pair(const uint8_t* rec, const uint8_t* act, size_t astride, int64_t k, float* out,
                                size_t ostride) {
    constexpr bool five = T == T_Q5_0 || T == T_Q5_1, has_m = T == T_Q4_1 || T == T_Q5_1;
    constexpr int64_t size = 8 * Blk<T>::size, doff = five ? 160 : 128;
    constexpr float offset = T == T_Q4_0 ? -8.0f : -16.0f;  // unused by Q4_1 / Q5_1
    const int64_t nb = k / 32;
    A32Parts a[R];
    for (int r = 0; r < R; ++r) a[r] = a32_parts(act + r * astride, k);
    const uint8_t* p = rec;
    const uint8_t* p1 = rec + nb * size;
    __m512 acc[R], accm[R];
    for (int r = 0; r < R; ++r) acc[r] = accm[r] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; ++b, p += size, p1 += size) {
        const __m512i h = five ? join256(_mm256_loadu_si256((const __m256i*)(p + 128)),
                                         _mm256_loadu_si256((const __m256i*)(p1 + 128)))
                               : _mm512_setzero_si512();
        __m512i s32[R];
        for (int r = 0; r < R; ++r) s32[r] = _mm512_setzero_si512();
        for (int c = 0; c < 4; ++c) {
            __m512i lo, hi;
            unpack_x8_q45_pair<five>(p, p1, c, h, lo, hi);
            for (int r = 0; r < R; ++r) {
                const int32_t* a32 = (const int32_t*)(a[r].qs + 32 * b);
                s32[r] = dpbusd512_bcst(s32[r], lo, a32 + 2 * c);
                s32[r] = dpbusd512_bcst(s32[r], hi, a32 + 2 * c + 1);
            }
        }
        auto halves = [&](int64_t off) {
            return _mm512_cvtph_ps(_mm256_inserti128_si256(_mm256_castsi128_si256(_mm_loadu_si128((const __m128i*)(p + off))),
                                                           _mm_loadu_si128((const __m128i*)(p1 + off)), 1));
        };
        const __m512 dw = halves(doff);
        [[maybe_unused]] const __m512 mw = has_m ? halves(doff + 16) : _mm512_setzero_ps();
        for (int r = 0; r < R; ++r) {
            const __m512 sf = _mm512_cvtepi32_ps(s32[r]);
            if constexpr (has_m) {
                acc[r] = _mm512_fmadd_ps(sf, _mm512_mul_ps(dw, _mm512_set1_ps(a[r].d[b])), acc[r]);
                accm[r] = _mm512_fmadd_ps(mw, _mm512_set1_ps(a[r].s[b]), accm[r]);
            } else {
                const __m512 t = _mm512_fmadd_ps(sf, _mm512_set1_ps(a[r].d[b]), _mm512_set1_ps(offset * a[r].s[b]));
                acc[r] = _mm512_fmadd_ps(t, dw, acc[r]);
            }
        }
    }
    for (int r = 0; r < R; ++r) _mm512_storeu_ps(out_row(out, r, ostride), _mm512_add_ps(acc[r], accm[r]));
}

// gemv_x8_q8_0's VNNI path for two groups of 8 rows at once: |w| and the activations carrying w's sign (AVX-512 has
// no vpsignb: negated under w's sign mask; where w is 0 the product is 0 either way), the same bits per row.
template <int R>
static void gemv_x8_q8_0_pair(const uint8_t* rec, const uint8_t* act, size_t astride, int64_t k, float* out,
                              size_t ostride) {
    const int64_t nb = k / 32;
    A32Parts a[R];
    for (int r = 0; r < R; ++r) a[r] = a32_parts(act + r * astride, k);
    const uint8_t* p = rec;
    const uint8_t* p1 = rec + nb * 272;
    __m512 acc[R];
    for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; ++b, p += 272, p1 += 272) {
        __m512i s32[R];
        for (int r = 0; r < R; ++r) s32[r] = _mm512_setzero_si512();
        for (int kk = 0; kk < 8; ++kk) {
            const __m512i w = join256(_mm256_loadu_si256((const __m256i*)(p + 32 * kk)),
                                      _mm256_loadu_si256((const __m256i*)(p1 + 32 * kk)));
            const __m512i aw = _mm512_abs_epi8(w);
            const __mmask64 neg = _mm512_movepi8_mask(w);
            for (int r = 0; r < R; ++r) {
                const __m512i av = _mm512_set1_epi32(((const int32_t*)(a[r].qs + 32 * b))[kk]);
                s32[r] = dpbusd512(s32[r], aw, _mm512_mask_sub_epi8(av, neg, _mm512_setzero_si512(), av));
            }
        }
        const __m512 dw = _mm512_cvtph_ps(_mm256_inserti128_si256(
            _mm256_castsi128_si256(_mm_loadu_si128((const __m128i*)(p + 256))), _mm_loadu_si128((const __m128i*)(p1 + 256)), 1));
        for (int r = 0; r < R; ++r)
            acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s32[r]), _mm512_mul_ps(dw, _mm512_set1_ps(a[r].d[b])), acc[r]);
    }
    for (int r = 0; r < R; ++r) _mm512_storeu_ps(out_row(out, r, ostride), acc[r]);
}
#endif

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
    int64_t g = 0;
#if GP_AVX512
    if constexpr (Vnni && R >= 2)  // gemv_x8_q45_K's rule
        for (; g + 1 < ngroups; g += 2)
            gemv_x8_q45_01_pair<T, R>(rec + g * nb * size, act, astride, k, out + 8 * g, ostride);
#endif
    for (; g < ngroups; ++g) {
        const uint8_t* p = rec + g * nb * size;
        __m256 acc[R], accm[R];
        for (int r = 0; r < R; ++r) acc[r] = accm[r] = _mm256_setzero_ps();
        for (int64_t b = 0; b < nb; ++b, p += size) {
            if (kPrefetchX8) {
                _mm_prefetch((const char*)(p + 8 * size), _MM_HINT_T0);
                _mm_prefetch((const char*)(p + 8 * size + 64), _MM_HINT_T0);
                _mm_prefetch((const char*)(p + 8 * size + 128), _MM_HINT_T0);
            }
            __m256i h = five ? _mm256_loadu_si256((const __m256i*)(p + 128)) : _mm256_setzero_si256();
            __m256i s16[R][2];  // Vnni: s16[r][0] holds 32-bit sums
            for (int r = 0; r < R; ++r) s16[r][0] = s16[r][1] = _mm256_setzero_si256();
            for (int c = 0; c < 4; ++c) {  // the weights' quants unpacked once for the R activation rows
                __m256i lo, hi;
                unpack_x8_q45<five>(p, c, h, lo, hi);
                for (int r = 0; r < R; ++r) {
                    const int32_t* a32 = (const int32_t*)(a[r].qs + 32 * b);
                    if constexpr (Vnni) {
                        s16[r][0] = dpbusd_bcst(s16[r][0], lo, a32 + 2 * c);
                        s16[r][0] = dpbusd_bcst(s16[r][0], hi, a32 + 2 * c + 1);
                        continue;
                    }
                    __m256i& t = s16[r][five ? c / 2 : 0];
                    t = _mm256_add_epi16(t, _mm256_maddubs_epi16(lo, _mm256_set1_epi32(a32[2 * c])));
                    t = _mm256_add_epi16(t, _mm256_maddubs_epi16(hi, _mm256_set1_epi32(a32[2 * c + 1])));
                    keep(t);
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
    int64_t g = 0;
#if GP_AVX512
    if constexpr (Vnni && R >= 2)  // gemv_x8_q45_K's rule
        for (; g + 1 < ngroups; g += 2) gemv_x8_q8_0_pair<R>(rec + g * nb * 272, act, astride, k, out + 8 * g, ostride);
#endif
    for (; g < ngroups; ++g) {
        const uint8_t* p = rec + g * nb * 272;
        __m256 acc[R];
        for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
        for (int64_t b = 0; b < nb; ++b, p += 272) {
            if (kPrefetchX8)
                for (int o = 0; o < 256; o += 64) _mm_prefetch((const char*)(p + 2176 + o), _MM_HINT_T0);
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
                    keep(s32[r]);
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
        case T_Q4_K: gemv_x8_q45_K<false, R, Vnni>(rec, ngroups, act, astride, k, out, ostride); break;
        case T_Q5_K: gemv_x8_q45_K<true, R, Vnni>(rec, ngroups, act, astride, k, out, ostride); break;
        case T_Q6_K: gemv_x8_q6_K<R, Vnni>(rec, ngroups, act, astride, k, out, ostride); break;
        default: break;
    }
}

template <bool Vnni>
static void gemv_x8_rows(int type, const uint8_t* rec, int64_t ngroups, const uint8_t* act, size_t astride, int nrows,
                         int64_t k, float* out, size_t ostride) {
    // Q6_K: 8 rows a pass halve each row's share of the unpacking (with VNNI the 6-bit quants' shifts run on the port
    // the dot products need; at AVX2 the unpacking is a third of the instructions: Zen 3, 73 -> 80 GMAC/s a thread).
    // A row's state is its sums alone, so 8 fit in the registers even at AVX2's 16.
    if (type == T_Q6_K)
        for (; nrows >= 8; nrows -= 8, act += 8 * astride, out = out_row(out, 8, ostride))
            gemv_x8_q6_K<8, Vnni>(rec, ngroups, act, astride, k, out, ostride);
    // Q4_K / Q5_K with VNNI too: the pair kernel's row state is its sums alone (8192 x 2048, 512 rows, a Zen 4, 1
    // thread, with that kernel's unpacking once per sub-block for all rows: Q5_K 128-132 -> 144-152 GMAC/s, Q4_K
    // 135-140 -> 145-150; 4 rows a pass: 119-136 and 139-145; 16 rows, or rows in blocks of 4 whose chains
    // interleave: no faster)
    if constexpr (Vnni)
        if (type == T_Q4_K || type == T_Q5_K)
            for (; nrows >= 8; nrows -= 8, act += 8 * astride, out = out_row(out, 8, ostride)) {
                if (type == T_Q4_K) gemv_x8_q45_K<false, 8, true>(rec, ngroups, act, astride, k, out, ostride);
                else gemv_x8_q45_K<true, 8, true>(rec, ngroups, act, astride, k, out, ostride);
            }
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

}  // namespace GP_NS
}  // namespace gp
