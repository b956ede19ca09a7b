#include "keel/data/llama_cpp_vocab.h"

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <simdjson.h>

#include <charconv>
#include <map>

#include "keel/core/error.h"
#include "keel/core/file_io.h"
#include "keel/core/json_text.h"
#include "keel/core/sha256.h"
#include "keel/data/hf_tokenizer_json.h"
#include "keel/data/llama_cpp_pre_tokenizers.h"
#include "keel/data/pretokenizer.h"
#include "keel/data/sentencepiece_model.h"
#include "keel/data/tokenizer.h"

namespace keel::data {
namespace {

using simdjson::dom::array;
using simdjson::dom::element;
using simdjson::dom::object;

// SpecialVocab's special_token_types.
constexpr const char* kSpecialTypes[] = {"bos", "eos", "unk", "sep", "pad", "cls", "mask"};

struct Json {
  simdjson::dom::parser parser;
  element root;
  std::string text;
};

// The document `text` (from `path`, for messages), or null where there is none.
std::unique_ptr<Json> parse_json(const std::optional<std::string>& text, const std::string& path) {
  if (!text) return nullptr;
  auto j = std::make_unique<Json>();
  j->text = *text;
  const auto error = parse_json_document(j->parser, j->text, j->root);
  require(!error, "{}: not valid JSON ({})", path, simdjson::error_message(error));
  require(j->root.is_object(), "{}: expected a JSON object at the top level", path);
  return j;
}

std::optional<std::string> read_if_there(const std::string& path) {
  return path_exists(path) ? std::optional<std::string>(read_file(path)) : std::nullopt;
}

std::optional<element> member(element e, std::string_view key) {
  element v;
  if (!e.is_object() || e.at_key(key).get(v) != simdjson::SUCCESS || v.is_null()) return std::nullopt;
  return v;
}

std::optional<std::string_view> string_member(element e, std::string_view key) {
  auto v = member(e, key);
  std::string_view s;
  if (v && v->get_string().get(s) == simdjson::SUCCESS) return s;
  return std::nullopt;
}

std::optional<bool> bool_member(element e, std::string_view key) {
  auto v = member(e, key);
  bool b;
  if (v && v->get_bool().get(b) == simdjson::SUCCESS) return b;
  return std::nullopt;
}

// BaseModel.does_token_look_special: added tokens some models forget to mark special.
bool looks_special(std::string_view t) {
  auto wrapped = [&](std::string_view open, std::string_view close) {
    return t.size() >= open.size() + close.size() && t.starts_with(open) && t.ends_with(close);
  };
  return t == "<pad>" || t == "<mask>" || t == "<2mass>" || t == "[@BOS@]" || wrapped("<|", "|>") ||
         wrapped("<\xef\xbd\x9c", "\xef\xbd\x9c>") || wrapped("<unused", ">");
}

std::string replace_all(std::string s, std::string_view from, std::string_view to) {
  for (size_t at = s.find(from); at != std::string::npos; at = s.find(from, at + to.size()))
    s.replace(at, from.size(), to);
  return s;
}

// gguf-py's merges: "a b" strings as they are; ["a", "b"] pairs joined by a space, a space inside
// a part written as chr(ord(' ') + 256) (U+0120) so the line still splits in two.
std::vector<std::string> read_merges(element model, const std::string& path) {
  std::vector<std::string> merges;
  auto m = member(model, "merges");
  array list;
  if (!m || m->get_array().get(list) != simdjson::SUCCESS) return merges;
  for (element entry : list) {
    std::string_view s;
    array pair;
    if (entry.get_string().get(s) == simdjson::SUCCESS) {
      merges.emplace_back(s);
    } else if (entry.get_array().get(pair) == simdjson::SUCCESS && pair.size() == 2) {
      std::string joined;
      for (element part : pair) {
        std::string_view p;
        require(part.get_string().get(p) == simdjson::SUCCESS, "{}: model.merges: expected pairs of strings, found {}",
                path, json_describe(entry));
        joined += (joined.empty() ? "" : " ") + replace_all(std::string(p), " ", "\xc4\xa0");
      }
      merges.push_back(std::move(joined));
    } else {
      fail("{}: model.merges: expected \"a b\" strings or [\"a\", \"b\"] pairs, found {}", path, json_describe(entry));
    }
  }
  return merges;
}

void read_normalizer(element n, LlamaCppVocab& v) {
  const auto type = string_member(n, "type");
  if (type == "Lowercase") v.normalizer_lowercase = true;
  if (type == "StripAccents") v.normalizer_strip_accents = true;
  if (type == "BertNormalizer") {
    if (auto b = bool_member(n, "lowercase")) v.normalizer_lowercase = b;
    if (auto b = bool_member(n, "strip_accents")) v.normalizer_strip_accents = b;
  }
  array list;
  if (type == "Sequence" && member(n, "normalizers") && member(n, "normalizers")->get_array().get(list) == simdjson::SUCCESS)
    for (element e : list) read_normalizer(e, v);
}

void set_add(LlamaCppVocab& v, std::string_view type, bool value, bool only_if_unset) {
  for (auto& [t, b] : v.add_special)
    if (t == type) {
      if (!only_if_unset) b = value;
      return;
    }
  v.add_special.emplace_back(type, value);
}

void set_special(LlamaCppVocab& v, std::string_view type, int64_t id) {
  for (const auto& [t, _] : v.special_ids)
    if (t == type) return;  // the first source wins
  v.special_ids.emplace_back(type, id);
}

// A token named in tokenizer_config.json: "<s>" or {"content": "<s>"}.
std::optional<std::string> config_token(element config, std::string_view key) {
  auto e = member(config, key);
  if (!e) return std::nullopt;
  auto text = config_token_text(*e);
  return text ? std::optional<std::string>(std::string(*text)) : std::nullopt;
}

// SpecialVocab's reading of the post-processor: which special tokens the tokenizer adds. Only the
// single-sequence template's ends matter for BOS/EOS (its crude parse, which keel follows).
void read_post_processor(element tokenizer, element* config, LlamaCppVocab& v) {
  auto post = member(tokenizer, "post_processor");
  if (!post) return;
  std::vector<element> processors;
  array list;
  if (auto p = member(*post, "processors"); p && p->get_array().get(list) == simdjson::SUCCESS) {
    for (element e : list) processors.push_back(e);
  } else {
    processors.push_back(*post);
  }
  const auto bos = config ? config_token(*config, "bos_token") : std::nullopt;
  const auto eos = config ? config_token(*config, "eos_token") : std::nullopt;
  for (element p : processors) {
    const auto type = string_member(p, "type");
    if (type == "ByteLevel") {
      set_add(v, "bos", false, true);
      set_add(v, "eos", false, true);
    } else if (type == "TemplateProcessing") {
      array single;
      auto s = member(p, "single");
      if (!s || s->get_array().get(single) != simdjson::SUCCESS || single.size() <= 1) continue;
      auto special_id = [](element item) {
        auto st = member(item, "SpecialToken");
        return st ? string_member(*st, "id") : std::nullopt;
      };
      const auto first = special_id(single.at(0)), last = special_id(single.at(single.size() - 1));
      if (first) set_add(v, "bos", bos && *first == *bos, false);
      if (last) set_add(v, "eos", eos && *last == *eos, false);
      // The pair template A [sep] [eos] B: whether a separator is added (add_sep_token).
      std::vector<element> pair;
      array pair_list;
      if (auto pr = member(p, "pair"); pr && pr->get_array().get(pair_list) == simdjson::SUCCESS)
        for (element e : pair_list) pair.push_back(e);
      if (pair.empty()) continue;
      size_t begin = first && special_id(pair.front()) == first ? 1 : 0;
      size_t end = last && special_id(pair.back()) == last ? pair.size() - 1 : pair.size();
      if (begin >= end) continue;
      auto sequence_id = [](element item) {
        auto sq = member(item, "Sequence");
        return sq ? string_member(*sq, "id") : std::nullopt;
      };
      if (sequence_id(pair[begin]) != std::string_view("A") || sequence_id(pair[end - 1]) != std::string_view("B") ||
          end - begin <= 2)
        continue;
      const auto sep = config ? config_token(*config, "sep_token") : std::nullopt;
      auto separator = [&](element item) {
        const auto id = special_id(item);
        return id && ((sep && *id == *sep) || (eos && *id == *eos));
      };
      bool add_sep = separator(pair[begin + 1]) && !last;
      if (end - begin - 2 == 2 && separator(pair[begin + 2])) add_sep = true;
      set_add(v, "sep", add_sep, false);
    } else if (type == "RobertaProcessing") {
      set_add(v, "bos", true, false);
      set_add(v, "eos", true, false);
      set_add(v, "sep", true, false);
    }
  }
}

std::optional<std::string> read_chat_template(const LlamaCppVocabFiles& files, element config) {
  if (auto t = string_member(config, "chat_template")) return std::string(*t);
  require(!member(config, "chat_template"),
          "{}/tokenizer_config.json: chat_template: a list of named templates is not supported by keel's GGUF "
          "export; keep one template as a string",
          files.origin);
  if (files.chat_template_jinja) return files.chat_template_jinja;
  if (auto j = parse_json(files.chat_template_json, files.origin + "/chat_template.json"))
    if (auto t = string_member(j->root, "chat_template")) return std::string(*t);
  return std::nullopt;
}

// SpecialVocab's reading of a directory, merges aside: the normalizer flags and the post-processor
// from tokenizer.json, the chat template, add_<type>_token and <type>_token (by tokenizer.json's added
// tokens) from tokenizer_config.json, then config.json's <type>_token_id where still unset. Ids at
// or past n_vocab (where SpecialVocab is given one) are skipped, as there.
void read_special_vocab(const LlamaCppVocabFiles& files, element tokenizer_root, const Json* config,
                        const std::vector<element>& added, LlamaCppVocab& v, std::optional<int64_t> n_vocab) {
  auto set = [&](std::string_view type, int64_t id) {
    if (!n_vocab || id < *n_vocab) set_special(v, type, id);
  };
  if (auto n = member(tokenizer_root, "normalizer")) read_normalizer(*n, v);
  element config_root;
  element* config_element = nullptr;
  if (config) config_element = &(config_root = config->root);
  read_post_processor(tokenizer_root, config_element, v);
  // ... the chat template, add_<type>_token and <type>_token from tokenizer_config.json ...
  if (config) {
    v.chat_template = read_chat_template(files, config->root);
    v.add_prefix_space = bool_member(config->root, "add_prefix_space");
    for (const char* type : kSpecialTypes) {
      if (auto add = bool_member(config->root, fmt::format("add_{}_token", type))) set_add(v, type, *add, true);
      const auto content = config_token(config->root, fmt::format("{}_token", type));
      if (!content) continue;
      for (element t : added) {
        if (string_member(t, "content") == std::string_view(*content)) {
          int64_t id = 0;
          if (t.at_key("id").get_int64().get(id) == simdjson::SUCCESS) set(type, id);
          break;
        }
      }
    }
  }
  // ... then config.json's <type>_token_id where still unset (integers only, as there).
  if (!files.config_json.empty()) {
    simdjson::dom::parser parser;
    element root;
    if (!parse_json_document(parser, files.config_json, root))
      for (const char* type : kSpecialTypes) {
        int64_t id;
        auto e = member(root, fmt::format("{}_token_id", type));
        if (e && e->is_int64() && e->get_int64().get(id) == simdjson::SUCCESS && id >= 0) set(type, id);
      }
  }
}

// The pre-tokenizer of GLM-4's tokenizer.json (glm-4-9b-hf, GLM-4.5): a Split on GLM-4's regex
// (cl100k's; llama.cpp's "glm4" splits by it, LLAMA_VOCAB_PRE_TYPE_CHATGLM4, with (?i:...) spelled
// out), isolated, then ByteLevel without a regex of its own; with GLM-4's [gMASK] and <sop> among
// the added tokens. keel's name for a tokenizer whose hash llama.cpp's table lacks (a GLM-4
// vocabulary extended or retrained): llama.cpp then splits its text as training did, which is
// what the name decides (the vocabulary and merges are the file's). The converter has no such
// rule and refuses it.
bool is_glm4_tokenizer(element root, const std::vector<element>& added) {
  const auto pre = member(root, "pre_tokenizer");
  const auto steps = pre ? member(*pre, "pretokenizers") : std::nullopt;
  array list;
  if (!pre || string_member(*pre, "type") != "Sequence" || !steps ||
      steps->get_array().get(list) != simdjson::SUCCESS)
    return false;
  std::vector<element> parts;
  for (element e : list) parts.push_back(e);
  if (parts.size() != 2) return false;
  const element split = parts[0], byte_level = parts[1];
  const auto pattern = member(split, "pattern");
  if (string_member(split, "type") != "Split" || !pattern ||
      string_member(*pattern, "Regex") != named_pattern("glm4") ||
      string_member(split, "behavior") != "Isolated" || bool_member(split, "invert").value_or(false) ||
      string_member(byte_level, "type") != "ByteLevel" || bool_member(byte_level, "use_regex").value_or(true))
    return false;
  bool gmask = false, sop = false;
  for (element t : added) {
    gmask = gmask || string_member(t, "content") == "[gMASK]";
    sop = sop || string_member(t, "content") == "<sop>";
  }
  return gmask && sop;
}

}  // namespace

bool llama_cpp_ends_generation(const LlamaCppVocab& vocab, int64_t id) {
  for (const auto& [type, special] : vocab.special_ids)
    if (special == id && (type == "eos" || type == "eot" || type == "eom")) return true;
  // llama_vocab::impl::load's list of end-of-generation token texts (llama.cpp as llama-cpp-python
  // 0.3.36 carries it).
  static constexpr std::string_view kEndOfGeneration[] = {
      "<|eot_id|>", "<|im_end|>", "<|end|>", "<|return|>", "<|call|>", "<|flush|>", "<|calls|>", "<end_of_turn>",
      "<|endoftext|>", "</s>", "<|eom_id|>", "<EOT>", "_<EOT>", "[EOT]", "[EOS]", "<|end_of_text|>",
      "<end_of_utterance>", "<eos>", "<turn|>", "<|tool_response>",
      "<\xef\xbd\x9c""end\xe2\x96\x81""of\xe2\x96\x81""sentence\xef\xbd\x9c>", "[e~["};
  if (id < 0 || size_t(id) >= vocab.tokens.size()) return false;
  for (std::string_view text : kEndOfGeneration)
    if (vocab.tokens[size_t(id)] == text) return true;
  return false;
}

std::string llama_cpp_pre_tokenizer_name(const std::vector<int32_t>& ids) {
  const std::string hash = sha256_hex(fmt::format("[{}]", fmt::join(ids, ", ")));
  std::string name;
  for (const auto& known : llama_cpp_pre_tokenizers())
    if (known.sha256 == hash) name = known.name;  // the converter's ifs: the last match wins
  return name;
}

LlamaCppVocab llama_cpp_vocab(const std::string& dir, int64_t vocab_size, const std::string& config_json,
                              bool sentencepiece_only) {
  const std::string tokenizer_path = dir + "/tokenizer.json", model_path = dir + "/tokenizer.model";
  LlamaCppVocabFiles files;
  files.origin = dir;
  if (path_exists(model_path)) files.sentencepiece_model = read_file(model_path);
  const bool sentencepiece = looks_like_sentencepiece_model(files.sentencepiece_model);
  require(sentencepiece || !sentencepiece_only,
          "{}: no SentencePiece tokenizer.model, which llama.cpp's converter reads for this family (its vocabulary "
          "with scores); put the model's tokenizer.model beside tokenizer.json",
          dir);
  require(path_exists(tokenizer_path),
          "{}: no such file: keel tokenizes with tokenizer.json (a SentencePiece tokenizer.model alone: load it with "
          "transformers and save_pretrained to write one), and reads its special tokens from it",
          tokenizer_path);
  files.tokenizer_json = read_file(tokenizer_path);
  files.tokenizer_config_json = read_if_there(dir + "/tokenizer_config.json");
  files.chat_template_jinja = read_if_there(dir + "/chat_template.jinja");
  files.chat_template_json = read_if_there(dir + "/chat_template.json");
  files.added_tokens_json = read_if_there(dir + "/added_tokens.json");
  files.config_json = config_json;
  return sentencepiece ? llama_cpp_sentencepiece_vocab(files, vocab_size) : llama_cpp_bpe_vocab(files, vocab_size);
}

LlamaCppVocab llama_cpp_sentencepiece_vocab(const LlamaCppVocabFiles& files, int64_t vocab_size) {
  const std::string model_path = files.origin + "/tokenizer.model";
  const std::vector<SentencePiece> pieces = read_sentencepiece_model(files.sentencepiece_model, model_path);
  require(vocab_size > 0, "{}: the model's vocabulary is empty (config.json vocab_size)", files.origin);
  LlamaCppVocab v;
  v.model = "llama";
  v.pre = "default";
  v.tokens.reserve(size_t(vocab_size));
  for (int64_t i = 0; i < vocab_size; ++i) v.tokens.push_back(fmt::format("[PAD{}]", i));
  v.scores.assign(size_t(vocab_size), -10000.0f);
  v.token_types.assign(size_t(vocab_size), int32_t(LlamaCppTokenType::Unused));
  // Pieces past the model's vocabulary are left out (the converter warns and stops there).
  for (size_t id = 0; id < pieces.size() && int64_t(id) < vocab_size; ++id) {
    const SentencePiece& p = pieces[id];
    LlamaCppTokenType type = LlamaCppTokenType::Normal;  // user-defined pieces too: the processor has no IsUserDefined
    if (p.type == SentencePieceType::Unknown) type = LlamaCppTokenType::Unknown;
    else if (p.type == SentencePieceType::Control) type = LlamaCppTokenType::Control;
    else if (p.type == SentencePieceType::Unused) type = LlamaCppTokenType::Unused;
    else if (p.type == SentencePieceType::Byte) type = LlamaCppTokenType::Byte;
    v.tokens[id] = p.piece;
    v.scores[id] = p.score;
    v.token_types[id] = int32_t(type);
  }
  auto over = [&](int64_t id, std::string token, LlamaCppTokenType type) {
    if (id < 0 || id >= vocab_size) return;  // out of range: the converter skips it
    v.tokens[size_t(id)] = std::move(token);
    v.scores[size_t(id)] = -1000.0f;
    v.token_types[size_t(id)] = int32_t(type);
  };
  if (auto added = parse_json(files.added_tokens_json, files.origin + "/added_tokens.json"))
    for (auto [key, value] : object(added->root)) {
      int64_t id;
      require(value.get_int64().get(id) == simdjson::SUCCESS, "{}/added_tokens.json: '{}': expected an integer id",
              files.origin, key);
      over(id, std::string(key), LlamaCppTokenType::UserDefined);
    }
  auto config = parse_json(files.tokenizer_config_json, files.origin + "/tokenizer_config.json");
  if (config)
    if (auto decoder = member(config->root, "added_tokens_decoder"); decoder && decoder->is_object())
      for (auto [key, value] : object(*decoder)) {
        int64_t id = 0;
        const auto [end, ec] = std::from_chars(key.data(), key.data() + key.size(), id);
        const auto content = string_member(value, "content");
        require(ec == std::errc() && end == key.data() + key.size() && content,
                "{}/tokenizer_config.json: added_tokens_decoder['{}']: expected an integer id and an object with "
                "'content'",
                files.origin, key);
        std::string token(*content);
        const bool control = bool_member(value, "special").value_or(false) || looks_special(token);
        if (!control) token = replace_all(token, "\xe2\x96\x81", " ");  // pre-normalized user-defined spaces
        over(id, std::move(token), control ? LlamaCppTokenType::Control : LlamaCppTokenType::UserDefined);
      }
  // SpecialVocab(n_vocab=len(tokens)), merges not loaded: from tokenizer.json's added tokens and
  // post-processor, tokenizer_config.json and config.json.
  auto tokenizer = parse_json(files.tokenizer_json, files.origin + "/tokenizer.json");
  std::vector<element> added;
  array added_list;
  if (auto a = member(tokenizer->root, "added_tokens"); a && a->get_array().get(added_list) == simdjson::SUCCESS)
    for (element t : added_list) added.push_back(t);
  read_special_vocab(files, tokenizer->root, config.get(), added, v, vocab_size);
  return v;
}

LlamaCppVocab llama_cpp_bpe_vocab(const LlamaCppVocabFiles& files, int64_t vocab_size) {
  const std::string tokenizer_path = files.origin + "/tokenizer.json";
  auto tokenizer = parse_json(files.tokenizer_json, tokenizer_path);
  auto config = parse_json(files.tokenizer_config_json, files.origin + "/tokenizer_config.json");
  element model;
  require(tokenizer->root.at_key("model").get(model) == simdjson::SUCCESS &&
              string_member(model, "type") == std::string_view("BPE"),
          "{}: model.type: expected \"BPE\" (a byte-level BPE tokenizer); keel's GGUF export writes no other",
          tokenizer_path);
  LlamaCppVocab v;
  v.byte_fallback = bool_member(model, "byte_fallback").value_or(false);
  v.tokenizer_json_entries = int64_t(member(model, "vocab") && member(model, "vocab")->is_object()
                                         ? object(*member(model, "vocab")).size()
                                         : 0);

  // get_vocab_base: the vocabulary with added tokens over it, [PAD<id>] where an id has no token.
  std::map<int64_t, std::string> by_id;
  object vocab;
  require(model.at_key("vocab").get_object().get(vocab) == simdjson::SUCCESS, "{}: model.vocab: expected an object",
          tokenizer_path);
  for (auto [key, value] : vocab) {
    int64_t id;
    require(value.get_int64().get(id) == simdjson::SUCCESS, "{}: model.vocab['{}']: expected an integer id",
            tokenizer_path, key);
    by_id[id] = std::string(key);
  }
  std::map<int64_t, LlamaCppTokenType> added_type;
  std::vector<element> added;  // tokenizer.json's added_tokens, in its order
  array added_list;
  if (auto a = member(tokenizer->root, "added_tokens"); a && a->get_array().get(added_list) == simdjson::SUCCESS)
    for (element t : added_list) added.push_back(t);
  for (element t : added) {
    int64_t id;
    const auto content = string_member(t, "content");
    require(content && t.at_key("id").get_int64().get(id) == simdjson::SUCCESS,
            "{}: added_tokens: expected objects with 'content' and 'id', found {}", tokenizer_path, json_describe(t));
    std::string token(*content);
    if (bool_member(t, "special").value_or(false) || looks_special(token)) {
      added_type[id] = LlamaCppTokenType::Control;
    } else {
      added_type[id] = LlamaCppTokenType::UserDefined;
      token = replace_all(token, "\xe2\x96\x81", " ");  // the converter's pre-normalized spaces (Gemma)
    }
    by_id[id] = token;
  }
  v.added_tokens = int64_t(added.size());
  // The largest id, read only when there is one: require's message arguments are evaluated whether
  // or not it fails, and an empty vocabulary has no last element.
  const int64_t largest = by_id.empty() ? -1 : by_id.rbegin()->first;
  require(largest < vocab_size, "{}: token id {} is outside the model's vocabulary of {} (config.json vocab_size)",
          tokenizer_path, largest, vocab_size);
  for (int64_t i = 0; i < vocab_size; ++i) {
    auto it = by_id.find(i);
    if (it == by_id.end()) {
      v.tokens.push_back(fmt::format("[PAD{}]", i));
      v.token_types.push_back(int32_t(LlamaCppTokenType::Unused));
    } else {
      v.tokens.push_back(it->second);
      auto type = added_type.find(i);
      v.token_types.push_back(int32_t(type == added_type.end() ? LlamaCppTokenType::Normal : type->second));
    }
  }

  // SpecialVocab(load_merges=True): merges, then what every vocabulary reads.
  v.merges = read_merges(model, tokenizer_path);
  read_special_vocab(files, tokenizer->root, config.get(), added, v, std::nullopt);
  // The ids the tokenizer gives the converter's fixed text name its pre-tokenizer (last: the
  // tokenizer is built whole for it).
  const Tokenizer keel_tokenizer = hf_tokenizer_from_json(files.tokenizer_json, tokenizer_path,
                                                          files.tokenizer_config_json.value_or(""));
  v.pre = llama_cpp_pre_tokenizer_name(
      keel_tokenizer.encode(llama_cpp_pre_tokenizer_text(), EncodeOptions{.add_special_tokens = true}));
  if (v.pre.empty() && is_glm4_tokenizer(tokenizer->root, added)) {
    v.pre = "glm4";
    v.pre_by_glm4_rule = true;
  }
  require(!v.pre.empty(),
          "{}: llama.cpp does not know this tokenizer's pre-tokenizer (the hash of its tokenization of the "
          "converter's test text is not in its table); llama.cpp could not tokenize as the model was trained",
          tokenizer_path);
  return v;
}

}  // namespace keel::data
