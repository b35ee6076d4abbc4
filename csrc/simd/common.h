// ggml_py simd backend: ISA-neutral declarations shared by the plan executor and every kernel translation unit.
//
// Only plain data and `static inline` helpers live here: kernel TUs are compiled once per ISA level with different
// flags, so anything with external linkage defined in a header (including std:: templates instantiated out of line)
// could be merged across levels by the linker and run AVX-512 code on an AVX2 machine.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>

#include "ggml_py/backend_abi.h"

namespace gp {

// ggml type ids
enum TypeId : int32_t {
    T_F32 = 0,
    T_F16 = 1,
    T_Q4_0 = 2,
    T_Q4_1 = 3,
    T_Q5_0 = 6,
    T_Q5_1 = 7,
    T_Q8_0 = 8,
    T_Q8_1 = 9,
    T_Q2_K = 10,
    T_Q3_K = 11,
    T_Q4_K = 12,
    T_Q5_K = 13,
    T_Q6_K = 14,
    T_Q8_K = 15,
    T_IQ4_NL = 20,
    T_IQ4_XS = 23,
    T_I8 = 24,
    T_I16 = 25,
    T_I32 = 26,
    T_I64 = 27,
    T_BF16 = 30,
};

// Elements per block and bytes per block; 0 for unknown types.
static inline int type_block(int t) {
    switch (t) {
        case T_Q4_0: case T_Q4_1: case T_Q5_0: case T_Q5_1: case T_Q8_0: case T_Q8_1: case T_IQ4_NL: return 32;
        case T_Q2_K: case T_Q3_K: case T_Q4_K: case T_Q5_K: case T_Q6_K: case T_Q8_K: case T_IQ4_XS: return 256;
        case T_F32: case T_F16: case T_BF16: case T_I8: case T_I16: case T_I32: case T_I64: return 1;
        default: return 0;
    }
}
static inline int type_size(int t) {
    switch (t) {
        case T_F32: return 4;
        case T_F16: return 2;
        case T_BF16: return 2;
        case T_I8: return 1;
        case T_I16: return 2;
        case T_I32: return 4;
        case T_I64: return 8;
        case T_Q4_0: return 18;
        case T_Q4_1: return 20;
        case T_Q5_0: return 22;
        case T_Q5_1: return 24;
        case T_Q8_0: return 34;
        case T_Q8_1: return 36;
        case T_Q2_K: return 84;
        case T_Q3_K: return 110;
        case T_Q4_K: return 144;
        case T_Q5_K: return 176;
        case T_Q6_K: return 210;
        case T_Q8_K: return 292;
        case T_IQ4_NL: return 18;
        case T_IQ4_XS: return 136;
        default: return 0;
    }
}
static inline bool type_is_quant(int t) { return type_block(t) > 1; }
static inline int64_t row_bytes(int t, int64_t n) { return n / type_block(t) * type_size(t); }
// The types CPY and SET_ROWS write (ggml_py.ir.ops.CPY_DST_TYPES): float storage, and the quantized types with one
// of ggml's reference quantizers here (k_quantize.cpp, k_quantize_k.cpp).
static inline bool type_is_cpy_dst(int t) {
    return t == T_F32 || t == T_F16 || t == T_BF16 || t == T_Q8_0 || t == T_Q4_0 || t == T_Q4_1 || t == T_Q5_0 ||
           t == T_Q5_1 || t == T_Q2_K || t == T_Q3_K || t == T_Q4_K || t == T_Q5_K || t == T_Q6_K;
}

// Op ids, names, parameter slots and op lists are the ABI's (generated from ggml_py's op schema). This backend never
// lists the ops of a family by hand: switches take their case labels from the header's X-macro lists,
//   switch (op) { GGML_PY_OPS_UNARY(GP_OP_CASE) ... }
static inline const char* op_name(int op) {
    static const char* const names[] = GGML_PY_OP_NAMES_INIT;
    return op > 0 && op < GGML_PY_OP_COUNT ? names[op] : "?";
}
#define GP_OP_CASE(NAME) case GGML_PY_OP_##NAME:

// The schema's TRANSCENDENTAL ops: exp, log, tanh, erf, sin or cos per element (work estimates weigh them heavier).
static constexpr bool op_is_transcendental(int op) {
#define GP_OP_IS(NAME) op == GGML_PY_OP_##NAME ||
    return GGML_PY_OPS_TRANSCENDENTAL(GP_OP_IS) false;
#undef GP_OP_IS
}

// One operand as a kernel sees it: ggml order (ne[0] innermost), strides in bytes.
struct Tensor {
    int32_t type = -1;
    int64_t ne[4] = {1, 1, 1, 1};
    int64_t nb[4] = {0, 0, 0, 0};
    uint8_t* data = nullptr;
};

static inline int64_t nrows(const Tensor& t) { return t.ne[1] * t.ne[2] * t.ne[3]; }
static inline int64_t nelements(const Tensor& t) { return t.ne[0] * t.ne[1] * t.ne[2] * t.ne[3]; }
static inline bool is_contiguous(const Tensor& t) {
    int64_t s = type_size(t.type);
    if (t.nb[0] != s) return false;
    int64_t r = row_bytes(t.type, t.ne[0]);
    for (int i = 1; i < 4; ++i) {
        if (t.ne[i] != 1 && t.nb[i] != r) return false;
        r *= t.ne[i];
    }
    return true;
}
static inline bool rows_contiguous(const Tensor& t) { return t.nb[0] == type_size(t.type); }

enum { MAX_SRC = GGML_PY_MAX_SRC };

struct ExecCtx;

struct Node {
    int32_t op = GGML_PY_OP_NONE;
    Tensor dst;
    Tensor src[MAX_SRC];
    bool has[MAX_SRC] = {false, false, false, false};
    ggml_py_op_params params = {};  // read through the GGML_PY_P_<OP>_<PARAM> slots
    // set by the plan
    int32_t index = 0;                      // position in the plan
    int32_t n_phases = 1;
    std::atomic<int64_t>* counter = nullptr; // work-stealing counter (reset before every compute)
    // MUL_MAT: src0 (a constant weight) repacked, x8 or p16 by its type (common.h), or null; MUL_MAT_ID: its
    // quantized experts x8 as one matrix of E * M rows, or null; GET_ROWS: the repacked copy a product of the same
    // weight made (a tied embedding), whose rows it reads back (unrepack_row), or null
    const uint8_t* repack = nullptr;
    // MUL_MAT matrix-vector products of one input computed as one task (Plan::group_gemvs): the next product of
    // this node's group, and whether this node is a later member (it then has no task of its own)
    Node* group_next = nullptr;
    bool grouped = false;
};

struct ExecCtx {
    uint8_t* wdata = nullptr;   // shared scratch (one node at a time)
    size_t wsize = 0;
    uint8_t* tdata = nullptr;   // this thread's scratch (each thread gets its own ExecCtx), tsize bytes
    size_t tsize = 0;
    std::atomic<int>* error = nullptr;
    char* errmsg = nullptr;     // ERRMSG_LEN bytes, written by whoever sets error 0 -> 1
    // The calling thread's scratch. Kernels are called with (ith, nth) = (work unit, number of units); the unit
    // index is not a thread index, so scratch does not depend on it.
    uint8_t* thread_scratch(int /*unit*/) const { return tdata; }
};
enum { ERRMSG_LEN = 512 };

typedef void (*KernelFn)(Node& node, int phase, int ith, int nth, const ExecCtx& ctx);

// What one ISA level provides.
struct KernelTable {
    const char* name;
    KernelFn ops[GGML_PY_OP_COUNT];
    // utilities for tests and benchmarks
    double (*stream_read)(const uint8_t* p, size_t n);                         // sums bytes as a read of n bytes
    void (*dequantize_row)(int type, const void* src, float* dst, int64_t n);  // n elements
    void (*quantize_row)(int type, const float* src, void* dst, int64_t n);    // ggml reference quantization
    bool uses_repack;  // plans of this level repack constant weights of products (x8, p16: see below)
};

// Scratch requirement of a node (computed ISA-neutrally by the plan).
struct Scratch {
    size_t shared = 0;
    size_t per_thread = 0;
};

// Rows of activations at or above which MUL_MAT of quantized weights of `type` takes the tiled F32 GEMM path
// (dequantizing the weights) instead of the integer path (each row an integer dot product against the weight chunk,
// which stays in cache for all the rows; activations rounded to 8 bits per row, as llama.cpp does at every size).
// Never by default: the two paths sum differently, and a row's result must not depend on how many rows share the
// product (deterministic batching). GGML_PY_SIMD_GEMM_ROWS (types not repacked) and GGML_PY_SIMD_GEMM_ROWS_X8 (the
// x8 types) set a threshold and give that up. Measured on SmolLM2 (2 threads), integer vs GEMM: Q4_1 16 tokens 735
// vs 372 tok/s, 128: ~720 vs ~570, 512: 564 vs 510; Q6_K ffn_down (the rest Q8_0) 32 / 128 / 512 tokens 1061 / 1072
// / 839 vs 749 / 914 / 658; Q4_K_M 128 tokens 1254 vs 1068. Q5_0 (then not repacked, one row per pass) at 128
// tokens: 234 vs 565. Float weights (F32/F16/BF16) take the GEMM at every row count (returns 1). Read once.
int64_t gemm_min_rows(int type);

// Whether the CPU has AVX512-VNNI (cpu.cpp's detection): the avx512 level's x8 kernels use vpdpbusd where it does.
bool cpu_has_avx512_vnni();

// Whether the CPU's vendor is AMD ("AuthenticAMD"): decode attention leaves out its software prefetch on AMD CPUs
// before Zen 4 (k_attn.cpp).
bool cpu_is_amd();

// FLASH_ATTN_EXT sums a query row's keys in chunks of this many visible tiles of 8 keys (128 keys), merged in order,
// on every path: a decode step splits its keys across threads at these chunks (the granularity of the former
// ranges, which kept two threads busy), and a chunk's partial result per head is FA_PART(Dv) floats (acc[Dv], M,
// pad, S as a double)
enum { FA_CHUNK_TILES = 16 };
// a split-key call's thread scratch for h query heads: their query rows, their chunk's state (acc, S as a double, M)
// and slopes, then its mask rows' chunk tables
static inline int64_t FA_SPLIT_FLOATS(int64_t d, int64_t dv, int64_t h) { return (h * (d + dv + 4) + 15) & ~(int64_t)15; }
static inline int64_t FA_PART(int64_t dv) { return dv + 4; }
// the other calls' thread scratch for h query heads: one row's (fa_row) or one KV head's group's (fa_group) tiles
// and state; then, with at least FA_COPY_MIN_ROWS query rows (a prefill that FA_ROWS_FLOATS' path does not take),
// a KV head's keys and values in F32 (FA_COPY_FLOATS), read by all its query rows: in a model's cache a
// key's heads sit side by side, so one head's keys are 4 KB apart for 32 heads of 64, all in the same cache sets
static inline int64_t FA_TILE_FLOATS(int64_t d, int64_t dv, int64_t h) {
    const int64_t single = ((dv + 15) & ~(int64_t)15) + ((d + 15) & ~(int64_t)15) + dv + 64;
    const int64_t group = 8 * d + 8 * dv + h * (d + 2 * dv) + 6 * h + 64;
    return ((single > group ? single : group) + 15) & ~(int64_t)15;
}
enum { FA_COPY_MIN_ROWS = 8 };
// A prefill takes query rows FA_ROW_BLOCK / g at a time for g = 1 or 2 query heads a KV head, each tile of keys
// converted once for the 8 heads of a block; one at a time for more (3 or 4 heads already share a tile: two rows a
// block measured no faster on Llama-3.2-1B's shape)
enum { FA_ROW_BLOCK = 8 };
// the query heads whose softmax steps a chunk's tile takes side by side (fa_chunk_heads_t): their logits and weights,
// 8 floats each, on the stack
enum { FA_TILE_HEADS = 64 };
constexpr int fa_block_rows(int g) { return g <= 2 ? FA_ROW_BLOCK / g : 1; }
// a prefill's rows through the split kernel, for a block of up to FA_ROW_BLOCK rows: FA_SPLIT_FLOATS, then the rows'
// totals per head (acc, S as a double, M) and each row's chunk table (fa_chunk_starts: the count, then each chunk's
// first tile)
static inline int64_t FA_ROWS_FLOATS(int64_t d, int64_t dv, int64_t h, int64_t nkv) {
    const int64_t hb = FA_ROW_BLOCK * h, nch = ((nkv + 7) / 8 + FA_CHUNK_TILES - 1) / FA_CHUNK_TILES;
    return FA_SPLIT_FLOATS(d, dv, hb) + hb * (dv + 3) + FA_ROW_BLOCK * (nch + 1) + 16;
}
static inline int64_t FA_COPY_FLOATS(int64_t nkv, int64_t d, int64_t dv) { return nkv * (d + dv); }

// Interleaved weight layout "x8" (GEMV of constant Q4_0 / Q4_1 / Q5_0 / Q5_1 / Q8_0 / Q4_K / Q5_K / Q6_K weights): groups
// of 8 rows; per group and 32-column block b a record of 8 * type_size bytes (the weight's own size):
//   Q4_1: qs[128] then d[8] (f16) then m[8] (f16). Byte 32c + 4r + i holds row r's elements 8c+i (low nibble) and
//         8c+4+i (high nibble), c = 0..3, i = 0..3: a 32-byte load, masked, gives 8 lanes (rows) x 4 elements.
//   Q4_0: qs[128] as Q4_1's, then d[8] (f16) at 128 (144 bytes). The -8 offset goes through the activations' block
//         sums (A32's s).
//   Q5_0: Q4_1's qs[128] (the low 4 bits), then qh[32] at 128 (byte 4r + i: the fifth bits of row r's elements 8c+i
//         at bit 2c and 8c+4+i at bit 2c+1, c = 0..3, as Q5_K's qh for one sub-block), then d[8] (f16) at 160 (176
//         bytes). The -16 offset goes through the block sums.
//   Q5_1: Q5_0's qs and qh, then d[8] (f16) at 160 and m[8] (f16) at 176 (192 bytes).
//   Q8_0: qs[256] then d[8] (f16). Byte 32k + 4r + i holds row r's element 4k+i, k = 0..7.
//   Q4_K: per group and 256-column super-block a record of 1184 bytes: sc[64] (6-bit scale of row r, sub-block j at
//         8j + r), m[64] (mins, same order), d[8] (f16), dmin[8] (f16), then qs[1024] (sub-block j = 0..7 at 160 +
//         128j, laid out as Q4_1's qs).
//   Q5_K: per group and super-block a record of 1440 bytes (8 x 180, +2%): Q4_K's sc, m, d, dmin, then for each
//         sub-block j 160 bytes at 160 + 160j, Q4_K's 128 bytes of its low 4 bits, then 32 of its fifth bits (byte
//         4r + i: row r's elements 8c+i at bit 2c and 8c+4+i at bit 2c+1, c = 0..3). The fifth bits beside their
//         nibbles make a record one stream read in order (in a region of their own after the nibbles, the one-row
//         GEMV read 14 GB/s from DRAM on a Zen 4 where Q4_K's read 26-29).
//   Q6_K: per group and 256-column super-block a record of 1680 bytes (8 x 210: no extra memory): sc[128] (int8
//         scale of row r, sub-block j at 16(j/2) + 2r + (j&1): widened to i16, sub-blocks 2p and 2p+1 form one i32
//         lane per row), d[8] (f16) at 128, then for each of the 16 sub-blocks j (16 columns) 96 bytes at 144 + 96j:
//         ql[64] (byte 32c + 4r + i: row r's 4 low bits of elements 16j+8c+i (low nibble) and 16j+8c+4+i (high
//         nibble), c = 0..1, i = 0..3), then qh[32] (byte 4r + i: row r's 2 high bits of elements 16j+4t+i at bits
//         2t..2t+1, t = 0..3).
//   The K-quants' scales come first so that the kernels read each record in address order: with them after the
//   quants (each sub-block's scales read before its quants), the one-row GEMV of a weight of 8192 columns streamed
//   from DRAM at 21-22 GB/s where 2048 columns read 30-32 (Q4_K; a Zen 4, 1 thread), 29-31 with them first.
// Rows beyond the last full group stay in the original layout. Every product of a repacked weight (the integer path,
// and the GEMM where forced) reads the repacked copy, which replaces the original: its memory, usually mapped from the
// GGUF file, is handed back to the OS once repacked (get_repacked).
static inline bool repack_supported(int t) {
    return t == T_Q4_0 || t == T_Q4_1 || t == T_Q5_0 || t == T_Q5_1 || t == T_Q8_0 || t == T_Q4_K || t == T_Q5_K ||
           t == T_Q6_K;
}
// Panel layout "p16" (constant F32 / F16 / BF16 weights): groups of 16 rows, each the GEMM's B panel over all of K
// in the weight's own type, element (r, k) of group g at g*16*K + 16k + r. The GEMM reads it in place (F16/BF16
// converted as they are loaded), without the transposes packing row-major rows takes: a decode step of any row
// count then runs the GEMM's micro-kernel, whose per-element sums every row count shares. Rows beyond the last full
// group stay in the original layout; the original of the groups is handed back as for x8.
static inline bool repack_p16(int t) { return t == T_F32 || t == T_F16 || t == T_BF16; }
// rows per repacked group: 8 (x8), 16 (p16), 0 (never repacked)
static inline int repack_group_rows(int t) { return repack_supported(t) ? 8 : repack_p16(t) ? 16 : 0; }
// Row `row` (< the full groups' rows) of weight w read back from its repacked copy, in the weight's stored format
// (row_bytes(w.type, w.ne[0]) bytes at out): the exact bytes the original held.
void unrepack_row(const Tensor& w, const uint8_t* repacked, int64_t row, uint8_t* out);
// An x8 Q4_K (five false) / Q5_K record (above): where its sc, m, d, dmin start, its bytes, where sub-block j's
// nibbles start (Q5_K's fifth bits 128 bytes after them) and a sub-block's bytes
enum : int64_t { X8K_SC = 0, X8K_MIN = 64, X8K_D = 128, X8K_DMIN = 144, X8K_META = 160 };
constexpr int64_t x8k_sub_bytes(bool five) { return five ? 160 : 128; }
constexpr int64_t x8k_size(bool five) { return X8K_META + 8 * x8k_sub_bytes(five); }
constexpr int64_t x8k_sub(bool five, int64_t j) { return X8K_META + x8k_sub_bytes(five) * j; }
// An x8 Q6_K record (above): where its sc, d and quants start, a sub-block's quant bytes, the record's bytes
enum : int64_t { X8Q6_SC = 0, X8Q6_D = 128, X8Q6_Q = 144, X8Q6_SUB = 96, X8Q6_SIZE = X8Q6_Q + 16 * X8Q6_SUB };
constexpr int64_t x8q6_sub(int64_t j) { return X8Q6_Q + X8Q6_SUB * j; }
// where row r's scale of sub-block j is (sub-blocks 2p and 2p + 1 side by side: one i32 lane per row once widened)
constexpr int64_t x8q6_sc(int j, int r) { return X8Q6_SC + 16 * (j / 2) + 2 * r + (j & 1); }
// bytes per repacked row (a group takes repack_group_rows times this)
static inline int64_t repack_row_bytes(int t, int64_t k) {
    switch (t) {
        case T_Q4_0: case T_Q4_1: case T_Q5_0: case T_Q5_1: case T_Q8_0: return k / 32 * type_size(t);
        case T_Q4_K: case T_Q5_K: return k / 256 * x8k_size(t == T_Q5_K) / 8;
        case T_Q6_K: return k / 256 * X8Q6_SIZE / 8;
        case T_F32: case T_F16: case T_BF16: return k * type_size(t);
        default: return 0;
    }
}

// Internal activation formats of MUL_MAT (per row, 64-byte aligned row stride).
// A32: 32-element blocks: int8 qs[nb*32], then float d[nb], then float s[nb] (s = d * sum(qs)).
// A256 (Q8_K-like): int8 qs[nb*256], then float d[nb], then int16 bsums[nb*16]; used by the weights of 256-element
// super-blocks (weight_uses_a256: Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, IQ4_XS), A32 by the others.
static inline size_t align64(size_t x) { return (x + 63) & ~(size_t)63; }
static inline size_t a32_row_size(int64_t k) { return align64((size_t)k + (size_t)(k / 32) * 8); }
static inline size_t a256_row_size(int64_t k) { return align64((size_t)k + (size_t)(k / 256) * (4 + 32)); }
// The parts of one activation row of k elements, read as `const auto [aq, ad, as] = a32_parts(act, k);`.
struct A32Parts { const int8_t* qs; const float* d; const float* s; };
struct A256Parts { const int8_t* qs; const float* d; const int16_t* bsums; };
static inline A32Parts a32_parts(const uint8_t* act, int64_t k) {
    const float* d = (const float*)(act + k);
    return {(const int8_t*)act, d, d + k / 32};
}
static inline A256Parts a256_parts(const uint8_t* act, int64_t k) {
    const float* d = (const float*)(act + k);
    return {(const int8_t*)act, d, (const int16_t*)(d + k / 256)};
}
static inline bool weight_uses_a256(int t) { return type_is_quant(t) && type_block(t) == 256; }

// GEMM blocking (floats): activations rows MR x weights NR micro tiles; K blocked by KC.
enum { GEMM_MR = 6, GEMM_NR = 16, GEMM_KC = 256, GEMM_MC = 120, GEMM_NC = 1024 };
static inline size_t gemm_thread_scratch() {
    return ((size_t)GEMM_NC * GEMM_KC + (size_t)(GEMM_MC + GEMM_MR) * GEMM_KC + 64 + (size_t)16 * GEMM_KC) * 4 + 256;
}
// at most GEMM_MR activation rows: one weight panel (and its dequantized rows) at a time, the rows packed over all K
static inline size_t gemm_small_thread_scratch(int64_t k) {
    return ((size_t)32 * GEMM_KC + (size_t)GEMM_MR * (size_t)k + 64) * 4 + 256;
}

// MUL_MAT_ID (k_mul_mat_id.cpp): src0 the experts' weights [K, M, E], src1 the activations [K, S, T], src2 the
// ids [k, T]. Its shared scratch: per expert the first of its grouped rows (E + 1 int64), a cursor per expert (E
// int64), the grouped (token, slot) pairs as dst rows t * k + i (k * T int32), then the grouped activation rows
// (quantized as MUL_MAT's integer path quantizes them, or F32), act_row bytes apart.
enum { ID_CHUNK_MAX = 1024, ID_GEMV_ROWS = 8, ID_GEMM_ROWS = 120 };
struct IdScratch {
    size_t cursors, pairs, acts, act_row, total;
};
// a float phase-2 unit's thread scratch: the GEMM's, then ID_GEMM_ROWS x ID_CHUNK_MAX results
static inline size_t id_gemm_scratch(int64_t k) {
    const size_t big = gemm_thread_scratch(), small = gemm_small_thread_scratch(k);
    return align64(big > small ? big : small);
}
static inline IdScratch id_scratch(const Node& n) {
    const int64_t K = n.src[0].ne[0], E = n.src[0].ne[2], R = n.src[2].ne[0] * n.src[2].ne[1];
    const int t = n.src[0].type;
    IdScratch s;
    s.cursors = (size_t)(E + 1) * 8;
    s.pairs = s.cursors + (size_t)E * 8;
    s.acts = align64(s.pairs + (size_t)R * 4);
    s.act_row = !type_is_quant(t) ? align64((size_t)K * 4) : weight_uses_a256(t) ? a256_row_size(K) : a32_row_size(K);
    s.total = s.acts + (size_t)R * s.act_row;
    return s;
}

}  // namespace gp
