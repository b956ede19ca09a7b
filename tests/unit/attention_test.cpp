// attention_forward / attention_backward against a naive softmax attention and finite differences.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "finite_difference.h"
#include "keel/core/error.h"
#include "keel/core/threads.h"
#include "keel/kernels/attention.h"
#include "keel/kernels/gemm.h"
#include "keel/kernels/reference/attention.h"

namespace keel::kernels {
namespace {

using test::expect_gradient_matches;
using test::random_vector;
using test::sample_indices;

// q, k and v live inside one fused row per token, [q heads | k heads | v heads | padding], as the
// fused qkv projection lays them out; out rows are padded too, so every stride is non-trivial.
struct FusedAttention {
  AttentionShape shape;
  int64_t q_offset, k_offset, v_offset;
  std::vector<double> qkv;  // [tokens, ld]
  std::vector<int32_t> segments;

  FusedAttention(int64_t batch, int64_t seq, int64_t q_heads, int64_t kv_heads, int64_t head_dim, uint64_t seed) {
    const int64_t ld = (q_heads + 2 * kv_heads) * head_dim + 3;
    shape = {
        batch, seq, q_heads, kv_heads, head_dim, ld, ld, ld, q_heads * head_dim + 5, 1.0 / std::sqrt(double(head_dim))};
    q_offset = 0;
    k_offset = q_heads * head_dim;
    v_offset = (q_heads + kv_heads) * head_dim;
    qkv = random_vector(tokens() * ld, seed, -1.5, 1.5);
  }
  int64_t tokens() const { return shape.batch * shape.seq; }
  int64_t out_size() const { return tokens() * shape.ldo; }
  int64_t lse_size() const { return shape.batch * shape.q_heads * shape.seq; }
  const int32_t* segment_ids() const { return segments.empty() ? nullptr : segments.data(); }

  template <typename T>
  void forward(const std::vector<T>& buf, std::vector<T>& out, std::vector<T>& lse) const {
    out.assign(out_size(), T(0));
    lse.assign(lse_size(), T(0));
    attention_forward<T>(shape, buf.data() + q_offset, buf.data() + k_offset, buf.data() + v_offset, segment_ids(),
                         out.data(), lse.data());
  }
  template <typename T>
  std::vector<T> backward(const std::vector<T>& buf, const std::vector<T>& out, const std::vector<T>& lse,
                          const std::vector<T>& dout) const {
    std::vector<T> grad(buf.size(), T(0));
    attention_backward<T>(shape, buf.data() + q_offset, buf.data() + k_offset, buf.data() + v_offset, segment_ids(),
                          out.data(), lse.data(), dout.data(), grad.data() + q_offset, grad.data() + k_offset,
                          grad.data() + v_offset);
    return grad;
  }
  // The blocked (GEMM) kernels on float data, with a workspace sized for the current threads.
  void forward_blocked(AttentionMatmul precision, const std::vector<float>& buf, std::vector<float>& out,
                       std::vector<float>& lse, Bf16Operands operands = Bf16Operands::automatic) const {
    out.assign(out_size(), 0.0f);
    lse.assign(lse_size(), 0.0f);
    std::vector<char> ws(attention_workspace_bytes(shape, precision, max_threads(), operands));
    attention_forward_blocked(shape, precision, buf.data() + q_offset, buf.data() + k_offset, buf.data() + v_offset,
                              segment_ids(), out.data(), lse.data(), ws.data(), ws.size(), operands);
  }
  std::vector<float> backward_blocked(AttentionMatmul precision, const std::vector<float>& buf,
                                      const std::vector<float>& lse, const std::vector<float>& dout,
                                      Bf16Operands operands = Bf16Operands::automatic) const {
    std::vector<float> grad(buf.size(), 0.0f);
    std::vector<char> ws(attention_workspace_bytes(shape, precision, max_threads(), operands));
    attention_backward_blocked(shape, precision, buf.data() + q_offset, buf.data() + k_offset, buf.data() + v_offset,
                               segment_ids(), lse.data(), dout.data(), grad.data() + q_offset,
                               grad.data() + k_offset, grad.data() + v_offset, ws.data(), ws.size(), operands);
    return grad;
  }
  // Indices of qkv that hold data (not row padding).
  std::vector<int64_t> data_indices() const {
    std::vector<int64_t> idx;
    const int64_t width = (shape.q_heads + 2 * shape.kv_heads) * shape.head_dim;
    for (int64_t t = 0; t < tokens(); ++t)
      for (int64_t c = 0; c < width; ++c) idx.push_back(t * shape.ldq + c);
    return idx;
  }
  // Weights of the test loss sum(out * weights); zero on row padding.
  std::vector<double> loss_weights(uint64_t seed) const {
    std::vector<double> w = random_vector(out_size(), seed);
    for (int64_t t = 0; t < tokens(); ++t)
      for (int64_t c = shape.q_heads * shape.head_dim; c < shape.ldo; ++c) w[t * shape.ldo + c] = 0;
    return w;
  }
};

// Direct softmax attention in double with the full [seq, seq] score matrix.
void naive_attention(const FusedAttention& a, std::vector<double>& out, std::vector<double>& lse) {
  const AttentionShape& s = a.shape;
  out.assign(a.out_size(), 0.0);
  lse.assign(a.lse_size(), 0.0);
  const int64_t group = s.q_heads / s.kv_heads;
  for (int64_t b = 0; b < s.batch; ++b)
    for (int64_t h = 0; h < s.q_heads; ++h)
      for (int64_t i = 0; i < s.seq; ++i) {
        const int64_t ti = b * s.seq + i;
        const double* qi = a.qkv.data() + ti * s.ldq + a.q_offset + h * s.head_dim;
        std::vector<double> scores;
        std::vector<int64_t> keys;
        for (int64_t j = 0; j <= i; ++j) {
          if (!a.segments.empty() && a.segments[ti] != a.segments[b * s.seq + j]) continue;
          if (s.window > 0 && j <= i - s.window) continue;  // outside the sliding window
          const double* kj = a.qkv.data() + (b * s.seq + j) * s.ldk + a.k_offset + h / group * s.head_dim;
          double dot = 0;
          for (int64_t d = 0; d < s.head_dim; ++d) dot += qi[d] * kj[d];
          const double score = dot * s.scale;
          scores.push_back(s.softcap > 0 ? s.softcap * std::tanh(score / s.softcap) : score);
          keys.push_back(j);
        }
        double max = -std::numeric_limits<double>::infinity();
        for (double x : scores) max = std::max(max, x);
        double sum = 0;
        for (double x : scores) sum += std::exp(x - max);
        lse[(b * s.q_heads + h) * s.seq + i] = max + std::log(sum);
        double* o = out.data() + ti * s.ldo + h * s.head_dim;
        for (size_t n = 0; n < keys.size(); ++n) {
          const double p = std::exp(scores[n] - max) / sum;
          const double* vj = a.qkv.data() + (b * s.seq + keys[n]) * s.ldv + a.v_offset + h / group * s.head_dim;
          for (int64_t d = 0; d < s.head_dim; ++d) o[d] += p * vj[d];
        }
      }
}

// Documents of the given lengths packed into each sequence (ids restart per sequence).
std::vector<int32_t> packed_segments(int64_t batch, const std::vector<int64_t>& lengths) {
  std::vector<int32_t> seg;
  for (int64_t b = 0; b < batch; ++b)
    for (size_t d = 0; d < lengths.size(); ++d)
      for (int64_t t = 0; t < lengths[d]; ++t) seg.push_back(int32_t(d));
  return seg;
}

void expect_forward_matches_naive(const FusedAttention& a) {
  std::vector<double> out, lse, ref_out, ref_lse;
  a.forward(a.qkv, out, lse);
  naive_attention(a, ref_out, ref_lse);
  for (size_t i = 0; i < out.size(); ++i) ASSERT_NEAR(out[i], ref_out[i], 1e-12) << i;
  for (size_t i = 0; i < lse.size(); ++i) ASSERT_NEAR(lse[i], ref_lse[i], 1e-12) << i;

  // fp32 agrees to float precision.
  std::vector<float> out_f, lse_f;
  a.forward(test::to_float(a.qkv), out_f, lse_f);
  for (size_t i = 0; i < out.size(); ++i) ASSERT_NEAR(out_f[i], ref_out[i], 2e-6) << i;
  for (size_t i = 0; i < lse.size(); ++i) ASSERT_NEAR(lse_f[i], ref_lse[i], 2e-6 * std::fabs(ref_lse[i]) + 1e-6) << i;
}

void expect_backward_matches_finite_differences(FusedAttention& a, int64_t samples) {
  const std::vector<double> weights = a.loss_weights(99);
  std::vector<double> out, lse;
  a.forward(a.qkv, out, lse);
  const std::vector<double> grad = a.backward(a.qkv, out, lse, weights);
  const std::vector<int64_t> all = a.data_indices();
  std::vector<int64_t> picked;
  for (int64_t i : sample_indices(int64_t(all.size()), samples, 5)) picked.push_back(all[i]);
  expect_gradient_matches("d qkv", a.qkv, grad, picked, [&] {
    std::vector<double> o, l;
    a.forward(a.qkv, o, l);
    return test::weighted_sum(o, weights);
  });
}

TEST(Attention, ForwardMatchesNaiveWithGqaAndStrides) {
  FusedAttention a(2, 70, 4, 2, 8, 1);  // 70: two query/key tiles, the second partial
  expect_forward_matches_naive(a);
}

TEST(Attention, ForwardMatchesNaiveMultiHeadAndMultiQuery) {
  FusedAttention mha(1, 33, 3, 3, 4, 2);
  expect_forward_matches_naive(mha);
  FusedAttention mqa(1, 130, 4, 1, 8, 3);
  expect_forward_matches_naive(mqa);
}

TEST(Attention, ForwardMatchesNaiveWithSegments) {
  FusedAttention a(2, 150, 4, 2, 8, 4);
  a.segments = packed_segments(2, {40, 70, 25, 15});
  expect_forward_matches_naive(a);
}

TEST(Attention, BackwardMatchesFiniteDifferencesSmall) {
  FusedAttention a(2, 9, 4, 2, 4, 6);
  expect_backward_matches_finite_differences(a, 1 << 30);  // every entry
}

TEST(Attention, BackwardMatchesFiniteDifferencesAcrossTiles) {
  FusedAttention a(2, 70, 4, 2, 8, 7);
  expect_backward_matches_finite_differences(a, 400);
}

TEST(Attention, BackwardMatchesFiniteDifferencesWithSegments) {
  FusedAttention a(1, 140, 4, 2, 8, 8);
  a.segments = packed_segments(1, {50, 30, 45, 15});  // boundaries inside and across tiles
  expect_backward_matches_finite_differences(a, 400);
}

TEST(Attention, BackwardMatchesFiniteDifferencesWithInterleavedSegments) {
  // Not contiguous: a document id may reappear; the mask only compares ids.
  FusedAttention a(1, 20, 2, 1, 4, 9);
  for (int64_t t = 0; t < 20; ++t) a.segments.push_back(int32_t(t % 3 == 0));
  expect_forward_matches_naive(a);
  expect_backward_matches_finite_differences(a, 1 << 30);
}

// A packed sequence gives every document the output it would get alone.
void expect_packed_documents_match_documents_alone(int64_t window, double softcap = 0.0) {
  const std::vector<int64_t> lengths = {40, 70, 25, 15};
  FusedAttention packed(1, 150, 4, 2, 8, 10);
  packed.shape.window = window;
  packed.shape.softcap = softcap;
  packed.segments = packed_segments(1, lengths);
  std::vector<double> out, lse;
  packed.forward(packed.qkv, out, lse);
  const AttentionShape& s = packed.shape;

  int64_t start = 0;
  for (int64_t len : lengths) {
    FusedAttention alone(1, len, 4, 2, 8, 0);
    alone.shape.window = window;
    alone.shape.softcap = softcap;
    std::copy_n(packed.qkv.begin() + start * s.ldq, len * s.ldq, alone.qkv.begin());
    std::vector<double> out1, lse1;
    alone.forward(alone.qkv, out1, lse1);
    for (int64_t t = 0; t < len; ++t)
      for (int64_t c = 0; c < s.q_heads * s.head_dim; ++c)
        ASSERT_NEAR(out1[t * s.ldo + c], out[(start + t) * s.ldo + c], 1e-13);
    for (int64_t h = 0; h < s.q_heads; ++h)
      for (int64_t t = 0; t < len; ++t) ASSERT_NEAR(lse1[h * len + t], lse[h * s.seq + start + t], 1e-13);
    start += len;
  }
}

TEST(Attention, PackedDocumentsMatchDocumentsAlone) { expect_packed_documents_match_documents_alone(0); }

// Sliding-window attention (Mistral): query i sees keys i - window < j <= i. `check` runs on `a`
// with each window, alone and with packed documents of `lengths`.
template <typename Check>
void for_each_window(FusedAttention a, std::initializer_list<int64_t> windows, const std::vector<int64_t>& lengths,
                     Check check) {
  for (int64_t window : windows) {
    SCOPED_TRACE(window);
    a.shape.window = window;
    a.segments.clear();
    check(a);
    a.segments = packed_segments(a.shape.batch, lengths);
    check(a);
  }
}

TEST(Attention, SlidingWindowForwardMatchesNaive) {
  // one key, inside a tile, tile-sized, across tiles, beyond the sequence
  for_each_window(FusedAttention(2, 150, 4, 2, 8, 50), {1, 5, 64, 65, 200}, {40, 70, 25, 15},
                  [](const FusedAttention& a) { expect_forward_matches_naive(a); });
}

TEST(Attention, SlidingWindowBackwardMatchesFiniteDifferences) {
  FusedAttention a(1, 140, 4, 2, 8, 51);
  a.shape.window = 37;  // window edges inside and across tiles
  a.segments = packed_segments(1, {50, 30, 45, 15});
  expect_backward_matches_finite_differences(a, 400);
  FusedAttention small(2, 9, 4, 2, 4, 52);
  small.shape.window = 3;
  expect_backward_matches_finite_differences(small, 1 << 30);
}

TEST(Attention, SlidingWindowPackedDocumentsMatchDocumentsAlone) { expect_packed_documents_match_documents_alone(33); }

TEST(Attention, SoftCappedPackedDocumentsMatchDocumentsAlone) {
  expect_packed_documents_match_documents_alone(0, 1.2);
  expect_packed_documents_match_documents_alone(33, 1.2);  // Gemma 2's sliding layers
}

TEST(Attention, BackwardIsIdenticalForOneAndTwoThreads) {
  FusedAttention a(2, 150, 4, 2, 16, 11);
  a.segments = packed_segments(2, {100, 50});
  const std::vector<float> buf = test::to_float(a.qkv);
  const std::vector<float> dout = test::to_float(a.loss_weights(12));
  std::vector<float> grads[2];
  for (int threads : {1, 2})
    test::with_threads(threads, [&] {
      std::vector<float> out, lse;
      a.forward(buf, out, lse);
      grads[threads - 1] = a.backward(buf, out, lse, dout);
    });
  ASSERT_EQ(std::memcmp(grads[0].data(), grads[1].data(), grads[0].size() * sizeof(float)), 0);
}

TEST(Attention, FloatBackwardAgreesWithDouble) {
  FusedAttention a(1, 100, 4, 2, 16, 13);
  const std::vector<double> dout = a.loss_weights(14);
  std::vector<double> out, lse;
  a.forward(a.qkv, out, lse);
  const std::vector<double> grad = a.backward(a.qkv, out, lse, dout);
  std::vector<float> out_f, lse_f;
  const std::vector<float> buf = test::to_float(a.qkv);
  a.forward(buf, out_f, lse_f);
  const std::vector<float> grad_f = a.backward(buf, out_f, lse_f, test::to_float(dout));
  for (int64_t i : a.data_indices()) ASSERT_NEAR(grad_f[i], grad[i], 2e-5) << i;
}

// --- The blocked (GEMM) kernels: the same results as the reference kernel in double. ---

// Relative L2 distance over the entries at `idx`.
template <typename A, typename B>
double relative_l2(const std::vector<A>& x, const std::vector<B>& ref, const std::vector<int64_t>& idx) {
  double num = 0, den = 0;
  for (int64_t i : idx) {
    num += (double(x[i]) - double(ref[i])) * (double(x[i]) - double(ref[i]));
    den += double(ref[i]) * double(ref[i]);
  }
  return std::sqrt(num / std::max(den, 1e-300));
}

std::vector<int64_t> output_indices(const FusedAttention& a) {
  std::vector<int64_t> idx;
  for (int64_t t = 0; t < a.tokens(); ++t)
    for (int64_t c = 0; c < a.shape.q_heads * a.shape.head_dim; ++c) idx.push_back(t * a.shape.ldo + c);
  return idx;
}

// f32: within float rounding of the double reference, entry by entry; bf16: within bf16 rounding
// of the inputs (relative L2, as for any bf16 product).
void expect_blocked_matches_reference(const FusedAttention& a) {
  std::vector<double> out, lse;
  a.forward(a.qkv, out, lse);
  const std::vector<double> dout = a.loss_weights(21);
  const std::vector<double> grad = a.backward(a.qkv, out, lse, dout);
  const std::vector<float> buf = test::to_float(a.qkv), dout_f = test::to_float(dout);
  for (AttentionMatmul precision : {AttentionMatmul::F32, AttentionMatmul::BF16}) {
    SCOPED_TRACE(precision == AttentionMatmul::F32 ? "f32" : "bf16");
    std::vector<float> out_f, lse_f;
    a.forward_blocked(precision, buf, out_f, lse_f);
    const std::vector<float> grad_f = a.backward_blocked(precision, buf, lse_f, dout_f);
    if (precision == AttentionMatmul::F32) {
      for (int64_t i : output_indices(a)) ASSERT_NEAR(out_f[i], out[i], 4e-6) << i;
      for (size_t i = 0; i < lse.size(); ++i) ASSERT_NEAR(lse_f[i], lse[i], 4e-6 * std::fabs(lse[i]) + 4e-6) << i;
      for (int64_t i : a.data_indices()) ASSERT_NEAR(grad_f[i], grad[i], 4e-5) << i;
    } else {
      EXPECT_LT(relative_l2(out_f, out, output_indices(a)), 1e-2);
      EXPECT_LT(relative_l2(grad_f, grad, a.data_indices()), 2e-2);
      for (size_t i = 0; i < lse.size(); ++i) ASSERT_NEAR(lse_f[i], lse[i], 5e-2 * std::fabs(lse[i]) + 5e-2) << i;
    }
    // Padding between rows is never written.
    for (int64_t t = 0; t < a.tokens(); ++t)
      for (int64_t c = a.shape.q_heads * a.shape.head_dim; c < a.shape.ldo; ++c)
        ASSERT_EQ(out_f[t * a.shape.ldo + c], 0.0f);
  }
}

TEST(AttentionBlocked, MatchesReferenceAcrossBlocksWithGqa) {
  expect_blocked_matches_reference(FusedAttention(2, 150, 4, 2, 16, 31));  // blocks of 64, the last partial
}

TEST(AttentionBlocked, MatchesReferenceMultiQueryAndShort) {
  expect_blocked_matches_reference(FusedAttention(1, 130, 4, 1, 8, 32));
  expect_blocked_matches_reference(FusedAttention(3, 5, 2, 2, 4, 33));
}

TEST(AttentionBlocked, MatchesReferenceWithPackedDocuments) {
  FusedAttention a(2, 200, 4, 2, 8, 34);
  a.segments = packed_segments(2, {40, 90, 25, 45});  // documents starting inside and across blocks
  expect_blocked_matches_reference(a);
}

TEST(AttentionBlocked, MatchesReferenceWithInterleavedSegments) {
  FusedAttention a(1, 140, 2, 1, 8, 35);  // ids reappear: every key from 0 is visited, the mask decides
  for (int64_t t = 0; t < 140; ++t) a.segments.push_back(int32_t((t / 7) % 3));
  expect_blocked_matches_reference(a);
}

TEST(AttentionBlocked, MatchesReferenceWithSlidingWindow) {
  // inside a block, a block, across blocks
  for_each_window(FusedAttention(2, 200, 4, 2, 8, 53), {1, 30, 64, 100}, {40, 90, 25, 45},
                  [](const FusedAttention& a) { expect_blocked_matches_reference(a); });
}

// Attention-logit soft-capping (Gemma 2), with and without windows and documents.
TEST(Attention, SoftCappedForwardMatchesNaiveAndBackwardFiniteDifferences) {
  FusedAttention a(1, 140, 4, 2, 8, 54);
  a.shape.softcap = 1.2;  // the scores reach several units: deep in tanh's curve
  expect_forward_matches_naive(a);
  expect_backward_matches_finite_differences(a, 400);
  for_each_window(FusedAttention(1, 140, 4, 2, 8, 55), {9, 70}, {50, 30, 45, 15}, [](FusedAttention a) {
    a.shape.softcap = 1.2;
    expect_forward_matches_naive(a);
    expect_backward_matches_finite_differences(a, 200);
  });
}

TEST(AttentionBlocked, MatchesReferenceWithSoftCapping) {
  for_each_window(FusedAttention(2, 200, 4, 2, 8, 56), {0, 30}, {40, 90, 25, 45}, [](FusedAttention a) {
    a.shape.softcap = 1.2;
    expect_blocked_matches_reference(a);
  });
}

TEST(AttentionBlocked, IdenticalForOneAndTwoThreads) {
  FusedAttention a(2, 150, 4, 2, 16, 36);
  a.segments = packed_segments(2, {100, 50});
  const std::vector<float> buf = test::to_float(a.qkv);
  const std::vector<float> dout = test::to_float(a.loss_weights(37));
  for (AttentionMatmul precision : {AttentionMatmul::F32, AttentionMatmul::BF16}) {
    std::vector<float> outs[2], grads[2];
    for (int threads : {1, 2})
      test::with_threads(threads, [&] {
        std::vector<float> lse;
        a.forward_blocked(precision, buf, outs[threads - 1], lse);
        grads[threads - 1] = a.backward_blocked(precision, buf, lse, dout);
      });
    ASSERT_EQ(outs[0], outs[1]);
    ASSERT_EQ(std::memcmp(grads[0].data(), grads[1].data(), grads[0].size() * sizeof(float)), 0);
  }
}

// bf16 operands held widened (fp32 rounded to bf16 values) against packed bf16 ones. Where
// gemm_bf16 widens its inputs (no bf16 matmul on this CPU) the two are the same fp32 products of
// the same values: identical bits. Where the CPU multiplies bf16 natively, its kernels sum in
// another order, and a score that moves by an ulp can round its probability to the next bf16: the
// widened holding is then held to what any bf16 attention must meet, the double reference within
// bf16 rounding (expect_blocked_matches_reference's bounds).
void expect_widened_operands_match_packed(const FusedAttention& a) {
  const std::vector<float> buf = test::to_float(a.qkv), dout = test::to_float(a.loss_weights(57));
  std::vector<float> out[2], lse[2], grad[2];
  const Bf16Operands holding[2] = {Bf16Operands::packed, Bf16Operands::widened};
  for (int m = 0; m < 2; ++m) {
    a.forward_blocked(AttentionMatmul::BF16, buf, out[m], lse[m], holding[m]);
    grad[m] = a.backward_blocked(AttentionMatmul::BF16, buf, lse[m], dout, holding[m]);
  }
  if (!bf16_matmul_native()) {
    ASSERT_EQ(std::memcmp(out[0].data(), out[1].data(), out[0].size() * sizeof(float)), 0);
    ASSERT_EQ(std::memcmp(lse[0].data(), lse[1].data(), lse[0].size() * sizeof(float)), 0);
    ASSERT_EQ(std::memcmp(grad[0].data(), grad[1].data(), grad[0].size() * sizeof(float)), 0);
  } else {
    std::vector<double> ref_out, ref_lse;
    a.forward(a.qkv, ref_out, ref_lse);
    const std::vector<double> ref_grad = a.backward(a.qkv, ref_out, ref_lse, a.loss_weights(57));
    EXPECT_LT(relative_l2(out[1], ref_out, output_indices(a)), 1e-2);
    EXPECT_LT(relative_l2(grad[1], ref_grad, a.data_indices()), 2e-2);
  }
  // And not the fp32 kernel's results: the rounding to bf16 happened.
  std::vector<float> out_f32, lse_f32;
  a.forward_blocked(AttentionMatmul::F32, buf, out_f32, lse_f32);
  EXPECT_GT(relative_l2(out[1], out_f32, output_indices(a)), 1e-4);
}

TEST(AttentionBlocked, WidenedBf16OperandsGiveThePackedOperandsResults) {
  FusedAttention gqa(2, 150, 4, 2, 16, 58);
  gqa.segments = packed_segments(2, {100, 50});
  expect_widened_operands_match_packed(gqa);
  for_each_window(FusedAttention(1, 200, 4, 2, 8, 59), {0, 30}, {40, 90, 25, 45}, [](FusedAttention a) {
    expect_widened_operands_match_packed(a);
    a.shape.softcap = 1.2;  // the capped backward rounds after the slope
    expect_widened_operands_match_packed(a);
  });
}

// Softmax ignores a shift of all of a row's scores, so each row of dS sums to 0, and so do the
// keys' gradients: sum_j dK_j = scale * sum_i (sum_j dS_ij) Q_i, what a bias added to every key
// (GLM's k bias outside the rotary channels) cannot change. In bf16 only the rounding of dS to
// bf16 may break it, at random across a row. A D taken as dO . O breaks it on every row: O was
// made from bf16-rounded probabilities and dP from bf16-rounded dO, so D misses sum_j P_ij dP_ij
// by ~2^-9 |D_i|, which dO close to O (a loss that pulls the output along itself) makes large.
// Measured (the same on AVX-512 BF16, AVX2 and portable kernels): the worst channel's sum is
// 6.9e-4 of sum_j |dK_j| with the row's own D, 2.1e-3 with dO . O.
TEST(AttentionBlocked, KeyGradientsSumToZeroAsSoftmaxIgnoresAShift) {
  FusedAttention a(2, 150, 4, 2, 16, 61);
  a.segments = packed_segments(2, {100, 50});
  const std::vector<float> buf = test::to_float(a.qkv), noise = test::to_float(a.loss_weights(62));
  for (AttentionMatmul precision : {AttentionMatmul::F32, AttentionMatmul::BF16}) {
    SCOPED_TRACE(precision == AttentionMatmul::F32 ? "f32" : "bf16");
    std::vector<float> out, lse;
    a.forward_blocked(precision, buf, out, lse);
    std::vector<float> dout(out.size());
    for (size_t i = 0; i < out.size(); ++i) dout[i] = out[i] + 0.1f * noise[i];
    const std::vector<float> grad = a.backward_blocked(precision, buf, lse, dout);
    double worst = 0.0;
    for (int64_t b = 0; b < a.shape.batch; ++b)
      for (int64_t c = 0; c < a.shape.kv_heads * a.shape.head_dim; ++c) {
        double sum = 0.0, size = 0.0;
        for (int64_t t = b * a.shape.seq; t < (b + 1) * a.shape.seq; ++t) {
          const double g = grad[size_t(t * a.shape.ldk + a.k_offset + c)];
          sum += g;
          size += std::fabs(g);
        }
        worst = std::max(worst, std::fabs(sum) / size);
      }
    EXPECT_LT(worst, precision == AttentionMatmul::F32 ? 1e-5 : 1.2e-3);
  }
}

TEST(AttentionBlocked, RefusesASmallWorkspace) {
  FusedAttention a(1, 100, 2, 1, 8, 38);
  const std::vector<float> buf = test::to_float(a.qkv);
  std::vector<float> out(a.out_size()), lse(a.lse_size());
  std::vector<char> ws(attention_workspace_bytes(a.shape, AttentionMatmul::F32, max_threads()) - 1);
  EXPECT_THROW(
      attention_forward_blocked(a.shape, AttentionMatmul::F32, buf.data(), buf.data() + a.k_offset,
                                buf.data() + a.v_offset, nullptr, out.data(), lse.data(), ws.data(), ws.size()),
      keel::Error);
}

}  // namespace
}  // namespace keel::kernels
