// The reference backend: every operation in double precision from the float inputs, rounded to
// float once at the end, on plain loops written from each operation's formula (gemm_reference, the
// flash-style attention template, rmsnorm.h, cached_attention.h, the rest in the backend's file).
// Nothing here includes or instantiates the CPU backend's kernels (the build refuses it:
// tests/layers), so a change to one of them cannot move the yardstick it is measured against.
// Slow and exact to fp32: the decoder tests and the reference trainings run on it next to the CPU
// backend, and a new backend is checked against it. Private to kernels/: others ask
// backend_named("reference").
#pragma once
#include "keel/kernels/backend.h"

namespace keel::kernels {

Backend& reference_backend();

}  // namespace keel::kernels
