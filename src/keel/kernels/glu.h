// Gated linear units for the MLP (Shazeer 2020, "GLU Variants Improve Transformer"):
//   out = act(gate) * up, with gate and up the two halves of one fused projection row:
//   gate_up[r] = [gate (inter) | up (inter)] (HF GLM gate_up_proj order).
// SwiGLU (Llama, Qwen, Mistral, GLM): act = silu. GeGLU (Gemma): act = GELU with the tanh
// approximation, torch's gelu(approximate="tanh"), transformers' "gelu_pytorch_tanh".
#pragma once
#include <cstdint>

#include "keel/core/dtype.h"
#include "keel/kernels/shapes.h"

namespace keel::kernels {

// gate_up: [rows, 2*inter]; out: [rows, inter]. out_bf16 (float only; may be null): bf16(out) as
// well, row by row while it is in cache: the down projection's input copy.
template <typename T>
void glu_forward(GluActivation act, const T* gate_up, int64_t rows, int64_t inter, T* out, bf16* out_bf16 = nullptr);
// dgate_up (overwritten): [rows, 2*inter]; dgate_up_bf16 (float only; may be null) the same in bf16,
// as the gate/up projection's backward GEMMs read it.
template <typename T>
void glu_backward(GluActivation act, const T* gate_up, const T* dout, int64_t rows, int64_t inter, T* dgate_up,
                  bf16* dgate_up_bf16 = nullptr);

}  // namespace keel::kernels
