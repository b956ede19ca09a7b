// Shared by the kernel tests: random data and central finite differences in double precision.
//   dL/dx_i ~ (L(x + eps e_i) - L(x - eps e_i)) / (2 eps), truncation error O(eps^2).
#pragma once
#include <gtest/gtest.h>
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <functional>
#include <random>
#include <vector>

namespace keel::test {

inline std::vector<double> random_vector(size_t n, uint64_t seed, double lo = -1, double hi = 1) {
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<double> dist(lo, hi);
  std::vector<double> v(n);
  for (double& x : v) x = dist(rng);
  return v;
}

inline std::vector<float> to_float(const std::vector<double>& v) { return std::vector<float>(v.begin(), v.end()); }

// Up to `count` distinct indices of [0, n) (all of them when n <= count), ascending.
inline std::vector<int64_t> sample_indices(int64_t n, int64_t count, uint64_t seed) {
  std::vector<int64_t> all(n);
  for (int64_t i = 0; i < n; ++i) all[i] = i;
  if (n <= count) return all;
  std::mt19937_64 rng(seed);
  std::shuffle(all.begin(), all.end(), rng);
  all.resize(count);
  std::sort(all.begin(), all.end());
  return all;
}

// Compares analytic[i] with the central difference of loss() in x[i] for each i in indices.
inline void expect_gradient_matches(const char* what, std::vector<double>& x, const std::vector<double>& analytic,
                                    const std::vector<int64_t>& indices, const std::function<double()>& loss,
                                    double eps = 1e-6, double tolerance = 1e-6) {
  // One thread: the kernels are tiny here, and on a loaded machine every parallel region's
  // barrier can cost a scheduler tick.
  const int saved_threads = omp_get_max_threads();
  omp_set_num_threads(1);
  int failures = 0;
  for (int64_t i : indices) {
    const double saved = x[i];
    x[i] = saved + eps;
    const double up = loss();
    x[i] = saved - eps;
    const double down = loss();
    x[i] = saved;
    const double numeric = (up - down) / (2 * eps);
    const double error = std::fabs(numeric - analytic[i]);
    if (error > tolerance * std::max(1.0, std::fabs(numeric)) && failures++ < 10)
      ADD_FAILURE() << what << "[" << i << "]: analytic " << analytic[i] << " numeric " << numeric;
  }
  omp_set_num_threads(saved_threads);
  EXPECT_EQ(failures, 0) << what << ": " << failures << " of " << indices.size() << " gradient entries differ";
}

inline double weighted_sum(const std::vector<double>& y, const std::vector<double>& weights) {
  double s = 0;
  for (size_t i = 0; i < y.size(); ++i) s += y[i] * weights[i];
  return s;
}

// Runs f with the given OpenMP thread count, restoring the previous setting.
template <typename F>
void with_threads(int threads, F&& f) {
  const int saved = omp_get_max_threads();
  omp_set_num_threads(threads);
  f();
  omp_set_num_threads(saved);
}

}  // namespace keel::test
