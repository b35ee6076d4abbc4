// The SIMD backend as a ggml_py ABI v2 plugin: the same table a third-party library exports. ggml_py drives the
// backend only through it (ggml_py/runtime/native/); the pybind11 module hands its address over (module.cpp).
#include <cstring>
#include <string>

#include "plugin.h"
#include "runtime.h"

namespace gp {
namespace {

struct Context {
    int n_threads;
    int level;             // -1: the level current when a plan is created
    bool force_parallel;   // every node on all threads (a benchmark of the barrier cost)
};

void set_error(ggml_py_error* err, int node, const std::string& msg) {
    if (!err) return;
    err->node = node;
    std::strncpy(err->message, msg.c_str(), GGML_PY_ERROR_MAX - 1);
    err->message[GGML_PY_ERROR_MAX - 1] = 0;
}

// ---------------------------------------------------------------------------------------------------- buffers

int32_t buffer_alloc(size_t size, ggml_py_buffer* buf) {
    try {
        bool mmapped = false;
        uint8_t* p = aligned_alloc_bytes(size, &mmapped);
        buf->base = p;
        buf->size = size;
        buf->context = (void*)(uintptr_t)(mmapped ? 1 : 2);  // 0 = wrapped memory (not ours to free)
        return GGML_PY_OK;
    } catch (const std::bad_alloc&) {
        return GGML_PY_ERR_NO_MEMORY;
    }
}

int32_t buffer_from_host_ptr(void* ptr, size_t size, ggml_py_buffer* buf) {
    buf->base = ptr;  // the kernels use unaligned loads: any address will do
    buf->size = size;
    buf->context = nullptr;
    return GGML_PY_OK;
}

void buffer_free(ggml_py_buffer* buf) {
    const uintptr_t kind = (uintptr_t)buf->context;
    if (kind != 0) aligned_free_bytes((uint8_t*)buf->base, buf->size, kind == 1);
    buf->base = nullptr;
    buf->context = nullptr;
}

// ---------------------------------------------------------------------------------------------------- lowering

Affine affine_of(const ggml_py_affine& a) {
    Affine r;
    r.c0 = a.c;
    if (a.n_terms < 0 || a.n_terms > MAX_TERMS) throw PlanError("an affine expression has too many terms");
    r.n = a.n_terms;
    for (int k = 0; k < a.n_terms; ++k) {
        r.sym[k] = a.sym[k];
        r.coef[k] = a.coef[k];
    }
    return r;
}

Affine constant(int64_t v) {
    Affine r;
    r.c0 = v;
    return r;
}

TensorDesc tensor_of(const ggml_py_tensor* t) {
    TensorDesc d;
    if (!t) return d;
    d.present = true;
    d.type = t->type;
    if (t->sym) {
        for (int i = 0; i < 4; ++i) {
            d.ne[i] = affine_of(t->sym->ne[i]);
            d.nb[i] = affine_of(t->sym->nb[i]);
        }
        d.base = (uint64_t)(uintptr_t)t->sym->base;
        d.offset = affine_of(t->sym->offset);
    } else {
        for (int i = 0; i < 4; ++i) {
            d.ne[i] = constant(t->ne[i]);
            d.nb[i] = constant(t->nb[i]);
        }
        d.base = (uint64_t)(uintptr_t)t->data;
    }
    // a weight's id is stable for its life: its repacked copy is shared by every plan that uses it
    d.const_id = (t->flags & GGML_PY_TENSOR_PARAM) ? (int64_t)t->id : 0;
    return d;
}

// The kernels' sources are the values an op reads: CPY's destination (src1) and SET_ROWS's (src0) are its dst.
NodeDesc node_of(const ggml_py_node* n) {
    NodeDesc d;
    d.op = n->op;
    d.dst = tensor_of(n->dst);
    d.params = n->params;
    const int first = n->op == GGML_PY_OP_SET_ROWS ? 1 : 0;
    const int last = n->op == GGML_PY_OP_CPY ? 1 : (n->n_src < MAX_SRC ? n->n_src : MAX_SRC);
    for (int i = first; i < last; ++i) d.src[i - first] = tensor_of(n->src[i]);
    return d;
}

// ---------------------------------------------------------------------------------------------------- backend

void* init(int32_t n_threads, const char* options) {
    Context ctx{n_threads > 0 ? n_threads : physical_cores(), -1, false};
    std::string opts = options ? options : "";
    size_t pos = 0;
    while (pos < opts.size()) {
        size_t end = opts.find(';', pos);
        if (end == std::string::npos) end = opts.size();
        const std::string kv = opts.substr(pos, end - pos);
        pos = end + 1;
        if (kv.empty()) continue;
        const size_t eq = kv.find('=');
        const std::string key = kv.substr(0, eq), value = eq == std::string::npos ? "" : kv.substr(eq + 1);
        if (key == "level") {
            ctx.level = level_from_name(value);
            if (ctx.level < 0 || !level_supported(ctx.level)) return nullptr;
        } else if (key == "force_parallel") {
            ctx.force_parallel = value == "1";
        } else {
            return nullptr;
        }
    }
    return new Context(ctx);
}

void backend_free(void* backend) { delete (Context*)backend; }

void set_n_threads(void* backend, int32_t n) { ((Context*)backend)->n_threads = n > 0 ? n : physical_cores(); }

int32_t supports_op(void* backend, const ggml_py_node* node) {
    (void)backend;
    try {
        // every symbolic value at its bound: addresses are not known yet, so they are not checked
        ggml_py_node concrete = *node;
        ggml_py_tensor ts[1 + MAX_SRC];
        ggml_py_tensor* all[1 + MAX_SRC] = {node->dst, node->src[0], node->src[1], node->src[2], node->src[3]};
        for (int i = 0; i < 1 + MAX_SRC; ++i) {
            if (!all[i]) continue;
            ts[i] = *all[i];
            ts[i].sym = nullptr;
            (i == 0 ? concrete.dst : concrete.src[i - 1]) = &ts[i];
        }
        std::vector<NodeDesc> nd{node_of(&concrete)};
        std::vector<Range> rs{{0, (uint64_t)1 << 62}};
        Plan p(nd, rs, {}, 1, LEVEL_SCALAR, true);
        return 1;
    } catch (const std::exception&) {
        return 0;
    }
}

int32_t plan_create(void* backend, const ggml_py_graph* g, void** plan, ggml_py_error* err) {
    const Context* ctx = (const Context*)backend;
    try {
        std::vector<NodeDesc> nodes;
        nodes.reserve((size_t)g->n_nodes);
        for (int i = 0; i < g->n_nodes; ++i) nodes.push_back(node_of(g->nodes[i]));
        std::vector<Range> ranges;
        for (int i = 0; i < g->n_ranges; ++i) ranges.push_back({(uint64_t)(uintptr_t)g->ranges[i].base, g->ranges[i].size});
        std::vector<int64_t> sym_max(g->sym_max, g->sym_max + g->n_syms);
        Plan* p = new Plan(nodes, ranges, sym_max, ctx->n_threads, ctx->level >= 0 ? ctx->level : current_level());
        if (ctx->force_parallel) p->set_force_parallel(true);
        *plan = p;
        return GGML_PY_OK;
    } catch (const PlanError& e) {
        set_error(err, -1, e.what());
        return GGML_PY_ERR_UNSUPPORTED;
    } catch (const std::bad_alloc&) {
        set_error(err, -1, "out of memory");
        return GGML_PY_ERR_NO_MEMORY;
    } catch (const std::exception& e) {
        set_error(err, -1, e.what());
        return GGML_PY_ERR_FAILED;
    }
}

void plan_free(void* backend, void* plan) {
    (void)backend;
    delete (Plan*)plan;
}

int32_t compute(void* backend, void* plan, const ggml_py_graph* g, const ggml_py_compute_args* args) {
    const Context* ctx = (const Context*)backend;
    Plan* p = (Plan*)plan;
    try {
        if (p->n_threads() != ctx->n_threads) p->set_n_threads(ctx->n_threads);
        p->compute(args->syms, (size_t)g->n_syms, AbortPoll{args->abort_callback, args->abort_data},
                   args->node_seconds);
        return GGML_PY_OK;
    } catch (const Interrupted&) {
        set_error(args->err, -1, "compute aborted");
        return GGML_PY_ERR_ABORTED;
    } catch (const PlanError& e) {
        set_error(args->err, -1, e.what());
        return GGML_PY_ERR_FAILED;
    } catch (const std::exception& e) {
        set_error(args->err, -1, e.what());
        return GGML_PY_ERR_FAILED;
    }
}

}  // namespace

const ggml_py_plugin* simd_plugin() {
    static const ggml_py_plugin table = [] {
        ggml_py_plugin t;
        std::memset(&t, 0, sizeof(t));
        t.abi_version = GGML_PY_ABI_VERSION;
        t.struct_size = sizeof(ggml_py_plugin);
        t.name = "simd";
        t.version = "0.2.0";
        t.description = "SIMD kernels (scalar / AVX2 / AVX-512, chosen at run time)";
        t.score = 10;
        t.n_threads = physical_cores();
        t.buffer_type.name = "simd";
        t.buffer_type.alignment = 64;
        t.buffer_type.is_host = 1;
        t.buffer_type.alloc_buffer = buffer_alloc;
        t.buffer.free_buffer = buffer_free;
        t.backend.init = init;
        t.backend.free = backend_free;
        t.backend.supports_op = supports_op;
        t.backend.graph_plan_create = plan_create;
        t.backend.graph_plan_free = plan_free;
        t.backend.graph_compute = compute;
        t.backend.set_n_threads = set_n_threads;
        t.buffer_from_host_ptr = buffer_from_host_ptr;
        return t;
    }();
    return &table;
}

}  // namespace gp
