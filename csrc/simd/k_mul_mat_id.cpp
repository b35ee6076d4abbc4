// MUL_MAT_ID, the expert-routed product of mixture-of-experts layers (ggml order):
//   dst[M, k, T] row (i, t) = as[K, M, ids[i, t]]^T . b[K, i % S, t]
// Three phases, so that each expert's weights stream from memory once per compute however many tokens chose it:
//   0. one unit groups the (token, slot) pairs by expert (a counting sort in token order: the same grouping for the
//      same ids, whatever the threads) and checks every id;
//   1. each grouped pair's activation row is written to the shared scratch in group order: quantized as MUL_MAT's
//      integer path quantizes it (A32 / A256) for quantized weights, copied as F32 for float ones;
//   2. units (an expert that has rows, a chunk of its weight rows), handed out by the node's counter: a chunk is
//      read once, in cache for all the expert's rows (the integer dot products of MUL_MAT's GEMV, from the x8
//      records when the plan repacked the experts, or the float GEMM), and its results are scattered to the pairs'
//      dst rows.
// A row's result does not depend on which other tokens share the step: both paths compute each element the same way
// whatever the row count (k_matmul.cpp), and the activation rows are quantized one by one.
#include "isa.h"

namespace gp {
namespace GP_NS {

static bool id_float(const Node& n) { return !type_is_quant(n.src[0].type); }

// phase 0: offsets[e] .. offsets[e + 1] are expert e's grouped rows; pairs[j] the dst row (t * k + i) of row j
static void group_by_expert(const Node& n, const ExecCtx& ctx) {
    const Tensor& ids = n.src[2];
    const int64_t E = n.src[0].ne[2], k = ids.ne[0], T = ids.ne[1];
    const IdScratch sc = id_scratch(n);
    int64_t* off = (int64_t*)ctx.wdata;
    int64_t* cur = (int64_t*)(ctx.wdata + sc.cursors);
    int32_t* pairs = (int32_t*)(ctx.wdata + sc.pairs);
    for (int64_t e = 0; e <= E; ++e) off[e] = 0;
    for (int64_t t = 0; t < T; ++t)
        for (int64_t i = 0; i < k; ++i) {
            const int32_t e = *(const int32_t*)(ids.data + t * ids.nb[1] + i * ids.nb[0]);
            if (e < 0 || e >= E) {
                char msg[128];
                snprintf(msg, sizeof msg, "MUL_MAT_ID: expert id %d out of range 0..%lld", (int)e, (long long)(E - 1));
                set_error(ctx, msg);
                return;
            }
            ++off[e + 1];
        }
    for (int64_t e = 0; e < E; ++e) {
        off[e + 1] += off[e];
        cur[e] = off[e];
    }
    for (int64_t t = 0; t < T; ++t)
        for (int64_t i = 0; i < k; ++i) {
            const int32_t e = *(const int32_t*)(ids.data + t * ids.nb[1] + i * ids.nb[0]);
            pairs[cur[e]++] = (int32_t)(t * k + i);
        }
}

// phase 1: the activation rows of grouped rows [j0, j1)
static void gather_rows(const Node& n, int64_t j0, int64_t j1, const ExecCtx& ctx, float* tmp) {
    const Tensor& b = n.src[1];
    const int64_t K = b.ne[0], S = b.ne[1], k = n.src[2].ne[0];
    const IdScratch sc = id_scratch(n);
    const int32_t* pairs = (const int32_t*)(ctx.wdata + sc.pairs);
    const int t = n.src[0].type;
    for (int64_t j = j0; j < j1; ++j) {
        const int64_t r = pairs[j], tok = r / k, slot = r % k;
        const uint8_t* xp = b.data + tok * b.nb[2] + (slot % S) * b.nb[1];
        const float* xf = (const float*)xp;
        if (b.nb[0] != 4) {
            for (int64_t c = 0; c < K; ++c) tmp[c] = *(const float*)(xp + c * b.nb[0]);
            xf = tmp;
        }
        uint8_t* row = ctx.wdata + sc.acts + (size_t)j * sc.act_row;
        if (!type_is_quant(t)) memcpy(row, xf, (size_t)K * 4);
        else if (weight_uses_a256(t)) quantize_a256(xf, row, K);
        else quantize_a32(xf, row, K);
    }
}

// weight rows per unit of phase 2: about GEMV_UNITS_PER_THREAD (4) units per thread over the used experts' rows
static int64_t chunk_rows(const Node& n, int64_t n_used, int nth) {
    const Tensor& w = n.src[0];
    const int64_t M = w.ne[1];
    const int64_t per = (int64_t)nth * 4;
    int64_t c = (n_used * M + per - 1) / per;
    if (type_is_quant(w.type)) c = imin(c, imax(16, (int64_t)(256 * 1024) / imax(1, w.nb[1])));  // stays in L2
    c = (c + 15) & ~(int64_t)15;
    return imin(imin(imax(c, 16), (int64_t)ID_CHUNK_MAX), M);
}

// phase 2, one unit: weight rows [m0, m1) of expert e against its grouped rows
static void expert_unit(const Node& n, int64_t e, int64_t m0, int64_t m1, int64_t chunk, const ExecCtx& ctx,
                        uint8_t* scratch) {
    const Tensor& w = n.src[0];
    const Tensor& d = n.dst;
    const int64_t K = w.ne[0], k = n.src[2].ne[0], nr = m1 - m0;
    const IdScratch sc = id_scratch(n);
    const int64_t* off = (const int64_t*)ctx.wdata;
    const int32_t* pairs = (const int32_t*)(ctx.wdata + sc.pairs);
    const uint8_t* wbase = w.data + e * w.nb[2] + m0 * w.nb[1];
    const bool flt = id_float(n);
    const int64_t block = flt ? ID_GEMM_ROWS : ID_GEMV_ROWS;
    // the results of a block of rows, chunk floats apart, then scattered to their dst rows
    float* out = (float*)(flt ? scratch + id_gemm_scratch(K) : scratch);
    for (int64_t j0 = off[e]; j0 < off[e + 1]; j0 += block) {
        const int64_t na = imin(block, off[e + 1] - j0);
        const uint8_t* acts = ctx.wdata + sc.acts + (size_t)j0 * sc.act_row;
        if (flt) {
            Tensor wt = w, xt, dt;
            wt.ne[1] = nr;
            wt.ne[2] = wt.ne[3] = 1;
            wt.data = (uint8_t*)wbase;
            xt.type = dt.type = T_F32;
            xt.ne[0] = K;
            xt.ne[1] = na;
            xt.nb[0] = 4;
            xt.nb[1] = (int64_t)sc.act_row;
            xt.nb[2] = xt.nb[3] = xt.nb[1] * na;
            xt.data = (uint8_t*)acts;
            dt.ne[0] = nr;
            dt.ne[1] = na;
            dt.nb[0] = 4;
            dt.nb[1] = chunk * 4;
            dt.nb[2] = dt.nb[3] = dt.nb[1] * na;
            dt.data = (uint8_t*)out;
            gemm_rows(wt, xt, dt, 0, nr, (float*)scratch);
        } else {
#if GP_AVX2
            if (n.repack)  // the plan repacked every expert's rows (groups of 8, M a multiple of 8): all of them x8
                gemv_x8(w.type, n.repack + (e * w.ne[1] + m0) * repack_row_bytes(w.type, K), nr / 8, acts,
                        sc.act_row, (int)na, K, out, (size_t)chunk * 4);
            else
#endif
                gemv_rows(w.type, wbase, w.nb[1], nr, acts, sc.act_row, (int)na, K, out, (size_t)chunk * 4);
        }
        for (int64_t a = 0; a < na; ++a) {
            const int64_t r = pairs[j0 + a];
            memcpy(d.data + (r / k) * d.nb[2] + (r % k) * d.nb[1] + m0 * 4, out + a * chunk, (size_t)nr * 4);
        }
    }
}

void k_mul_mat_id(Node& n, int phase, int ith, int nth, const ExecCtx& ctx) {
    if (phase == 0) {
        if (ith == 0) group_by_expert(n, ctx);
        return;
    }
    const int64_t E = n.src[0].ne[2], R = n.src[2].ne[0] * n.src[2].ne[1];
    if (phase == 1) {
        int64_t j0, j1;
        if (!my_rows(R, n.src[1].ne[0], ith, nth, &j0, &j1, 8192)) return;
        gather_rows(n, j0, j1, ctx, (float*)ctx.thread_scratch(ith));
        return;
    }
    const int64_t* off = (const int64_t*)ctx.wdata;
    int64_t n_used = 0;
    for (int64_t e = 0; e < E; ++e) n_used += off[e + 1] > off[e];
    const int64_t M = n.src[0].ne[1], chunk = chunk_rows(n, n_used, nth), per_expert = (M + chunk - 1) / chunk;
    uint8_t* scratch = ctx.thread_scratch(ith);
    for (;;) {
        int64_t u = n.counter->fetch_add(1, std::memory_order_relaxed);
        if (u >= n_used * per_expert) break;
        int64_t e = 0;  // the (u / per_expert)-th expert that has rows
        for (int64_t skip = u / per_expert;; ++e)
            if (off[e + 1] > off[e] && skip-- == 0) break;
        const int64_t m0 = (u % per_expert) * chunk;
        expert_unit(n, e, m0, imin(M, m0 + chunk), chunk, ctx, scratch);
    }
}

}  // namespace GP_NS
}  // namespace gp
