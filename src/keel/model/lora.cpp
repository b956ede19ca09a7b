#include "keel/model/lora.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <map>
#include <random>
#include <set>

#include "keel/core/error.h"
#include "keel/model/hf_weights.h"

namespace keel::model {

double LoraSpec::scaling() const { return rslora ? alpha / std::sqrt(double(rank)) : alpha / double(rank); }

namespace {

struct Owner {
  int64_t layer;
  LinearSlot slot;
};

int slot_weight(const LayerParamIds& p, LinearSlot slot) {
  switch (slot) {
    case LinearSlot::Qkv: return p.qkv_weight;
    case LinearSlot::O: return p.o_weight;
    case LinearSlot::GateUp: return p.gate_up_weight;
    case LinearSlot::Down: return p.down_weight;
    case LinearSlot::ExpertsGateUp: return p.experts_gate_up;
    case LinearSlot::ExpertsDown: return p.experts_down;
  }
  return -1;
}

// The block's linear layers proper (a module of hf_tensors' names per block of rows); the experts'
// slots are parameters, found by expert_parameters.
constexpr LinearSlot kModuleSlots[] = {LinearSlot::Qkv, LinearSlot::O, LinearSlot::GateUp, LinearSlot::Down};

// Internal parameter index -> the block and linear layer it is the weight of.
std::map<int, Owner> linear_owners(const DecoderParamIds& ids) {
  std::map<int, Owner> owners;
  for (size_t l = 0; l < ids.layers.size(); ++l)
    for (LinearSlot s : kModuleSlots) owners[slot_weight(ids.layers[l], s)] = {int64_t(l), s};
  return owners;
}

// Every linear module of the blocks, whatever the targets.
std::vector<LoraModule> block_linears(const ModelConfig& config, const DecoderParamIds& ids) {
  const auto owners = linear_owners(ids);
  std::vector<LoraModule> out;
  const std::string suffix = ".weight";
  for (const auto& t : hf_tensors(config, ids)) {
    auto it = owners.find(t.param);
    if (it == owners.end() || t.cols == 0) continue;  // embedding, norms, biases, LM head
    LoraModule m;
    m.path = t.name.substr(0, t.name.size() - suffix.size());
    m.name = m.path.substr(m.path.rfind('.') + 1);
    m.layer = it->second.layer;
    m.slot = it->second.slot;
    m.row_begin = t.row_begin;
    m.rows = t.rows;
    m.cols = t.cols;
    out.push_back(std::move(m));
  }
  return out;
}

// Every sparse layer's two expert parameters, by transformers 5's in-memory names (the fused
// layout's: model.layers.N.mlp.experts.gate_up_proj [E, 2I, H] and .down_proj [E, H, I]).
std::vector<LoraModule> expert_parameters(const ModelConfig& config, const DecoderParamIds& ids) {
  std::vector<LoraModule> out;
  if (!config.has_experts()) return out;
  for (const auto& t : hf_tensors(config, ids, ExpertLayout::Fused)) {
    for (int64_t l = 0; l < config.num_layers; ++l) {
      if (!config.sparse_layer(l)) continue;
      const LayerParamIds& p = ids.layers[size_t(l)];
      if (t.param != p.experts_gate_up && t.param != p.experts_down) continue;
      LoraModule m;
      m.path = t.name;
      m.name = m.path.substr(m.path.rfind('.') + 1);
      m.layer = l;
      m.slot = t.param == p.experts_gate_up ? LinearSlot::ExpertsGateUp : LinearSlot::ExpertsDown;
      m.experts = config.moe.experts;
      m.rows = t.rows / m.experts;
      m.cols = t.cols;
      out.push_back(std::move(m));
    }
  }
  return out;
}

bool matches(const std::string& path, const std::string& target) {
  if (target == path) return true;
  return path.size() > target.size() && path.compare(path.size() - target.size(), target.size(), target) == 0 &&
         path[path.size() - target.size() - 1] == '.';
}

}  // namespace

bool expert_target(const std::string& target) {
  return target == "experts" || target.starts_with("experts.") || target.ends_with(".experts") ||
         target.find(".experts.") != std::string::npos;
}

int module_weight(const DecoderParamIds& ids, const LoraModule& m) {
  return slot_weight(ids.layers[size_t(m.layer)], m.slot);
}

std::vector<std::string> block_linear_names(const ModelConfig& config, const DecoderParamIds& ids) {
  std::vector<std::string> names;
  for (const auto& m : block_linears(config, ids))
    if (std::find(names.begin(), names.end(), m.name) == names.end()) names.push_back(m.name);
  return names;
}

namespace {

// What a lora_target entry that matches nothing meant, where keel can tell: the published
// checkpoints' per-expert modules or the router, which transformers 5 no longer holds as modules.
std::string unmatched_hint(const ModelConfig& config, const std::string& target) {
  if (!config.has_experts()) return "";
  const std::string last = target.substr(target.rfind('.') + 1);
  if (last == "gate" || last == "router")
    return "; the router (mlp.gate) is never adapted by keel's LoRA (PEFT 0.21's all-linear on transformers 5 adds it; "
           "keel's \"all\" does not)";
  // The family's own per-expert names (Mixtral's w1/w3/w2, the others' gate/up/down_proj).
  static const std::vector<std::string> mixtral_names{"w1", "w2", "w3"}, names{"gate_proj", "up_proj", "down_proj"};
  for (const std::string& per_expert : config.family == Family::Mixtral ? mixtral_names : names)
    if (last == per_expert)
      return fmt::format(
          "; '{}' is a per-expert module of the published checkpoints (experts.N.{}), which transformers 5 holds "
          "fused in one parameter: PEFT 0.21 rewrites such targets to target_parameters, gate_up_proj at twice the "
          "rank, and keel adapts the fused parameters directly: write \"experts\" (both), \"experts.gate_up_proj\" "
          "or \"experts.down_proj\"",
          target, per_expert);
  return "; the experts' parameters are targeted as \"experts\", \"experts.gate_up_proj\" or \"experts.down_proj\"";
}

}  // namespace

std::vector<LoraModule> lora_modules(const ModelConfig& config, const DecoderParamIds& ids, const LoraSpec& spec) {
  require(spec.rank > 0, "LoRA: rank must be positive, got {}", spec.rank);
  require(!spec.targets.empty(), "LoRA: lora_target names no module");
  const bool all = std::find(spec.targets.begin(), spec.targets.end(), "all") != spec.targets.end();
  std::vector<LoraModule> out;
  std::set<std::string> matched;
  for (auto& m : block_linears(config, ids)) {
    bool take = all;
    for (const auto& t : spec.targets)
      if (t != "all" && !expert_target(t) && matches(m.path, t)) take = true, matched.insert(t);
    if (take) out.push_back(std::move(m));
  }
  // The experts' parameters: named by an expert target, never by "all" (PEFT's all-linear on
  // transformers 5's module tree reaches no parameter either).
  for (auto& m : expert_parameters(config, ids)) {
    const std::string module = m.path.substr(0, m.path.rfind('.'));  // model.layers.N.mlp.experts
    bool take = false;
    for (const auto& t : spec.targets)
      if (expert_target(t) && (matches(module, t) || matches(m.path, t))) take = true, matched.insert(t);
    if (take) out.push_back(std::move(m));
  }
  // Layer by layer (each block's linear modules, then its experts' gate_up and down), as
  // transformers names them.
  std::stable_sort(out.begin(), out.end(), [](const LoraModule& a, const LoraModule& b) { return a.layer < b.layer; });
  std::vector<int64_t> per_layer(size_t(config.num_layers), 0), experts_per_layer(size_t(config.num_layers), 0);
  for (auto& m : out) m.index_in_layer = (m.on_experts() ? experts_per_layer : per_layer)[size_t(m.layer)]++;
  for (auto& m : out) {
    if (!m.on_experts()) continue;
    const std::string module = m.path.substr(0, m.path.rfind('.'));
    // PEFT wraps gate_up_proj first (the module's first parameter), so with down_proj adapted too
    // gate_up_proj's pair sits one level in.
    const bool nested = m.slot == LinearSlot::ExpertsGateUp && experts_per_layer[size_t(m.layer)] == 2;
    m.peft_path = nested ? module + ".base_layer" : module;
  }
  for (const auto& t : spec.targets) {
    if (t == "all" || matched.count(t)) continue;
    if (expert_target(t)) {
      std::vector<std::string> names;
      for (const auto& m : expert_parameters(config, ids))
        if (std::find(names.begin(), names.end(), "experts." + m.name) == names.end()) names.push_back("experts." + m.name);
      fail("lora_target '{}' names experts' parameters but matches none of {}'s{}", t, config.architecture,
           names.empty() ? std::string(" (it has no mixture-of-experts layers)")
                         : fmt::format(": {} (or \"experts\" for both)", fmt::join(names, ", ")));
    }
    fail("lora_target '{}' matches no linear layer of {}; its modules are: {} (or \"all\"){}", t, config.architecture,
         fmt::join(block_linear_names(config, ids), ", "), unmatched_hint(config, t));
  }
  const bool on_experts = std::any_of(out.begin(), out.end(), [](const LoraModule& m) { return m.on_experts(); });
  require(!on_experts || spec.dropout == 0,
          "lora_dropout = {} with the experts in lora_target: PEFT's LoRA on a parameter (lora.ParamWrapper, how it "
          "adapts the experts) has no dropout and refuses lora_dropout != 0, since the update is folded into the "
          "weight; set lora_dropout = 0 or leave the experts out of lora_target",
          spec.dropout);
  return out;
}

void declare_lora_params(std::vector<LoraModule>& modules, int64_t rank, ParamStore& adapter) {
  for (auto& m : modules) {
    const int64_t experts = std::max<int64_t>(m.experts, 1);
    m.a = adapter.add(m.path + ".lora_A", {experts * rank, m.cols}, true);
    m.b = adapter.add(m.path + ".lora_B", {experts * m.rows, rank}, true);
  }
}

void init_lora(const std::vector<LoraModule>& modules, ParamStore& adapter, uint64_t seed) {
  std::mt19937_64 rng(seed);
  for (const auto& m : modules) {
    // torch.nn.init.kaiming_uniform_(A, a=sqrt(5)): gain sqrt(2 / (1 + 5)), bound gain * sqrt(3 / fan_in).
    const float bound = float(1.0 / std::sqrt(double(m.cols)));
    std::uniform_real_distribution<float> uniform(-bound, bound);
    float* a = adapter.weight(m.a);
    for (int64_t i = 0, n = adapter.param(m.a).numel; i < n; ++i) a[i] = uniform(rng);
    std::fill_n(adapter.weight(m.b), adapter.param(m.b).numel, 0.0f);
  }
  adapter.refresh_bf16_copy();
}

SavedModules resolve_modules_to_save(const ModelConfig& config, const DecoderParamIds& ids, const LoraSpec& spec) {
  SavedModules saved;
  if (spec.modules_to_save.empty()) return saved;
  std::string embedding, head;  // the tensors' names
  for (const auto& t : hf_tensors(config, ids)) {
    if (t.param == ids.embed && embedding.empty()) embedding = t.name;
    if (t.param == ids.lm_head && !config.tie_word_embeddings) head = t.name;
  }
  auto module = [](const std::string& tensor) { return tensor.substr(0, tensor.size() - std::string(".weight").size()); };
  auto last = [](const std::string& path) { return path.substr(path.rfind('.') + 1); };
  const std::string choices = head.empty() ? last(module(embedding)) : last(module(embedding)) + ", " + last(module(head));
  for (const auto& name : spec.modules_to_save) {
    if (matches(module(embedding), name)) {
      require(!config.tie_word_embeddings,
              "additional_target '{}': {} ties its embedding to its LM head (one tensor in two roles); training it "
              "beside LoRA is not supported",
              name, config.architecture);
      if (saved.embedding.empty()) saved.embedding = embedding, saved.names.push_back(last(module(embedding)));
    } else if (!head.empty() && matches(module(head), name)) {
      if (saved.lm_head.empty()) saved.lm_head = head, saved.names.push_back(last(module(head)));
    } else {
      fail("additional_target '{}' is neither the embedding nor the LM head of {} ({}); only those train beside the "
           "adapters",
           name, config.architecture, choices);
    }
  }
  return saved;
}

std::string peft_tensor_name(const LoraModule& m, bool a) {
  return fmt::format("base_model.model.{}.lora_{}.weight", m.on_experts() ? m.peft_path : m.path, a ? "A" : "B");
}

void expert_b_from_peft(const LoraModule& m, int64_t rank, const float* peft, float* keel) {
  const int64_t E = m.experts;
  for (int64_t e = 0; e < E; ++e)
    for (int64_t o = 0; o < m.rows; ++o)
      for (int64_t j = 0; j < rank; ++j) keel[(e * m.rows + o) * rank + j] = peft[o * rank * E + j * E + e];
}

void expert_b_to_peft(const LoraModule& m, int64_t rank, const float* keel, float* peft) {
  const int64_t E = m.experts;
  for (int64_t e = 0; e < E; ++e)
    for (int64_t o = 0; o < m.rows; ++o)
      for (int64_t j = 0; j < rank; ++j) peft[o * rank * E + j * E + e] = keel[(e * m.rows + o) * rank + j];
}

}  // namespace keel::model
