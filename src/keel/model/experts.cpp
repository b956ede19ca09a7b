#include "keel/model/experts.h"

#include <algorithm>
#include <array>
#include <bitset>
#include <cmath>
#include <numeric>
#include <tuple>
#include <utility>

#include "keel/core/error.h"
#include "keel/core/threads.h"

namespace keel::model {

using kernels::Trans;

namespace {

// Row loops worth splitting over threads: above this many elements touched.
constexpr int64_t kParallelElements = int64_t(1) << 15;

// p[t] = softmax(p[t]) in place, fp32 as torch's softmax(dtype=float).
void softmax_rows(float* p, int64_t rows, int64_t n) {
  parallel_for(rows, rows * n >= kParallelElements, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      float* r = p + t * n;
      const float most = *std::max_element(r, r + n);
      float sum = 0;
      for (int64_t e = 0; e < n; ++e) sum += r[e] = std::exp(r[e] - most);
      for (int64_t e = 0; e < n; ++e) r[e] /= sum;
    }
  });
}

// s = sigmoid(s) in place, fp32 as torch's sigmoid: 1 / (1 + exp(-x)).
void sigmoid_rows(float* p, int64_t n) {
  parallel_for(n, n >= kParallelElements, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) p[i] = 1.0f / (1.0f + std::exp(-p[i]));
  });
}

// Sigmoid routing (experts.h): each token's top_k experts by score + bias among its topk_groups
// best groups, the lower index first among equals (torch.topk leaves ties unspecified), and their
// weights from the scores alone.
void choose_experts_sigmoid(const ExpertsShape& s, const float* bias, const RoutedActivations& a) {
  const int64_t E = s.experts, k = s.top_k, G = s.groups, per_group = E / G;
  parallel_for(s.tokens, s.tokens * E * k >= kParallelElements, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const float* p = a.probs + t * E;
      auto choice_score = [&](int64_t e) { return p[e] + (bias ? bias[e] : 0.0f); };
      // A group's score: its two best choice scores, summed (topk(2)[0].sum()).
      auto group_score = [&](int64_t g) {
        float first = -INFINITY, second = -INFINITY;
        for (int64_t e = g * per_group; e < (g + 1) * per_group; ++e) {
          const float v = choice_score(e);
          if (v > first) {
            second = first;
            first = v;
          } else if (v > second) {
            second = v;
          }
        }
        return first + second;
      };
      std::bitset<kMaxExpertGroups> kept;
      if (s.topk_groups == G) {
        for (int64_t g = 0; g < G; ++g) kept.set(size_t(g));
      } else {
        for (int64_t j = 0; j < s.topk_groups; ++j) {
          int64_t best = -1;
          float best_score = 0;
          for (int64_t g = 0; g < G; ++g) {
            if (kept.test(size_t(g))) continue;
            const float score = group_score(g);
            if (best < 0 || score > best_score) best = g, best_score = score;
          }
          kept.set(size_t(best));
        }
      }
      int32_t* chosen = a.choice + t * k;
      float* w = a.weight + t * k;
      for (int64_t j = 0; j < k; ++j) {
        int32_t best = -1;
        float best_score = 0;
        for (int64_t e = 0; e < E; ++e) {
          if (!kept.test(size_t(e / per_group)) || std::find(chosen, chosen + j, int32_t(e)) != chosen + j) continue;
          const float score = choice_score(e);
          if (best < 0 || score > best_score) best = int32_t(e), best_score = score;
        }
        chosen[j] = best;
        w[j] = p[best];
      }
      if (s.norm_topk_prob) {
        float sum = 0;
        for (int64_t j = 0; j < k; ++j) sum += w[j];
        sum += 1e-20f;
        for (int64_t j = 0; j < k; ++j) w[j] /= sum;
      }
      for (int64_t j = 0; j < k; ++j) w[j] *= s.routed_scaling_factor;
    }
  });
}

// Each token's top_k experts by descending probability (the lower index first among equals, as a
// stable sort would; torch.topk leaves ties unspecified), and their weights.
void choose_experts(const ExpertsShape& s, const RoutedActivations& a) {
  const int64_t E = s.experts, k = s.top_k;
  parallel_for(s.tokens, s.tokens * E * k >= kParallelElements, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const float* p = a.probs + t * E;
      int32_t* chosen = a.choice + t * k;
      float* w = a.weight + t * k;
      for (int64_t j = 0; j < k; ++j) {
        int32_t best = -1;
        for (int64_t e = 0; e < E; ++e) {
          if (std::find(chosen, chosen + j, int32_t(e)) != chosen + j) continue;
          if (best < 0 || p[e] > p[best]) best = int32_t(e);
        }
        chosen[j] = best;
        w[j] = p[best];
      }
      if (s.norm_topk_prob) {
        float sum = 0;
        for (int64_t j = 0; j < k; ++j) sum += w[j];
        for (int64_t j = 0; j < k; ++j) w[j] /= sum;
      }
    }
  });
}

// Sorts the routed rows by expert (counting sort; by token within an expert) and lists each
// token's rows in ascending order, which is its experts' ascending order.
void sort_rows(const ExpertsShape& s, const RoutedActivations& a) {
  const int64_t E = s.experts, k = s.top_k, R = s.routed();
  int32_t* begin = a.expert_rows;
  std::fill_n(begin, E + 1, 0);
  for (int64_t i = 0; i < R; ++i) ++begin[a.choice[i] + 1];
  for (int64_t e = 0; e < E; ++e) begin[e + 1] += begin[e];
  // begin[e] serves as expert e's cursor, ending at its successor's start; shifted back after.
  for (int64_t i = 0; i < R; ++i) {
    const int32_t row = begin[a.choice[i]]++;
    a.row_slot[row] = int32_t(i);
    a.token_rows[i] = row;
  }
  for (int64_t e = E; e > 0; --e) begin[e] = begin[e - 1];
  begin[0] = 0;
  for (int64_t t = 0; t < s.tokens; ++t) std::sort(a.token_rows + t * k, a.token_rows + (t + 1) * k);
}

// out[i] = base[i] + sum (base null: out[i] = sum), sum = 0 + w_0 r_0[i] + w_1 r_1[i] + ... over
// j < k in that order (unweighted: r_j[i] alone), for i < n: a token's rows gathered back. Each
// element is the running sum it always was; the columns go a chunk at a time, innermost, so the
// loops vectorise (the sum over j innermost ran a float at a time). out may be base.
template <bool kWeighted, typename Row, typename Weight>
void sum_rows(float* out, const float* base, int64_t n, int64_t k, Row&& row, Weight&& weight) {
  constexpr int64_t kChunk = 256;
  float sum[kChunk];
  for (int64_t c0 = 0; c0 < n; c0 += kChunk) {
    const int64_t m = std::min(kChunk, n - c0);
    std::fill_n(sum, m, 0.0f);
    for (int64_t j = 0; j < k; ++j) {
      const float* r = row(j) + c0;
      if constexpr (kWeighted) {
        const float w = weight(j);
        for (int64_t i = 0; i < m; ++i) sum[i] += w * r[i];
      } else {
        for (int64_t i = 0; i < m; ++i) sum[i] += r[i];
      }
    }
    if (base)
      for (int64_t i = 0; i < m; ++i) out[c0 + i] = base[c0 + i] + sum[i];
    else
      std::copy_n(sum, m, out + c0);
  }
}

// sum over i < n of double(a[i]) * b[i], in 8 lanes (lane i % 8) added in order at the end. A
// product of two floats is exact in double, and the lanes' order moves only the double sum's last
// bits, far below the float it is rounded to. One running sum was a chain of n dependent adds for
// every routed row (its routing weight's gradient, over the hidden size).
double dot_f64(const float* a, const float* b, int64_t n) {
  constexpr int kLanes = 8;
  double lane[kLanes] = {};
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes)
    for (int l = 0; l < kLanes; ++l) lane[l] += double(a[i + l]) * b[i + l];
  for (int l = 0; i < n; ++i, ++l) lane[l] += double(a[i]) * b[i];
  double sum = 0;
  for (int l = 0; l < kLanes; ++l) sum += lane[l];
  return sum;
}

// Expert e's rows [r0, r0 + n): C = A_rows op(W_e) for each expert holding rows.
template <typename F>
void for_each_expert(const RoutedActivations& a, int64_t experts, F&& f) {
  for (int64_t e = 0; e < experts; ++e) {
    const int64_t r0 = a.expert_rows[e], n = a.expert_rows[e + 1] - r0;
    f(e, r0, n);
  }
}

// Experts for_each_expert_task puts in order, largest first; past this many, expert order.
constexpr int64_t kMaxOrderedExperts = 1024;

// The experts' products of one kind as the tasks of one parallel region, where the backend cuts
// each product over its threads (Backend::bf16_product_shares): f(e, r0, n, part) for every expert
// and every part < parts, largest experts first, each task taken by whichever thread is free and
// its products run on that thread. Cut one product at a time, the threads met at the end of every
// piece's product (some 5,000 times a step on the bench model), the one done first waiting for the
// other; as tasks they meet once per kind, and a thread slowed by a neighbour takes fewer tasks.
// Each part is the same single-threaded product the cut ran, so the results are the same (a kind
// too narrow to cut, run beside one that is, runs whole in its part-0 task: the backend plans
// either for every thread). One part (fp32, a backend that does not cut, experts dequantized into
// the one tile): f(e, r0, n, 0) in expert order on this thread, each product whole.
template <typename F>
void for_each_expert_task(const RoutedActivations& a, int64_t experts, int64_t parts, F&& f) {
  if (parts <= 1)
    return for_each_expert(a, experts, [&](int64_t e, int64_t r0, int64_t n) { f(e, r0, n, int64_t(0)); });
  auto rows = [&](int64_t e) { return a.expert_rows[e + 1] - a.expert_rows[e]; };
  std::array<int32_t, kMaxOrderedExperts> order;  // the last tasks the shortest; ties by index
  const bool ordered = experts <= kMaxOrderedExperts;
  if (ordered) {
    std::iota(order.begin(), order.begin() + experts, 0);
    std::sort(order.begin(), order.begin() + experts,
              [&](int32_t x, int32_t y) { return rows(x) != rows(y) ? rows(x) > rows(y) : x < y; });
  }
  for_each_task(experts * parts, true, [&](int64_t task, int) {
    const int64_t e = ordered ? order[size_t(task / parts)] : task / parts;
    f(e, a.expert_rows[e], rows(e), task % parts);
  });
}

// f(first, count) over [0, n) in power-of-two pieces, largest first (experts.h says why).
template <typename F>
void for_each_piece(int64_t n, F&& f) {
  int64_t first = 0;
  for (int64_t bit = int64_t(1) << 62; bit > 0; bit >>= 1)
    if (n & bit) {
      f(first, bit);
      first += bit;
    }
}

// An operand as the products read it: fp32, or in bf16 precision its bf16 copy.
struct Operand {
  const float* f32;
  const bf16* b16;
  Operand at(int64_t offset) const { return {f32 ? f32 + offset : nullptr, b16 ? b16 + offset : nullptr}; }
};

// Expert e's matrix of a tensor holding `per_expert` elements per expert, as its products read it:
// its slice of the full-precision tensor, or of the 4-bit one dequantized whole into the tile
// (experts.h), bf16 where the products read bf16.
Operand expert_matrix(kernels::Backend& backend, const ExpertsWeights& w, Operand full, const FourBitWeight& q,
                      int64_t e, int64_t per_expert) {
  if (!q) return full.at(e * per_expert);
  const uint8_t* packed = q.packed + e * per_expert / 2;
  const float* absmax = q.absmax + e * per_expert / kFourBitBlockSize;
  if (w.in_bf16()) {
    backend.dequantize_4bit_bf16(q.type, packed, absmax, per_expert, w.tile_b);
    return {nullptr, w.tile_b};
  }
  backend.dequantize_4bit(q.type, packed, absmax, per_expert, w.tile);
  return {w.tile, nullptr};
}

void require_tile(const ExpertsShape& s, const ExpertsWeights& w) {
  if (!w.gate_up_4bit && !w.down_4bit) return;
  require((w.in_bf16() ? static_cast<const void*>(w.tile_b) : w.tile) != nullptr &&
              s.hidden % kFourBitBlockSize == 0,
          "experts: 4-bit experts need a dequantization tile of {} elements and hidden ({}) a multiple of {}",
          2 * s.inter * s.hidden, s.hidden, kFourBitBlockSize);
}

void product(kernels::Backend& backend, const kernels::GemmShape& s, Operand a, Operand b, float* c, float beta) {
  if (a.b16)
    backend.gemm_bf16(s, a.b16, b.b16, c, beta);
  else
    backend.gemm(s, a.f32, b.f32, c, beta);
}

// The products over a block of rows, each cut into its pieces. Rows of the output (row_product):
// C[rows] = A[rows] op(W) for m = rows, as packed_gemm(ta, tb, rows, n, k) lays them out. Sums
// over the rows (row_sum: a weight gradient, C [m, n] = A[rows]^T B[rows], k = rows): the pieces
// add into C after the first writes with `beta`.
// Each piece's part `part` of the products as `shares` cuts them (one part: the whole product).
void row_product(kernels::Backend& backend, Trans tb, int64_t rows, int64_t n, int64_t k, Operand a, Operand w,
                 float* c, float beta = 0.0f, const kernels::ProductShares& shares = {}, int64_t part = 0) {
  for_each_piece(rows, [&](int64_t first, int64_t count) {
    const auto p = shares.part(kernels::packed_gemm(Trans::N, tb, count, n, k), part);
    product(backend, p.shape, a.at(first * k + p.a), w.at(p.b), c + first * n + p.c, beta);
  });
}
void row_sum(kernels::Backend& backend, int64_t m, int64_t n, int64_t rows, Operand a, Operand b, float* c,
             float beta, const kernels::ProductShares& shares = {}, int64_t part = 0) {
  for_each_piece(rows, [&](int64_t first, int64_t count) {
    const auto p = shares.part(kernels::packed_gemm(Trans::T, Trans::N, m, n, count), part);
    product(backend, p.shape, a.at(first * m + p.a), b.at(first * n + p.b), c + p.c, first == 0 ? beta : 1.0f);
  });
}

// The backend's cut of a kind of the experts' products, where they run as tasks
// (for_each_expert_task): bf16 products read from full-precision experts' bf16 copies (4-bit ones
// are dequantized into one tile, expert by expert, and run whole).
kernels::ProductShares expert_shares(kernels::Backend& backend, const ExpertsWeights& w, const kernels::GemmShape& s) {
  if (!w.in_bf16() || w.gate_up_4bit || w.down_4bit) return {};
  return backend.bf16_product_shares(s);
}

// Expert e's matrices of an adapter (experts.h: ExpertsLora), A_e [rank, in] and B_e [out, rank];
// fp32: their masters alone, which the adapter's products read wherever the other operand is
// fp32 too (experts.h says why).
Operand lora_a(const ExpertsLora& l, int64_t e, int64_t rank, int64_t in, bool fp32) {
  return Operand{l.a, fp32 ? nullptr : l.a_b}.at(e * rank * in);
}
Operand lora_b(const ExpertsLora& l, int64_t e, int64_t out, int64_t rank) {
  return Operand{l.b, nullptr}.at(e * out * rank);
}
Operand fp32_only(Operand x) { return {x.f32, nullptr}; }

// LoRA on one expert tensor [out, in] per expert, forward (experts.h): u = scaling x A_e^T over
// every expert's rows, then y_e += u_e B_e^T. x, u and y are [routed, in | rank | out].
void lora_forward(kernels::Backend& backend, const RoutedActivations& a, int64_t E, const ExpertsWeights& w,
                  const ExpertsLora& l, int64_t out, int64_t in, Operand x, float* u, float* y) {
  const int64_t r = w.lora_rank, R = a.expert_rows[E];
  const bool x_fp32 = x.f32 != nullptr;  // else bf16 precision's routed input, held in bf16 alone
  const Operand xo = x_fp32 ? fp32_only(x) : x;
  for_each_expert(a, E, [&](int64_t e, int64_t r0, int64_t n) {
    if (n > 0) row_product(backend, Trans::T, n, r, in, xo.at(r0 * in), lora_a(l, e, r, in, x_fp32), u + r0 * r);
  });
  backend.scale_in_place(u, R * r, w.lora_scaling);
  for_each_expert(a, E, [&](int64_t e, int64_t r0, int64_t n) {
    if (n > 0)
      row_product(backend, Trans::T, n, out, r, Operand{u, nullptr}.at(r0 * r), lora_b(l, e, out, r), y + r0 * out,
                  1.0f);
  });
}

// Its backward pass, from dy [routed, out] (the product's output gradient, fp32): du = scaling dy_e
// B_e, dB_e += dy_e^T u_e, dA_e += du_e^T x_e and dx_e += du_e A_e (dx [routed, in], fp32, already
// holding the base product's input gradient).
void lora_backward(kernels::Backend& backend, const RoutedActivations& a, int64_t E, const ExpertsWeights& w,
                   const ExpertsLora& l, int64_t out, int64_t in, const float* dy, Operand x, const float* u,
                   const ExpertsScratch& d, float* grad_a, float* grad_b, float* dx) {
  const int64_t r = w.lora_rank, R = a.expert_rows[E];
  const Operand dyo{dy, nullptr}, uo{u, nullptr}, du{d.lora_du, nullptr};
  for_each_expert(a, E, [&](int64_t e, int64_t r0, int64_t n) {
    if (n > 0) row_product(backend, Trans::N, n, r, out, dyo.at(r0 * out), lora_b(l, e, out, r), d.lora_du + r0 * r);
  });
  backend.scale_in_place(d.lora_du, R * r, w.lora_scaling);
  // dA reads x: in fp32 where the forward pass keeps x so (the experts' act), else (bf16 precision's
  // routed input, held in bf16 alone) as bf16 with du's bf16 copy.
  const bool x_fp32 = x.f32 != nullptr;
  if (!x_fp32) backend.cast_to_bf16(d.lora_du, d.lora_du_b, R * r);
  const Operand du_x = x_fp32 ? du : Operand{nullptr, d.lora_du_b};
  for_each_expert(a, E, [&](int64_t e, int64_t r0, int64_t n) {
    if (n == 0) return;
    if (grad_b) row_sum(backend, out, r, n, dyo.at(r0 * out), uo.at(r0 * r), grad_b + e * out * r, 1.0f);
    if (grad_a) row_sum(backend, r, in, n, du_x.at(r0 * r), x_fp32 ? fp32_only(x).at(r0 * in) : x.at(r0 * in),
                        grad_a + e * r * in, 1.0f);
    row_product(backend, Trans::N, n, in, r, du.at(r0 * r), lora_a(l, e, r, in, true), dx + r0 * in, 1.0f);
  });
}

}  // namespace

void prepare_experts(kernels::Backend& backend, const ExpertsShape& s, bool bf16_inputs, int64_t lora_rank) {
  const int64_t H = s.hidden, I = s.inter, r = lora_rank;
  for (int64_t rows = 1; rows <= s.routed(); rows *= 2) {
    for (const auto& [tb, n, k] : {std::tuple{Trans::T, 2 * I, H}, std::tuple{Trans::T, H, I},
                                   std::tuple{Trans::N, I, H}, std::tuple{Trans::N, H, 2 * I}})
      backend.prepare_gemm(kernels::packed_gemm(Trans::N, tb, rows, n, k), bf16_inputs, 0.0f);
    for (const auto& [m, n] : {std::pair{H, I}, std::pair{2 * I, H}})
      for (float beta : {0.0f, 1.0f})
        backend.prepare_gemm(kernels::packed_gemm(Trans::T, Trans::N, m, n, rows), bf16_inputs, beta);
    if (r == 0) continue;
    // LoRA (lora_forward, lora_backward) on gate_up ([2I, H] per expert) and down ([H, I]); in bf16
    // some read bf16 operands and the rest fp32 (experts.h), so both kinds are prepared.
    for (const bool bf : {false, bf16_inputs})
      for (const auto& [out, in] : {std::pair{2 * I, H}, std::pair{H, I}}) {
        backend.prepare_gemm(kernels::packed_gemm(Trans::N, Trans::T, rows, r, in), bf, 0.0f);   // u
        backend.prepare_gemm(kernels::packed_gemm(Trans::N, Trans::T, rows, out, r), bf, 1.0f);  // y +=
        backend.prepare_gemm(kernels::packed_gemm(Trans::N, Trans::N, rows, r, out), bf, 0.0f);  // du
        backend.prepare_gemm(kernels::packed_gemm(Trans::N, Trans::N, rows, in, r), bf, 1.0f);   // dx +=
        backend.prepare_gemm(kernels::packed_gemm(Trans::T, Trans::N, out, r, rows), bf, 1.0f);  // dB +=
        backend.prepare_gemm(kernels::packed_gemm(Trans::T, Trans::N, r, in, rows), bf, 1.0f);   // dA +=
      }
  }
}

ExpertsShape experts_shape(const ModelConfig& c, int64_t tokens) {
  const auto& m = c.moe;
  return {tokens,           c.hidden_size,      m.experts, m.experts_per_token, m.intermediate_size, m.norm_topk_prob,
          m.sigmoid_router, m.groups,           m.topk_groups, float(m.routed_scaling_factor)};
}

void RouterBalance::clear(int64_t experts) {
  std::fill_n(tokens, experts, 0.0);
  std::fill_n(probs, experts, 0.0);
  std::fill_n(grad, experts, 0.0);
  rows = 0;
}

double RouterBalance::finish(int64_t experts, double weight) {
  if (rows <= 0) {  // every token padding: transformers' 0 / 0 is NaN; keel adds nothing
    std::fill_n(grad, experts, 0.0);
    return 0.0;
  }
  double aux = 0;
  for (int64_t e = 0; e < experts; ++e) {
    aux += (tokens[e] / rows) * (probs[e] / rows);
    grad[e] = weight * double(experts) * tokens[e] / (rows * rows);
  }
  return aux * double(experts);
}

void experts_forward(kernels::Backend& backend, const ExpertsShape& s, const float* x, const bf16* x_b,
                     const ExpertsWeights& w, const RoutedActivations& a, const float* residual, float* y,
                     const float* mask, RouterBalance* balance) {
  const int64_t N = s.tokens, H = s.hidden, E = s.experts, k = s.top_k, I = s.inter, R = s.routed();
  const bool bf = w.in_bf16();
  // p = softmax(x W_r^T)
  product(backend, kernels::packed_gemm(Trans::N, Trans::T, N, E, H), {x, bf ? x_b : nullptr}, {w.router, w.router_b},
          a.probs, 0.0f);
  if (s.sigmoid) {
    require(s.groups > 0 && s.groups <= kMaxExpertGroups && s.experts % s.groups == 0,
            "experts: {} expert groups of {} experts: expected a divisor of the experts, at most {}", s.groups,
            s.experts, kMaxExpertGroups);
    sigmoid_rows(a.probs, N * E);
    choose_experts_sigmoid(s, w.router_bias, a);
  } else {
    softmax_rows(a.probs, N, E);
    choose_experts(s, a);
  }
  sort_rows(s, a);
  if (balance) {
    for (int64_t t = 0; t < N; ++t) {
      const double m = mask ? mask[t] : 1.0;
      if (m == 0) continue;
      for (int64_t j = 0; j < k; ++j) balance->tokens[a.choice[t * k + j]] += m;
      for (int64_t e = 0; e < E; ++e) balance->probs[e] += m * a.probs[t * E + e];
    }
  }
  // Each row's input, then every expert's rows through its gate/up, the activation over all rows
  // at once, and its down projection.
  parallel_for(R, R * H >= kParallelElements, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const int64_t t = a.row_slot[r] / k;
      if (a.in) std::copy_n(x + t * H, H, a.in + r * H);  // fp32: the products' input
      if (bf) std::copy_n(x_b + t * H, H, a.in_b + r * H);
    }
  });
  const Operand in{a.in, bf ? a.in_b : nullptr}, act{a.act, bf ? a.act_b : nullptr};
  const Operand gate_up{w.gate_up, w.gate_up_b}, down{w.down, w.down_b};
  require_tile(s, w);
  const kernels::ProductShares gate_up_shares =
      expert_shares(backend, w, kernels::packed_gemm(Trans::N, Trans::T, 1, 2 * I, H));
  for_each_expert_task(a, E, gate_up_shares.parts, [&](int64_t e, int64_t r0, int64_t n, int64_t part) {
    if (n == 0) return;
    row_product(backend, Trans::T, n, 2 * I, H, in.at(r0 * H),
                expert_matrix(backend, w, gate_up, w.gate_up_4bit, e, 2 * I * H), a.gate_up + r0 * 2 * I, 0.0f,
                gate_up_shares, part);
  });
  if (w.gate_up_lora) lora_forward(backend, a, E, w, w.gate_up_lora, 2 * I, H, in, a.lora_u_gate_up, a.gate_up);
  backend.glu_forward(kernels::GluActivation::Silu, a.gate_up, R, I, a.act, bf ? a.act_b : nullptr);
  const kernels::ProductShares down_shares =
      expert_shares(backend, w, kernels::packed_gemm(Trans::N, Trans::T, 1, H, I));
  for_each_expert_task(a, E, down_shares.parts, [&](int64_t e, int64_t r0, int64_t n, int64_t part) {
    if (n == 0) return;
    row_product(backend, Trans::T, n, H, I, act.at(r0 * I), expert_matrix(backend, w, down, w.down_4bit, e, H * I),
                a.out + r0 * H, 0.0f, down_shares, part);
  });
  if (w.down_lora) lora_forward(backend, a, E, w, w.down_lora, H, I, act, a.lora_u_down, a.out);
  if (!y) return;
  // y[t] = residual[t] + sum over its rows (ascending expert) of w * out
  parallel_for(N, N * H * k >= kParallelElements, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      float* yt = y + t * H;
      const int32_t* rows = a.token_rows + t * k;
      sum_rows<true>(yt, residual + t * H, H, k, [&](int64_t j) { return a.out + rows[j] * H; },
                     [&](int64_t j) { return a.weight[a.row_slot[rows[j]]]; });
    }
  });
}

void experts_backward(kernels::Backend& backend, const ExpertsShape& s, const float* x, const bf16* x_b,
                      const ExpertsWeights& w, const RoutedActivations& a, const float* dy,
                      const ExpertsScratch& d, const RouterBalance* balance, const float* mask,
                      const ExpertsGrads& g, float* dx, bool add_to_dx) {
  const int64_t N = s.tokens, H = s.hidden, E = s.experts, k = s.top_k, I = s.inter, R = s.routed();
  const bool bf = w.in_bf16();
  const Operand in{a.in, bf ? a.in_b : nullptr}, act{a.act, bf ? a.act_b : nullptr};
  const Operand gate_up{w.gate_up, w.gate_up_b}, down{w.down, w.down_b};
  const Operand d_rows{d.rows, bf ? d.rows_b : nullptr}, d_gate_up{d.gate_up, bf ? d.gate_up_b : nullptr};
  // Row r serves slot (t, j): d w[t, j] = dy[t] . out[r], and its output gradient is w[t, j] dy[t].
  parallel_for(R, R * H >= kParallelElements, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const int64_t slot = a.row_slot[r], t = slot / k;
      const float* dyt = dy + t * H;
      const float* out = a.out + r * H;
      const float wt = a.weight[slot];
      float* drow = d.rows + r * H;
      for (int64_t i = 0; i < H; ++i) drow[i] = wt * dyt[i];
      d.slot_grad[slot] = float(dot_f64(dyt, out, H));
    }
  });
  // An expert no row reached gets a zero gradient where this write overwrites.
  auto zero_unrouted = [&](float* grad, float beta, int64_t per_expert) {
    if (beta != 0) return;
    for_each_expert(a, E, [&](int64_t e, int64_t, int64_t n) {
      if (n == 0) std::fill_n(grad + e * per_expert, per_expert, 0.0f);
    });
  };
  if (bf) backend.cast_to_bf16(d.rows, d.rows_b, R * H);
  // down: d act = d rows W_d[e];  dW_d[e] (+)= d rows^T act
  require_tile(s, w);
  // Each task: its part of d act's product and of dW_d's (every expert's parts of both, as tasks).
  const kernels::ProductShares d_act_shares =
      expert_shares(backend, w, kernels::packed_gemm(Trans::N, Trans::N, 1, I, H));
  const kernels::ProductShares d_down_shares =
      g.down ? expert_shares(backend, w, kernels::packed_gemm(Trans::T, Trans::N, H, I, 1)) : kernels::ProductShares{};
  for_each_expert_task(a, E, std::max(d_act_shares.parts, d_down_shares.parts),
                       [&](int64_t e, int64_t r0, int64_t n, int64_t part) {
    if (n == 0) return;
    if (part < d_act_shares.parts)
      row_product(backend, Trans::N, n, I, H, d_rows.at(r0 * H),
                  expert_matrix(backend, w, down, w.down_4bit, e, H * I), d.act + r0 * I, 0.0f, d_act_shares, part);
    if (g.down && part < d_down_shares.parts)
      row_sum(backend, H, I, n, d_rows.at(r0 * H), act.at(r0 * I), g.down + e * H * I, g.down_beta,
              d_down_shares, part);
  });
  if (g.down) zero_unrouted(g.down, g.down_beta, H * I);
  if (w.down_lora)
    lora_backward(backend, a, E, w, w.down_lora, H, I, d.rows, act, a.lora_u_down, d, g.down_a, g.down_b, d.act);
  backend.glu_backward(kernels::GluActivation::Silu, a.gate_up, d.act, R, I, d.gate_up, bf ? d.gate_up_b : nullptr);
  // gate/up: d in = d gate_up W_gu[e] (into d.rows, read above);  dW_gu[e] (+)= d gate_up^T in
  const kernels::ProductShares d_in_shares =
      expert_shares(backend, w, kernels::packed_gemm(Trans::N, Trans::N, 1, H, 2 * I));
  const kernels::ProductShares d_gate_up_shares =
      g.gate_up ? expert_shares(backend, w, kernels::packed_gemm(Trans::T, Trans::N, 2 * I, H, 1))
                : kernels::ProductShares{};
  for_each_expert_task(a, E, std::max(d_in_shares.parts, d_gate_up_shares.parts),
                       [&](int64_t e, int64_t r0, int64_t n, int64_t part) {
    if (n == 0) return;
    if (part < d_in_shares.parts)
      row_product(backend, Trans::N, n, H, 2 * I, d_gate_up.at(r0 * 2 * I),
                  expert_matrix(backend, w, gate_up, w.gate_up_4bit, e, 2 * I * H), d.rows + r0 * H, 0.0f,
                  d_in_shares, part);
    if (g.gate_up && part < d_gate_up_shares.parts)
      row_sum(backend, 2 * I, H, n, d_gate_up.at(r0 * 2 * I), in.at(r0 * H), g.gate_up + e * 2 * I * H,
              g.gate_up_beta, d_gate_up_shares, part);
  });
  if (g.gate_up) zero_unrouted(g.gate_up, g.gate_up_beta, 2 * I * H);
  if (w.gate_up_lora)
    lora_backward(backend, a, E, w, w.gate_up_lora, 2 * I, H, d.gate_up, in, a.lora_u_gate_up, d, g.gate_up_a,
                  g.gate_up_b, d.rows);
  // dx[t] = sum of its rows' input gradients
  parallel_for(N, N * H * k >= kParallelElements, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const int32_t* rows = a.token_rows + t * k;
      float* dxt = dx + t * H;
      sum_rows<false>(dxt, add_to_dx ? dxt : nullptr, H, k, [&](int64_t j) { return d.rows + rows[j] * H; },
                      [](int64_t) { return 1.0f; });
    }
  });
  // The router: d p from the slots' weights (through the renormalisation w_j = p_j / sum_i p_i:
  // d p_j = (d w_j - sum_i d w_i w_i) / sum_i p_i) and from the load-balancing loss, then through
  // the softmax: d logit = p (d p - sum_e p_e d p_e).
  parallel_for(N, N * E >= kParallelElements, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const float* p = a.probs + t * E;
      float* dl = d.logits + t * E;
      const float* dw = d.slot_grad + t * k;
      const float* wt = a.weight + t * k;
      const int32_t* chosen = a.choice + t * k;
      const double m = mask ? mask[t] : 1.0;
      for (int64_t e = 0; e < E; ++e) dl[e] = balance && m != 0 ? float(balance->grad[e] * m) : 0.0f;
      if (s.sigmoid) {
        // w_j = rsf s_j / D (D = sum_i s_i + 1e-20 with norm_topk_prob, else w_j = rsf s_j):
        // d s_j = rsf (d w_j - sum_i d w_i s_i / D) / D; then d logit = d s * s (1 - s).
        double sum_s = 1e-20, dot = 0;
        for (int64_t j = 0; j < k; ++j) {
          sum_s += p[chosen[j]];
          dot += double(dw[j]) * p[chosen[j]];
        }
        for (int64_t j = 0; j < k; ++j) {
          const double sj = p[chosen[j]];
          const double ds = s.norm_topk_prob ? s.routed_scaling_factor * (dw[j] - dot / sum_s) / sum_s
                                             : double(s.routed_scaling_factor) * dw[j];
          dl[chosen[j]] += float(ds * sj * (1.0 - sj));
        }
        continue;
      }
      if (s.norm_topk_prob) {
        double sum_p = 0, dot = 0;
        for (int64_t j = 0; j < k; ++j) {
          sum_p += p[chosen[j]];
          dot += double(dw[j]) * wt[j];
        }
        for (int64_t j = 0; j < k; ++j) dl[chosen[j]] += float((dw[j] - dot) / sum_p);
      } else {
        for (int64_t j = 0; j < k; ++j) dl[chosen[j]] += dw[j];
      }
      double pdp = 0;
      for (int64_t e = 0; e < E; ++e) pdp += double(p[e]) * dl[e];
      for (int64_t e = 0; e < E; ++e) dl[e] = float(p[e] * (dl[e] - pdp));
    }
  });
  // dW_r (+)= d logits^T x;  dx += d logits W_r
  if (bf) backend.cast_to_bf16(d.logits, d.logits_b, N * E);
  const Operand d_logits{d.logits, bf ? d.logits_b : nullptr};
  if (g.router)
    product(backend, kernels::packed_gemm(Trans::T, Trans::N, E, H, N), d_logits, {x, bf ? x_b : nullptr}, g.router,
            g.router_beta);
  product(backend, kernels::packed_gemm(Trans::N, Trans::N, N, H, E), d_logits, {w.router, w.router_b}, dx, 1.0f);
}

}  // namespace keel::model
