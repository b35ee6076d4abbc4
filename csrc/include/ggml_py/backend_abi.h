/*
 * ggml_py native backend ABI, version 1.
 *
 * A native backend is a shared library (.so / .dylib / .dll) that exports two plain C functions:
 *
 *     uint32_t              ggml_py_plugin_abi_version(void);   returns GGML_PY_ABI_VERSION it was built with
 *     const ggml_py_plugin *ggml_py_plugin_init(void);          returns a static description of the backend
 *
 * ggml_py (ggml_py/native.py) opens the library with cffi, checks the ABI version *before* calling init (so struct
 * layouts of another version are never read), checks the plugin's struct_size and required function pointers, and
 * wraps it as an ordinary ggml_py Backend. A plugin with score 0 is refused ("cannot run on this machine").
 *
 * Conventions (they are ggml's):
 *   - type ids are ggml's (GGML_TYPE_F32 = 0, F16 = 1, Q4_0 = 2, ...), see enum ggml_py_type;
 *   - ne[4] / nb[4] are innermost first: ne[0] is the contiguous row length, nb[0] the element (or block) size in
 *     bytes, nb[1] the row stride in bytes, ...; unused outer dims have ne = 1. Shapes on the Python side are in
 *     numpy order, so ne is the Python shape reversed (and padded with 1s);
 *   - op codes carry ggml's op names, flattened: ggml's UNARY and GLU sub-ops (SILU, GELU, SWIGLU, ...) have codes of
 *     their own. The numbers are ggml_py's (ggml renumbers between releases): they only ever get appended to;
 *   - op params are ggml-style: 16 32-bit slots, read as int32 (params.i) or float (params.f); the layout per op is
 *     listed at enum ggml_py_op.
 *
 * Life cycle:
 *   init()                        once per ggml_py Backend object; returns the plugin's backend context
 *   supports_op(ctx, node)        while scheduling; node tensors have data == NULL and every symbolic dim at its
 *                                 upper bound (flag GGML_PY_TENSOR_SYMBOLIC); return 1 to accept the node
 *   buffer_type.alloc_buffer      planned memory: weights, states, one compute buffer per plan
 *   graph_plan_create(ctx, ...)   once per split (optional); the node array stays at the same address until
 *                                 graph_plan_free, and only the fields of SYMBOLIC tensors (ne, nb, data) change
 *   graph_compute(ctx, plan, ...) every step; nodes are in dependency order; return GGML_PY_OK or fill *err
 *   graph_plan_free, free         when the plan / backend object goes away
 *
 * Every call comes from one thread at a time per backend context (ggml_py serialises a plan's computes); the GIL
 * is released during the calls. Plain C99; the region between the CDEF markers is also what cffi parses, so it may
 * hold only declarations and integer #defines (no other preprocessor lines).
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

#define GGML_PY_ABI_VERSION 1
#define GGML_PY_MAX_DIMS 4
#define GGML_PY_MAX_SRC 4
#define GGML_PY_MAX_OP_PARAMS 16
#define GGML_PY_ERROR_MAX 256

/* Status codes returned by the plugin's functions. */
enum ggml_py_status {
    GGML_PY_OK = 0,
    GGML_PY_ERR_FAILED = 1,      /* generic failure; say why in ggml_py_error.message */
    GGML_PY_ERR_UNSUPPORTED = 2, /* an op / type / layout the plugin cannot compute */
    GGML_PY_ERR_NO_MEMORY = 3    /* an allocation failed */
};

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

/*
 * Op codes. Sources are src[0], src[1], ... in the order of the Python op's arguments; an absent optional source
 * is NULL. Op params per op (i = params.i, f = params.f; unlisted slots are 0):
 *   SCALE            f[0] = s, f[1] = b                      dst = src0 * s + b
 *   CLAMP            f[0] = min, f[1] = max
 *   NORM, RMS_NORM   f[0] = eps                              over ne[0]
 *   SOFT_MAX         f[0] = scale, f[1] = max_bias           src1 = mask (F32/F16) or NULL
 *   DIAG_MASK_INF    i[0] = n_past
 *   ROPE             i[1] = n_dims, i[2] = mode (0 normal, 2 neox), f[5] = freq_base, f[6] = freq_scale
 *                                                            src1 = positions (I32)
 *   FLASH_ATTN_EXT   f[0] = scale, f[1] = max_bias, f[2] = softcap; src = q, k, v, mask (or NULL)
 *   CONCAT           i[0] = dim (ggml order: 0 = innermost)
 *   PAD              i[2*d] = 0 (left), i[2*d+1] = padding at the end of dim d (ggml order), as ggml_pad_ext
 *   SWIGLU, GEGLU    src1 = the value operand, or NULL: then the first half of src0's rows gates the second half
 *   MUL_MAT          src0 (M rows of K) x src1 (N rows of K) -> dst (N rows of M), as ggml; outer dims broadcast
 *   ADD, SUB, MUL, DIV  src1 is tiled over src0 (each ne of src1 divides the one of src0), as ggml
 *   SET_ROWS         dst aliases src0; src1 = rows (F32), src2 = row indices (I32/I64)
 *   CPY              dst aliases src1 (the destination); src0 = the values
 * View ops (VIEW, RESHAPE, PERMUTE, TRANSPOSE) never reach a plugin: they are resolved into ne/nb/data.
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
    GGML_PY_OP_COUNT = 37
};

/* ggml_py_tensor.flags */
#define GGML_PY_TENSOR_INPUT 1     /* written by the user before each compute */
#define GGML_PY_TENSOR_OUTPUT 2    /* read by the user after compute */
#define GGML_PY_TENSOR_PARAM 4     /* a weight: constant after the first upload */
#define GGML_PY_TENSOR_STATE 8     /* persistent (e.g. a KV cache) */
#define GGML_PY_TENSOR_SYMBOLIC 16 /* ne, nb or data may change between computes (a symbolic dimension) */

/* One tensor as a kernel sees it. */
typedef struct ggml_py_tensor {
    int32_t type;                 /* enum ggml_py_type */
    int32_t flags;                /* GGML_PY_TENSOR_* */
    int64_t ne[GGML_PY_MAX_DIMS]; /* elements per dim, innermost first; unused dims are 1 */
    size_t nb[GGML_PY_MAX_DIMS];  /* byte strides, innermost first (nb[0] = type or block size) */
    void *data;                   /* address of element 0 (buffer base + offset); NULL in supports_op */
    const char *name;             /* the Python tensor's name (for messages) */
} ggml_py_tensor;

/* 16 ggml-style op param slots, read as int32 or float. */
typedef union ggml_py_op_params {
    int32_t i[GGML_PY_MAX_OP_PARAMS];
    float f[GGML_PY_MAX_OP_PARAMS];
} ggml_py_op_params;

/* One node of a split: dst = op(src...). */
typedef struct ggml_py_node {
    int32_t op;                           /* enum ggml_py_op */
    int32_t n_src;                        /* 1 + index of the last non-NULL source */
    ggml_py_tensor *dst;
    ggml_py_tensor *src[GGML_PY_MAX_SRC]; /* NULL for absent (optional) sources */
    ggml_py_op_params params;
} ggml_py_node;

/* Filled by a failing graph_compute. */
typedef struct ggml_py_error {
    int32_t node;                     /* index of the failing node in the array, or -1 */
    char message[GGML_PY_ERROR_MAX];  /* NUL-terminated, one line */
} ggml_py_error;

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
    void *(*init)(int32_t n_threads);                              /* required; NULL = failure */
    void (*free)(void *backend);                                   /* required */
    int32_t (*supports_op)(void *backend, const ggml_py_node *node); /* required; 1 = can compute it */
    /* Optional: prepare a split once (e.g. pick kernels); *plan is passed back to graph_compute. */
    int32_t (*graph_plan_create)(void *backend, const ggml_py_node *nodes, int32_t n_nodes, void **plan);
    void (*graph_plan_free)(void *backend, void *plan);            /* optional */
    /* Required: compute the nodes in order. plan is NULL without graph_plan_create. */
    int32_t (*graph_compute)(void *backend, void *plan, const ggml_py_node *nodes, int32_t n_nodes,
                             ggml_py_error *err);
    void (*set_n_threads)(void *backend, int32_t n_threads);       /* optional */
    void (*synchronize)(void *backend);                            /* optional */
} ggml_py_backend_i;

/* What ggml_py_plugin_init returns: static data, valid while the library is loaded. */
typedef struct ggml_py_plugin {
    uint32_t abi_version;     /* GGML_PY_ABI_VERSION */
    uint32_t struct_size;     /* sizeof(ggml_py_plugin), a layout check */
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
} ggml_py_plugin;

/* The two symbols a plugin library exports. */
uint32_t ggml_py_plugin_abi_version(void);
const ggml_py_plugin *ggml_py_plugin_init(void);

/* GGML_PY_CDEF_END */

#ifdef __cplusplus
}
#endif

#endif /* GGML_PY_BACKEND_ABI_H */
