// The OpenMP thread count and index, or one thread when keel is built without OpenMP (the fuzz
// build): kernels that split a workspace per thread ask here instead of calling omp_* directly.
//
// Parallel loops go through for_each_task (dynamic schedule) or parallel_for (static chunks)
// rather than `#pragma omp parallel ... if (cond)`: with a false condition libgomp still creates
// (and frees) a one-thread team on every call, as only teams of two or more threads are cached,
// so every kernel call below its parallel threshold would allocate inside the step loop. These
// helpers branch instead: below the threshold, on a one-thread runtime or inside another parallel
// region (where OpenMP would serialise anyway) the loop runs on the calling thread with no region.
#pragma once
#include <algorithm>
#include <atomic>
#include <cstdint>
#include <exception>
#include <mutex>
#ifdef _OPENMP
#include <omp.h>
#endif

namespace keel {

inline int max_threads() {
#ifdef _OPENMP
  return omp_get_max_threads();
#else
  return 1;
#endif
}

inline int thread_index() {
#ifdef _OPENMP
  return omp_get_thread_num();
#else
  return 0;
#endif
}

// Whether the caller runs inside an OpenMP parallel region (one of its team's threads).
inline bool in_parallel_region() {
#ifdef _OPENMP
  return omp_in_parallel() != 0;
#else
  return false;
#endif
}

// True when a parallel region opened here would have more than one thread: `wanted` (the
// caller's threshold), more than one OpenMP thread, and not already inside a parallel region
// (nested regions run on one thread, in a team libgomp allocates each time).
inline bool forks(bool wanted) {
#ifdef _OPENMP
  return wanted && omp_get_max_threads() > 1 && !omp_in_parallel();
#else
  (void)wanted;
  return false;
#endif
}

// Runs f(task, thread) for every task in [0, tasks): on all OpenMP threads when `parallel` (see
// forks), else inline on thread 0. Scheduling is dynamic, one task at a time, except that thread
// t of the team starts with task t: every thread then runs at least one task per call (when
// tasks >= threads), so per-thread state a task builds on first use (oneDNN GEMM plans) is built
// in the first call rather than in whichever later call a late thread first gets work. The first
// exception a task throws is rethrown here once the loop has ended, and the tasks not yet started
// are skipped: an exception escaping an OpenMP region would terminate the process.
template <typename F>
void for_each_task(int64_t tasks, bool parallel, F&& f) {
  if (!forks(parallel && tasks > 1)) {
    for (int64_t t = 0; t < tasks; ++t) f(t, 0);
    return;
  }
#ifdef _OPENMP
  std::exception_ptr error;
  std::atomic<bool> failed{false};
  std::atomic<int64_t> claimed{0};  // tasks from `threads` on, handed out in order
  std::mutex mutex;
#pragma omp parallel
  {
    const int64_t threads = omp_get_num_threads();
    const int thread = omp_get_thread_num();
    for (int64_t t = thread; t < tasks && !failed.load(std::memory_order_relaxed);
         t = threads + claimed.fetch_add(1, std::memory_order_relaxed)) {
      try {
        f(t, thread);
      } catch (...) {
        std::lock_guard<std::mutex> lock(mutex);
        if (!error) error = std::current_exception();
        failed.store(true, std::memory_order_relaxed);
      }
    }
  }
  if (error) std::rethrow_exception(error);
#endif
}

// Runs f(begin, end) over [0, n) split into one contiguous chunk per OpenMP thread when
// `parallel` (see forks), as `#pragma omp parallel for schedule(static)` splits it: thread t of
// T gets n/T elements, plus one for the first n%T threads. Otherwise one call f(0, n) on the
// calling thread. For loops whose every element (or every reduction) is computed the same way
// whatever the partition; f should not throw (an exception escaping a chunk is rethrown here).
template <typename F>
void parallel_for(int64_t n, bool parallel, F&& f) {
  if (n <= 0) return;
  if (!forks(parallel && n > 1)) {
    f(int64_t(0), n);
    return;
  }
#ifdef _OPENMP
  std::exception_ptr error;
  std::mutex mutex;
#pragma omp parallel
  {
    const int64_t threads = omp_get_num_threads(), t = omp_get_thread_num();
    const int64_t chunk = n / threads, extra = n % threads;
    const int64_t begin = t * chunk + std::min(t, extra);
    const int64_t end = begin + chunk + (t < extra ? 1 : 0);
    if (begin < end) {
      try {
        f(begin, end);
      } catch (...) {
        std::lock_guard<std::mutex> lock(mutex);
        if (!error) error = std::current_exception();
      }
    }
  }
  if (error) std::rethrow_exception(error);
#endif
}

}  // namespace keel
