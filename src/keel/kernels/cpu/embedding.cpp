// Embedding lookup and its gradient. The gradient is a scatter-add, dtable[ids[i]] += dout[i];
// repeated ids would race if tokens were split across threads, so threads split the hidden
// columns instead: each thread owns a column block of every table row and visits the tokens in
// order, which makes every sum independent of the thread count.
#include "keel/kernels/embedding.h"

#include <algorithm>
#include <cstring>

#include "keel/core/error.h"
#include "keel/core/threads.h"

namespace keel::kernels {
namespace {

constexpr int64_t kColumnBlock = 64;  // 256 bytes of fp32: whole cache lines per thread
// Below this many elements a parallel region costs more than it saves.
constexpr int64_t kParallelMinElements = int64_t(1) << 15;

}  // namespace

template <typename T>
void embedding_forward(const int32_t* ids, int64_t n, const T* table, int64_t hidden, T* out) {
  parallel_for(n, n * hidden >= kParallelMinElements, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i)
      std::memcpy(out + i * hidden, table + int64_t(ids[i]) * hidden, sizeof(T) * hidden);
  });
}

void embedding_forward_bf16(const int32_t* ids, int64_t n, const bf16* table, int64_t hidden, float* out) {
  parallel_for(n, n * hidden >= kParallelMinElements, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i)
      convert_bf16_to_f32(table + int64_t(ids[i]) * hidden, out + i * hidden, size_t(hidden));
  });
}

template <typename T>
void embedding_backward(const int32_t* ids, int64_t n, const T* dout, int64_t hidden, int64_t vocab,
                        int64_t padding_idx, T* dtable) {
  for (int64_t i = 0; i < n; ++i)
    require(ids[i] >= 0 && ids[i] < vocab, "embedding_backward: token {} has id {}, expected an id in [0, {})", i,
            ids[i], vocab);
  const int64_t blocks = (hidden + kColumnBlock - 1) / kColumnBlock;
  parallel_for(blocks, n * hidden >= kParallelMinElements, [&](int64_t begin, int64_t end) {
    for (int64_t blk = begin; blk < end; ++blk) {
      const int64_t c0 = blk * kColumnBlock;
      const int64_t nc = std::min(kColumnBlock, hidden - c0);
      for (int64_t i = 0; i < n; ++i) {
        if (ids[i] == padding_idx) continue;  // nn.Embedding(padding_idx): no gradient from its lookups
        T* dst = dtable + int64_t(ids[i]) * hidden + c0;
        const T* src = dout + i * hidden + c0;
        for (int64_t c = 0; c < nc; ++c) dst[c] += src[c];
      }
    }
  });
}

template void embedding_forward<float>(const int32_t*, int64_t, const float*, int64_t, float*);
template void embedding_forward<double>(const int32_t*, int64_t, const double*, int64_t, double*);
template void embedding_backward<float>(const int32_t*, int64_t, const float*, int64_t, int64_t, int64_t, float*);
template void embedding_backward<double>(const int32_t*, int64_t, const double*, int64_t, int64_t, int64_t, double*);

}  // namespace keel::kernels
