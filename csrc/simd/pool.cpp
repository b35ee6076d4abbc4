// The thread pool: persistent workers that spin, then sleep, between the jobs a driver publishes (docs/simd.md,
// Threads). Its waits back off as runtime.h's Backoff says.
#include <pthread.h>
#include <sched.h>

#include <chrono>
#include <cstdlib>

#include "runtime.h"

namespace gp {

static void pool_after_fork_child() { ThreadPool::instance().after_fork_in_child(); }

ThreadPool& ThreadPool::instance() {
    static ThreadPool* pool = [] {
        ThreadPool* p = new ThreadPool();  // never destroyed: workers may outlive static destruction order
        pthread_atfork(nullptr, nullptr, pool_after_fork_child);
        return p;
    }();
    return *pool;
}

// A forked child has none of the parent's workers: forget them (without touching the std::thread objects) and
// start afresh.
void ThreadPool::after_fork_in_child() {
    threads_ = new std::vector<std::thread>();
    new (&run_mutex_) std::mutex();
    new (&m_) std::mutex();
    new (&cv_) std::condition_variable();
    gen_.store(0);
    done_.store(0);
    busy_.store(0);
    sleeping_.store(0);
    job_.store(nullptr);
}

ThreadPool::~ThreadPool() {
    stop_.store(true);
    {
        std::lock_guard<std::mutex> lk(m_);
        gen_.fetch_add(1);
    }
    cv_.notify_all();
    for (auto& t : *threads_) t.join();
}

void ThreadPool::ensure_workers(int n) {
    while ((int)threads_->size() < n) {
        const int index = (int)threads_->size() + 1;
        threads_->emplace_back([this, index] { worker(index); });
    }
}

static int64_t idle_spin_us() {
    static int64_t v = [] {
        const char* e = getenv("GGML_PY_SIMD_IDLE_US");
        return e ? (int64_t)atoll(e) : (int64_t)2000;
    }();
    return v;
}

void ThreadPool::worker(int index) {
    uint64_t seen = 0;
    for (;;) {
        // wait for a new generation: spin for a while, then sleep
        auto t0 = std::chrono::steady_clock::now();
        int spins = 0;
        while (gen_.load(std::memory_order_acquire) == seen) {
            cpu_relax();
            if (++spins % 1024 == 0) {
                const auto us = std::chrono::duration_cast<std::chrono::microseconds>(
                                    std::chrono::steady_clock::now() - t0).count();
                if (us > idle_spin_us()) {
                    std::unique_lock<std::mutex> lk(m_);
                    sleeping_.fetch_add(1);
                    cv_.wait(lk, [&] { return gen_.load() != seen; });
                    sleeping_.fetch_sub(1);
                    break;
                }
                if (spins % 16384 == 0) sched_yield();
            }
        }
        seen = gen_.load(std::memory_order_acquire);
        if (stop_.load()) return;
        busy_.fetch_add(1, std::memory_order_seq_cst);
        const bool classic = classic_.load(std::memory_order_seq_cst);
        Job* job = job_.load(std::memory_order_seq_cst);
        const int nth = nth_.load(std::memory_order_seq_cst);
        if (job && index < nth) job->run(index, nth);
        busy_.fetch_sub(1, std::memory_order_seq_cst);
        if (classic) done_.fetch_add(1, std::memory_order_acq_rel);
    }
}

void ThreadPool::wake(Job* job, int nth, bool classic) {
    ensure_workers(nth - 1);
    job_.store(job, std::memory_order_seq_cst);
    nth_.store(nth, std::memory_order_seq_cst);
    classic_.store(classic, std::memory_order_seq_cst);
    done_.store(0, std::memory_order_relaxed);
    gen_.fetch_add(1, std::memory_order_seq_cst);
    if (sleeping_.load(std::memory_order_seq_cst) > 0) {
        { std::lock_guard<std::mutex> lk(m_); }
        cv_.notify_all();
    }
}

void ThreadPool::run(Job* job, int nth) {
    if (nth <= 1) {
        job->run(0, 1);
        return;
    }
    std::lock_guard<std::mutex> guard(run_mutex_);
    // helpers of an earlier helper job may still be finishing: classic jobs count every worker
    Backoff bo;
    while (busy_.load(std::memory_order_seq_cst) > 0) bo.pause();
    wake(job, nth, true);
    const int nworkers = (int)threads_->size();
    job->run(0, nth);
    Backoff bo2;
    while (done_.load(std::memory_order_acquire) < nworkers) bo2.pause();
    job_.store(nullptr, std::memory_order_seq_cst);
}

void ThreadPool::start(Job* job, int nth) {
    if (nth <= 1) return;
    wake(job, nth, false);
}

void ThreadPool::quiesce(Job* job) {
    Job* expected = job;
    job_.compare_exchange_strong(expected, nullptr, std::memory_order_seq_cst);
    Backoff bo;
    while (busy_.load(std::memory_order_seq_cst) > 0) bo.pause();
}

}  // namespace gp
