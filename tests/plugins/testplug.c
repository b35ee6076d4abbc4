/*
 * A configurable native plugin for tests/test_native_plugin.py: computes ADD (F32, ggml broadcasting) and, by macro,
 * misbehaves in the ways a loader must catch.
 *
 *   -DPLUG_NAME='"name"'    backend name (default "testplug")
 *   -DPLUG_ABI=N            ABI version reported (default GGML_PY_ABI_VERSION)
 *   -DPLUG_SCORE=N          device score (default 3)
 *   -DPLUG_NON_HOST         a non-host buffer type (memory reached only through set/get/memset)
 *   -DPLUG_FAIL_COMPUTE     graph_compute fails on the first node with a message
 *   -DPLUG_NULL_COMPUTE     graph_compute is NULL
 *   -DPLUG_BAD_SIZE         struct_size is wrong
 *   -DPLUG_WRONG            ADD computes a - b (wrong results, for the conformance kit to catch)
 *   -DPLUG_SLOW=MS          every node spins MS milliseconds, polling the abort callback every millisecond
 *   -DPLUG_ABI_2_0          built as against ABI 2.0: minor 0, and the 2.1 fields outside its struct_size (they hold
 *                           garbage that the loader must never read)
 *   -DPLUG_ANY_OP           supports_op accepts every node (careless: only ggml_py keeps from it the nodes whose
 *                           parameters or sources its ABI version does not know)
 *
 * testplug_stat(k) returns counters: 0 plans created, 1 computes, 2 plans freed, 3 live buffers, 4 backends alive,
 * 5 host pointers wrapped, 6 computes aborted.
 */
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "ggml_py/backend_abi.h"

#ifndef PLUG_NAME
#define PLUG_NAME "testplug"
#endif
#ifndef PLUG_ABI
#ifdef PLUG_ABI_2_0
#define PLUG_ABI ((GGML_PY_ABI_MAJOR << 16) | 0)
#else
#define PLUG_ABI GGML_PY_ABI_VERSION
#endif
#endif
#ifndef PLUG_SCORE
#define PLUG_SCORE 3
#endif
#ifdef PLUG_WRONG
#define PLUG_SIGN -
#else
#define PLUG_SIGN +
#endif
#ifdef PLUG_NON_HOST
#define PLUG_IS_HOST 0
#else
#define PLUG_IS_HOST 1
#endif

static int32_t stats[7];
static const int32_t plan_magic = 0x5eed;

GGML_PY_PLUGIN_EXPORT int32_t testplug_stat(int32_t k) { return k >= 0 && k < 7 ? stats[k] : -1; }

static int32_t buf_alloc(size_t size, ggml_py_buffer *buf) {
    buf->base = calloc(1, size); /* malloc's alignment (16) is what this buffer type declares */
    if (!buf->base) return GGML_PY_ERR_NO_MEMORY;
    buf->size = size;
    buf->context = NULL;
    stats[3]++;
    return GGML_PY_OK;
}

static void buf_free(ggml_py_buffer *buf) {
    if (buf->context == &stats[5]) { /* wrapped host memory: not ours */
        stats[5]--;
        return;
    }
    free(buf->base);
    stats[3]--;
}

#ifndef PLUG_ABI_2_0
static int32_t buf_from_host(void *ptr, size_t size, ggml_py_buffer *buf) {
    buf->base = ptr;
    buf->size = size;
    buf->context = &stats[5];
    stats[5]++;
    return GGML_PY_OK;
}
#endif

#ifdef PLUG_NON_HOST
static int32_t buf_set(ggml_py_buffer *buf, size_t offset, const void *src, size_t size) {
    memcpy((char *)buf->base + offset, src, size);
    return GGML_PY_OK;
}

static int32_t buf_get(ggml_py_buffer *buf, size_t offset, void *dst, size_t size) {
    memcpy(dst, (const char *)buf->base + offset, size);
    return GGML_PY_OK;
}

static int32_t buf_memset(ggml_py_buffer *buf, size_t offset, uint8_t value, size_t size) {
    memset((char *)buf->base + offset, value, size);
    return GGML_PY_OK;
}

#endif

static int backend_token;

static void *be_init(int32_t n_threads, const char *options) {
    (void)n_threads;
    if (options && options[0]) return NULL;
    stats[4]++;
    return &backend_token;
}

static void be_free(void *backend) {
    (void)backend;
    stats[4]--;
}

static int32_t be_supports(void *backend, const ggml_py_node *node) {
    (void)backend;
#ifdef PLUG_ANY_OP
    return 1;
#endif
    return node->op == GGML_PY_OP_ADD && node->dst->type == GGML_PY_TYPE_F32 &&
           node->src[0]->type == GGML_PY_TYPE_F32 && node->src[1]->type == GGML_PY_TYPE_F32;
}

static int32_t be_plan_create(void *backend, const ggml_py_graph *graph, void **plan, ggml_py_error *err) {
    (void)backend;
    (void)graph;
    (void)err;
    *plan = (void *)&plan_magic;
    stats[0]++;
    return GGML_PY_OK;
}

static void be_plan_free(void *backend, void *plan) {
    (void)backend;
    if (plan == &plan_magic) stats[2]++;
}

#ifndef PLUG_NULL_COMPUTE
static float *at(const ggml_py_tensor *t, int64_t i0, int64_t i1, int64_t i2, int64_t i3) {
    return (float *)((char *)t->data + i0 * t->nb[0] + i1 * t->nb[1] + i2 * t->nb[2] + i3 * t->nb[3]);
}

static double now(void) {
    struct timespec ts;
    timespec_get(&ts, TIME_UTC);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

static int32_t be_compute(void *backend, void *plan, const ggml_py_graph *graph, const ggml_py_compute_args *args) {
    ggml_py_error *err = args->err;
    if (backend != &backend_token || plan != &plan_magic) {
        err->node = -1;
        snprintf(err->message, sizeof(err->message), "wrong backend context or plan handle");
        return GGML_PY_ERR_FAILED;
    }
    stats[1]++;
#ifdef PLUG_FAIL_COMPUTE
    err->node = 0;
    snprintf(err->message, sizeof(err->message), "injected failure in node %s", graph->nodes[0]->dst->name);
    return GGML_PY_ERR_FAILED;
#endif
    for (int32_t i = 0; i < graph->n_nodes; i++) {
        const double t0 = now();
#ifdef PLUG_SLOW
        while (now() - t0 < PLUG_SLOW * 1e-3) {
            if (args->abort_callback && args->abort_callback(args->abort_data)) {
                stats[6]++;
                return GGML_PY_ERR_ABORTED;
            }
            const double t1 = now();
            while (now() - t1 < 1e-3) {
            }
        }
#endif
        ggml_py_tensor dt, at_, bt;
        ggml_py_tensor_bind(graph->nodes[i]->dst, args->syms, &dt);
        ggml_py_tensor_bind(graph->nodes[i]->src[0], args->syms, &at_);
        ggml_py_tensor_bind(graph->nodes[i]->src[1], args->syms, &bt);
        const ggml_py_tensor *d = &dt, *a = &at_, *b = &bt;
        for (int64_t i3 = 0; i3 < d->ne[3]; i3++)
            for (int64_t i2 = 0; i2 < d->ne[2]; i2++)
                for (int64_t i1 = 0; i1 < d->ne[1]; i1++)
                    for (int64_t i0 = 0; i0 < d->ne[0]; i0++)
                        *at(d, i0, i1, i2, i3) = *at(a, i0, i1, i2, i3) PLUG_SIGN
                            *at(b, i0 % b->ne[0], i1 % b->ne[1], i2 % b->ne[2], i3 % b->ne[3]);
        if (args->node_seconds) args->node_seconds[i] += now() - t0;
    }
    return GGML_PY_OK;
}

#endif

static const ggml_py_plugin plugin = {
    PLUG_ABI,
#if defined(PLUG_BAD_SIZE)
    sizeof(ggml_py_plugin) + 8,
#elif defined(PLUG_ABI_2_0)
    offsetof(ggml_py_plugin, buffer_from_host_ptr), /* a 2.0 struct ends before the 2.1 fields */
#else
    sizeof(ggml_py_plugin),
#endif
    PLUG_NAME,
    "9.9",
    "test plugin",
    PLUG_SCORE,
    2,
    1024,
    512,
    {PLUG_NAME "_mem", 16, 0, PLUG_IS_HOST, buf_alloc, NULL},
#ifdef PLUG_NON_HOST
    {buf_free, buf_set, buf_get, buf_memset},
#else
    {buf_free, NULL, NULL, NULL},
#endif
#ifdef PLUG_NULL_COMPUTE
    {be_init, be_free, be_supports, be_plan_create, be_plan_free, NULL, NULL, NULL},
#else
    {be_init, be_free, be_supports, be_plan_create, be_plan_free, be_compute, NULL, NULL},
#endif
#ifdef PLUG_ABI_2_0
    (int32_t(*)(void *, size_t, ggml_py_buffer *))(uintptr_t)0x1, /* past struct_size: must not be called */
#else
    buf_from_host,
#endif
    .precision = GGML_PY_PRECISION_EXACT, /* designated: later fields stay zero without a warning */
};

GGML_PY_PLUGIN_EXPORT uint32_t ggml_py_plugin_abi_version(void) { return PLUG_ABI; }

GGML_PY_PLUGIN_EXPORT const ggml_py_plugin *ggml_py_plugin_init(void) { return &plugin; }
