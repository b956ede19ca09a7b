// SwiGLU MLP activation (Shazeer 2020): out = silu(gate) * up, with gate and up the two halves of
// one fused projection row: gate_up[r] = [gate (inter) | up (inter)] (HF GLM gate_up_proj order).
#pragma once
#include <cstdint>

namespace keel::kernels {

// gate_up: [rows, 2*inter]; out: [rows, inter].
template <typename T>
void swiglu_forward(const T* gate_up, int64_t rows, int64_t inter, T* out);
// dgate_up (overwritten): [rows, 2*inter].
template <typename T>
void swiglu_backward(const T* gate_up, const T* dout, int64_t rows, int64_t inter, T* dgate_up);

}  // namespace keel::kernels
