#include "keel/checkpoint/gguf_tokenizer.h"

#include <fmt/format.h>
#include <fmt/ostream.h>

#include <cmath>
#include <filesystem>

#include "keel/core/error.h"
#include "keel/core/file_io.h"
#include "keel/data/hf_tokenizer_json.h"
#include "keel/data/llama_cpp_vocab_hf.h"
#include "keel/model/gguf_config.h"

namespace keel::checkpoint {
namespace {

// SpecialVocab's token types, in the order it writes them.
constexpr const char* kSpecialTypes[] = {"bos", "eos", "unk", "sep", "pad", "mask"};

std::vector<std::string> strings_of(const formats::GgufFile& file, const std::string& key) {
  const auto* e = file.find(key);
  if (!e) return {};
  require(e->is_array() && e->element == formats::GgufValueType::String, "{}: {}: expected an array of strings",
          file.path(), key);
  return e->strings;
}

std::vector<int32_t> integers_of(const formats::GgufFile& file, const std::string& key) {
  const auto* e = file.find(key);
  if (!e) return {};
  require(e->is_array() && e->element != formats::GgufValueType::String && e->element != formats::GgufValueType::Array,
          "{}: {}: expected an array of integers", file.path(), key);
  std::vector<int32_t> out;
  out.reserve(e->numbers.size());
  for (double x : e->numbers) {
    require(x == std::floor(x) && std::abs(x) < 2147483648.0, "{}: {}: expected an array of integers, found {}",
            file.path(), key, x);
    out.push_back(int32_t(x));
  }
  return out;
}

std::vector<float> floats_of(const formats::GgufFile& file, const std::string& key) {
  const auto* e = file.find(key);
  if (!e) return {};
  require(e->is_array() && e->element != formats::GgufValueType::String && e->element != formats::GgufValueType::Array,
          "{}: {}: expected an array of numbers", file.path(), key);
  return std::vector<float>(e->numbers.begin(), e->numbers.end());
}

}  // namespace

std::string gguf_architecture_of(const formats::GgufFile& file) {
  return file.string_value("general.architecture").value_or("");
}

std::optional<std::string> gguf_special_id_key(const std::string& type) {
  if (type == "bos") return "tokenizer.ggml.bos_token_id";
  if (type == "eos") return "tokenizer.ggml.eos_token_id";
  if (type == "unk") return "tokenizer.ggml.unknown_token_id";
  if (type == "sep") return "tokenizer.ggml.seperator_token_id";  // sic: llama.cpp's spelling
  if (type == "pad") return "tokenizer.ggml.padding_token_id";
  if (type == "mask") return "tokenizer.ggml.mask_token_id";
  if (type == "eot") return "tokenizer.ggml.eot_token_id";  // GLM-4's <|user|> (ChatGLMModel.set_vocab)
  if (type == "eom") return "tokenizer.ggml.eom_token_id";  // GLM-4.5's <|observation|> (_set_vocab_glm)
  return std::nullopt;
}

data::LlamaCppVocab read_gguf_vocab(const formats::GgufFile& file) {
  data::LlamaCppVocab v;
  const auto model = file.string_value("tokenizer.ggml.model");
  require(model.has_value(), "{}: metadata key 'tokenizer.ggml.model' is missing: the file carries no tokenizer "
          "(give one with `tokenizer` in the recipe)", file.path());
  v.model = *model;
  v.pre = file.string_value("tokenizer.ggml.pre").value_or("default");  // llama.cpp's name when the key is absent
  v.tokens = strings_of(file, "tokenizer.ggml.tokens");
  v.scores = floats_of(file, "tokenizer.ggml.scores");
  v.token_types = integers_of(file, "tokenizer.ggml.token_type");
  v.merges = strings_of(file, "tokenizer.ggml.merges");
  for (const char* type : kSpecialTypes)
    if (auto id = file.integer_value(*gguf_special_id_key(type))) v.special_ids.emplace_back(type, *id);
  for (const char* type : {"bos", "eos", "sep"})
    if (auto add = file.bool_value(fmt::format("tokenizer.ggml.add_{}_token", type)))
      v.add_special.emplace_back(type, *add);
  v.chat_template = file.string_value("tokenizer.chat_template");
  v.add_prefix_space = file.bool_value("tokenizer.ggml.add_space_prefix");
  return v;
}

data::Tokenizer gguf_tokenizer(const std::string& gguf_path) {
  const formats::GgufFile file(gguf_path);
  const auto files = data::hf_tokenizer_files(read_gguf_vocab(file), gguf_path, gguf_architecture_of(file));
  return data::hf_tokenizer_from_json(files.tokenizer_json, gguf_path, files.tokenizer_config_json);
}

void write_gguf_tokenizer_dir(const std::string& gguf_path, const std::string& dir, std::ostream* log) {
  const formats::GgufFile file(gguf_path);
  const data::LlamaCppVocab vocab = read_gguf_vocab(file);
  const data::HfTokenizerFiles files = data::hf_tokenizer_files(vocab, gguf_path, gguf_architecture_of(file));
  make_dirs(dir);
  write_file_atomic(dir + "/tokenizer.json", files.tokenizer_json);
  write_file_atomic(dir + "/tokenizer_config.json", files.tokenizer_config_json);
  const std::string template_path = dir + "/chat_template.jinja";
  if (files.chat_template)
    write_file_atomic(template_path, *files.chat_template);
  else if (path_exists(template_path))
    std::filesystem::remove(template_path);  // left by a run from another file
  if (!log) return;
  const std::string kind = fmt::format("{}, {} tokens, {}",
                                       vocab.model == "llama" ? "SentencePiece (\"llama\")" : vocab.model + " BPE",
                                       vocab.tokens.size(), files.merges);
  fmt::print(*log, "keel: tokenizer from GGUF file {}: {}, pre-tokenizer {}, {}; written to {}\n", gguf_path, kind,
             files.pre_tokenizer, files.chat_template ? "its chat template" : "no chat template", dir);
  for (const auto& note : files.notes) fmt::print(*log, "keel: note: {}\n", note);
}

void prepare_recipe_gguf_tokenizer(const recipe::Recipe& r, std::ostream* log) {
  if (r.model_config || !r.tokenizer.empty() || !model::is_gguf_path(r.model_name)) return;
  write_gguf_tokenizer_dir(r.model_name, recipe::recipe_tokenizer_path(r), log);
}

}  // namespace keel::checkpoint
