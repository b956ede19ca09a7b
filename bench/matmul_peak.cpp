// Prints this machine's measured matmul throughput (bf16 and fp32 oneDNN GEMM on a large square
// problem): the denominator of keel's MFU figures, measured in the same run as the workload.
#include <cstdio>
#include <cstdlib>

#include "keel/kernels/gemm.h"

int main(int argc, char** argv) {
  const int64_t size = argc > 1 ? std::atoll(argv[1]) : 2048;
  const double bf16 = keel::kernels::measure_matmul_peak(true, size, 5);
  const double f32 = keel::kernels::measure_matmul_peak(false, size, 5);
  std::printf("{\"size\": %lld, \"bf16_flops\": %.6g, \"f32_flops\": %.6g}\n", static_cast<long long>(size), bf16, f32);
  return 0;
}
