#include "keel/checkpoint/gguf_experts.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <cstring>
#include <functional>
#include <map>
#include <optional>
#include <string_view>
#include <utility>

#include "keel/core/error.h"
#include "keel/model/hf_weights.h"

namespace keel::checkpoint {
namespace {

using Projection = model::ExpertProjection;

// One sparse layer's expert tensors as they came: per expert, or fused.
struct LayerExperts {
  std::vector<std::optional<HfTensorSource>> gate, up, down;  // [experts]
  std::optional<HfTensorSource> gate_up_fused, down_fused;
};

void require_shape(const HfTensorSource& t, const std::vector<int64_t>& expected) {
  require(t.shape == expected, "tensor '{}': expected shape [{}] (config.json's experts, hidden_size and "
          "moe_intermediate_size), found [{}]",
          t.name, fmt::join(expected, ", "), fmt::join(t.shape, ", "));
}

// Values [begin, begin + count) of a stack of equal parts of `per` values each (experts), part e's
// [first, first + n) read by read_part(e, first, n, to): a piece may start and end inside a part.
void read_stacked(int64_t begin, int64_t count, float* dst, int64_t per,
                  const std::function<void(int64_t e, int64_t first, int64_t n, float* to)>& read_part) {
  while (count > 0) {
    const int64_t e = begin / per, first = begin - e * per, n = std::min(count, per - first);
    read_part(e, first, n, dst);
    begin += n, count -= n, dst += n;
  }
}

// The stack of one projection from its per-expert tensors: expert e's [rows, cols] at e x rows x cols.
HfTensorSource stack_per_expert(const std::string& name, std::vector<std::optional<HfTensorSource>>& parts,
                                int64_t rows, int64_t cols, const std::string& what) {
  std::vector<HfTensorSource::Read> reads;
  for (size_t e = 0; e < parts.size(); ++e) {
    require(parts[e].has_value(),
            "{}: expert {}'s {} is missing from the checkpoint (config.json says {} experts; a GGUF file stacks "
            "them all into one tensor)",
            name.substr(0, name.rfind(".mlp.")), e, what, parts.size());
    require_shape(*parts[e], {rows, cols});
    reads.push_back(std::move(parts[e]->read));
  }
  const int64_t experts = int64_t(parts.size());
  return {name, {experts, rows, cols},
          [reads = std::move(reads), per = rows * cols](int64_t begin, int64_t count, float* dst) {
            read_stacked(begin, count, dst, per, [&](int64_t e, int64_t first, int64_t n, float* to) {
              reads[size_t(e)](first, n, to);
            });
          }};
}

// One half of transformers 5's fused gate_up_proj [E, 2I, H]: the gate (rows 0..I of each expert)
// or the up projection (rows I..2I), as Qwen2MoeModel splits it.
HfTensorSource fused_half(const std::string& name, const HfTensorSource& fused, int64_t experts, int64_t inter,
                          int64_t hidden, bool up) {
  return {name, {experts, inter, hidden},
          [read = fused.read, per = inter * hidden, up](int64_t begin, int64_t count, float* dst) {
            read_stacked(begin, count, dst, per, [&](int64_t e, int64_t first, int64_t n, float* to) {
              read((e * 2 + (up ? 1 : 0)) * per + first, n, to);
            });
          }};
}

// The layer's three stacks in the converter's order.
std::vector<HfTensorSource> layer_stacks(const model::ModelConfig& c, int64_t layer, LayerExperts& x) {
  const int64_t E = c.moe.experts, I = c.moe.intermediate_size, H = c.hidden_size;
  const std::string pre = fmt::format("model.layers.{}.mlp.experts.", layer);
  const bool any_per_expert = std::any_of(x.gate.begin(), x.gate.end(), [](auto& t) { return t.has_value(); }) ||
                              std::any_of(x.up.begin(), x.up.end(), [](auto& t) { return t.has_value(); }) ||
                              std::any_of(x.down.begin(), x.down.end(), [](auto& t) { return t.has_value(); });
  const bool fused = x.gate_up_fused || x.down_fused;
  require(!(fused && any_per_expert),
          "model.layers.{}: the checkpoint holds this layer's experts both fused (mlp.experts.gate_up_proj, "
          "down_proj) and one tensor per expert; expected one layout",
          layer);
  HfTensorSource gate, up, down;
  if (fused) {
    require(x.gate_up_fused && x.down_fused, "model.layers.{}.mlp.experts: expected both gate_up_proj and down_proj "
            "(transformers 5's fused experts), found only {}",
            layer, x.gate_up_fused ? "gate_up_proj" : "down_proj");
    require_shape(*x.gate_up_fused, {E, 2 * I, H});
    require_shape(*x.down_fused, {E, H, I});
    gate = fused_half(pre + "gate_proj.weight", *x.gate_up_fused, E, I, H, false);
    up = fused_half(pre + "up_proj.weight", *x.gate_up_fused, E, I, H, true);
    down = {pre + "down_proj.weight", x.down_fused->shape, std::move(x.down_fused->read)};
  } else {
    const auto names = model::published_expert_names(c.family);
    const auto stem = [](std::string_view n) { return std::string(n.substr(0, n.rfind('.'))); };  // w1, up_proj
    gate = stack_per_expert(pre + "gate_proj.weight", x.gate, I, H, stem(names.gate));
    up = stack_per_expert(pre + "up_proj.weight", x.up, I, H, stem(names.up));
    down = stack_per_expert(pre + "down_proj.weight", x.down, H, I, stem(names.down));
  }
  std::vector<HfTensorSource> out;
  if (c.family == model::Family::Mixtral) {  // LlamaModel: for wid in ["w1", "w2", "w3"]
    out.push_back(std::move(gate));
    out.push_back(std::move(down));
    out.push_back(std::move(up));
  } else {  // Qwen2MoeModel: for w_name in ["down_proj", "gate_proj", "up_proj"]
    out.push_back(std::move(down));
    out.push_back(std::move(gate));
    out.push_back(std::move(up));
  }
  return out;
}

}  // namespace

std::vector<HfTensorSource> gguf_converter_order(const model::ModelConfig& c, std::vector<HfTensorSource> tensors) {
  const bool mixtral = c.family == model::Family::Mixtral;
  const auto names = model::published_expert_names(c.family);
  // (sort key, tensors): a layer's stacks sort where its per-expert tensors do, under their common
  // prefix, so the fused layout lands where the published one would.
  std::vector<std::pair<std::string, std::vector<HfTensorSource>>> items;
  std::map<int64_t, LayerExperts> layers;
  for (auto& t : tensors) {
    std::optional<model::ExpertTensorName> e;
    if (c.has_experts()) e = model::parse_expert_tensor_name(c.family, t.name);
    if (!e) {
      // Mixtral's router under transformers 5's name sorts where the published one does.
      std::string key = t.name;
      constexpr std::string_view kRouter = ".mlp.gate.weight";
      if (mixtral && t.name.starts_with("model.layers.") && std::string_view(t.name).ends_with(kRouter))
        key = t.name.substr(0, t.name.size() - kRouter.size()) + ".block_sparse_moe.gate.weight";
      t.name = key;
      std::vector<HfTensorSource> one;
      one.push_back(std::move(t));
      items.emplace_back(key, std::move(one));
      continue;
    }
    require(e->layer >= 0 && e->layer < c.num_layers && c.sparse_layer(e->layer),
            "tensor '{}': config.json has no mixture of experts in layer {} ({} layers)", t.name, e->layer,
            c.num_layers);
    LayerExperts& x = layers[e->layer];
    if (e->expert < 0) {
      auto& slot = e->projection == Projection::GateUp ? x.gate_up_fused : x.down_fused;
      slot = std::move(t);
      continue;
    }
    require(e->expert < c.moe.experts, "tensor '{}': expert {} of a layer of {} experts (config.json)", t.name,
            e->expert, c.moe.experts);
    for (auto* list : {&x.gate, &x.up, &x.down}) list->resize(size_t(c.moe.experts));
    auto& list = e->projection == Projection::Gate ? x.gate : e->projection == Projection::Up ? x.up : x.down;
    list[size_t(e->expert)] = std::move(t);
  }
  for (int64_t l = 0; l < c.num_layers; ++l) {
    if (!c.sparse_layer(l)) continue;
    auto it = layers.find(l);
    require(it != layers.end(), "model.layers.{}: the checkpoint has no experts for this layer (config.json makes "
            "it a mixture of {} experts)",
            l, c.moe.experts);
    for (auto* list : {&it->second.gate, &it->second.up, &it->second.down}) list->resize(size_t(c.moe.experts));
    items.emplace_back(fmt::format("model.layers.{}.{}experts.", l, names.block),
                       layer_stacks(c, l, it->second));
  }
  std::stable_sort(items.begin(), items.end(), [](const auto& a, const auto& b) { return a.first < b.first; });
  std::vector<HfTensorSource> out;
  for (auto& [key, list] : items)
    for (auto& t : list) out.push_back(std::move(t));
  return out;
}

void require_llama_cpp_runs_experts(const model::ModelConfig& c, const std::string& arch) {
  if (!c.has_experts()) return;
  const std::string family = model::family_display_name(c.family);
  // llama.cpp's glm4moe reads what GLM-4.5 varies: its leading dense layers
  // (leading_dense_block_count; config.json's first_k_dense_replace can say nothing else), the
  // renormalisation (expert_weights_norm), the scaling, the sigmoid and the expert groups.
  if (arch == "glm4moe") return;
  for (int64_t l = 0; l < c.num_layers; ++l)
    require(c.sparse_layer(l),
            "--format gguf: layer {} of this {} model has a dense MLP (mlp_only_layers or decoder_sparse_step in "
            "config.json), and llama.cpp's {} wants a mixture of experts in every layer (its loader requires each "
            "layer's ffn_gate_inp and expert tensors; no GGUF key says which layers are dense): llama.cpp could not "
            "load the file. Export --format hf for runtimes that read config.json",
            l, family, arch);
  require(c.moe.norm_topk_prob,
          "--format gguf: this {} model does not renormalise its top-{} router weights (norm_topk_prob false in "
          "config.json), and llama.cpp's {} always does (build_moe_ffn with norm_w; the file has no key for it): "
          "llama.cpp would not run the model as trained. Export --format hf for runtimes that read config.json",
          family, c.moe.experts_per_token, arch);
}

}  // namespace keel::checkpoint
