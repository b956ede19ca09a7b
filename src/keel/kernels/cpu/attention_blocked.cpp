// Causal grouped-query attention over blocks of query rows, every product a GEMM.
//
// For one head and a block of rows [i0, i1) that may see keys [k0, i1) (k0 = 0, or the start of
// the block's first document when packed documents make earlier keys invisible):
//   forward   S = Q_blk K^T,  P = softmax(scale * S) over allowed keys,  O_blk = P V,
//             lse = log-sum-exp of the row (saved);
//   backward  S = Q_blk K^T,  P = exp(scale * S - lse),  dP = dO_blk V^T,
//             dS = scale * P (dP - D)  with D_i = sum_j P_ij dP_ij,
//             dV += P^T dO_blk,  dK += dS^T Q_blk,  dQ_blk = dS K.
// D is summed from the row's own P and dP, not taken as dO_i . O_i (equal in exact arithmetic,
// and what a kernel that tiles the keys must use): in bf16, O was made from bf16-rounded P and dP
// from bf16-rounded dO, so dO . O misses sum_j P_ij dP_ij by ~2^-9 |D_i| and every row of dS then
// sums to that instead of 0. Softmax ignores a shift of all of a row's scores; that error does
// not, and lands on what only shifts scores: a k bias, wholly in its non-rotary channels and
// nearly in its slow rotary ones, where AdamW turns it into lr-sized steps. (GLM-4's bf16
// reference over six seeds: the k bias was keel's farthest tensor from fp32, up to 2.70x torch
// bf16's own distance, one element 4.6x; with the row's own D, 1.12-1.77x, and no bias.) Each
// block holds its rows' every visible key, so the row's own sum is one more pass over a row
// already in cache, and the pass over dO . O is gone.
// The scalar flash kernel (attention.cpp) tiles the keys and so takes dO . O (the reference
// backend runs it in double, where the two agree); otherwise it does the same arithmetic one row
// at a time. Here the O(seq^2 * head_dim) work runs in oneDNN's GEMMs (AVX-512 / AVX-512 BF16 / AMX, or AVX2, chosen
// by oneDNN at run time) and only the O(seq^2) softmax is ours, vectorised.
//
// The products write packed rows (row stride head_dim) in the thread's workspace, copied to the
// strided [tokens, heads * head_dim] outputs once a block (O, dQ) or a head (dK, dV, accumulated
// over every query block) is done: oneDNN runs these narrow products 1.5-3x slower into rows
// 768 floats apart (`dV += P^T dO` for 1,024 keys, head_dim 64: 27 us with row stride 768, 15 us
// packed), and the accumulators stay in cache.
//
// Threads: each OpenMP thread takes whole heads (forward: a (sequence, q head); backward: a
// (sequence, kv head) with all q heads of its group, so dk/dv have one writer) and calls
// single-threaded GEMMs on its own slice of the workspace; results do not depend on the thread
// count or on scheduling.
#include <algorithm>
#include <utility>
#include <vector>
#include <cmath>
#include <cstring>
#include <limits>
#include <type_traits>

#include "keel/core/dtype.h"
#include "keel/core/error.h"
#include "keel/core/threads.h"
#include "keel/kernels/attention.h"
#include "keel/kernels/cpu/flush_denormals.h"
#include "keel/kernels/cpu/prefetch.h"
#include "keel/kernels/cpu/vector_ops.h"
#include "keel/kernels/gemm.h"

namespace keel::kernels {
namespace {

// Query rows per block. Causal blocks on the diagonal compute scores for keys past the row that
// the mask then drops: ~block/seq of the work. 64 keeps that at 6% for seq 1024 while the GEMMs
// stay large enough for oneDNN's kernels.
constexpr int64_t kBlock = 64;
constexpr size_t kAlign = 64;
// Below this many multiply-adds (batch * q_heads * seq^2 * head_dim) one thread is faster.
constexpr int64_t kParallelMinWork = int64_t(1) << 20;

size_t align_up(size_t n) { return (n + kAlign - 1) / kAlign * kAlign; }

inline void matmul(const GemmShape& s, const float* a, const float* b, float* c, float beta) {
  gemm_f32(s, a, b, c, beta);
}
inline void matmul(const GemmShape& s, const bf16* a, const bf16* b, float* c, float beta) {
  gemm_bf16(s, a, b, c, beta);
}
// The products of one block: `rows` query rows against its `n` keys, head_dim hd, on packed
// [rows|n, hd] operands. Spelled once here for the kernels and for prepare_attention_blocked.
struct BlockProducts {
  int64_t rows, n, hd;
  // [rows, n] = [rows, hd] x [n, hd]^T: the scores Q K^T, and dP = dO V^T.
  GemmShape rows_by_keys() const { return {Trans::N, Trans::T, rows, n, hd, hd, hd, n}; }
  // [rows, hd] = [rows, n] x [n, hd] into packed rows: P V (O), dS K (dQ).
  GemmShape rows_by_dim() const { return {Trans::N, Trans::N, rows, hd, n, n, hd, hd}; }
  // [n, hd] += [rows, n]^T x [rows, hd] into packed rows: P^T dO (dV), dS^T Q (dK).
  GemmShape keys_by_dim() const { return {Trans::T, Trans::N, n, hd, rows, n, hd, hd}; }
};

inline void store(float x, float* dst) { *dst = x; }
inline void store(float x, bf16* dst) { *dst = float_to_bf16(x); }

// One thread's slice of the workspace: packed copies of the head's operands ([seq, head_dim],
// in the GEMM input type M) and one block's rows of scores.
template <typename M>
struct ThreadScratch {
  M *q, *k, *v, *dout;  // [seq, head_dim] each
  float *s, *dp;        // [kBlock, seq] scores (then fp32 probabilities) and dP
  M *p, *ds;            // [kBlock, seq] probabilities and score gradients as GEMM inputs
  float* cap;           // [kBlock, seq] soft-capping's d(capped)/d(score) (null without a cap)
  float *dk, *dv;       // [seq, head_dim] the kv head's gradients as they accumulate, packed
  float* rows_out;      // [kBlock, head_dim] one block's O or dQ rows, packed

  // Bytes of each section: packed operands, fp32 rows, rows in the GEMM input type (none in
  // fp32, where the GEMMs read the fp32 rows).
  struct Sizes {
    size_t operand, row_f32, row_m, accumulator, block_rows;
    Sizes(int64_t seq, int64_t head_dim)
        : operand(align_up(size_t(seq * head_dim) * sizeof(M))),
          row_f32(align_up(size_t(kBlock * seq) * sizeof(float))),
          row_m(std::is_same_v<M, float> ? 0 : align_up(size_t(kBlock * seq) * sizeof(M))),
          accumulator(align_up(size_t(seq * head_dim) * sizeof(float))),
          block_rows(align_up(size_t(kBlock * head_dim) * sizeof(float))) {}
  };

  static size_t bytes(int64_t seq, int64_t head_dim, bool softcap) {
    const Sizes z(seq, head_dim);
    return 4 * z.operand + (softcap ? 3 : 2) * z.row_f32 + 2 * z.row_m + 2 * z.accumulator + z.block_rows;
  }
  static ThreadScratch at(char* base, int64_t seq, int64_t head_dim, bool softcap) {
    const Sizes z(seq, head_dim);
    const size_t operand = z.operand, row_f32 = z.row_f32, row_m = z.row_m;
    ThreadScratch t;
    t.q = reinterpret_cast<M*>(base);
    t.k = reinterpret_cast<M*>(base + operand);
    t.v = reinterpret_cast<M*>(base + 2 * operand);
    t.dout = reinterpret_cast<M*>(base + 3 * operand);
    char* rows = base + 4 * operand;
    t.s = reinterpret_cast<float*>(rows);
    t.dp = reinterpret_cast<float*>(rows + row_f32);
    if constexpr (std::is_same_v<M, float>) {  // fp32 GEMMs read the fp32 rows in place
      t.p = t.s;
      t.ds = t.dp;
    } else {
      t.p = reinterpret_cast<M*>(rows + 2 * row_f32);
      t.ds = reinterpret_cast<M*>(rows + 2 * row_f32 + row_m);
    }
    char* after_rows = rows + 2 * row_f32 + 2 * row_m;
    t.cap = softcap ? reinterpret_cast<float*>(after_rows) : nullptr;
    char* packed = after_rows + (softcap ? row_f32 : 0);
    t.dk = reinterpret_cast<float*>(packed);
    t.dv = reinterpret_cast<float*>(packed + z.accumulator);
    t.rows_out = reinterpret_cast<float*>(packed + 2 * z.accumulator);
    return t;
  }
};

// Copies one head's [seq, head_dim] slice of a strided [tokens, ld] buffer into packed rows (fp32
// rows rounded to bf16 values when `widened`).
template <typename M>
void pack_head(const float* base, int64_t ld, int64_t token0, int64_t head, int64_t seq, int64_t head_dim, M* dst,
               bool widened) {
  const VectorOps& ops = vector_ops();
  for (int64_t t = 0; t < seq; ++t) {
    const float* row = base + (token0 + t) * ld + head * head_dim;
    // One head's head_dim floats a row, ld apart: a walk the hardware does not prefetch (prefetch.h).
    if (t + kPrefetchRows < seq) prefetch_lines(row + kPrefetchRows * ld, sizeof(float) * size_t(head_dim));
    if constexpr (std::is_same_v<M, float>) {
      if (widened)
        ops.scale_round_bf16(row, 1.0f, dst + t * head_dim, head_dim);
      else
        std::memcpy(dst + t * head_dim, row, sizeof(float) * size_t(head_dim));
    } else {
      ops.scale_to_bf16(row, 1.0f, dst + t * head_dim, head_dim);
    }
  }
}

// Copies `rows` packed [rows, head_dim] rows into head `head`'s columns of a strided [tokens, ld]
// buffer from token `token0` on.
void unpack_rows(const float* src, int64_t rows, int64_t head_dim, float* base, int64_t ld, int64_t token0,
                 int64_t head) {
  for (int64_t t = 0; t < rows; ++t)
    std::memcpy(base + (token0 + t) * ld + head * head_dim, src + t * head_dim, sizeof(float) * size_t(head_dim));
}

// The first key any row of [i0, i1) may attend, rounded down to a block boundary (so GEMM shapes
// repeat): the start of the block's first document with packed documents, and no earlier than
// the first row's sliding window. The document bound is exact only when each document is one run
// of positions with ids increasing run by run, as packing writes them; otherwise every key from 0
// is visited and the mask alone decides.
int64_t first_key(const AttentionShape& s, const int32_t* seg, bool runs_increase, int64_t i0) {
  int64_t j = 0;
  if (seg != nullptr && runs_increase) {
    j = i0;
    while (j > 0 && seg[j - 1] == seg[i0]) --j;
  }
  if (s.window > 0) j = std::max(j, i0 - s.window + 1);
  return j / kBlock * kBlock;
}

bool runs_increase(const int32_t* seg, int64_t seq) {
  if (seg == nullptr) return true;
  for (int64_t t = 1; t < seq; ++t)
    if (seg[t] != seg[t - 1] && seg[t] < seg[t - 1]) return false;
  return true;
}

// Key c (position k0 + c) is visible to row i: causal, inside the sliding window and, with
// packing, same document.
struct RowMask {
  const int32_t* seg;  // the sequence's ids, or null
  int64_t i, k0, window;
  int64_t causal_count() const { return i - k0 + 1; }
  int64_t first_in_window() const { return window > 0 ? std::max<int64_t>(0, i - window + 1 - k0) : 0; }
};

RowVisibility visibility(const RowMask& mask, int64_t n) {
  return {std::min(n, mask.causal_count()), mask.seg ? mask.seg + mask.k0 : nullptr, mask.seg ? mask.seg[mask.i] : 0,
          mask.first_in_window()};
}

// Forward softmax of one row of scores s[0, n): p = exp(scale*s - m) / sum over visible keys,
// written to p (the GEMM input type; in fp32, p is s itself, rounded to bf16 values when
// `widened`). Returns the row's log-sum-exp (-inf when nothing is visible).
template <typename M>
float softmax_row(const RowMask& mask, float scale, int64_t n, float* s, M* p, bool widened) {
  const VectorOps& ops = vector_ops();
  const RowVisibility vis = visibility(mask, n);
  const float mx = ops.masked_max(s, vis);
  if (mx == -std::numeric_limits<float>::infinity()) {  // no visible key (not possible causally)
    for (int64_t c = 0; c < n; ++c) store(0.0f, p + c);
    return mx;
  }
  const float m = mx * scale;  // scale > 0, so the max of the scaled scores
  const float sum = ops.exp_and_sum(s, n, scale, m, vis);
  if constexpr (std::is_same_v<M, float>) {
    if (widened)
      ops.scale_round_bf16(s, 1.0f / sum, s, n);
    else
      ops.scale(s, 1.0f / sum, n);
  } else {
    ops.scale_to_bf16(s, 1.0f / sum, p, n);
  }
  return m + std::log(sum);
}

// Backward of one row: p = exp(scale*s - lse) over visible keys, ds = scale * p * (dp - D) with
// D = sum p dp (see the top of this file),
// computed in place in fp32 (s becomes p, dp becomes ds), then converted to the GEMM input type
// (or, `widened`, rounded to bf16 values in place). With soft-capping, s is already capped
// (scale 1) and ds is multiplied by the cap's slope.
template <typename M>
void softmax_backward_row(const RowMask& mask, float scale, float lse, int64_t n, float* s, float* dp,
                          M* p, M* ds, const float* cap_slope, bool widened) {
  const VectorOps& ops = vector_ops();
  RowVisibility vis = visibility(mask, n);
  if (lse == -std::numeric_limits<float>::infinity()) vis.visible = 0;
  if (!cap_slope) {  // the GEMMs read only the rounded rows: written straight from the formulas
    if constexpr (!std::is_same_v<M, float>) {
      ops.softmax_grad_to_bf16(s, dp, n, scale, lse, vis, p, ds);
      return;
    } else if (widened) {
      ops.softmax_grad_round_bf16(s, dp, n, scale, lse, vis);
      return;
    }
  }
  ops.softmax_grad(s, dp, n, scale, lse, vis);
  if (cap_slope)
    for (int64_t c = 0; c < n; ++c) dp[c] *= cap_slope[c];
  if constexpr (!std::is_same_v<M, float>) {
    ops.scale_to_bf16(s, 1.0f, p, n);
    ops.scale_to_bf16(dp, 1.0f, ds, n);
  } else if (widened) {
    ops.scale_round_bf16(s, 1.0f, s, n);
    ops.scale_round_bf16(dp, 1.0f, dp, n);
  }
}

template <typename M>
void forward_head(const AttentionShape& s, const float* q, const float* k, const float* v, const int32_t* seg,
                  float* out, float* lse, int64_t b, int64_t h, ThreadScratch<M>& w, bool widened) {
  const int64_t hd = s.head_dim, T = s.seq, token0 = b * T, kv = h / (s.q_heads / s.kv_heads);
  const float scale = float(s.scale), cap = float(s.softcap);
  const bool runs = runs_increase(seg, T);
  pack_head(q, s.ldq, token0, h, T, hd, w.q, widened);
  pack_head(k, s.ldk, token0, kv, T, hd, w.k, widened);
  pack_head(v, s.ldv, token0, kv, T, hd, w.v, widened);
  float* lse_h = lse + (b * s.q_heads + h) * T;
  for (int64_t i0 = 0; i0 < T; i0 += kBlock) {
    const int64_t rows = std::min(kBlock, T - i0), k0 = first_key(s, seg, runs, i0), n = i0 + rows - k0;
    const BlockProducts block{rows, n, hd};
    matmul(block.rows_by_keys(), w.q + i0 * hd, w.k + k0 * hd, w.s, 0.0f);
    for (int64_t r = 0; r < rows; ++r) {
      // Soft-capping (Gemma 2): the row becomes cap * tanh(scale * s / cap); the softmax then runs with scale 1.
      if (cap > 0) vector_ops().soft_cap(w.s + r * n, n, scale, cap, nullptr);
      lse_h[i0 + r] =
          softmax_row(RowMask{seg, i0 + r, k0, s.window}, cap > 0 ? 1.0f : scale, n, w.s + r * n, w.p + r * n, widened);
    }
    matmul(block.rows_by_dim(), w.p, w.v + k0 * hd, w.rows_out, 0.0f);
    unpack_rows(w.rows_out, rows, hd, out, s.ldo, token0 + i0, h);
  }
}

template <typename M>
void backward_kv_head(const AttentionShape& s, const float* q, const float* k, const float* v, const int32_t* seg,
                      const float* lse, const float* dout, float* dq, float* dk, float* dv, int64_t b,
                      int64_t kv, ThreadScratch<M>& w, bool widened) {
  const int64_t hd = s.head_dim, T = s.seq, token0 = b * T, group = s.q_heads / s.kv_heads;
  const float scale = float(s.scale), cap = float(s.softcap);
  const bool runs = runs_increase(seg, T);
  pack_head(k, s.ldk, token0, kv, T, hd, w.k, widened);
  pack_head(v, s.ldv, token0, kv, T, hd, w.v, widened);
  // dK, dV accumulate over every block of every q head, packed, then go out once.
  std::memset(w.dk, 0, sizeof(float) * size_t(T * hd));
  std::memset(w.dv, 0, sizeof(float) * size_t(T * hd));
  for (int64_t g = 0; g < group; ++g) {
    const int64_t h = kv * group + g;
    pack_head(q, s.ldq, token0, h, T, hd, w.q, widened);
    pack_head(dout, s.ldo, token0, h, T, hd, w.dout, widened);
    const float* lse_h = lse + (b * s.q_heads + h) * T;
    for (int64_t i0 = 0; i0 < T; i0 += kBlock) {
      const int64_t rows = std::min(kBlock, T - i0), k0 = first_key(s, seg, runs, i0), n = i0 + rows - k0;
      const BlockProducts block{rows, n, hd};
      matmul(block.rows_by_keys(), w.q + i0 * hd, w.k + k0 * hd, w.s, 0.0f);
      matmul(block.rows_by_keys(), w.dout + i0 * hd, w.v + k0 * hd, w.dp, 0.0f);
      for (int64_t r = 0; r < rows; ++r) {
        float* slope = cap > 0 ? w.cap + r * n : nullptr;
        if (cap > 0) vector_ops().soft_cap(w.s + r * n, n, scale, cap, slope);  // slope: d capped / d raw
        softmax_backward_row(RowMask{seg, i0 + r, k0, s.window}, cap > 0 ? 1.0f : scale, lse_h[i0 + r], n,
                             w.s + r * n, w.dp + r * n, w.p + r * n, w.ds + r * n, slope, widened);
      }
      matmul(block.keys_by_dim(), w.p, w.dout + i0 * hd, w.dv + k0 * hd, 1.0f);
      matmul(block.keys_by_dim(), w.ds, w.q + i0 * hd, w.dk + k0 * hd, 1.0f);
      matmul(block.rows_by_dim(), w.ds, w.k + k0 * hd, w.rows_out, 0.0f);
      unpack_rows(w.rows_out, rows, hd, dq, s.ldq, token0 + i0, h);
    }
  }
  unpack_rows(w.dk, T, hd, dk, s.ldk, token0, kv);
  unpack_rows(w.dv, T, hd, dv, s.ldv, token0, kv);
}

void check_shape(const AttentionShape& s) {
  require(s.batch > 0 && s.seq > 0 && s.head_dim > 0 && s.kv_heads > 0 && s.q_heads % s.kv_heads == 0,
          "attention: bad shape (batch {}, seq {}, heads {}/{}, head_dim {})", s.batch, s.seq, s.q_heads, s.kv_heads,
          s.head_dim);
}

template <typename M>
char* thread_base(void* workspace, size_t workspace_bytes, const AttentionShape& s) {
  const size_t per_thread = ThreadScratch<M>::bytes(s.seq, s.head_dim, s.softcap > 0);
  const size_t needed = per_thread * size_t(max_threads());
  require(workspace != nullptr && workspace_bytes >= needed,
          "attention: workspace of {} bytes, {} needed for sequence {} on {} threads", workspace_bytes, needed, s.seq,
          max_threads());
  return static_cast<char*>(workspace);
}

inline bool parallel(const AttentionShape& s) {
  return s.batch * s.q_heads * s.seq * s.seq * s.head_dim >= kParallelMinWork;
}

// Runs f(batch, head, thread scratch) for every (sequence, head) in [0, batch * heads), one task
// per pair, each thread on its own slice of the workspace.
template <typename M, typename F>
void for_each_head(const AttentionShape& s, int64_t heads, void* workspace, size_t workspace_bytes, F&& f) {
  check_shape(s);
  char* base = thread_base<M>(workspace, workspace_bytes, s);
  const size_t per_thread = ThreadScratch<M>::bytes(s.seq, s.head_dim, s.softcap > 0);
  for_each_task(s.batch * heads, parallel(s), [&](int64_t t, int thread) {
    const FlushDenormals flush;  // the head's fp32 products and rows (flush_denormals.h)
    auto w = ThreadScratch<M>::at(base + size_t(thread) * per_thread, s.seq, s.head_dim, s.softcap > 0);
    f(t / heads, t % heads, w);
  });
}

const int32_t* sequence_segments(const int32_t* segments, const AttentionShape& s, int64_t b) {
  return segments ? segments + b * s.seq : nullptr;
}

template <typename M>
void forward_all(const AttentionShape& s, const float* q, const float* k, const float* v, const int32_t* segments,
                 float* out, float* lse, void* workspace, size_t workspace_bytes, bool widened) {
  for_each_head<M>(s, s.q_heads, workspace, workspace_bytes, [&](int64_t b, int64_t h, ThreadScratch<M>& w) {
    forward_head(s, q, k, v, sequence_segments(segments, s, b), out, lse, b, h, w, widened);
  });
}

template <typename M>
void backward_all(const AttentionShape& s, const float* q, const float* k, const float* v, const int32_t* segments,
                  const float* lse, const float* dout, float* dq, float* dk, float* dv, void* workspace,
                  size_t workspace_bytes, bool widened) {
  for_each_head<M>(s, s.kv_heads, workspace, workspace_bytes, [&](int64_t b, int64_t kv, ThreadScratch<M>& w) {
    backward_kv_head(s, q, k, v, sequence_segments(segments, s, b), lse, dout, dq, dk, dv, b, kv, w, widened);
  });
}

// How this call holds its operands: packed bf16, or (`widened`) fp32 rounded to bf16 values.
bool widened_operands(AttentionMatmul precision, Bf16Operands operands) {
  if (precision != AttentionMatmul::BF16) return false;
  if (operands == Bf16Operands::automatic) return !bf16_matmul_native();
  return operands == Bf16Operands::widened;
}

}  // namespace

void prepare_attention_blocked(const AttentionShape& s, AttentionMatmul precision, Bf16Operands operands) {
  check_shape(s);
  const bool bf16 = precision == AttentionMatmul::BF16 && !widened_operands(precision, operands);
  const int64_t T = s.seq, hd = s.head_dim;
  // Query block i0 has `rows` rows and starts at key block k0 <= i0 (first_key): n = i0 + rows - k0
  // keys. Every (rows, n) pair, with each product forward_head and backward_kv_head run on it.
  std::vector<std::pair<int64_t, int64_t>> blocks;
  for (int64_t i0 = 0; i0 < T; i0 += kBlock) {
    const int64_t rows = std::min(kBlock, T - i0);
    for (int64_t k0 = 0; k0 <= i0; k0 += kBlock) blocks.push_back({rows, i0 + rows - k0});
  }
  std::sort(blocks.begin(), blocks.end());
  blocks.erase(std::unique(blocks.begin(), blocks.end()), blocks.end());
  for_each_task(max_threads(), true, [&](int64_t, int) {
    for (auto [rows, n] : blocks) {
      const BlockProducts block{rows, n, hd};
      gemm_prepare(block.rows_by_keys(), bf16, 0.0f);  // scores, dP
      gemm_prepare(block.rows_by_dim(), bf16, 0.0f);   // P V, dQ
      gemm_prepare(block.keys_by_dim(), bf16, 1.0f);   // dV, dK
    }
  });
}

size_t attention_workspace_bytes(const AttentionShape& s, AttentionMatmul precision, int threads,
                                 Bf16Operands operands) {
  const bool cap = s.softcap > 0;
  const bool packed_bf16 = precision == AttentionMatmul::BF16 && !widened_operands(precision, operands);
  const size_t per_thread = packed_bf16 ? ThreadScratch<bf16>::bytes(s.seq, s.head_dim, cap)
                                        : ThreadScratch<float>::bytes(s.seq, s.head_dim, cap);
  return per_thread * size_t(std::max(threads, 1));
}

void attention_forward_blocked(const AttentionShape& s, AttentionMatmul precision, const float* q, const float* k,
                               const float* v, const int32_t* segments, float* out, float* lse, void* workspace,
                               size_t workspace_bytes, Bf16Operands operands) {
  const bool widened = widened_operands(precision, operands);
  if (precision == AttentionMatmul::BF16 && !widened)
    forward_all<bf16>(s, q, k, v, segments, out, lse, workspace, workspace_bytes, false);
  else
    forward_all<float>(s, q, k, v, segments, out, lse, workspace, workspace_bytes, widened);
}

void attention_backward_blocked(const AttentionShape& s, AttentionMatmul precision, const float* q, const float* k,
                                const float* v, const int32_t* segments, const float* lse, const float* dout, float* dq,
                                float* dk, float* dv, void* workspace, size_t workspace_bytes, Bf16Operands operands) {
  const bool widened = widened_operands(precision, operands);
  if (precision == AttentionMatmul::BF16 && !widened)
    backward_all<bf16>(s, q, k, v, segments, lse, dout, dq, dk, dv, workspace, workspace_bytes, false);
  else
    backward_all<float>(s, q, k, v, segments, lse, dout, dq, dk, dv, workspace, workspace_bytes, widened);
}

}  // namespace keel::kernels
