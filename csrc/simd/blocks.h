// ggml block layouts (storage formats of the quantized types). Plain structs and ISA-neutral static inline helpers.
#pragma once

#include <cstdint>
#include <cstring>

#include "common.h"

namespace gp {

struct blk_q4_0 { uint16_t d; uint8_t qs[16]; };
struct blk_q4_1 { uint16_t d, m; uint8_t qs[16]; };
struct blk_q5_0 { uint16_t d; uint8_t qh[4]; uint8_t qs[16]; };
struct blk_q5_1 { uint16_t d, m; uint8_t qh[4]; uint8_t qs[16]; };
struct blk_q8_0 { uint16_t d; int8_t qs[32]; };
// Q2_K: 16 groups of 16; scales[g] = scale (low nibble) | min (high nibble); element 128h + 32s + l (h = 0..1,
// s = 0..3, l = 0..31) is bits 2s..2s+1 of qs[32h + l]; value = d * scale * q - dmin * min.
struct blk_q2_K { uint8_t scales[16]; uint8_t qs[64]; uint16_t d, dmin; };
// Q3_K: the low 2 bits as Q2_K's qs; the third bit of element 32j + l (j = 0..7) is bit j of hmask[l]; a clear bit
// subtracts 4 (q in -4..3); 16 six-bit scales packed in 12 bytes (see unpack_q3_scales), stored + 32;
// value = d * (scale - 32) * q.
struct blk_q3_K { uint8_t hmask[32]; uint8_t qs[64]; uint8_t scales[12]; uint16_t d; };
struct blk_q4_K { uint16_t d, dmin; uint8_t scales[12]; uint8_t qs[128]; };
struct blk_q5_K { uint16_t d, dmin; uint8_t scales[12]; uint8_t qh[32]; uint8_t qs[128]; };
struct blk_q6_K { uint8_t ql[128]; uint8_t qh[64]; int8_t scales[16]; uint16_t d; };
// IQ4_NL / IQ4_XS: 4-bit indices into the fixed non-linear table iq4_values; per 32 elements 16 bytes, element j
// in the low nibble of byte j, element 16 + j in its high nibble. value = d * iq4_values[q] (IQ4_NL), or
// d * (scale - 32) * iq4_values[q] with a six-bit scale per 32 elements (IQ4_XS: see iq4_xs_scales).
struct blk_iq4_nl { uint16_t d; uint8_t qs[16]; };
struct blk_iq4_xs { uint16_t d; uint16_t scales_h; uint8_t scales_l[4]; uint8_t qs[128]; };

static_assert(sizeof(blk_q4_0) == 18, "q4_0");
static_assert(sizeof(blk_q4_1) == 20, "q4_1");
static_assert(sizeof(blk_q5_0) == 22, "q5_0");
static_assert(sizeof(blk_q5_1) == 24, "q5_1");
static_assert(sizeof(blk_q8_0) == 34, "q8_0");
static_assert(sizeof(blk_q2_K) == 84, "q2_K");
static_assert(sizeof(blk_q3_K) == 110, "q3_K");
static_assert(sizeof(blk_q4_K) == 144, "q4_K");
static_assert(sizeof(blk_q5_K) == 176, "q5_K");
static_assert(sizeof(blk_q6_K) == 210, "q6_K");
static_assert(sizeof(blk_iq4_nl) == 18, "iq4_nl");
static_assert(sizeof(blk_iq4_xs) == 136, "iq4_xs");

// The block of a 32-element type id, for kernels templated on the type: Blk<T_Q4_0>::size == sizeof(blk_q4_0).
template <int T>
struct Blk;
template <> struct Blk<T_Q4_0> { enum { size = sizeof(blk_q4_0) }; };
template <> struct Blk<T_Q4_1> { enum { size = sizeof(blk_q4_1) }; };
template <> struct Blk<T_Q5_0> { enum { size = sizeof(blk_q5_0) }; };
template <> struct Blk<T_Q5_1> { enum { size = sizeof(blk_q5_1) }; };
template <> struct Blk<T_Q8_0> { enum { size = sizeof(blk_q8_0) }; };

// ggml's kvalues_iq4nl
alignas(16) static const int8_t iq4_values[16] = {-127, -104, -83, -65, -49, -35, -22, -10,
                                                  1,    13,   25,  38,  53,  69,  89,  113};

// The 8 six-bit scales of an IQ4_XS block as bytes of a uint64 (sub-block j in byte j, stored value 0..63, i.e.
// + 32): the low 4 bits of scale j are nibble j of scales_l, its high 2 bits are bits 2j..2j+1 of scales_h. Built
// in a register by spreading the bit fields apart (no byte stores for a vector load to trip over).
static inline uint64_t iq4_xs_scales(const blk_iq4_xs* x) {
    uint32_t l32;
    memcpy(&l32, x->scales_l, 4);
    uint64_t lo = l32, hi = x->scales_h;
    lo = (lo | lo << 16) & 0x0000ffff0000ffffull;  // nibbles j -> byte j
    lo = (lo | lo << 8) & 0x00ff00ff00ff00ffull;
    lo = (lo | lo << 4) & 0x0f0f0f0f0f0f0f0full;
    hi = (hi | hi << 24) & 0x000000ff000000ffull;  // 2-bit fields j -> byte j
    hi = (hi | hi << 12) & 0x000f000f000f000full;
    hi = (hi | hi << 6) & 0x0303030303030303ull;
    return lo | hi << 4;
}

// The 12 packed bytes of a Q4_K/Q5_K block -> 8 six-bit scales (out[0..7]) and 8 mins (out[8..15]).
static inline void unpack_k_scales(const uint8_t* s, uint8_t* out) {
    uint32_t u[4];
    u[0] = (uint32_t)s[0] | (uint32_t)s[1] << 8 | (uint32_t)s[2] << 16 | (uint32_t)s[3] << 24;
    u[1] = (uint32_t)s[4] | (uint32_t)s[5] << 8 | (uint32_t)s[6] << 16 | (uint32_t)s[7] << 24;
    u[2] = (uint32_t)s[8] | (uint32_t)s[9] << 8 | (uint32_t)s[10] << 16 | (uint32_t)s[11] << 24;
    const uint32_t m6 = 0x3f3f3f3fu, m4 = 0x0f0f0f0fu, m2 = 0x03030303u;
    uint32_t sc_lo = u[0] & m6;                                  // scales 0..3
    uint32_t sc_hi = (u[2] & m4) | (((u[0] >> 6) & m2) << 4);    // scales 4..7
    uint32_t mn_lo = u[1] & m6;                                  // mins 0..3
    uint32_t mn_hi = ((u[2] >> 4) & m4) | (((u[1] >> 6) & m2) << 4);  // mins 4..7
    uint32_t r[4] = {sc_lo, sc_hi, mn_lo, mn_hi};
    for (int i = 0; i < 4; ++i) {
        out[4 * i + 0] = (uint8_t)(r[i]);
        out[4 * i + 1] = (uint8_t)(r[i] >> 8);
        out[4 * i + 2] = (uint8_t)(r[i] >> 16);
        out[4 * i + 3] = (uint8_t)(r[i] >> 24);
    }
}

// The inverse: 8 six-bit scales (sm[0..7]) and 8 mins (sm[8..15]) -> the 12 packed bytes of a Q4_K/Q5_K block.
static inline void pack_k_scales(const uint8_t* sm, uint8_t* s) {
    for (int j = 0; j < 4; ++j) {
        s[j] = (uint8_t)((sm[j] & 63) | (sm[j + 4] >> 4) << 6);
        s[j + 4] = (uint8_t)((sm[8 + j] & 63) | (sm[12 + j] >> 4) << 6);
        s[j + 8] = (uint8_t)((sm[j + 4] & 15) | (sm[12 + j] & 15) << 4);
    }
}

// The 12 packed bytes of a Q3_K block -> its 16 signed scales (stored value - 32, -32..31). Scale i takes its low
// 4 bits from byte i % 8 (low nibble for i < 8, high nibble otherwise) and its high 2 bits from byte 8 + i % 4, bits
// 2 * (i / 4) and up.
// r[w] holds scales 4w..4w+3 (stored values 0..63), one per byte, little-endian.
static inline void q3_scales_u32(const uint8_t* s, uint32_t* r) {
    const uint32_t u0 = (uint32_t)s[0] | (uint32_t)s[1] << 8 | (uint32_t)s[2] << 16 | (uint32_t)s[3] << 24;
    const uint32_t u1 = (uint32_t)s[4] | (uint32_t)s[5] << 8 | (uint32_t)s[6] << 16 | (uint32_t)s[7] << 24;
    const uint32_t u2 = (uint32_t)s[8] | (uint32_t)s[9] << 8 | (uint32_t)s[10] << 16 | (uint32_t)s[11] << 24;
    const uint32_t m4 = 0x0f0f0f0fu, m2 = 0x03030303u;
    r[0] = (u0 & m4) | ((u2 & m2) << 4);                // scales 0..3
    r[1] = (u1 & m4) | (((u2 >> 2) & m2) << 4);         // scales 4..7
    r[2] = ((u0 >> 4) & m4) | (((u2 >> 4) & m2) << 4);  // scales 8..11
    r[3] = ((u1 >> 4) & m4) | (((u2 >> 6) & m2) << 4);  // scales 12..15
}
static inline void unpack_q3_scales(const uint8_t* s, int8_t* out) {
    uint32_t r[4];
    q3_scales_u32(s, r);
    for (int i = 0; i < 4; ++i)
        for (int b = 0; b < 4; ++b) out[4 * i + b] = (int8_t)((int)((r[i] >> (8 * b)) & 0xffu) - 32);
}

}  // namespace gp
