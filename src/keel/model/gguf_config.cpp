#include "keel/model/gguf_config.h"

#include <string_view>
#include <utility>

#include "keel/core/error.h"

namespace keel::model {
namespace {

// The GGUF architectures keel trains from, and the family each is (gguf_architecture's inverse:
// Mistral's files are "llama", and train as Llama, which they are but for the sliding window the
// file does not carry).
constexpr std::pair<std::string_view, Family> kArchitectures[] = {
    {"llama", Family::Llama},
    {"qwen2", Family::Qwen2},
    {"qwen3", Family::Qwen3},
};

const formats::GgufTensorInfo* find_tensor(const formats::GgufFile& file, std::string_view name) {
  for (const auto& t : file.tensors())
    if (t.name == name) return &t;
  return nullptr;
}

int64_t positive(const formats::GgufFile& file, const std::string& key, std::optional<int64_t> fallback = {}) {
  const auto v = file.integer_value(key);
  require(v || fallback, "{}: metadata key '{}' is missing (llama.cpp's converter writes it for every model)",
          file.path(), key);
  const int64_t value = v ? *v : *fallback;
  require(value > 0, "{}: {}: expected a positive integer, found {}", file.path(), key, value);
  return value;
}

}  // namespace

std::string gguf_readable_architectures() {
  std::string out;
  for (const auto& [name, family] : kArchitectures) out += (out.empty() ? "" : ", ") + std::string(name);
  return out;
}

bool is_gguf_path(const std::string& path) { return std::string_view(path).ends_with(".gguf"); }

ModelConfig gguf_model_config(const formats::GgufFile& file) {
  const auto arch = file.string_value("general.architecture");
  require(arch.has_value(), "{}: metadata key 'general.architecture' is missing: not a model file", file.path());
  require(file.string_value("general.type").value_or("model") == "model",
          "{}: general.type is '{}': a {} file, not a model (train from the base model's file; a LoRA adapter "
          "GGUF is for llama.cpp's --lora)",
          file.path(), *file.string_value("general.type"), *file.string_value("general.type"));
  ModelConfig c;
  bool known = false;
  for (const auto& [name, family] : kArchitectures)
    if (*arch == name) c.family = family, known = true;
  require(known, "{}: general.architecture '{}': keel trains GGUF files of the architectures {} (convert the model "
          "to a Hugging Face directory with transformers' from_pretrained(dir, gguf_file=...) and save_pretrained "
          "for another family keel trains)",
          file.path(), *arch, gguf_readable_architectures());
  const std::string k = *arch + ".";
  c.hidden_size = positive(file, k + "embedding_length");
  c.num_layers = positive(file, k + "block_count");
  c.intermediate_size = positive(file, k + "feed_forward_length");
  c.num_heads = positive(file, k + "attention.head_count");
  c.num_kv_heads = positive(file, k + "attention.head_count_kv", c.num_heads);
  c.head_dim = positive(file, k + "attention.key_length", c.hidden_size / c.num_heads);
  const int64_t value_length = positive(file, k + "attention.value_length", c.head_dim);
  require(value_length == c.head_dim, "{}: {}attention.value_length {} differs from key_length {}: keel's attention "
          "has one head size", file.path(), k, value_length, c.head_dim);
  c.max_position_embeddings = positive(file, k + "context_length");
  // llama.cpp's defaults where the converter left the key out (llama-model.cpp).
  c.rope_theta = file.number_value(k + "rope.freq_base").value_or(10000.0);
  const auto eps = file.number_value(k + "attention.layer_norm_rms_epsilon");
  require(eps.has_value() && *eps > 0, "{}: metadata key '{}attention.layer_norm_rms_epsilon' is missing or not "
          "positive", file.path(), k);
  c.rms_norm_eps = *eps;
  // Anything that would make RoPE differ from the plain one keel computes: said, not trained past.
  const auto scaling = file.string_value(k + "rope.scaling.type");
  require(!scaling || *scaling == "none",
          "{}: {}rope.scaling.type is '{}': keel trains GGUF models with plain RoPE only", file.path(), k,
          scaling.value_or(""));
  require(!find_tensor(file, "rope_freqs.weight"),
          "{}: tensor 'rope_freqs.weight' (Llama 3.1-style RoPE frequency factors): keel trains GGUF models with "
          "plain RoPE only",
          file.path());
  const auto* embedding = find_tensor(file, "token_embd.weight");
  require(embedding && embedding->shape.size() == 2,
          "{}: tensor 'token_embd.weight' is missing or not a matrix: not a model file", file.path());
  c.vocab_size = embedding->shape[0];
  require(embedding->shape[1] == c.hidden_size, "{}: token_embd.weight has {} columns, {}embedding_length is {}",
          file.path(), embedding->shape[1], k, c.hidden_size);
  c.tie_word_embeddings = !find_tensor(file, "output.weight");  // the converter drops a tied head
  const auto id = [&](std::string_view which) {
    return file.integer_value("tokenizer.ggml." + std::string(which) + "_token_id").value_or(-1);
  };
  c.bos_token_id = id("bos");
  c.pad_token_id = id("padding");
  if (id("eos") >= 0) c.eos_token_ids = {id("eos")};
  c.torch_dtype = DType::F32;  // dequantized to fp32 at load, as transformers does
  apply_family_traits(c);
  validate(c, file.path());
  c.config_json = model_config_json(c, DType::F32);
  return c;
}

}  // namespace keel::model
