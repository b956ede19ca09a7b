// The run banner's lines about a mixture of experts: how its layers route, what QLoRA stores in 4
// bits among the experts, and which expert tensors LoRA adapts. Said once at start-up, so that
// every decision keel takes for the user is printed.
#include "keel/train/experts_banner.h"

#include <fmt/format.h>
#include <fmt/ostream.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <vector>

#include "keel/model/experts.h"

namespace keel::train {

// A mixture of experts: which layers are sparse and how they route, and whether the
// load-balancing loss joins the loss (it is reported as aux_loss either way).
void print_experts_routing(std::ostream& log, const model::Decoder& decoder) {
  const model::ModelConfig& config = decoder.config();
  const auto& m = config.moe;
  if (!config.has_experts()) return;
  int64_t sparse = 0;
  for (int64_t l = 0; l < config.num_layers; ++l) sparse += config.sparse_layer(l);
  fmt::print(log, "keel: {} of {} layers route each token to {} of {} experts{}; ", sparse, config.num_layers,
             m.experts_per_token, m.experts, m.norm_topk_prob ? " (weights renormalised)" : "");
  if (m.sigmoid_router) {  // GLM-4.5
    fmt::print(log,
               "sigmoid scores, chosen with e_score_correction_bias (kept as loaded, never trained) among the best "
               "{} of {} expert groups, weights x {}{}; {} multi-token-prediction layer(s) not run, as "
               "transformers does not run them; no load-balancing loss: Glm4MoeForCausalLM adds none{}\n",
               m.topk_groups, m.groups, m.routed_scaling_factor,
               m.shared_intermediate_size > 0
                   ? fmt::format(", plus shared experts of width {}", m.shared_intermediate_size)
                   : std::string(),
               config.nextn_predict_layers,
               m.output_router_logits ? " (output_router_logits in config.json asks for one: ignored, as transformers "
                                        "ignores it)"
                                      : "");
    return;
  }
  if (config.aux_loss_weight() > 0)
    fmt::print(log,
               "the load-balancing loss is added x {} per micro-batch (output_router_logits, as transformers' "
               "Trainer adds it), and reported as aux_loss\n",
               m.router_aux_loss_coef);
  else
    fmt::print(log,
               "the load-balancing loss is reported as aux_loss, not added (output_router_logits is false in "
               "config.json)\n");
}

// QLoRA on a mixture of experts: what is 4-bit among the experts, and what is not.
void print_experts_four_bit(std::ostream& log, const model::Decoder& decoder, const std::string& type) {
  const model::ModelConfig& config = decoder.config();
  if (!config.has_experts()) return;
  const model::ParamStore& frozen = decoder.params();
  int64_t weights = 0;
  for (const auto& l : decoder.ids().layers)
    for (int id : {l.experts_gate_up, l.experts_down})
      if (id >= 0 && frozen.param(id).storage == model::ParamStorage::FourBit) weights += frozen.param(id).numel;
  const bool bf = decoder.precision() == model::Precision::BF16;
  const int64_t tile = model::experts_tile_elements(config);
  fmt::print(log,
             "keel: QLoRA: experts stored {} ({:.1f}M weights, {:.3f} GiB with their absmax values), frozen; each "
             "expert dequantized whole ({:.2f} MiB in {}) into the projections' 4-bit tile right before its grouped products (forward, "
             "recomputation, backward to the input), an expert no token chose not at all; the router stays in {}\n",
             type, double(weights) / 1e6, double(weights) * (0.5 + 4.0 / 64) / double(1 << 30),
             double(tile) * (bf ? 2 : 4) / double(1 << 20), bf ? "bf16" : "fp32", bf ? "bf16" : "fp32");
}

// LoRA and a mixture of experts: whether the experts are adapted (PEFT's target_parameters), and
// that the router never is.
void print_experts_lora(std::ostream& log, const model::Decoder& decoder) {
  const model::ModelConfig& config = decoder.config();
  if (!config.has_experts()) return;
  std::vector<std::string> params;
  int64_t layers = 0, pairs = 0;
  for (int64_t l = 0; l < config.num_layers; ++l) {
    bool any = false;
    for (const auto& m : decoder.lora_modules())
      if (m.layer == l && m.on_experts()) {
        any = true;
        pairs += m.experts;
        if (std::find(params.begin(), params.end(), m.name) == params.end()) params.push_back(m.name);
      }
    layers += any;
  }
  if (params.empty()) {
    fmt::print(log,
               "keel: LoRA: the experts are not adapted (lora_target names none of them; add \"experts\", "
               "\"experts.gate_up_proj\" or \"experts.down_proj\" to adapt them); the router never is\n");
    return;
  }
  fmt::print(log,
             "keel: LoRA on the experts: mlp.experts.{} of {} sparse layers, one A/B pair per expert ({} pairs; "
             "PEFT's target_parameters, saved as its lora.ParamWrapper's lora_A [experts x r, in] and lora_B [out, r "
             "x experts]); no dropout on them; the router is not adapted\n",
             fmt::join(params, ", mlp.experts."), layers, pairs);
}

}  // namespace keel::train
