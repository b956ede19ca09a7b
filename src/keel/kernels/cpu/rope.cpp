// Rotary position embedding (Su et al. 2021): each channel pair (a, b) of the first rotary_dim
// channels of a head is rotated by the angle pos * inv_freq[i]:
//   a' = a cos - b sin,   b' = b cos + a sin.
// The backward pass applies the transpose, i.e. the rotation by -angle.
#include "keel/kernels/rope.h"

#include <cassert>
#include <cmath>

#include "keel/core/threads.h"

namespace keel::kernels {
namespace {

// Channel indices of pair i within a head: (i, i + r/2) for rotate_half, (2i, 2i+1) interleaved.
// Below this many rotated elements a parallel region costs more than it saves.
constexpr int64_t kParallelMinElements = int64_t(1) << 15;

struct PairLayout {
  int64_t first_stride, second_offset;
};

PairLayout pair_layout(const RopeTable& t) {
  return t.interleaved ? PairLayout{2, 1} : PairLayout{1, t.rotary_dim / 2};
}

// sign = +1 rotates by +angle (forward), -1 by -angle (backward).
template <typename T>
void rotate_head(T* x, const float* cos, const float* sin, int64_t pairs, PairLayout layout, T sign) {
  for (int64_t i = 0; i < pairs; ++i) {
    T* a = x + i * layout.first_stride;
    T* b = a + layout.second_offset;
    const T c = T(cos[i]), s = sign * T(sin[i]);
    const T av = *a, bv = *b;
    // Same operation order as HF: x*cos + rotate_half(x)*sin.
    *a = av * c - bv * s;
    *b = bv * c + av * s;
  }
}

template <typename T>
void rotate_tokens(T* x, int64_t ld, const int32_t* positions, int64_t tokens, int64_t heads, int64_t head_dim,
                   const RopeTable& table, T sign) {
  const int64_t pairs = table.rotary_dim / 2;
  const PairLayout layout = pair_layout(table);
  assert(table.rotary_dim <= head_dim);
  const int64_t work = tokens * heads * table.rotary_dim;
  parallel_for(tokens, work >= kParallelMinElements, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const int64_t pos = positions[t];
      assert(pos >= 0 && pos < table.max_positions);
      const float* cos = table.cos.data() + pos * pairs;
      const float* sin = table.sin.data() + pos * pairs;
      for (int64_t h = 0; h < heads; ++h) rotate_head(x + t * ld + h * head_dim, cos, sin, pairs, layout, sign);
    }
  });
}

}  // namespace

RopeTable RopeTable::build(int64_t rotary_dim, bool interleaved, double theta, int64_t max_positions) {
  RopeTable t;
  t.rotary_dim = rotary_dim;
  t.interleaved = interleaved;
  t.max_positions = max_positions;
  const int64_t pairs = rotary_dim / 2;
  // HF: inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2).float() / dim)), every step in fp32.
  std::vector<float> inv_freq(pairs);
  const float base = float(theta);
  for (int64_t i = 0; i < pairs; ++i) {
    const float exponent = float(2 * i) / float(rotary_dim);
    inv_freq[i] = 1.0f / std::pow(base, exponent);
  }
  t.cos.resize(max_positions * pairs);
  t.sin.resize(max_positions * pairs);
  for (int64_t p = 0; p < max_positions; ++p) {
    for (int64_t i = 0; i < pairs; ++i) {
      // HF: freqs = float(position) * inv_freq as an fp32 product; cos/sin of that fp32 angle
      // (evaluated in double and rounded: within torch's 1-ulp float cos/sin).
      const float angle = float(p) * inv_freq[i];
      t.cos[p * pairs + i] = float(std::cos(double(angle)));
      t.sin[p * pairs + i] = float(std::sin(double(angle)));
    }
  }
  return t;
}

template <typename T>
void rope_forward(T* x, int64_t ld, const int32_t* positions, int64_t tokens, int64_t heads, int64_t head_dim,
                  const RopeTable& table) {
  rotate_tokens(x, ld, positions, tokens, heads, head_dim, table, T(1));
}

template <typename T>
void rope_backward(T* dx, int64_t ld, const int32_t* positions, int64_t tokens, int64_t heads, int64_t head_dim,
                   const RopeTable& table) {
  rotate_tokens(dx, ld, positions, tokens, heads, head_dim, table, T(-1));
}

template void rope_forward<float>(float*, int64_t, const int32_t*, int64_t, int64_t, int64_t, const RopeTable&);
template void rope_forward<double>(double*, int64_t, const int32_t*, int64_t, int64_t, int64_t, const RopeTable&);
template void rope_backward<float>(float*, int64_t, const int32_t*, int64_t, int64_t, int64_t, const RopeTable&);
template void rope_backward<double>(double*, int64_t, const int32_t*, int64_t, int64_t, int64_t, const RopeTable&);

}  // namespace keel::kernels
