// Prints this machine's measured matmul throughput (bf16 and fp32 oneDNN GEMM on a large square
// problem): the denominator of keel's MFU figures, measured in the same run as the workload.
//
//   matmul_peak [SIZE]
//   matmul_peak --model HIDDEN INTERMEDIATE QKV_ROWS VOCAB TOKENS
//   matmul_peak --prepacked HIDDEN INTERMEDIATE QKV_ROWS VOCAB TOKENS
//   matmul_peak --k-chunks M K N NN|NT|TN
//
// The second form times, in bf16, each linear layer's three products as the decoder runs them:
// forward y = x W^T (NT), the input gradient dx = dy W (NN) and the weight gradient dW = dy^T x
// (TN), for TOKENS rows, with operands on 64-byte lines as in the decoder's arena.
//
// The third asks whether bf16 products could beat widened fp32 ones where keel widens them
// (kernels/gemm.h, bf16_products): each linear layer's forward (NT) and input-gradient (NN)
// products straight on oneDNN, in fp32, in bf16 on the row-major weight, and in bf16 on the weight
// reordered once into the layout oneDNN picks for it (`format_tag::any`, its VNNI blocking), as a
// frozen LoRA weight could be held. The reorder is not timed.
//
// The fourth times one fp32 product on oneDNN whole and as K-chunks of kernels::kKChunk
// accumulating into C, as gemm_f32 runs it when K is longer (kernels/gemm.h).
#include <dnnl.hpp>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

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

dnnl::engine& cpu_engine() {
  static dnnl::engine engine(dnnl::engine::kind::cpu, 0);
  return engine;
}

// GFLOP/s of an [m, k] x [k, n] product that run() issues on `stream`: the best of 5 runs after a
// warm-up run.
template <typename Run>
double best_gflops(int64_t m, int64_t n, int64_t k, dnnl::stream& stream, Run&& run) {
  double best = 1e30;
  for (int r = 0; r <= 5; ++r) {  // round 0 warms up
    const auto t0 = std::chrono::steady_clock::now();
    run();
    stream.wait();
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    if (r > 0) best = std::min(best, s);
  }
  return 2.0 * double(m) * double(n) * double(k) / best / 1e9;
}

// GFLOP/s of y[m, n] = x[m, k] w, w stored [n, k] (`w_transposed`: the forward's W^T) or [k, n],
// on oneDNN's threads.
double time_onednn(int64_t m, int64_t n, int64_t k, bool w_transposed, dnnl::memory::data_type in, bool prepacked) {
  using dt = dnnl::memory::data_type;
  using tag = dnnl::memory::format_tag;
  dnnl::engine& engine = cpu_engine();
  dnnl::stream stream(engine);
  const dnnl::memory::desc x_md({m, k}, in, tag::ab), y_md({m, n}, dt::f32, tag::ab);
  const dnnl::memory::desc w_plain({k, n}, in, w_transposed ? tag::ba : tag::ab);
  const dnnl::memory::desc w_md = prepacked ? dnnl::memory::desc({k, n}, in, tag::any) : w_plain;
  const dnnl::matmul::primitive_desc pd(dnnl::matmul::desc(x_md, w_md, y_md), engine);
  dnnl::memory x(x_md, engine), w_rows(w_plain, engine), w(pd.weights_desc(), engine), y(y_md, engine);
  std::memset(x.get_data_handle(), 0x3f, x_md.get_size());  // 0x3f3f: about 0.75 in bf16 and fp32
  std::memset(w_rows.get_data_handle(), 0x3f, w_plain.get_size());
  dnnl::reorder(w_rows, w).execute(stream, w_rows, w);
  const dnnl::matmul product(pd);
  return best_gflops(m, n, k, stream, [&] {
    product.execute(stream, {{DNNL_ARG_SRC, x}, {DNNL_ARG_WEIGHTS, w}, {DNNL_ARG_DST, y}});
  });
}

// GFLOP/s of C[m, n] = op(A)[m, k] op(B)[k, n] in fp32 on oneDNN's threads, as one product or
// as K-chunks of `chunk` (the first overwriting C, the rest adding to it).
double time_k_chunks(int64_t m, int64_t k, int64_t n, bool trans_a, bool trans_b, int64_t chunk) {
  using dt = dnnl::memory::data_type;
  dnnl::engine& engine = cpu_engine();
  dnnl::stream stream(engine);
  std::vector<float> a(size_t(m * k), 0.5f), b(size_t(k * n), 0.25f), c(size_t(m * n));
  const dnnl::memory::desc c_md({m, n}, dt::f32, dnnl::memory::dims{n, 1});
  dnnl::memory mc(c_md, engine, c.data());
  struct Piece {
    dnnl::matmul product;
    dnnl::memory a, b;  // op(A)'s [m, kn] columns from k0 and op(B)'s [kn, n] rows from k0, as strided views
  };
  std::vector<Piece> pieces;
  for (int64_t k0 = 0; k0 < k; k0 += chunk) {
    const int64_t kn = std::min(chunk, k - k0);
    const dnnl::memory::desc a_md({m, kn}, dt::f32, trans_a ? dnnl::memory::dims{1, m} : dnnl::memory::dims{k, 1});
    const dnnl::memory::desc b_md({kn, n}, dt::f32, trans_b ? dnnl::memory::dims{1, k} : dnnl::memory::dims{n, 1});
    dnnl::primitive_attr attr;
    if (k0 > 0) {
      dnnl::post_ops ops;
      ops.append_sum(1.0f);
      attr.set_post_ops(ops);
    }
    pieces.push_back({dnnl::matmul(dnnl::matmul::primitive_desc(dnnl::matmul::desc(a_md, b_md, c_md), attr, engine)),
                      dnnl::memory(a_md, engine, a.data() + (trans_a ? k0 * m : k0)),
                      dnnl::memory(b_md, engine, b.data() + (trans_b ? k0 : k0 * n))});
  }
  return best_gflops(m, n, k, stream, [&] {
    for (Piece& p : pieces)
      p.product.execute(stream, {{DNNL_ARG_SRC, p.a}, {DNNL_ARG_WEIGHTS, p.b}, {DNNL_ARG_DST, mc}});
  });
}

void time_layouts(const char* name, int64_t tokens, int64_t in, int64_t out) {
  using dt = dnnl::memory::data_type;
  for (const bool forward : {true, false}) {
    // forward: y = x W^T, W [out, in]; input gradient: dx = dy W, the same W read as [k = out, n = in].
    const int64_t n = forward ? out : in, k = forward ? in : out;
    std::printf(
        "{\"linear\": \"%s\", \"product\": \"%s\", \"m\": %lld, \"n\": %lld, \"k\": %lld, \"f32_gflops\": %.1f, "
        "\"bf16_gflops\": %.1f, \"bf16_prepacked_gflops\": %.1f}\n",
        name, forward ? "forward_nt" : "input_grad_nn", static_cast<long long>(tokens), static_cast<long long>(n),
        static_cast<long long>(k), time_onednn(tokens, n, k, forward, dt::f32, false),
        time_onednn(tokens, n, k, forward, dt::bf16, false), time_onednn(tokens, n, k, forward, dt::bf16, true));
  }
}

}  // namespace

int main(int argc, char** argv) {
  if (argc == 7 && (std::strcmp(argv[1], "--model") == 0 || std::strcmp(argv[1], "--prepacked") == 0)) {
    const int64_t hidden = std::atoll(argv[2]), intermediate = std::atoll(argv[3]), qkv = std::atoll(argv[4]),
                  vocab = std::atoll(argv[5]), tokens = std::atoll(argv[6]);
    const auto time = std::strcmp(argv[1], "--model") == 0 ? time_linear : time_layouts;
    time("qkv", tokens, hidden, qkv);
    time("o", tokens, hidden, hidden);
    time("gate_up", tokens, hidden, 2 * intermediate);
    time("down", tokens, intermediate, hidden);
    time("lm_head", tokens, hidden, vocab);
    return 0;
  }
  if (argc == 6 && std::strcmp(argv[1], "--k-chunks") == 0) {
    const int64_t m = std::atoll(argv[2]), k = std::atoll(argv[3]), n = std::atoll(argv[4]);
    const std::string layout = argv[5];
    if (layout != "NN" && layout != "NT" && layout != "TN") {
      std::fprintf(stderr, "matmul_peak --k-chunks M K N NN|NT|TN\n");
      return 2;
    }
    const bool ta = layout[0] == 'T', tb = layout[1] == 'T';
    std::printf(
        "{\"m\": %lld, \"k\": %lld, \"n\": %lld, \"layout\": \"%s\", \"k_chunk\": %lld, \"whole_gflops\": %.1f, "
        "\"chunks_gflops\": %.1f}\n",
        static_cast<long long>(m), static_cast<long long>(k), static_cast<long long>(n), layout.c_str(),
        static_cast<long long>(keel::kernels::kKChunk), time_k_chunks(m, k, n, ta, tb, k),
        time_k_chunks(m, k, n, ta, tb, keel::kernels::kKChunk));
    return 0;
  }
  const int64_t size = argc > 1 ? std::atoll(argv[1]) : 2048;
  const double bf16 = keel::kernels::measure_matmul_peak(true, size, 5);
  const double f32 = keel::kernels::measure_matmul_peak(false, size, 5);
  std::printf("{\"size\": %lld, \"bf16_flops\": %.6g, \"f32_flops\": %.6g}\n", static_cast<long long>(size), bf16, f32);
  return 0;
}
