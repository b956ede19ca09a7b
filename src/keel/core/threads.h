// The OpenMP thread count and index, or one thread when keel is built without OpenMP (the fuzz
// build): kernels that split a workspace per thread ask here instead of calling omp_* directly.
#pragma once
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

// Runs f(task, thread) for every task in [0, tasks): on all OpenMP threads with dynamic
// scheduling when `parallel`, else inline on thread 0 (a branch rather than `omp parallel if`,
// which still makes libgomp allocate a team). The first exception a task throws is rethrown here
// once the loop has ended, and the tasks not yet started are skipped: an exception escaping an
// OpenMP region would terminate the process.
template <typename F>
void for_each_task(int64_t tasks, bool parallel, F&& f) {
  if (!parallel) {
    for (int64_t t = 0; t < tasks; ++t) f(t, 0);
    return;
  }
  std::exception_ptr error;
  std::atomic<bool> failed{false};
  std::mutex mutex;
#pragma omp parallel for schedule(dynamic, 1)
  for (int64_t t = 0; t < tasks; ++t) {
    if (failed.load(std::memory_order_relaxed)) continue;
    try {
      f(t, thread_index());
    } catch (...) {
      std::lock_guard<std::mutex> lock(mutex);
      if (!error) error = std::current_exception();
      failed.store(true, std::memory_order_relaxed);
    }
  }
  if (error) std::rethrow_exception(error);
}

}  // namespace keel
