/*
 * devexample: the path a GPU backend takes, on a machine without a GPU (ggml_py backend ABI 2.2, C11 + pthreads).
 *
 * Its memory is device memory in every way that matters to ggml_py:
 *   - the host cannot read it: a buffer's base is a handle in a non-canonical address range (any dereference by
 *     ggml_py or numpy would fault), and its bytes are stored scrambled (XOR with a per-buffer key stream);
 *   - data moves only through the plugin: set_tensor / get_tensor / memset_tensor, buffer_copy between two of its
 *     buffers (also across its devices) without the host, and set_tensor_async on a backend's queue;
 *   - work is asynchronous: each backend context owns a worker thread running an in-order queue of computes,
 *     copies and events, as a GPU stream does; ggml_py enqueues and waits on events only where it needs a result;
 *   - it drives two devices, "d0" and "d1" (backends devexample:d0 and devexample:d1), each with its own memory.
 * It computes ADD and MUL of F32 tensors (ggml broadcasting, any strides): exact in IEEE arithmetic, so a model run
 * with it and simd gives the tokens of simd alone.
 *
 * Options (ggml-py --backend-opt devexample:KEY=VALUE): async=0 runs every enqueued item at once on the caller's
 * thread (for comparison); slow_copy_us=N makes each enqueued copy take at least N microseconds (a slow bus, to
 * make overlaps visible in a profile; the worker sleeps meanwhile, as a copy engine leaves the CPU alone).
 *
 * devexample_stat(k) counts what crossed the ABI: 0 set_tensor, 1 get_tensor, 2 buffer_copy, 3 set_tensor_async,
 * 4 queued computes, 5 direct computes, 6 live buffers, 7 events synchronized.
 *
 * Build:  cc -O2 -std=c11 -pthread -shared -fPIC -I"$(python -c 'import ggml_py; print(ggml_py.get_include())')" \
 *             -o libggml_py_devexample.so devexample.c
 */
#define _POSIX_C_SOURCE 200809L
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "ggml_py/backend_abi.h"

#define ALIGNMENT 64
#define N_DEVICES 2
#define N_STATS 8

static atomic_long stats[N_STATS];

GGML_PY_PLUGIN_EXPORT long devexample_stat(int k) { return k >= 0 && k < N_STATS ? atomic_load(&stats[k]) : -1; }

static double now_seconds(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts); /* the clock of Python's time.monotonic() */
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

/* ------------------------------------------------------------------------------------------------ device memory */

/* A buffer: `size` bytes stored scrambled in `store`, known to ggml_py only by the handle `base`. */
typedef struct devbuf {
    uintptr_t base;
    size_t size;
    uint8_t *store;
    uint8_t key;
    int device;
    struct devbuf *next;
} devbuf;

static pthread_mutex_t buffers_lock = PTHREAD_MUTEX_INITIALIZER;
static devbuf *buffers;
/* Handles live in a non-canonical x86-64 range: ggml_py may add offsets to them, never dereference them. */
static uintptr_t next_handle = (uintptr_t)0xdec0000000000000ull;
static uint8_t next_key = 0x5a;

static uint8_t mask(const devbuf *b, size_t offset) { return (uint8_t)(b->key ^ (offset * 167u) ^ (offset >> 7)); }

static void put_bytes(devbuf *b, size_t offset, const uint8_t *src, size_t size) {
    for (size_t i = 0; i < size; i++) {
        b->store[offset + i] = src[i] ^ mask(b, offset + i);
    }
}

static void get_bytes(const devbuf *b, size_t offset, uint8_t *dst, size_t size) {
    for (size_t i = 0; i < size; i++) {
        dst[i] = b->store[offset + i] ^ mask(b, offset + i);
    }
}

static int32_t alloc_on(int32_t device, size_t size, ggml_py_buffer *buf) {
    if (device < 0 || device >= N_DEVICES) {
        return GGML_PY_ERR_FAILED;
    }
    devbuf *b = calloc(1, sizeof(*b));
    uint8_t *store = malloc(size ? size : 1);
    if (b == NULL || store == NULL) {
        free(b);
        free(store);
        return GGML_PY_ERR_NO_MEMORY;
    }
    pthread_mutex_lock(&buffers_lock);
    b->base = next_handle;
    next_handle += (size + 2 * ALIGNMENT - 1) / ALIGNMENT * ALIGNMENT; /* a gap: no two buffers touch */
    b->key = next_key;
    next_key = (uint8_t)(next_key * 13 + 7);
    b->size = size;
    b->store = store;
    b->device = device;
    b->next = buffers;
    buffers = b;
    pthread_mutex_unlock(&buffers_lock);
    static const uint8_t zero[256];
    for (size_t off = 0; off < size; off += sizeof(zero)) { /* zeroed by contract (scrambled zeros) */
        put_bytes(b, off, zero, size - off < sizeof(zero) ? size - off : sizeof(zero));
    }
    buf->base = (void *)b->base;
    buf->size = size;
    buf->context = b;
    atomic_fetch_add(&stats[6], 1);
    return GGML_PY_OK;
}

static int32_t buffer_alloc(size_t size, ggml_py_buffer *buf) { return alloc_on(0, size, buf); }

static void buffer_free(ggml_py_buffer *buf) {
    devbuf *b = buf->context;
    pthread_mutex_lock(&buffers_lock);
    for (devbuf **p = &buffers; *p != NULL; p = &(*p)->next) {
        if (*p == b) {
            *p = b->next;
            break;
        }
    }
    pthread_mutex_unlock(&buffers_lock);
    free(b->store);
    free(b);
    atomic_fetch_sub(&stats[6], 1);
}

static int in_range(const ggml_py_buffer *buf, size_t offset, size_t size) {
    return offset <= buf->size && size <= buf->size - offset;
}

static int32_t buffer_set(ggml_py_buffer *buf, size_t offset, const void *src, size_t size) {
    if (!in_range(buf, offset, size)) return GGML_PY_ERR_FAILED;
    put_bytes(buf->context, offset, src, size);
    atomic_fetch_add(&stats[0], 1);
    return GGML_PY_OK;
}

static int32_t buffer_get(ggml_py_buffer *buf, size_t offset, void *dst, size_t size) {
    if (!in_range(buf, offset, size)) return GGML_PY_ERR_FAILED;
    get_bytes(buf->context, offset, dst, size);
    atomic_fetch_add(&stats[1], 1);
    return GGML_PY_OK;
}

static int32_t buffer_memset(ggml_py_buffer *buf, size_t offset, uint8_t value, size_t size) {
    if (!in_range(buf, offset, size)) return GGML_PY_ERR_FAILED;
    for (size_t i = 0; i < size; i++) {
        put_bytes(buf->context, offset + i, &value, 1);
    }
    return GGML_PY_OK;
}

/* Device to device (either device to either), never through ggml_py's memory. */
static int32_t buffer_copy(ggml_py_buffer *src, size_t src_offset, ggml_py_buffer *dst, size_t dst_offset,
                           size_t size) {
    if (!in_range(src, src_offset, size) || !in_range(dst, dst_offset, size)) return GGML_PY_ERR_FAILED;
    uint8_t chunk[4096];
    for (size_t done = 0; done < size; done += sizeof(chunk)) {
        size_t n = size - done < sizeof(chunk) ? size - done : sizeof(chunk);
        get_bytes(src->context, src_offset + done, chunk, n);
        put_bytes(dst->context, dst_offset + done, chunk, n);
    }
    atomic_fetch_add(&stats[2], 1);
    return GGML_PY_OK;
}

/* The buffer holding device address `addr`, or NULL (host memory, which these kernels cannot read). */
static devbuf *find(uintptr_t addr) {
    pthread_mutex_lock(&buffers_lock);
    devbuf *b = buffers;
    while (b != NULL && !(addr >= b->base && addr < b->base + b->size)) {
        b = b->next;
    }
    pthread_mutex_unlock(&buffers_lock);
    return b;
}

/* ------------------------------------------------------------------------------------------------ kernels */

/* A bound tensor as the kernels see it: its buffer and the offset of element 0. */
typedef struct {
    const ggml_py_tensor *t;
    devbuf *b;
    size_t off;
} view;

static int view_of(const ggml_py_tensor *t, view *v) {
    v->t = t;
    v->b = find((uintptr_t)t->data);
    v->off = v->b ? (size_t)((uintptr_t)t->data - v->b->base) : 0;
    return v->b != NULL;
}

static size_t offset_of(const view *v, int64_t i0, int64_t i1, int64_t i2, int64_t i3) {
    const ggml_py_tensor *t = v->t;
    return v->off + (size_t)(i0 * t->nb[0] + i1 * t->nb[1] + i2 * t->nb[2] + i3 * t->nb[3]);
}

static float load(const view *v, size_t offset) {
    float x;
    get_bytes(v->b, offset, (uint8_t *)&x, sizeof(x));
    return x;
}

static void store(const view *v, size_t offset, float x) { put_bytes(v->b, offset, (const uint8_t *)&x, sizeof(x)); }

/* dst = a op b, b tiled over a, as ggml_add / ggml_mul. */
static void binary_f32(int32_t op, const view *d, const view *a, const view *b) {
    const ggml_py_tensor *dt = d->t, *bt = b->t;
    for (int64_t i3 = 0; i3 < dt->ne[3]; i3++) {
        for (int64_t i2 = 0; i2 < dt->ne[2]; i2++) {
            for (int64_t i1 = 0; i1 < dt->ne[1]; i1++) {
                for (int64_t i0 = 0; i0 < dt->ne[0]; i0++) {
                    float x = load(a, offset_of(a, i0, i1, i2, i3));
                    float y = load(b, offset_of(b, i0 % bt->ne[0], i1 % bt->ne[1], i2 % bt->ne[2], i3 % bt->ne[3]));
                    store(d, offset_of(d, i0, i1, i2, i3), op == GGML_PY_OP_MUL ? x * y : x + y);
                }
            }
        }
    }
}

static int32_t supports_op(void *backend, const ggml_py_node *node) {
    (void)backend;
    if (node->op != GGML_PY_OP_ADD && node->op != GGML_PY_OP_MUL) return 0;
    return node->dst->type == GGML_PY_TYPE_F32 && node->src[0]->type == GGML_PY_TYPE_F32 &&
           node->src[1]->type == GGML_PY_TYPE_F32;
}

static int32_t run_graph(const ggml_py_graph *graph, const int64_t *syms, double *node_seconds, ggml_py_error *err,
                         ggml_py_abort_callback abort_callback, void *abort_data) {
    for (int32_t i = 0; i < graph->n_nodes; i++) {
        const ggml_py_node *in = graph->nodes[i];
        if (abort_callback != NULL && abort_callback(abort_data)) return GGML_PY_ERR_ABORTED;
        double t0 = node_seconds ? now_seconds() : 0.0;
        ggml_py_tensor dst, a, b;
        ggml_py_tensor_bind(in->dst, syms, &dst);
        ggml_py_tensor_bind(in->src[0], syms, &a);
        ggml_py_tensor_bind(in->src[1], syms, &b);
        view vd, va, vb;
        if (!supports_op(NULL, in) || !view_of(&dst, &vd) || !view_of(&a, &va) || !view_of(&b, &vb)) {
            err->node = i;
            snprintf(err->message, sizeof(err->message), "devexample: node %s: op %d or an operand not in device "
                     "memory", in->dst->name ? in->dst->name : "?", in->op);
            return GGML_PY_ERR_UNSUPPORTED;
        }
        binary_f32(in->op, &vd, &va, &vb);
        if (node_seconds) node_seconds[i] += now_seconds() - t0;
    }
    return GGML_PY_OK;
}

/* ------------------------------------------------------------------------------------------------ the queue */

enum { ITEM_COMPUTE, ITEM_COPY, ITEM_EVENT };

typedef struct event {
    int done;
    double seconds;
} event;

typedef struct item {
    int kind;
    const ggml_py_graph *graph; /* ITEM_COMPUTE */
    const ggml_py_compute_args *args;
    ggml_py_buffer *buf; /* ITEM_COPY: host bytes into device memory */
    size_t offset, size;
    const void *src;
    event *ev; /* ITEM_EVENT */
    struct item *next;
} item;

typedef struct {
    int device;
    int async;
    long slow_copy_us;
    pthread_t worker;
    pthread_mutex_t lock;
    pthread_cond_t changed;
    item *head, *tail;
    int stop;
    int32_t status; /* the first error of queued work, until an event_synchronize returns it */
    ggml_py_error err;
} backend_ctx;

static void run_item(backend_ctx *c, item *it) {
    if (it->kind == ITEM_COMPUTE) {
        ggml_py_error err = {-1, ""};
        int32_t rc = run_graph(it->graph, it->args->syms, it->args->node_seconds, &err, NULL, NULL);
        atomic_fetch_add(&stats[4], 1);
        pthread_mutex_lock(&c->lock);
        if (rc != GGML_PY_OK && c->status == GGML_PY_OK) {
            c->status = rc;
            c->err = err;
        }
        pthread_mutex_unlock(&c->lock);
    } else if (it->kind == ITEM_COPY) {
        double until = now_seconds() + 1e-6 * (double)c->slow_copy_us;
        put_bytes(it->buf->context, it->offset, it->src, it->size);
        double left = until - now_seconds();
        if (left > 0) { /* a slow bus: waiting, as a DMA engine would, leaves the CPU to the host */
            struct timespec ts = {(time_t)left, (long)((left - (double)(time_t)left) * 1e9)};
            nanosleep(&ts, NULL);
        }
    } else {
        pthread_mutex_lock(&c->lock);
        it->ev->seconds = now_seconds();
        it->ev->done = 1;
        pthread_cond_broadcast(&c->changed);
        pthread_mutex_unlock(&c->lock);
    }
}

static void *worker_main(void *arg) {
    backend_ctx *c = arg;
    pthread_mutex_lock(&c->lock);
    for (;;) {
        while (c->head == NULL && !c->stop) pthread_cond_wait(&c->changed, &c->lock);
        if (c->head == NULL) break;
        item *it = c->head; /* it stays at the head while it runs: "queue empty" means "all done" */
        pthread_mutex_unlock(&c->lock);
        run_item(c, it);
        pthread_mutex_lock(&c->lock);
        c->head = it->next;
        if (c->head == NULL) c->tail = NULL;
        free(it);
        pthread_cond_broadcast(&c->changed);
    }
    pthread_mutex_unlock(&c->lock);
    return NULL;
}

static int32_t enqueue(backend_ctx *c, item *it) {
    if (!c->async) { /* async=0: run it now */
        run_item(c, it);
        free(it);
        return GGML_PY_OK;
    }
    pthread_mutex_lock(&c->lock);
    if (c->tail) c->tail->next = it;
    else c->head = it;
    c->tail = it;
    pthread_cond_broadcast(&c->changed);
    pthread_mutex_unlock(&c->lock);
    return GGML_PY_OK;
}

static void drain(backend_ctx *c) {
    pthread_mutex_lock(&c->lock);
    while (c->head != NULL) pthread_cond_wait(&c->changed, &c->lock);
    pthread_mutex_unlock(&c->lock);
}

/* ------------------------------------------------------------------------------------------------ backend */

/* options: "key=value;..." with async=0|1 and slow_copy_us=N; anything else is refused. */
static void *init_device(int32_t device, int32_t n_threads, const char *options) {
    (void)n_threads; /* one worker thread per context, like one stream */
    if (device < 0 || device >= N_DEVICES) return NULL;
    backend_ctx *c = calloc(1, sizeof(*c));
    if (c == NULL) return NULL;
    c->device = device;
    c->async = 1;
    char opts[256];
    snprintf(opts, sizeof(opts), "%s", options ? options : "");
    char *save = NULL;
    for (char *kv = strtok_r(opts, ";", &save); kv != NULL; kv = strtok_r(NULL, ";", &save)) {
        char *eq = strchr(kv, '=');
        if (eq == NULL) goto refuse;
        *eq = '\0';
        char *end;
        long v = strtol(eq + 1, &end, 10);
        if (*end != '\0' || v < 0) goto refuse;
        if (strcmp(kv, "async") == 0 && v <= 1) c->async = (int)v;
        else if (strcmp(kv, "slow_copy_us") == 0) c->slow_copy_us = v;
        else goto refuse;
    }
    pthread_mutex_init(&c->lock, NULL);
    pthread_cond_init(&c->changed, NULL);
    if (pthread_create(&c->worker, NULL, worker_main, c) != 0) goto refuse;
    return c;
refuse:
    free(c);
    return NULL;
}

static void *backend_init(int32_t n_threads, const char *options) { return init_device(0, n_threads, options); }

static void backend_free(void *backend) {
    backend_ctx *c = backend;
    pthread_mutex_lock(&c->lock);
    c->stop = 1;
    pthread_cond_broadcast(&c->changed);
    pthread_mutex_unlock(&c->lock);
    pthread_join(c->worker, NULL);
    pthread_mutex_destroy(&c->lock);
    pthread_cond_destroy(&c->changed);
    free(c);
}

/* A direct compute waits for the queue first: it may read what queued work writes. */
static int32_t graph_compute(void *backend, void *plan, const ggml_py_graph *graph, const ggml_py_compute_args *a) {
    (void)plan;
    drain(backend);
    atomic_fetch_add(&stats[5], 1);
    return run_graph(graph, a->syms, a->node_seconds, a->err, a->abort_callback, a->abort_data);
}

static int32_t graph_compute_async(void *backend, void *plan, const ggml_py_graph *graph,
                                   const ggml_py_compute_args *args) {
    (void)plan;
    item *it = calloc(1, sizeof(*it));
    if (it == NULL) return GGML_PY_ERR_NO_MEMORY;
    it->kind = ITEM_COMPUTE;
    it->graph = graph;
    it->args = args;
    return enqueue(backend, it);
}

static int32_t set_tensor_async(void *backend, ggml_py_buffer *buf, size_t offset, const void *src, size_t size) {
    if (!in_range(buf, offset, size)) return GGML_PY_ERR_FAILED;
    item *it = calloc(1, sizeof(*it));
    if (it == NULL) return GGML_PY_ERR_NO_MEMORY;
    it->kind = ITEM_COPY;
    it->buf = buf;
    it->offset = offset;
    it->src = src;
    it->size = size;
    atomic_fetch_add(&stats[3], 1);
    return enqueue(backend, it);
}

static void *event_new(void *backend) {
    (void)backend;
    return calloc(1, sizeof(event));
}

static void event_free(void *backend, void *ev) {
    (void)backend;
    free(ev);
}

static int32_t event_record(void *backend, void *ev) {
    item *it = calloc(1, sizeof(*it));
    if (it == NULL) return GGML_PY_ERR_NO_MEMORY;
    ((event *)ev)->done = 0;
    it->kind = ITEM_EVENT;
    it->ev = ev;
    return enqueue(backend, it);
}

static int32_t event_synchronize(void *backend, void *evp, double *seconds, ggml_py_error *err) {
    backend_ctx *c = backend;
    event *ev = evp;
    pthread_mutex_lock(&c->lock);
    while (!ev->done) pthread_cond_wait(&c->changed, &c->lock);
    int32_t rc = c->status;
    if (rc != GGML_PY_OK) { /* reported once */
        *err = c->err;
        c->status = GGML_PY_OK;
    }
    pthread_mutex_unlock(&c->lock);
    if (seconds) *seconds = ev->seconds;
    atomic_fetch_add(&stats[7], 1);
    return rc;
}

static void synchronize(void *backend) { drain(backend); }

/* ------------------------------------------------------------------------------------------------ plugin */

static const ggml_py_device_desc devices[N_DEVICES] = {
    {"d0", "devexample device 0: scrambled memory behind handles, one queue per backend", 1ull << 32, 1ull << 32},
    {"d1", "devexample device 1: scrambled memory behind handles, one queue per backend", 1ull << 32, 1ull << 32},
};

static const ggml_py_plugin plugin = {
    .abi_version = GGML_PY_ABI_VERSION,
    .struct_size = sizeof(ggml_py_plugin),
    .name = "devexample",
    .version = "0.1.0",
    .description = "example device backend: memory the host cannot read, a queue per backend, two devices",
    .score = 1, /* never preferred by default: ask for it by name */
    .n_threads = 1,
    .buffer_type = {"devexample_mem", ALIGNMENT, 0, 0 /* not host memory */, buffer_alloc, NULL},
    .buffer = {buffer_free, buffer_set, buffer_get, buffer_memset},
    .backend = {backend_init, backend_free, supports_op, NULL, NULL, graph_compute, NULL, synchronize},
    .precision = GGML_PY_PRECISION_EXACT,
    .buffer_copy = buffer_copy,
    .graph_compute_async = graph_compute_async,
    .set_tensor_async = set_tensor_async,
    .event_new = event_new,
    .event_free = event_free,
    .event_record = event_record,
    .event_synchronize = event_synchronize,
    .n_devices = N_DEVICES,
    .devices = devices,
    .init_device = init_device,
    .alloc_buffer_device = alloc_on,
    .host_threads = 1, /* the queue's worker: a core the host backends beside it should leave free */
};

GGML_PY_PLUGIN_EXPORT uint32_t ggml_py_plugin_abi_version(void) { return GGML_PY_ABI_VERSION; }

GGML_PY_PLUGIN_EXPORT const ggml_py_plugin *ggml_py_plugin_init(void) { return &plugin; }
