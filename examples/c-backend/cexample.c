/*
 * cexample: a minimal ggml_py native backend in plain C11 (ABI 2.2; it uses nothing newer than 2.1).
 *
 * It computes ADD, MUL, RMS_NORM and MUL_MAT on F32 tensors of any layout (strides are honoured, ggml broadcasting
 * included)
 * and declines everything else, which the scheduler then gives to another backend (numpy). Its memory is ordinary
 * host memory, so numpy reads its buffers directly, and weights are used where they are (mapped from a GGUF file)
 * without a copy. Symbolic dimensions (a KV length that changes every step) are bound per compute.
 *
 * Build:  cc -O2 -std=c11 -shared -fPIC -I"$(python -c 'import ggml_py; print(ggml_py.get_include())')" \
 *             -o libggml_py_cexample.so cexample.c
 * Use:    GGML_PY_BACKEND_PATH=$PWD/libggml_py_cexample.so ggml-py backends
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "ggml_py/backend_abi.h"

#define ALIGNMENT 64

/* ---------------------------------------------------------------------------------------------------- buffers */

/* C11's aligned_alloc wants a size that is a multiple of the alignment. context != NULL marks memory we own. */
static int32_t buffer_alloc(size_t size, ggml_py_buffer *buf) {
    void *p = aligned_alloc(ALIGNMENT, (size + ALIGNMENT - 1) / ALIGNMENT * ALIGNMENT);
    if (p == NULL) {
        return GGML_PY_ERR_NO_MEMORY;
    }
    memset(p, 0, size);
    buf->base = p;
    buf->size = size;
    buf->context = p;
    return GGML_PY_OK;
}

/* Existing host memory (a weight) used where it is: nothing to allocate, nothing to free later. */
static int32_t buffer_from_host_ptr(void *ptr, size_t size, ggml_py_buffer *buf) {
    buf->base = ptr;
    buf->size = size;
    buf->context = NULL;
    return GGML_PY_OK;
}

static void buffer_free(ggml_py_buffer *buf) {
    free(buf->context);
    buf->context = NULL;
    buf->base = NULL;
}

/* ---------------------------------------------------------------------------------------------------- backend */

typedef struct {
    int32_t n_threads; /* kept for the interface; these kernels are single-threaded */
} cexample_backend;

static void *backend_init(int32_t n_threads, const char *options) {
    if (options != NULL && options[0] != '\0') {
        return NULL; /* this backend takes no options */
    }
    cexample_backend *b = calloc(1, sizeof(*b));
    if (b) {
        b->n_threads = n_threads > 0 ? n_threads : 1;
    }
    return b;
}

static void backend_free(void *backend) { free(backend); }

static void backend_set_n_threads(void *backend, int32_t n_threads) {
    ((cexample_backend *)backend)->n_threads = n_threads > 0 ? n_threads : 1;
}

static int is_f32(const ggml_py_tensor *t) { return t != NULL && t->type == GGML_PY_TYPE_F32; }

static int32_t backend_supports_op(void *backend, const ggml_py_node *node) {
    (void)backend;
    switch (node->op) {
    case GGML_PY_OP_ADD:
    case GGML_PY_OP_MUL:
    case GGML_PY_OP_MUL_MAT:
        return is_f32(node->dst) && is_f32(node->src[0]) && is_f32(node->src[1]);
    case GGML_PY_OP_RMS_NORM:
        return is_f32(node->dst) && is_f32(node->src[0]);
    default:
        return 0;
    }
}

/* Address of element (i0, i1, i2, i3) of t. */
static float *at(const ggml_py_tensor *t, int64_t i0, int64_t i1, int64_t i2, int64_t i3) {
    return (float *)((char *)t->data + i0 * t->nb[0] + i1 * t->nb[1] + i2 * t->nb[2] + i3 * t->nb[3]);
}

/* dst = a op b, b tiled over a (each ne of b divides the one of a), as ggml_add / ggml_mul. */
static void binary_f32(const ggml_py_node *node) {
    const ggml_py_tensor *d = node->dst, *a = node->src[0], *b = node->src[1];
    int mul = node->op == GGML_PY_OP_MUL;
    for (int64_t i3 = 0; i3 < d->ne[3]; i3++) {
        for (int64_t i2 = 0; i2 < d->ne[2]; i2++) {
            for (int64_t i1 = 0; i1 < d->ne[1]; i1++) {
                for (int64_t i0 = 0; i0 < d->ne[0]; i0++) {
                    float x = *at(a, i0, i1, i2, i3);
                    float y = *at(b, i0 % b->ne[0], i1 % b->ne[1], i2 % b->ne[2], i3 % b->ne[3]);
                    *at(d, i0, i1, i2, i3) = mul ? x * y : x + y;
                }
            }
        }
    }
}

/* dst = a / sqrt(mean(a^2) + eps) over each row (ne[0]), the sum in double, as ggml_rms_norm. */
static void rms_norm_f32(const ggml_py_node *node) {
    const ggml_py_tensor *d = node->dst, *a = node->src[0];
    const double eps = node->params.f[GGML_PY_P_RMS_NORM_EPS];
    for (int64_t i3 = 0; i3 < d->ne[3]; i3++) {
        for (int64_t i2 = 0; i2 < d->ne[2]; i2++) {
            for (int64_t i1 = 0; i1 < d->ne[1]; i1++) {
                double sum = 0.0;
                for (int64_t i0 = 0; i0 < d->ne[0]; i0++) {
                    const double x = *at(a, i0, i1, i2, i3);
                    sum += x * x;
                }
                const float scale = (float)(1.0 / sqrt(sum / (double)d->ne[0] + eps));
                for (int64_t i0 = 0; i0 < d->ne[0]; i0++) {
                    *at(d, i0, i1, i2, i3) = *at(a, i0, i1, i2, i3) * scale;
                }
            }
        }
    }
}

/* dst[n, m] = sum_k a[m, k] * b[n, k] per outer index, a's outer dims broadcast over b's, as ggml_mul_mat. */
static void mul_mat_f32(const ggml_py_node *node) {
    const ggml_py_tensor *d = node->dst, *a = node->src[0], *b = node->src[1];
    const int64_t K = a->ne[0], M = a->ne[1], N = b->ne[1];
    const int64_t r2 = b->ne[2] / a->ne[2], r3 = b->ne[3] / a->ne[3];
    for (int64_t i3 = 0; i3 < b->ne[3]; i3++) {
        for (int64_t i2 = 0; i2 < b->ne[2]; i2++) {
            for (int64_t n = 0; n < N; n++) {
                const char *brow = (const char *)at(b, 0, n, i2, i3);
                for (int64_t m = 0; m < M; m++) {
                    const char *arow = (const char *)at(a, 0, m, i2 / r2, i3 / r3);
                    float sum = 0.0f;
                    for (int64_t k = 0; k < K; k++) {
                        sum += *(const float *)(arow + k * a->nb[0]) * *(const float *)(brow + k * b->nb[0]);
                    }
                    *at(d, m, n, i2, i3) = sum;
                }
            }
        }
    }
}

/* Every node in order. Operands with symbolic dims are bound to this compute's symbol values first. */
static int32_t backend_graph_compute(void *backend, void *plan, const ggml_py_graph *graph,
                                     const ggml_py_compute_args *args) {
    (void)plan;
    for (int32_t i = 0; i < graph->n_nodes; i++) {
        const ggml_py_node *in = graph->nodes[i];
        if (!backend_supports_op(backend, in)) {
            args->err->node = i;
            snprintf(args->err->message, sizeof(args->err->message), "cexample cannot compute op %d on these types",
                     in->op);
            return GGML_PY_ERR_UNSUPPORTED;
        }
        if (args->abort_callback != NULL && args->abort_callback(args->abort_data)) {
            return GGML_PY_ERR_ABORTED; /* e.g. Ctrl-C: stop between nodes */
        }
        ggml_py_tensor dst, a, b;
        ggml_py_tensor_bind(in->dst, args->syms, &dst);
        ggml_py_tensor_bind(in->src[0], args->syms, &a);
        ggml_py_node node = *in;
        node.dst = &dst;
        node.src[0] = &a;
        if (in->src[1] != NULL) {
            ggml_py_tensor_bind(in->src[1], args->syms, &b);
            node.src[1] = &b;
        }
        if (node.op == GGML_PY_OP_MUL_MAT) {
            mul_mat_f32(&node);
        } else if (node.op == GGML_PY_OP_RMS_NORM) {
            rms_norm_f32(&node);
        } else {
            binary_f32(&node);
        }
    }
    return GGML_PY_OK;
}

/* ---------------------------------------------------------------------------------------------------- plugin */

/* Designated initializers: fields a later minor version appends stay zero (absent), without a warning. */
static const ggml_py_plugin plugin = {
    .abi_version = GGML_PY_ABI_VERSION,
    .struct_size = sizeof(ggml_py_plugin),
    .name = "cexample",
    .version = "0.1.0",
    .description = "example C backend: ADD, MUL, RMS_NORM, MUL_MAT (F32)",
    .score = 10,   /* usable everywhere */
    .n_threads = 1,
    /* memory_total, memory_free: 0 = unknown */
    .buffer_type = {"cexample", ALIGNMENT, 0, 1, buffer_alloc, NULL},
    .buffer = {buffer_free, NULL, NULL, NULL},
    .backend = {backend_init, backend_free, backend_supports_op, NULL, NULL, backend_graph_compute,
                backend_set_n_threads, NULL},
    .buffer_from_host_ptr = buffer_from_host_ptr, /* 2.1: weights without a copy */
    .precision = GGML_PY_PRECISION_EXACT,         /* 2.2: F32 products summed in F32: every kit threshold applies */
};

GGML_PY_PLUGIN_EXPORT uint32_t ggml_py_plugin_abi_version(void) { return GGML_PY_ABI_VERSION; }

GGML_PY_PLUGIN_EXPORT const ggml_py_plugin *ggml_py_plugin_init(void) { return &plugin; }
