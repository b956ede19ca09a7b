// Rotary position embedding (Su et al. 2021, RoFormer), full or partial, in the two layouts HF uses:
//  - half (Llama/Qwen2, "rotate_half"): pairs are (i, i + rotary_dim/2);
//  - interleaved (GLM-4, both formats): pairs are (2i, 2i+1).
// Only the first rotary_dim channels of each head rotate; the rest pass through unchanged.
#pragma once
#include <cstdint>
#include <vector>

namespace keel::kernels {

struct RopeTable {
  int64_t rotary_dim = 0;   // even, <= head_dim
  bool interleaved = false;
  int64_t max_positions = 0;
  // cos/sin [max_positions, rotary_dim/2], computed exactly as HF does: inv_freq in fp32,
  // theta^(-2i/rotary_dim), angle = float(position) * inv_freq (fp32 product), then cos/sin.
  std::vector<float> cos, sin;

  static RopeTable build(int64_t rotary_dim, bool interleaved, double theta, int64_t max_positions);
};

// x: [tokens, heads, head_dim] with row stride ld (elements between consecutive tokens);
// positions[tokens] index the table (must be < max_positions). Rotates in place.
template <typename T>
void rope_forward(T* x, int64_t ld, const int32_t* positions, int64_t tokens, int64_t heads,
                  int64_t head_dim, const RopeTable& table);
// Gradient of rope_forward: rotates by the negative angle, in place on dx.
template <typename T>
void rope_backward(T* dx, int64_t ld, const int32_t* positions, int64_t tokens, int64_t heads,
                   int64_t head_dim, const RopeTable& table);

}  // namespace keel::kernels
