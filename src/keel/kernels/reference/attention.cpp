// Causal grouped-query attention, flash-style (Dao et al. 2022, FlashAttention; backward as in
// Dao 2023, FlashAttention-2).
//
// Forward, per query row i, over key tiles with an online softmax (Milakov & Gimelshein 2018):
//   s_ij = scale * q_i . k_j                      (only keys j the mask allows)
//   m'   = max(m, max_j s_ij),  alpha = exp(m - m')
//   l'   = alpha * l + sum_j exp(s_ij - m'),  acc' = alpha * acc + sum_j exp(s_ij - m') v_j
//   out_i = acc / l,  lse_i = m + log(l)
// Backward, recomputing p_ij = exp(s_ij - lse_i) from the saved lse:
//   D_i = dout_i . out_i,  dv_j += p_ij dout_i,  dp_ij = dout_i . v_j,
//   ds_ij = p_ij (dp_ij - D_i),  dq_i += scale ds_ij k_j,  dk_j += scale ds_ij q_i.
// Soft-capping (Gemma 2) replaces s_ij by cap tanh(s_ij / cap), and multiplies ds_ij by its slope
// 1 - tanh^2.
//
// Determinism: the forward pass gives each (batch, head, query tile) to one thread. The backward
// pass gives each (batch, kv head) to one thread, which loops over the q heads of its group, so
// dk/dv of a kv head and dq of its q heads each have a single writer and a fixed summation
// order whatever the thread count.
#include "keel/kernels/reference/attention.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "keel/core/threads.h"

namespace keel::kernels {
namespace {

constexpr int64_t kQueryTile = 64;
constexpr int64_t kKeyTile = 64;
// Below this many multiply-adds (batch * q_heads * seq^2 * head_dim) one thread is faster.
constexpr int64_t kParallelMinWork = int64_t(1) << 18;

// Per-thread scratch reused across calls: it grows to the largest shape seen and then the step
// loop no longer allocates.
template <typename T>
T* thread_scratch(size_t elements) {
  static thread_local std::vector<T> buffer;
  if (buffer.size() < elements) buffer.resize(elements);
  return buffer.data();
}

// Token t's row of head h in a [batch*seq, ld] buffer.
template <typename T>
T* head_row(T* base, int64_t ld, int64_t token, int64_t head, int64_t head_dim) {
  return base + token * ld + head * head_dim;
}

inline int64_t attention_work(const AttentionShape& s) { return s.batch * s.q_heads * s.seq * s.seq * s.head_dim; }

// Query i may attend key j: causal, inside the sliding window if there is one, and within the
// same document when segments are given.
inline bool attends(const AttentionShape& s, const int32_t* seg, int64_t i, int64_t j) {
  return j <= i && in_window(s.window, i, j) && (seg == nullptr || seg[i] == seg[j]);
}

// True when some query in [i0, i0+nq) may attend some key in [j0, j0+nk); lets packed documents
// skip whole tiles of other documents, and a sliding window the tiles behind it.
bool tile_has_allowed_pair(const AttentionShape& s, const int32_t* seg, int64_t i0, int64_t nq, int64_t j0,
                           int64_t nk) {
  if (j0 > i0 + nq - 1) return false;
  // The block's first row reaches furthest back: if the tile's last key is behind its window, the
  // whole tile is behind every row's.
  if (!in_window(s.window, i0, j0 + nk - 1)) return false;
  if (seg == nullptr) return true;
  for (int64_t i = i0; i < i0 + nq; ++i)
    for (int64_t j = j0; j < std::min(j0 + nk, i + 1); ++j)
      if (seg[i] == seg[j]) return true;
  return false;
}

// Copies rows [j0, j0+nk) of one head into a [head_dim, kKeyTile] transposed tile, so that a
// query's dot products with all keys of the tile vectorise over the keys.
template <typename T>
void load_transposed_tile(const T* base, int64_t ld, int64_t token0, int64_t head, int64_t head_dim, int64_t nk,
                          T* tile) {
  for (int64_t c = 0; c < nk; ++c) {
    const T* row = head_row(base, ld, token0 + c, head, head_dim);
    for (int64_t d = 0; d < head_dim; ++d) tile[d * kKeyTile + c] = row[d];
  }
}

// out[c] = x . tile[:, c] for c < nk.
template <typename T>
void dot_with_tile(const T* x, const T* tile, int64_t head_dim, int64_t nk, T* out) {
  for (int64_t c = 0; c < nk; ++c) out[c] = T(0);
  for (int64_t d = 0; d < head_dim; ++d) {
    const T xd = x[d];
    const T* col = tile + d * kKeyTile;
    for (int64_t c = 0; c < nk; ++c) out[c] += xd * col[c];
  }
}

// y += a * x over head_dim elements.
template <typename T>
void add_scaled(T* y, T a, const T* x, int64_t n) {
  for (int64_t d = 0; d < n; ++d) y[d] += a * x[d];
}

// A scaled score as the softmax sees it: soft-capped when the shape says so.
template <typename T>
T capped(const AttentionShape& s, T scaled) {
  return s.softcap > 0 ? T(s.softcap) * std::tanh(scaled / T(s.softcap)) : scaled;
}
// d capped / d scaled.
template <typename T>
T cap_slope(const AttentionShape& s, T scaled) {
  if (s.softcap <= 0) return T(1);
  const T t = std::tanh(scaled / T(s.softcap));
  return T(1) - t * t;
}

// Number of keys of the tile starting at j0 that row i can reach causally.
inline int64_t causal_keys(int64_t i, int64_t j0, int64_t nk) { return std::min(nk, i - j0 + 1); }

// Which sequence and heads a forward task works on.
struct HeadIndex {
  int64_t batch, q_head, kv_head;
};

// Forward for one query tile of one head: the online softmax over all key tiles it can see.
template <typename T>
void forward_query_tile(const AttentionShape& s, const T* q, const T* k, const T* v, const int32_t* seg, HeadIndex hp,
                        int64_t i0, T* out, T* lse) {
  const int64_t hd = s.head_dim;
  const int64_t token0 = hp.batch * s.seq;
  const int64_t nq = std::min(kQueryTile, s.seq - i0);
  const T scale = T(s.scale);
  const T neg_inf = -std::numeric_limits<T>::infinity();

  T* scratch = thread_scratch<T>(hd * kKeyTile + kKeyTile + nq * (hd + 2));
  T* k_tile = scratch;                 // [hd, kKeyTile]
  T* scores = k_tile + hd * kKeyTile;  // [kKeyTile]
  T* acc = scores + kKeyTile;          // [nq, hd]
  T* row_max = acc + nq * hd;          // [nq]
  T* row_sum = row_max + nq;           // [nq]
  std::fill(acc, acc + nq * hd, T(0));
  std::fill(row_max, row_max + nq, neg_inf);
  std::fill(row_sum, row_sum + nq, T(0));

  const int64_t last_query = i0 + nq - 1;
  for (int64_t j0 = 0; j0 <= last_query; j0 += kKeyTile) {
    const int64_t nk = std::min(kKeyTile, s.seq - j0);
    if (!tile_has_allowed_pair(s, seg, i0, nq, j0, nk)) continue;
    load_transposed_tile(k, s.ldk, token0 + j0, hp.kv_head, hd, nk, k_tile);
    for (int64_t r = 0; r < nq; ++r) {
      const int64_t i = i0 + r;
      const int64_t n = causal_keys(i, j0, nk);
      if (n <= 0) continue;
      dot_with_tile(head_row(q, s.ldq, token0 + i, hp.q_head, hd), k_tile, hd, n, scores);
      T tile_max = neg_inf;
      for (int64_t c = 0; c < n; ++c) {
        scores[c] = attends(s, seg, i, j0 + c) ? capped(s, scores[c] * scale) : neg_inf;
        tile_max = std::max(tile_max, scores[c]);
      }
      if (tile_max == neg_inf) continue;  // every key of this tile is in another document
      const T new_max = std::max(row_max[r], tile_max);
      const T alpha = std::exp(row_max[r] - new_max);  // exp(-inf) = 0 on the first tile
      T tile_sum = 0;
      for (int64_t c = 0; c < n; ++c) {
        scores[c] = std::exp(scores[c] - new_max);
        tile_sum += scores[c];
      }
      row_sum[r] = row_sum[r] * alpha + tile_sum;
      row_max[r] = new_max;
      T* acc_row = acc + r * hd;
      if (alpha != T(1))
        for (int64_t d = 0; d < hd; ++d) acc_row[d] *= alpha;
      for (int64_t c = 0; c < n; ++c)
        if (scores[c] != T(0)) add_scaled(acc_row, scores[c], head_row(v, s.ldv, token0 + j0 + c, hp.kv_head, hd), hd);
    }
  }

  for (int64_t r = 0; r < nq; ++r) {
    T* out_row = head_row(out, s.ldo, token0 + i0 + r, hp.q_head, hd);
    T* lse_at = lse + (hp.batch * s.q_heads + hp.q_head) * s.seq + i0 + r;
    if (row_sum[r] == T(0)) {  // no key allowed: cannot happen for causal masks, guarded anyway
      std::fill(out_row, out_row + hd, T(0));
      *lse_at = neg_inf;
      continue;
    }
    const T inv_sum = T(1) / row_sum[r];
    for (int64_t d = 0; d < hd; ++d) out_row[d] = acc[r * hd + d] * inv_sum;
    *lse_at = row_max[r] + std::log(row_sum[r]);
  }
}

// Scratch layout of one backward task.
template <typename T>
struct BackwardScratch {
  T *k_tile, *v_tile;  // [hd, kKeyTile] transposed tiles
  T *dk_acc, *dv_acc;  // [kKeyTile, hd] gradients of the current key tile
  T *p, *ds;           // [kKeyTile] one query row's probabilities and score gradients
  T* delta;            // [group, seq] D_i = dout_i . out_i

  static BackwardScratch take(int64_t hd, int64_t group, int64_t seq) {
    const int64_t tile = hd * kKeyTile;
    T* base = thread_scratch<T>(4 * tile + 2 * kKeyTile + group * seq);
    BackwardScratch b;
    b.k_tile = base;
    b.v_tile = base + tile;
    b.dk_acc = base + 2 * tile;
    b.dv_acc = base + 3 * tile;
    b.p = base + 4 * tile;
    b.ds = b.p + kKeyTile;
    b.delta = b.ds + kKeyTile;
    return b;
  }
};

// Backward for one (batch, kv head): all key tiles, and for each the query rows of every q head
// of the group that can see it.
template <typename T>
void backward_kv_head(const AttentionShape& s, const T* q, const T* k, const T* v, const int32_t* seg, const T* out,
                      const T* lse, const T* dout, T* dq, T* dk, T* dv, int64_t b, int64_t kv_head) {
  const int64_t hd = s.head_dim;
  const int64_t group = s.q_heads / s.kv_heads;
  const int64_t token0 = b * s.seq;
  const T scale = T(s.scale);
  const T neg_inf = -std::numeric_limits<T>::infinity();
  BackwardScratch<T> w = BackwardScratch<T>::take(hd, group, s.seq);

  for (int64_t g = 0; g < group; ++g) {
    const int64_t h = kv_head * group + g;
    for (int64_t i = 0; i < s.seq; ++i) {
      const T* o = head_row(out, s.ldo, token0 + i, h, hd);
      const T* dout_row = head_row(dout, s.ldo, token0 + i, h, hd);
      T delta = 0;
      for (int64_t d = 0; d < hd; ++d) delta += dout_row[d] * o[d];
      w.delta[g * s.seq + i] = delta;
      T* dq_row = head_row(dq, s.ldq, token0 + i, h, hd);
      std::fill(dq_row, dq_row + hd, T(0));
    }
  }

  for (int64_t j0 = 0; j0 < s.seq; j0 += kKeyTile) {
    const int64_t nk = std::min(kKeyTile, s.seq - j0);
    load_transposed_tile(k, s.ldk, token0 + j0, kv_head, hd, nk, w.k_tile);
    load_transposed_tile(v, s.ldv, token0 + j0, kv_head, hd, nk, w.v_tile);
    std::fill(w.dk_acc, w.dk_acc + nk * hd, T(0));
    std::fill(w.dv_acc, w.dv_acc + nk * hd, T(0));

    for (int64_t g = 0; g < group; ++g) {
      const int64_t h = kv_head * group + g;
      const T* lse_h = lse + (b * s.q_heads + h) * s.seq;
      // Query tiles on the same grid as the forward pass; those ending before j0 see no key here.
      for (int64_t i0 = j0 / kQueryTile * kQueryTile; i0 < s.seq; i0 += kQueryTile) {
        const int64_t nq = std::min(kQueryTile, s.seq - i0);
        if (!tile_has_allowed_pair(s, seg, i0, nq, j0, nk)) continue;
        for (int64_t i = i0; i < i0 + nq; ++i) {
          const int64_t n = causal_keys(i, j0, nk);
          if (n <= 0 || lse_h[i] == neg_inf) continue;
          const T* q_row = head_row(q, s.ldq, token0 + i, h, hd);
          const T* dout_row = head_row(dout, s.ldo, token0 + i, h, hd);
          dot_with_tile(q_row, w.k_tile, hd, n, w.p);
          dot_with_tile(dout_row, w.v_tile, hd, n, w.ds);  // dp_ij, turned into ds_ij below
          const T delta = w.delta[g * s.seq + i];
          bool any = false;
          for (int64_t c = 0; c < n; ++c) {
            const bool allowed = attends(s, seg, i, j0 + c);
            const T scaled = w.p[c] * scale;
            const T p = allowed ? std::exp(capped(s, scaled) - lse_h[i]) : T(0);
            w.p[c] = p;
            // scale (and the cap's slope) folded in: d(loss)/d(q.k) = scale * ds_ij.
            w.ds[c] = p * (w.ds[c] - delta) * scale * cap_slope(s, scaled);
            any = any || allowed;
          }
          if (!any) continue;
          T* dq_row = head_row(dq, s.ldq, token0 + i, h, hd);
          for (int64_t c = 0; c < n; ++c) {
            if (w.p[c] == T(0) && w.ds[c] == T(0)) continue;
            add_scaled(w.dv_acc + c * hd, w.p[c], dout_row, hd);
            add_scaled(w.dk_acc + c * hd, w.ds[c], q_row, hd);
            add_scaled(dq_row, w.ds[c], head_row(k, s.ldk, token0 + j0 + c, kv_head, hd), hd);
          }
        }
      }
    }

    for (int64_t c = 0; c < nk; ++c) {
      std::copy_n(w.dk_acc + c * hd, hd, head_row(dk, s.ldk, token0 + j0 + c, kv_head, hd));
      std::copy_n(w.dv_acc + c * hd, hd, head_row(dv, s.ldv, token0 + j0 + c, kv_head, hd));
    }
  }
}

}  // namespace

template <typename T>
void attention_forward(const AttentionShape& s, const T* q, const T* k, const T* v, const int32_t* segments, T* out,
                       T* lse) {
  const int64_t group = s.q_heads / s.kv_heads;
  const int64_t query_tiles = (s.seq + kQueryTile - 1) / kQueryTile;
  const int64_t tasks = s.batch * s.q_heads * query_tiles;
  // Later query tiles see more keys: dynamic scheduling balances the causal triangle.
  for_each_task(tasks, attention_work(s) >= kParallelMinWork, [&](int64_t task, int) {
    const int64_t qt = task % query_tiles;
    const int64_t h = task / query_tiles % s.q_heads;
    const int64_t b = task / query_tiles / s.q_heads;
    // seg is indexed by position within the sequence, the buffers by token b*seq + position.
    const int32_t* seg = segments ? segments + b * s.seq : nullptr;
    forward_query_tile(s, q, k, v, seg, HeadIndex{b, h, h / group}, qt * kQueryTile, out, lse);
  });
}

template <typename T>
void attention_backward(const AttentionShape& s, const T* q, const T* k, const T* v, const int32_t* segments,
                        const T* out, const T* lse, const T* dout, T* dq, T* dk, T* dv) {
  const int64_t tasks = s.batch * s.kv_heads;
  for_each_task(tasks, attention_work(s) >= kParallelMinWork, [&](int64_t task, int) {
    const int64_t b = task / s.kv_heads;
    const int64_t kv_head = task % s.kv_heads;
    const int32_t* seg = segments ? segments + b * s.seq : nullptr;
    backward_kv_head(s, q, k, v, seg, out, lse, dout, dq, dk, dv, b, kv_head);
  });
}

template void attention_forward<float>(const AttentionShape&, const float*, const float*, const float*, const int32_t*,
                                       float*, float*);
template void attention_forward<double>(const AttentionShape&, const double*, const double*, const double*,
                                        const int32_t*, double*, double*);
template void attention_backward<float>(const AttentionShape&, const float*, const float*, const float*, const int32_t*,
                                        const float*, const float*, const float*, float*, float*, float*);
template void attention_backward<double>(const AttentionShape&, const double*, const double*, const double*,
                                         const int32_t*, const double*, const double*, const double*, double*, double*,
                                         double*);

}  // namespace keel::kernels
