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
  }
  return -1;
}

// Internal parameter index -> the block and linear layer it is the weight of.
std::map<int, Owner> linear_owners(const DecoderParamIds& ids) {
  std::map<int, Owner> owners;
  for (size_t l = 0; l < ids.layers.size(); ++l)
    for (int s = 0; s < kLinearSlots; ++s)
      owners[slot_weight(ids.layers[l], LinearSlot(s))] = {int64_t(l), LinearSlot(s)};
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

bool matches(const std::string& path, const std::string& target) {
  if (target == path) return true;
  return path.size() > target.size() && path.compare(path.size() - target.size(), target.size(), target) == 0 &&
         path[path.size() - target.size() - 1] == '.';
}

}  // namespace

int module_weight(const DecoderParamIds& ids, const LoraModule& m) {
  return slot_weight(ids.layers[size_t(m.layer)], m.slot);
}

std::vector<std::string> block_linear_names(const ModelConfig& config, const DecoderParamIds& ids) {
  std::vector<std::string> names;
  for (const auto& m : block_linears(config, ids))
    if (std::find(names.begin(), names.end(), m.name) == names.end()) names.push_back(m.name);
  return names;
}

std::vector<LoraModule> lora_modules(const ModelConfig& config, const DecoderParamIds& ids, const LoraSpec& spec) {
  require(spec.rank > 0, "LoRA: rank must be positive, got {}", spec.rank);
  require(!spec.targets.empty(), "LoRA: lora_target names no module");
  const bool all = std::find(spec.targets.begin(), spec.targets.end(), "all") != spec.targets.end();
  std::vector<LoraModule> out;
  std::set<std::string> matched;
  std::vector<int64_t> per_layer(size_t(config.num_layers), 0);
  for (auto& m : block_linears(config, ids)) {
    bool take = all;
    for (const auto& t : spec.targets)
      if (t != "all" && matches(m.path, t)) take = true, matched.insert(t);
    if (!take) continue;
    m.index_in_layer = per_layer[size_t(m.layer)]++;
    out.push_back(std::move(m));
  }
  for (const auto& t : spec.targets)
    require(t == "all" || matched.count(t),
            "lora_target '{}' matches no linear layer of {}; its modules are: {} (or \"all\")", t,
            config.architecture, fmt::join(block_linear_names(config, ids), ", "));
  return out;
}

void declare_lora_params(std::vector<LoraModule>& modules, int64_t rank, ParamStore& adapter) {
  for (auto& m : modules) {
    m.a = adapter.add(m.path + ".lora_A", {rank, m.cols}, true);
    m.b = adapter.add(m.path + ".lora_B", {m.rows, rank}, true);
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
  return fmt::format("base_model.model.{}.lora_{}.weight", m.path, a ? "A" : "B");
}

}  // namespace keel::model
