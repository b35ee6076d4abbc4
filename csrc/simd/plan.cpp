// The plan: node descriptions bound to memory and symbols, scratch sizing, the cost estimates and phases that
// schedule its tasks, grouped GEMV products, and the executor that runs them on the thread pool.
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <sstream>

#include "runtime.h"

namespace gp {

// ---------------------------------------------------------------------------------------------------------------
// memory

// A buffer of 2 MiB or more starts on a 2 MiB boundary and asks for transparent huge pages: decode's GEMV streaming
// repacked weights from DRAM ran 22-59% faster on them (a 1 GB weight at 2 threads, Q4_0 17 -> 27 GB/s; a plain read
// loop is the same on either, so the page walks are the GEMV's, not the memory's). The mapping is trimmed to the
// buffer's own pages: the part past its last whole 2 MiB stays in small pages, so RSS does not grow.
static uint8_t* map_bytes(size_t size) {
    constexpr size_t huge = 2u << 20;
    const size_t page = (size_t)sysconf(_SC_PAGESIZE), len = (size + page - 1) & ~(page - 1);
    const size_t extra = len >= huge ? huge : 0;
    uint8_t* raw = (uint8_t*)mmap(nullptr, len + extra, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (raw == MAP_FAILED) throw std::bad_alloc();
    if (!extra) return raw;
    uint8_t* p = (uint8_t*)(((uintptr_t)raw + huge - 1) & ~(uintptr_t)(huge - 1));
    if (p > raw) munmap(raw, (size_t)(p - raw));
    if (raw + len + extra > p + len) munmap(p + len, (size_t)(raw + len + extra - (p + len)));
#ifdef MADV_HUGEPAGE
    madvise(p, len, MADV_HUGEPAGE);  // a hint: where THP is off, small pages
#endif
    return p;
}

uint8_t* aligned_alloc_bytes(size_t size, bool* mmapped) {
    if (size == 0) size = 64;
    if (size >= (1u << 20)) {
        *mmapped = true;
        return map_bytes(size);  // zeroed, page aligned
    }
    void* p = nullptr;
    if (posix_memalign(&p, 64, (size + 63) & ~(size_t)63) != 0) throw std::bad_alloc();
    memset(p, 0, size);
    *mmapped = false;
    return (uint8_t*)p;
}

void aligned_free_bytes(uint8_t* p, size_t size, bool mmapped) {
    if (!p) return;
    if (size == 0) size = 64;
    if (mmapped) munmap(p, size);
    else free(p);
}

void Plan::Free::operator()(uint8_t* p) const { free(p); }

static uint8_t* scratch_alloc(size_t size) {
    void* p = nullptr;
    if (posix_memalign(&p, 64, size < 64 ? 64 : size) != 0) throw std::bad_alloc();
    return (uint8_t*)p;
}

// A decode step's attention splits the keys across threads (k_flash_attn_ext) for up to this many query rows: when
// rows x KV heads < 8 (too few units for the threads otherwise), and for 1-2 rows whatever the heads (each chunk of
// keys then reads the cache rows of all heads in address order: fa_chunk_heads)
static int64_t fa_split_max_rows(const Node& n) { return std::max<int64_t>(7 / n.src[1].ne[2], 2); }
static bool fa_splits_keys(const Node& n) {
    return n.op == GGML_PY_OP_FLASH_ATTN_EXT && n.src[0].ne[1] * n.src[0].ne[3] <= fa_split_max_rows(n);
}

static int64_t env_rows(const char* name, long long dflt) {
    const char* e = getenv(name);
    const long long r = e ? atoll(e) : dflt;
    return (int64_t)(r < 1 ? 1 : r);
}

int64_t gemm_min_rows(int type) {
    if (!type_is_quant(type)) return 1;  // floats: one path, the GEMM
    static const int64_t x8 = env_rows("GGML_PY_SIMD_GEMM_ROWS_X8", INT64_C(1) << 40),
                         other = env_rows("GGML_PY_SIMD_GEMM_ROWS", INT64_C(1) << 40);
    return repack_supported(type) ? x8 : other;
}

static size_t pad64(size_t x) { return (x + 63) & ~(size_t)63; }

Scratch node_scratch(const Node& n) {
    Scratch s;
    const Tensor& a = n.src[0];
    switch (n.op) {
        case GGML_PY_OP_MUL_MAT: {
            const Tensor& w = n.src[0];
            const Tensor& x = n.src[1];
            const int64_t K = w.ne[0];
            // the GEMV's quantized activation rows; a symbolic row count sized at its bound may still take the GEMV
            // path at run time (fewer than gemm_min_rows rows), so up to that many - 1 rows are always planned
            const int64_t lim = gemm_min_rows(w.type);
            if (type_is_quant(w.type)) {
                const int64_t qrows = (x.ne[1] < lim ? x.ne[1] : lim - 1) * x.ne[2] * x.ne[3];
                s.shared = (size_t)qrows * (weight_uses_a256(w.type) ? a256_row_size(K) : a32_row_size(K));
            }
            s.per_thread = pad64((size_t)K * 4 + 64);
            if (x.ne[1] >= lim) {  // the GEMM; up to GEMM_MR rows its small form (a symbolic count may bind to 1)
                const size_t small = gemm_small_thread_scratch(K);
                const size_t g = x.ne[1] > GEMM_MR ? std::max(gemm_thread_scratch(), small) : small;
                s.per_thread = pad64(std::max(s.per_thread, g));
            }
            break;
        }
        case GGML_PY_OP_MUL_MAT_ID: {  // the routing and grouped rows; a strided row's copy, a block's results
            const int64_t K = a.ne[0];
            s.shared = id_scratch(n).total;
            s.per_thread = type_is_quant(a.type)
                               ? pad64(std::max((size_t)K * 4 + 64, (size_t)ID_GEMV_ROWS * ID_CHUNK_MAX * 4))
                               : id_gemm_scratch(K) + pad64((size_t)ID_GEMM_ROWS * ID_CHUNK_MAX * 4);
            break;
        }
        case GGML_PY_OP_FLASH_ATTN_EXT: {
            const int64_t D = a.ne[0], Dv = n.src[2].ne[0], H = a.ne[2];
            const bool copies = a.ne[1] >= FA_COPY_MIN_ROWS;
            s.per_thread = pad64((size_t)(FA_TILE_FLOATS(D, Dv, H) +
                                          (copies ? FA_COPY_FLOATS(n.src[1].ne[1], D, Dv) : 0)) * 4);
            if (copies)
                s.per_thread = std::max(s.per_thread, pad64((size_t)FA_ROWS_FLOATS(D, Dv, H, n.src[1].ne[1]) * 4));
            if (fa_splits_keys(n)) {
                // every (query row, head, chunk)'s partial result, and in each thread its mask rows' chunk tables,
                // for as many rows as a split may have whatever the (symbolic) row count
                const int64_t nch = ((n.src[1].ne[1] + 7) / 8 + FA_CHUNK_TILES - 1) / FA_CHUNK_TILES;
                const int64_t rows = fa_split_max_rows(n), mrows = rows * (n.has[3] ? n.src[3].ne[2] : 1);
                s.shared = (size_t)(rows * H * nch * FA_PART(Dv)) * 4;
                const size_t split = (size_t)(FA_SPLIT_FLOATS(D, Dv, H) + mrows * (nch + 1)) * 4;
                if (pad64(split) > s.per_thread) s.per_thread = pad64(split);
            }
            break;
        }
        case GGML_PY_OP_TOP_K:  // a strided row's copy, then the candidates' buffer (>= 4k entries of 8 bytes)
            s.per_thread = pad64((size_t)((a.ne[0] + 15) & ~(int64_t)15) * 4 + (size_t)(n.dst.ne[0] + 64) * 4 * 8);
            break;
        case GGML_PY_OP_ROPE: s.per_thread = pad64((size_t)(2 * n.params.i[GGML_PY_P_ROPE_N_DIMS] + 16) * 4); break;
        case GGML_PY_OP_NORM: case GGML_PY_OP_RMS_NORM: case GGML_PY_OP_SUM_ROWS: case GGML_PY_OP_MEAN: case GGML_PY_OP_ARGMAX: case GGML_PY_OP_SOFT_MAX:
            s.per_thread = pad64((size_t)(a.ne[0] + 16) * 4);
            break;
        case GGML_PY_OP_CPY: case GGML_PY_OP_CONT: case GGML_PY_OP_GET_ROWS: case GGML_PY_OP_SET_ROWS: {
            const int64_t ne0 = n.op == GGML_PY_OP_SET_ROWS ? a.ne[0] : n.dst.ne[0];
            s.per_thread = pad64((size_t)((ne0 + 15) & ~15) * 4 + (size_t)ne0 * 8 + 64);
            break;
        }
        default: break;
    }
    return s;
}

bool node_is_small(const Node& n) {
    static const int64_t scale = [] {
        const char* e = getenv("GGML_PY_SIMD_SMALL");
        return e ? (int64_t)atoll(e) : (int64_t)1;
    }();
    const Tensor& d = n.dst;
    const Tensor& a = n.src[0];
    int64_t work, threshold;
    switch (n.op) {
        case GGML_PY_OP_MUL_MAT:
            work = 0;
            for (const Node* g = &n; g; g = g->group_next)  // with the products grouped with it
                work += g->src[0].ne[0] * g->src[0].ne[1] * g->src[1].ne[1] * g->src[1].ne[2] * g->src[1].ne[3];
            threshold = 96 * 1024;
            break;
        case GGML_PY_OP_MUL_MAT_ID:  // K x M per routed row
            work = a.ne[0] * a.ne[1] * n.src[2].ne[0] * n.src[2].ne[1];
            threshold = 96 * 1024;
            break;
        case GGML_PY_OP_FLASH_ATTN_EXT:
            work = a.ne[1] * a.ne[2] * a.ne[3] * n.src[1].ne[1] * (a.ne[0] + n.src[2].ne[0]);
            threshold = 64 * 1024;
            break;
        GGML_PY_OPS_TRANSCENDENTAL(GP_OP_CASE)  // the schema's: exp, tanh, sin, ... per element
            work = nelements(d) * 4;
            threshold = 64 * 1024;
            break;
        case GGML_PY_OP_SET_ROWS:
            work = nelements(a) * (type_is_quant(d.type) ? 8 : 1);
            threshold = 64 * 1024;
            break;
        case GGML_PY_OP_CPY: case GGML_PY_OP_CONT: case GGML_PY_OP_GET_ROWS:
            work = nelements(d) * (type_is_quant(d.type) || type_is_quant(a.type) ? 8 : 1);
            threshold = 64 * 1024;
            break;
        default:
            work = nelements(d) > nelements(a) ? nelements(d) : nelements(a);
            threshold = 64 * 1024;
            break;
    }
    return work < threshold * scale;
}

int node_phases(const Node& n, bool n_rows_symbolic) {
    if (n.op == GGML_PY_OP_MUL_MAT && type_is_quant(n.src[0].type)) {
        if (n_rows_symbolic || n.src[1].ne[1] < gemm_min_rows(n.src[0].type)) return 2;
    }
    if (n.op == GGML_PY_OP_MUL_MAT_ID) return 3;  // group by expert, gather the rows, the experts' products
    if (fa_splits_keys(n)) return 2;  // chunks of keys, then their merge
    return 1;
}

// ---------------------------------------------------------------------------------------------------------------
// plan

static bool node_symbolic_src0(const NodeDesc& d) {
    const TensorDesc& t = d.src[0];
    for (int i = 0; i < 4; ++i)
        if (t.ne[i].symbolic() || t.nb[i].symbolic()) return true;
    return t.offset.symbolic();
}

Plan::Plan(const std::vector<NodeDesc>& descs, const std::vector<Range>& ranges, const std::vector<int64_t>& sym_max,
           int n_threads, int level, bool validate_only)
    : ranges_(ranges), sym_max_(sym_max), level_(level) {
    kt_ = level_table(level);
    n_threads_ = n_threads > 0 ? n_threads : physical_cores();
    if (n_threads_ > 256) n_threads_ = 256;
    for (int64_t m : sym_max_)
        if (m < 0) throw PlanError("symbol bounds must be >= 0");
    const int nsym = (int)sym_max_.size();
    nodes_.resize(descs.size());
    counters_.reset(new std::atomic<int64_t>[descs.size() > 0 ? descs.size() : 1]);
    std::vector<bool> node_symbolic(descs.size(), false);
    for (size_t i = 0; i < descs.size(); ++i) {
        const NodeDesc& nd = descs[i];
        Node& n = nodes_[i];
        n.op = nd.op;
        n.index = (int)i;
        n.counter = &counters_[i];
        if (nd.op <= 0 || nd.op >= GGML_PY_OP_COUNT) throw PlanError("node " + std::to_string(i) + ": unknown op code " + std::to_string(nd.op));
        n.params = nd.params;
        if (!nd.dst.present) throw PlanError("node " + std::to_string(i) + ": missing dst");
        for (int s = -1; s < MAX_SRC; ++s) {
            const TensorDesc& td = s < 0 ? nd.dst : nd.src[s];
            if (s >= 0) n.has[s] = td.present;
            if (!td.present) continue;
            Tensor& t = s < 0 ? n.dst : n.src[s];
            t.type = td.type;
            auto add = [&](int64_t* target, const Affine& ex) {
                for (int k = 0; k < ex.n; ++k)
                    if (ex.sym[k] < 0 || ex.sym[k] >= nsym)
                        throw PlanError("node " + std::to_string(i) + ": symbol index " + std::to_string(ex.sym[k]) +
                                        " out of range");
                if (ex.symbolic()) {
                    patches_.push_back({target, ex});
                    node_symbolic[i] = true;
                } else {
                    *target = ex.c0;
                }
            };
            for (int d = 0; d < 4; ++d) {
                add(&t.ne[d], td.ne[d]);
                add(&t.nb[d], td.nb[d]);
            }
            for (int k = 0; k < td.offset.n; ++k)
                if (td.offset.sym[k] < 0 || td.offset.sym[k] >= nsym) throw PlanError("symbol index out of range");
            if (td.offset.symbolic()) {
                addr_patches_.push_back({&t.data, td.base, td.offset});
                node_symbolic[i] = true;
            } else {
                t.data = (uint8_t*)(uintptr_t)(td.base + (uint64_t)td.offset.c0);
            }
        }
    }
    for (size_t i = 0; i < nodes_.size(); ++i)
        if (node_symbolic[i]) symbolic_nodes_.push_back(i);

    // validate every node at the corners of the symbol box (each symbol at 1 and at its bound); size scratch
    std::vector<int64_t> s(nsym);
    const int ncorner_bits = nsym < 6 ? nsym : 6;
    const int ncorners = 1 << ncorner_bits;
    Scratch need;
    for (int c = ncorners - 1; c >= 0; --c) {
        for (int k = 0; k < nsym; ++k) {
            const bool hi = k < ncorner_bits ? ((c >> k) & 1) : true;
            s[k] = hi ? sym_max_[k] : (sym_max_[k] > 0 ? 1 : 0);
        }
        bind(s.data());
        const bool all = c == ncorners - 1;
        for (size_t i = 0; i < nodes_.size(); ++i) {
            if (!all && !node_symbolic[i]) continue;
            std::string e = check_node(nodes_[i], i, false);
            if (!e.empty()) {
                std::ostringstream o;
                o << e;
                if (nsym) {
                    o << " (symbols:";
                    for (int k = 0; k < nsym; ++k) o << " " << s[k];
                    o << ")";
                }
                throw PlanError(o.str());
            }
            Scratch sc = node_scratch(nodes_[i]);
            if (sc.shared > need.shared) need.shared = sc.shared;
            if (sc.per_thread > need.per_thread) need.per_thread = sc.per_thread;
        }
    }
    for (int k = 0; k < nsym; ++k) s[k] = sym_max_[k];
    bind(s.data());
    wsize_ = pad64(need.shared);
    tsize_ = pad64(need.per_thread);
    if (validate_only) return;

    // tasks
    for (size_t i = 0; i < nodes_.size(); ++i) {
        Node& n = nodes_[i];
        bool rows_sym = false;
        if (n.op == GGML_PY_OP_MUL_MAT)
            for (const Patch& p : patches_)
                if (p.target == &n.src[1].ne[1]) rows_sym = true;
        // constant weights of products: repacked once, x8 or p16 (shared by all plans)
        if (n.op == GGML_PY_OP_MUL_MAT && kt_->uses_repack && descs[i].src[0].const_id != 0 && !node_symbolic_src0(descs[i]) &&
            repack_group_rows(n.src[0].type) > 0) {
            auto rp = get_repacked(descs[i].src[0].const_id, n.src[0], n_threads_);
            if (rp) {
                n.repack = rp->data;
                repacks_.push_back(rp);
            }
        }
        // constant quantized expert weights whose groups of 8 rows never straddle two experts: repacked x8 as one
        // matrix of all the experts' rows (the integer path reads each expert's rows from there)
        const Tensor& xw = n.src[0];
        if (n.op == GGML_PY_OP_MUL_MAT_ID && kt_->uses_repack && descs[i].src[0].const_id != 0 &&
            !node_symbolic_src0(descs[i]) && repack_supported(xw.type) && xw.ne[1] % 8 == 0 &&
            xw.nb[2] == xw.nb[1] * xw.ne[1]) {
            Tensor flat = xw;
            flat.ne[1] = xw.ne[1] * xw.ne[2];
            flat.ne[2] = 1;
            flat.nb[2] = flat.nb[3] = flat.nb[1] * flat.ne[1];
            auto rp = get_repacked(descs[i].src[0].const_id, flat, n_threads_);
            if (rp) {
                n.repack = rp->data;
                repacks_.push_back(rp);
            }
        }
        n.n_phases = node_phases(n, rows_sym);
    }
    // GET_ROWS of a weight a product repacked (a tied embedding): its rows read back from the copy
    for (size_t i = 0; i < nodes_.size(); ++i) {
        Node& n = nodes_[i];
        if (n.op != GGML_PY_OP_GET_ROWS || !kt_->uses_repack || descs[i].src[0].const_id == 0 ||
            node_symbolic_src0(descs[i]))
            continue;
        if (auto rp = find_repacked(descs[i].src[0].const_id, n.src[0])) {
            n.repack = rp->data;
            repacks_.push_back(rp);
        }
    }
    group_gemvs(node_symbolic);
    for (Node& n : nodes_) {
        KernelFn fn = kt_->ops[n.op];
        if (!fn) throw PlanError(std::string(op_name(n.op)) + ": no kernel at level " + level_name(level_));
        if (n.grouped) continue;  // computed in its group's first task
        for (int p = 0; p < n.n_phases; ++p) tasks_.push_back({fn, &n, p});
    }
    tstate_.reset(new TaskState[tasks_.size() > 0 ? tasks_.size() : 1]);
    ctx_.error = &error_;
    ctx_.errmsg = errmsg_;
    errmsg_[0] = 0;
    schedule_tasks();
    alloc_scratch();
}

static bool overlaps(const Tensor& a, const Tensor& b) {
    const int64_t ea = tensor_extent(a), eb = tensor_extent(b);
    return ea > 0 && eb > 0 && a.data < b.data + eb && b.data < a.data + ea;
}

static bool same_view(const Tensor& a, const Tensor& b) {
    if (a.type != b.type || a.data != b.data) return false;
    for (int i = 0; i < 4; ++i)
        if (a.ne[i] != b.ne[i] || a.nb[i] != b.nb[i]) return false;
    return true;
}

// a quantized matrix-vector product of concrete shape, one weight matrix, whose phase 0 quantizes its input
static bool gemv_groupable(const Node& n, bool symbolic) {
    return !symbolic && n.op == GGML_PY_OP_MUL_MAT && n.n_phases == 2 && type_is_quant(n.src[0].type) &&
           n.src[1].ne[1] < gemm_min_rows(n.src[0].type) && n.src[0].ne[2] == 1 && n.src[0].ne[3] == 1;
}

static bool group_enabled() {
    static const bool v = [] {
        const char* e = getenv("GGML_PY_SIMD_GROUP");
        return !(e && e[0] == '0');
    }();
    return v;
}

// Matrix-vector products of one input (a layer's q, k and v, or its gate and up) become one task: the input is
// quantized once and the rows of all their weights are one pool of work, so the threads wait for each other once
// instead of once per product (at 2 threads, a small product's waits cost as much as its reads). A later product
// joins a group only where computing it early is provably the same: it reads the same tensor, that no node in
// between writes, and no node in between reads or writes its output (checked on the plan's concrete addresses;
// nodes with symbolic shapes or addresses end the search).
void Plan::group_gemvs(const std::vector<bool>& node_symbolic) {
    enum { WINDOW = 8 };  // nodes looked at past a group's first product
    if (!group_enabled()) return;
    for (size_t i = 0; i < nodes_.size(); ++i) {
        Node& first = nodes_[i];
        if (first.grouped || !gemv_groupable(first, node_symbolic[i])) continue;
        const bool a256 = weight_uses_a256(first.src[0].type);
        std::vector<size_t> members{i};
        for (size_t j = i + 1; j < nodes_.size() && j <= i + WINDOW; ++j) {
            if (node_symbolic[j]) break;
            Node& cand = nodes_[j];
            if (cand.grouped || !gemv_groupable(cand, false) || !same_view(cand.src[1], first.src[1]) ||
                weight_uses_a256(cand.src[0].type) != a256 || overlaps(cand.dst, first.src[1]))
                continue;
            bool safe = true;
            for (size_t m : members) safe = safe && !overlaps(cand.dst, nodes_[m].dst);
            for (size_t k = i + 1; k < j && safe; ++k) {
                const Node& mid = nodes_[k];
                if (mid.grouped) continue;  // a member, or computed with an earlier group
                safe = !overlaps(mid.dst, cand.dst) && !overlaps(mid.dst, cand.src[0]) &&
                       !overlaps(mid.dst, cand.src[1]);
                for (int s = 0; s < MAX_SRC && safe; ++s) safe = !mid.has[s] || !overlaps(mid.src[s], cand.dst);
            }
            if (!safe) continue;
            nodes_[members.back()].group_next = &cand;
            cand.grouped = true;
            members.push_back(j);
        }
    }
}

// Which tasks are small (one unit, run by whoever claims it: in practice the driving thread) and into how many
// units the others are cut: a few per thread, so that a thread the OS deschedules holds back little work.
void Plan::schedule_tasks() {
    all_single_ = true;
    for (size_t i = 0; i < tasks_.size(); ++i) {
        const Task& t = tasks_[i];
        const Node& n = *t.node;
        // the activation quantization of a matrix-vector product is tiny: no need to spread it
        const bool small_quantize = (n.op == GGML_PY_OP_MUL_MAT && n.n_phases == 2 && t.phase == 0 &&
                                     n.src[1].ne[0] * n.src[1].ne[1] * n.src[1].ne[2] * n.src[1].ne[3] < 32768) ||
                                    (n.op == GGML_PY_OP_MUL_MAT_ID && t.phase < 2 &&
                                     (t.phase == 0 || n.src[1].ne[0] * nelements(n.src[2]) < 32768));
        const bool single = n_threads_ <= 1 || (!force_parallel_ && (node_is_small(n) || small_quantize));
        uint32_t units = 1;
        if (!single) {
            const bool counter_based = (n.op == GGML_PY_OP_MUL_MAT || n.op == GGML_PY_OP_MUL_MAT_ID) &&
                                       t.phase == n.n_phases - 1;
            units = (uint32_t)(counter_based ? n_threads_ : 4 * n_threads_);
            all_single_ = false;
        }
        tstate_[i].single.store(single, std::memory_order_relaxed);
        tstate_[i].units.store(units, std::memory_order_relaxed);
    }
}

void Plan::alloc_scratch() {
    if (!wdata_ && wsize_) wdata_.reset(scratch_alloc(wsize_));
    if (tdata_threads_ < (size_t)n_threads_) {
        tdata_.reset(tsize_ ? scratch_alloc(tsize_ * (size_t)n_threads_) : nullptr);
        tdata_threads_ = (size_t)n_threads_;
    }
    ctx_.wdata = wdata_.get();
    ctx_.wsize = wsize_;
    ctx_.tdata = tdata_.get();
    ctx_.tsize = tsize_;
    tctx_.assign((size_t)n_threads_, ctx_);
    for (int i = 0; i < n_threads_; ++i) tctx_[(size_t)i].tdata = tdata_ ? tdata_.get() + (size_t)i * tsize_ : nullptr;
}

void Plan::set_n_threads(int n) {
    std::lock_guard<std::mutex> lk(mutex_);
    ThreadPool::instance().quiesce(this);  // no worker may hold the old per-thread contexts
    n_threads_ = n > 0 ? (n > 256 ? 256 : n) : physical_cores();
    schedule_tasks();
    alloc_scratch();
}

void Plan::set_force_parallel(bool v) {
    std::lock_guard<std::mutex> lk(mutex_);
    force_parallel_ = v;
    schedule_tasks();
}

void Plan::bind(const int64_t* s) {
    for (const Patch& p : patches_) *p.target = p.expr.eval(s);
    for (const AddrPatch& p : addr_patches_) *p.target = (uint8_t*)(uintptr_t)(p.base + (uint64_t)p.off.eval(s));
}

std::string Plan::check_node(const Node& n, size_t index, bool check_scratch) const {
    std::string e = validate_node(n);
    auto where = [&](const std::string& m) { return "node " + std::to_string(index) + " " + m; };
    if (!e.empty()) return where(e);
    for (int s = -1; s < MAX_SRC; ++s) {
        if (s >= 0 && !n.has[s]) continue;
        const Tensor& t = s < 0 ? n.dst : n.src[s];
        const int64_t ext = tensor_extent(t);
        if (ext <= 0) continue;
        const uint64_t p = (uint64_t)(uintptr_t)t.data;
        bool inside = false;
        for (const Range& r : ranges_) {
            if (p >= r.base && p - r.base <= r.size && (uint64_t)ext <= r.size - (p - r.base)) {
                inside = true;
                break;
            }
        }
        if (!inside) {
            std::ostringstream o;
            o << op_name(n.op) << ": " << (s < 0 ? std::string("dst") : "src" + std::to_string(s)) << " "
              << shape_str(t) << " at 0x" << std::hex << p << std::dec << " spanning " << ext
              << " bytes is outside every registered buffer";
            return where(o.str());
        }
    }
    if (check_scratch) {
        Scratch sc = node_scratch(n);
        if (sc.shared > wsize_ || sc.per_thread > tsize_)
            return where(std::string(op_name(n.op)) + ": needs more scratch than planned for the symbol bounds");
    }
    return "";
}

void Plan::compute(const int64_t* syms, size_t n_syms, AbortPoll poll, double* node_seconds) {
    // A signal handler run by the poll between two nodes may start another compute on this thread: the pool's
    // driver lock (or this plan's) is held, so that would deadlock. Refuse it instead.
    static thread_local bool computing = false;
    if (computing) throw PlanError("a compute was started on a thread that is inside another (from a signal handler?)");
    computing = true;
    struct Done {
        ~Done() { computing = false; }
    } done;
    std::lock_guard<std::mutex> lk(mutex_);
    if (n_syms != sym_max_.size())
        throw PlanError("expected " + std::to_string(sym_max_.size()) + " symbol values, got " + std::to_string(n_syms));
    for (size_t k = 0; k < n_syms; ++k)
        if (syms[k] < 0 || syms[k] > sym_max_[k])
            throw PlanError("symbol " + std::to_string(k) + " = " + std::to_string(syms[k]) + " is outside 0.." +
                            std::to_string(sym_max_[k]));
    if (!symbolic_nodes_.empty()) {
        bind(syms);
        for (size_t i : symbolic_nodes_) {
            std::string e = check_node(nodes_[i], i, true);
            if (!e.empty()) throw PlanError(e);
        }
        schedule_tasks();
    }
    for (size_t i = 0; i < nodes_.size(); ++i) counters_[i].store(0, std::memory_order_relaxed);
    error_.store(0, std::memory_order_relaxed);
    poll_ = poll;
    node_seconds_ = node_seconds;
    interrupted_ = false;
    if (poll_.fn) last_poll_ = std::chrono::steady_clock::now();
    const int nth = all_single_ ? 1 : n_threads_;
    ThreadPool& pool = ThreadPool::instance();
    if (nth <= 1) {
        // a new generation, published as finished: a worker still looking at an earlier compute claims nothing
        const uint64_t gen = ++gen_ & 0xffffffffu;
        for (size_t t = 0; t < tasks_.size(); ++t) tstate_[t].claim.store(gen << 32 | 0xffffffffu, std::memory_order_relaxed);
        cur_.store((gen << 32) | tasks_.size(), std::memory_order_release);
        run_nth_ = 1;
        for (size_t t = 0; t < tasks_.size(); ++t) {
            const Task& tk = tasks_[t];
            const uint32_t units = tstate_[t].units.load(std::memory_order_relaxed);
            std::chrono::steady_clock::time_point t0;
            if (node_seconds_) t0 = std::chrono::steady_clock::now();
            if (!error_.load(std::memory_order_relaxed))
                for (uint32_t u = 0; u < units; ++u) tk.fn(*tk.node, tk.phase, (int)u, (int)units, tctx_[0]);
            if (node_seconds_)
                node_seconds_[tk.node->index] +=
                    std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
            maybe_poll(t, units);
        }
    } else {
        auto guard = pool.lock();
        const uint64_t gen = ++gen_ & 0xffffffffu;
        for (size_t t = 0; t < tasks_.size(); ++t) {
            tstate_[t].claim.store(gen << 32, std::memory_order_relaxed);
            tstate_[t].done.store(0, std::memory_order_relaxed);
        }
        run_nth_ = nth;
        cur_.store(gen << 32, std::memory_order_release);
        pool.start(this, nth);
        drive(gen, nth);
    }
    if (interrupted_) throw Interrupted();
    if (error_.load()) throw PlanError(std::string(errmsg_));
}

// Between tasks, on the computing thread: ask the poll (it may take the GIL) every INTERRUPT_POLL_MS. The clock is
// read after every task split into several units, but only after every 8th one-unit task (those are small by the
// work threshold), which keeps it off the per-node dispatch cost. A stop is an error every later unit sees.
void Plan::maybe_poll(size_t task, uint32_t units) {
    if (!poll_.fn || interrupted_ || (units <= 1 && (task & 7) != 7)) return;
    const auto now = std::chrono::steady_clock::now();
    if (now - last_poll_ < std::chrono::milliseconds(INTERRUPT_POLL_MS)) return;
    last_poll_ = now;
    if (poll_.fn(poll_.data) != 0) {
        interrupted_ = true;
        int expected = 0;
        error_.compare_exchange_strong(expected, 1);
    }
}

// Claim one unit of task t in generation gen and run it; false when none is left.
bool Plan::run_unit(size_t t, uint64_t gen, const ExecCtx& ctx) {
    TaskState& st = tstate_[t];
    const Task& tk = tasks_[t];
    uint64_t c = st.claim.load(std::memory_order_acquire);
    uint32_t units;
    for (;;) {
        units = st.units.load(std::memory_order_relaxed);
        if ((c >> 32) != gen || (c & 0xffffffffu) >= units) return false;
        if (st.claim.compare_exchange_weak(c, c + 1, std::memory_order_acq_rel, std::memory_order_acquire)) break;
    }
    const uint32_t u = (uint32_t)(c & 0xffffffffu);
    if (!error_.load(std::memory_order_relaxed)) tk.fn(*tk.node, tk.phase, (int)u, (int)units, ctx);
    st.done.fetch_add(1, std::memory_order_acq_rel);
    return true;
}

// The calling thread runs the tasks in order, doing whatever units no worker took, and waits for each task's
// units to finish before going on. It never waits for a worker that is not inside a unit, so a worker the OS has
// descheduled costs at most the unit it holds. Only the tasks split into units are published to the workers: a
// small task runs here without touching memory they read (publishing each one made every small node at 2 threads
// wait for the line the worker spins on; SmolLM2 decode: norms, RoPE, adds 1.5-3x slower than at 1 thread).
void Plan::drive(uint64_t gen, int nth) {
    (void)nth;
    const size_t nt = tasks_.size();
    for (size_t t = 0; t < nt; ++t) {
        std::chrono::steady_clock::time_point t0;
        if (node_seconds_) t0 = std::chrono::steady_clock::now();
        const uint32_t units = tstate_[t].units.load(std::memory_order_relaxed);
        if (tstate_[t].single.load(std::memory_order_relaxed)) {
            const Task& tk = tasks_[t];
            if (!error_.load(std::memory_order_relaxed)) tk.fn(*tk.node, tk.phase, 0, 1, tctx_[0]);
        } else {
            cur_.store((gen << 32) | t, std::memory_order_release);
            while (run_unit(t, gen, tctx_[0])) {
            }
            Backoff bo;
            while (tstate_[t].done.load(std::memory_order_acquire) < units) bo.pause();
        }
        if (node_seconds_)
            node_seconds_[tasks_[t].node->index] +=
                std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
        maybe_poll(t, units);
    }
    cur_.store((gen << 32) | nt, std::memory_order_release);
}

// A worker: follow the tasks the driver publishes, claim units, leave when the compute is over.
void Plan::run(int ith, int nth) {
    (void)nth;
    const uint64_t c0 = cur_.load(std::memory_order_acquire);
    const uint64_t gen = c0 >> 32;
    const size_t nt = tasks_.size();
    const ExecCtx& ctx = tctx_[(size_t)ith < tctx_.size() ? (size_t)ith : 0];
    if ((size_t)ith >= tctx_.size()) return;
    uint64_t cur = c0;
    for (;;) {
        if ((cur >> 32) != gen) return;
        const size_t t = (size_t)(cur & 0xffffffffu);
        if (t >= nt) return;
        if (!tstate_[t].single.load(std::memory_order_relaxed)) {
            while (run_unit(t, gen, ctx)) {
            }
        }
        // wait for the driver to move on
        Backoff bo;
        uint64_t next;
        while ((next = cur_.load(std::memory_order_acquire)) == cur) bo.pause();
        cur = next;
    }
}

Plan::~Plan() { ThreadPool::instance().quiesce(this); }

}  // namespace gp
