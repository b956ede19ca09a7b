// The CPU backend: oneDNN GEMMs, the blocked attention kernel and the row kernels compiled per ISA
// (AVX-512 where present, chosen at run time). Private to kernels/: others ask backend_named("cpu").
#pragma once
#include "keel/kernels/backend.h"

namespace keel::kernels {

Backend& cpu_backend();

}  // namespace keel::kernels
