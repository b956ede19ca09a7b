#include "keel/model/decoder_plan.h"

#include <algorithm>
#include <string>

#include <fmt/format.h>

#include "keel/core/error.h"
#include "keel/kernels/bf16_widening.h"
#include "keel/model/experts.h"
#include "keel/model/hf_weights.h"

namespace keel::model {

namespace {

int64_t round_up(int64_t n, int64_t unit) { return (n + unit - 1) / unit * unit; }

// A gathered buffer's name in the plan: what it holds and where it is read.
// cast: ZeRO-3 with one rank's bf16 casts (cast_per_position).
std::string gathered_name(const StepTimeline& t, const ParamStore& params, const WeightGather& g, bool resident,
                          bool cast) {
  const std::string& first = params.param(g.first_param).name;
  const std::string what = first == "embed"        ? "embed"
                           : first == "final_norm" ? "final_norm + lm_head"
                                                   : first.substr(0, first.find('.', first.find('.') + 1));
  const std::string where = g.position == t.head() ? "head"
                            : g.position <= t.layers
                                ? fmt::format("forward of layer {}", g.position - 1)
                                : fmt::format("backward of layer {}", t.head() + t.layers - g.position);
  if (cast) return fmt::format("weights.bf16.cast ({}, read in the {})", what, where);
  return resident ? fmt::format("weights.resident ({}, first read in the {})", what, where)
                  : fmt::format("weights.gathered ({}, read in the {})", what, where);
}

// The largest operand the decoder holds widened (kernels::Bf16Widening::hold): 32 MiB in fp32, two of
// the GEMM's own widened tiles (kernels/gemm.h) — the bench model's gate/up gradient at 2,048 tokens.
constexpr int64_t kHeldWidenedElements = int64_t(8) << 20;

// The output width of a block's projection: its fused weight's rows.
int64_t slot_width(const ModelConfig& c, LinearSlot slot) {
  switch (slot) {
    case LinearSlot::Qkv: return c.q_size() + 2 * c.kv_size();
    case LinearSlot::O: return c.hidden_size;
    case LinearSlot::GateUp: return 2 * c.intermediate_size;
    case LinearSlot::Down: return c.hidden_size;
    case LinearSlot::ExpertsGateUp: return 2 * c.moe.intermediate_size;  // per expert
    case LinearSlot::ExpertsDown: return c.hidden_size;
  }
  return 0;
}

// Where the backward pass writes a gradient group, in words (its staging buffer's name).
std::string written_where(const StepTimeline& t, const GradGroup& g) {
  auto at = [&](int32_t p) {
    return p == t.head() ? std::string("head") : fmt::format("layer {}", t.head() + t.layers - p);
  };
  return g.first_written == g.last_written
             ? "written at " + at(g.first_written)
             : fmt::format("written from {} to {}", at(g.first_written), at(g.last_written));
}

// The packed plan of one set of options, as the constructor would lay it out (checkpointing_layers
// as given: resolve_checkpointing_layers chooses it by comparing two of these).
MemoryPlan plan_decoder(const ModelConfig& config, Precision precision, int64_t max_batch, int64_t max_seq,
                        const DecoderOptions& options) {
  ParamStore params, adapter;
  DecoderParamIds ids;
  declare_params(config, params, ids, base_storage(options, precision));
  const auto layout = declare_adapter(config, ids, options.lora, adapter);
  const std::vector<GradGroup> groups =
      options.shard_gradients ? gradient_groups(config, ids, layout.modules.empty() ? params : adapter, layout)
                              : std::vector<GradGroup>{};
  const std::vector<WeightGather> gathers = weight_gathers_for(config, ids, params, precision, options);
  MemoryPlan plan;
  describe_memory(config, params, adapter_shape(config, layout.modules, adapter, options.lora), groups, gathers,
                  precision, max_batch, max_seq, options, plan);
  plan.pack();
  return plan;
}

}  // namespace

std::vector<WeightGather> plan_weight_gathers(const ModelConfig& c, const DecoderParamIds& ids,
                                              const ParamStore& params, bool bf16_copies, bool resident, bool local) {
  const StepTimeline t{int32_t(c.num_layers)};
  // Each storage's tensors of a group are contiguous in their own buffer (declared in order). The
  // compute-only spans end where the store's alignment does, so their shards' parts are whole
  // 4-byte words (bf16 pairs; 4-bit: whole blocks of codes and their absmax values).
  auto span = [&](int first, int last, ParamStorage storage) {
    FlatRange r{-1, -1};
    for (int i = first; i <= last; ++i) {
      const Param& p = params.param(i);
      if (p.storage != storage) continue;
      if (r.begin < 0) r.begin = p.offset;
      const int64_t align = storage == ParamStorage::Master ? 1
                            : storage == ParamStorage::Bf16 ? kParamAlignElements
                                                            : kFourBitShardAlign;
      r.end = p.offset + round_up(p.numel, align);
    }
    return r.begin < 0 ? FlatRange{} : r;
  };
  // A master the position reads in fp32: every one without bf16 copies; with them the 1-D ones
  // (norms, biases) and the embedding where it is looked up (at the head it is the tied LM head).
  auto reads_fp32 = [&](int i, int32_t position) {
    const Param& p = params.param(i);
    return !bf16_copies || p.shape.size() == 1 || (i == ids.embed && position != t.head());
  };
  std::vector<WeightGather> out;
  auto gather = [&](int first, int last, int32_t position) {
    WeightGather g{first, last, span(first, last, ParamStorage::Master), position};
    bool bf16_read = false;
    for (int i = first; i <= last; ++i) {
      const Param& p = params.param(i);
      if (!p.master()) continue;
      if (!reads_fp32(i, position)) {  // the GEMMs' matrices: bf16 alone
        bf16_read = true;
        continue;
      }
      if (local) continue;
      if (!g.fp32_runs.empty() && i > first && params.param(i - 1).master() && reads_fp32(i - 1, position)) {
        g.fp32_runs.back().range.end = p.offset + p.numel;  // extends the run (padding between included)
      } else {
        g.fp32_runs.push_back({FlatRange{p.offset, p.offset + p.numel}, g.fp32_elements});
      }
      const WeightGather::Run& run = g.fp32_runs.back();
      g.fp32_elements = run.at + round_up(run.range.size(), kParamAlignElements);
    }
    if (bf16_read) g.bf16_span = {g.range.begin, round_up(g.range.end, kParamAlignElements)};
    g.compute_only = span(first, last, ParamStorage::Bf16);
    g.four_bit = span(first, last, ParamStorage::FourBit);
    if (local && !bf16_read) return;
    out.push_back(g);
  };
  gather(ids.embed, ids.embed, t.forward(0));
  for (int64_t l = 0; l < c.num_layers; ++l) {
    const int first = ids.layers[size_t(l)].input_norm;
    const int last = l + 1 < c.num_layers ? ids.layers[size_t(l + 1)].input_norm - 1 : ids.final_norm - 1;
    gather(first, last, t.forward(l));
    if (!resident) gather(first, last, t.backward(l));  // resident buffers still hold the forward's
  }
  const int head_last = c.tie_word_embeddings ? ids.final_norm : ids.lm_head;
  gather(ids.final_norm, head_last, t.head());
  if (c.tie_word_embeddings) gather(ids.embed, ids.embed, t.head());
  std::stable_sort(out.begin(), out.end(),
                   [](const WeightGather& a, const WeightGather& b) { return a.position < b.position; });
  return out;
}

int64_t lm_head_chunk_rows(int64_t vocab, int64_t tokens, int64_t requested) {
  tokens = std::max<int64_t>(tokens, 1);
  const int64_t most =
      requested > 0 ? requested : std::max<int64_t>(512, (int64_t(8) << 20) / std::max<int64_t>(vocab, 1));
  const int64_t rows = std::min(most, tokens);
  const int64_t chunks = (tokens + rows - 1) / rows;
  return (tokens + chunks - 1) / chunks;
}

BaseStorage base_storage(const DecoderOptions& options, Precision precision) {
  BaseStorage s;
  if (!options.lora.enabled()) return s;
  s.head = precision == Precision::BF16 ? ParamStorage::Bf16 : ParamStorage::Master;
  s.blocks = options.four_bit_base ? ParamStorage::FourBit : s.head;
  return s;
}

void declare_params(const ModelConfig& c, ParamStore& params, DecoderParamIds& ids, BaseStorage storage) {
  const int64_t H = c.hidden_size, qkv_rows = c.q_size() + 2 * c.kv_size();
  const ParamStorage head = storage.head, blocks = storage.blocks;
  ids.embed = params.add("embed", {c.vocab_size, H}, true, head);
  ids.layers.resize(c.num_layers);
  for (int64_t l = 0; l < c.num_layers; ++l) {
    auto& p = ids.layers[l];
    std::string prefix = "layers." + std::to_string(l) + ".";
    p.input_norm = params.add(prefix + "input_norm", {H}, false);
    p.qkv_weight = params.add(prefix + "qkv.weight", {qkv_rows, H}, true, blocks);
    if (c.qkv_bias) p.qkv_bias = params.add(prefix + "qkv.bias", {qkv_rows}, false);
    if (c.qk_norm) {
      p.q_norm = params.add(prefix + "q_norm", {c.head_dim}, false);
      p.k_norm = params.add(prefix + "k_norm", {c.head_dim}, false);
    }
    p.o_weight = params.add(prefix + "o.weight", {H, c.q_size()}, true, blocks);
    if (c.sandwich_norms) p.attn_out_norm = params.add(prefix + "attention_output_norm", {H}, false);
    p.post_norm = params.add(prefix + "post_attention_norm", {H}, false);
    if (c.sparse_layer(l)) {  // the router and the experts (experts.h), decayed as transformers' Trainer decays them
      // The router stays in full precision under QLoRA (as bitsandbytes leaves transformers' router,
      // no nn.Linear): the head's storage, which is the blocks' without 4 bits.
      const int64_t E = c.moe.experts, I = c.moe.intermediate_size;
      p.router = params.add(prefix + "router.weight", {E, H}, true, head);
      if (c.moe.sigmoid_router) p.router_bias = params.add(prefix + "router.score_correction_bias", {E}, false);
      p.experts_gate_up = params.add(prefix + "experts.gate_up.weight", {E * 2 * I, H}, true, blocks);
      p.experts_down = params.add(prefix + "experts.down.weight", {E * H, I}, true, blocks);
    }
    // The dense MLP, or a sparse layer's shared experts (GLM-4.5).
    if (const int64_t width = c.mlp_width(l); width > 0) {
      const std::string mlp = prefix + (c.sparse_layer(l) ? "shared_experts." : "");
      p.gate_up_weight = params.add(mlp + "gate_up.weight", {2 * width, H}, true, blocks);
      p.down_weight = params.add(mlp + "down.weight", {H, width}, true, blocks);
    }
    if (c.sandwich_norms) p.mlp_out_norm = params.add(prefix + "mlp_output_norm", {H}, false);
  }
  ids.final_norm = params.add("final_norm", {H}, false);
  ids.lm_head = c.tie_word_embeddings ? ids.embed : params.add("lm_head", {c.vocab_size, H}, true, head);
}

int64_t four_bit_tile_rows(int64_t rows, int64_t cols, int64_t budget) {
  return std::clamp<int64_t>(budget / cols, 1, rows);
}

AdapterLayout declare_adapter(const ModelConfig& c, const DecoderParamIds& ids, const LoraSpec& spec,
                              ParamStore& adapter) {
  AdapterLayout a;
  if (!spec.enabled()) return a;
  a.modules = lora_modules(c, ids, spec);
  a.saved = resolve_modules_to_save(c, ids, spec);
  if (!a.saved.embedding.empty()) a.embed = adapter.add(a.saved.embedding, {c.vocab_size, c.hidden_size}, true);
  declare_lora_params(a.modules, spec.rank, adapter);
  if (!a.saved.lm_head.empty()) a.lm_head = adapter.add(a.saved.lm_head, {c.vocab_size, c.hidden_size}, true);
  return a;
}

std::vector<GradGroup> gradient_groups(const ModelConfig& c, const DecoderParamIds& ids, const ParamStore& trained,
                                       const AdapterLayout& adapter) {
  const StepTimeline t{int32_t(c.num_layers)};
  const int n = int(trained.params().size());
  std::vector<std::pair<int32_t, int32_t>> written(size_t(n), {-1, -1});
  auto at = [&](int param, int32_t first, int32_t last) {
    if (param >= 0) written[size_t(param)] = {first, last};
  };
  const bool tied = c.tie_word_embeddings;
  if (adapter.modules.empty()) {
    at(ids.embed, tied ? t.head() : t.backward(0), t.backward(0));
    at(ids.final_norm, t.head(), t.head());
    if (!tied) at(ids.lm_head, t.head(), t.head());
    for (int64_t l = 0; l < c.num_layers; ++l) {
      const LayerParamIds& p = ids.layers[size_t(l)];
      for (int id : {p.input_norm, p.qkv_weight, p.qkv_bias, p.q_norm, p.k_norm, p.o_weight, p.attn_out_norm,
                     p.post_norm, p.gate_up_weight, p.down_weight, p.mlp_out_norm, p.router, p.router_bias,
                     p.experts_gate_up, p.experts_down})
        at(id, t.backward(l), t.backward(l));
    }
  } else {
    for (const LoraModule& m : adapter.modules) {
      at(m.a, t.backward(m.layer), t.backward(m.layer));
      at(m.b, t.backward(m.layer), t.backward(m.layer));
    }
    at(adapter.embed, t.backward(0), t.backward(0));
    at(adapter.lm_head, t.head(), t.head());
  }
  std::vector<GradGroup> groups;
  for (int i = 0; i < n; ++i) {
    require(written[size_t(i)].first >= 0, "ZeRO-2: no position writes the gradient of '{}'", trained.param(i).name);
    if (groups.empty() || written[size_t(i)] != std::make_pair(groups.back().first_written, groups.back().last_written))
      groups.push_back({i, i, {trained.param(i).offset, 0}, written[size_t(i)].first, written[size_t(i)].second});
    groups.back().last_param = i;
  }
  for (size_t g = 0; g < groups.size(); ++g)
    groups[g].range.end = g + 1 < groups.size() ? groups[g + 1].range.begin : trained.total();
  // The order the backward pass finishes them: by the position of their last write.
  std::stable_sort(groups.begin(), groups.end(),
                   [](const GradGroup& a, const GradGroup& b) { return a.last_written < b.last_written; });
  return groups;
}

std::vector<WeightGather> weight_gathers_for(const ModelConfig& c, const DecoderParamIds& ids, const ParamStore& params,
                                             Precision precision, const DecoderOptions& options) {
  const bool bf16_copies = precision == Precision::BF16 && !options.lora.enabled();
  if (options.shard_weights) return plan_weight_gathers(c, ids, params, bf16_copies, false);
  if (options.cast_per_position && bf16_copies) return plan_weight_gathers(c, ids, params, true, false, true);
  if (!options.shard_masters) return {};
  require(bf16_copies,
          "decoder: sharded fp32 masters (ZeRO-1/2) need bf16 full fine-tuning: in fp32 the masters are the weights "
          "the step reads, and LoRA's frozen base has none to shard");
  return plan_weight_gathers(c, ids, params, true, true);
}

void check_arguments(const ModelConfig& config, int64_t max_batch, int64_t max_seq, const DecoderOptions& options) {
  model::validate(config, "model");
  require(options.optimizer_shards >= 1 && options.optimizer_shard >= 0 &&
              options.optimizer_shard < options.optimizer_shards,
          "decoder: optimizer shard {} of {} does not exist", options.optimizer_shard, options.optimizer_shards);
  require(!options.shard_gradients || (options.optimizer_state && options.optimizer_shards > 1),
          "decoder: sharded gradients (ZeRO-2) need the optimizer state sharded over more than one rank");
  require(!options.shard_weights || options.shard_gradients,
          "decoder: sharded weights (ZeRO-3) need sharded gradients (ZeRO-2)");
  require(!options.shard_masters || (options.optimizer_state && options.optimizer_shards > 1 && !options.shard_weights),
          "decoder: sharded masters (ZeRO-1/2) need the optimizer state sharded over more than one rank, and not "
          "ZeRO-3 (which shards them itself)");
  require(!options.cast_per_position ||
              (options.optimizer_shards == 1 && !options.shard_weights && !options.lora.enabled()),
          "decoder: bf16 weights cast per position (ZeRO-3 with one rank) need one rank and full fine-tuning");
  require(options.checkpointing_layers >= 0 && options.checkpointing_layers <= config.num_layers &&
              (options.checkpointing_layers == 0 || options.gradient_checkpointing),
          "decoder: {} recomputed blocks of {} (gradient checkpointing {})", options.checkpointing_layers,
          config.num_layers, options.gradient_checkpointing ? "on" : "off");
  require(max_batch > 0 && max_seq > 1, "decoder: batch {} and sequence length {} must be positive (seq >= 2)",
          max_batch, max_seq);
  require(!options.four_bit_base || options.lora.enabled(), "decoder: 4-bit base weights (QLoRA) need LoRA");
  // Every HF tensor of a projection must start and end on a 64-element 4-bit block, as bitsandbytes
  // quantizes each on its own (an expert's gate, up and down: whole rows of hidden_size). The dense
  // MLP's width matters only where a layer has one.
  // GLM-4.5's shared experts are a dense MLP of their own width.
  bool dense_mlp = false;
  for (int64_t l = 0; l < config.num_layers; ++l) dense_mlp = dense_mlp || !config.sparse_layer(l);
  require(!options.four_bit_base ||
              (config.hidden_size % kFourBitBlockSize == 0 &&
               (!dense_mlp || config.intermediate_size % kFourBitBlockSize == 0) &&
               config.moe.shared_intermediate_size % kFourBitBlockSize == 0 &&
               config.q_size() % kFourBitBlockSize == 0),
          "QLoRA: hidden_size ({}), intermediate_size ({}), the shared experts' width ({}) and heads x head_dim ({}) "
          "must be multiples of {} (4-bit blocks of whole rows)",
          config.hidden_size, config.intermediate_size, config.moe.shared_intermediate_size, config.q_size(),
          kFourBitBlockSize);
}

kernels::AttentionMatmul attention_matmul(Precision p) {
  return p == Precision::BF16 ? kernels::AttentionMatmul::BF16 : kernels::AttentionMatmul::F32;
}

AdapterShape adapter_shape(const ModelConfig& c, const std::vector<LoraModule>& modules, const ParamStore& adapter,
                           const LoraSpec& spec) {
  AdapterShape a;
  if (modules.empty()) return a;
  a.elements = adapter.total();
  a.rank = spec.rank;
  a.modules_per_layer.assign(size_t(c.num_layers), 0);
  a.expert_modules_per_layer.assign(size_t(c.num_layers), 0);
  for (const auto& m : modules) {
    if (m.on_experts()) {  // its buffers are the routed rows' (experts.h), not the tokens'
      ++a.expert_modules_per_layer[size_t(m.layer)];
      continue;
    }
    ++a.modules_per_layer[size_t(m.layer)];
    a.widest_input = std::max(a.widest_input, m.cols);
    a.inputs.push_back(m.cols);
    a.outputs.push_back(m.rows);
    a.projection_outputs.push_back(slot_width(c, m.slot));
  }
  a.dropout = spec.dropout > 0;
  return a;
}

namespace {

// A sparse layer's experts tensor (declare_params' names): 4-bit, it is dequantized an expert at a time.
bool is_experts_tensor(const Param& p) { return p.name.find(".experts.") != std::string::npos; }

// describe_memory's sections, in the order the buffers are added to the plan (which `keel plan`
// and the arena's layout both follow): the weights the step reads, what training adds to them
// (gradients, optimizer state), the activations kept for the backward pass, the head and the
// backward pass's gradient scratch, and the scratch particular to a precision, 4-bit weights, LoRA
// or the backend.
class MemoryDescription {
 public:
  using Cat = MemoryCategory;

  MemoryDescription(const ModelConfig& c, const ParamStore& params, const AdapterShape& adapter, Precision precision,
                    int64_t max_batch, int64_t max_seq, const DecoderOptions& options, MemoryPlan& plan)
      : c_(c),
        params_(params),
        adapter_(adapter),
        precision_(precision),
        options_(options),
        plan_(plan),
        t_{int32_t(c.num_layers)},
        bf_(precision == Precision::BF16),
        max_batch_(max_batch),
        max_seq_(max_seq),
        N_(max_batch * max_seq),
        H_(c.hidden_size),
        I_(c.intermediate_size),
        Q_(c.q_size()),
        QKV_(c.q_size() + 2 * c.kv_size()),
        L_(c.num_layers),
        end_(t_.last()) {}

  // The weights: whole or this rank's shard, ZeRO's gathers, the 4-bit store.
  void weights(DecoderLayout& d, const std::vector<WeightGather>& gathers) {
    const int64_t param_elements = params_.total();
    const bool masters_sharded = options_.shard_weights || options_.shard_masters;
    if (masters_sharded) {
      // ZeRO-3: this rank's shard of the masters (every rank plans the largest, shard 0) and, under
      // LoRA in bf16, of the frozen bf16 matrices. Sharded masters (ZeRO-1/2): the same shard.
      const int shards = options_.optimizer_shards;
      const WeightShards held = weight_shards(params_, shards);
      d.weights = add(fmt::format("weights (1/{} shard)", shards), Cat::MasterWeights, held.masters[0].size(), f32,
                      kAlways, end_);
      if (params_.compute_only_total() > 0)
        d.compute_only_shard = add(fmt::format("weights.bf16 (frozen matrices, 1/{} shard)", shards),
                                   Cat::ComputeWeights, held.compute_only[0].size(), b16, kAlways, end_);
    } else {
      d.weights = add("weights", Cat::MasterWeights, param_elements, f32, kAlways, end_);
      if (gathers.empty())  // ZeRO-3 with one rank (cast_per_position) casts into its gathers instead
        d.weights_bf16 =
            add_bf16(params_.compute_only_total() ? "weights.bf16 (frozen matrices in bf16 only)" : "weights.bf16",
                     Cat::ComputeWeights, params_.bf16_total(), kAlways, end_);
    }
    // Each gather's buffers (WeightGather: what it carries in fp32, in bf16, as 4-bit) from the
    // position before the one that reads it (the first position's: that one alone); the resident
    // gathers' (sharded masters, ZeRO-1/2) across steps. With one rank a gather is its bf16 casts.
    const bool resident = options_.shard_masters;
    for (const WeightGather& g : gathers) {
      const int32_t first = resident ? kAlways : std::max(g.position - 1, t_.forward(0));
      const int32_t last = resident ? end_ : g.position;
      const std::string name = gathered_name(t_, params_, g, resident, !masters_sharded);
      d.gathered.push_back(g.fp32_elements > 0 ? add(name, Cat::ComputeWeights, g.fp32_elements, f32, first, last)
                                               : -1);
      d.gathered_b.push_back(g.bf16_span.size() > 0 ? add(masters_sharded ? name + ".bf16" : name, Cat::ComputeWeights,
                                                          g.bf16_span.size(), b16, first, last)
                                                    : -1);
      d.gathered_c.push_back(g.compute_only.size() > 0 ? add(name + " (frozen matrices, bf16)", Cat::ComputeWeights,
                                                             g.compute_only.size(), b16, first, last)
                                                       : -1);
      const bool four_bit = g.four_bit.size() > 0;
      d.gathered_4bit.push_back(
          four_bit ? add(name + " (4-bit codes)", Cat::ComputeWeights, g.four_bit.size() / 2, 1, first, last) : -1);
      d.gathered_4bit_absmax.push_back(four_bit ? add(name + " (4-bit absmax)", Cat::ComputeWeights,
                                                      g.four_bit.size() / kFourBitBlockSize, f32, first, last)
                                                : -1);
    }
    if (params_.four_bit_total() > 0) {
      // Whole, or ZeRO-3's shard (the largest, shard 0).
      const std::string_view type = four_bit_type_name(options_.four_bit_type);  // report/memory_report reads it
      const int shards = options_.shard_weights ? options_.optimizer_shards : 1;
      const int64_t held = weight_shards(params_, shards).four_bit[0].size();
      const std::string part = shards > 1 ? fmt::format(", 1/{} shard", shards) : "";
      d.four_bit_packed =
          add(fmt::format("weights.{} (4-bit codes{})", type, part), Cat::ComputeWeights, held / 2, 1, kAlways, end_);
      d.four_bit_absmax = add(fmt::format("weights.{}.absmax{}", type, shards > 1 ? " (" + part.substr(2) + ")" : ""),
                              Cat::ComputeWeights, held / kFourBitBlockSize, f32, kAlways, end_);
    }
  }

  // What training adds: gradients (whole, or ZeRO-2's shard and staging) and AdamW's moments.
  void training_state(DecoderLayout& d, const std::vector<GradGroup>& grad_groups) {
    const int64_t param_elements = params_.total();
    // Under LoRA the model's weights are frozen: gradients and moments only for the adapter.
    const bool staged = options_.shard_gradients;
    if (!adapter_.enabled() && !staged) d.grads = add("grads", Cat::Gradients, param_elements, f32, kAlways, end_);
    const int64_t trained = adapter_.enabled() ? adapter_.elements : param_elements;
    if (adapter_.enabled()) {
      d.lora_weights = add("lora.weights", Cat::MasterWeights, trained, f32, kAlways, end_);
      d.lora_weights_bf16 = add_bf16("lora.weights.bf16", Cat::ComputeWeights, trained, kAlways, end_);
      if (!staged) d.lora_grads = add("lora.grads", Cat::Gradients, trained, f32, kAlways, end_);
    }
    if (staged) {
      // ZeRO-2: the summed gradients of the (largest) shard, and each group's staging while the
      // backward pass writes it and its reduction runs.
      const std::string what = adapter_.enabled() ? "lora.grads" : "grads";
      const int shards = options_.optimizer_shards;
      d.grad_shard = add(fmt::format("{} (1/{} shard)", what, shards), Cat::Gradients,
                         shard_ranges(trained, shards)[0].size(), f32, kAlways, end_);
      for (const GradGroup& g : grad_groups)
        d.grad_staging.push_back(add(fmt::format("{}.staged ({})", what, written_where(t_, g)), Cat::Gradients,
                                     g.range.size(), f32, g.first_written, g.last_written + 1));
    }
    if (options_.optimizer_state) {
      // Every rank plans the largest shard (shard 0), so all ranks have the same plan.
      const int shards = options_.optimizer_shards;
      const int64_t moments = shard_ranges(trained, shards)[0].size();
      const std::string part = shards > 1 ? fmt::format(" (1/{} shard)", shards) : "";
      d.adam_m = add("adam.m" + part, Cat::OptimizerState, moments, f32, kAlways, end_);
      d.adam_v = add("adam.v" + part, Cat::OptimizerState, moments, f32, kAlways, end_);
    }
  }

  // The residual stream between blocks and each block's intermediates (BlockIds), kept from its
  // forward position to its backward one, or recomputed there (gradient checkpointing).
  void activations(DecoderLayout& d) {
    d.x.resize(size_t(L_ + 1));
    for (int64_t l = 0; l <= L_; ++l) {
      const int32_t written = l == 0 ? t_.forward(0) : t_.forward(l - 1);  // the embedding writes x[0]
      const int32_t read_last = l < L_ ? t_.backward(l) : t_.head();
      d.x[size_t(l)] = add(l < L_ ? fmt::format("layers.{}.input", l) : "final_norm.input", Cat::Activations, N_ * H_,
                           f32, written, read_last);
    }
    for (int64_t l = 0; l < L_; ++l) {
      const std::string prefix = fmt::format("layers.{}.", l);
      if (options_.recomputes(l)) {
        d.forward.push_back(block(l, prefix + "forward.", Cat::Workspace, t_.forward(l), t_.forward(l)));
        d.backward.push_back(block(l, prefix + "recomputed.", Cat::Activations, t_.backward(l), t_.backward(l)));
      } else {
        d.forward.push_back(block(l, prefix, Cat::Activations, t_.forward(l), t_.backward(l)));
        d.backward.push_back(d.forward.back());
      }
    }
  }

  // The final norm and the LM head's logits chunk, and the backward pass's gradient scratch.
  void head_and_gradients(DecoderLayout& d) {
    const int32_t head = t_.head(), backward_first = t_.backward(L_ - 1), backward_last = t_.backward(0);
    d.xn_final = add("final_norm.output", Cat::Activations, N_ * H_, f32, head, head);
    d.rstd_final = add("final_norm.rstd", Cat::Activations, N_, f32, head, head);
    d.xn_final_b = add_bf16("final_norm.output.bf16", Cat::Activations, N_ * H_, head, head);
    const int64_t chunk = lm_head_chunk_rows(c_.vocab_size, N_, options_.lm_head_chunk_tokens);
    d.logits = add("lm_head.logits", Cat::Workspace, chunk * c_.vocab_size, f32, head, head);
    d.logits_b = add_bf16("lm_head.logits.bf16", Cat::Workspace, chunk * c_.vocab_size, head, head);
    d.dx = add("grad.residual", Cat::Workspace, N_ * H_, f32, head, backward_last);
    d.dnorm = add("grad.norm_output", Cat::Workspace, N_ * H_, f32, head, backward_last);
    d.dh = add("grad.residual_mid", Cat::Workspace, N_ * H_, f32, backward_first, backward_last);
    // A sandwich norm's input gradient (Gemma): the other norms add theirs into the residual
    // stream's gradient as they compute it (rmsnorm_backward's residual), with no buffer between.
    if (c_.sandwich_norms)
      d.dtmp = add("grad.norm_input", Cat::Workspace, N_ * H_, f32, backward_first, backward_last);
    // The MLP's: a dense layer's, or the routed rows' of a sparse one (the wider of the two), or its
    // shared experts' (GLM-4.5).
    int64_t act_width = 0, mlp_width = I_;
    for (int64_t l = 0; l < L_; ++l) {
      act_width = std::max(act_width, c_.sparse_layer(l) ? c_.moe.experts_per_token * c_.moe.intermediate_size : I_);
      mlp_width = std::max(mlp_width, c_.mlp_width(l));
    }
    act_width = std::max(act_width, mlp_width);
    d.d_act = add("grad.act", Cat::Workspace, N_ * act_width, f32, backward_first, backward_last);
    d.d_gate_up = add("grad.gate_up", Cat::Workspace, N_ * 2 * act_width, f32, backward_first, backward_last);
    if (c_.has_experts()) experts(d);
    d.d_attn = add("grad.attn", Cat::Workspace, N_ * Q_, f32, backward_first, backward_last);
    d.d_qkv = add("grad.qkv", Cat::Workspace, N_ * QKV_, f32, backward_first, backward_last);
    if (c_.qk_norm)
      d.d_qk = add("grad.qk_normed", Cat::Workspace, N_ * (Q_ + c_.kv_size()), f32, backward_first, backward_last);
    // From the head on: the final norm's backward (at the head position, before the first block's)
    // writes the last block's down-projection gradient into it (backward(): residual_dy_b).
    d.dy_b = add_bf16("grad.bf16", Cat::Workspace, N_ * std::max({H_, 2 * mlp_width, QKV_}), head, backward_last);
  }

  // Scratch of 4-bit weights (a dequantized tile), LoRA (dropout, its gradient), bf16 products on a
  // CPU that widens them, attention's workspace, and the RoPE tables outside the arena.
  void scratch(DecoderLayout& d) {
    const int32_t backward_first = t_.backward(L_ - 1), backward_last = t_.backward(0);
    if (params_.four_bit_total() > 0) {  // one tile of dequantized rows, used by every 4-bit GEMM in turn
      // A projection's tile of rows; 4-bit experts one expert's gate/up at a time (experts.h).
      int64_t tile = 0;
      for (const auto& p : params_.params())
        if (p.storage == ParamStorage::FourBit && !is_experts_tensor(p))
          tile = std::max(tile, four_bit_tile_rows(p.shape[0], p.shape[1], options_.four_bit_tile_elements) * p.shape[1]);
      if (c_.has_experts() && options_.four_bit_base) tile = std::max(tile, experts_tile_elements(c_));
      if (bf_)
        d.four_bit_tile_b = add("4bit.dequantized_tile (bf16)", Cat::Workspace, tile, b16, t_.forward(0), backward_last);
      else
        d.four_bit_tile = add("4bit.dequantized_tile", Cat::Workspace, tile, f32, t_.forward(0), backward_last);
    }
    if (adapter_.dropout) {  // a module's dropped-out input (forward and backward), and its dx before the mask
      const int64_t wide = N_ * adapter_.widest_input;
      if (bf_)
        d.lora_dropped_b = add("lora.dropout.input (bf16)", Cat::Workspace, wide, b16, t_.forward(0), backward_last);
      else
        d.lora_dropped = add("lora.dropout.input", Cat::Workspace, wide, f32, t_.forward(0), backward_last);
      d.lora_dx = add("grad.lora.dropout", Cat::Workspace, wide, f32, backward_first, backward_last);
    }
    if (adapter_.enabled()) {
      d.lora_du = add("grad.lora", Cat::Workspace, N_ * adapter_.rank, f32, backward_first, backward_last);
      d.lora_du_b = add_bf16("grad.lora.bf16", Cat::Workspace, N_ * adapter_.rank, backward_first, backward_last);
    }
    held_widened(d);

    // The attention kernel's per-thread blocks of scores and packed heads, used by every layer in
    // the forward and the backward pass.
    d.attention_workspace = add("attention.workspace", Cat::Workspace,
                                int64_t(backend_of(options_).attention_workspace_bytes(
                                    attention_shape(c_, 0, max_batch_, max_seq_), attention_matmul(precision_))),
                                1, t_.forward(0), backward_last);

    // bf16 products on a CPU without a bf16 matmul widen their operands into fp32 tiles the GEMM
    // layer holds from the first step on (kernels/gemm.h: gemm_widened_operand_bytes).
    if (const size_t widened = backend_of(options_).gemm_scratch_bytes(bf_))
      plan_.add_external("bf16 GEMM operands widened to fp32 (no bf16 matmul on this CPU)", Cat::Workspace, widened,
                         t_.forward(0), end_);

    // The rotary table is a kernels::RopeTable (std::vector) built once: counted, not in the arena.
    plan_.add_external("rope_table", Cat::Data, size_t(max_seq_) * size_t(c_.rotary_dim) * f32, kAlways, end_);
    if (c_.rope_local_theta > 0)  // Gemma 3's sliding-window layers rotate with their own base
      plan_.add_external("rope_table.local", Cat::Data, size_t(max_seq_) * size_t(c_.rotary_dim) * f32, kAlways, end_);
  }

 private:
  static constexpr size_t f32 = sizeof(float), b16 = sizeof(bf16), i32 = sizeof(int32_t), f64 = sizeof(double);
  static constexpr int32_t kAlways = 0;

  int add(std::string name, Cat cat, int64_t elements, size_t element_size, int32_t first, int32_t last) {
    return plan_.add(std::move(name), cat, size_t(elements) * element_size, first, last);
  }
  // bf16 GEMM inputs exist only in bf16 mode.
  int add_bf16(std::string name, Cat cat, int64_t elements, int32_t first, int32_t last) {
    return bf_ ? add(std::move(name), cat, elements, b16, first, last) : -1;
  }

  // Mixture of experts beyond the blocks' routing: the backward pass's scratch, the token mask and
  // load-balancing sums of a call, and the expert load gathered over a step.
  void experts(DecoderLayout& d) {
    const int32_t backward_first = t_.backward(L_ - 1), backward_last = t_.backward(0);
    const int64_t E = c_.moe.experts, R = N_ * c_.moe.experts_per_token;
    d.d_routed = add("grad.experts.rows", Cat::Workspace, R * H_, f32, backward_first, backward_last);
    d.d_router = add("grad.router", Cat::Workspace, N_ * E, f32, backward_first, backward_last);
    d.d_slot = add("grad.router.slots", Cat::Workspace, R, f32, backward_first, backward_last);
    const int64_t IM = c_.moe.intermediate_size;
    d.d_routed_b = add_bf16("grad.experts.rows.bf16", Cat::Workspace, R * H_, backward_first, backward_last);
    d.d_routed_gate_up_b =
        add_bf16("grad.experts.gate_up.bf16", Cat::Workspace, R * 2 * IM, backward_first, backward_last);
    d.d_router_b = add_bf16("grad.router.bf16", Cat::Workspace, N_ * E, backward_first, backward_last);
    d.token_mask = add("router.token_mask", Cat::Workspace, N_, f32, t_.forward(0), backward_last);
    d.router_balance = add("router.balance", Cat::Workspace, 3 * E, f64, t_.forward(0), backward_last);
    int64_t sparse = 0;
    for (int64_t l = 0; l < L_; ++l) sparse += c_.sparse_layer(l);
    d.expert_load = add("router.expert_load", Cat::Activations, sparse * E, f64, kAlways, end_);
    if (adapter_.on_experts()) {  // LoRA on the experts: du of the routed rows, one module at a time
      d.d_experts_lora = add("grad.experts.lora", Cat::Workspace, R * adapter_.rank, f32, backward_first, backward_last);
      d.d_experts_lora_b =
          add_bf16("grad.experts.lora.bf16", Cat::Workspace, R * adapter_.rank, backward_first, backward_last);
    }
  }

  BlockIds block(int64_t layer, const std::string& prefix, Cat cat, int32_t first, int32_t last) {
    // I: the dense MLP's width, or a sparse layer's shared experts' (0: none).
    const int64_t N = N_, H = H_, I = c_.mlp_width(layer), Q = Q_, QKV = QKV_;
    BlockIds b;
    // In bf16 the GEMMs of the backward pass read the bf16 copies of the normalised inputs and of
    // the SwiGLU output (Linear::backward_weight), so their fp32 originals are scratch of the
    // forward position only: one block's worth shared by all blocks.
    const Cat gemm_input_cat = bf_ ? Cat::Workspace : cat;
    const int32_t gemm_input_last = bf_ ? first : last;
    b.xn1 = add(prefix + "xn1", gemm_input_cat, N * H, f32, first, gemm_input_last);
    b.rstd1 = add(prefix + "rstd1", cat, N, f32, first, last);
    b.qkv = add(prefix + "qkv", cat, N * QKV, f32, first, last);
    if (c_.qk_norm) {
      b.qk = add(prefix + "qk_normed", cat, N * (Q + c_.kv_size()), f32, first, last);
      b.rstd_qk = add(prefix + "qk_norm.rstd", cat, N * (c_.num_heads + c_.num_kv_heads), f32, first, last);
    }
    b.attn = add(prefix + "attn", cat, N * Q, f32, first, last);  // attention_backward reads it
    b.lse = add(prefix + "lse", cat, N * c_.num_heads, f32, first, last);
    b.xmid = add(prefix + "xmid", cat, N * H, f32, first, last);
    b.xn2 = add(prefix + "xn2", gemm_input_cat, N * H, f32, first, gemm_input_last);
    b.rstd2 = add(prefix + "rstd2", cat, N, f32, first, last);
    if (c_.sandwich_norms) {
      b.ao = add(prefix + "attention_output", cat, N * H, f32, first, last);
      b.rstd_ao = add(prefix + "attention_output.rstd", cat, N, f32, first, last);
      b.mo = add(prefix + "mlp_output", cat, N * H, f32, first, last);
      b.rstd_mo = add(prefix + "mlp_output.rstd", cat, N, f32, first, last);
    }
    if (c_.sparse_layer(layer)) {
      // The routing and the routed rows (experts.h: RoutedActivations): tokens x top_k rows however
      // the tokens fall, so these sizes hold any routing.
      const int64_t E = c_.moe.experts, R = N * c_.moe.experts_per_token, IM = c_.moe.intermediate_size;
      b.router_probs = add(prefix + "router.probs", cat, N * E, f32, first, last);
      b.route_choice = add(prefix + "router.choice", cat, R, i32, first, last);
      b.route_weight = add(prefix + "router.weight", cat, R, f32, first, last);
      b.expert_rows = add(prefix + "experts.rows", cat, E + 1, i32, first, last);
      b.row_slot = add(prefix + "experts.row_slot", cat, R, i32, first, last);
      b.token_rows = add(prefix + "experts.token_rows", cat, R, i32, first, last);
      // The products' input: fp32, or in bf16 its bf16 copy alone (the gather copies from xn2's).
      if (bf_)
        b.routed_in_b = add_bf16(prefix + "experts.input.bf16", cat, R * H, first, last);
      else
        b.routed_in = add(prefix + "experts.input", cat, R * H, f32, first, last);
      b.routed_gate_up = add(prefix + "experts.gate_up", cat, R * 2 * IM, f32, first, last);
      b.routed_act = add(prefix + "experts.act", cat, R * IM, f32, first, last);
      b.routed_out = add(prefix + "experts.output", cat, R * H, f32, first, last);
      b.routed_act_b = add_bf16(prefix + "experts.act.bf16", cat, R * IM, first, last);
      if (adapter_.enabled() && adapter_.expert_modules_per_layer[size_t(layer)] > 0) {
        const int64_t u = R * adapter_.rank * adapter_.expert_modules_per_layer[size_t(layer)];
        b.experts_lora_u = add(prefix + "experts.lora.u", cat, u, f32, first, last);  // fp32 in bf16 too (experts.h)
      }
    }
    if (I > 0) {  // the dense MLP, or the shared experts beside the routed ones
      const std::string mlp = prefix + (c_.sparse_layer(layer) ? "shared_experts." : "");
      b.gate_up = add(mlp + "gate_up", cat, N * 2 * I, f32, first, last);
      b.act = add(mlp + "act", gemm_input_cat, N * I, f32, first, gemm_input_last);
    }
    b.xn1_b = add_bf16(prefix + "xn1.bf16", cat, N * H, first, last);
    b.attn_b = add_bf16(prefix + "attn.bf16", cat, N * Q, first, last);
    b.xn2_b = add_bf16(prefix + "xn2.bf16", cat, N * H, first, last);
    if (I > 0)
      b.act_b = add_bf16(prefix + (c_.sparse_layer(layer) ? "shared_experts." : "") + "act.bf16", cat, N * I, first,
                         last);
    if (adapter_.enabled() && adapter_.modules_per_layer[size_t(layer)] > 0) {
      const int64_t u = N * adapter_.rank * adapter_.modules_per_layer[size_t(layer)];
      b.lora_u = add(prefix + "lora.u", cat, u, f32, first, last);
      b.lora_u_b = add_bf16(prefix + "lora.u.bf16", cat, u, first, last);
    }
    return b;
  }

  // bf16 on a backend whose products widen bf16 to fp32 at every call (kernels/bf16_widening.h): a
  // projection's output gradient widened once for its input-gradient product, its weight-gradient
  // product (full fine-tuning) and its adapters' products, or, too wide for that, an adapter's
  // slice of it once for its two products; under LoRA a projection's input once for it and its
  // adapters' products. Each copy is at most kHeldWidenedElements: a wider operand is widened per
  // product, as without these.
  void held_widened(DecoderLayout& d) {
    if (!bf_ || !kernels::widens_bf16_products(backend_of(options_))) return;
    const int32_t backward_first = t_.backward(L_ - 1), backward_last = t_.backward(0);
    auto held = [&](const std::vector<int64_t>& widths) {
      int64_t most = 0;
      for (int64_t w : widths)
        if (N_ * w <= kHeldWidenedElements) most = std::max(most, N_ * w);
      return most;
    };
    std::vector<int64_t> grads = adapter_.outputs;
    grads.insert(grads.end(), adapter_.projection_outputs.begin(), adapter_.projection_outputs.end());
    if (!adapter_.enabled())
      for (LinearSlot slot : {LinearSlot::Qkv, LinearSlot::O, LinearSlot::GateUp, LinearSlot::Down})
        grads.push_back(slot_width(c_, slot));
    if (const int64_t in = held(adapter_.inputs))
      d.lora_held_input = add("lora.input (widened once: no bf16 matmul on this CPU)", Cat::Workspace, in, f32,
                              t_.forward(0), backward_last);
    if (const int64_t out = held(grads))
      d.held_grad = add("grad.output (widened once: no bf16 matmul on this CPU)", Cat::Workspace, out, f32,
                        backward_first, backward_last);
  }

  const ModelConfig& c_;
  const ParamStore& params_;
  const AdapterShape& adapter_;
  const Precision precision_;
  const DecoderOptions& options_;
  MemoryPlan& plan_;
  const StepTimeline t_;
  const bool bf_;
  const int64_t max_batch_, max_seq_, N_, H_, I_, Q_, QKV_, L_;
  const int32_t end_;
};

}  // namespace

DecoderLayout describe_memory(const ModelConfig& c, const ParamStore& params, const AdapterShape& adapter,
                              const std::vector<GradGroup>& grad_groups, const std::vector<WeightGather>& gathers,
                              Precision precision, int64_t max_batch, int64_t max_seq, const DecoderOptions& options,
                              MemoryPlan& plan) {
  MemoryDescription describe(c, params, adapter, precision, max_batch, max_seq, options, plan);
  DecoderLayout d;
  describe.weights(d, gathers);
  describe.training_state(d, grad_groups);
  describe.activations(d);
  describe.head_and_gradients(d);
  describe.scratch(d);
  return d;
}

DecoderOptions resolve_checkpointing_layers(const ModelConfig& config, Precision precision, int64_t max_batch,
                                            int64_t max_seq, DecoderOptions options) {
  check_arguments(config, max_batch, max_seq, options);
  if (!options.gradient_checkpointing || options.checkpointing_layers != 0 || config.num_layers < 2) return options;
  DecoderOptions every = options, all_but_last = options;
  every.checkpointing_layers = config.num_layers;
  all_but_last.checkpointing_layers = config.num_layers - 1;
  const bool keep_last = plan_decoder(config, precision, max_batch, max_seq, all_but_last).total_bytes() <=
                         plan_decoder(config, precision, max_batch, max_seq, every).total_bytes();
  return keep_last ? all_but_last : every;
}

MemoryPlan decoder_memory_plan(const ModelConfig& config, Precision precision, int64_t max_batch, int64_t max_seq,
                               const DecoderOptions& options) {
  return plan_decoder(config, precision, max_batch, max_seq,
                      resolve_checkpointing_layers(config, precision, max_batch, max_seq, options));
}

void declare_model_params(const ModelConfig& config, ParamStore& params, DecoderParamIds& ids) {
  declare_params(config, params, ids);
}

int64_t four_bit_setup_scratch_elements(const ModelConfig& config, const DecoderOptions& options, bool from_files,
                                        bool fused_experts) {
  // A checkpoint bitsandbytes saved in 4 bits is copied as it is: no tensor passes through fp32.
  if (!options.four_bit_base || (from_files && config.saved_four_bit)) return 0;
  ParamStore params;
  DecoderParamIds ids;
  declare_params(config, params, ids, {ParamStorage::Master, ParamStorage::FourBit});
  int64_t most = 0;
  // The checkpoint's tensors: in the published layout an expert's gate, up or down on its own; in
  // transformers 5's fused one every expert's gate_up (or down) of a layer in one tensor.
  if (from_files) {
    for (const auto& t : hf_tensors(config, ids, fused_experts ? ExpertLayout::Fused : ExpertLayout::PerExpert))
      if (params.param(t.param).storage == ParamStorage::FourBit) most = std::max(most, t.rows * t.cols);
    return most;
  }
  for (const auto& p : params.params())
    if (p.storage == ParamStorage::FourBit) most = std::max(most, p.numel);
  // A random initialisation draws a piece at a time (Decoder::init_random), but under ZeRO-3 each
  // tensor is quantized whole.
  return options.shard_weights ? most : std::min(most, kInitPieceElements);
}

}  // namespace keel::model
