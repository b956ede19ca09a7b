// An optional capability of a backend, not part of Backend: bf16 products that may widen their
// operands to fp32 at every call. The CPU backend has it (where oneDNN has no bf16 matmul, or runs
// it slower than fp32: kernels/gemm.h's bf16_products); a backend whose products read bf16 as they
// are (the reference, a device with bf16 matrix units) has none and implements nothing for it.
// Callers ask bf16_widening(backend) and, where it is null, plan and do nothing.
//
// Two things follow from widening, and they are why callers see it at all:
// - a bf16 matrix that several products read in a row is better widened once, into a copy the
//   memory plan holds, than once per product (hold/release);
// - the widened and the native products round differently in the last bits, so a resumed run asks
//   to multiply as the run that wrote its checkpoint did (keep), or its steps would differ from the
//   uninterrupted run's.
#pragma once
#include <cstdint>
#include <string>

#include "keel/core/dtype.h"
#include "keel/kernels/backend.h"

namespace keel::kernels {

class Bf16Widening {
 public:
  // Whether this process's bf16 products widen (chosen once per process, on first use).
  virtual bool widens() = 0;
  // Asks, before anything has multiplied, that the products run `widened` or not (`why` names
  // whose choice it is): returns whether they now do.
  virtual bool keep(bool widened, const std::string& why) = 0;
  // x [rows, cols] (leading dimension ld) widened once into `copy` [rows, cols]; until
  // release(slot), products on the calling thread that read an operand inside x read the copy: the
  // same fp32 values, so the same products. Slot 0 or 1 (two matrices at once). Does nothing where
  // widens() is false. x must not be written while it is held.
  virtual void hold(int slot, const bf16* x, int64_t rows, int64_t cols, int64_t ld, float* copy) = 0;
  virtual void release(int slot) = 0;

 protected:
  ~Bf16Widening() = default;
};

// The backend's widening, or null where its bf16 products never widen.
Bf16Widening* bf16_widening(Backend& backend);

// Whether the backend's bf16 products widen in this process: what the memory plan, the run's notes
// and a checkpoint's record ask.
inline bool widens_bf16_products(Backend& backend) {
  Bf16Widening* widening = bf16_widening(backend);
  return widening && widening->widens();
}

}  // namespace keel::kernels
