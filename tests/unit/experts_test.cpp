// The mixture-of-experts MLP (model/experts.h) against a naive per-token implementation in double
// precision: the grouped forward pass, and every gradient (inputs, router, experts, with the
// load-balancing loss and its padding mask) against central differences of the naive one, on each
// backend, with norm_topk_prob both ways and an expert no token chooses.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <numeric>
#include <vector>

#include "finite_difference.h"
#include "keel/core/dtype.h"
#include "keel/core/error.h"
#include "keel/core/four_bit.h"
#include "keel/kernels/backend.h"
#include "keel/model/decoder.h"
#include "keel/model/decoder_plan.h"
#include "keel/model/experts.h"
#include "keel/model/lora.h"
#include "keel/model/peft_adapter.h"

namespace keel::model {
namespace {

struct Case {
  ExpertsShape s;
  std::vector<double> x, router, gate_up, down, residual, probe, mask;
  std::vector<double> bias;  // sigmoid routing: e_score_correction_bias
};

// y = residual + sum_j w_j down_e(silu(gate_e x) * up_e x), and the load-balancing loss, in double.
struct Naive {
  std::vector<double> y;
  double aux = 0;
};

Naive naive(const Case& c) {
  const auto& s = c.s;
  const int64_t N = s.tokens, H = s.hidden, E = s.experts, k = s.top_k, I = s.inter;
  Naive out;
  out.y = c.residual;
  std::vector<double> count(size_t(E), 0.0), prob(size_t(E), 0.0);
  double rows = 0;
  for (int64_t t = 0; t < N; ++t) {
    std::vector<double> p(static_cast<size_t>(E));
    for (int64_t e = 0; e < E; ++e) {
      double logit = 0;
      for (int64_t i = 0; i < H; ++i) logit += c.x[size_t(t * H + i)] * c.router[size_t(e * H + i)];
      p[size_t(e)] = logit;
    }
    std::vector<int64_t> order(static_cast<size_t>(E));
    std::iota(order.begin(), order.end(), 0);
    double chosen_sum = 0;
    if (s.sigmoid) {  // GLM-4.5: sigmoid scores; the choice by score + bias among the best groups
      for (double& v : p) v = 1 / (1 + std::exp(-v));
      const int64_t per = E / s.groups;
      std::vector<double> choice(static_cast<size_t>(E)), group(static_cast<size_t>(s.groups));
      for (int64_t e = 0; e < E; ++e) choice[size_t(e)] = p[size_t(e)] + c.bias[size_t(e)];
      for (int64_t g = 0; g < s.groups; ++g) {  // its two best, summed
        std::vector<double> members(choice.begin() + g * per, choice.begin() + (g + 1) * per);
        std::sort(members.rbegin(), members.rend());
        group[size_t(g)] = members[0] + members[1];
      }
      std::vector<int64_t> groups(static_cast<size_t>(s.groups));
      std::iota(groups.begin(), groups.end(), 0);
      std::stable_sort(groups.begin(), groups.end(),
                       [&](int64_t a, int64_t b) { return group[size_t(a)] > group[size_t(b)]; });
      for (int64_t g = s.topk_groups; g < s.groups; ++g)
        for (int64_t e = groups[size_t(g)] * per; e < (groups[size_t(g)] + 1) * per; ++e) choice[size_t(e)] = -1e300;
      std::stable_sort(order.begin(), order.end(),
                       [&](int64_t a, int64_t b) { return choice[size_t(a)] > choice[size_t(b)]; });
      chosen_sum = 1e-20;
    } else {
      const double most = *std::max_element(p.begin(), p.end());
      double sum = 0;
      for (double& v : p) sum += v = std::exp(v - most);
      for (double& v : p) v /= sum;
      std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return p[size_t(a)] > p[size_t(b)]; });
    }
    for (int64_t j = 0; j < k; ++j) chosen_sum += p[size_t(order[size_t(j)])];
    for (int64_t j = 0; j < k; ++j) {
      const int64_t e = order[size_t(j)];
      double w = s.norm_topk_prob ? p[size_t(e)] / chosen_sum : p[size_t(e)];
      if (s.sigmoid) w *= s.routed_scaling_factor;
      std::vector<double> act(static_cast<size_t>(I));
      for (int64_t r = 0; r < I; ++r) {
        double g = 0, u = 0;
        for (int64_t i = 0; i < H; ++i) {
          g += c.gate_up[size_t((e * 2 * I + r) * H + i)] * c.x[size_t(t * H + i)];
          u += c.gate_up[size_t((e * 2 * I + I + r) * H + i)] * c.x[size_t(t * H + i)];
        }
        act[size_t(r)] = g / (1 + std::exp(-g)) * u;
      }
      for (int64_t i = 0; i < H; ++i) {
        double d = 0;
        for (int64_t r = 0; r < I; ++r) d += c.down[size_t((e * H + i) * I + r)] * act[size_t(r)];
        out.y[size_t(t * H + i)] += w * d;
      }
      count[size_t(e)] += c.mask[size_t(t)];
    }
    for (int64_t e = 0; e < E; ++e) prob[size_t(e)] += c.mask[size_t(t)] * p[size_t(e)];
    rows += c.mask[size_t(t)];
  }
  for (int64_t e = 0; e < E; ++e) out.aux += (count[size_t(e)] / rows) * (prob[size_t(e)] / rows);
  out.aux *= double(E);
  return out;
}

// Parameters: backend, norm_topk_prob, and GLM-4.5's sigmoid routing (6 experts in 3 groups, the
// best 2 groups' top 2, a nonzero e_score_correction_bias, weights x 2.5; no load-balancing loss).
class ExpertsTest : public ::testing::TestWithParam<std::tuple<std::string, bool, bool>> {};

TEST_P(ExpertsTest, GroupedProductsMatchANaiveLoopAndItsGradients) {
  const auto& [backend_name, norm, sigmoid] = GetParam();
  kernels::Backend& backend = kernels::backend_named(backend_name);
  Case c;
  c.s = {7, 8, 5, 2, 6, norm};
  if (sigmoid) c.s = {7, 8, 6, 2, 6, norm, true, 3, 2, 2.5f};
  const auto& s = c.s;
  const int64_t N = s.tokens, H = s.hidden, E = s.experts, I = s.inter, R = s.routed();
  c.x = test::random_vector(size_t(N * H), 1);
  c.router = test::random_vector(size_t(E * H), 2, -1.5, 1.5);
  // Feature 0 is 1 for every token, and expert 3's router row reads only it, at -20: no token chooses expert 3.
  for (int64_t t = 0; t < N; ++t) c.x[size_t(t * H)] = 1.0;
  for (int64_t i = 0; i < H; ++i) c.router[size_t(3 * H + i)] = i == 0 ? -20.0 : 0.0;
  c.gate_up = test::random_vector(size_t(E * 2 * I * H), 3);
  c.down = test::random_vector(size_t(E * H * I), 4);
  c.residual = test::random_vector(size_t(N * H), 5);
  c.probe = test::random_vector(size_t(N * H), 6);
  c.mask = {1, 1, 1, 1, 0, 1, 0};  // two padding tokens: out of the load-balancing loss
  c.bias = test::random_vector(size_t(E), 11, -0.3, 0.3);
  c.bias[3] = -1.0;  // expert 3 stays unchosen under sigmoid routing too
  const double aux_weight = sigmoid ? 0.0 : 0.7;  // GLM-4.5 has no load-balancing loss

  // keel, fp32
  auto x = test::to_float(c.x), router = test::to_float(c.router), gate_up = test::to_float(c.gate_up),
       down = test::to_float(c.down), residual = test::to_float(c.residual), mask = test::to_float(c.mask);
  auto floats = [](int64_t n) { return std::vector<float>(static_cast<size_t>(n)); };
  auto ints = [](int64_t n) { return std::vector<int32_t>(static_cast<size_t>(n)); };
  std::vector<float> probs = floats(N * E), weight = floats(R), in = floats(R * H), gu = floats(R * 2 * I),
                     act = floats(R * I), out = floats(R * H), y = floats(N * H);
  std::vector<int32_t> choice = ints(R), expert_rows = ints(E + 1), row_slot = ints(R), token_rows = ints(R);
  const RoutedActivations a{probs.data(),    choice.data(), weight.data(), expert_rows.data(), row_slot.data(),
                            token_rows.data(), in.data(),   gu.data(),     act.data(),         out.data()};
  std::vector<double> sums(static_cast<size_t>(3 * E));
  RouterBalance balance{sums.data(), sums.data() + E, sums.data() + 2 * E};
  balance.clear(E);
  auto bias = test::to_float(c.bias);
  ExpertsWeights w{router.data(), gate_up.data(), down.data()};
  if (sigmoid) w.router_bias = bias.data();
  experts_forward(backend, s, x.data(), nullptr, w, a, residual.data(), y.data(), mask.data(),
                  sigmoid ? nullptr : &balance);
  balance.rows = std::accumulate(c.mask.begin(), c.mask.end(), 0.0);
  const double aux = balance.finish(E, aux_weight);

  const Naive ref = naive(c);
  for (int64_t i = 0; i < N * H; ++i) EXPECT_NEAR(y[size_t(i)], ref.y[size_t(i)], 1e-5) << i;
  if (!sigmoid) EXPECT_NEAR(aux, ref.aux, 1e-6);
  EXPECT_EQ(expert_tokens(a, 3), 0) << "the test wants an expert no token chose";
  int64_t routed = 0;
  for (int64_t e = 0; e < E; ++e) routed += expert_tokens(a, e);
  EXPECT_EQ(routed, R);

  // Backward of L = sum(probe * y) + aux_weight * aux; the gradients overwrite (beta 0), so the
  // unchosen expert's must come out 0 over the garbage put there.
  std::vector<float> dy = test::to_float(c.probe), dx = floats(N * H), d_rows = floats(R * H),
                     d_act = floats(R * I), d_gu = floats(R * 2 * I), d_logits = floats(N * E), d_slot = floats(R);
  std::vector<float> g_router(size_t(E * H), 9.0f), g_gate_up(size_t(E * 2 * I * H), 9.0f),
      g_down(size_t(E * H * I), 9.0f);
  const ExpertsGrads g{g_router.data(), g_gate_up.data(), g_down.data(), 0.0f, 0.0f, 0.0f};
  const ExpertsScratch scratch{d_rows.data(), d_act.data(), d_gu.data(), d_logits.data(), d_slot.data()};
  experts_backward(backend, s, x.data(), nullptr, w, a, dy.data(), scratch, sigmoid ? nullptr : &balance, mask.data(),
                   g, dx.data());

  auto loss = [&] {
    const Naive n = naive(c);
    double l = aux_weight * n.aux;
    for (size_t i = 0; i < n.y.size(); ++i) l += c.probe[i] * n.y[i];
    return l;
  };
  auto as_double = [](const std::vector<float>& v) { return std::vector<double>(v.begin(), v.end()); };
  test::expect_gradient_matches("dx", c.x, as_double(dx), test::sample_indices(N * H, 40, 7), loss, 1e-6, 2e-4);
  test::expect_gradient_matches("d router", c.router, as_double(g_router), test::sample_indices(E * H, 40, 8), loss,
                                1e-6, 2e-4);
  test::expect_gradient_matches("d gate_up", c.gate_up, as_double(g_gate_up),
                                test::sample_indices(E * 2 * I * H, 60, 9), loss, 1e-6, 2e-4);
  test::expect_gradient_matches("d down", c.down, as_double(g_down), test::sample_indices(E * H * I, 60, 10), loss,
                                1e-6, 2e-4);
  for (int64_t i = 0; i < 2 * I * H; ++i) ASSERT_EQ(g_gate_up[size_t(3 * 2 * I * H + i)], 0.0f);
  for (int64_t i = 0; i < H * I; ++i) ASSERT_EQ(g_down[size_t(3 * H * I + i)], 0.0f);
}

// LoRA on the experts (experts.h: ExpertsLora): each expert's W_e + scaling B_e A_e, as PEFT folds
// it (lora.ParamWrapper), computed as x W_e^T + (scaling x A_e^T) B_e^T on the expert's rows. The
// forward pass against the naive loop on the folded weights; dA, dB (added to, as LoRA's gradients
// are) and dx against its central differences; an expert no token chose gets nothing.
TEST_P(ExpertsTest, AdaptersOnBothTensorsMatchTheFoldedWeightsAndTheirGradients) {
  const auto& [backend_name, norm, sigmoid] = GetParam();
  kernels::Backend& backend = kernels::backend_named(backend_name);
  Case c;
  // The adapters act on each expert's routed rows whatever chose them: the softmax routing only
  // (GroupedProductsMatchANaiveLoopAndItsGradients checks GLM-4.5's sigmoid routing).
  if (sigmoid) GTEST_SKIP() << "adapters are checked under the softmax routing";
  c.s = {7, 8, 5, 2, 6, norm};
  const auto& s = c.s;
  const int64_t N = s.tokens, H = s.hidden, E = s.experts, I = s.inter, R = s.routed(), r = 3;
  const double scaling = 1.5;
  c.x = test::random_vector(size_t(N * H), 11);
  c.router = test::random_vector(size_t(E * H), 12, -1.5, 1.5);
  for (int64_t t = 0; t < N; ++t) c.x[size_t(t * H)] = 1.0;  // expert 3 unchosen, as above
  for (int64_t i = 0; i < H; ++i) c.router[size_t(3 * H + i)] = i == 0 ? -20.0 : 0.0;
  const std::vector<double> gate_up0 = test::random_vector(size_t(E * 2 * I * H), 13),
                            down0 = test::random_vector(size_t(E * H * I), 14);
  c.residual = test::random_vector(size_t(N * H), 15);
  c.probe = test::random_vector(size_t(N * H), 16);
  c.mask.assign(size_t(N), 1.0);
  // keel's layouts (lora.h): A [E r, in], B [E out, r].
  std::vector<double> a_gu = test::random_vector(size_t(E * r * H), 17), b_gu = test::random_vector(size_t(E * 2 * I * r), 18),
                      a_d = test::random_vector(size_t(E * r * I), 19), b_d = test::random_vector(size_t(E * H * r), 20);
  auto fold = [&](const std::vector<double>& w0, const std::vector<double>& A, const std::vector<double>& B, int64_t out,
                  int64_t in) {
    std::vector<double> w = w0;
    for (int64_t e = 0; e < E; ++e)
      for (int64_t o = 0; o < out; ++o)
        for (int64_t i = 0; i < in; ++i) {
          double sum = 0;
          for (int64_t j = 0; j < r; ++j) sum += B[size_t((e * out + o) * r + j)] * A[size_t((e * r + j) * in + i)];
          w[size_t((e * out + o) * in + i)] += scaling * sum;
        }
    return w;
  };
  auto folded = [&] {
    Case f = c;
    f.gate_up = fold(gate_up0, a_gu, b_gu, 2 * I, H);
    f.down = fold(down0, a_d, b_d, H, I);
    return f;
  };

  auto x = test::to_float(c.x), router = test::to_float(c.router), gate_up = test::to_float(gate_up0),
       down = test::to_float(down0), residual = test::to_float(c.residual);
  auto fa_gu = test::to_float(a_gu), fb_gu = test::to_float(b_gu), fa_d = test::to_float(a_d), fb_d = test::to_float(b_d);
  auto floats = [](int64_t n) { return std::vector<float>(static_cast<size_t>(n)); };
  auto ints = [](int64_t n) { return std::vector<int32_t>(static_cast<size_t>(n)); };
  std::vector<float> probs = floats(N * E), weight = floats(R), in = floats(R * H), gu = floats(R * 2 * I),
                     act = floats(R * I), out = floats(R * H), y = floats(N * H), u_gu = floats(R * r), u_d = floats(R * r);
  std::vector<int32_t> choice = ints(R), expert_rows = ints(E + 1), row_slot = ints(R), token_rows = ints(R);
  RoutedActivations a{probs.data(),    choice.data(), weight.data(), expert_rows.data(), row_slot.data(),
                      token_rows.data(), in.data(),   gu.data(),     act.data(),         out.data()};
  a.lora_u_gate_up = u_gu.data();
  a.lora_u_down = u_d.data();
  ExpertsWeights w{router.data(), gate_up.data(), down.data()};
  w.gate_up_lora = {fa_gu.data(), fb_gu.data()};
  w.down_lora = {fa_d.data(), fb_d.data()};
  w.lora_rank = r;
  w.lora_scaling = float(scaling);
  experts_forward(backend, s, x.data(), nullptr, w, a, residual.data(), y.data(), nullptr, nullptr);
  const Naive ref = naive(folded());
  for (int64_t i = 0; i < N * H; ++i) EXPECT_NEAR(y[size_t(i)], ref.y[size_t(i)], 1e-5) << i;
  ASSERT_EQ(expert_tokens(a, 3), 0);

  std::vector<float> dy = test::to_float(c.probe), dx = floats(N * H), d_rows = floats(R * H), d_act = floats(R * I),
                     d_gu = floats(R * 2 * I), d_logits = floats(N * E), d_slot = floats(R), du = floats(R * r);
  std::vector<float> g_a_gu = floats(E * r * H), g_b_gu = floats(E * 2 * I * r), g_a_d = floats(E * r * I),
                     g_b_d = floats(E * H * r);
  ExpertsGrads g;  // the base frozen: only the adapters' gradients
  g.gate_up_a = g_a_gu.data(), g.gate_up_b = g_b_gu.data(), g.down_a = g_a_d.data(), g.down_b = g_b_d.data();
  ExpertsScratch scratch{d_rows.data(), d_act.data(), d_gu.data(), d_logits.data(), d_slot.data()};
  scratch.lora_du = du.data();
  experts_backward(backend, s, x.data(), nullptr, w, a, dy.data(), scratch, nullptr, nullptr, g, dx.data());

  auto loss = [&] {
    const Naive n = naive(folded());
    double l = 0;
    for (size_t i = 0; i < n.y.size(); ++i) l += c.probe[i] * n.y[i];
    return l;
  };
  auto as_double = [](const std::vector<float>& v) { return std::vector<double>(v.begin(), v.end()); };
  test::expect_gradient_matches("dx", c.x, as_double(dx), test::sample_indices(N * H, 30, 21), loss, 1e-6, 2e-4);
  test::expect_gradient_matches("d gate_up A", a_gu, as_double(g_a_gu), test::sample_indices(E * r * H, 40, 22), loss,
                                1e-6, 2e-4);
  test::expect_gradient_matches("d gate_up B", b_gu, as_double(g_b_gu), test::sample_indices(E * 2 * I * r, 40, 23),
                                loss, 1e-6, 2e-4);
  test::expect_gradient_matches("d down A", a_d, as_double(g_a_d), test::sample_indices(E * r * I, 40, 24), loss, 1e-6,
                                2e-4);
  test::expect_gradient_matches("d down B", b_d, as_double(g_b_d), test::sample_indices(E * H * r, 40, 25), loss, 1e-6,
                                2e-4);
  for (int64_t i = 0; i < r * H; ++i) ASSERT_EQ(g_a_gu[size_t(3 * r * H + i)], 0.0f) << "expert 3 got a gradient";
  for (int64_t i = 0; i < H * r; ++i) ASSERT_EQ(g_b_d[size_t(3 * H * r + i)], 0.0f) << "expert 3 got a gradient";
}

// QLoRA: 4-bit experts (dequantized an expert at a time into the tile) compute exactly what the
// full-precision path computes on the dequantized weights, bit for bit: forward (with the
// recomputation's y-less call) and the backward pass's input and router gradients, in fp32 and in
// bf16 (where the full-precision path reads the dequantized weights' bf16 rounding, as
// bitsandbytes' dequantize_4bit to bfloat16 rounds). An expert no token chooses is not needed.
class FourBitExpertsTest : public ::testing::TestWithParam<std::tuple<std::string, bool, FourBitType>> {};

TEST_P(FourBitExpertsTest, ComputeWhatTheirDequantizedWeightsCompute) {
  const auto& [backend_name, bf, type] = GetParam();
  kernels::Backend& backend = kernels::backend_named(backend_name);
  const ExpertsShape s{9, 64, 5, 2, 32, true};
  const int64_t N = s.tokens, H = s.hidden, E = s.experts, I = s.inter, R = s.routed();
  auto x = test::to_float(test::random_vector(size_t(N * H), 1));
  auto router = test::to_float(test::random_vector(size_t(E * H), 2, -1.5, 1.5));
  for (int64_t t = 0; t < N; ++t) x[size_t(t * H)] = 1.0f;  // expert 3: chosen by no token (ExpertsTest)
  for (int64_t i = 0; i < H; ++i) router[size_t(3 * H + i)] = i == 0 ? -20.0f : 0.0f;
  const auto gate_up = test::to_float(test::random_vector(size_t(E * 2 * I * H), 3, -0.3, 0.3));
  const auto down = test::to_float(test::random_vector(size_t(E * H * I), 4, -0.3, 0.3));
  const auto residual = test::to_float(test::random_vector(size_t(N * H), 5));
  const auto dy = test::to_float(test::random_vector(size_t(N * H), 6));
  // The 4-bit experts, and their dequantized values as a full-precision model would hold them.
  auto quantize = [&](const std::vector<float>& w, std::vector<uint8_t>& packed, std::vector<float>& absmax) {
    packed.resize(w.size() / 2);
    absmax.resize(w.size() / kFourBitBlockSize);
    four_bit_quantize(type, w.data(), int64_t(w.size()), packed.data(), absmax.data());
    std::vector<float> back(w.size());
    four_bit_dequantize(type, packed.data(), absmax.data(), int64_t(w.size()), back.data());
    return back;
  };
  std::vector<uint8_t> gu_packed, down_packed;
  std::vector<float> gu_absmax, down_absmax;
  const auto gate_up_deq = quantize(gate_up, gu_packed, gu_absmax), down_deq = quantize(down, down_packed, down_absmax);
  auto to_bf16 = [](const std::vector<float>& v) {
    std::vector<bf16> out(v.size());
    convert_f32_to_bf16(v.data(), out.data(), v.size());
    return out;
  };
  const auto x_b = to_bf16(x), router_b = to_bf16(router), gate_up_b = to_bf16(gate_up_deq), down_b = to_bf16(down_deq);

  struct Run {
    std::vector<float> y, dx, probs, out;
  };
  auto run = [&](bool four_bit) {
    auto floats = [](int64_t n) { return std::vector<float>(static_cast<size_t>(n), 0.0f); };
    auto ints = [](int64_t n) { return std::vector<int32_t>(static_cast<size_t>(n)); };
    std::vector<float> probs = floats(N * E), weight = floats(R), in = floats(R * H), gu = floats(R * 2 * I),
                       act = floats(R * I), out = floats(R * H), y = floats(N * H), dx = floats(N * H);
    std::vector<bf16> in_b(size_t(R * H)), act_b(size_t(R * I));
    std::vector<int32_t> choice = ints(R), expert_rows = ints(E + 1), row_slot = ints(R), token_rows = ints(R);
    const RoutedActivations a{probs.data(),    choice.data(),          weight.data(),
                              expert_rows.data(), row_slot.data(),     token_rows.data(),
                              bf ? nullptr : in.data(), gu.data(),     act.data(),
                              out.data(),      bf ? in_b.data() : nullptr, bf ? act_b.data() : nullptr};
    ExpertsWeights w{router.data(), four_bit ? nullptr : gate_up_deq.data(), four_bit ? nullptr : down_deq.data()};
    std::vector<float> tile = floats(2 * I * H);
    std::vector<bf16> tile_b(size_t(2 * I * H));
    if (bf) {
      w.router_b = router_b.data();
      if (!four_bit) w.gate_up_b = gate_up_b.data(), w.down_b = down_b.data();
    }
    if (four_bit) {
      w.gate_up_4bit = {gu_packed.data(), gu_absmax.data(), type};
      w.down_4bit = {down_packed.data(), down_absmax.data(), type};
      (bf ? static_cast<void>(w.tile_b = tile_b.data()) : static_cast<void>(w.tile = tile.data()));
    }
    // The recomputation's call (no y) first, then the forward pass proper: the same intermediates.
    experts_forward(backend, s, x.data(), bf ? x_b.data() : nullptr, w, a, residual.data(), nullptr, nullptr, nullptr);
    experts_forward(backend, s, x.data(), bf ? x_b.data() : nullptr, w, a, residual.data(), y.data(), nullptr, nullptr);
    std::vector<float> d_rows = floats(R * H), d_act = floats(R * I), d_gu = floats(R * 2 * I),
                       d_logits = floats(N * E), d_slot = floats(R);
    std::vector<bf16> d_rows_b(size_t(R * H)), d_gu_b(size_t(R * 2 * I)), d_logits_b(size_t(N * E));
    const ExpertsScratch scratch{d_rows.data(),   d_act.data(),  d_gu.data(),    d_logits.data(),
                                 d_slot.data(),   bf ? d_rows_b.data() : nullptr, bf ? d_gu_b.data() : nullptr,
                                 bf ? d_logits_b.data() : nullptr};
    experts_backward(backend, s, x.data(), bf ? x_b.data() : nullptr, w, a, dy.data(), scratch, nullptr, nullptr,
                     ExpertsGrads{}, dx.data());
    EXPECT_EQ(expert_tokens(a, 3), 0) << "the test wants an expert no token chose";
    return Run{y, dx, probs, out};
  };
  const Run full = run(false), four = run(true);
  EXPECT_EQ(four.probs, full.probs);
  EXPECT_EQ(four.out, full.out);
  EXPECT_EQ(four.y, full.y);
  EXPECT_EQ(four.dx, full.dx);
  // And the weights are 4-bit's, not the originals: the outputs differ from the unquantized ones.
  EXPECT_NE(gate_up_deq, gate_up);
}

INSTANTIATE_TEST_SUITE_P(Backends, FourBitExpertsTest,
                         ::testing::Combine(::testing::ValuesIn(kernels::backend_names()), ::testing::Bool(),
                                            ::testing::Values(FourBitType::Nf4, FourBitType::Fp4)));

// A planned buffer's bytes, by name (a failure, and -1, when the plan has no such buffer).
int64_t buffer_bytes(const MemoryPlan& plan, const std::string& name) {
  for (const auto& b : plan.buffers())
    if (b.name == name) return int64_t(b.bytes);
  ADD_FAILURE() << "no buffer " << name;
  return int64_t(-1);
}

// A Qwen3-MoE decoder: layer 0 sparse (6 experts, top 2), layer 1 dense.
ModelConfig tiny_moe() {
  ModelConfig c;
  c.family = Family::Qwen3Moe;
  c.vocab_size = 50, c.hidden_size = 16, c.intermediate_size = 24, c.num_layers = 2;
  c.num_heads = 2, c.num_kv_heads = 1, c.head_dim = 8;
  apply_family_traits(c);
  c.moe.experts = 6;
  c.moe.experts_per_token = 2;
  c.moe.intermediate_size = 8;
  c.moe.sparse_layers = {true, false};
  validate(c, "test");
  return c;
}

TEST(ExpertsPlan, CountsEveryExpertAndHoldsAnyRouting) {
  const ModelConfig c = tiny_moe();
  const int64_t batch = 2, seq = 5;
  Decoder decoder(c, Precision::F32, batch, seq, DecoderOptions{false, true, 0});
  // The store holds the router and every expert, as transformers' model has them.
  int64_t stored = 0;
  for (const auto& p : decoder.params().params()) stored += p.numel;
  EXPECT_EQ(stored, c.total_parameters());
  const MemoryPlan plan = decoder_memory_plan(c, Precision::F32, batch, seq, DecoderOptions{false, true, 0});
  EXPECT_EQ(plan.arena_bytes(), decoder.memory_plan().arena_bytes());
  auto bytes_of = [&](const std::string& name) { return buffer_bytes(plan, name); };
  const int64_t routed = batch * seq * c.moe.experts_per_token;  // every routing routes this many rows
  EXPECT_EQ(bytes_of("layers.0.experts.input"), routed * c.hidden_size * 4);
  EXPECT_EQ(bytes_of("layers.0.experts.gate_up"), routed * 2 * c.moe.intermediate_size * 4);
  EXPECT_EQ(bytes_of("layers.0.router.probs"), batch * seq * c.moe.experts * 4);
  EXPECT_EQ(bytes_of("layers.1.gate_up"), batch * seq * 2 * c.intermediate_size * 4);  // the dense layer's
  for (const auto& b : plan.buffers()) EXPECT_NE(b.name, "layers.0.gate_up") << "a sparse layer has no dense MLP";
  // The load report: a forward_backward counts each token top_k times in layer 0's row.
  decoder.init_random(3);
  const auto tokens = static_cast<size_t>(batch * seq);
  std::vector<int32_t> ids(tokens, 7), targets(tokens, 8), positions(tokens);
  for (int64_t i = 0; i < batch * seq; ++i) positions[size_t(i)] = int32_t(i % seq);
  decoder.trainable().begin_gradient_step();
  decoder.forward_backward({batch, seq, ids.data(), targets.data(), positions.data(), nullptr}, 0.1);
  const auto load = decoder.expert_load();
  ASSERT_EQ(load.size(), size_t(c.moe.experts));
  EXPECT_EQ(std::accumulate(load.begin(), load.end(), 0.0), double(routed));
  EXPECT_GT(decoder.aux_loss(), 0.0);
}

// QLoRA on a mixture of experts: the experts (with the attention and the dense MLP) in 4 bits and
// counted so in the plan, the router in full precision, and the one tile the products dequantize
// into large enough for an expert's gate/up.
TEST(ExpertsPlan, QLoraHoldsTheExpertsInFourBitsAndTheRouterInFull) {
  ModelConfig c = tiny_moe();
  c.hidden_size = 64, c.intermediate_size = 64, c.num_heads = 4, c.num_kv_heads = 2, c.head_dim = 16;
  c.rotary_dim = 16;
  c.moe.intermediate_size = 128;  // an expert's gate/up (2 x 128 x 64) outgrows every projection's tile
  validate(c, "test");
  DecoderOptions options{true, true, 0};
  options.lora.rank = 4;
  options.four_bit_base = true;
  for (Precision precision : {Precision::F32, Precision::BF16}) {
    Decoder decoder(c, precision, 1, 8, options);
    const ParamStore& P = decoder.params();
    const LayerParamIds& l = decoder.ids().layers[0];
    EXPECT_EQ(P.param(l.experts_gate_up).storage, ParamStorage::FourBit);
    EXPECT_EQ(P.param(l.experts_down).storage, ParamStorage::FourBit);
    EXPECT_EQ(P.param(l.router).storage, precision == Precision::BF16 ? ParamStorage::Bf16 : ParamStorage::Master);
    int64_t four_bit = 0;
    for (const auto& p : P.params())
      if (p.storage == ParamStorage::FourBit) four_bit += (p.numel + kFourBitShardAlign - 1) / kFourBitShardAlign * kFourBitShardAlign;
    EXPECT_EQ(P.four_bit_total(), four_bit);
    auto bytes_of = [&](const std::string& name) { return buffer_bytes(decoder.memory_plan(), name); };
    EXPECT_EQ(bytes_of("weights.nf4 (4-bit codes)"), four_bit / 2);
    EXPECT_EQ(bytes_of("weights.nf4.absmax"), four_bit / kFourBitBlockSize * 4);
    const int64_t tile = experts_tile_elements(c);
    EXPECT_EQ(tile, 2 * 128 * 64);
    if (precision == Precision::BF16)
      EXPECT_EQ(bytes_of("4bit.dequantized_tile (bf16)"), tile * 2);
    else
      EXPECT_EQ(bytes_of("4bit.dequantized_tile"), tile * 4);
    decoder.init_random(3);
    decoder.init_adapter(4);
    std::vector<int32_t> ids(8, 7), targets(8, 8), positions(8);
    for (int i = 0; i < 8; ++i) positions[size_t(i)] = i;
    decoder.trainable().begin_gradient_step();
    const double loss = decoder.forward_backward({1, 8, ids.data(), targets.data(), positions.data(), nullptr}, 0.1);
    EXPECT_TRUE(std::isfinite(loss));
  }
}

// QLoRA's setup reads each checkpoint tensor of a 4-bit matrix whole in fp32 before quantizing it:
// in the published layout the largest is one expert's gate, up or down (or a dense projection), in
// transformers 5's fused layout a layer's gate_up of every expert, which the plan must count.
TEST(ExpertsPlan, QLoraSetupScratchIsTheCheckpointsLargestTensorInItsLayout) {
  ModelConfig c = tiny_moe();
  c.hidden_size = 64, c.intermediate_size = 64, c.num_heads = 4, c.num_kv_heads = 2, c.head_dim = 16;
  c.rotary_dim = 16;
  c.moe.intermediate_size = 128;
  validate(c, "test");
  DecoderOptions options{true, true, 0};
  options.lora.rank = 4;
  options.four_bit_base = true;
  const int64_t H = c.hidden_size, I = c.moe.intermediate_size, E = c.moe.experts;
  EXPECT_EQ(four_bit_setup_scratch_elements(c, options, true), I * H);  // an expert's gate (the projections: 64 x 64)
  EXPECT_EQ(four_bit_setup_scratch_elements(c, options, true, true), E * 2 * I * H);
  options.four_bit_base = false;
  EXPECT_EQ(four_bit_setup_scratch_elements(c, options, true, true), 0);
}

// lora_target on a mixture of experts: "experts" adapts both expert tensors of every sparse layer
// with one pair per expert in PEFT's names (gate_up_proj nested under base_layer when down_proj is
// adapted too), "all" none of them, a path one layer's; the published per-expert names, the router
// and dropout are refused saying why; the plan holds the routed rows' u per module and one du.
TEST(ExpertsLora, TargetsNamesAndRefusals) {
  const ModelConfig c = tiny_moe();
  DecoderParamIds ids;
  ParamStore store;
  declare_params(c, store, ids, {});
  LoraSpec spec;
  spec.rank = 2;
  spec.targets = {"q_proj", "experts"};
  auto modules = lora_modules(c, ids, spec);
  std::vector<std::string> paths;
  for (const auto& m : modules) paths.push_back(m.path);
  EXPECT_EQ(paths, (std::vector<std::string>{"model.layers.0.self_attn.q_proj", "model.layers.0.mlp.experts.gate_up_proj",
                                             "model.layers.0.mlp.experts.down_proj", "model.layers.1.self_attn.q_proj"}));
  const LoraModule& gu = modules[1];
  EXPECT_EQ(gu.experts, 6);
  EXPECT_EQ(gu.rows, 2 * c.moe.intermediate_size);
  EXPECT_EQ(gu.cols, c.hidden_size);
  EXPECT_EQ(peft_tensor_name(gu, true), "base_model.model.model.layers.0.mlp.experts.base_layer.lora_A.weight");
  EXPECT_EQ(peft_tensor_name(modules[2], false), "base_model.model.model.layers.0.mlp.experts.lora_B.weight");
  ParamStore adapter;
  declare_lora_params(modules, 2, adapter);
  EXPECT_EQ(adapter.param(gu.a).shape, (std::vector<int64_t>{6 * 2, c.hidden_size}));  // PEFT's lora_A
  EXPECT_EQ(adapter.param(gu.b).shape, (std::vector<int64_t>{6 * 2 * c.moe.intermediate_size, 2}));
  spec.targets = {"experts.down_proj"};  // alone: not nested
  modules = lora_modules(c, ids, spec);
  ASSERT_EQ(modules.size(), 1u);
  EXPECT_EQ(peft_tensor_name(modules[0], true), "base_model.model.model.layers.0.mlp.experts.lora_A.weight");
  spec.targets = {"all"};
  for (const auto& m : lora_modules(c, ids, spec)) EXPECT_FALSE(m.on_experts()) << m.path;
  auto error_of = [&](std::vector<std::string> targets, double dropout = 0) {
    spec.targets = std::move(targets);
    spec.dropout = dropout;
    try {
      lora_modules(c, ids, spec);
    } catch (const keel::Error& e) {
      return std::string(e.what());
    }
    return std::string("no error");
  };
  // Every layer sparse: the published per-expert name matches no module (on tiny_moe's dense layer
  // 1 it names that layer's MLP, as before).
  ModelConfig sparse = c;
  sparse.moe.sparse_layers = {true, true};
  validate(sparse, "test");
  DecoderParamIds sparse_ids;
  ParamStore sparse_store;
  declare_params(sparse, sparse_store, sparse_ids, {});
  spec.targets = {"down_proj"};
  try {
    lora_modules(sparse, sparse_ids, spec);
    ADD_FAILURE() << "down_proj matched on a model without dense layers";
  } catch (const keel::Error& e) {
    EXPECT_NE(std::string(e.what()).find("write \"experts\""), std::string::npos) << e.what();
  }
  EXPECT_NE(error_of({"gate"}).find("router"), std::string::npos) << error_of({"gate"});
  EXPECT_NE(error_of({"experts.gate_proj"}).find("experts.gate_up_proj, experts.down_proj"), std::string::npos);
  EXPECT_NE(error_of({"experts"}, 0.1).find("lora_dropout"), std::string::npos);
  EXPECT_EQ(error_of({"experts"}, 0.0), "no error");
}

// PEFT's lora_B [out, r x experts] holds expert e's column j at j x experts + e; keel's [experts x
// out, r] expert by expert, and the two conversions are each other's inverse.
TEST(ExpertsLora, PeftLayoutOfBIsInterleavedByExpert) {
  LoraModule m;
  m.experts = 3, m.rows = 2;
  const int64_t r = 2;
  std::vector<float> keel(12), peft(12), back(12);
  for (int64_t e = 0; e < 3; ++e)
    for (int64_t o = 0; o < 2; ++o)
      for (int64_t j = 0; j < r; ++j) keel[size_t((e * 2 + o) * r + j)] = float(100 * e + 10 * o + j);
  expert_b_to_peft(m, r, keel.data(), peft.data());
  // PEFT: B.reshape(out, r, experts)[o, j, e]
  for (int64_t e = 0; e < 3; ++e)
    for (int64_t o = 0; o < 2; ++o)
      for (int64_t j = 0; j < r; ++j) EXPECT_EQ(peft[size_t(o * r * 3 + j * 3 + e)], float(100 * e + 10 * o + j));
  expert_b_from_peft(m, r, peft.data(), back.data());
  EXPECT_EQ(back, keel);
}

// An adapter_config.json with target_parameters (PEFT's, for the experts): parsed into expert
// targets; the router's weight refused.
TEST(ExpertsLora, PeftConfigTargetParameters) {
  const auto c = parse_peft_adapter_config(
      R"({"peft_type": "LORA", "r": 4, "lora_alpha": 8, "target_modules": ["q_proj"],
          "target_parameters": ["down_proj", "mlp.experts.gate_up_proj"]})",
      "cfg.json");
  EXPECT_EQ(c.spec.targets, (std::vector<std::string>{"q_proj", "experts.down_proj", "mlp.experts.gate_up_proj"}));
  const auto only = parse_peft_adapter_config(
      R"({"peft_type": "LORA", "r": 4, "target_modules": null, "target_parameters": ["gate_up_proj"]})", "cfg.json");
  EXPECT_EQ(only.spec.targets, (std::vector<std::string>{"experts.gate_up_proj"}));
  try {
    parse_peft_adapter_config(R"({"peft_type": "LORA", "r": 4, "target_parameters": ["mlp.gate.weight"]})", "cfg.json");
    ADD_FAILURE() << "the router's weight was accepted";
  } catch (const keel::Error& e) {
    EXPECT_NE(std::string(e.what()).find("cfg.json: key 'target_parameters'"), std::string::npos) << e.what();
  }
}

// The plan holds LoRA on the experts exactly: each adapted module's u over the routed rows (tokens x
// top_k, however they fall), fp32 in bf16 too, and one du; and a step trains every expert's pair.
TEST(ExpertsLora, PlannedAndTrained) {
  const ModelConfig c = tiny_moe();
  const int64_t batch = 2, seq = 5, r = 4;
  DecoderOptions options{true, true, 0};
  options.lora.rank = r;
  options.lora.targets = {"experts"};
  for (Precision precision : {Precision::F32, Precision::BF16}) {
    Decoder decoder(c, precision, batch, seq, options);
    const MemoryPlan plan = decoder_memory_plan(c, precision, batch, seq, options);
    EXPECT_EQ(plan.arena_bytes(), decoder.memory_plan().arena_bytes());
    auto bytes_of = [&](const std::string& name) { return buffer_bytes(plan, name); };
    const int64_t routed = batch * seq * c.moe.experts_per_token;
    // With gradient checkpointing the recomputation's copy is what the backward pass reads.
    EXPECT_EQ(bytes_of("layers.0.recomputed.experts.lora.u"), 2 * routed * r * 4);
    EXPECT_EQ(bytes_of("grad.experts.lora"), routed * r * 4);
    decoder.init_random(3);
    decoder.init_adapter(4);
    ParamStore& adapter = decoder.adapter();
    for (const auto& m : decoder.lora_modules())  // B nonzero, so that A gets a gradient too
      for (int64_t i = 0; i < adapter.param(m.b).numel; ++i) adapter.weight(m.b)[i] = 0.01f * float(i % 7 - 3);
    adapter.refresh_bf16_copy();
    std::vector<int32_t> ids(10), targets(10), positions(10);
    for (int i = 0; i < 10; ++i) ids[size_t(i)] = i * 3 % 50, targets[size_t(i)] = (i * 7 + 1) % 50, positions[size_t(i)] = i % 5;
    decoder.trainable().begin_gradient_step();
    decoder.forward_backward({batch, seq, ids.data(), targets.data(), positions.data(), nullptr}, 0.1);
    for (const auto& m : decoder.lora_modules()) {
      double a = 0, b = 0;
      for (int64_t i = 0; i < adapter.param(m.a).numel; ++i) a += std::abs(adapter.grad(m.a)[i]);
      for (int64_t i = 0; i < adapter.param(m.b).numel; ++i) b += std::abs(adapter.grad(m.b)[i]);
      EXPECT_GT(a, 0) << m.path;
      EXPECT_GT(b, 0) << m.path;
    }
  }
}

// The experts in bf16 where the CPU backend cuts their products over the threads, run as tasks of
// (expert, part) on whichever thread is free (experts.cpp: for_each_expert_task), against the same
// forward and backward pass on one thread, where each product runs whole. The two differ where a
// product's sums over K are blocked differently: ~1e-7 of a value in fp32, which flips the bf16
// rounding of some intermediates (act, the rows' gradients), ~1e-4 of the largest value after them
// (5e-5 seen). A part written to another part's rows or columns, read from another expert's weight
// or not run at all is off by the values themselves (each of the three fails it). The shape cuts
// every kind of product in two but one (d act, [rows, 256] outputs: too narrow, run whole by the
// task that holds part 0, on whichever thread).
TEST(ExpertsTasks, Bf16PartsRunAsTasksMatchWholeProductsOnOneThread) {
  kernels::Backend& backend = kernels::backend_named("cpu");
  const ExpertsShape s{48, 512, 6, 2, 256, true};
  const int64_t N = s.tokens, H = s.hidden, E = s.experts, I = s.inter, R = s.routed();
  const int threads = 2;
  bool cut = false;
  test::with_threads(threads, [&] {
    const kernels::GemmShape gate_up = kernels::packed_gemm(kernels::Trans::N, kernels::Trans::T, 1, 2 * I, H);
    cut = backend.bf16_product_shares(gate_up).parts > 1;
  });
  if (!cut) GTEST_SKIP() << "no native bf16 matmul (or KEEL_GEMM_SPLIT=0): the experts' products are not cut";

  auto bf16_of = [](const std::vector<float>& v) {
    std::vector<bf16> b(v.size());
    convert_f32_to_bf16(v.data(), b.data(), v.size());
    return b;
  };
  const std::vector<float> x = test::to_float(test::random_vector(size_t(N * H), 31)),
                           router = test::to_float(test::random_vector(size_t(E * H), 32, -0.2, 0.2)),
                           gate_up = test::to_float(test::random_vector(size_t(E * 2 * I * H), 33, -0.1, 0.1)),
                           down = test::to_float(test::random_vector(size_t(E * H * I), 34, -0.1, 0.1)),
                           residual = test::to_float(test::random_vector(size_t(N * H), 35)),
                           dy = test::to_float(test::random_vector(size_t(N * H), 36));
  const std::vector<bf16> x_b = bf16_of(x), router_b = bf16_of(router), gate_up_b = bf16_of(gate_up),
                          down_b = bf16_of(down);
  struct Outputs {
    std::vector<float> y, dx, g_router, g_gate_up, g_down;
  };
  auto run = [&] {
    auto floats = [](int64_t n) { return std::vector<float>(static_cast<size_t>(n), 7.0f); };
    auto ints = [](int64_t n) { return std::vector<int32_t>(static_cast<size_t>(n)); };
    auto halves = [](int64_t n) { return std::vector<bf16>(static_cast<size_t>(n)); };
    std::vector<float> probs = floats(N * E), weight = floats(R), gu = floats(R * 2 * I), act = floats(R * I),
                       out = floats(R * H);
    std::vector<bf16> in_b = halves(R * H), act_b = halves(R * I);
    std::vector<int32_t> choice = ints(R), expert_rows = ints(E + 1), row_slot = ints(R), token_rows = ints(R);
    RoutedActivations a{probs.data(),      choice.data(), weight.data(), expert_rows.data(), row_slot.data(),
                        token_rows.data(), nullptr,       gu.data(),     act.data(),         out.data()};
    a.in_b = in_b.data();
    a.act_b = act_b.data();
    ExpertsWeights w{router.data(), gate_up.data(), down.data()};
    w.router_b = router_b.data();
    w.gate_up_b = gate_up_b.data();
    w.down_b = down_b.data();
    Outputs o{floats(N * H), floats(N * H), floats(E * H), floats(E * 2 * I * H), floats(E * H * I)};
    experts_forward(backend, s, x.data(), x_b.data(), w, a, residual.data(), o.y.data(), nullptr, nullptr);
    std::vector<float> d_rows = floats(R * H), d_act = floats(R * I), d_gu = floats(R * 2 * I),
                       d_logits = floats(N * E), d_slot = floats(R);
    std::vector<bf16> rows_b = halves(R * H), gu_b = halves(R * 2 * I), logits_b = halves(N * E);
    ExpertsScratch scratch{d_rows.data(), d_act.data(), d_gu.data(), d_logits.data(), d_slot.data()};
    scratch.rows_b = rows_b.data();
    scratch.gate_up_b = gu_b.data();
    scratch.logits_b = logits_b.data();
    const ExpertsGrads g{o.g_router.data(), o.g_gate_up.data(), o.g_down.data(), 0.0f, 0.0f, 0.0f};
    experts_backward(backend, s, x.data(), x_b.data(), w, a, dy.data(), scratch, nullptr, nullptr, g, o.dx.data());
    return o;
  };
  Outputs tasks, whole;
  test::with_threads(threads, [&] { tasks = run(); });
  test::with_threads(1, [&] { whole = run(); });
  auto expect_close = [](const char* what, const std::vector<float>& got, const std::vector<float>& want) {
    float scale = 0;
    for (float v : want) scale = std::max(scale, std::fabs(v));
    int64_t off = 0;
    for (size_t i = 0; i < want.size(); ++i)
      if (std::fabs(got[i] - want[i]) > 1e-3f * scale && off++ < 5)
        ADD_FAILURE() << what << "[" << i << "]: " << got[i] << " as tasks, " << want[i] << " on one thread";
    EXPECT_EQ(off, 0) << what << ": " << off << " of " << want.size() << " differ (largest value " << scale << ")";
  };
  expect_close("y", tasks.y, whole.y);
  expect_close("dx", tasks.dx, whole.dx);
  expect_close("d router", tasks.g_router, whole.g_router);
  expect_close("d gate_up", tasks.g_gate_up, whole.g_gate_up);
  expect_close("d down", tasks.g_down, whole.g_down);
}

INSTANTIATE_TEST_SUITE_P(Backends, ExpertsTest,
                         ::testing::Combine(::testing::ValuesIn(kernels::backend_names()), ::testing::Bool(),
                                            ::testing::Bool()));

}  // namespace
}  // namespace keel::model
