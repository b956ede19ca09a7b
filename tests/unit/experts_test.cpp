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
#include "keel/kernels/backend.h"
#include "keel/model/decoder.h"
#include "keel/model/experts.h"

namespace keel::model {
namespace {

struct Case {
  ExpertsShape s;
  std::vector<double> x, router, gate_up, down, residual, probe, mask;
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
    const double most = *std::max_element(p.begin(), p.end());
    double sum = 0;
    for (double& v : p) sum += v = std::exp(v - most);
    for (double& v : p) v /= sum;
    std::vector<int64_t> order(static_cast<size_t>(E));
    std::iota(order.begin(), order.end(), 0);
    std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return p[size_t(a)] > p[size_t(b)]; });
    double chosen_sum = 0;
    for (int64_t j = 0; j < k; ++j) chosen_sum += p[size_t(order[size_t(j)])];
    for (int64_t j = 0; j < k; ++j) {
      const int64_t e = order[size_t(j)];
      const double w = s.norm_topk_prob ? p[size_t(e)] / chosen_sum : p[size_t(e)];
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

class ExpertsTest : public ::testing::TestWithParam<std::tuple<std::string, bool>> {};

TEST_P(ExpertsTest, GroupedProductsMatchANaiveLoopAndItsGradients) {
  const auto& [backend_name, norm] = GetParam();
  kernels::Backend& backend = kernels::backend_named(backend_name);
  Case c;
  c.s = {7, 8, 5, 2, 6, norm};
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
  const double aux_weight = 0.7;

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
  const ExpertsWeights w{router.data(), gate_up.data(), down.data()};
  experts_forward(backend, s, x.data(), nullptr, w, a, residual.data(), y.data(), mask.data(), &balance);
  balance.rows = std::accumulate(c.mask.begin(), c.mask.end(), 0.0);
  const double aux = balance.finish(E, aux_weight);

  const Naive ref = naive(c);
  for (int64_t i = 0; i < N * H; ++i) EXPECT_NEAR(y[size_t(i)], ref.y[size_t(i)], 1e-5) << i;
  EXPECT_NEAR(aux, ref.aux, 1e-6);
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
  experts_backward(backend, s, x.data(), nullptr, w, a, dy.data(), scratch, &balance, mask.data(), g, dx.data());

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
  auto bytes_of = [&](const std::string& name) {
    for (const auto& b : plan.buffers())
      if (b.name == name) return int64_t(b.bytes);
    ADD_FAILURE() << "no buffer " << name;
    return int64_t(-1);
  };
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

INSTANTIATE_TEST_SUITE_P(Backends, ExpertsTest,
                         ::testing::Combine(::testing::ValuesIn(kernels::backend_names()), ::testing::Bool()));

}  // namespace
}  // namespace keel::model
