#include "keel/model/hf_weights.h"

#include <algorithm>
#include <charconv>
#include <set>

#include "keel/core/error.h"
#include "keel/core/file_io.h"
#include "keel/formats/bnb_4bit.h"

namespace keel::model {

// The file formats this reads and writes (formats/).
using formats::CheckpointReader;
using formats::TensorToWrite;
using formats::write_model_weights;
using formats::is_bnb_4bit;
using formats::bnb_4bit_parts;
using formats::read_bnb_4bit_dequantized;
using formats::read_bnb_4bit;
namespace {

struct Names {
  std::string embed, final_norm, lm_head, layer_prefix;
};

Names family_names(Family f) {
  if (f == Family::GlmOriginal)
    return {"transformer.embedding.word_embeddings.weight", "transformer.encoder.final_layernorm.weight",
            "transformer.output_layer.weight", "transformer.encoder.layers."};
  return {"model.embed_tokens.weight", "model.norm.weight", "lm_head.weight", "model.layers."};
}

// "3.rest" -> 3, s left at "rest"; nullopt without a number and a dot.
std::optional<int64_t> leading_number(std::string_view& s) {
  int64_t n = -1;
  const auto [end, ec] = std::from_chars(s.data(), s.data() + s.size(), n);
  if (ec != std::errc() || end == s.data() + s.size() || *end != '.') return std::nullopt;
  s.remove_prefix(size_t(end - s.data()) + 1);
  return n;
}

}  // namespace

std::optional<ExpertTensorName> parse_expert_tensor_name(Family family, std::string_view name) {
  constexpr std::string_view kLayers = "model.layers.";
  if (!name.starts_with(kLayers)) return std::nullopt;
  name.remove_prefix(kLayers.size());
  ExpertTensorName e;
  const auto layer = leading_number(name);
  if (!layer) return std::nullopt;
  e.layer = *layer;
  if (name == "mlp.experts.gate_up_proj" || name == "mlp.experts.down_proj") {
    e.projection = name.ends_with("gate_up_proj") ? ExpertProjection::GateUp : ExpertProjection::Down;
    return e;
  }
  const PublishedExpertNames names = published_expert_names(family);
  constexpr std::string_view kExperts = "experts.";
  if (!name.starts_with(names.block)) return std::nullopt;
  name.remove_prefix(names.block.size());
  if (!name.starts_with(kExperts)) return std::nullopt;
  name.remove_prefix(kExperts.size());
  const auto expert = leading_number(name);
  if (!expert) return std::nullopt;
  e.expert = *expert;
  const std::pair<std::string_view, ExpertProjection> projections[] = {
      {names.gate, ExpertProjection::Gate}, {names.up, ExpertProjection::Up}, {names.down, ExpertProjection::Down}};
  for (const auto& [suffix, projection] : projections)
    if (name == suffix) {
      e.projection = projection;
      return e;
    }
  return std::nullopt;
}

std::vector<HfTensor> hf_tensors(const ModelConfig& c, const DecoderParamIds& ids, ExpertLayout layout) {
  const Names names = family_names(c.family);
  const int64_t H = c.hidden_size, I = c.intermediate_size, Q = c.q_size(), KV = c.kv_size();
  std::vector<HfTensor> out;
  out.push_back({names.embed, ids.embed, 0, c.vocab_size, H});
  for (int64_t l = 0; l < c.num_layers; ++l) {
    const auto& p = ids.layers[l];
    const std::string pre = names.layer_prefix + std::to_string(l) + ".";
    out.push_back({pre + "input_layernorm.weight", p.input_norm, 0, H, 0});
    if (c.family == Family::GlmOriginal) {
      out.push_back({pre + "self_attention.query_key_value.weight", p.qkv_weight, 0, Q + 2 * KV, H});
      if (p.qkv_bias >= 0) out.push_back({pre + "self_attention.query_key_value.bias", p.qkv_bias, 0, Q + 2 * KV, 0});
      out.push_back({pre + "self_attention.dense.weight", p.o_weight, 0, H, Q});
      out.push_back({pre + "post_attention_layernorm.weight", p.post_norm, 0, H, 0});
      out.push_back({pre + "mlp.dense_h_to_4h.weight", p.gate_up_weight, 0, 2 * I, H});
      out.push_back({pre + "mlp.dense_4h_to_h.weight", p.down_weight, 0, H, I});
      continue;
    }
    const int64_t row[3] = {0, Q, Q + KV}, rows[3] = {Q, KV, KV};
    const char* proj[3] = {"q_proj", "k_proj", "v_proj"};
    for (int i = 0; i < 3; ++i) {
      out.push_back({pre + "self_attn." + proj[i] + ".weight", p.qkv_weight, row[i], rows[i], H});
      if (p.qkv_bias >= 0) out.push_back({pre + "self_attn." + proj[i] + ".bias", p.qkv_bias, row[i], rows[i], 0});
    }
    if (p.q_norm >= 0) {
      out.push_back({pre + "self_attn.q_norm.weight", p.q_norm, 0, c.head_dim, 0});
      out.push_back({pre + "self_attn.k_norm.weight", p.k_norm, 0, c.head_dim, 0});
    }
    out.push_back({pre + "self_attn.o_proj.weight", p.o_weight, 0, H, Q});
    if (p.attn_out_norm >= 0) {  // Gemma: post_attention_layernorm is on the attention's output
      out.push_back({pre + "post_attention_layernorm.weight", p.attn_out_norm, 0, H, 0});
      out.push_back({pre + "pre_feedforward_layernorm.weight", p.post_norm, 0, H, 0});
      out.push_back({pre + "post_feedforward_layernorm.weight", p.mlp_out_norm, 0, H, 0});
    } else {
      out.push_back({pre + "post_attention_layernorm.weight", p.post_norm, 0, H, 0});
    }
    if (c.sparse_layer(l)) {  // the router (gate), then the experts
      const int64_t E = c.moe.experts, IM = c.moe.intermediate_size, IS = c.moe.shared_intermediate_size;
      // transformers 5's fused layout names every family's block mlp (its router too).
      const PublishedExpertNames names = published_expert_names(c.family);
      const std::string block = pre + std::string(layout == ExpertLayout::PerExpert ? names.block : "mlp.");
      out.push_back({block + "gate.weight", p.router, 0, E, H});
      // GLM-4.5's router buffer, saved with the model by transformers (a persistent nn.Buffer).
      if (p.router_bias >= 0) out.push_back({block + "gate.e_score_correction_bias", p.router_bias, 0, E, 0});
      if (layout == ExpertLayout::Fused) {  // transformers 5's in-memory names, every family's
        out.push_back({pre + "mlp.experts.gate_up_proj", p.experts_gate_up, 0, E * 2 * IM, H, E});
        out.push_back({pre + "mlp.experts.down_proj", p.experts_down, 0, E * H, IM, E});
      } else {
        for (int64_t e = 0; e < E; ++e) {  // the published names (published_expert_names)
          const std::string expert = block + "experts." + std::to_string(e) + ".";
          out.push_back({expert + std::string(names.gate), p.experts_gate_up, e * 2 * IM, IM, H});
          out.push_back({expert + std::string(names.up), p.experts_gate_up, e * 2 * IM + IM, IM, H});
          out.push_back({expert + std::string(names.down), p.experts_down, e * H, H, IM});
        }
      }
      if (p.gate_up_weight >= 0) {  // GLM-4.5's shared experts: one SwiGLU MLP, in both layouts
        const std::string shared = pre + "mlp.shared_experts.";
        out.push_back({shared + "gate_proj.weight", p.gate_up_weight, 0, IS, H});
        out.push_back({shared + "up_proj.weight", p.gate_up_weight, IS, IS, H});
        out.push_back({shared + "down_proj.weight", p.down_weight, 0, H, IS});
      }
      continue;
    }
    if (c.family == Family::Glm) {
      out.push_back({pre + "mlp.gate_up_proj.weight", p.gate_up_weight, 0, 2 * I, H});
    } else {
      out.push_back({pre + "mlp.gate_proj.weight", p.gate_up_weight, 0, I, H});
      out.push_back({pre + "mlp.up_proj.weight", p.gate_up_weight, I, I, H});
    }
    out.push_back({pre + "mlp.down_proj.weight", p.down_weight, 0, H, I});
  }
  out.push_back({names.final_norm, ids.final_norm, 0, H, 0});
  if (!c.tie_word_embeddings) out.push_back({names.lm_head, ids.lm_head, 0, c.vocab_size, H});
  return out;
}

namespace {

// Buffers transformers keeps in some older checkpoints that carry no trainable state.
bool is_ignorable(const std::string& name) {
  return name.find("rotary_emb.inv_freq") != std::string::npos ||
         name.find("rotary_pos_emb.inv_freq") != std::string::npos;
}

}  // namespace

ExpertLayout checkpoint_expert_layout(const CheckpointReader& reader, const ModelConfig& c) {
  for (int64_t l = 0; l < c.num_layers; ++l)
    if (c.sparse_layer(l))
      return reader.has("model.layers." + std::to_string(l) + ".mlp.experts.gate_up_proj") ? ExpertLayout::Fused
                                                                                             : ExpertLayout::PerExpert;
  return ExpertLayout::PerExpert;
}

std::vector<std::string> load_hf_weights(Decoder& decoder, const std::string& dir, WorkProgress* progress) {
  auto reader = CheckpointReader::open_dir(dir);
  const auto tensors = hf_tensors(decoder.config(), decoder.ids(), checkpoint_expert_layout(reader, decoder.config()));
  auto& P = decoder.params();
  std::set<std::string> used;
  double total = 0, done = 0;  // weights, in millions
  for (const auto& t : tensors) total += double(t.rows * (t.cols ? t.cols : 1)) / 1e6;
  for (const auto& t : tensors) {
    const int64_t cols = t.cols ? t.cols : 1;
    if (progress) progress->update("loading " + dir, done, total, "M weights");
    done += double(t.rows * cols) / 1e6;
    const ParamStorage storage = P.param(t.param).storage;
    const int64_t first = t.row_begin * cols, n = t.rows * cols;
    // A checkpoint bitsandbytes saved in 4 bits: QLoRA copies the codes as they are; a decoder
    // holding full-precision weights (generation, a merged export) gets them dequantized.
    const auto& saved = decoder.config().saved_four_bit;
    if (saved && (storage == ParamStorage::FourBit || is_bnb_4bit(reader, t.name))) {
      if (storage == ParamStorage::FourBit && P.sharded_weights()) {  // ZeRO-3: this rank keeps its part
        std::vector<uint8_t> packed(static_cast<size_t>(n / 2));
        std::vector<float> absmax(static_cast<size_t>(n / kFourBitBlockSize));
        read_bnb_4bit(reader, t.name, t.shape(), saved->type, packed.data(), absmax.data());
        P.write_four_bit(t.param, first, n, packed.data(), absmax.data());
      } else if (storage == ParamStorage::FourBit) {
        const auto slot = P.four_bit_slot(t.param, first, n);
        read_bnb_4bit(reader, t.name, t.shape(), saved->type, slot.packed, slot.absmax);
      } else {
        const bool in_place = storage == ParamStorage::Master && !P.sharded_weights();
        std::vector<float> values(static_cast<size_t>(in_place ? 0 : n));
        float* out = in_place ? P.weight(t.param) + first : values.data();
        read_bnb_4bit_dequantized(reader, t.name, t.shape(), saved->type, out);
        if (storage == ParamStorage::Master && !in_place) decoder.write_weights(t.param, first, values.data(), n);
        if (storage == ParamStorage::Bf16) {
          std::vector<bf16> rounded(static_cast<size_t>(n));
          convert_f32_to_bf16(values.data(), rounded.data(), size_t(n));
          decoder.write_weights(t.param, first, rounded.data(), n);
        }
      }
      for (auto& part : bnb_4bit_parts(reader, t.name)) used.insert(std::move(part));
      used.insert(t.name);
      continue;
    }
    switch (storage) {
      case ParamStorage::Master:
        if (P.sharded_weights()) {  // ZeRO-3: the tensor passes through memory, this rank keeps its part
          std::vector<float> values(static_cast<size_t>(n));
          reader.read_f32(t.name, t.shape(), values.data());
          decoder.write_weights(t.param, first, values.data(), n);
        } else {
          reader.read_f32(t.name, t.shape(), P.weight(t.param) + first);
        }
        break;
      case ParamStorage::Bf16:  // a frozen bf16 matrix: straight into bf16, no fp32 copy on the way
        if (P.sharded_weights()) {  // ZeRO-3 (LoRA's base): the tensor passes through memory, this rank keeps its part
          std::vector<bf16> values(static_cast<size_t>(n));
          reader.read_bf16(t.name, t.shape(), values.data());
          decoder.write_weights(t.param, first, values.data(), n);
        } else {
          reader.read_bf16(t.name, t.shape(), P.weight_bf16(t.param) + first);
        }
        break;
      case ParamStorage::FourBit: {  // QLoRA: quantized tensor by tensor, one fp32 tensor in memory at a time
        std::vector<float> values(static_cast<size_t>(n));
        reader.read_f32(t.name, t.shape(), values.data());
        P.store_four_bit(t.param, first, values.data(), n, decoder.options().double_quantization);
        break;
      }
    }
    used.insert(t.name);
  }
  // GLM-4.5's multi-token-prediction layers (model.layers.{num_layers ...}) are not part of the
  // model transformers builds, which skips their tensors on load; so does keel (the trainer's
  // banner says so), rather than warning about each of them.
  const ModelConfig& c = decoder.config();
  std::vector<std::string> unused;
  for (const auto& name : reader.names())
    if (!used.count(name) && !is_ignorable(name) && !c.next_token_prediction_tensor(name)) unused.push_back(name);
  P.refresh_bf16_copy();
  return unused;
}

namespace {

// The model's weights as save_hf_model writes them: every matrix in full precision (LoRA and
// QLoRA hold theirs in bf16 or 4 bits only).
const ParamStore& full_precision_params(const Decoder& decoder) {
  const auto& P = decoder.params();
  require(P.compute_only_total() == 0 && P.four_bit_total() == 0,
          "save_hf_model: the model's matrices are held in bf16 or 4 bits only (LoRA, QLoRA); export the adapter, or "
          "merge it with keel export --merge");
  return P;
}

// The weight files (write_model_weights makes the directory), then config.json.
void write_hf_model(const Decoder& decoder, const std::string& dir, DType dtype,
                    const std::vector<TensorToWrite>& tensors, uint64_t max_shard_bytes, WorkProgress* progress) {
  write_model_weights(dir, tensors, dtype, max_shard_bytes, progress);
  write_file_atomic(dir + "/config.json", model_config_json(decoder.config(), dtype));
}

}  // namespace

std::vector<TensorToWrite> hf_weight_tensors(const Decoder& decoder) {
  const auto& P = full_precision_params(decoder);
  std::vector<TensorToWrite> out;
  for (const auto& t : hf_tensors(decoder.config(), decoder.ids())) {
    const int64_t cols = t.cols ? t.cols : 1;
    out.push_back({t.name, t.shape(), P.weight(t.param) + t.row_begin * cols});
  }
  return out;
}

void save_hf_model(const Decoder& decoder, const std::string& dir, DType dtype, uint64_t max_shard_bytes,
                   WorkProgress* progress) {
  write_hf_model(decoder, dir, dtype, hf_weight_tensors(decoder), max_shard_bytes, progress);
}

void save_hf_model_streamed(const Decoder& decoder, const std::string& dir, DType dtype,
                            const FlatWeightStream& weights, uint64_t max_shard_bytes) {
  const auto& P = full_precision_params(decoder);
  struct Placed {
    int64_t flat_begin;
    HfTensor tensor;
  };
  std::vector<Placed> placed;
  for (auto& t : hf_tensors(decoder.config(), decoder.ids()))
    placed.push_back({P.param(t.param).offset + t.row_begin * (t.cols ? t.cols : 1), std::move(t)});
  // The stream only goes forward, and transformers' order is not the flat buffer's (Qwen2's q, k
  // and v biases sit between their weights' row blocks; Gemma's post-feedforward norm comes before
  // the MLP): the file takes the tensors in the flat buffer's order (a safetensors header says
  // where each one is).
  std::stable_sort(placed.begin(), placed.end(),
                   [](const Placed& a, const Placed& b) { return a.flat_begin < b.flat_begin; });
  std::vector<TensorToWrite> out;
  for (const auto& [flat_begin, t] : placed)
    out.push_back(
        {t.name, t.shape(), TensorToWrite::Reader([&weights, flat_begin](int64_t begin, int64_t max_count, int64_t* n) {
           return weights(flat_begin + begin, max_count, n);
         })});
  write_hf_model(decoder, dir, dtype, out, max_shard_bytes, nullptr);
}

}  // namespace keel::model
