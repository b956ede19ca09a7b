// The CPU backend's dense matrix products: oneDNN matmul primitives, created once per shape and
// cached (GemmShape in shapes.h). Private to kernels/: model/ and train/ reach them through the
// Backend interface (backend.h).
#pragma once
#include <cstdint>
#include <string>

#include "keel/core/dtype.h"
#include "keel/kernels/shapes.h"

namespace keel::kernels {

// An fp32 product whose K exceeds kKChunk runs as products over K-chunks of kKChunk (boundaries at
// its multiples), accumulating into C. oneDNN 2.6's fp32 matmul ran long products up to 18% under
// its rate as chunks on an AVX-512 Xeon, 2 threads (`bench/matmul_peak --k-chunks`): [2048, 4096]
// x [4096, 768] 293-300 GFLOP/s whole against 304-308 as chunks, [2048, 13696] x [13696, 4096]
// 273 / 321, the LM head's input gradient [512, 32000] x [32000, 768] 260 / 315
// (docs/performance-log.md). The sums then come in another order than one product's: the same values
// to fp32 rounding.
constexpr int64_t kKChunk = 2048;
// beta must be 0 (overwrite) or 1 (accumulate into C, as for gradients).
void gemm_f32(const GemmShape& s, const float* a, const float* b, float* c, float beta);
// bf16 inputs, fp32 accumulation and fp32 output. Where oneDNN has no bf16 matmul for this CPU
// (x86 before AVX-512), the inputs are widened to fp32 (exactly) and an fp32 matmul runs.
void gemm_bf16(const GemmShape& s, const bf16* a, const bf16* b, float* c, float beta);
// Builds the calling thread's plan for this product now, as its first gemm_f32 (bf16_inputs =
// false) or gemm_bf16 call would: a step loop that meets the shape later allocates nothing.
void gemm_prepare(const GemmShape& s, bool bf16_inputs, float beta);
// Where oneDNN has no bf16 matmul, the most elements of each operand a widened product holds in
// fp32 at once (gemm.cpp: run_widened cuts larger products into tiles).
constexpr size_t kWidenedOperandElements = size_t(4) << 20;
// The fp32 operand tiles the products of a run in `bf16` hold outside any plan's arena, for the
// memory plan: 32 MiB where oneDNN has no bf16 matmul on this CPU, else 0. (Attention's products
// widen nothing there: it holds its bf16 operands widened in its own workspace, attention.h.)
size_t gemm_widened_operand_bytes(bool bf16);
// Where oneDNN has no bf16 matmul, each gemm_bf16 call widens its operands anew, and a matrix that
// several products read in a row (a block's normalised input feeds its fused projection and each
// of its adapters' A products) was widened once per product. gemm_hold_widened widens x
// [rows, cols] (leading dimension ld) once into `copy` [rows, cols] (the caller's, planned
// memory), and until gemm_release_widened(slot) every gemm_bf16 on this thread whose operand lies
// inside x reads the copy instead: the same fp32 values, so the same products. `slot` < 2: two
// matrices at once (an adapter's backward reads its output gradient and its input). Does nothing
// where oneDNN multiplies bf16 itself (bf16_matmul_native). The caller must not write x while it
// is held.
constexpr int kHeldWidenedSlots = 2;
void gemm_hold_widened(int slot, const bf16* x, int64_t rows, int64_t cols, int64_t ld, float* copy);
void gemm_release_widened(int slot);
// True once some gemm_bf16 call had to widen its inputs (reported with the run's kernels).
bool gemm_bf16_emulated();
// How gemm_bf16 multiplies, chosen once per process: on oneDNN's bf16 matmul (`native`), or
// widened to fp32 (exactly) where oneDNN has none, or where its fp32 matmul runs at least
// kWidenAbove times its bf16 one (an AVX-512 BF16 CPU without AMX can run bf16 at half the fp32
// rate). KEEL_BF16_MATMUL=native|widened overrides the measurement (tests compare the two).
// The choice is printed with the run's kernels (Backend::description).
struct Bf16Products {
  bool native = false;
  double bf16_flops = 0, f32_flops = 0;  // the 768^3 products on one thread, when measured
  std::string reason;                    // "AMX", "KEEL_BF16_MATMUL=widened", the measured rates, ...
};
// Close to 1 on purpose: another process's load adds time to both products and so pulls the
// measured ratio toward 1, never across it; a margin above 1 then only has to absorb what load
// compresses, and a CPU whose bf16 is faster (ratio ~0.5) cannot be pushed past it.
constexpr double kWidenAbove = 1.1;
const Bf16Products& bf16_products();
// A resumed run multiplies as the run that wrote its checkpoint did, so that its steps round as
// the uninterrupted run's would (the two ways differ in the last bits of every product): asks for
// `native` (or widened) instead of the measurement, `why` saying whose choice it was. Only before
// the first bf16_products() call; KEEL_BF16_MATMUL still overrides, and a CPU without oneDNN's
// bf16 matmul widens whatever is asked. Returns the way chosen: compare it to see whether the
// request held.
const Bf16Products& keep_bf16_products(bool native, const std::string& why);
// bf16_products().native: the products read bf16 as they are (nothing widened, nothing held).
bool bf16_matmul_native();
// Whether keel splits large bf16 products over the threads itself, one single-threaded product a
// thread (gemm.cpp says when and why), rather than handing each whole to oneDNN's threading.
bool bf16_products_split();
// The shares gemm_bf16 cuts a bf16 product into, one a thread, when called outside a parallel
// region (one part when it runs whole). Where it cuts products at all (bf16_products_split), every
// thread holds the plans of every share (or of the whole product) once the product is prepared
// (gemm_prepare), so a caller's own tasks may run them, one single-threaded product each, on
// whichever threads take them (Backend::bf16_product_shares).
ProductShares bf16_product_shares(const GemmShape& s);

// Measures the bf16 (or f32) matmul throughput of this machine on a large square GEMM, in FLOP/s.
double measure_matmul_peak(bool use_bf16, int64_t size = 2048, int repeats = 5);
// The same for one product of shape s (the best of `repeats` calls, operands on 64-byte lines as
// in the decoder's arena).
double measure_gemm(bool use_bf16, const GemmShape& s, int repeats = 5);

}  // namespace keel::kernels
