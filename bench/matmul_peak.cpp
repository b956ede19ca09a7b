// Prints this machine's measured matmul throughput (bf16 and fp32 oneDNN GEMM on a large square
// problem): the denominator of keel's MFU figures, measured in the same run as the workload.
//
//   matmul_peak [SIZE]
//   matmul_peak --model HIDDEN INTERMEDIATE QKV_ROWS VOCAB TOKENS
//
// The second form times, in bf16, each linear layer's three products as the decoder runs them:
// forward y = x W^T (NT), the input gradient dx = dy W (NN) and the weight gradient dW = dy^T x
// (TN), for TOKENS rows, with operands on 64-byte lines as in the decoder's arena.
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>

#include "keel/kernels/gemm.h"

namespace {

using keel::kernels::packed_gemm;
using keel::kernels::Trans;

void time_linear(const char* name, int64_t tokens, int64_t in, int64_t out) {
  const double fwd = keel::kernels::measure_gemm(true, packed_gemm(Trans::N, Trans::T, tokens, out, in));
  const double bwd_in = keel::kernels::measure_gemm(true, packed_gemm(Trans::N, Trans::N, tokens, in, out));
  const double bwd_w = keel::kernels::measure_gemm(true, packed_gemm(Trans::T, Trans::N, out, in, tokens));
  std::printf(
      "{\"linear\": \"%s\", \"tokens\": %lld, \"in\": %lld, \"out\": %lld, \"forward_nt\": %.4g, "
      "\"input_grad_nn\": %.4g, \"weight_grad_tn\": %.4g}\n",
      name, static_cast<long long>(tokens), static_cast<long long>(in), static_cast<long long>(out), fwd, bwd_in,
      bwd_w);
}

}  // namespace

int main(int argc, char** argv) {
  if (argc == 7 && std::strcmp(argv[1], "--model") == 0) {
    const int64_t hidden = std::atoll(argv[2]), intermediate = std::atoll(argv[3]), qkv = std::atoll(argv[4]),
                  vocab = std::atoll(argv[5]), tokens = std::atoll(argv[6]);
    time_linear("qkv", tokens, hidden, qkv);
    time_linear("o", tokens, hidden, hidden);
    time_linear("gate_up", tokens, hidden, 2 * intermediate);
    time_linear("down", tokens, intermediate, hidden);
    time_linear("lm_head", tokens, hidden, vocab);
    return 0;
  }
  const int64_t size = argc > 1 ? std::atoll(argv[1]) : 2048;
  const double bf16 = keel::kernels::measure_matmul_peak(true, size, 5);
  const double f32 = keel::kernels::measure_matmul_peak(false, size, 5);
  std::printf("{\"size\": %lld, \"bf16_flops\": %.6g, \"f32_flops\": %.6g}\n", static_cast<long long>(size), bf16, f32);
  return 0;
}
