// A new model drawn at random (a config-only model directory, [model_config]) starts as
// transformers' _init_weights starts it: matrices normal(0, the config's initializer_range), biases
// 0, and every norm scaling by 1 — a weight of 1, or of 0 where the norm scales by (1 + w), Gemma's.
// A Gemma norm drawn as 1 would double every normalised activation of the new model.
#include <gtest/gtest.h>

#include <cmath>

#include "decoder_test_support.h"
#include "keel/model/decoder.h"

namespace keel::model {
namespace {

struct Drawn {
  double matrix_std = 0;
  int64_t matrix_values = 0;
  double norm_min = 1e30, norm_max = -1e30;
};

Drawn drawn_weights(const ModelConfig& config) {
  Decoder decoder(config, Precision::F32, 1, 8, test::on_backend("cpu"));
  decoder.init_random(3);
  Drawn d;
  double sum_sq = 0;
  for (const auto& p : decoder.params().params()) {
    const float* w = decoder.params().weight(int(&p - decoder.params().params().data()));
    const bool is_norm = p.name.find("norm") != std::string::npos;
    for (int64_t k = 0; k < p.numel; ++k) {
      if (is_norm) {
        d.norm_min = std::min(d.norm_min, double(w[k]));
        d.norm_max = std::max(d.norm_max, double(w[k]));
      } else if (p.name.find(".bias") == std::string::npos && w[k] != 0.0f) {  // the pad row is 0
        sum_sq += double(w[k]) * w[k];
        ++d.matrix_values;
      }
    }
  }
  d.matrix_std = std::sqrt(sum_sq / double(d.matrix_values));
  return d;
}

TEST(RandomInit, MatricesDrawnWithTheConfigsInitializerRange) {
  for (double range : {0.02, 0.006}) {
    auto config = test::tiny_config("llama");
    config.initializer_range = range;
    const Drawn d = drawn_weights(config);
    ASSERT_GT(d.matrix_values, 10000);
    // The sample's standard deviation is within a few percent of the drawn one at ~30k values.
    EXPECT_NEAR(d.matrix_std, range, 0.03 * range) << "initializer_range " << range;
    EXPECT_EQ(d.norm_min, 1.0);
    EXPECT_EQ(d.norm_max, 1.0);
  }
}

TEST(RandomInit, GemmaNormsScaleByOneAsOnePlusZero) {
  for (const char* family : {"gemma2", "gemma3"}) {
    const auto config = test::tiny_config(family);
    ASSERT_EQ(config.norm_weight_offset, 1.0) << family;
    const Drawn d = drawn_weights(config);
    EXPECT_EQ(d.norm_min, 0.0) << family;
    EXPECT_EQ(d.norm_max, 0.0) << family;
  }
}

}  // namespace
}  // namespace keel::model
