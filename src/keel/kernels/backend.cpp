#include "keel/kernels/backend.h"

#include "keel/core/error.h"
#include "keel/kernels/bf16_widening.h"
#include "keel/kernels/cpu/cpu_backend.h"
#include "keel/kernels/reference/reference_backend.h"

namespace keel::kernels {

std::vector<std::string> backend_names() { return {"cpu", "reference"}; }

Backend& backend_named(std::string_view name) {
  if (name == "cpu") return cpu_backend();
  if (name == "reference") return reference_backend();
  throw Error(fmt::format("unknown backend '{}' (known: cpu, reference)", name));
}

Backend& default_backend() { return cpu_backend(); }

// The backends that widen implement Bf16Widening beside Backend (the CPU's: cpu_backend.cpp).
Bf16Widening* bf16_widening(Backend& backend) { return dynamic_cast<Bf16Widening*>(&backend); }

}  // namespace keel::kernels
