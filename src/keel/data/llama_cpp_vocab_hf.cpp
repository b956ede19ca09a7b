#include "keel/data/llama_cpp_vocab_hf.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
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
    // Not transformers' (its GGUF loader reads no GLM architecture, so it has no entry for them):
    // llama.cpp's own regex for GLM-4's names (LLAMA_VOCAB_PRE_TYPE_CHATGLM4), GLM-4's tokenizer.json one.
    {"glm4", "glm4", {}},      {"chatglm-bpe", "glm4", {}},
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


// A token's code points, as Python's str indexes them (a lead byte's length, clamped to the end).
std::vector<std::string_view> code_points(std::string_view token) {
  std::vector<std::string_view> out;
  for (size_t at = 0; at < token.size();) {
    const size_t n = std::min(utf8_length(static_cast<unsigned char>(token[at])), token.size() - at);
    out.push_back(token.substr(at, n));
    at += n;
  }
  return out;
}

// Python's str.isspace for one code point.
bool is_space(std::string_view cp) {
  static constexpr std::string_view kSpaces[] = {
      " ", "\t", "\n", "\v", "\f", "\r", "\x1c", "\x1d", "\x1e", "\x1f", "\xc2\x85", "\xc2\xa0", "\xe1\x9a\x80",
      "\xe2\x80\x80", "\xe2\x80\x81", "\xe2\x80\x82", "\xe2\x80\x83", "\xe2\x80\x84", "\xe2\x80\x85", "\xe2\x80\x86",
      "\xe2\x80\x87", "\xe2\x80\x88", "\xe2\x80\x89", "\xe2\x80\x8a", "\xe2\x80\xa8", "\xe2\x80\xa9", "\xe2\x80\xaf",
      "\xe2\x81\x9f", "\xe3\x80\x80"};
  for (std::string_view s : kSpaces)
    if (cp == s) return true;
  return false;
}

// transformers' generate_merges(vocab, vocab_scores) (tokenization_utils_base.py): every way to
// cut a token in two known tokens, each token's cuts by the pieces' ids, all of them sorted by the
// token's score (then the pieces' lengths in code points), best first, stably.
std::vector<std::pair<std::string, std::string>> generate_merges(
    const std::vector<std::string>& order, const std::unordered_map<std::string, int64_t>& vocab,
    const std::unordered_map<std::string, double>& scores) {
  struct Merge {
    std::string_view left, right;
    double score;
    size_t left_length, right_length;
  };
  std::vector<Merge> merges;
  std::vector<Merge> local;
  for (const std::string& token : order) {
    const double score = scores.at(token);
    const auto cps = code_points(token);
    local.clear();
    size_t offset = 0;
    for (size_t i = 1; i < cps.size(); ++i) {
      offset += cps[i - 1].size();
      const std::string left = token.substr(0, offset), right = token.substr(offset);
      const auto l = vocab.find(left), r = vocab.find(right);
      if (l != vocab.end() && r != vocab.end())
        local.push_back({l->first, r->first, score, i, cps.size() - i});
    }
    std::stable_sort(local.begin(), local.end(), [&](const Merge& a, const Merge& b) {
      const int64_t al = vocab.at(std::string(a.left)), bl = vocab.at(std::string(b.left));
      if (al != bl) return al < bl;
      return vocab.at(std::string(a.right)) < vocab.at(std::string(b.right));
    });
    merges.insert(merges.end(), local.begin(), local.end());
  }
  // sorted(..., reverse=True) keeps equal keys in their order: a stable sort on the key descending.
  std::stable_sort(merges.begin(), merges.end(), [](const Merge& a, const Merge& b) {
    if (a.score != b.score) return a.score > b.score;
    if (a.left_length != b.left_length) return a.left_length > b.left_length;
    return a.right_length > b.right_length;
  });
  std::vector<std::pair<std::string, std::string>> out;
  out.reserve(merges.size());
  for (const auto& m : merges) out.emplace_back(m.left, m.right);
  return out;
}

// The tokenizer class transformers' GGUF loader makes of a SentencePiece vocabulary ("llama")
// (gguf_tokenizer_mapping.py's select_tokenizer_builder): GemmaTokenizer for gemma/gemma2/gemma3
// files (gemma_tokenizer), LlamaTokenizer for the others (sentencepiece_tokenizer: Llama 2,
// Mistral v0.1, TinyLlama). `named`: the class's special tokens, its __init__ defaults and the
// file's id that replaces each ("" for none).
struct SentencePieceClass {
  std::string_view name;
  bool gemma;
  struct Named {
    std::string_view key, which, fallback;
  };
  std::vector<Named> named;
};

SentencePieceClass sentencepiece_class(const std::string& arch, const std::string& origin) {
  // phi3_tokenizer prefixes U+2581 by a normalizer and splits nothing: a third pipeline, not built here.
  require(arch != "phi3",
          "{}: a SentencePiece vocabulary of architecture 'phi3': keel rebuilds those of Llama-style and Gemma files, "
          "not Phi-3's (its own prefix rule); give the model's Hugging Face tokenizer with `tokenizer` in the recipe",
          origin);
  if (arch == "gemma" || arch == "gemma2" || arch == "gemma3")
    return {"GemmaTokenizer",
            true,
            {{"unk_token", "unk", "<unk>"},
             {"bos_token", "bos", "<bos>"},
             {"eos_token", "eos", "<eos>"},
             {"pad_token", "pad", "<pad>"},
             {"mask_token", "", "<mask>"}}};
  return {"LlamaTokenizer",
          false,
          {{"unk_token", "unk", "<unk>"}, {"bos_token", "bos", "<s>"}, {"eos_token", "eos", "</s>"},
           {"pad_token", "pad", ""}}};
}

// transformers' get_merges: the file's (tokenizer.ggml.merges, "left right") where it has them,
// else generate_merges over the vocabulary ranked by each token's score: the file's scores
// (LlamaTokenizer: SentencePiece's BPE merges by the merged piece's score), or for Gemma the
// tokens' order in the file (its scores do not follow its merges). `order`: the distinct tokens in
// their first order, `vocab`: each token's last id, as Python's dicts have them.
std::vector<std::pair<std::string, std::string>> sentencepiece_merges(
    const LlamaCppVocab& v, const std::vector<std::string>& tokens, const std::vector<std::string>& order,
    const std::unordered_map<std::string, int64_t>& vocab, bool gemma, const std::string& origin) {
  std::vector<std::pair<std::string, std::string>> out;
  if (!v.merges.empty()) {
    for (const auto& merge : v.merges) {
      const size_t space = merge.find(' ');
      require(space != std::string::npos && merge.find(' ', space + 1) == std::string::npos,
              "{}: tokenizer.ggml.merges: expected \"left right\", found {:?}", origin, merge);
      out.emplace_back(merge.substr(0, space), merge.substr(space + 1));
    }
    return out;
  }
  require(gemma || v.scores.size() == tokens.size(),
          "{}: tokenizer.ggml.scores has {} entries for {} tokens: a SentencePiece vocabulary without merges is "
          "ranked by its scores (one per token)",
          origin, v.scores.size(), tokens.size());
  std::unordered_map<std::string, double> scores;  // {token: score}: the last one wins, as dict(zip(...))
  for (size_t id = 0; id < tokens.size(); ++id) {
    const double score = gemma ? -double(id) : double(v.scores[id]);
    require(std::isfinite(score), "{}: tokenizer.ggml.scores[{}] is {}: expected a finite number", origin, id, score);
    scores[tokens[id]] = score;
  }
  return generate_merges(order, vocab, scores);
}

// transformers' update_post_processor: "[bos] $A [eos]", and for a pair "[bos] $A [eos] [bos] $B
// [eos]", each special token where the tokenizer adds it (its text; nullopt where not).
std::string post_processor_json(const std::optional<std::string>& bos, const std::optional<std::string>& eos,
                                const std::unordered_map<std::string, int64_t>& vocab) {
  auto special_item = [](const std::string& text, int type_id) {
    return fmt::format(R"({{"SpecialToken":{{"id":{},"type_id":{}}}}})", json_quoted(text), type_id);
  };
  std::string single, pair, specials;
  for (int type_id : {0, 1}) {
    std::string& s = type_id == 0 ? single : pair;
    if (bos) s += special_item(*bos, type_id) + ",";
    s += fmt::format(R"({{"Sequence":{{"id":"{}","type_id":{}}}}})", type_id == 0 ? "A" : "B", type_id);
    if (eos) s += "," + special_item(*eos, type_id);
  }
  pair = single + "," + pair;
  for (const auto& text : {bos, eos})
    if (text)
      specials += fmt::format(R"({}{}:{{"id":{},"ids":[{}],"tokens":[{}]}})", specials.empty() ? "" : ",",
                              json_quoted(*text), json_quoted(*text), vocab.at(*text), json_quoted(*text));
  return fmt::format(
      R"("post_processor":{{"type":"TemplateProcessing","single":[{}],"pair":[{}],"special_tokens":{{{}}}}},)", single,
      pair, specials);
}

// A SentencePiece vocabulary ("llama") as transformers' GGUF loader rebuilds it: the class's
// pipeline (GemmaTokenizer: spaces to U+2581 by a normalizer, no split; LlamaTokenizer: Metaspace,
// U+2581 prepended to the text's start, prepend_scheme "first"), BPE with byte fallback and the
// merges of sentencepiece_merges, Gemma's tokens of spaces respelled; then the class's special
// tokens, the file's control tokens (special) and user-defined ones (not), and BOS as
// tokenizer.ggml.add_bos_token says (true where absent, as there).
HfTokenizerFiles sentencepiece_files(const LlamaCppVocab& v, const std::string& origin, const std::string& arch) {
  const SentencePieceClass cls = sentencepiece_class(arch, origin);
  HfTokenizerFiles out;
  std::vector<std::string> tokens = v.tokens;
  // A Gemma token made of spaces is stored as spaces; GemmaTokenizer looks it up as U+2581s.
  for (auto& t : tokens) {
    if (!cls.gemma) break;
    const auto cps = code_points(t);
    if (t.find(' ') != std::string::npos && std::all_of(cps.begin(), cps.end(), is_space)) {
      std::string respelled;
      for (size_t i = 0; i < cps.size(); ++i) respelled += "\xe2\x96\x81";
      t = respelled;
    }
  }
  // {token: id} as Python builds it: the last id wins, the first order stays.
  std::unordered_map<std::string, int64_t> vocab;
  std::vector<std::string> order;
  for (size_t id = 0; id < tokens.size(); ++id) {
    if (!vocab.count(tokens[id])) order.push_back(tokens[id]);
    vocab[tokens[id]] = int64_t(id);
  }
  const auto merges = sentencepiece_merges(v, tokens, order, vocab, cls.gemma, origin);
  out.merges = !v.merges.empty()
                   ? fmt::format("{} merges", merges.size())
                   : fmt::format("merges derived from the vocabulary, ranked by the {}, as transformers does",
                                 cls.gemma ? "tokens' order" : "file's scores");

  const auto type_of = [&](size_t id) { return v.token_types.empty() ? 1 : v.token_types[id]; };
  const auto special_text = [&](std::string_view which) -> std::optional<std::string> {
    for (const auto& [type, id] : v.special_ids)
      if (type == which && id >= 0 && size_t(id) < tokens.size()) return v.tokens[size_t(id)];
    return std::nullopt;
  };
  // The class's special tokens: the file's, else the class's defaults where the vocabulary has
  // them (transformers would add a missing one past the model's vocabulary); the class's own
  // defaults are added tokens whatever the file names (its constructor adds them).
  std::map<int64_t, bool> added;  // id -> special
  std::string config = fmt::format(R"({{"tokenizer_class":"{}")", cls.name);
  std::optional<std::string> bos_text, eos_text;
  for (const auto& n : cls.named) {
    if (!n.fallback.empty() && vocab.count(std::string(n.fallback))) added[vocab.at(std::string(n.fallback))] = true;
    std::optional<std::string> text = n.which.empty() ? std::nullopt : special_text(n.which);
    if (!text && !n.fallback.empty()) text = std::string(n.fallback);
    if (text && !vocab.count(*text)) {
      out.notes.push_back(fmt::format("{} '{}' is not in the vocabulary: not added (transformers would add it as a "
                                      "new token past the model's embedding)",
                                      n.key, *text));
      text.reset();
    }
    config += fmt::format(",\"{}\":{}", n.key, text ? json_quoted(*text) : "null");
    if (!text) continue;
    added[vocab.at(*text)] = true;
    if (n.which == "bos") bos_text = text;
    if (n.which == "eos") eos_text = text;
  }
  for (size_t id = 0; id < tokens.size(); ++id)  // added by their text: a text spelled twice is its last id
    if (type_of(id) == int32_t(LlamaCppTokenType::Control)) added[vocab.at(tokens[id])] = true;
  for (size_t id = 0; id < tokens.size(); ++id)
    if (type_of(id) == int32_t(LlamaCppTokenType::UserDefined) && vocab.at(tokens[id]) == int64_t(id))
      added[int64_t(id)] = false;
  auto add_flag = [&](std::string_view type, bool fallback) {
    for (const auto& [t, add] : v.add_special)
      if (t == type) return add;
    return fallback;
  };
  const bool add_bos = add_flag("bos", true) && bos_text, add_eos = add_flag("eos", false) && eos_text;
  config += fmt::format(R"(,"add_bos_token":{},"add_eos_token":{}}})", add_bos ? "true" : "false",
                        add_eos ? "true" : "false");

  std::string json = R"({"version":"1.0","truncation":null,"padding":null,"added_tokens":[)";
  bool first = true;
  for (const auto& [id, special] : added) {
    json += (first ? "" : ",") + added_token_json(id, tokens[size_t(id)], special);
    first = false;
  }
  json += "],";
  if (cls.gemma) {
    json += R"("normalizer":{"type":"Replace","pattern":{"String":" "},"content":"\u2581"},)"
            R"("pre_tokenizer":{"type":"Split","pattern":{"String":" "},"behavior":"MergedWithPrevious",)"
            R"("invert":false},)";
    out.pre_tokenizer = "GemmaTokenizer's (spaces as U+2581, no split)";
  } else {
    json += R"("normalizer":null,"pre_tokenizer":{"type":"Metaspace","replacement":"\u2581",)"
            R"("prepend_scheme":"first","split":false},)";
    out.pre_tokenizer = "LlamaTokenizer's (Metaspace: spaces as U+2581, one prepended to the text)";
    if (v.add_prefix_space == false)
      out.notes.push_back(
          "tokenizer.ggml.add_space_prefix is false, but the tokenizer prepends U+2581 to the text as transformers' "
          "GGUF loader builds it (LlamaTokenizer's Metaspace; llama.cpp would not prepend it)");
  }
  json += post_processor_json(add_bos ? bos_text : std::nullopt, add_eos ? eos_text : std::nullopt, vocab);
  json += R"("decoder":{"type":"Sequence","decoders":[{"type":"Replace","pattern":{"String":"\u2581"},"content":" "},)"
          R"({"type":"ByteFallback"},{"type":"Fuse"})";
  json += cls.gemma ? "]}," : R"(,{"type":"Strip","content":" ","start":1,"stop":0}]},)";
  // GemmaTokenizer's BPE has an unk token, LlamaTokenizer's none (byte fallback only).
  const std::string unk =
      !cls.gemma ? "null" : special_text("unk") ? json_quoted(*special_text("unk")) : std::string("\"<unk>\"");
  json += fmt::format(R"("model":{{"type":"BPE","dropout":null,"unk_token":{},"continuing_subword_prefix":null,)"
                      R"("end_of_word_suffix":null,"fuse_unk":true,"byte_fallback":true,"ignore_merges":false,)"
                      R"("vocab":{{)",
                      unk);
  first = true;
  for (size_t id = 0; id < tokens.size(); ++id) {
    if (vocab.at(tokens[id]) != int64_t(id)) continue;
    json += (first ? "" : ",") + json_quoted(tokens[id]) + ":" + std::to_string(id);
    first = false;
  }
  json += R"(},"merges":[)";
  first = true;
  for (const auto& [left, right] : merges) {
    json += fmt::format("{}[{},{}]", first ? "" : ",", json_quoted(left), json_quoted(right));
    first = false;
  }
  json += "]}}";
  out.tokenizer_json = std::move(json);
  out.tokenizer_config_json = std::move(config);
  out.chat_template = v.chat_template;
  return out;
}

}  // namespace

HfTokenizerFiles hf_tokenizer_files(const LlamaCppVocab& v, const std::string& origin,
                                    const std::string& architecture) {
  require(v.model == "gpt2" || v.model == "llama",
          "{}: tokenizer.ggml.model is '{}': keel builds byte-level BPE (\"gpt2\") and SentencePiece (\"llama\") "
          "tokenizers from GGUF metadata; give the model's Hugging Face tokenizer with `tokenizer` in the recipe",
          origin, v.model);
  require(!v.tokens.empty(), "{}: tokenizer.ggml.tokens is missing or empty", origin);
  require(v.token_types.empty() || v.token_types.size() == v.tokens.size(),
          "{}: tokenizer.ggml.token_type has {} entries for {} tokens", origin, v.token_types.size(), v.tokens.size());
  if (v.model == "llama") return sentencepiece_files(v, origin, architecture);
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
  out.merges = fmt::format("{} merges", v.merges.size());
  for (const auto& [type, add] : v.add_special)
    if (add && (type == "bos" || type == "eos"))
      out.notes.push_back(fmt::format(
          "tokenizer.ggml.add_{}_token is true, but the tokenizer adds no {} to a text, as transformers' GGUF loader "
          "builds it (a chat template that writes {}_token still has it)",
          type, type == "bos" ? "BOS" : "EOS", type));
  return out;
}

}  // namespace keel::data
