#include "keel/data/llama_cpp_vocab_hf.h"

#include <fmt/format.h>

#include <map>
#include <string_view>
#include <unordered_map>
#include <utility>

#include "keel/core/error.h"
#include "keel/core/json_text.h"
#include "keel/data/byte_level.h"
#include "keel/data/pretokenizer.h"

namespace keel::data {
namespace {

// transformers' GGUF_PRE_TOKENIZER_SPLITS: tokenizer.ggml.pre -> the Split regex (keel's named
// pattern where it is the same text: Llama 3's is cl100k's, GPT-4o's o200k's).
constexpr std::string_view kTekken =
    R"([^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+)";
constexpr std::string_view kQwen35 =
    R"((?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+)";

struct PreSplit {
  std::string_view gguf_name, pattern_name, literal;  // literal when keel has no name for the pattern
};
constexpr PreSplit kPreSplits[] = {
    {"llama3", "cl100k", {}},  {"llama-v3", "cl100k", {}},  {"llama-bpe", "cl100k", {}},
    {"falcon3", "cl100k", {}}, {"falcon-h1", "cl100k", {}}, {"pixtral", "cl100k", {}},
    {"midm-2.0", "cl100k", {}}, {"lfm2", "cl100k", {}},     {"jina-v5-nano", "cl100k", {}},
    {"dbrx", "cl100k", {}},    {"smaug-bpe", "cl100k", {}}, {"tekken", {}, kTekken},
    {"qwen2", "qwen2", {}},    {"deepseek-r1-qwen", "qwen2", {}}, {"kormo", "qwen2", {}},
    {"f2llmv2", "qwen2", {}},  {"megrez", "qwen2", {}},     {"qwen35", {}, kQwen35},
    {"gpt-4o", "o200k", {}},   {"llama4", "o200k", {}},     {"kanana2", "o200k", {}},
    {"talkie", "o200k", {}},   {"minimax-m2", "o200k", {}},
};

// The token as tokenizer.json's vocabulary spells it (byte_level_tokenizer): as the file has it
// when every character is one of the byte alphabet's, else its UTF-8 bytes respelled.
std::string vocab_spelling(const std::string& token) {
  std::string bytes;
  return bytes_from_byte_level(token, bytes) ? token : byte_level_spelling(token);
}

bool in_byte_alphabet(const std::string& token) {
  std::string bytes;
  return bytes_from_byte_level(token, bytes);
}

std::string added_token_json(int64_t id, const std::string& content, bool special) {
  return fmt::format(
      R"({{"id":{},"content":{},"single_word":false,"lstrip":false,"rstrip":false,"normalized":false,"special":{}}})",
      id, json_quoted(content), special ? "true" : "false");
}

}  // namespace

HfTokenizerFiles hf_tokenizer_files(const LlamaCppVocab& v, const std::string& origin) {
  require(v.model == "gpt2",
          "{}: tokenizer.ggml.model is '{}': keel builds byte-level BPE tokenizers (\"gpt2\") from GGUF metadata; "
          "give the model's Hugging Face tokenizer with `tokenizer` in the recipe",
          origin, v.model);
  require(!v.tokens.empty(), "{}: tokenizer.ggml.tokens is missing or empty", origin);
  require(v.token_types.empty() || v.token_types.size() == v.tokens.size(),
          "{}: tokenizer.ggml.token_type has {} entries for {} tokens", origin, v.token_types.size(), v.tokens.size());
  HfTokenizerFiles out;
  const auto type_of = [&](size_t id) { return v.token_types.empty() ? 1 : v.token_types[id]; };
  const auto special_id = [&](std::string_view which) -> std::optional<int64_t> {
    for (const auto& [type, id] : v.special_ids)
      if (type == which && id >= 0 && size_t(id) < v.tokens.size()) return id;
    return std::nullopt;
  };

  // Added tokens, by id: control tokens (in the byte alphabet: one outside it is a mislabel that
  // transformers skips), user-defined ones, then the special tokens its config names.
  std::map<int64_t, bool> added;  // id -> special
  for (size_t id = 0; id < v.tokens.size(); ++id) {
    if (type_of(id) == int32_t(LlamaCppTokenType::Control) && in_byte_alphabet(v.tokens[id])) added[int64_t(id)] = true;
    if (type_of(id) == int32_t(LlamaCppTokenType::UserDefined)) added.emplace(int64_t(id), false);
  }
  for (const char* which : {"bos", "eos", "unk", "pad"})
    if (auto id = special_id(which)) added[*id] = true;

  std::string json = R"({"version":"1.0","truncation":null,"padding":null,"added_tokens":[)";
  bool first = true;
  for (const auto& [id, special] : added) {
    json += (first ? "" : ",") + added_token_json(id, v.tokens[size_t(id)], special);
    first = false;
  }
  json += R"(],"normalizer":null,"pre_tokenizer":)";
  const PreSplit* split = nullptr;
  for (const auto& s : kPreSplits)
    if (s.gguf_name == v.pre) split = &s;
  if (split) {
    const std::string_view pattern = split->pattern_name.empty() ? split->literal : named_pattern(split->pattern_name);
    json += fmt::format(
        R"({{"type":"Sequence","pretokenizers":[{{"type":"Split","pattern":{{"Regex":{}}},"behavior":"Isolated",)"
        R"("invert":false}},{{"type":"ByteLevel","add_prefix_space":false,"trim_offsets":true,"use_regex":false}}]}})",
        json_quoted(pattern));
    out.pre_tokenizer =
        fmt::format("'{}' ({} regex)", v.pre, split->pattern_name.empty() ? split->gguf_name : split->pattern_name);
  } else {
    json += R"({"type":"ByteLevel","add_prefix_space":false,"trim_offsets":true,"use_regex":true})";
    out.pre_tokenizer = fmt::format("'{}' (GPT-2's regex)", v.pre);
    out.notes.push_back(fmt::format(
        "tokenizer.ggml.pre '{}' is not in transformers' table of pre-tokenizers: GPT-2's regex, as transformers' GGUF "
        "loader uses (llama.cpp may split text otherwise)",
        v.pre));
  }
  json += R"(,"post_processor":{"type":"TemplateProcessing","single":[{"Sequence":{"id":"A","type_id":0}}],)"
          R"("pair":[{"Sequence":{"id":"A","type_id":0}},{"Sequence":{"id":"B","type_id":1}}],"special_tokens":{}},)"
          R"("decoder":{"type":"ByteLevel","add_prefix_space":true,"trim_offsets":true,"use_regex":true},)"
          R"("model":{"type":"BPE","dropout":null,"unk_token":null,"continuing_subword_prefix":"","end_of_word_suffix":"",)"
          R"("fuse_unk":false,"byte_fallback":false,"ignore_merges":false,"vocab":{)";
  // {token: id} as Python builds it: a token spelled twice keeps its last id.
  std::unordered_map<std::string, size_t> last_id;
  std::vector<std::string> spelled(v.tokens.size());
  for (size_t id = 0; id < v.tokens.size(); ++id) last_id[spelled[id] = vocab_spelling(v.tokens[id])] = id;
  first = true;
  for (size_t id = 0; id < v.tokens.size(); ++id) {
    if (last_id[spelled[id]] != id) continue;
    json += (first ? "" : ",") + json_quoted(spelled[id]) + ":" + std::to_string(id);
    first = false;
  }
  json += R"(},"merges":[)";
  first = true;
  for (const auto& merge : v.merges) {
    const size_t space = merge.find(' ');
    require(space != std::string::npos && merge.find(' ', space + 1) == std::string::npos,
            "{}: tokenizer.ggml.merges: expected \"left right\", found {:?}", origin, merge);
    json += fmt::format("{}[{},{}]", first ? "" : ",", json_quoted(merge.substr(0, space)),
                        json_quoted(merge.substr(space + 1)));
    first = false;
  }
  json += "]}}";
  out.tokenizer_json = std::move(json);

  std::string config = R"({"tokenizer_class":"PreTrainedTokenizerFast")";
  for (const auto& [which, key] : {std::pair{"bos", "bos_token"}, {"eos", "eos_token"}, {"pad", "pad_token"},
                                   {"unk", "unk_token"}}) {
    const auto id = special_id(which);
    config += fmt::format(",\"{}\":{}", key, id ? json_quoted(v.tokens[size_t(*id)]) : "null");
  }
  config += "}";
  out.tokenizer_config_json = std::move(config);
  out.chat_template = v.chat_template;
  for (const auto& [type, add] : v.add_special)
    if (add && (type == "bos" || type == "eos"))
      out.notes.push_back(fmt::format(
          "tokenizer.ggml.add_{}_token is true, but the tokenizer adds no {} to a text, as transformers' GGUF loader "
          "builds it (a chat template that writes {}_token still has it)",
          type, type == "bos" ? "BOS" : "EOS", type));
  return out;
}

}  // namespace keel::data
