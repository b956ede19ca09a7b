// Flush-to-zero and denormals-are-zero on the calling thread for a scope (MXCSR), where fp32
// arithmetic meets values near exp's floor: each denormal lane costs a microcode assist on Intel
// CPUs, ~100x an ordinary FMA.
//
// - The softmax backward multiplies probabilities by the scale and dP - D: a probability at exp's
//   floor (~1.2e-38, where every key far below the row's maximum lands) times 0.125 is a denormal;
//   rows of such keys ran 10x slower (628 ns -> 6,242 ns per 1,024 keys, measured).
// - Attention's per-head fp32 products (where bf16 products widen, and in fp32 training) start each
//   sum of P V or dS K from zero with such terms: on a randomly initialised ~1B model (logits far
//   apart, most probabilities at the floor) they ran at ~6 GFLOP/s a thread against ~150.
//
// What is flushed is below 1.2e-38, nothing a sum holds next to the row's terms; bf16 dot-product
// instructions (AVX-512 BF16, AMX) flush their inputs and outputs the same way whatever MXCSR says.
#pragma once
#include <xmmintrin.h>

namespace keel::kernels {

class FlushDenormals {
 public:
  FlushDenormals() : saved_(_mm_getcsr()) { _mm_setcsr(saved_ | kFlushToZero | kDenormalsAreZero); }
  ~FlushDenormals() { _mm_setcsr(saved_); }
  FlushDenormals(const FlushDenormals&) = delete;
  FlushDenormals& operator=(const FlushDenormals&) = delete;

 private:
  static constexpr unsigned kFlushToZero = 1u << 15, kDenormalsAreZero = 1u << 6;  // MXCSR bits
  unsigned saved_;
};

}  // namespace keel::kernels
