// ISA-neutral runtime: CPU features and level dispatch (cpu.cpp), the thread pool (pool.cpp), node validation
// (validate.cpp) and the plan executor (plan.cpp).
#pragma once

#include <sched.h>

#include <atomic>
#include <chrono>
#include <cstdlib>
#include <condition_variable>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "common.h"

namespace gp {

// ---------------------------------------------------------------------------------------------------------------
// CPU features and levels

struct CpuFeatures {
    bool sse2 = false, ssse3 = false, sse41 = false, avx = false, avx2 = false, fma = false, f16c = false;
    bool bmi2 = false, avx512f = false, avx512bw = false, avx512vl = false, avx512dq = false, avx512cd = false;
    bool avx512vnni = false, avx512bf16 = false, avxvnni = false;
    bool os_avx = false, os_avx512 = false;
    std::string vendor, brand;
};
const CpuFeatures& cpu_features();

enum Level { LEVEL_SCALAR = 0, LEVEL_AVX2 = 1, LEVEL_AVX512 = 2, LEVEL_COUNT = 3 };
const char* level_name(int level);
int level_from_name(const std::string& name);  // -1 if unknown
bool level_supported(int level, std::string* missing = nullptr);
int best_level();
int current_level();
void set_current_level(int level);  // throws std::invalid_argument if unsupported
const KernelTable* level_table(int level);

int physical_cores();

// ---------------------------------------------------------------------------------------------------------------
// thread pool (pool.cpp)

inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#else
    std::this_thread::yield();
#endif
}

inline int spin_before_yield() {
    static int v = [] {
        const char* e = getenv("GGML_PY_SIMD_SPIN");
        return e ? atoi(e) : 2000;
    }();
    return v;
}

// spin with pause, then yield the CPU (a descheduled partner must get to run): the pool's and the plan's waits
struct Backoff {
    int spins = 0;
    void pause() {
        if (++spins < spin_before_yield()) cpu_relax();
        else sched_yield();
    }
};

struct Job {
    // Classic jobs (ThreadPool::run): every thread calls run(ith, nth) once and the caller waits for all.
    // Helper jobs (ThreadPool::start): workers call run(ith, nth) to help; the caller drives the job itself and
    // does not wait for the workers, who leave on their own (see Plan).
    virtual void run(int ith, int nth) = 0;
    virtual ~Job() = default;
};

class ThreadPool {
   public:
    static ThreadPool& instance();
    // Classic fork-join: runs job->run(ith, nth) on nth threads (the caller is thread 0), returns when all are done.
    void run(Job* job, int nth);
    // Helper mode: wakes nth-1 workers into job->run(i, nth) and returns at once; the caller must hold the lock
    // returned by lock() for as long as it drives the job.
    void start(Job* job, int nth);
    std::unique_lock<std::mutex> lock() { return std::unique_lock<std::mutex>(run_mutex_); }
    // Waits until no worker is inside `job` (before a job object is destroyed).
    void quiesce(Job* job);
    void after_fork_in_child();
    ~ThreadPool();

   private:
    ThreadPool() = default;
    void ensure_workers(int n);
    void worker(int index);
    void wake(Job* job, int nth, bool classic);

    std::mutex run_mutex_;  // one driver at a time
    std::vector<std::thread>* threads_ = new std::vector<std::thread>();  // leaked on fork (see after_fork)
    std::mutex m_;
    std::condition_variable cv_;
    alignas(64) std::atomic<uint64_t> gen_{0};
    alignas(64) std::atomic<int> done_{0};
    alignas(64) std::atomic<int> busy_{0};  // workers that may hold a job pointer
    std::atomic<int> sleeping_{0};
    std::atomic<bool> stop_{false};
    std::atomic<Job*> job_{nullptr};
    std::atomic<int> nth_{1};
    std::atomic<bool> classic_{true};
};

// ---------------------------------------------------------------------------------------------------------------
// plan (plan.cpp)

enum { MAX_TERMS = 4 };

struct Affine {
    int64_t c0 = 0;
    int n = 0;
    int sym[MAX_TERMS] = {0};
    int64_t coef[MAX_TERMS] = {0};
    bool symbolic() const { return n > 0; }
    int64_t eval(const int64_t* s) const {
        int64_t v = c0;
        for (int i = 0; i < n; ++i) v += coef[i] * s[sym[i]];
        return v;
    }
};

struct TensorDesc {
    int32_t type = -1;
    Affine ne[4], nb[4], offset;
    uint64_t base = 0;
    int64_t const_id = 0;  // != 0: constant data (a weight) with this unique id; may be repacked once
    bool present = false;
};

// A weight repacked for the GEMV kernels, shared by every plan that uses that weight; its bytes are in a repack
// arena (repack.cpp), which lives as long as a weight in it does.
struct RepackBuf {
    uint8_t* data = nullptr;
    size_t size = 0;
    std::shared_ptr<void> arena;
    ~RepackBuf();  // its whole pages given back (the arena may live on for other weights)
};
std::shared_ptr<RepackBuf> get_repacked(int64_t const_id, const Tensor& w, int n_threads = 1);
// The repacked copy of that weight if a plan made one (and it lives), else null; never repacks.
std::shared_ptr<RepackBuf> find_repacked(int64_t const_id, const Tensor& w);

struct NodeDesc {
    int32_t op = 0;
    TensorDesc dst;
    TensorDesc src[MAX_SRC];
    ggml_py_op_params params = {};
};

struct Range {
    uint64_t base, size;
};

class PlanError : public std::runtime_error {
   public:
    using std::runtime_error::runtime_error;
};

// Thrown by Plan::compute when its interrupt poll asked it to stop; the nodes after that point did not run.
class Interrupted : public std::exception {
   public:
    const char* what() const noexcept override { return "compute interrupted"; }
};

// The abort callback of a compute (ggml_py_compute_args): called by the computing thread between nodes, at most
// every INTERRUPT_POLL_MS; nonzero stops the compute.
struct AbortPoll {
    ggml_py_abort_callback fn = nullptr;
    void* data = nullptr;
};
enum { INTERRUPT_POLL_MS = 50 };

class Plan : public Job {
   public:
    Plan(const std::vector<NodeDesc>& nodes, const std::vector<Range>& ranges, const std::vector<int64_t>& sym_max,
         int n_threads, int level, bool validate_only = false);
    // Binds the symbols, validates what depends on them, runs every node; throws PlanError, or Interrupted when
    // the abort poll asked to stop. node_seconds: null, or n_nodes() accumulators of per-node wall time (thread 0,
    // including the wait for the node's other units).
    void compute(const int64_t* syms, size_t n_syms, AbortPoll poll = {}, double* node_seconds = nullptr);
    void run(int ith, int nth) override;  // a worker helping with the current compute
    ~Plan() override;

    int n_threads() const { return n_threads_; }
    void set_n_threads(int n);
    bool force_parallel() const { return force_parallel_; }
    void set_force_parallel(bool v);
    size_t n_nodes() const { return nodes_.size(); }
    size_t n_tasks() const { return tasks_.size(); }
    // matrix-vector products computed in an earlier product's task (see group_gemvs)
    size_t grouped_products() const {
        size_t c = 0;
        for (const Node& n : nodes_) c += n.grouped;
        return c;
    }
    // GET_ROWS nodes that read a repacked copy (a tied embedding's)
    size_t get_rows_from_repack() const {
        size_t c = 0;
        for (const Node& n : nodes_) c += n.op == GGML_PY_OP_GET_ROWS && n.repack;
        return c;
    }
    size_t shared_scratch() const { return wsize_; }
    size_t thread_scratch() const { return tsize_; }
    int level() const { return level_; }
    const std::vector<int64_t>& sym_max() const { return sym_max_; }

   private:
    struct Patch {
        int64_t* target;
        Affine expr;
    };
    struct AddrPatch {
        uint8_t** target;
        uint64_t base;
        Affine off;
    };
    struct Task {
        KernelFn fn;
        Node* node;
        int phase;
    };
    // per task, shared with workers (atomics: a worker of an earlier compute may still look at them)
    struct alignas(64) TaskState {
        std::atomic<uint64_t> claim{0};  // (generation << 32) | next unit
        std::atomic<uint32_t> done{0};   // units finished in this generation
        std::atomic<uint32_t> units{1};  // the kernel is called as (unit, units) for every unit
        std::atomic<bool> single{true};  // small: one unit, left to the driving thread
    };
    bool run_unit(size_t t, uint64_t gen, const ExecCtx& ctx);
    void drive(uint64_t gen, int nth);
    void schedule_tasks();
    void group_gemvs(const std::vector<bool>& node_symbolic);

    void bind(const int64_t* s);
    std::string check_node(const Node& n, size_t index, bool check_scratch) const;
    void alloc_scratch();

    std::vector<Node> nodes_;
    std::unique_ptr<std::atomic<int64_t>[]> counters_;
    std::vector<Patch> patches_;
    std::vector<AddrPatch> addr_patches_;
    std::vector<size_t> symbolic_nodes_;
    std::vector<Range> ranges_;
    std::vector<int64_t> sym_max_;
    std::vector<Task> tasks_;
    std::vector<std::shared_ptr<RepackBuf>> repacks_;
    bool all_single_ = false;
    bool force_parallel_ = false;
    double* node_seconds_ = nullptr;  // of the compute under way (null: not profiling)
    const KernelTable* kt_;
    int level_;
    int n_threads_;
    size_t wsize_ = 0, tsize_ = 0;
    struct Free {
        void operator()(uint8_t* p) const;
    };
    std::unique_ptr<uint8_t, Free> wdata_, tdata_;
    size_t tdata_threads_ = 0;
    ExecCtx ctx_;
    std::atomic<int> error_{0};
    char errmsg_[ERRMSG_LEN];
    AbortPoll poll_;
    std::chrono::steady_clock::time_point last_poll_;
    bool interrupted_ = false;
    void maybe_poll(size_t task, uint32_t units);
    std::unique_ptr<TaskState[]> tstate_;
    std::vector<ExecCtx> tctx_;  // per thread
    alignas(64) std::atomic<uint64_t> cur_{0};  // (generation << 32) | the last task published (or the end)
    uint64_t gen_ = 0;
    int run_nth_ = 1;
    std::mutex mutex_;
};

// work estimate of a node (element-operations); nodes below a threshold run on one thread
bool node_is_small(const Node& n);
// scratch and phases of a node (also used by validation)
Scratch node_scratch(const Node& n);
int node_phases(const Node& n, bool n_rows_symbolic);

// validation (validate.cpp): op-specific checks; returns "" if fine, else a message naming the op
std::string validate_node(const Node& n);
// "[ne0,ne1,ne2,ne3]" for messages
std::string shape_str(const Tensor& t);

// bytes spanned by a tensor (0 if empty, -1 if absurdly large)
inline int64_t tensor_extent(const Tensor& t) {
    for (int i = 0; i < 4; ++i)
        if (t.ne[i] == 0) return 0;
    __int128 e;
    if (type_is_quant(t.type)) e = row_bytes(t.type, t.ne[0]);
    else e = (__int128)(t.ne[0] - 1) * t.nb[0] + type_size(t.type);
    for (int i = 1; i < 4; ++i) e += (__int128)(t.ne[i] - 1) * t.nb[i];
    if (e > ((__int128)1 << 62)) return -1;
    return (int64_t)e;
}

// 64-byte aligned and zeroed (from 1 MiB mmap'd, from 2 MiB on huge pages)
uint8_t* aligned_alloc_bytes(size_t size, bool* mmapped);
void aligned_free_bytes(uint8_t* p, size_t size, bool mmapped);

}  // namespace gp
