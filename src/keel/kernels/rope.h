// Rotary position embedding (Su et al. 2021, RoFormer), full or partial, in the two layouts HF uses:
//  - half (Llama/Qwen2, "rotate_half"): pairs are (i, i + rotary_dim/2);
//  - interleaved (GLM-4, both formats): pairs are (2i, 2i+1).
// Only the first rotary_dim channels of each head rotate; the rest pass through unchanged.
#pragma once
#include <cstdint>
#include <vector>

#include "keel/kernels/shapes.h"

namespace keel::kernels {

// x: [tokens, heads, head_dim] with row stride ld (elements between consecutive tokens);
// positions[tokens] index the table (must be < max_positions). Rotates in place.
template <typename T>
void rope_forward(T* x, int64_t ld, const int32_t* positions, int64_t tokens, int64_t heads, int64_t head_dim,
                  const RopeTable& table);
// Gradient of rope_forward: rotates by the negative angle, in place on dx.
template <typename T>
void rope_backward(T* dx, int64_t ld, const int32_t* positions, int64_t tokens, int64_t heads, int64_t head_dim,
                   const RopeTable& table);

}  // namespace keel::kernels
