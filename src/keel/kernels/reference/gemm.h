// Dense matrix product as a plain triple loop in double (C = op(A) op(B) + beta C, GemmShape in
// shapes.h): the reference the CPU backend's GEMMs are tested against and the reference backend's
// products.
#pragma once
#include "keel/kernels/shapes.h"

namespace keel::kernels {

void gemm_reference(const GemmShape& s, const double* a, const double* b, double* c, double beta);

}  // namespace keel::kernels
