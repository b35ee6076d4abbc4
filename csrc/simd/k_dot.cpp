// Dot products: weight rows of every block type against quantized activation rows (the GEMV path of weights
// that are not repacked), and the plain read loop the products are measured against.
#include "blocks.h"
#include "isa.h"

namespace gp {
namespace GP_NS {

// ===============================================================================================================
// dot products: weight rows x quantized activation rows

#if GP_AVX2
GP_INLINE __m256i bits_to_bytes(uint32_t x) {  // byte j = 0xff where bit j of x is set
    const __m256i shuf = _mm256_setr_epi64x(0x0000000000000000LL, 0x0101010101010101LL, 0x0202020202020202LL,
                                            0x0303030303030303LL);
    __m256i v = _mm256_shuffle_epi8(_mm256_set1_epi32((int)x), shuf);
    v = _mm256_or_si256(v, _mm256_set1_epi64x(0x7fbfdfeff7fbfdfeLL));
    return _mm256_cmpeq_epi8(v, _mm256_set1_epi64x(-1));
}
GP_INLINE __m256i nibbles32(const uint8_t* qs) {  // 16 bytes -> 32 values: low nibbles then high nibbles
    __m128i t = _mm_loadu_si128((const __m128i*)qs);
    __m256i b = _mm256_insertf128_si256(_mm256_castsi128_si256(t), _mm_srli_epi16(t, 4), 1);
    return _mm256_and_si256(b, _mm256_set1_epi8(0x0f));
}
GP_INLINE __m256 mul_sum_us8(__m256i u, __m256i s) {  // sum of u8*s8 in 8 i32 lanes as float
    __m256i p = _mm256_maddubs_epi16(u, s);
    return _mm256_cvtepi32_ps(_mm256_madd_epi16(p, _mm256_set1_epi16(1)));
}
GP_INLINE __m256 mul_sum_ss8(__m256i a, __m256i b) {  // signed x signed
    __m256i ax = _mm256_sign_epi8(a, a);
    __m256i sb = _mm256_sign_epi8(b, a);
    return mul_sum_us8(ax, sb);
}

// Decode one 32-element block of weight type T to (unsigned values, d, m) with w = d*q + m.
template <int T>
GP_TINLINE __m256i dec32(const uint8_t* blk, float* d, float* m);
template <>
GP_TINLINE __m256i dec32<T_Q4_0>(const uint8_t* blk, float* d, float* m) {
    const blk_q4_0* b = (const blk_q4_0*)blk;
    *d = fp16_to_fp32(b->d);
    *m = -8.0f * *d;
    return nibbles32(b->qs);
}
template <>
GP_TINLINE __m256i dec32<T_Q4_1>(const uint8_t* blk, float* d, float* m) {
    const blk_q4_1* b = (const blk_q4_1*)blk;
    int dm_bits;
    memcpy(&dm_bits, blk, 4);
    __m128 dm = _mm_cvtph_ps(_mm_cvtsi32_si128(dm_bits));
    *d = _mm_cvtss_f32(dm);
    *m = _mm_cvtss_f32(_mm_movehdup_ps(dm));
    return nibbles32(b->qs);
}
template <>
GP_TINLINE __m256i dec32<T_Q5_0>(const uint8_t* blk, float* d, float* m) {
    const blk_q5_0* b = (const blk_q5_0*)blk;
    *d = fp16_to_fp32(b->d);
    *m = -16.0f * *d;
    uint32_t qh;
    memcpy(&qh, b->qh, 4);
    __m256i hb = _mm256_and_si256(bits_to_bytes(qh), _mm256_set1_epi8(0x10));
    return _mm256_or_si256(nibbles32(b->qs), hb);
}
template <>
GP_TINLINE __m256i dec32<T_Q5_1>(const uint8_t* blk, float* d, float* m) {
    const blk_q5_1* b = (const blk_q5_1*)blk;
    *d = fp16_to_fp32(b->d);
    *m = fp16_to_fp32(b->m);
    uint32_t qh;
    memcpy(&qh, b->qh, 4);
    __m256i hb = _mm256_and_si256(bits_to_bytes(qh), _mm256_set1_epi8(0x10));
    return _mm256_or_si256(nibbles32(b->qs), hb);
}

// One weight row (unsigned-with-offset types) against one A32 activation row. Rows are read one at a time, in
// order: reading 4 rows side by side (activations loaded once for all) measured slower, 0.44-0.61 of stream against
// 0.59-0.76, as the hardware prefetcher follows one stream per thread better than four short ones.
template <int T>
static float dot_u32(const uint8_t* w, const uint8_t* act, int64_t k) {
    const int64_t nb = k / 32;
    const auto [aq, ad, as] = a32_parts(act, k);
    __m256 acc = _mm256_setzero_ps();
    float summ = 0.0f;
    for (int64_t b = 0; b < nb; ++b) {
        const __m256i av = _mm256_loadu_si256((const __m256i*)(aq + 32 * b));
        float d, m;
        const __m256i wv = dec32<T>(w + b * Blk<T>::size, &d, &m);
        acc = _mm256_fmadd_ps(mul_sum_us8(wv, av), _mm256_set1_ps(d * ad[b]), acc);
        summ += m * as[b];
    }
    return hsum(acc) + summ;
}

GP_INLINE __m256i iq4_lookup(const uint8_t* qs) {  // 16 bytes of 4-bit indices -> 32 table values (int8)
    return _mm256_shuffle_epi8(_mm256_broadcastsi128_si256(_mm_load_si128((const __m128i*)iq4_values)),
                               nibbles32(qs));
}

static float dot_q8_0(const uint8_t* w, const uint8_t* act, int64_t k) {
    const int64_t nb = k / 32;
    const int8_t* aq = (const int8_t*)act;
    const float* ad = (const float*)(act + k);
    __m256 acc = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; ++b) {
        const blk_q8_0* blk = (const blk_q8_0*)(w + b * 34);
        const __m256i av = _mm256_loadu_si256((const __m256i*)(aq + 32 * b));
        const __m256i wv = _mm256_loadu_si256((const __m256i*)blk->qs);
        acc = _mm256_fmadd_ps(mul_sum_ss8(wv, av), _mm256_set1_ps(fp16_to_fp32(blk->d) * ad[b]), acc);
    }
    return hsum(acc);
}

// broadcast i16 lane `lane` of a 128-bit vector of 8 i16 to all 16 lanes of a 256-bit vector
GP_INLINE __m256i bcast_i16(__m256i v2, int lane) {
    const __m256i idx = _mm256_set1_epi16((short)(0x0100 * (2 * lane + 1) + 2 * lane));
    return _mm256_shuffle_epi8(v2, idx);
}

// Q4_K against A256
static float dot_q4_K(const uint8_t* w, const uint8_t* act, int64_t k) {
    const int64_t nb = k / 256;
    const auto [aq, ad, bs] = a256_parts(act, k);
    __m256 acc = _mm256_setzero_ps();
    float summ = 0.0f;
    const __m256i m4 = _mm256_set1_epi8(0x0f);
    for (int64_t i = 0; i < nb; ++i) {
        const __m128i pairs = _mm_hadd_epi16(_mm_loadu_si128((const __m128i*)(bs + 16 * i)),
                                             _mm_loadu_si128((const __m128i*)(bs + 16 * i + 8)));
        const int8_t* a = aq + 256 * i;
        __m256i av[8];
        for (int j = 0; j < 8; ++j) av[j] = _mm256_loadu_si256((const __m256i*)(a + 32 * j));
        const blk_q4_K* x = (const blk_q4_K*)(w + i * 144);
        const float d = fp16_to_fp32(x->d) * ad[i];
        const float dmin = fp16_to_fp32(x->dmin) * ad[i];
        uint8_t sm[16];
        unpack_k_scales(x->scales, sm);
        const __m128i sm16 = _mm_cvtepu8_epi16(_mm_loadl_epi64((const __m128i*)sm));
        const __m128i mins = _mm_cvtepu8_epi16(_mm_loadl_epi64((const __m128i*)(sm + 8)));
        __m128i pm = _mm_madd_epi16(mins, pairs);
        pm = _mm_add_epi32(pm, _mm_shuffle_epi32(pm, 0x4e));
        pm = _mm_add_epi32(pm, _mm_shuffle_epi32(pm, 0xb1));
        summ -= dmin * (float)_mm_cvtsi128_si32(pm);
        const __m256i sc2 = _mm256_broadcastsi128_si256(sm16);
        __m256i sumi = _mm256_setzero_si256();
        for (int c = 0; c < 4; ++c) {
            const __m256i q = _mm256_loadu_si256((const __m256i*)(x->qs + 32 * c));
            const __m256i lo = _mm256_and_si256(q, m4);
            const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(q, 4), m4);
            const __m256i p0 = _mm256_madd_epi16(_mm256_maddubs_epi16(lo, av[2 * c]), bcast_i16(sc2, 2 * c));
            const __m256i p1 = _mm256_madd_epi16(_mm256_maddubs_epi16(hi, av[2 * c + 1]), bcast_i16(sc2, 2 * c + 1));
            sumi = _mm256_add_epi32(sumi, _mm256_add_epi32(p0, p1));
        }
        acc = _mm256_fmadd_ps(_mm256_set1_ps(d), _mm256_cvtepi32_ps(sumi), acc);
    }
    return hsum(acc) + summ;
}

// Q2_K / Q3_K rows against A256 activations. The 16 group scales are
// widened to i16 with the even groups in the low 128-bit lane and the odd ones in the high lane, so one in-lane
// broadcast gives the scales of a 32-element chunk (groups 2j, 2j+1 = the two halves of a maddubs result).
GP_INLINE __m256i even_odd_i16(__m128i v8, bool is_signed) {
    const __m128i deint = _mm_setr_epi8(0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15);
    const __m128i t = _mm_shuffle_epi8(v8, deint);
    return is_signed ? _mm256_cvtepi8_epi16(t) : _mm256_cvtepu8_epi16(t);
}

// R activation rows (astride bytes apart) against one weight row: the quants and scales decoded once for all R; each
// row's operations are a lone row's, so its result is the same bits whatever R (also in dot_q3_K_r, dot_iq4_*_r).
template <int R>
static void dot_q2_K_r(const uint8_t* w, const uint8_t* act, size_t astride, int64_t k, float* out) {
    const int64_t nb = k / 256;
    A256Parts ap[R];
    __m256 acc[R];
    for (int r = 0; r < R; ++r) {
        ap[r] = a256_parts(act + r * astride, k);
        acc[r] = _mm256_setzero_ps();
    }
    const __m256i m3 = _mm256_set1_epi8(3);
    const __m128i m4 = _mm_set1_epi8(0x0f);
    for (int64_t i = 0; i < nb; ++i) {
        const blk_q2_K* x = (const blk_q2_K*)(w + i * 84);
        const __m128 dm = _mm_cvtph_ps(_mm_cvtsi32_si128((int)(x->d | (uint32_t)x->dmin << 16)));
        const __m128i raw = _mm_loadu_si128((const __m128i*)x->scales);
        const __m256i mins = _mm256_cvtepu8_epi16(_mm_and_si128(_mm_srli_epi16(raw, 4), m4));
        const __m256i sc = even_odd_i16(_mm_and_si128(raw, m4), false);
        __m256i sumi[R], mi[R];
        for (int r = 0; r < R; ++r) {
            mi[r] = _mm256_madd_epi16(mins, _mm256_loadu_si256((const __m256i*)(ap[r].bsums + 16 * i)));
            sumi[r] = _mm256_setzero_si256();
        }
        for (int h = 0; h < 2; ++h) {
            const __m256i Q = _mm256_loadu_si256((const __m256i*)(x->qs + 32 * h));
            for (int j = 0; j < 4; ++j) {
                const __m256i q = _mm256_and_si256(_mm256_srli_epi16(Q, 2 * j), m3);
                const __m256i scj = bcast_i16(sc, 4 * h + j);
                for (int r = 0; r < R; ++r) {
                    const __m256i a = _mm256_loadu_si256((const __m256i*)(ap[r].qs + 256 * i + 32 * (4 * h + j)));
                    sumi[r] = _mm256_add_epi32(sumi[r], _mm256_madd_epi16(_mm256_maddubs_epi16(q, a), scj));
                }
            }
        }
        for (int r = 0; r < R; ++r) {
            const __m128 dd = _mm_mul_ps(dm, _mm_set1_ps(ap[r].d[i]));
            acc[r] = _mm256_fmadd_ps(_mm256_broadcastss_ps(dd), _mm256_cvtepi32_ps(sumi[r]), acc[r]);
            acc[r] = _mm256_fnmadd_ps(_mm256_broadcastss_ps(_mm_movehdup_ps(dd)), _mm256_cvtepi32_ps(mi[r]), acc[r]);
        }
    }
    for (int r = 0; r < R; ++r) out[r] = hsum(acc[r]);
}

template <int R>
static void dot_q3_K_r(const uint8_t* w, const uint8_t* act, size_t astride, int64_t k, float* out) {
    const int64_t nb = k / 256;
    A256Parts ap[R];
    __m256 acc[R];
    for (int r = 0; r < R; ++r) {
        ap[r] = a256_parts(act + r * astride, k);
        acc[r] = _mm256_setzero_ps();
    }
    const __m256i m3 = _mm256_set1_epi8(3);
    const __m256i one = _mm256_set1_epi8(1);
    for (int64_t i = 0; i < nb; ++i) {
        const blk_q3_K* x = (const blk_q3_K*)(w + i * 110);
        const float dw = fp16_to_fp32(x->d);
        uint32_t u[4];  // built in registers: a byte-wise store then a 16-byte load would stall forwarding
        q3_scales_u32(x->scales, u);
        const __m128i sc128 = _mm_sub_epi8(_mm_setr_epi32((int)u[0], (int)u[1], (int)u[2], (int)u[3]),
                                           _mm_set1_epi8(32));
        const __m256i sc = even_odd_i16(sc128, true), sc16 = _mm256_cvtepi8_epi16(sc128);
        // the quants are taken as q + 4 (0..7): subtract 4 * sum(scale * bsum) afterwards
        __m256i sumi[R];
        for (int r = 0; r < R; ++r) {
            const __m256i bsv = _mm256_loadu_si256((const __m256i*)(ap[r].bsums + 16 * i));
            sumi[r] = _mm256_sub_epi32(_mm256_setzero_si256(), _mm256_slli_epi32(_mm256_madd_epi16(sc16, bsv), 2));
        }
        const __m256i H = _mm256_loadu_si256((const __m256i*)x->hmask);
        for (int h = 0; h < 2; ++h) {
            const __m256i Q = _mm256_loadu_si256((const __m256i*)(x->qs + 32 * h));
            for (int s4 = 0; s4 < 4; ++s4) {
                const int j = 4 * h + s4;
                const __m256i hb = _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(H, j), one), 2);
                const __m256i q = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(Q, 2 * s4), m3), hb);
                const __m256i scj = bcast_i16(sc, j);
                for (int r = 0; r < R; ++r) {
                    const __m256i a = _mm256_loadu_si256((const __m256i*)(ap[r].qs + 256 * i + 32 * j));
                    sumi[r] = _mm256_add_epi32(sumi[r], _mm256_madd_epi16(_mm256_maddubs_epi16(q, a), scj));
                }
            }
        }
        for (int r = 0; r < R; ++r)
            acc[r] = _mm256_fmadd_ps(_mm256_set1_ps(dw * ap[r].d[i]), _mm256_cvtepi32_ps(sumi[r]), acc[r]);
    }
    for (int r = 0; r < R; ++r) out[r] = hsum(acc[r]);
}

static float dot_q5_K(const uint8_t* w, const uint8_t* act, int64_t k) {
    const int64_t nb = k / 256;
    const auto [aq, ad, bs] = a256_parts(act, k);
    __m256 acc = _mm256_setzero_ps();
    float summ = 0.0f;
    const __m256i m4 = _mm256_set1_epi8(0x0f);
    const __m256i one = _mm256_set1_epi8(1);
    for (int64_t i = 0; i < nb; ++i) {
        const blk_q5_K* x = (const blk_q5_K*)(w + i * 176);
        const float d = fp16_to_fp32(x->d) * ad[i];
        const float dmin = fp16_to_fp32(x->dmin) * ad[i];
        uint8_t sm[16];
        unpack_k_scales(x->scales, sm);
        __m128i b0 = _mm_loadu_si128((const __m128i*)(bs + 16 * i));
        __m128i b1 = _mm_loadu_si128((const __m128i*)(bs + 16 * i + 8));
        __m128i pairs = _mm_hadd_epi16(b0, b1);
        __m128i mins = _mm_cvtepu8_epi16(_mm_loadl_epi64((const __m128i*)(sm + 8)));
        __m128i pm = _mm_madd_epi16(mins, pairs);
        pm = _mm_add_epi32(pm, _mm_shuffle_epi32(pm, 0x4e));
        pm = _mm_add_epi32(pm, _mm_shuffle_epi32(pm, 0xb1));
        summ -= dmin * (float)_mm_cvtsi128_si32(pm);
        const __m256i hb = _mm256_loadu_si256((const __m256i*)x->qh);
        __m256i sumi = _mm256_setzero_si256();
        const int8_t* a = aq + 256 * i;
        for (int c = 0; c < 4; ++c) {
            __m256i q = _mm256_loadu_si256((const __m256i*)(x->qs + 32 * c));
            __m256i h0 = _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(hb, 2 * c), one), 4);
            __m256i h1 = _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(hb, 2 * c + 1), one), 4);
            __m256i lo = _mm256_or_si256(_mm256_and_si256(q, m4), h0);
            __m256i hi = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(q, 4), m4), h1);
            __m256i a0 = _mm256_loadu_si256((const __m256i*)(a + 64 * c));
            __m256i a1 = _mm256_loadu_si256((const __m256i*)(a + 64 * c + 32));
            __m256i p0 = _mm256_madd_epi16(_mm256_maddubs_epi16(lo, a0), _mm256_set1_epi16(sm[2 * c]));
            __m256i p1 = _mm256_madd_epi16(_mm256_maddubs_epi16(hi, a1), _mm256_set1_epi16(sm[2 * c + 1]));
            sumi = _mm256_add_epi32(sumi, _mm256_add_epi32(p0, p1));
        }
        acc = _mm256_fmadd_ps(_mm256_set1_ps(d), _mm256_cvtepi32_ps(sumi), acc);
    }
    return hsum(acc) + summ;
}

static float dot_q6_K(const uint8_t* w, const uint8_t* act, int64_t k) {
    const int64_t nb = k / 256;
    const auto [aq, ad, bs] = a256_parts(act, k);
    __m256 acc = _mm256_setzero_ps();
    const __m256i m4 = _mm256_set1_epi8(0x0f);
    const __m256i m2 = _mm256_set1_epi8(3);
    for (int64_t i = 0; i < nb; ++i) {
        const blk_q6_K* x = (const blk_q6_K*)(w + i * 210);
        const float d = fp16_to_fp32(x->d) * ad[i];
        // 32 * sum(sc * bsum)
        __m256i sc16 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i*)x->scales));
        __m256i bsv = _mm256_loadu_si256((const __m256i*)(bs + 16 * i));
        const int corr = hsum_i32(_mm256_madd_epi16(sc16, bsv));
        __m256i sumi = _mm256_setzero_si256();
        const int8_t* a = aq + 256 * i;
        for (int h = 0; h < 2; ++h) {
            const uint8_t* ql = x->ql + 64 * h;
            const __m256i L0 = _mm256_loadu_si256((const __m256i*)ql);
            const __m256i L1 = _mm256_loadu_si256((const __m256i*)(ql + 32));
            const __m256i H = _mm256_loadu_si256((const __m256i*)(x->qh + 32 * h));
            __m256i q[4];
            q[0] = _mm256_or_si256(_mm256_and_si256(L0, m4), _mm256_slli_epi16(_mm256_and_si256(H, m2), 4));
            q[1] = _mm256_or_si256(_mm256_and_si256(L1, m4),
                                   _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(H, 2), m2), 4));
            q[2] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(L0, 4), m4),
                                   _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(H, 4), m2), 4));
            q[3] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(L1, 4), m4),
                                   _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(H, 6), m2), 4));
            const int8_t* sc = x->scales + 8 * h;
            for (int j = 0; j < 4; ++j) {
                __m256i av = _mm256_loadu_si256((const __m256i*)(a + 128 * h + 32 * j));
                __m256i p = _mm256_maddubs_epi16(q[j], av);
                __m256i s = _mm256_setr_m128i(_mm_set1_epi16(sc[2 * j]), _mm_set1_epi16(sc[2 * j + 1]));
                sumi = _mm256_add_epi32(sumi, _mm256_madd_epi16(p, s));
            }
        }
        sumi = _mm256_sub_epi32(sumi, _mm256_setr_epi32(32 * corr, 0, 0, 0, 0, 0, 0, 0));
        acc = _mm256_fmadd_ps(_mm256_set1_ps(d), _mm256_cvtepi32_ps(sumi), acc);
    }
    return hsum(acc);
}

// Two IQ4 16-byte code fields in the two lanes of q against 64 activations (a0: the first field's 32 elements, a1:
// the second's), regrouped to match the nibbles (low: elements 0..15, high: 16..31). The i16 pair products of each
// half: a pair reaches 2 * 127 * 127, so the halves can only be added as i32.
struct Iq4Halves {
    __m256i lo, hi;
};
struct Iq4Codes {  // the table values of the low and the high nibbles
    __m256i lo, hi;
};
GP_INLINE Iq4Codes iq4_codes(__m256i q) {
    const __m256i m4 = _mm256_set1_epi8(0x0f);
    const __m256i tab = _mm256_broadcastsi128_si256(_mm_load_si128((const __m128i*)iq4_values));
    return {_mm256_shuffle_epi8(tab, _mm256_and_si256(q, m4)),
            _mm256_shuffle_epi8(tab, _mm256_and_si256(_mm256_srli_epi16(q, 4), m4))};
}
GP_INLINE Iq4Halves iq4_pair_products(const Iq4Codes& c, __m256i a0, __m256i a1) {
    const __m256i alo = _mm256_permute2x128_si256(a0, a1, 0x20);
    const __m256i ahi = _mm256_permute2x128_si256(a0, a1, 0x31);
    return {_mm256_maddubs_epi16(_mm256_sign_epi8(alo, alo), _mm256_sign_epi8(c.lo, alo)),
            _mm256_maddubs_epi16(_mm256_sign_epi8(ahi, ahi), _mm256_sign_epi8(c.hi, ahi))};
}

// IQ4_NL against A32: two blocks per step, their 16-byte code fields in the two lanes of one register (low
// nibbles: elements 0..15 of each block, high nibbles 16..31; the activations are regrouped to match). Decode reads
// the rows in order: a streaming read the hardware prefetcher follows, which 4 interleaved rows are not.
template <int R>
static void dot_iq4_nl_r(const uint8_t* w, const uint8_t* act, size_t astride, int64_t k, float* out) {
    const int64_t nb = k / 32;
    A32Parts ap[R];
    __m256 acc[R];
    for (int r = 0; r < R; ++r) {
        ap[r] = a32_parts(act + r * astride, k);
        acc[r] = _mm256_setzero_ps();
    }
    const __m256i ones = _mm256_set1_epi16(1);
    int64_t b = 0;
    for (; b + 2 <= nb; b += 2) {
        const blk_iq4_nl* x = (const blk_iq4_nl*)(w + b * 18);
        const __m256i q = _mm256_inserti128_si256(_mm256_castsi128_si256(_mm_loadu_si128((const __m128i*)x[0].qs)),
                                                  _mm_loadu_si128((const __m128i*)x[1].qs), 1);
        const Iq4Codes c = iq4_codes(q);
        const float d0 = fp16_to_fp32(x[0].d), d1 = fp16_to_fp32(x[1].d);
        for (int r = 0; r < R; ++r) {
            const Iq4Halves pp = iq4_pair_products(c, _mm256_loadu_si256((const __m256i*)(ap[r].qs + 32 * b)),
                                                   _mm256_loadu_si256((const __m256i*)(ap[r].qs + 32 * b + 32)));
            const __m256i s = _mm256_add_epi32(_mm256_madd_epi16(pp.lo, ones), _mm256_madd_epi16(pp.hi, ones));
            const __m256 d = _mm256_set_m128(_mm_set1_ps(d1 * ap[r].d[b + 1]), _mm_set1_ps(d0 * ap[r].d[b]));
            acc[r] = _mm256_fmadd_ps(d, _mm256_cvtepi32_ps(s), acc[r]);
        }
    }
    if (b < nb) {  // an odd block count
        const blk_iq4_nl* x = (const blk_iq4_nl*)(w + b * 18);
        const __m256i wv = iq4_lookup(x->qs);
        const float d0 = fp16_to_fp32(x->d);
        for (int r = 0; r < R; ++r) {
            const __m256i av = _mm256_loadu_si256((const __m256i*)(ap[r].qs + 32 * b));
            acc[r] = _mm256_fmadd_ps(mul_sum_ss8(av, wv), _mm256_set1_ps(d0 * ap[r].d[b]), acc[r]);
        }
    }
    for (int r = 0; r < R; ++r) out[r] = hsum(acc[r]);
}

// IQ4_XS against A256 (as IQ4_NL: rows in order): two 32-element sub-blocks per 32-byte load. The low nibbles hold
// elements 0..15 of sub-block 2p (low lane) and 2p+1 (high lane), the high nibbles elements 16..31: the activations
// are regrouped the same way, and the scales (even sub-blocks in the low lane, odd in the high one) applied by one
// madd per half.
template <int R>
static void dot_iq4_xs_r(const uint8_t* w, const uint8_t* act, size_t astride, int64_t k, float* out) {
    const int64_t nb = k / 256;
    A256Parts ap[R];
    __m256 acc[R];
    for (int r = 0; r < R; ++r) {
        ap[r] = a256_parts(act + r * astride, k);
        acc[r] = _mm256_setzero_ps();
    }
    for (int64_t i = 0; i < nb; ++i) {
        const blk_iq4_xs* x = (const blk_iq4_xs*)(w + i * 136);
        const __m128i sc8 = _mm_sub_epi8(_mm_cvtsi64_si128((long long)iq4_xs_scales(x)), _mm_set1_epi8(32));
        const __m256i sc = even_odd_i16(sc8, true);
        const float dw = fp16_to_fp32(x->d);
        __m256i sumi[R];
        for (int r = 0; r < R; ++r) sumi[r] = _mm256_setzero_si256();
        for (int p = 0; p < 4; ++p) {
            const Iq4Codes c = iq4_codes(_mm256_loadu_si256((const __m256i*)(x->qs + 32 * p)));
            const __m256i s = bcast_i16(sc, p);
            for (int r = 0; r < R; ++r) {
                const int8_t* a = ap[r].qs + 256 * i + 64 * p;
                const Iq4Halves pp = iq4_pair_products(c, _mm256_loadu_si256((const __m256i*)a),
                                                       _mm256_loadu_si256((const __m256i*)(a + 32)));
                sumi[r] = _mm256_add_epi32(sumi[r],
                                           _mm256_add_epi32(_mm256_madd_epi16(pp.lo, s), _mm256_madd_epi16(pp.hi, s)));
            }
        }
        for (int r = 0; r < R; ++r)
            acc[r] = _mm256_fmadd_ps(_mm256_set1_ps(dw * ap[r].d[i]), _mm256_cvtepi32_ps(sumi[r]), acc[r]);
    }
    for (int r = 0; r < R; ++r) out[r] = hsum(acc[r]);
}

// one row of the types with R-row kernels
template <void (*F)(const uint8_t*, const uint8_t*, size_t, int64_t, float*)>
static float dot_one(const uint8_t* w, const uint8_t* act, int64_t k) {
    float v;
    F(w, act, 0, k, &v);
    return v;
}

#else  // scalar

template <int T>
static float dot32_scalar(const uint8_t* w, const uint8_t* act, int64_t k) {
    const int64_t nb = k / 32;
    const auto [aq, ad, as] = a32_parts(act, k);
    float acc = 0.0f, summ = 0.0f;
    for (int64_t b = 0; b < nb; ++b) {
        const int8_t* a = aq + 32 * b;
        int q[32];
        float d = 0.0f, m = 0.0f;
        if (T == T_Q8_0) {
            const blk_q8_0* x = (const blk_q8_0*)(w + b * 34);
            d = fp16_to_fp32(x->d);
            for (int j = 0; j < 32; ++j) q[j] = x->qs[j];
        } else if (T == T_IQ4_NL) {
            const blk_iq4_nl* x = (const blk_iq4_nl*)(w + b * 18);
            d = fp16_to_fp32(x->d);
            for (int j = 0; j < 16; ++j) { q[j] = iq4_values[x->qs[j] & 0x0f]; q[j + 16] = iq4_values[x->qs[j] >> 4]; }
        } else if (T == T_Q4_0 || T == T_Q4_1) {
            const uint8_t* qs;
            if (T == T_Q4_0) {
                const blk_q4_0* x = (const blk_q4_0*)(w + b * 18);
                d = fp16_to_fp32(x->d); m = -8.0f * d; qs = x->qs;
            } else {
                const blk_q4_1* x = (const blk_q4_1*)(w + b * 20);
                d = fp16_to_fp32(x->d); m = fp16_to_fp32(x->m); qs = x->qs;
            }
            for (int j = 0; j < 16; ++j) { q[j] = qs[j] & 0x0f; q[j + 16] = qs[j] >> 4; }
        } else {
            const uint8_t* qs;
            uint32_t qh;
            if (T == T_Q5_0) {
                const blk_q5_0* x = (const blk_q5_0*)(w + b * 22);
                d = fp16_to_fp32(x->d); m = -16.0f * d; qs = x->qs; memcpy(&qh, x->qh, 4);
            } else {
                const blk_q5_1* x = (const blk_q5_1*)(w + b * 24);
                d = fp16_to_fp32(x->d); m = fp16_to_fp32(x->m); qs = x->qs; memcpy(&qh, x->qh, 4);
            }
            for (int j = 0; j < 16; ++j) {
                q[j] = (qs[j] & 0x0f) | (((qh >> j) & 1) << 4);
                q[j + 16] = (qs[j] >> 4) | (((qh >> (j + 16)) & 1) << 4);
            }
        }
        int s = 0;
        for (int j = 0; j < 32; ++j) s += q[j] * a[j];
        acc += (float)s * (d * ad[b]);
        summ += m * as[b];
    }
    return acc + summ;
}

// Q2_K / Q3_K: one 32-element chunk (two groups of 16) per step, in plain loops the compiler vectorises.
static float dot_q2_K_scalar(const uint8_t* w, const uint8_t* act, int64_t k) {
    const int64_t nb = k / 256;
    const auto [aq, ad, bs] = a256_parts(act, k);
    float acc = 0.0f;
    for (int64_t i = 0; i < nb; ++i) {
        const blk_q2_K* x = (const blk_q2_K*)(w + i * 84);
        int sumi = 0, summ = 0;
        for (int j = 0; j < 8; ++j) {
            const uint8_t* q = x->qs + 32 * (j / 4);
            const int8_t* a = aq + 256 * i + 32 * j;
            const int sh = 2 * (j % 4);
            int s0 = 0, s1 = 0;
#pragma GCC unroll 1  // else fully unrolled before the vectoriser sees the loop
            for (int l = 0; l < 16; ++l) s0 += (int)((q[l] >> sh) & 3) * (int)a[l];
#pragma GCC unroll 1
            for (int l = 16; l < 32; ++l) s1 += (int)((q[l] >> sh) & 3) * (int)a[l];
            sumi += (x->scales[2 * j] & 0x0f) * s0 + (x->scales[2 * j + 1] & 0x0f) * s1;
        }
        for (int g = 0; g < 16; ++g) summ += (x->scales[g] >> 4) * bs[16 * i + g];
        acc += fp16_to_fp32(x->d) * ad[i] * (float)sumi - fp16_to_fp32(x->dmin) * ad[i] * (float)summ;
    }
    return acc;
}

static float dot_q3_K_scalar(const uint8_t* w, const uint8_t* act, int64_t k) {
    const int64_t nb = k / 256;
    const int8_t* aq = (const int8_t*)act;
    const float* ad = (const float*)(act + k);
    float acc = 0.0f;
    for (int64_t i = 0; i < nb; ++i) {
        const blk_q3_K* x = (const blk_q3_K*)(w + i * 110);
        int8_t sc[16];
        unpack_q3_scales(x->scales, sc);
        int sumi = 0;
        for (int j = 0; j < 8; ++j) {
            const uint8_t* q = x->qs + 32 * (j / 4);
            const uint8_t* hm = x->hmask;
            const int8_t* a = aq + 256 * i + 32 * j;
            const int sh = 2 * (j % 4);
            int s0 = 0, s1 = 0;
#pragma GCC unroll 1  // else fully unrolled before the vectoriser sees the loop
            for (int l = 0; l < 16; ++l)
                s0 += ((int)((q[l] >> sh) & 3) + 4 * (int)((hm[l] >> j) & 1) - 4) * (int)a[l];
#pragma GCC unroll 1
            for (int l = 16; l < 32; ++l)
                s1 += ((int)((q[l] >> sh) & 3) + 4 * (int)((hm[l] >> j) & 1) - 4) * (int)a[l];
            sumi += sc[2 * j] * s0 + sc[2 * j + 1] * s1;
        }
        acc += fp16_to_fp32(x->d) * ad[i] * (float)sumi;
    }
    return acc;
}

static float dot_iq4_xs_scalar(const uint8_t* w, const uint8_t* act, int64_t k) {
    const int64_t nb = k / 256;
    const int8_t* aq = (const int8_t*)act;
    const float* ad = (const float*)(act + k);
    float acc = 0.0f;
    for (int64_t i = 0; i < nb; ++i) {
        const blk_iq4_xs* x = (const blk_iq4_xs*)(w + i * 136);
        const uint64_t sc = iq4_xs_scales(x);
        int sumi = 0;
        for (int j = 0; j < 8; ++j) {
            const uint8_t* q = x->qs + 16 * j;
            const int8_t* a = aq + 256 * i + 32 * j;
            int s = 0;
            for (int l = 0; l < 16; ++l) s += iq4_values[q[l] & 0x0f] * a[l] + iq4_values[q[l] >> 4] * a[l + 16];
            sumi += ((int)((sc >> (8 * j)) & 63) - 32) * s;
        }
        acc += fp16_to_fp32(x->d) * ad[i] * (float)sumi;
    }
    return acc;
}

static float dot_qK_scalar(int type, const uint8_t* w, const uint8_t* act, int64_t k) {
    const int64_t nb = k / 256;
    const auto [aq, ad, bs] = a256_parts(act, k);
    float acc = 0.0f;
    for (int64_t i = 0; i < nb; ++i) {
        const int8_t* a = aq + 256 * i;
        const int16_t* b = bs + 16 * i;
        if (type == T_Q6_K) {
            const blk_q6_K* x = (const blk_q6_K*)(w + i * 210);
            int sumi = 0;
            for (int h = 0; h < 2; ++h) {
                const uint8_t* ql = x->ql + 64 * h;
                const uint8_t* qh = x->qh + 32 * h;
                const int8_t* sc = x->scales + 8 * h;
                const int8_t* ah = a + 128 * h;
                for (int l = 0; l < 32; ++l) {
                    const int is = l / 16;
                    const int q1 = (int)((ql[l] & 0x0f) | (((qh[l] >> 0) & 3) << 4)) - 32;
                    const int q2 = (int)((ql[l + 32] & 0x0f) | (((qh[l] >> 2) & 3) << 4)) - 32;
                    const int q3 = (int)((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) - 32;
                    const int q4 = (int)((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) - 32;
                    sumi += sc[is] * q1 * ah[l] + sc[is + 2] * q2 * ah[l + 32] + sc[is + 4] * q3 * ah[l + 64] +
                            sc[is + 6] * q4 * ah[l + 96];
                }
            }
            acc += fp16_to_fp32(x->d) * ad[i] * (float)sumi;
            continue;
        }
        const uint8_t* qs;
        const uint8_t* qh = nullptr;
        const uint8_t* scales;
        float d, dmin;
        if (type == T_Q4_K) {
            const blk_q4_K* x = (const blk_q4_K*)(w + i * 144);
            d = fp16_to_fp32(x->d); dmin = fp16_to_fp32(x->dmin); qs = x->qs; scales = x->scales;
        } else {
            const blk_q5_K* x = (const blk_q5_K*)(w + i * 176);
            d = fp16_to_fp32(x->d); dmin = fp16_to_fp32(x->dmin); qs = x->qs; scales = x->scales; qh = x->qh;
        }
        uint8_t sm[16];
        unpack_k_scales(scales, sm);
        int sumi = 0, summ = 0;
        for (int c = 0; c < 4; ++c) {
            int s0 = 0, s1 = 0;
            for (int l = 0; l < 32; ++l) {
                int lo = qs[32 * c + l] & 0x0f, hi = qs[32 * c + l] >> 4;
                if (qh) {
                    lo |= ((qh[l] >> (2 * c)) & 1) << 4;
                    hi |= ((qh[l] >> (2 * c + 1)) & 1) << 4;
                }
                s0 += lo * a[64 * c + l];
                s1 += hi * a[64 * c + 32 + l];
            }
            sumi += s0 * sm[2 * c] + s1 * sm[2 * c + 1];
            summ += sm[8 + 2 * c] * (b[4 * c] + b[4 * c + 1]) + sm[8 + 2 * c + 1] * (b[4 * c + 2] + b[4 * c + 3]);
        }
        acc += d * ad[i] * (float)sumi - dmin * ad[i] * (float)summ;
    }
    return acc;
}
#endif

float vec_dot_w(int type, const void* w, const uint8_t* act, int64_t k) {
    const uint8_t* wb = (const uint8_t*)w;
#if GP_AVX2
    switch (type) {
        case T_Q4_0: return dot_u32<T_Q4_0>(wb, act, k);
        case T_Q4_1: return dot_u32<T_Q4_1>(wb, act, k);
        case T_Q5_0: return dot_u32<T_Q5_0>(wb, act, k);
        case T_Q5_1: return dot_u32<T_Q5_1>(wb, act, k);
        case T_Q8_0: return dot_q8_0(wb, act, k);
        case T_Q2_K: return dot_one<dot_q2_K_r<1>>(wb, act, k);
        case T_Q3_K: return dot_one<dot_q3_K_r<1>>(wb, act, k);
        case T_Q4_K: return dot_q4_K(wb, act, k);
        case T_Q5_K: return dot_q5_K(wb, act, k);
        case T_Q6_K: return dot_q6_K(wb, act, k);
        case T_IQ4_NL: return dot_one<dot_iq4_nl_r<1>>(wb, act, k);
        case T_IQ4_XS: return dot_one<dot_iq4_xs_r<1>>(wb, act, k);
        default: return 0.0f;
    }
#else
    switch (type) {
        case T_Q4_0: return dot32_scalar<T_Q4_0>(wb, act, k);
        case T_Q4_1: return dot32_scalar<T_Q4_1>(wb, act, k);
        case T_Q5_0: return dot32_scalar<T_Q5_0>(wb, act, k);
        case T_Q5_1: return dot32_scalar<T_Q5_1>(wb, act, k);
        case T_Q8_0: return dot32_scalar<T_Q8_0>(wb, act, k);
        case T_Q2_K: return dot_q2_K_scalar(wb, act, k);
        case T_Q3_K: return dot_q3_K_scalar(wb, act, k);
        case T_Q4_K: case T_Q5_K: case T_Q6_K: return dot_qK_scalar(type, wb, act, k);
        case T_IQ4_NL: return dot32_scalar<T_IQ4_NL>(wb, act, k);
        case T_IQ4_XS: return dot_iq4_xs_scalar(wb, act, k);
        default: return 0.0f;
    }
#endif
}

#if GP_AVX2
// R activation rows against weight rows [0, nr) of a type with R-row kernels; false for the other types
template <int R>
static bool dot_rows_r(int type, const uint8_t* w, int64_t ws, int64_t nr, const uint8_t* act, size_t astride,
                       int64_t k, float* out, size_t ostride) {
    void (*f)(const uint8_t*, const uint8_t*, size_t, int64_t, float*);
    switch (type) {
        case T_Q2_K: f = dot_q2_K_r<R>; break;
        case T_Q3_K: f = dot_q3_K_r<R>; break;
        case T_IQ4_NL: f = dot_iq4_nl_r<R>; break;
        case T_IQ4_XS: f = dot_iq4_xs_r<R>; break;
        default: return false;
    }
    for (int64_t m = 0; m < nr; ++m) {
        float v[R];
        f(w + m * ws, act, astride, k, v);
        for (int r = 0; r < R; ++r) ((float*)((uint8_t*)out + r * ostride))[m] = v[r];
    }
    return true;
}
#endif

void gemv_rows(int type, const uint8_t* w, int64_t ws, int64_t nr, const uint8_t* act, size_t astride, int nact,
               int64_t k, float* out, size_t ostride) {
    int i = 0;
#if GP_AVX2
    // Q2_K / Q3_K / IQ4: 4 activation rows per pass over a weight row, whose blocks are decoded once for them (these
    // types are not repacked, and they take this path at every row count)
    for (; i + 4 <= nact; i += 4)
        if (!dot_rows_r<4>(type, w, ws, nr, act + i * astride, astride, k, (float*)((uint8_t*)out + i * ostride),
                           ostride))
            break;
    const int left = nact - i;
    if (left > 1 && left < 4 &&
        (left == 3 ? dot_rows_r<3>(type, w, ws, nr, act + i * astride, astride, k,
                                   (float*)((uint8_t*)out + i * ostride), ostride)
                   : dot_rows_r<2>(type, w, ws, nr, act + i * astride, astride, k,
                                   (float*)((uint8_t*)out + i * ostride), ostride)))
        i = nact;
#endif
    for (; i < nact; ++i) {
        float* o = (float*)((uint8_t*)out + i * ostride);
        const uint8_t* a = act + i * astride;
        for (int64_t m = 0; m < nr; ++m) o[m] = vec_dot_w(type, w + m * ws, a, k);
    }
}

double stream_read(const uint8_t* p, size_t n) {
    size_t i = 0;
#if GP_AVX2
    __m256i s0 = _mm256_setzero_si256(), s1 = _mm256_setzero_si256();
    __m256i s2 = _mm256_setzero_si256(), s3 = _mm256_setzero_si256();
    for (; i + 128 <= n; i += 128) {
        s0 = _mm256_add_epi64(s0, _mm256_loadu_si256((const __m256i*)(p + i)));
        s1 = _mm256_add_epi64(s1, _mm256_loadu_si256((const __m256i*)(p + i + 32)));
        s2 = _mm256_add_epi64(s2, _mm256_loadu_si256((const __m256i*)(p + i + 64)));
        s3 = _mm256_add_epi64(s3, _mm256_loadu_si256((const __m256i*)(p + i + 96)));
    }
    __m256i s = _mm256_add_epi64(_mm256_add_epi64(s0, s1), _mm256_add_epi64(s2, s3));
    int64_t v[4];
    _mm256_storeu_si256((__m256i*)v, s);
    uint64_t acc = (uint64_t)v[0] + (uint64_t)v[1] + (uint64_t)v[2] + (uint64_t)v[3];
#else
    uint64_t acc = 0;
    for (; i + 8 <= n; i += 8) {
        uint64_t x;
        memcpy(&x, p + i, 8);
        acc += x;
    }
#endif
    for (; i < n; ++i) acc += p[i];
    return (double)(acc & 0xffffffu);
}

}  // namespace GP_NS
}  // namespace gp
