// The OpenMP thread count and index, or one thread when keel is built without OpenMP (the fuzz
// build): kernels that split a workspace per thread ask here instead of calling omp_* directly.
#pragma once
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

}  // namespace keel
