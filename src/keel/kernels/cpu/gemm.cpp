// oneDNN matmul primitives, one per distinct (dtype, layout, shape, beta), created on first use and
// reused: primitive creation costs far more than a small GEMM, and the training step calls the same
// few shapes every step. Memory objects are cached too and only re-pointed (set_data_handle), so a
// steady-state call needs no new objects.
//
// The cache and the stream are per thread: a call from outside a parallel region runs the product
// on all threads (oneDNN parallelises it, or, for a large bf16 product, keel splits it into one
// single-threaded product a thread: bf16_product_shares below), while calls from inside an OpenMP parallel
// region (the attention kernel gives each thread its own heads) run concurrently, each on its own
// thread, with nothing shared.
#include <algorithm>
#include <array>
#include <atomic>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <dnnl.hpp>
#include <memory>
#include <string>
#include <tuple>
#include <unordered_map>
#include <vector>

#include "keel/core/error.h"
#include "keel/core/memory_plan.h"
#include "keel/core/threads.h"
#include "keel/kernels/cpu/matmul_rates_record.h"
#include "keel/kernels/cpu/vector_ops.h"
#include "keel/kernels/gemm.h"

namespace keel::kernels {
namespace {

struct GemmKey {
  bool bf16;
  GemmShape s;
  bool accumulate;
  bool operator==(const GemmKey& o) const {
    return bf16 == o.bf16 && accumulate == o.accumulate && s.trans_a == o.s.trans_a && s.trans_b == o.s.trans_b &&
           s.m == o.s.m && s.n == o.s.n && s.k == o.s.k && s.lda == o.s.lda && s.ldb == o.s.ldb && s.ldc == o.s.ldc;
  }
};

struct GemmKeyHash {
  size_t operator()(const GemmKey& k) const {
    size_t h = k.bf16 * 2 + k.accumulate;
    for (int64_t v : {int64_t(k.s.trans_a), int64_t(k.s.trans_b), k.s.m, k.s.n, k.s.k, k.s.lda, k.s.ldb, k.s.ldc})
      h = h * 1000003u ^ std::hash<int64_t>()(v);
    return h;
  }
};

struct GemmPlan {
  dnnl::matmul primitive;
  dnnl::memory a, b, c;
  // bf16 where the products widen (bf16_products: no oneDNN bf16 matmul, or a slower one than
  // fp32): no primitive of its own; the product runs as fp32 products over widened tiles of its
  // operands (run_widened).
  bool widened = false;
  // Execution arguments for the C API, built once: dnnl::primitive::execute would rebuild a
  // std::vector of them from a map on every call, a heap allocation inside the step loop.
  std::array<dnnl_exec_arg_t, 3> args;
};

dnnl::engine& cpu_engine() {
  static dnnl::engine engine(dnnl::engine::kind::cpu, 0);
  return engine;
}

dnnl::stream& cpu_stream() {
  thread_local dnnl::stream stream(cpu_engine());
  return stream;
}

std::atomic<bool>& bf16_emulated() {
  static std::atomic<bool> flag{false};
  return flag;
}

// The fp32 copies of a widened product's operand tiles (run_widened), per thread as the plans
// are. A thread calling from outside a parallel region (the training thread: the decoder's
// projections and LM head, on all threads inside oneDNN) holds a pair of kWidenedOperandElements
// each, allocated whole on first use, so that the memory plan counts it exactly
// (gemm_widened_operand_bytes); a call from inside one (attention's per-head products, one thread
// each) uses a pair as large as the thread's largest tile, at most 0.5 MB at head_dim 64 and
// 1,024 keys. (One pair per product shape, as before 2026-12-04, summed to ~600 MB on the bench
// model, outside the plan.)
struct WidenedOperands {
  std::vector<float> a, b;
  void reserve(size_t a_elements, size_t b_elements) {
    if (a.size() < a_elements) a.resize(a_elements);
    if (b.size() < b_elements) b.resize(b_elements);
  }
};

WidenedOperands& widened_operands() {
  if (!in_parallel_region()) {
    thread_local WidenedOperands whole = [] {
      WidenedOperands w;
      w.reserve(kWidenedOperandElements, kWidenedOperandElements);
      return w;
    }();
    return whole;
  }
  thread_local WidenedOperands own;
  return own;
}

// The matrices held widened on this thread (gemm_hold_widened).
struct HeldWidened {
  const bf16* x = nullptr;
  int64_t rows = 0, cols = 0, ld = 0;
  const float* copy = nullptr;
};
std::array<HeldWidened, kHeldWidenedSlots>& held_widened() {
  thread_local std::array<HeldWidened, kHeldWidenedSlots> held;
  return held;
}

// op(X) (rows x cols, stored with leading dimension ld) read from a held copy: the copy's address
// of X's first element and its leading dimension, or null when no held matrix contains all of X.
std::pair<const float*, int64_t> held_operand(Trans t, const bf16* x, int64_t rows, int64_t cols, int64_t ld) {
  if (in_parallel_region()) return {nullptr, 0};  // holds are the calling thread's, outside parallel work
  const int64_t stored_rows = t == Trans::N ? rows : cols, run = t == Trans::N ? cols : rows;
  for (const HeldWidened& h : held_widened()) {
    const auto at = reinterpret_cast<uintptr_t>(x), begin = reinterpret_cast<uintptr_t>(h.x);
    if (!h.x || ld != h.ld || at < begin || at >= begin + size_t(h.rows * h.ld) * sizeof(bf16)) continue;
    const int64_t offset = x - h.x, r0 = offset / ld, c0 = offset % ld;
    if (r0 + stored_rows <= h.rows && c0 + run <= h.cols) return {h.copy + r0 * h.cols + c0, h.cols};
  }
  return {nullptr, 0};
}

// Widens op(X)[r0, r0 + nr) x [c0, c0 + nc) of a bf16 operand stored with leading dimension ld
// into dst, packed in X's own layout; returns the copy's leading dimension (nc, or nr when X is
// stored transposed).
int64_t widen(Trans t, const bf16* x, int64_t ld, int64_t r0, int64_t nr, int64_t c0, int64_t nc, float* dst) {
  // Stored rows: op(X)'s rows (N) or its columns (T); each contributes `run` elements from `first`.
  const int64_t rows = t == Trans::N ? nr : nc, run = t == Trans::N ? nc : nr;
  const int64_t row0 = t == Trans::N ? r0 : c0, first = t == Trans::N ? c0 : r0;
  const auto widen_row = vector_ops().widen_bf16;
  if (run == ld) {  // whole stored rows: one contiguous span, a chunk of it per thread
    const bf16* src = x + row0 * ld;
    const int64_t n = rows * run;
    parallel_for(n, n > (int64_t(1) << 16),
                 [&](int64_t begin, int64_t end) { widen_row(src + begin, dst + begin, end - begin); });
    return run;
  }
  parallel_for(rows, rows * run > (int64_t(1) << 16), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) widen_row(x + (row0 + r) * ld + first, dst + r * run, run);
  });
  return run;
}

// op(X) of logical size rows x cols stored row-major with leading dimension ld.
dnnl::memory::desc operand_desc(Trans t, int64_t rows, int64_t cols, int64_t ld, dnnl::memory::data_type dt) {
  dnnl::memory::dims dims{rows, cols};
  dnnl::memory::dims strides = t == Trans::N ? dnnl::memory::dims{ld, 1} : dnnl::memory::dims{1, ld};
  return dnnl::memory::desc(dims, dt, strides);
}

// Elements an operand spans in memory: op(X) is rows x cols, stored with leading dimension ld.
size_t stored_elements(Trans t, int64_t rows, int64_t cols, int64_t ld) {
  return t == Trans::N ? size_t((rows - 1) * ld + cols) : size_t((cols - 1) * ld + rows);
}

// oneDNN 3 dropped the operation descriptors: a primitive descriptor is made from the memory
// descriptors directly.
dnnl::matmul::primitive_desc matmul_desc(const dnnl::memory::desc& a, const dnnl::memory::desc& b,
                                         const dnnl::memory::desc& c, const dnnl::primitive_attr& attr = {}) {
#if DNNL_VERSION_MAJOR >= 3
  return dnnl::matmul::primitive_desc(cpu_engine(), a, b, c, attr);
#else
  return dnnl::matmul::primitive_desc(dnnl::matmul::desc(a, b, c), attr, cpu_engine());
#endif
}

std::unique_ptr<GemmPlan> make_plan(const GemmKey& key) {
  using dt = dnnl::memory::data_type;
  const GemmShape& s = key.s;
  auto& engine = cpu_engine();
  auto c_desc = operand_desc(Trans::N, s.m, s.n, s.ldc, dt::f32);
  dnnl::primitive_attr attr;
  if (key.accumulate) {
    dnnl::post_ops ops;
    ops.append_sum(1.0f);
    attr.set_post_ops(ops);
  }
  auto plan = std::make_unique<GemmPlan>();
  auto try_type = [&](dt in_type) -> bool {
    auto a_desc = operand_desc(s.trans_a, s.m, s.k, s.lda, in_type);
    auto b_desc = operand_desc(s.trans_b, s.k, s.n, s.ldb, in_type);
    try {
      plan->primitive = dnnl::matmul(matmul_desc(a_desc, b_desc, c_desc, attr));
    } catch (const dnnl::error& e) {
      if (e.status != dnnl_unimplemented) throw;
      return false;
    }
    plan->a = dnnl::memory(a_desc, engine, DNNL_MEMORY_NONE);
    plan->b = dnnl::memory(b_desc, engine, DNNL_MEMORY_NONE);
    return true;
  };
  if (key.bf16 ? !bf16_matmul_native() || !try_type(dt::bf16) : !try_type(dt::f32)) {
    require(key.bf16, "gemm: oneDNN has no fp32 matmul for {}x{}x{}", s.m, s.n, s.k);
    plan->widened = true;
    bf16_emulated().store(true, std::memory_order_relaxed);
    return plan;
  }
  plan->c = dnnl::memory(c_desc, engine, DNNL_MEMORY_NONE);
  plan->args = {dnnl_exec_arg_t{DNNL_ARG_SRC, plan->a.get()}, dnnl_exec_arg_t{DNNL_ARG_WEIGHTS, plan->b.get()},
                dnnl_exec_arg_t{DNNL_ARG_DST, plan->c.get()}};
  return plan;
}

void validate(const GemmShape& s) {
  require(s.m > 0 && s.n > 0 && s.k > 0, "gemm: empty shape {}x{}x{}", s.m, s.n, s.k);
  require(s.lda >= (s.trans_a == Trans::N ? s.k : s.m) && s.ldb >= (s.trans_b == Trans::N ? s.n : s.k) && s.ldc >= s.n,
          "gemm: leading dimension smaller than the row length");
}

// The calling thread's plan for this product, built on first use.
GemmPlan& plan_for(bool bf16, const GemmShape& s, float beta) {
  validate(s);
  require(beta == 0.0f || beta == 1.0f, "gemm: beta must be 0 or 1, got {}", beta);
  thread_local std::unordered_map<GemmKey, std::unique_ptr<GemmPlan>, GemmKeyHash> cache;
  GemmKey key{bf16, s, beta == 1.0f};
  auto it = cache.find(key);
  if (it == cache.end()) it = cache.emplace(key, make_plan(key)).first;
  return *it->second;
}

void run(bool bf16, const GemmShape& s, const void* a, const void* b, float* c, float beta);

// op(X)[r0, r0 + nr) x [c0, c0 + nc) in fp32, and its leading dimension in `ld`: read where it is
// in X's held copy (`held`, leading dimension held_ld), else widened into `dst`.
const float* operand_tile(Trans t, const bf16* x, int64_t x_ld, const float* held, int64_t held_ld, int64_t r0,
                          int64_t nr, int64_t c0, int64_t nc, float* dst, int64_t& ld) {
  if (!held) {
    ld = widen(t, x, x_ld, r0, nr, c0, nc, dst);
    return dst;
  }
  ld = held_ld;
  return held + (t == Trans::N ? r0 * ld + c0 : c0 * ld + r0);
}

// A bf16 product where oneDNN has none: fp32 products over tiles of the operands widened to fp32
// (exactly), each tile at most kWidenedOperandElements, every element widened once. When both
// whole operands exceed that, K is cut first (the LM head's input gradient: [512, 32000] x
// [32000, 768]; C is small and the chunks accumulate into it); then M (the LM head's weight
// gradient, [32000, 512] x [512, 768]) or N (its logits, [512, 768] x [768, 32000]). The fp32
// sums of a product then come in K-chunks, another order than one fp32 product: it is an
// emulation of bf16 inputs with fp32 accumulation either way.
// An operand held widened (gemm_hold_widened) is read where it is, tile by tile, and widens nothing.
void run_widened(const GemmShape& s, const bf16* a, const bf16* b, float* c, float beta) {
  const auto [held_a, held_lda] = held_operand(s.trans_a, a, s.m, s.k, s.lda);
  const auto [held_b, held_ldb] = held_operand(s.trans_b, b, s.k, s.n, s.ldb);
  const int64_t E = int64_t(kWidenedOperandElements);
  int64_t kt = s.k, mt = s.m, nt = s.n;
  if (s.m * kt > E && kt * s.n > E) kt = std::clamp<int64_t>(std::min(E / s.m, E / s.n), 1, s.k);
  if (s.m * kt > E) mt = std::max<int64_t>(1, E / kt);
  if (kt * s.n > E) nt = std::max<int64_t>(1, E / kt);
  WidenedOperands& wide = widened_operands();
  wide.reserve(held_a ? 0 : size_t(std::min(mt * kt, s.m * s.k)), held_b ? 0 : size_t(std::min(kt * nt, s.k * s.n)));
  auto tile_a = [&](int64_t m0, int64_t mn, int64_t k0, int64_t kn, int64_t& ld) {
    return operand_tile(s.trans_a, a, s.lda, held_a, held_lda, m0, mn, k0, kn, wide.a.data(), ld);
  };
  auto tile_b = [&](int64_t k0, int64_t kn, int64_t n0, int64_t nn, int64_t& ld) {
    return operand_tile(s.trans_b, b, s.ldb, held_b, held_ldb, k0, kn, n0, nn, wide.b.data(), ld);
  };
  for (int64_t k0 = 0; k0 < s.k; k0 += kt) {
    const int64_t kn = std::min(kt, s.k - k0);
    const float tile_beta = k0 == 0 ? beta : 1.0f;
    int64_t lda = 0, ldb = 0;
    const float* wa = mt == s.m ? tile_a(0, s.m, k0, kn, lda) : nullptr;  // once per K-chunk
    for (int64_t n0 = 0; n0 < s.n; n0 += nt) {
      const int64_t nn = std::min(nt, s.n - n0);
      const float* wb = tile_b(k0, kn, n0, nn, ldb);
      for (int64_t m0 = 0; m0 < s.m; m0 += mt) {
        const int64_t mn = std::min(mt, s.m - m0);
        const float* pa = mt == s.m ? wa : tile_a(m0, mn, k0, kn, lda);
        run(false, GemmShape{s.trans_a, s.trans_b, mn, nn, kn, lda, ldb, s.ldc}, pa, wb, c + m0 * s.ldc + n0,
            tile_beta);
      }
    }
  }
}

// Calls f(chunk, k0, chunk_beta) for the K-chunks of an fp32 product longer than kKChunk: chunk
// boundaries at multiples of kKChunk from K's start, the first chunk with the product's beta and
// the rest accumulating (beta 1). (gemm_prepare builds the same chunks' plans.)
template <typename F>
void for_each_k_chunk(const GemmShape& s, float beta, F&& f) {
  for (int64_t k0 = 0; k0 < s.k; k0 += kKChunk) {
    GemmShape chunk = s;
    chunk.k = std::min(kKChunk, s.k - k0);
    f(chunk, k0, k0 == 0 ? beta : 1.0f);
  }
}

void execute(GemmPlan& plan, const void* a, const void* b, float* c) {
  plan.a.set_data_handle(const_cast<void*>(a));
  plan.b.set_data_handle(const_cast<void*>(b));
  plan.c.set_data_handle(c);
  dnnl::error::wrap_c_api(
      dnnl_primitive_execute(plan.primitive.get(), cpu_stream().get(), int(plan.args.size()), plan.args.data()),
      "could not execute a matmul");
  cpu_stream().wait();
}

void run(bool bf16, const GemmShape& s, const void* a, const void* b, float* c, float beta) {
  if (!bf16 && s.k > kKChunk) {
    const auto* fa = static_cast<const float*>(a);
    const auto* fb = static_cast<const float*>(b);
    return for_each_k_chunk(s, beta, [&](const GemmShape& chunk, int64_t k0, float chunk_beta) {
      // op(A)[:, k0:] and op(B)[k0:, :]: columns of a row-major A (rows of a transposed one), rows
      // of a row-major B (columns of a transposed one).
      const float* ca = s.trans_a == Trans::N ? fa + k0 : fa + k0 * s.lda;
      const float* cb = s.trans_b == Trans::N ? fb + k0 * s.ldb : fb + k0;
      execute(plan_for(false, chunk, chunk_beta), ca, cb, c);
    });
  }
  GemmPlan& plan = plan_for(bf16, s, beta);
  if (plan.widened)
    return run_widened(s, static_cast<const keel::bf16*>(a), static_cast<const keel::bf16*>(b), c, beta);
  execute(plan, a, b, c);
}

// keel's own split of a bf16 product over the threads: each thread runs one single-threaded
// oneDNN product on its share of the output, columns (N) or, for a weight gradient (op(A) = A^T,
// M = the weight's rows), rows (M), a multiple of 32 each. oneDNN 2.6's own partition of one
// product over two threads left a thread waiting at its end: on the Qwen3-MoE bench (AMD EPYC,
// AVX-512 BF16, 2 threads, 2026-12-07) the split products took 9% less time than the same products
// on all threads (`ONEDNN_VERBOSE`, bench/onednn_verbose_summary.py), and the step less too
// (bench/keel_before_after.py against the same binary under KEEL_GEMM_SPLIT=0; docs/performance.md).
// Shares below kSplitMinExtent would leave each thread's product too small to run at speed, so
// many threads split only the largest products (the LM head), and the rest go to oneDNN whole.
// Inside a parallel region (attention's per-head products) a product runs on its thread anyway.
// KEEL_GEMM_SPLIT=0 turns the split off.
constexpr int64_t kSplitMinExtent = 256, kSplitAlign = 32;

bool split_enabled() {
  static const bool enabled = [] {
    const char* env = std::getenv("KEEL_GEMM_SPLIT");
    return env == nullptr || std::string(env) != "0";
  }();
  return enabled;
}

}  // namespace

bool bf16_products_split() { return max_threads() > 1 && split_enabled() && bf16_matmul_native(); }

ProductShares bf16_product_shares(const GemmShape& s) {
  const int64_t threads = max_threads();
  if (!bf16_products_split()) return {};
  const bool by_rows = s.trans_a == Trans::T;
  const int64_t extent = by_rows ? s.m : s.n;
  if (extent < kSplitMinExtent * threads) return {};
  const int64_t share = (extent / threads + kSplitAlign - 1) / kSplitAlign * kSplitAlign;
  return {(extent + share - 1) / share, share, by_rows};
}

namespace {

// The split gemm_bf16 runs now: none inside a parallel region, where the product runs on its thread.
ProductShares thread_split(bool bf16, const GemmShape& s) {
  if (!bf16 || in_parallel_region()) return {};
  return bf16_product_shares(s);
}

// f(part) for each part, part t on thread t (parallel_for gives n <= threads one index each).
template <typename F>
void for_each_part(const ProductShares& split, F&& f) {
  parallel_for(split.parts, true, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) f(t);
  });
}

// Whether oneDNN has a bf16 matmul on this CPU at all (x86 before AVX-512 has none).
bool onednn_has_bf16_matmul() {
  using dt = dnnl::memory::data_type;
  const dnnl::memory::desc a({8, 8}, dt::bf16, dnnl::memory::dims{8, 1}), c({8, 8}, dt::f32, dnnl::memory::dims{8, 1});
  try {
    matmul_desc(a, a, c);
    return true;
  } catch (const dnnl::error&) {
    return false;
  }
}

// FLOP/s of oneDNN's n^3 matmul in bf16 and in fp32, timed in turns (so that another process's
// load slows both alike), the best of `repeats` each. Its own primitives, not measure_gemm's:
// gemm_bf16 asks bf16_products, which this measurement decides.
std::pair<double, double> time_bf16_and_f32(int64_t n, int repeats) {
  using dt = dnnl::memory::data_type;
  struct Timed {
    dnnl::matmul primitive;
    dnnl::memory a, b, c;
    double best = 1e30;
  };
  auto make = [&](dt in) {
    const dnnl::memory::desc ad({n, n}, in, dnnl::memory::dims{n, 1}), cd({n, n}, dt::f32, dnnl::memory::dims{n, 1});
    Timed t{dnnl::matmul(matmul_desc(ad, ad, cd)), dnnl::memory(ad, cpu_engine()), dnnl::memory(ad, cpu_engine()),
            dnnl::memory(cd, cpu_engine())};
    const size_t bytes = ad.get_size();
    std::memset(t.a.get_data_handle(), 0x3f, bytes);  // 0x3f3f: about 0.75 in bf16, 0.75 in fp32
    std::memset(t.b.get_data_handle(), 0x3f, bytes);
    return t;
  };
  // On one thread: a product over all threads waits for the slowest at its end, so another
  // process's load on any core shows in the time, in bursts that can favour either type (the
  // fp32 / bf16 ratio over 60 runs on a 2-core machine busy compiling: 1.40-2.75 on both threads,
  // 1.78-2.36 on one).
  struct OneThread {  // restored however the timing ends (a oneDNN error included)
#ifdef _OPENMP
    int threads = omp_get_max_threads();
    OneThread() { omp_set_num_threads(1); }
    ~OneThread() { omp_set_num_threads(threads); }
#endif
  } one_thread [[maybe_unused]];
  Timed timed[2] = {make(dt::bf16), make(dt::f32)};
  for (int r = 0; r <= repeats; ++r)  // round 0 warms up
    for (Timed& t : timed) {
      const auto t0 = std::chrono::steady_clock::now();
      t.primitive.execute(cpu_stream(), {{DNNL_ARG_SRC, t.a}, {DNNL_ARG_WEIGHTS, t.b}, {DNNL_ARG_DST, t.c}});
      cpu_stream().wait();
      const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      if (r > 0) t.best = std::min(t.best, s);
    }
  const double flops = 2.0 * double(n) * double(n) * double(n);
  return {flops / timed[0].best, flops / timed[1].best};
}

// What keep_bf16_products asked for before the choice was made: native or not, and why.
struct KeptProducts {
  bool asked = false, native = false;
  std::string why;
};
KeptProducts& kept_products() {
  static KeptProducts kept;
  return kept;
}

// Widened where oneDNN has no bf16 matmul; else as KEEL_BF16_MATMUL asks; else as a resume's
// checkpoint records (keep_bf16_products); else native with AMX (its tiles multiply bf16 several
// times faster than fp32); else by the machine's measured rates: an AVX-512 BF16 CPU without AMX
// may run oneDNN's bf16 kernels slower than its fp32 ones (a Sapphire Rapids VM with AMX hidden:
// 168 against 314 GFLOP/s), and then the exact widening wins. The margin keeps a noisy
// measurement from landing on the wrong side, and keeping the rates keeps every process of the
// machine on the same side (their bits differ).
Bf16Products choose_bf16_products() {
  Bf16Products p;
  const char* env = std::getenv("KEEL_BF16_MATMUL");
  const std::string want = env != nullptr ? env : "";
  require(want.empty() || want == "native" || want == "widened", "KEEL_BF16_MATMUL={}: expected native or widened",
          want);
  if (!onednn_has_bf16_matmul()) {
    p.reason = want == "native" || (kept_products().asked && kept_products().native)
                   ? "no oneDNN bf16 matmul on this CPU, whatever was asked"
                   : "no oneDNN bf16 matmul on this CPU";
    return p;
  }
  if (!want.empty()) {
    p.native = want == "native";
    p.reason = "KEEL_BF16_MATMUL=" + want;
    return p;
  }
  if (kept_products().asked) {
    p.native = kept_products().native;
    p.reason = kept_products().why;
    return p;
  }
  const auto isa = static_cast<unsigned>(dnnl::get_effective_cpu_isa());
  const auto amx = static_cast<unsigned>(dnnl::cpu_isa::avx512_core_amx);
  if ((isa & amx) == amx) {
    p.native = true;
    p.reason = "AMX";
    return p;
  }
  // Timed once per machine and kept (matmul_rates_record.h): every later process decides from the
  // same rates, so runs of one recipe, and the ranks of a job, multiply alike. Another CPU, oneDNN
  // or way of timing is another machine.
  const dnnl_version_t* v = dnnl_version();
  const std::string machine = fmt::format("{} | oneDNN {}.{}.{} | isa {:#x} | 768^3, one thread, best of 5",
                                          cpu_model_name(), v->major, v->minor, v->patch, isa);
  const std::string path = matmul_rates_path();
  const RecordedRates rates = recorded_rates(path, machine, [] { return time_bf16_and_f32(768, 5); });
  p.bf16_flops = rates.bf16_flops;
  p.f32_flops = rates.f32_flops;
  p.native = p.f32_flops < kWidenAbove * p.bf16_flops;
  p.reason = fmt::format("oneDNN's matmul on one thread of this CPU: bf16 {:.0f} GFLOP/s, fp32 {:.0f}{}",
                         p.bf16_flops / 1e9, p.f32_flops / 1e9,
                         rates.recorded ? fmt::format(", measured {}, kept in {}", rates.measured_on, path)
                         : rates.kept   ? fmt::format(", measured now, kept in {}", path)
                                        : "");
  return p;
}

}  // namespace

void gemm_hold_widened(int slot, const bf16* x, int64_t rows, int64_t cols, int64_t ld, float* copy) {
  require(slot >= 0 && slot < kHeldWidenedSlots, "gemm_hold_widened: slot {} of {}", slot, kHeldWidenedSlots);
  require(rows > 0 && cols > 0 && ld >= cols, "gemm_hold_widened: {} x {} with leading dimension {}", rows, cols, ld);
  if (bf16_matmul_native()) return;
  widen(Trans::N, x, ld, 0, rows, 0, cols, copy);
  held_widened()[size_t(slot)] = HeldWidened{x, rows, cols, ld, copy};
}

void gemm_release_widened(int slot) {
  require(slot >= 0 && slot < kHeldWidenedSlots, "gemm_release_widened: slot {} of {}", slot, kHeldWidenedSlots);
  held_widened()[size_t(slot)] = HeldWidened{};
}

size_t gemm_widened_operand_bytes(bool bf16) {
  return bf16 && !bf16_matmul_native() ? 2 * kWidenedOperandElements * sizeof(float) : 0;
}

bool gemm_bf16_emulated() { return bf16_emulated().load(std::memory_order_relaxed); }

const Bf16Products& bf16_products() {
  static const Bf16Products chosen = choose_bf16_products();
  return chosen;
}

const Bf16Products& keep_bf16_products(bool native, const std::string& why) {
  // Before the first bf16_products() call (the function-local static below is built then), the
  // request decides; after it, the way stays as chosen and the caller sees the difference.
  KeptProducts& kept = kept_products();
  if (!kept.asked) kept = KeptProducts{true, native, why};
  return bf16_products();
}

bool bf16_matmul_native() { return bf16_products().native; }

void gemm_f32(const GemmShape& s, const float* a, const float* b, float* c, float beta) {
  run(false, s, a, b, c, beta);
}

void gemm_bf16(const GemmShape& s, const bf16* a, const bf16* b, float* c, float beta) {
  const ProductShares split = thread_split(true, s);
  if (split.parts <= 1) return run(true, s, a, b, c, beta);
  for_each_part(split, [&](int64_t t) {
    const ProductShares::Part part = split.part(s, t);
    run(true, part.shape, a + part.a, b + part.b, c + part.c, beta);
  });
}

void gemm_prepare(const GemmShape& s, bool bf16_inputs, float beta) {
  if (!bf16_inputs && s.k > kKChunk)
    return for_each_k_chunk(s, beta, [](const GemmShape& chunk, int64_t, float b) { plan_for(false, chunk, b); });
  const ProductShares split = thread_split(bf16_inputs, s);
  if (split.parts <= 1) plan_for(bf16_inputs, s, beta);  // the whole product, as a call from here runs it
  // Where keel cuts bf16 products, every thread's plans for each share (or the whole product, not
  // cut): gemm_bf16 runs share t on thread t, and tasks that run products themselves (the experts',
  // experts.cpp) run a share, or a product too narrow to cut, on whichever thread takes the task.
  if (bf16_inputs && !in_parallel_region() && bf16_products_split())
    for_each_task(max_threads(), true, [&](int64_t, int) {
      for (int64_t t = 0; t < split.parts; ++t) plan_for(true, split.part(s, t).shape, beta);
    });
}

double measure_gemm(bool use_bf16, const GemmShape& s, int repeats) {
  validate(s);
  // The operands in an arena planned as the decoder's is (64-byte lines, pages touched up front):
  // oneDNN's AMX kernels run about 25% slower on operands 16 or 32 bytes off a line, which is where
  // std::vector's allocation puts them.
  const size_t a_elements = stored_elements(s.trans_a, s.m, s.k, s.lda);
  const size_t b_elements = stored_elements(s.trans_b, s.k, s.n, s.ldb);
  const size_t c_elements = size_t((s.m - 1) * s.ldc + s.n);
  const size_t element = use_bf16 ? sizeof(bf16) : sizeof(float);
  MemoryPlan plan;
  const int a_id = plan.add("a", MemoryCategory::Workspace, a_elements * element, 0, 0);
  const int b_id = plan.add("b", MemoryCategory::Workspace, b_elements * element, 0, 0);
  const int c_id = plan.add("c", MemoryCategory::Workspace, c_elements * sizeof(float), 0, 0);
  Arena arena(plan.arena_bytes());
  std::byte *a = arena.at<std::byte>(plan.offset(a_id)), *b = arena.at<std::byte>(plan.offset(b_id));
  float* c = arena.at<float>(plan.offset(c_id));
  auto once = [&] {
    if (use_bf16)
      gemm_bf16(s, reinterpret_cast<bf16*>(a), reinterpret_cast<bf16*>(b), c, 0.0f);
    else
      gemm_f32(s, reinterpret_cast<float*>(a), reinterpret_cast<float*>(b), c, 0.0f);
  };
  if (use_bf16) {
    std::fill_n(reinterpret_cast<bf16*>(a), a_elements, float_to_bf16(0.5f));
    std::fill_n(reinterpret_cast<bf16*>(b), b_elements, float_to_bf16(0.25f));
  } else {
    std::fill_n(reinterpret_cast<float*>(a), a_elements, 0.5f);
    std::fill_n(reinterpret_cast<float*>(b), b_elements, 0.25f);
  }
  once();  // warm-up: primitive creation
  double best = 1e30;
  for (int r = 0; r < repeats; ++r) {
    auto t0 = std::chrono::steady_clock::now();
    once();
    best = std::min(best, std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  }
  return 2.0 * double(s.m) * double(s.n) * double(s.k) / best;
}

double measure_matmul_peak(bool use_bf16, int64_t size, int repeats) {
  return measure_gemm(use_bf16, packed_gemm(Trans::N, Trans::N, size, size, size), repeats);
}

}  // namespace keel::kernels
