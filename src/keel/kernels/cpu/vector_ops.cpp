// Instantiates the row kernels for each x86 level and picks one for this CPU.
#include "keel/kernels/cpu/vector_ops.h"

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <string>
#include <type_traits>
#include <utility>

#include <xmmintrin.h>

#include "keel/core/error.h"
#include "keel/kernels/cpu/flush_denormals.h"

// The 16-lane vector types are passed between inline functions only, never across a library
// boundary, so the ABI note about AVX vectors on the portable level does not apply.
#pragma GCC diagnostic ignored "-Wpsabi"

namespace keel::kernels {

// Each level's vectors are as wide as its registers (vector_ops_body.inc says why). On AVX2 and
// AVX-512 any vector operation GCC would still split lane by lane fails the build: the slow
// code it makes gives the right results, so no test would notice. (SSE2 keeps two: widening two
// floats to two doubles has no vector form GCC uses there.)
#define KEEL_ISA_NAMESPACE isa_portable
#define KEEL_ISA_LEVEL Isa::Portable
#define KEEL_ISA_LANES 4
#include "keel/kernels/cpu/vector_ops_body.inc"
#undef KEEL_ISA_NAMESPACE
#undef KEEL_ISA_LEVEL
#undef KEEL_ISA_LANES

#pragma GCC diagnostic push
#pragma GCC diagnostic error "-Wvector-operation-performance"
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
#define KEEL_ISA_NAMESPACE isa_avx2
#define KEEL_ISA_LEVEL Isa::Avx2
#define KEEL_ISA_LANES 8
#include "keel/kernels/cpu/vector_ops_body.inc"
#undef KEEL_ISA_NAMESPACE
#undef KEEL_ISA_LEVEL
#undef KEEL_ISA_LANES
#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")
#define KEEL_ISA_NAMESPACE isa_avx512
#define KEEL_ISA_LEVEL Isa::Avx512
#define KEEL_ISA_LANES 16
#include "keel/kernels/cpu/vector_ops_body.inc"
#undef KEEL_ISA_NAMESPACE
#undef KEEL_ISA_LEVEL
#undef KEEL_ISA_LANES
#pragma GCC pop_options
#pragma GCC diagnostic pop

std::string_view isa_name(Isa isa) {
  switch (isa) {
    case Isa::Portable: return "portable";
    case Isa::Avx2: return "avx2";
    case Isa::Avx512: return "avx512";
  }
  return "?";
}

Isa cpu_isa() {
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl") &&
      __builtin_cpu_supports("avx512dq"))
    return Isa::Avx512;
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) return Isa::Avx2;
  return Isa::Portable;
}

const VectorOps& vector_ops_for(Isa isa) {
  require(isa <= cpu_isa(), "this CPU has no {} instructions (best: {})", isa_name(isa), isa_name(cpu_isa()));
  switch (isa) {
    case Isa::Avx512: return isa_avx512::kOps;
    case Isa::Avx2: return isa_avx2::kOps;
    case Isa::Portable: break;
  }
  return isa_portable::kOps;
}

namespace {

// KEEL_ISA lowers the level (to test the portable path on a newer CPU); it never raises it.
Isa chosen_isa() {
  Isa isa = cpu_isa();
  if (const char* env = std::getenv("KEEL_ISA"); env != nullptr && *env != '\0') {
    const std::string want(env);
    Isa asked = Isa::Portable;
    if (want == "avx512")
      asked = Isa::Avx512;
    else if (want == "avx2")
      asked = Isa::Avx2;
    else
      require(want == "portable", "KEEL_ISA={}: expected portable, avx2 or avx512", want);
    isa = std::min(isa, asked);
  }
  return isa;
}

}  // namespace

const VectorOps& vector_ops() {
  static const VectorOps& ops = vector_ops_for(chosen_isa());
  return ops;
}

}  // namespace keel::kernels
