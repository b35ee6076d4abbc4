// Interleaved ("x8") layouts of constant Q4_0 / Q4_1 / Q5_0 / Q5_1 / Q8_0 / Q4_K / Q5_K / Q6_K weights for the GEMV
// kernels and panel ("p16") layouts of constant F32 / F16 / BF16 weights for the GEMM (see common.h), made once per
// weight and shared by every plan through a cache keyed by the weight's unique id, address and shape.
#include <cstdlib>
#include <cstring>
#if defined(__linux__)
#include <sys/mman.h>
#include <unistd.h>
#endif
#include <atomic>
#include <map>
#include <mutex>
#include <thread>
#include <tuple>
#include <type_traits>
#include <vector>

#include "blocks.h"
#include "runtime.h"

namespace gp {

// Repacked weights are laid back to back in arenas of whole 2 MiB pages (aligned_alloc_bytes: huge pages where the
// OS gives them), so no weight ends in small pages: each in its own mapping, a model's weights of 2-14 MB had their
// last partial huge page, about 15% of their bytes, in small pages, which the GEMV read about twice as slowly (a
// chain of 9.4 MB Q4_K products at 2 threads: 25 GB/s, in one arena 29). An arena is ARENA_BYTES of address space
// (or one larger weight's size); only the pages written count in RSS.
namespace {
struct RepackArena {
    uint8_t* base = nullptr;
    size_t size = 0, used = 0;
    bool mmapped = false;
    ~RepackArena() { aligned_free_bytes(base, size, mmapped); }
};
constexpr size_t ARENA_BYTES = size_t(256) << 20;
}  // namespace

// n bytes (64-aligned) in the current arena, or in a new one; the caller holds get_repacked's lock
static uint8_t* arena_alloc(size_t n, std::shared_ptr<void>* owner) {
    static std::weak_ptr<RepackArena> current;
    n = (n + 63) & ~(size_t)63;
    std::shared_ptr<RepackArena> a = current.lock();
    if (!a || a->size - a->used < n) {
        a = std::make_shared<RepackArena>();
        a->size = n > ARENA_BYTES ? n : ARENA_BYTES;
        a->base = aligned_alloc_bytes(a->size, &a->mmapped);  // mmap'd: zero pages, none written until used
        current = a;
    }
    uint8_t* p = a->base + a->used;
    a->used += n;
    *owner = a;
    return p;
}

RepackBuf::~RepackBuf() {
    const uintptr_t page = (uintptr_t)sysconf(_SC_PAGESIZE);
    const uintptr_t a = ((uintptr_t)data + page - 1) & ~(page - 1), b = ((uintptr_t)data + size) & ~(page - 1);
    if (b > a) madvise((void*)a, b - a, MADV_DONTNEED);  // a weight freed while others of its arena live
}

// Q4_0 / Q4_1 / Q5_0 / Q5_1: the nibbles as Q4_1's qs[128], Q5's fifth bits in qh[32] after them, then d[8] and
// (Q4_1, Q5_1) m[8] (see common.h)
template <typename Block>
static void repack_q45_01(const Tensor& w, uint8_t* out, int64_t g0, int64_t g1) {
    constexpr bool five = std::is_same_v<Block, blk_q5_0> || std::is_same_v<Block, blk_q5_1>;
    constexpr bool has_m = std::is_same_v<Block, blk_q4_1> || std::is_same_v<Block, blk_q5_1>;
    constexpr int64_t size = 8 * (int64_t)sizeof(Block), doff = five ? 160 : 128;
    const int64_t K = w.ne[0], nb = K / 32;
    for (int64_t g = g0; g < g1; ++g) {
        for (int64_t b = 0; b < nb; ++b) {
            uint8_t* rec = out + (g * nb + b) * size;
            for (int r = 0; r < 8; ++r) {
                const Block* x = (const Block*)(w.data + (8 * g + r) * w.nb[1]) + b;
                uint8_t q[32], h[32] = {};
                for (int j = 0; j < 16; ++j) {
                    q[j] = x->qs[j] & 0x0f;
                    q[j + 16] = x->qs[j] >> 4;
                }
                if constexpr (five) {  // element l's fifth bit is bit l of qh
                    uint32_t qh;
                    memcpy(&qh, x->qh, 4);
                    for (int l = 0; l < 32; ++l) h[l] = (uint8_t)((qh >> l) & 1);
                }
                for (int c = 0; c < 4; ++c)
                    for (int i = 0; i < 4; ++i) {
                        rec[32 * c + 4 * r + i] = (uint8_t)(q[8 * c + i] | (q[8 * c + 4 + i] << 4));
                        if constexpr (five) {
                            uint8_t& hb = rec[128 + 4 * r + i];
                            if (c == 0) hb = 0;
                            hb |= (uint8_t)((h[8 * c + i] << (2 * c)) | (h[8 * c + 4 + i] << (2 * c + 1)));
                        }
                    }
                memcpy(rec + doff + 2 * r, &x->d, 2);
                if constexpr (has_m) memcpy(rec + doff + 16 + 2 * r, &x->m, 2);
            }
        }
    }
}

static void repack_q8_0(const Tensor& w, uint8_t* out, int64_t g0, int64_t g1) {
    const int64_t K = w.ne[0], nb = K / 32;
    for (int64_t g = g0; g < g1; ++g) {
        for (int64_t b = 0; b < nb; ++b) {
            uint8_t* rec = out + (g * nb + b) * 272;
            uint16_t* dd = (uint16_t*)(rec + 256);
            for (int r = 0; r < 8; ++r) {
                const blk_q8_0* x = (const blk_q8_0*)(w.data + (8 * g + r) * w.nb[1]) + b;
                for (int k = 0; k < 8; ++k)
                    for (int i = 0; i < 4; ++i) rec[32 * k + 4 * r + i] = (uint8_t)x->qs[4 * k + i];
                memcpy(&dd[r], &x->d, 2);
            }
        }
    }
}

// Q4_K and Q5_K: the same records, Q5_K's with each sub-block's fifth bits after its nibbles (see common.h)
template <typename Block>
static void repack_q45_K(const Tensor& w, uint8_t* out, int64_t g0, int64_t g1) {
    constexpr bool five = std::is_same_v<Block, blk_q5_K>;
    constexpr int64_t size = x8k_size(five);
    const int64_t K = w.ne[0], nb = K / 256;
    for (int64_t g = g0; g < g1; ++g) {
        for (int64_t s = 0; s < nb; ++s) {
            uint8_t* rec = out + (g * nb + s) * size;
            if constexpr (five) memset(rec + x8k_sub(five, 0), 0, 8 * x8k_sub_bytes(five));  // bits OR-ed below
            for (int r = 0; r < 8; ++r) {
                const Block* x = (const Block*)(w.data + (8 * g + r) * w.nb[1]) + s;
                uint8_t sm[16];
                unpack_k_scales(x->scales, sm);
                for (int j = 0; j < 8; ++j) {
                    // sub-block j: elements 32j..32j+31 = low nibbles (j even) or high nibbles (j odd) of qs[32(j/2)..]
                    const uint8_t* q = x->qs + 32 * (j / 2);
                    uint8_t v[32];
                    for (int l = 0; l < 32; ++l) v[l] = (j & 1) ? (q[l] >> 4) : (q[l] & 0x0f);
                    for (int c = 0; c < 4; ++c)
                        for (int i = 0; i < 4; ++i) {
                            rec[x8k_sub(five, j) + 32 * c + 4 * r + i] =
                                (uint8_t)(v[8 * c + i] | (v[8 * c + 4 + i] << 4));
                            if constexpr (five)  // Q5_K: element l's fifth bit is bit j of qh[l]
                                rec[x8k_sub(five, j) + 128 + 4 * r + i] |=
                                    (uint8_t)((((x->qh[8 * c + i] >> j) & 1) << (2 * c)) |
                                              (((x->qh[8 * c + 4 + i] >> j) & 1) << (2 * c + 1)));
                        }
                    rec[X8K_SC + 8 * j + r] = sm[j];
                    rec[X8K_MIN + 8 * j + r] = sm[8 + j];
                }
                memcpy(rec + X8K_D + 2 * r, &x->d, 2);
                memcpy(rec + X8K_DMIN + 2 * r, &x->dmin, 2);
            }
        }
    }
}

static void repack_q6_K(const Tensor& w, uint8_t* out, int64_t g0, int64_t g1) {
    const int64_t K = w.ne[0], nb = K / 256;
    for (int64_t g = g0; g < g1; ++g) {
        for (int64_t s = 0; s < nb; ++s) {
            uint8_t* rec = out + (g * nb + s) * X8Q6_SIZE;
            memset(rec + X8Q6_Q, 0, X8Q6_SIZE - X8Q6_Q);  // the quant bytes are OR-ed together below
            for (int r = 0; r < 8; ++r) {
                const blk_q6_K* x = (const blk_q6_K*)(w.data + (8 * g + r) * w.nb[1]) + s;
                uint8_t q[256];  // the 6-bit values (0..63) of the super-block in column order
                for (int h = 0; h < 2; ++h) {
                    const uint8_t* ql = x->ql + 64 * h;
                    for (int l = 0; l < 32; ++l) {
                        const int hb = x->qh[32 * h + l];
                        uint8_t* o = q + 128 * h + l;
                        o[0] = (uint8_t)((ql[l] & 0x0f) | ((hb & 3) << 4));
                        o[32] = (uint8_t)((ql[l + 32] & 0x0f) | (((hb >> 2) & 3) << 4));
                        o[64] = (uint8_t)((ql[l] >> 4) | (((hb >> 4) & 3) << 4));
                        o[96] = (uint8_t)((ql[l + 32] >> 4) | (((hb >> 6) & 3) << 4));
                    }
                }
                for (int j = 0; j < 16; ++j) {
                    uint8_t* u = rec + x8q6_sub(j);
                    for (int t = 0; t < 4; ++t)
                        for (int i = 0; i < 4; ++i) {
                            const int v = q[16 * j + 4 * t + i];
                            u[32 * (t / 2) + 4 * r + i] |= (uint8_t)((v & 0x0f) << (4 * (t & 1)));
                            u[64 + 4 * r + i] |= (uint8_t)((v >> 4) << (2 * t));
                        }
                    rec[x8q6_sc(j, r)] = (uint8_t)x->scales[j];
                }
                memcpy(rec + X8Q6_D + 2 * r, &x->d, 2);
            }
        }
    }
}

// F32 / F16 / BF16: groups of 16 rows as the GEMM's B panels over all of K (element (r, k) at 16k + r), in the
// weight's own type
static void repack_panels(const Tensor& w, uint8_t* out, int64_t g0, int64_t g1) {
    const int64_t K = w.ne[0];
    const int es = type_size(w.type);
    enum { KB = 64 };  // columns per pass: 16 rows x 64 columns read, one 4 KiB (F32) block written
    for (int64_t g = g0; g < g1; ++g) {
        uint8_t* o = out + g * 16 * K * es;
        for (int64_t k0 = 0; k0 < K; k0 += KB) {
            const int64_t k1 = k0 + KB < K ? k0 + KB : K;
            for (int r = 0; r < 16; ++r) {
                const uint8_t* src = w.data + (16 * g + r) * w.nb[1];
                if (es == 4) {
                    for (int64_t k = k0; k < k1; ++k) memcpy(o + (16 * k + r) * 4, src + 4 * k, 4);
                } else {
                    for (int64_t k = k0; k < k1; ++k) memcpy(o + (16 * k + r) * 2, src + 2 * k, 2);
                }
            }
        }
    }
}

// ---------------------------------------------------------------------------------------------------------------
// one row back from the repacked layouts (the inverses of the above): GET_ROWS of a tied embedding reads the copy
// its output product made instead of the original, whose pages were handed back (re-reading them would fault from
// the file: 0.3-0.9 ms for every new token of a 1-2B model)

template <typename Block>
static void unrepack_q45_01(const uint8_t* grp, int64_t nb, int r, Block* out) {
    constexpr bool five = std::is_same_v<Block, blk_q5_0> || std::is_same_v<Block, blk_q5_1>;
    constexpr bool has_m = std::is_same_v<Block, blk_q4_1> || std::is_same_v<Block, blk_q5_1>;
    constexpr int64_t size = 8 * (int64_t)sizeof(Block), doff = five ? 160 : 128;
    for (int64_t b = 0; b < nb; ++b) {
        const uint8_t* rec = grp + b * size;
        Block* x = out + b;
        uint8_t q[32];
        uint32_t qh = 0;
        for (int c = 0; c < 4; ++c)
            for (int i = 0; i < 4; ++i) {
                const uint8_t v = rec[32 * c + 4 * r + i];
                q[8 * c + i] = v & 0x0f;
                q[8 * c + 4 + i] = v >> 4;
                if constexpr (five) {
                    const uint8_t hb = rec[128 + 4 * r + i];
                    qh |= (uint32_t)((hb >> (2 * c)) & 1) << (8 * c + i) | (uint32_t)((hb >> (2 * c + 1)) & 1)
                                                                               << (8 * c + 4 + i);
                }
            }
        for (int j = 0; j < 16; ++j) x->qs[j] = (uint8_t)(q[j] | q[j + 16] << 4);
        if constexpr (five) memcpy(x->qh, &qh, 4);
        memcpy(&x->d, rec + doff + 2 * r, 2);
        if constexpr (has_m) memcpy(&x->m, rec + doff + 16 + 2 * r, 2);
    }
}

static void unrepack_q8_0(const uint8_t* grp, int64_t nb, int r, blk_q8_0* out) {
    for (int64_t b = 0; b < nb; ++b) {
        const uint8_t* rec = grp + b * 272;
        for (int k = 0; k < 8; ++k) memcpy(out[b].qs + 4 * k, rec + 32 * k + 4 * r, 4);
        memcpy(&out[b].d, rec + 256 + 2 * r, 2);
    }
}

template <typename Block>
static void unrepack_q45_K(const uint8_t* grp, int64_t nb, int r, Block* out) {
    constexpr bool five = std::is_same_v<Block, blk_q5_K>;
    constexpr int64_t size = x8k_size(five);
    for (int64_t s = 0; s < nb; ++s) {
        const uint8_t* rec = grp + s * size;
        Block* x = out + s;
        uint8_t sm[16];
        if constexpr (five) memset(x->qh, 0, 32);
        for (int j = 0; j < 8; ++j) {
            uint8_t v[32];
            for (int c = 0; c < 4; ++c)
                for (int i = 0; i < 4; ++i) {
                    const uint8_t b = rec[x8k_sub(five, j) + 32 * c + 4 * r + i];
                    v[8 * c + i] = b & 0x0f;
                    v[8 * c + 4 + i] = b >> 4;
                    if constexpr (five) {
                        const uint8_t hb = rec[x8k_sub(five, j) + 128 + 4 * r + i];
                        x->qh[8 * c + i] |= (uint8_t)(((hb >> (2 * c)) & 1) << j);
                        x->qh[8 * c + 4 + i] |= (uint8_t)(((hb >> (2 * c + 1)) & 1) << j);
                    }
                }
            uint8_t* q = x->qs + 32 * (j / 2);
            for (int l = 0; l < 32; ++l) q[l] = (j & 1) ? (uint8_t)(q[l] | v[l] << 4) : v[l];
            sm[j] = rec[X8K_SC + 8 * j + r];
            sm[8 + j] = rec[X8K_MIN + 8 * j + r];
        }
        pack_k_scales(sm, x->scales);
        memcpy(&x->d, rec + X8K_D + 2 * r, 2);
        memcpy(&x->dmin, rec + X8K_DMIN + 2 * r, 2);
    }
}

static void unrepack_q6_K(const uint8_t* grp, int64_t nb, int r, blk_q6_K* out) {
    for (int64_t s = 0; s < nb; ++s) {
        const uint8_t* rec = grp + s * X8Q6_SIZE;
        blk_q6_K* x = out + s;
        uint8_t q[256];  // the 6-bit values in column order
        for (int j = 0; j < 16; ++j) {
            const uint8_t* u = rec + x8q6_sub(j);
            for (int t = 0; t < 4; ++t)
                for (int i = 0; i < 4; ++i)
                    q[16 * j + 4 * t + i] = (uint8_t)(((u[32 * (t / 2) + 4 * r + i] >> (4 * (t & 1))) & 0x0f) |
                                                      ((u[64 + 4 * r + i] >> (2 * t)) & 3) << 4);
            x->scales[j] = (int8_t)rec[x8q6_sc(j, r)];
        }
        for (int h = 0; h < 2; ++h)
            for (int l = 0; l < 32; ++l) {
                const uint8_t* o = q + 128 * h + l;
                x->ql[64 * h + l] = (uint8_t)((o[0] & 0x0f) | (o[64] & 0x0f) << 4);
                x->ql[64 * h + l + 32] = (uint8_t)((o[32] & 0x0f) | (o[96] & 0x0f) << 4);
                x->qh[32 * h + l] = (uint8_t)(o[0] >> 4 | (o[32] >> 4) << 2 | (o[64] >> 4) << 4 | (o[96] >> 4) << 6);
            }
        memcpy(&x->d, rec + X8Q6_D + 2 * r, 2);
    }
}

void unrepack_row(const Tensor& w, const uint8_t* repacked, int64_t row, uint8_t* out) {
    const int gr = repack_group_rows(w.type);
    const int64_t K = w.ne[0], g = row / gr;
    const int r = (int)(row % gr);
    const uint8_t* grp = repacked + g * gr * repack_row_bytes(w.type, K);
    switch (w.type) {
        case T_Q4_0: unrepack_q45_01(grp, K / 32, r, (blk_q4_0*)out); break;
        case T_Q4_1: unrepack_q45_01(grp, K / 32, r, (blk_q4_1*)out); break;
        case T_Q5_0: unrepack_q45_01(grp, K / 32, r, (blk_q5_0*)out); break;
        case T_Q5_1: unrepack_q45_01(grp, K / 32, r, (blk_q5_1*)out); break;
        case T_Q8_0: unrepack_q8_0(grp, K / 32, r, (blk_q8_0*)out); break;
        case T_Q4_K: unrepack_q45_K(grp, K / 256, r, (blk_q4_K*)out); break;
        case T_Q5_K: unrepack_q45_K(grp, K / 256, r, (blk_q5_K*)out); break;
        case T_Q6_K: unrepack_q6_K(grp, K / 256, r, (blk_q6_K*)out); break;
        default: {  // p16 panels: element (r, k) at 16k + r
            const int es = type_size(w.type);
            for (int64_t k = 0; k < K; ++k) memcpy(out + k * es, grp + (16 * k + r) * es, (size_t)es);
        }
    }
}

// The original of a weight whose every reader now uses the repacked copy: give its whole pages back to the OS
// (MADV_PAGEOUT: clean pages of a mapped file are dropped and re-read from the file if ever touched again, e.g. by
// GET_ROWS of a tied embedding or another backend; anonymous pages go to swap, or stay). Nothing is lost either way;
// without this, peak RSS holds both copies. Linux only; elsewhere, and on older kernels, a no-op.
static void release_pages(const uint8_t* p, size_t n) {
#if defined(__linux__) && defined(MADV_PAGEOUT)
    static const bool enabled = [] {
        const char* e = getenv("GGML_PY_SIMD_KEEP_ORIGINALS");
        return !(e && *e && *e != '0');
    }();
    const uintptr_t page = (uintptr_t)sysconf(_SC_PAGESIZE);
    const uintptr_t a = ((uintptr_t)p + page - 1) & ~(page - 1), b = ((uintptr_t)p + n) & ~(page - 1);
    if (enabled && b > a) madvise((void*)a, b - a, MADV_PAGEOUT);
#else
    (void)p;
    (void)n;
#endif
}

// every weight's repacked copy, by what identifies the weight's view; the plans own them
using RepackKey = std::tuple<int64_t, uintptr_t, int, int64_t, int64_t, int64_t>;
static std::mutex repack_mu;
static auto* repack_cache = new std::map<RepackKey, std::weak_ptr<RepackBuf>>();

static bool repack_key(int64_t const_id, const Tensor& w, RepackKey* key) {
    const int gr = repack_group_rows(w.type);
    if (gr == 0 || w.ne[1] < gr || w.ne[2] != 1 || w.ne[3] != 1 || w.nb[0] != type_size(w.type)) return false;
    *key = RepackKey{const_id, (uintptr_t)w.data, w.type, w.ne[0], w.ne[1], w.nb[1]};
    return true;
}

std::shared_ptr<RepackBuf> find_repacked(int64_t const_id, const Tensor& w) {
    RepackKey key;
    if (!repack_key(const_id, w, &key)) return nullptr;
    std::lock_guard<std::mutex> lk(repack_mu);
    auto it = repack_cache->find(key);
    return it == repack_cache->end() ? nullptr : it->second.lock();
}

std::shared_ptr<RepackBuf> get_repacked(int64_t const_id, const Tensor& w, int n_threads) {
    RepackKey key;
    if (!repack_key(const_id, w, &key)) return nullptr;
    const int gr = repack_group_rows(w.type);
    std::lock_guard<std::mutex> lk(repack_mu);
    for (auto it = repack_cache->begin(); it != repack_cache->end();) {  // drop dead entries
        if (it->second.expired()) it = repack_cache->erase(it);
        else ++it;
    }
    auto it = repack_cache->find(key);
    if (it != repack_cache->end()) {
        if (auto sp = it->second.lock()) return sp;
    }
    auto buf = std::make_shared<RepackBuf>();
    buf->size = (size_t)(w.ne[1] / gr) * gr * (size_t)repack_row_bytes(w.type, w.ne[0]);
    buf->data = arena_alloc(buf->size, &buf->arena);
    // by slices of 1024 rows, each slice's original released as soon as it is repacked: at no time are both copies
    // of a whole large weight (a 49k-token embedding) resident. The slices are independent (disjoint input and
    // output): the plan's threads take them in turn, so a model's first plan (its time to first token) waits on the
    // repacking of its weights n_threads times less.
    const int64_t groups = w.ne[1] / gr, slice = 1024 / gr, nslices = (groups + slice - 1) / slice;
    std::atomic<int64_t> next{0};
    auto work = [&] {
        for (int64_t k; (k = next.fetch_add(1)) < nslices;) {
            const int64_t g0 = k * slice, g1 = g0 + slice < groups ? g0 + slice : groups;
            if (w.type == T_Q4_0) repack_q45_01<blk_q4_0>(w, buf->data, g0, g1);
            else if (w.type == T_Q4_1) repack_q45_01<blk_q4_1>(w, buf->data, g0, g1);
            else if (w.type == T_Q5_0) repack_q45_01<blk_q5_0>(w, buf->data, g0, g1);
            else if (w.type == T_Q5_1) repack_q45_01<blk_q5_1>(w, buf->data, g0, g1);
            else if (w.type == T_Q8_0) repack_q8_0(w, buf->data, g0, g1);
            else if (w.type == T_Q4_K) repack_q45_K<blk_q4_K>(w, buf->data, g0, g1);
            else if (w.type == T_Q5_K) repack_q45_K<blk_q5_K>(w, buf->data, g0, g1);
            else if (w.type == T_Q6_K) repack_q6_K(w, buf->data, g0, g1);
            else repack_panels(w, buf->data, g0, g1);
            release_pages(w.data + g0 * gr * w.nb[1], (size_t)(g1 - g0) * gr * (size_t)w.nb[1]);
        }
    };
    const int64_t nth = n_threads < nslices ? n_threads : nslices;
    std::vector<std::thread> helpers;
    for (int64_t t = 1; t < nth; ++t) helpers.emplace_back(work);
    work();
    for (auto& t : helpers) t.join();
    (*repack_cache)[key] = buf;
    return buf;
}

}  // namespace gp
