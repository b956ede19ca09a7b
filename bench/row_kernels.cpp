// Times the attention softmax's row kernels on every ISA level this CPU has, one thread, a
// 1,024-key row (64 rows of a causal block, with and without packed documents): ns per row.
//
//   row_kernels [REPEATS]
//
// The figure that found the AVX2 and SSE2 levels running as scalar code (2026-12-04, AMD EPYC
// Zen 3: masked_max 4,001 ns a row on AVX2, exp_and_sum 5,769 ns; 190 and 702 once each level's
// vectors were its register width). A level far slower than its width explains is the sign.
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <string>
#include <vector>

#include "keel/kernels/cpu/vector_ops.h"

namespace {

using keel::bf16;
using keel::kernels::Isa;
using keel::kernels::RowVisibility;
using keel::kernels::VectorOps;

constexpr int kKeys = 1024, kRows = 64;

template <typename F>
double ns_per_row(int repeats, F&& f) {
  const auto start = std::chrono::steady_clock::now();
  for (int r = 0; r < repeats; ++r)
    for (int row = 0; row < kRows; ++row) f(row);
  const std::chrono::duration<double, std::nano> took = std::chrono::steady_clock::now() - start;
  return took.count() / (double(repeats) * kRows);
}

}  // namespace

int main(int argc, char** argv) {
  const int repeats = argc > 1 ? std::atoi(argv[1]) : 200;
  std::mt19937 gen(1);
  std::normal_distribution<float> normal;
  std::vector<float> scores(size_t(kKeys) * kRows), dp(scores.size());
  for (float& x : scores) x = normal(gen);
  for (float& x : dp) x = normal(gen);
  std::vector<int32_t> documents(kKeys, 3);
  std::vector<float> s(scores.size()), d(scores.size());
  std::vector<bf16> out(kKeys);
  float sink = 0;
  for (Isa isa : {Isa::Portable, Isa::Avx2, Isa::Avx512}) {
    if (isa > keel::kernels::cpu_isa()) break;
    const VectorOps& ops = keel::kernels::vector_ops_for(isa);
    for (bool packed : {false, true}) {
      auto visible = [&](int row) { return RowVisibility{kKeys - row, packed ? documents.data() : nullptr, 3}; };
      const double max_ns =
          ns_per_row(repeats, [&](int row) { sink += ops.masked_max(scores.data() + row * kKeys, visible(row)); });
      s = scores;
      const double exp_ns = ns_per_row(repeats / 10 + 1, [&](int row) {
        sink += ops.exp_and_sum(s.data() + row * kKeys, kKeys, 0.125f, 0.5f, visible(row));
      });
      s = scores;
      d = dp;
      const double grad_ns = ns_per_row(repeats / 10 + 1, [&](int row) {
        ops.softmax_grad_round_bf16(s.data() + row * kKeys, d.data() + row * kKeys, kKeys, 0.125f, 1.5f,
                                    visible(row));
      });
      const double cast_ns = ns_per_row(repeats, [&](int row) {
        ops.scale_to_bf16(scores.data() + row * kKeys, 0.7f, out.data(), kKeys);
        sink += float(out[0].bits);
      });
      std::printf(
          "{\"isa\": \"%s\", \"documents\": %s, \"keys\": %d, \"masked_max_ns\": %.1f, \"exp_and_sum_ns\": %.1f, "
          "\"softmax_grad_round_bf16_ns\": %.1f, \"scale_to_bf16_ns\": %.1f}\n",
          std::string(keel::kernels::isa_name(isa)).c_str(), packed ? "true" : "false", kKeys, max_ns, exp_ns, grad_ns,
          cast_ns);
    }
  }
  return sink == 12345.0f ? 1 : 0;  // keeps the results alive
}
