/*
 * ggml_py native backend ABI, version 2.2.
 *
 * A native backend is a shared library (.so / .dylib / .dll) exporting two plain C functions:
 *
 *     uint32_t              ggml_py_plugin_abi_version(void);   returns GGML_PY_ABI_VERSION it was built with
 *     const ggml_py_plugin *ggml_py_plugin_init(void);          returns a static description of the backend
 *
 * The built-in SIMD backend is one of these too: its Python module hands ggml_py the same table.
 *
 * Versions: GGML_PY_ABI_VERSION is (major << 16) | minor. ggml_py loads a plugin of its own major version and of any
 * minor version up to its own; it refuses any other with a message saying what to rebuild or upgrade. A minor version
 * only appends fields at the end of structs, so a plugin built against 2.0 runs unchanged under 2.1: ggml_py reads
 * the plugin's ggml_py_plugin only within the plugin's struct_size (later function pointers count as absent), and
 * every struct ggml_py hands to the plugin begins with the fields of every earlier minor version (nodes are passed as
 * an array of pointers, so a longer node struct does not move them). Version 1 plugins are refused: rebuild them
 * against this header (`ggml_py.get_include()`).
 *   2.0  everything below unless marked otherwise
 *   2.1  ggml_py_plugin.buffer_from_host_ptr (wrap host memory, e.g. mmap'd weights, without copying)
 *   2.2  ROPE: YaRN parameters (GGML_PY_P_ROPE_EXT_FACTOR ... _N_CTX_ORIG) and an optional src[2], the frequency
 *        factors (F32, n_dims/2 values dividing each pair's angle). ggml_py offers a plugin of an earlier minor only
 *        ROPE nodes without src[2] whose new parameters are neutral (ext_factor 0, attn_factor 1, beta_fast 32,
 *        beta_slow 1, n_ctx_orig 0): the rope it computes already. ggml_py_plugin.precision: the precision tier
 *        the plugin claims (exact when absent). Device plugins: buffer_copy (between two of its buffers, no host),
 *        asynchronous execution (graph_compute_async, set_tensor_async and events; see "Asynchronous
 *        execution" below), several devices (n_devices, devices, init_device, alloc_buffer_device), host_threads.
 *
 * Conventions (ggml's):
 *   - type ids are ggml's (F32 = 0, F16 = 1, Q4_0 = 2, ...), enum ggml_py_type;
 *   - ne[4] / nb[4] are innermost first: ne[0] is the contiguous row length, nb[0] the element (or block) size in
 *     bytes, nb[1] the row stride, ...; unused outer dims have ne = 1. Python shapes are numpy order, so ne is the
 *     Python shape reversed;
 *   - op ids and the parameter slots of every op are generated from ggml_py's op schema (ggml_py/ir/schema.py), below.
 *
 * Symbolic dimensions: a plan prepared once serves many computes whose sizes differ (the KV length of a decode
 * loop). A tensor with flag GGML_PY_TENSOR_SYMBOLIC carries `sym`: each of its ne, nb and its byte offset as an affine
 * expression c + sum(coef[k] * syms[sym[k]]) of the graph's symbols. Its plain ne, nb and data hold the values at
 * every symbol's upper bound (graph.sym_max): enough for supports_op and for sizing scratch memory. A compute passes
 * the symbols' values (args.syms); ggml_py_tensor_bind() below gives the tensor for them. Nothing in the node array
 * changes between computes.
 *
 * Life cycle (each call comes from one thread at a time per backend context; the GIL is released during calls):
 *   init(n_threads, options)         once per ggml_py Backend object; returns the plugin's backend context
 *   supports_op(ctx, node)           while scheduling; data is NULL; return 1 to accept the node
 *   buffer_type.alloc_buffer         planned memory: weights, states, one compute buffer per plan
 *   graph_plan_create(ctx, g, ...)   once per split (optional): validate, choose kernels, convert weights
 *   graph_compute(ctx, plan, g, a)   every step: nodes in dependency order; return GGML_PY_OK or fill a->err
 *   graph_plan_free, free            when the plan / backend object goes away
 *
 * Asynchronous execution (2.2, optional, all of graph_compute_async ... event_synchronize or none): the backend
 * context is an in-order queue. graph_compute_async and set_tensor_async only enqueue and return; event_record
 * marks the point after everything enqueued so far and event_synchronize waits on the host until the queue has
 * passed that point. ggml_py keeps the host memory an enqueued copy reads, and the compute arguments, untouched
 * until an event after it was synchronized, waits for an event before it reads what the queue wrote, and ends every
 * Plan.compute with one. So the host computes another backend's split while the queue copies or computes:
 * the overlap that hides a device's transfers. An error in queued work is returned (and described in err) by the
 * next event_synchronize. The abort callback is not passed to an asynchronous compute (Plan.cancel stops the plan
 * between splits instead).
 *
 * C99 or C++; the region between the CDEF markers is also what ggml_py's loader parses (cffi), so it holds only
 * declarations and integer #defines.
 */
#ifndef GGML_PY_BACKEND_ABI_H
#define GGML_PY_BACKEND_ABI_H

#include <stddef.h>
#include <stdint.h>

#if defined(_WIN32)
#define GGML_PY_PLUGIN_EXPORT __declspec(dllexport)
#elif defined(__GNUC__)
#define GGML_PY_PLUGIN_EXPORT __attribute__((visibility("default")))
#else
#define GGML_PY_PLUGIN_EXPORT
#endif

#ifdef __cplusplus
extern "C" {
#endif

/* GGML_PY_CDEF_BEGIN */

#define GGML_PY_ABI_MAJOR 2
#define GGML_PY_ABI_MINOR 2
#define GGML_PY_ABI_VERSION 131074 /* (GGML_PY_ABI_MAJOR << 16) | GGML_PY_ABI_MINOR */
#define GGML_PY_MAX_DIMS 4
#define GGML_PY_MAX_SRC 4
#define GGML_PY_MAX_OP_PARAMS 16
#define GGML_PY_MAX_TERMS 4
#define GGML_PY_ERROR_MAX 256
#define GGML_PY_PRECISION_EXACT 0
#define GGML_PY_PRECISION_REDUCED 1

/* Status codes returned by the plugin's functions. */
enum ggml_py_status {
    GGML_PY_OK = 0,
    GGML_PY_ERR_FAILED = 1,      /* generic failure; say why in ggml_py_error.message */
    GGML_PY_ERR_UNSUPPORTED = 2, /* an op / type / layout the plugin cannot compute */
    GGML_PY_ERR_NO_MEMORY = 3,   /* an allocation failed */
    GGML_PY_ERR_ABORTED = 4      /* the abort callback asked to stop; the nodes after that point did not run */
};

/* GGML_PY_SCHEMA_BEGIN: generated by `python -m ggml_py.ir.schema header`, do not edit */
/* Element types: ggml's type ids (also GGUF's). */
enum ggml_py_type {
    GGML_PY_TYPE_F32 = 0,
    GGML_PY_TYPE_F16 = 1,
    GGML_PY_TYPE_Q4_0 = 2,
    GGML_PY_TYPE_Q4_1 = 3,
    GGML_PY_TYPE_Q5_0 = 6,
    GGML_PY_TYPE_Q5_1 = 7,
    GGML_PY_TYPE_Q8_0 = 8,
    GGML_PY_TYPE_Q8_1 = 9,
    GGML_PY_TYPE_Q2_K = 10,
    GGML_PY_TYPE_Q3_K = 11,
    GGML_PY_TYPE_Q4_K = 12,
    GGML_PY_TYPE_Q5_K = 13,
    GGML_PY_TYPE_Q6_K = 14,
    GGML_PY_TYPE_Q8_K = 15,
    GGML_PY_TYPE_IQ4_NL = 20,
    GGML_PY_TYPE_IQ4_XS = 23,
    GGML_PY_TYPE_I8 = 24,
    GGML_PY_TYPE_I16 = 25,
    GGML_PY_TYPE_I32 = 26,
    GGML_PY_TYPE_I64 = 27,
    GGML_PY_TYPE_BF16 = 30
};

/* Op ids: only ever appended to. Sources (src[0], src[1], ...; '?' = optional, NULL when absent;
 * [rows]: must have contiguous rows, [contiguous]: must be contiguous, see GGML_PY_LAYOUT_<OP>):
 *   ADD             a [rows], b
 *   SUB             a [rows], b
 *   MUL             a [rows], b
 *   DIV             a [rows], b
 *   SCALE           a [contiguous]
 *   SQR             a [rows]
 *   SQRT            a [rows]
 *   NEG             a [rows]
 *   ABS             a [rows]
 *   EXP             a [rows]
 *   LOG             a [rows]
 *   SILU            a [rows]
 *   GELU            a [rows]
 *   RELU            a [rows]
 *   TANH            a [rows]
 *   SIGMOID         a [rows]
 *   CLAMP           a [rows]
 *   SWIGLU          a [rows], b? [rows]
 *   GEGLU           a [rows], b? [rows]
 *   NORM            a
 *   RMS_NORM        a [rows]
 *   SUM_ROWS        a [rows]
 *   MEAN            a [rows]
 *   ARGMAX          a [rows]
 *   MUL_MAT         a [rows], b [rows]
 *   SOFT_MAX        a [contiguous], mask? [contiguous]
 *   DIAG_MASK_INF   a [contiguous]
 *   ROPE            a [rows], pos [contiguous], freq_factors? [contiguous]
 *   FLASH_ATTN_EXT  q [rows], k [rows], v [rows], mask? [contiguous]
 *   GET_ROWS        a [rows], idx
 *   SET_ROWS        dst [rows], rows [rows], idx  (dst aliases src[0])
 *   CPY             a, dst?  (dst aliases src[1])
 *   CONT            a
 *   CONCAT          a, b
 *   REPEAT          a [rows]
 *   PAD             a
 *   TOP_K           a [rows]
 *   GELU_ERF        a [rows]
 *   MUL_MAT_ID      as [rows], b [rows], ids
 * Sources added by a later minor version: ROPE freq_factors (ABI 2.2).
 */
enum ggml_py_op {
    GGML_PY_OP_NONE = 0,
    GGML_PY_OP_ADD = 1,
    GGML_PY_OP_SUB = 2,
    GGML_PY_OP_MUL = 3,
    GGML_PY_OP_DIV = 4,
    GGML_PY_OP_SCALE = 5,
    GGML_PY_OP_SQR = 6,
    GGML_PY_OP_SQRT = 7,
    GGML_PY_OP_NEG = 8,
    GGML_PY_OP_ABS = 9,
    GGML_PY_OP_EXP = 10,
    GGML_PY_OP_LOG = 11,
    GGML_PY_OP_SILU = 12,
    GGML_PY_OP_GELU = 13,
    GGML_PY_OP_RELU = 14,
    GGML_PY_OP_TANH = 15,
    GGML_PY_OP_SIGMOID = 16,
    GGML_PY_OP_CLAMP = 17,
    GGML_PY_OP_SWIGLU = 18,
    GGML_PY_OP_GEGLU = 19,
    GGML_PY_OP_NORM = 20,
    GGML_PY_OP_RMS_NORM = 21,
    GGML_PY_OP_SUM_ROWS = 22,
    GGML_PY_OP_MEAN = 23,
    GGML_PY_OP_ARGMAX = 24,
    GGML_PY_OP_MUL_MAT = 25,
    GGML_PY_OP_SOFT_MAX = 26,
    GGML_PY_OP_DIAG_MASK_INF = 27,
    GGML_PY_OP_ROPE = 28,
    GGML_PY_OP_FLASH_ATTN_EXT = 29,
    GGML_PY_OP_GET_ROWS = 30,
    GGML_PY_OP_SET_ROWS = 31,
    GGML_PY_OP_CPY = 32,
    GGML_PY_OP_CONT = 33,
    GGML_PY_OP_CONCAT = 34,
    GGML_PY_OP_REPEAT = 35,
    GGML_PY_OP_PAD = 36,
    GGML_PY_OP_TOP_K = 37,
    GGML_PY_OP_GELU_ERF = 38,
    GGML_PY_OP_MUL_MAT_ID = 39,
    GGML_PY_OP_COUNT = 40
};

/* Op parameters: GGML_PY_P_<OP>_<PARAM> is the first slot of ggml_py_op_params it fills, read
 * as .f[] (float) or .i[] (int32) as noted; DIMS fill MAX_DIMS int slots in ggml order (innermost
 * first). */
#define GGML_PY_P_SCALE_S 0 /* f */
#define GGML_PY_P_SCALE_B 1 /* f */
#define GGML_PY_P_CLAMP_MIN 0 /* f */
#define GGML_PY_P_CLAMP_MAX 1 /* f */
#define GGML_PY_P_NORM_EPS 0 /* f */
#define GGML_PY_P_RMS_NORM_EPS 0 /* f */
#define GGML_PY_P_SOFT_MAX_SCALE 0 /* f */
#define GGML_PY_P_SOFT_MAX_MAX_BIAS 1 /* f */
#define GGML_PY_P_DIAG_MASK_INF_N_PAST 0 /* i */
#define GGML_PY_P_ROPE_N_DIMS 0 /* i */
#define GGML_PY_P_ROPE_MODE 1 /* i */
#define GGML_PY_P_ROPE_FREQ_BASE 2 /* f */
#define GGML_PY_P_ROPE_FREQ_SCALE 3 /* f */
#define GGML_PY_P_ROPE_EXT_FACTOR 4 /* f; ABI 2.2, neutral 0 */
#define GGML_PY_P_ROPE_ATTN_FACTOR 5 /* f; ABI 2.2, neutral 1 */
#define GGML_PY_P_ROPE_BETA_FAST 6 /* f; ABI 2.2, neutral 32 */
#define GGML_PY_P_ROPE_BETA_SLOW 7 /* f; ABI 2.2, neutral 1 */
#define GGML_PY_P_ROPE_N_CTX_ORIG 8 /* i; ABI 2.2, neutral 0 */
#define GGML_PY_P_FLASH_ATTN_EXT_SCALE 0 /* f */
#define GGML_PY_P_FLASH_ATTN_EXT_MAX_BIAS 1 /* f */
#define GGML_PY_P_FLASH_ATTN_EXT_SOFTCAP 2 /* f */
#define GGML_PY_P_CONCAT_AXIS 0 /* i, ggml dim */
#define GGML_PY_P_PAD_PADS 0 /* i, MAX_DIMS slots */
#define GGML_PY_P_TOP_K_K 0 /* i */

/* Source layouts: what each source's memory must be, as ggml's CPU backend requires it. A plugin may
 * decline a node whose source lacks its layout and must compute every other layout (the conformance kit
 * feeds windows of wider inputs to every source that is not CONTIGUOUS, transposed views to every ANY
 * one). GGML_PY_LAYOUT_<OP> holds source j's layout at bits 2j and 2j+1:
 * (GGML_PY_LAYOUT_<OP> >> (2 * j)) & 3. ROWS: nb[0] == the type (block) size, other strides free. */
#define GGML_PY_LAYOUT_ANY 0
#define GGML_PY_LAYOUT_ROWS 1
#define GGML_PY_LAYOUT_CONTIGUOUS 2
#define GGML_PY_LAYOUT_ADD 1 /* a rows */
#define GGML_PY_LAYOUT_SUB 1 /* a rows */
#define GGML_PY_LAYOUT_MUL 1 /* a rows */
#define GGML_PY_LAYOUT_DIV 1 /* a rows */
#define GGML_PY_LAYOUT_SCALE 2 /* a contiguous */
#define GGML_PY_LAYOUT_SQR 1 /* a rows */
#define GGML_PY_LAYOUT_SQRT 1 /* a rows */
#define GGML_PY_LAYOUT_NEG 1 /* a rows */
#define GGML_PY_LAYOUT_ABS 1 /* a rows */
#define GGML_PY_LAYOUT_EXP 1 /* a rows */
#define GGML_PY_LAYOUT_LOG 1 /* a rows */
#define GGML_PY_LAYOUT_SILU 1 /* a rows */
#define GGML_PY_LAYOUT_GELU 1 /* a rows */
#define GGML_PY_LAYOUT_RELU 1 /* a rows */
#define GGML_PY_LAYOUT_TANH 1 /* a rows */
#define GGML_PY_LAYOUT_SIGMOID 1 /* a rows */
#define GGML_PY_LAYOUT_CLAMP 1 /* a rows */
#define GGML_PY_LAYOUT_SWIGLU 5 /* a rows, b rows */
#define GGML_PY_LAYOUT_GEGLU 5 /* a rows, b rows */
#define GGML_PY_LAYOUT_NORM 0
#define GGML_PY_LAYOUT_RMS_NORM 1 /* a rows */
#define GGML_PY_LAYOUT_SUM_ROWS 1 /* a rows */
#define GGML_PY_LAYOUT_MEAN 1 /* a rows */
#define GGML_PY_LAYOUT_ARGMAX 1 /* a rows */
#define GGML_PY_LAYOUT_MUL_MAT 5 /* a rows, b rows */
#define GGML_PY_LAYOUT_SOFT_MAX 10 /* a contiguous, mask contiguous */
#define GGML_PY_LAYOUT_DIAG_MASK_INF 2 /* a contiguous */
#define GGML_PY_LAYOUT_ROPE 41 /* a rows, pos contiguous, freq_factors contiguous */
#define GGML_PY_LAYOUT_FLASH_ATTN_EXT 149 /* q rows, k rows, v rows, mask contiguous */
#define GGML_PY_LAYOUT_GET_ROWS 1 /* a rows */
#define GGML_PY_LAYOUT_SET_ROWS 5 /* dst rows, rows rows */
#define GGML_PY_LAYOUT_CPY 0
#define GGML_PY_LAYOUT_CONT 0
#define GGML_PY_LAYOUT_CONCAT 0
#define GGML_PY_LAYOUT_REPEAT 1 /* a rows */
#define GGML_PY_LAYOUT_PAD 0
#define GGML_PY_LAYOUT_TOP_K 1 /* a rows */
#define GGML_PY_LAYOUT_GELU_ERF 1 /* a rows */
#define GGML_PY_LAYOUT_MUL_MAT_ID 5 /* as rows, b rows */
/* GGML_PY_SCHEMA_END */

/* ggml_py_tensor.flags */
#define GGML_PY_TENSOR_INPUT 1     /* written by the user before each compute */
#define GGML_PY_TENSOR_OUTPUT 2    /* read by the user after compute */
#define GGML_PY_TENSOR_PARAM 4     /* a weight: constant after the first upload */
#define GGML_PY_TENSOR_STATE 8     /* persistent (e.g. a KV cache) */
#define GGML_PY_TENSOR_SYMBOLIC 16 /* ne, nb or data depend on the symbols: see `sym` */

/* c + coef[0] * syms[sym[0]] + ... + coef[n_terms - 1] * syms[sym[n_terms - 1]] */
typedef struct ggml_py_affine {
    int64_t c;
    int32_t n_terms;
    int32_t sym[GGML_PY_MAX_TERMS]; /* indexes into the graph's symbols */
    int64_t coef[GGML_PY_MAX_TERMS];
} ggml_py_affine;

/* The layout of a SYMBOLIC tensor. */
typedef struct ggml_py_symbolic_layout {
    ggml_py_affine ne[GGML_PY_MAX_DIMS];
    ggml_py_affine nb[GGML_PY_MAX_DIMS];
    ggml_py_affine offset; /* bytes from base */
    void *base;            /* byte 0 of the buffer the tensor lives in */
} ggml_py_symbolic_layout;

/* One tensor as a kernel sees it. */
typedef struct ggml_py_tensor {
    int32_t type;                 /* enum ggml_py_type */
    int32_t flags;                /* GGML_PY_TENSOR_* */
    int64_t ne[GGML_PY_MAX_DIMS]; /* elements per dim, innermost first; unused dims are 1 */
    int64_t nb[GGML_PY_MAX_DIMS]; /* byte strides, innermost first (nb[0] = type or block size) */
    void *data;                   /* address of element 0; NULL in supports_op */
    const char *name;             /* the Python tensor's name (for messages) */
    uint64_t id;                  /* unique in the process for the tensor's memory (views share it); a weight
                                     (PARAM) keeps its id for life: a key for caches of converted weights */
    const ggml_py_symbolic_layout *sym; /* non-NULL exactly when flags has GGML_PY_TENSOR_SYMBOLIC */
} ggml_py_tensor;

/* 16 op parameter slots, read as int32 or float (the GGML_PY_P_* slots above). */
typedef union ggml_py_op_params {
    int32_t i[GGML_PY_MAX_OP_PARAMS];
    float f[GGML_PY_MAX_OP_PARAMS];
} ggml_py_op_params;

/* One node: dst = op(src...). View ops never reach a plugin: they are resolved into ne, nb and data. */
typedef struct ggml_py_node {
    int32_t op;                           /* enum ggml_py_op */
    int32_t n_src;                        /* 1 + index of the last non-NULL source */
    ggml_py_tensor *dst;
    ggml_py_tensor *src[GGML_PY_MAX_SRC]; /* NULL for absent (optional) sources */
    ggml_py_op_params params;
} ggml_py_node;

/* A block of host addresses: a buffer some tensor of the graph lives in. */
typedef struct ggml_py_range {
    void *base;
    uint64_t size;
} ggml_py_range;

/* A split of the graph, as lowered once; the same struct (same address) is passed to every compute of it. */
typedef struct ggml_py_graph {
    int32_t n_nodes;
    const ggml_py_node *const *nodes; /* in dependency order */
    int32_t n_syms;
    const int64_t *sym_max;           /* each symbol's upper bound (values lie in 1..sym_max) */
    const char *const *sym_names;
    int32_t n_ranges;
    const ggml_py_range *ranges;      /* every buffer a tensor of these nodes lives in */
} ggml_py_graph;

/* Filled by a failing call. */
typedef struct ggml_py_error {
    int32_t node;                    /* index of the failing node, or -1 */
    char message[GGML_PY_ERROR_MAX]; /* NUL-terminated, one line */
} ggml_py_error;

/* Returns nonzero to ask a running compute to stop. */
typedef int32_t (*ggml_py_abort_callback)(void *data);

/* What one compute gets besides the plan. */
typedef struct ggml_py_compute_args {
    const int64_t *syms;                   /* graph.n_syms values for this compute */
    ggml_py_abort_callback abort_callback; /* NULL, or poll it now and then between nodes (ggml_py's own backends:
                                              at most every 50 ms): nonzero = stop and return GGML_PY_ERR_ABORTED */
    void *abort_data;
    double *node_seconds;                  /* NULL, or graph.n_nodes accumulators: add each node's wall time (s) */
    ggml_py_error *err;                    /* fill it when returning an error */
} ggml_py_compute_args;

/* A block of memory of the plugin's buffer type. ggml_py owns the struct; alloc_buffer fills it. */
typedef struct ggml_py_buffer {
    void *base;    /* address of byte 0: a CPU address when is_host, else a device address used only in data */
    size_t size;   /* bytes (>= the size asked for) */
    void *context; /* plugin-private */
} ggml_py_buffer;

/* The buffer type: the memory the backend computes on. */
typedef struct ggml_py_buffer_type_i {
    const char *name;  /* unique buffer type name, e.g. "cexample" */
    size_t alignment;  /* of base and of every tensor offset; a power of two */
    size_t max_size;   /* largest buffer, 0 = no limit */
    int32_t is_host;   /* 1: base is CPU memory ggml_py (and numpy) may read and write directly */
    /* Required: allocate `size` zeroed bytes, base aligned to `alignment`. */
    int32_t (*alloc_buffer)(size_t size, ggml_py_buffer *buf);
    /* Optional (NULL = the bytes spanned by ne/nb): bytes a tensor needs, e.g. for padding. */
    size_t (*get_alloc_size)(const ggml_py_tensor *tensor);
} ggml_py_buffer_type_i;

/* Operations on a buffer. The copies are optional for host buffers (ggml_py then uses base directly). */
typedef struct ggml_py_buffer_i {
    void (*free_buffer)(ggml_py_buffer *buf); /* required */
    int32_t (*set_tensor)(ggml_py_buffer *buf, size_t offset, const void *src, size_t size);
    int32_t (*get_tensor)(ggml_py_buffer *buf, size_t offset, void *dst, size_t size);
    int32_t (*memset_tensor)(ggml_py_buffer *buf, size_t offset, uint8_t value, size_t size);
} ggml_py_buffer_i;

/* The backend. `backend` is the context init returned. */
typedef struct ggml_py_backend_i {
    /* Required; NULL = failure. options: "key=value" pairs separated by ';' (the Python create() options other
       than n_threads, e.g. "level=avx2"), "" when none; refuse an option you do not know by returning NULL. */
    void *(*init)(int32_t n_threads, const char *options);
    void (*free)(void *backend);                                     /* required */
    int32_t (*supports_op)(void *backend, const ggml_py_node *node); /* required; 1 = can compute it */
    /* Optional: prepare a split once; *plan is passed back to graph_compute. On failure fill *err. */
    int32_t (*graph_plan_create)(void *backend, const ggml_py_graph *graph, void **plan, ggml_py_error *err);
    void (*graph_plan_free)(void *backend, void *plan);              /* optional */
    /* Required: compute the graph's nodes in order. plan is NULL without graph_plan_create. */
    int32_t (*graph_compute)(void *backend, void *plan, const ggml_py_graph *graph, const ggml_py_compute_args *args);
    void (*set_n_threads)(void *backend, int32_t n_threads);         /* optional */
    void (*synchronize)(void *backend);                              /* optional */
} ggml_py_backend_i;

/* One device of a plugin that drives several (2.2). */
typedef struct ggml_py_device_desc {
    const char *name;        /* [a-z0-9_]+, unique within the plugin, e.g. "gpu0" */
    const char *description; /* one line */
    uint64_t memory_total;   /* bytes, 0 = unknown */
    uint64_t memory_free;
} ggml_py_device_desc;

/* What ggml_py_plugin_init returns: static data, valid while the library is loaded. */
typedef struct ggml_py_plugin {
    uint32_t abi_version;     /* GGML_PY_ABI_VERSION */
    uint32_t struct_size;     /* sizeof(ggml_py_plugin) as built: fields past it are absent */
    const char *name;         /* backend name: [a-z0-9_]+, e.g. "cexample" */
    const char *version;      /* the plugin's own version string */
    const char *description;  /* the device, one line */
    int32_t score;            /* 0 = cannot run on this machine (refused); higher = preferred */
    int32_t n_threads;        /* default thread count (0 = 1) */
    uint64_t memory_total;    /* bytes, 0 = unknown */
    uint64_t memory_free;
    ggml_py_buffer_type_i buffer_type;
    ggml_py_buffer_i buffer;
    ggml_py_backend_i backend;
    /* 2.1, optional (host buffer types only): describe `size` bytes of existing host memory at `ptr` (aligned to
       buffer_type.alignment) as a buffer without copying; free_buffer is called on it later and must not free ptr.
       ggml_py uses it for weights (e.g. mapped from a GGUF file) and keeps the memory alive meanwhile. */
    int32_t (*buffer_from_host_ptr)(void *ptr, size_t size, ggml_py_buffer *buf);
    /* 2.2, optional: the precision tier the plugin claims, GGML_PY_PRECISION_EXACT (0, also when absent: every
       kit threshold, 1e-10 for MUL_MAT/MUL_MAT_ID of F32/F16/BF16 weights) or GGML_PY_PRECISION_REDUCED (1: those
       products in F16/BF16/TF32, held to ggml's test-backend-ops bound 5e-4). */
    int32_t precision;
    /* 2.2, optional: copy `size` bytes from one buffer of this plugin to another (of any of its devices) without
       the host; ggml_py uses it for a split input that lives in another buffer of the same plugin (NULL: through
       host memory, get_tensor then set_tensor). Returns when the bytes are in place. */
    int32_t (*buffer_copy)(ggml_py_buffer *src, size_t src_offset, ggml_py_buffer *dst, size_t dst_offset,
                           size_t size);
    /* 2.2, optional, all or none: asynchronous execution ("Asynchronous execution" above). graph_compute_async
       takes what graph_compute takes (args->abort_callback is NULL) and returns once the work is enqueued (an
       error it can see at once: fill args->err and return it). set_tensor_async is set_tensor on `backend`'s queue:
       src stays valid and untouched until an event recorded after it is synchronized (reading a device's memory
       back is get_tensor, after an event). event_new returns
       NULL on failure. event_synchronize waits for the event; seconds (may be NULL) gets the CLOCK_MONOTONIC time
       (Python's time.monotonic()) at which the queue passed it, for profiles; it returns GGML_PY_OK, or the error
       of queued work before the event (described in err, node = its index in its graph, or -1), once. */
    int32_t (*graph_compute_async)(void *backend, void *plan, const ggml_py_graph *graph,
                                   const ggml_py_compute_args *args);
    int32_t (*set_tensor_async)(void *backend, ggml_py_buffer *buf, size_t offset, const void *src, size_t size);
    void *(*event_new)(void *backend);
    void (*event_free)(void *backend, void *event);
    int32_t (*event_record)(void *backend, void *event);
    int32_t (*event_synchronize)(void *backend, void *event, double *seconds, ggml_py_error *err);
    /* 2.2, optional: several devices (0 = the one device the fields above describe). Device i is a backend of
       its own, "<name>:<devices[i].name>" (name, description and memory from devices[i]), created with
       init_device(i, ...) instead of init; its memory is a buffer type of its own ("<buffer_type.name>:<device
       name>", the same alignment, max_size and is_host), allocated with alloc_buffer_device(i, ...) and freed,
       copied and read through buffer as above. */
    int32_t n_devices;
    const ggml_py_device_desc *devices;
    void *(*init_device)(int32_t device, int32_t n_threads, const char *options);
    int32_t (*alloc_buffer_device)(int32_t device, size_t size, ggml_py_buffer *buf);
    /* 2.2, optional: host CPU threads each backend context keeps busy while its queue runs (a device the CPU
       emulates or feeds); ggml_py takes them out of the thread budget of the host backends computing beside it. */
    int32_t host_threads;
} ggml_py_plugin;

/* The two symbols a plugin library exports. */
uint32_t ggml_py_plugin_abi_version(void);
const ggml_py_plugin *ggml_py_plugin_init(void);

/* GGML_PY_CDEF_END */

/* GGML_PY_OP_NAMES_BEGIN: generated by `python -m ggml_py.ir.schema header`, do not edit */
#define GGML_PY_OP_NAMES_INIT { \
    "NONE", "ADD", "SUB", "MUL", "DIV", "SCALE", "SQR", "SQRT", \
    "NEG", "ABS", "EXP", "LOG", "SILU", "GELU", "RELU", "TANH", \
    "SIGMOID", "CLAMP", "SWIGLU", "GEGLU", "NORM", "RMS_NORM", "SUM_ROWS", "MEAN", \
    "ARGMAX", "MUL_MAT", "SOFT_MAX", "DIAG_MASK_INF", "ROPE", "FLASH_ATTN_EXT", "GET_ROWS", "SET_ROWS", \
    "CPY", "CONT", "CONCAT", "REPEAT", "PAD", "TOP_K", "GELU_ERF", "MUL_MAT_ID" }
/* GGML_PY_OP_NAMES_END */

/* GGML_PY_OP_LISTS_BEGIN: generated by `python -m ggml_py.ir.schema header`, do not edit */
/* Op lists (X-macros): GGML_PY_OPS_<LIST>(X) expands to X(NAME) for every op of the list, in id order:
 *   #define CASE(NAME) case GGML_PY_OP_##NAME:
 *   switch (op) { GGML_PY_OPS_UNARY(CASE) return unary(op); ... }
 * COMPUTE: every op with an id. UNARY, BINARY, GLU: the schema's families (ops that share a builder and a
 * kernel). TRANSCENDENTAL: ops that evaluate exp, log, tanh, erf, sin or cos per element. */
#define GGML_PY_OPS_COMPUTE(X) \
    X(ADD) X(SUB) X(MUL) X(DIV) X(SCALE) X(SQR) X(SQRT) X(NEG) \
    X(ABS) X(EXP) X(LOG) X(SILU) X(GELU) X(RELU) X(TANH) X(SIGMOID) \
    X(CLAMP) X(SWIGLU) X(GEGLU) X(NORM) X(RMS_NORM) X(SUM_ROWS) X(MEAN) X(ARGMAX) \
    X(MUL_MAT) X(SOFT_MAX) X(DIAG_MASK_INF) X(ROPE) X(FLASH_ATTN_EXT) X(GET_ROWS) X(SET_ROWS) X(CPY) \
    X(CONT) X(CONCAT) X(REPEAT) X(PAD) X(TOP_K) X(GELU_ERF) X(MUL_MAT_ID)
#define GGML_PY_OPS_UNARY(X) \
    X(SQR) X(SQRT) X(NEG) X(ABS) X(EXP) X(LOG) X(SILU) X(GELU) \
    X(RELU) X(TANH) X(SIGMOID) X(GELU_ERF)
#define GGML_PY_OPS_BINARY(X) \
    X(ADD) X(SUB) X(MUL) X(DIV)
#define GGML_PY_OPS_GLU(X) \
    X(SWIGLU) X(GEGLU)
#define GGML_PY_OPS_TRANSCENDENTAL(X) \
    X(EXP) X(LOG) X(SILU) X(GELU) X(TANH) X(SIGMOID) X(SWIGLU) X(GEGLU) \
    X(SOFT_MAX) X(ROPE) X(GELU_ERF)
/* GGML_PY_OP_LISTS_END */

/* The value of an affine expression for the given symbol values. */
static inline int64_t ggml_py_affine_eval(const ggml_py_affine *a, const int64_t *syms) {
    int64_t v = a->c;
    for (int32_t k = 0; k < a->n_terms; ++k) {
        v += a->coef[k] * syms[a->sym[k]];
    }
    return v;
}

/* *out = *t with ne, nb and data bound to the symbol values (a plain copy when t is not symbolic). */
static inline void ggml_py_tensor_bind(const ggml_py_tensor *t, const int64_t *syms, ggml_py_tensor *out) {
    *out = *t;
    if (t->sym == NULL) {
        return;
    }
    for (int d = 0; d < GGML_PY_MAX_DIMS; ++d) {
        out->ne[d] = ggml_py_affine_eval(&t->sym->ne[d], syms);
        out->nb[d] = ggml_py_affine_eval(&t->sym->nb[d], syms);
    }
    out->data = (char *)t->sym->base + ggml_py_affine_eval(&t->sym->offset, syms);
    out->sym = NULL;
    out->flags &= ~GGML_PY_TENSOR_SYMBOLIC;
}

#ifdef __cplusplus
}
#endif

#endif /* GGML_PY_BACKEND_ABI_H */
