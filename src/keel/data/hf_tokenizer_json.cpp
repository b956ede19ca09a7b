#include "keel/core/json_text.h"
#include "keel/data/hf_tokenizer_json.h"

#include <simdjson.h>

#include <limits>
#include <unordered_map>

#include "keel/core/error.h"
#include "keel/core/file_io.h"
#include "keel/data/byte_level.h"

namespace keel::data {
// Ids may skip at most this many slots past the vocabulary and added tokens (reserved ranges in
// real tokenizer files are far smaller); beyond it a file is claiming tables it does not fill.
constexpr size_t kIdSlack = size_t(1) << 16;

namespace {

using simdjson::dom::array;
using simdjson::dom::element;
using simdjson::dom::object;

// Reads one tokenizer.json; every accessor names the JSON path it was asked for.
class Reader {
 public:
  explicit Reader(const std::string& origin) : origin_(origin) {}

  [[noreturn]] void bad(std::string_view where, std::string_view expected) const {
    fail("{}: {}: expected {}", origin_, where, expected);
  }
  object as_object(element e, std::string_view where) const {
    object o;
    if (e.get_object().get(o) != simdjson::SUCCESS) bad(where, "an object");
    return o;
  }
  array as_array(element e, std::string_view where) const {
    array a;
    if (e.get_array().get(a) != simdjson::SUCCESS) bad(where, "an array");
    return a;
  }
  std::string_view as_string(element e, std::string_view where) const {
    std::string_view s;
    if (e.get_string().get(s) != simdjson::SUCCESS) bad(where, "a string");
    return s;
  }
  // The required string field `key` of `o`, errors naming where.key.
  std::string_view string_field(object o, std::string_view key, std::string_view where) const {
    return as_string(required(o, key, where), fmt::format("{}.{}", where, key));
  }
  int64_t as_int(element e, std::string_view where) const {
    int64_t v;
    if (e.get_int64().get(v) != simdjson::SUCCESS) bad(where, "an integer");
    return v;
  }
  // A member that is absent or null reads as missing.
  std::optional<element> member(object o, std::string_view key) const {
    element e;
    if (o.at_key(key).get(e) != simdjson::SUCCESS || e.is_null()) return std::nullopt;
    return e;
  }
  element required(object o, std::string_view key, std::string_view where) const {
    auto e = member(o, key);
    if (!e) fail("{}: {}: missing field '{}'", origin_, where, key);
    return *e;
  }
  bool flag(object o, std::string_view key, bool fallback, std::string_view where) const {
    auto e = member(o, key);
    if (!e) return fallback;
    bool v;
    if (e->get_bool().get(v) != simdjson::SUCCESS) bad(fmt::format("{}.{}", where, key), "true or false");
    return v;
  }
  std::string_view type_of(object o, std::string_view where) const {
    return as_string(required(o, "type", where), fmt::format("{}.type", where));
  }
  const std::string& origin() const { return origin_; }

 private:
  const std::string& origin_;
};

std::optional<NormalizationForm> normalization_form(std::string_view type) {
  if (type == "NFC") return NormalizationForm::nfc;
  if (type == "NFD") return NormalizationForm::nfd;
  if (type == "NFKC") return NormalizationForm::nfkc;
  if (type == "NFKD") return NormalizationForm::nfkd;
  return std::nullopt;
}

// A Replace step's {"String": ...} pattern (a {"Regex": ...} one is refused, naming it).
std::string literal_pattern(const Reader& r, object o, std::string_view where, std::string_view what) {
  const std::string at = fmt::format("{}.pattern", where);
  object pattern = r.as_object(r.required(o, "pattern", where), at);
  if (auto literal = r.member(pattern, "String")) return std::string(r.as_string(*literal, at + ".String"));
  fail("{}: {}: a {} with a Regex pattern is not supported (keel reads String patterns)", r.origin(), at, what);
}

void read_normalizer(const Reader& r, element e, std::string_view where, std::vector<NormalizerStep>& out) {
  object o = r.as_object(e, where);
  std::string_view type = r.type_of(o, where);
  NormalizerStep step;
  if (auto form = normalization_form(type)) {
    step.form = *form;
    out.push_back(step);
  } else if (type == "Prepend") {
    step.kind = NormalizerStep::Kind::prepend;
    step.text = r.string_field(o, "prepend", where);
    out.push_back(step);
  } else if (type == "Replace") {
    step.kind = NormalizerStep::Kind::replace;
    const std::string at = fmt::format("{}.pattern", where);
    object pattern = r.as_object(r.required(o, "pattern", where), at);
    if (auto regex = r.member(pattern, "Regex"))
      step.regex = std::make_shared<PretokenizerRegex>(r.as_string(*regex, at + ".Regex"), RegexDialect::oniguruma,
                                                       fmt::format("{}: {}", r.origin(), at));
    else
      step.text = literal_pattern(r, o, where, "Replace normalizer");
    step.content = r.string_field(o, "content", where);
    out.push_back(step);
  } else if (type == "Strip") {
    step.kind = NormalizerStep::Kind::strip;
    step.left = r.flag(o, "strip_left", true, where);
    step.right = r.flag(o, "strip_right", true, where);
    out.push_back(step);
  } else if (type == "Lowercase") {
    step.kind = NormalizerStep::Kind::lowercase;
    out.push_back(step);
  } else if (type == "Sequence") {
    size_t i = 0;
    for (element n : r.as_array(r.required(o, "normalizers", where), fmt::format("{}.normalizers", where)))
      read_normalizer(r, n, fmt::format("{}.normalizers[{}]", where, i++), out);
  } else {
    fail(
        "{}: {}: normalizer '{}' is not supported (keel reads NFC, NFD, NFKC, NFKD, Prepend, Replace, Strip, "
        "Lowercase and Sequence)",
        r.origin(), where, type);
  }
}

SplitBehavior split_behavior(const Reader& r, std::string_view name, std::string_view where) {
  if (name == "Removed") return SplitBehavior::removed;
  if (name == "Isolated") return SplitBehavior::isolated;
  if (name == "MergedWithPrevious") return SplitBehavior::merged_with_previous;
  if (name == "MergedWithNext") return SplitBehavior::merged_with_next;
  if (name == "Contiguous") return SplitBehavior::contiguous;
  r.bad(where, "one of Removed, Isolated, MergedWithPrevious, MergedWithNext, Contiguous");
}

// Metaspace's prepend_scheme ("always", "first", "never"), or the add_prefix_space flag of files
// written before it existed (true = always).
PreTokenizerStep::Prepend metaspace_prepend(const Reader& r, object o, std::string_view where) {
  if (auto scheme = r.member(o, "prepend_scheme")) {
    const std::string at = fmt::format("{}.prepend_scheme", where);
    const std::string_view s = r.as_string(*scheme, at);
    if (s == "always") return PreTokenizerStep::Prepend::always;
    if (s == "first") return PreTokenizerStep::Prepend::first;
    if (s == "never") return PreTokenizerStep::Prepend::never;
    r.bad(at, "\"always\", \"first\" or \"never\"");
  }
  return r.flag(o, "add_prefix_space", true, where) ? PreTokenizerStep::Prepend::always
                                                    : PreTokenizerStep::Prepend::never;
}

// The regex Hugging Face's ByteLevel pre-tokenizer splits with when use_regex is true (GPT-2's).
constexpr std::string_view kByteLevelPattern =
    R"('s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+)";

void read_pre_tokenizer(const Reader& r, element e, std::string_view where, std::vector<PreTokenizerStep>& out,
                        bool& byte_level) {
  object o = r.as_object(e, where);
  std::string_view type = r.type_of(o, where);
  if (type == "Sequence") {
    size_t i = 0;
    for (element p : r.as_array(r.required(o, "pretokenizers", where), fmt::format("{}.pretokenizers", where)))
      read_pre_tokenizer(r, p, fmt::format("{}.pretokenizers[{}]", where, i++), out, byte_level);
  } else if (type == "ByteLevel") {
    byte_level = true;
    if (r.flag(o, "add_prefix_space", true, where)) {
      PreTokenizerStep step;
      step.kind = PreTokenizerStep::Kind::prefix_space;
      out.push_back(std::move(step));
    }
    if (r.flag(o, "use_regex", true, where)) {
      PreTokenizerStep step;
      step.regex = std::make_shared<PretokenizerRegex>(kByteLevelPattern, RegexDialect::oniguruma, r.origin());
      out.push_back(std::move(step));
    }
  } else if (type == "Split") {
    PreTokenizerStep step;
    const std::string pattern_at = fmt::format("{}.pattern", where);
    object pattern = r.as_object(r.required(o, "pattern", where), pattern_at);
    if (auto regex = r.member(pattern, "Regex")) {
      step.regex =
          std::make_shared<PretokenizerRegex>(r.as_string(*regex, pattern_at + ".Regex"), RegexDialect::oniguruma,
                                              fmt::format("{}: {}", r.origin(), pattern_at));
    } else if (auto literal = r.member(pattern, "String")) {
      step.literal = r.as_string(*literal, pattern_at + ".String");
    } else {
      r.bad(pattern_at, "{\"Regex\": ...} or {\"String\": ...}");
    }
    const std::string behavior_at = fmt::format("{}.behavior", where);
    step.behavior = split_behavior(r, r.as_string(r.required(o, "behavior", where), behavior_at), behavior_at);
    step.invert = r.flag(o, "invert", false, where);
    out.push_back(std::move(step));
  } else if (type == "Metaspace") {
    PreTokenizerStep step;
    step.kind = PreTokenizerStep::Kind::metaspace;
    step.literal = r.string_field(o, "replacement", where);
    step.prepend = metaspace_prepend(r, o, where);
    step.split_on_literal = r.flag(o, "split", true, where);
    out.push_back(std::move(step));
  } else if (type == "Whitespace" || type == "WhitespaceSplit") {
    // Hugging Face: Whitespace keeps the runs of \w and of other non-space characters
    // (\w+|[^\w\s]+, in Rust's regex crate, whose \w also holds the combining marks PCRE2's
    // leaves out: spelled out here); WhitespaceSplit cuts at whitespace. Both drop the whitespace.
    constexpr std::string_view kWord = "\\p{Alphabetic}\\p{M}\\p{Nd}\\p{Pc}\\x{200C}\\x{200D}";
    PreTokenizerStep step;
    step.regex = std::make_shared<PretokenizerRegex>(
        type == "Whitespace" ? fmt::format("[{0}]+|[^{0}\\s]+", kWord) : std::string("\\s+"), RegexDialect::oniguruma,
        r.origin());
    step.behavior = SplitBehavior::removed;
    step.invert = type == "Whitespace";
    out.push_back(std::move(step));
  } else if (type == "Punctuation") {
    // Hugging Face: each ASCII punctuation or Unicode P* character is a delimiter (default Isolated).
    PreTokenizerStep step;
    step.regex = std::make_shared<PretokenizerRegex>("[\\p{P}!-/:-@\\[-`{-~]", RegexDialect::oniguruma, r.origin());
    const std::string behavior_at = fmt::format("{}.behavior", where);
    step.behavior = r.member(o, "behavior")
                        ? split_behavior(r, r.as_string(*r.member(o, "behavior"), behavior_at), behavior_at)
                        : SplitBehavior::isolated;
    out.push_back(std::move(step));
  } else if (type == "Digits") {
    // Hugging Face: char::is_numeric (Unicode N), each digit alone or runs of them, isolated.
    PreTokenizerStep step;
    const bool individual = r.flag(o, "individual_digits", false, where);
    step.regex =
        std::make_shared<PretokenizerRegex>(individual ? "\\p{N}" : "\\p{N}+", RegexDialect::oniguruma, r.origin());
    out.push_back(std::move(step));
  } else {
    fail(
        "{}: {}: pre-tokenizer '{}' is not supported (keel reads ByteLevel, Metaspace, Split, Digits, Whitespace, "
        "WhitespaceSplit, Punctuation and Sequence)",
        r.origin(), where, type);
  }
}

// The single-sequence template's special tokens before and after the text ($A).
void read_post_processor(const Reader& r, element e, std::string_view where, TokenizerParts& parts) {
  object o = r.as_object(e, where);
  std::string_view type = r.type_of(o, where);
  if (type == "ByteLevel") return;  // only adjusts offsets
  if (type == "Sequence") {
    size_t i = 0;
    for (element p : r.as_array(r.required(o, "processors", where), fmt::format("{}.processors", where)))
      read_post_processor(r, p, fmt::format("{}.processors[{}]", where, i++), parts);
    return;
  }
  if (type != "TemplateProcessing")
    fail("{}: {}: post-processor '{}' is not supported (keel reads TemplateProcessing, ByteLevel and Sequence)",
         r.origin(), where, type);
  const std::string specials_at = fmt::format("{}.special_tokens", where);
  std::unordered_map<std::string, std::vector<int32_t>> special_ids;
  if (auto specials = r.member(o, "special_tokens")) {
    for (auto [name, value] : r.as_object(*specials, specials_at)) {
      const std::string at = fmt::format("{}.{}", specials_at, name);
      std::vector<int32_t> ids;
      for (element id : r.as_array(r.required(r.as_object(value, at), "ids", at), at + ".ids"))
        ids.push_back(int32_t(r.as_int(id, at + ".ids")));
      special_ids[std::string(name)] = std::move(ids);
    }
  }
  const std::string single_at = fmt::format("{}.single", where);
  bool seen_sequence = false;
  size_t i = 0;
  for (element item : r.as_array(r.required(o, "single", where), single_at)) {
    const std::string at = fmt::format("{}[{}]", single_at, i++);
    object piece = r.as_object(item, at);
    if (r.member(piece, "Sequence")) {
      seen_sequence = true;
    } else if (auto special = r.member(piece, "SpecialToken")) {
      const std::string name(r.as_string(r.required(r.as_object(*special, at), "id", at), at + ".SpecialToken.id"));
      auto found = special_ids.find(name);
      if (found == special_ids.end())
        fail("{}: {}: special token '{}' is not listed in {}", r.origin(), at, name, specials_at);
      auto& target = seen_sequence ? parts.template_suffix : parts.template_prefix;
      target.insert(target.end(), found->second.begin(), found->second.end());
    } else {
      r.bad(at, "{\"SpecialToken\": ...} or {\"Sequence\": ...}");
    }
  }
}

void read_decoder(const Reader& r, element e, std::string_view where, bool& byte_level, std::vector<DecoderStep>& out) {
  object o = r.as_object(e, where);
  std::string_view type = r.type_of(o, where);
  DecoderStep step;
  if (type == "ByteLevel") {
    byte_level = true;
  } else if (type == "Sequence") {
    size_t i = 0;
    for (element d : r.as_array(r.required(o, "decoders", where), fmt::format("{}.decoders", where)))
      read_decoder(r, d, fmt::format("{}.decoders[{}]", where, i++), byte_level, out);
  } else if (type == "Replace") {
    step.kind = DecoderStep::Kind::replace;
    step.text = literal_pattern(r, o, where, "Replace decoder");
    step.content = r.string_field(o, "content", where);
    out.push_back(step);
  } else if (type == "Metaspace") {
    step.kind = DecoderStep::Kind::metaspace;
    step.text = r.string_field(o, "replacement", where);
    step.start = metaspace_prepend(r, o, where) == PreTokenizerStep::Prepend::never ? 0 : 1;
    out.push_back(step);
  } else if (type == "ByteFallback") {
    step.kind = DecoderStep::Kind::byte_fallback;
    out.push_back(step);
  } else if (type == "Fuse") {
    step.kind = DecoderStep::Kind::fuse;
    out.push_back(step);
  } else if (type == "BPEDecoder") {  // CLIP's: the end-of-word suffix becomes a space, dropped at the end
    step.kind = DecoderStep::Kind::bpe_suffix;
    step.text = r.member(o, "suffix") ? r.string_field(o, "suffix", where) : std::string("</w>");
    out.push_back(step);
  } else if (type == "WordPiece") {  // "##" pieces join the one before; others get a space
    step.kind = DecoderStep::Kind::word_piece;
    step.text = r.member(o, "prefix") ? r.string_field(o, "prefix", where) : std::string("##");
    step.start = r.flag(o, "cleanup", true, where) ? 1 : 0;
    out.push_back(step);
  } else if (type == "Strip") {
    step.kind = DecoderStep::Kind::strip;
    step.text = r.string_field(o, "content", where);
    step.start = size_t(r.as_int(r.required(o, "start", where), fmt::format("{}.start", where)));
    step.stop = size_t(r.as_int(r.required(o, "stop", where), fmt::format("{}.stop", where)));
    out.push_back(step);
  } else {
    fail(
        "{}: {}: decoder '{}' is not supported (keel reads ByteLevel, Metaspace, Replace, ByteFallback, Fuse, "
        "Strip, BPEDecoder, WordPiece and Sequence)",
        r.origin(), where, type);
  }
}

void read_added_tokens(const Reader& r, element e, std::vector<AddedToken>& out) {
  size_t i = 0;
  for (element token : r.as_array(e, "added_tokens")) {
    const std::string at = fmt::format("added_tokens[{}]", i++);
    object o = r.as_object(token, at);
    AddedToken t;
    t.content = r.as_string(r.required(o, "content", at), at + ".content");
    const int64_t id = r.as_int(r.required(o, "id", at), at + ".id");
    // Below INT32_MAX: the vocabulary size (largest id + 1) must fit in an int32 too.
    require(id >= 0 && id < std::numeric_limits<int32_t>::max(), "{}: {}.id: {} is not a valid token id", r.origin(),
            at, id);
    t.id = int32_t(id);
    t.special = r.flag(o, "special", false, at);
    t.normalized = r.flag(o, "normalized", !t.special, at);
    t.lstrip = r.flag(o, "lstrip", false, at);
    t.rstrip = r.flag(o, "rstrip", false, at);
    t.single_word = r.flag(o, "single_word", false, at);
    out.push_back(std::move(t));
  }
}

// model.vocab: the tokens as the model holds them (bytes when byte-level, else the spelling),
// and each spelling's id, for the merges and unk_token to name tokens by.
struct Vocabulary {
  std::vector<std::pair<std::string, int32_t>> tokens;
  std::unordered_map<std::string_view, int32_t> id_of_spelling;  // views into the parsed file
};

Vocabulary read_vocab(const Reader& r, object model, const std::vector<AddedToken>& added_tokens, bool byte_level) {
  std::unordered_map<int32_t, bool> added_ids;
  for (const auto& t : added_tokens) added_ids[t.id] = true;
  object vocab_object = r.as_object(r.required(model, "vocab", "model"), "model.vocab");
  const size_t vocab_entries = vocab_object.size();
  const size_t id_limit = vocab_entries + added_tokens.size() + kIdSlack;
  Vocabulary vocab;
  vocab.tokens.reserve(vocab_entries);
  vocab.id_of_spelling.reserve(vocab_entries);
  std::string bytes;
  // The places errors name are formatted only for an error: formatting one per entry was a
  // third of loading a 150k-token file.
  for (auto [spelling, value] : vocab_object) {
    auto at = [spelling = spelling] { return fmt::format("model.vocab[{}]", json_quoted(spelling)); };
    int64_t id;
    if (value.get_int64().get(id) != simdjson::SUCCESS) id = r.as_int(value, at());
    // Ids index dense tables, so a vocabulary claiming ids far past its size would make keel
    // allocate for them; real files leave small gaps (reserved ids), hence the slack.
    if (id < 0 || size_t(id) >= id_limit)
      fail("{}: {}: id {} is outside [0, {}) for a vocabulary of {} entries and {} added tokens", r.origin(), at(), id,
           id_limit, vocab_entries, added_tokens.size());
    if (!vocab.id_of_spelling.emplace(spelling, int32_t(id)).second) fail("{}: {} appears twice", r.origin(), at());
    bytes.clear();
    if (!byte_level) {
      vocab.tokens.emplace_back(std::string(spelling), int32_t(id));
      continue;
    }
    if (!bytes_from_byte_level(spelling, bytes)) {
      // Added tokens may sit in the vocabulary with their plain spelling; their content encodes them.
      if (!added_ids.count(int32_t(id)))
        fail("{}: {}: not in the byte-level alphabet (keel reads byte-level BPE)", r.origin(), at());
      continue;
    }
    vocab.tokens.emplace_back(bytes, int32_t(id));
  }
  return vocab;
}

// model.merges, as pairs of ids: "left right" strings or ["left", "right"] pairs.
std::vector<std::pair<int32_t, int32_t>> read_merges(const Reader& r, element e, const Vocabulary& vocab) {
  std::vector<std::pair<int32_t, int32_t>> merges;
  array merges_array = r.as_array(e, "model.merges");
  merges.reserve(merges_array.size());
  size_t i = 0;
  for (element m : merges_array) {
    const size_t index = i++;
    auto at = [index] { return fmt::format("model.merges[{}]", index); };
    std::string_view left, right;
    std::string_view line;
    array pair;
    if (m.get_string().get(line) == simdjson::SUCCESS) {
      // "a b": byte-level spellings never contain a space (the space byte is spelled 'Ġ').
      const size_t space = line.find(' ');
      if (space == std::string_view::npos || line.find(' ', space + 1) != std::string_view::npos)
        r.bad(at(), "\"left right\" (two tokens separated by one space)");
      left = line.substr(0, space);
      right = line.substr(space + 1);
    } else if (m.get_array().get(pair) == simdjson::SUCCESS && pair.size() == 2 &&
               pair.at(0).get_string().get(left) == simdjson::SUCCESS &&
               pair.at(1).get_string().get(right) == simdjson::SUCCESS) {
      // ["left", "right"], as tokenizers >= 0.20 writes them
    } else {
      pair = r.as_array(m, at());
      if (pair.size() != 2) r.bad(at(), "a pair [\"left\", \"right\"]");
      left = r.as_string(pair.at(0).value_unsafe(), at());
      right = r.as_string(pair.at(1).value_unsafe(), at());
    }
    auto a = vocab.id_of_spelling.find(left), b = vocab.id_of_spelling.find(right);
    if (a == vocab.id_of_spelling.end())
      fail("{}: {}: token {} is not in model.vocab", r.origin(), at(), json_quoted(left));
    if (b == vocab.id_of_spelling.end())
      fail("{}: {}: token {} is not in model.vocab", r.origin(), at(), json_quoted(right));
    merges.emplace_back(a->second, b->second);
  }
  return merges;
}

// The model's flags, word-piece marks and unk_token.
BytePairModel::MergeOptions read_merge_options(const Reader& r, object model, const Vocabulary& vocab,
                                               bool byte_level) {
  BytePairModel::MergeOptions options;
  options.ignore_merges = r.flag(model, "ignore_merges", false, "model");
  options.fuse_unk = r.flag(model, "fuse_unk", false, "model");
  options.char_level = !byte_level;
  options.byte_fallback = r.flag(model, "byte_fallback", false, "model");
  // Word-piece marks, spelled like the vocabulary (byte-level: in its alphabet) and kept as bytes.
  for (auto [key, mark] : {std::pair{"continuing_subword_prefix", &options.continuing_subword_prefix},
                           std::pair{"end_of_word_suffix", &options.end_of_word_suffix}}) {
    auto e = r.member(model, key);
    if (!e) continue;
    const std::string at = fmt::format("model.{}", key);
    const std::string_view spelling = r.as_string(*e, at);
    if (!byte_level) {
      mark->assign(spelling);
    } else if (!bytes_from_byte_level(spelling, *mark)) {
      r.bad(at, "a string in the byte-level alphabet");
    }
  }
  if (auto unk = r.member(model, "unk_token")) {
    std::string_view name = r.as_string(*unk, "model.unk_token");
    auto found = vocab.id_of_spelling.find(name);
    if (found == vocab.id_of_spelling.end())
      fail("{}: model.unk_token {} is not in model.vocab", r.origin(), json_quoted(name));
    options.unk_id = found->second;
  }
  return options;
}

// The "model" section: a BPE model (its vocabulary, merges and options).
BytePairModel read_model(const Reader& r, object root, const std::vector<AddedToken>& added_tokens, bool byte_level) {
  object model = r.as_object(r.required(root, "model", "the top level"), "model");
  if (auto type = r.member(model, "type")) {
    std::string_view t = r.as_string(*type, "model.type");
    require(t == "BPE", "{}: model.type: '{}' is not supported (keel reads BPE)", r.origin(), t);
  }
  if (auto dropout = r.member(model, "dropout")) {
    double p = 0;
    if (dropout->get_double().get(p) != simdjson::SUCCESS) r.bad("model.dropout", "a number or null");
    require(p == 0, "{}: model.dropout {} is not supported (keel encodes deterministically)", r.origin(), p);
  }
  const Vocabulary vocab = read_vocab(r, model, added_tokens, byte_level);
  std::vector<std::pair<int32_t, int32_t>> merges;
  if (auto merges_element = r.member(model, "merges")) merges = read_merges(r, *merges_element, vocab);
  const BytePairModel::MergeOptions options = read_merge_options(r, model, vocab, byte_level);
  return BytePairModel::from_merges(vocab.tokens, merges, options, r.origin());
}

// BOS/EOS by name from tokenizer_config.json: "bos_token": "<s>" or {"content": "<s>", ...}.
std::optional<int32_t> config_token(const Tokenizer& tokenizer, object config, std::string_view key,
                                    const std::string& origin) {
  element e;
  if (config.at_key(key).get(e) != simdjson::SUCCESS || e.is_null()) return std::nullopt;
  const auto name = config_token_text(e);
  if (!name) fail("{}: {}: expected a string or an object with 'content'", origin, key);
  auto id = tokenizer.token_to_id(*name);
  if (!id) fail("{}: {} '{}' is not a token of the tokenizer", origin, key, *name);
  return id;
}

// tokenizer_config.json's bos_token and eos_token, where it names them, over the post-processor's.
void apply_config(Tokenizer& tokenizer, std::string_view config_json, const std::string& origin) {
  const std::string config_origin = origin + " (tokenizer_config.json)";
  simdjson::dom::parser config_parser;
  element config_element;
  auto error = parse_json_document(config_parser, config_json, config_element);
  if (error) fail("{}: not valid JSON ({})", config_origin, simdjson::error_message(error));
  object config;
  if (config_element.get_object().get(config) != simdjson::SUCCESS)
    fail("{}: expected an object at the top level", config_origin);
  auto bos = config_token(tokenizer, config, "bos_token", config_origin);
  auto eos = config_token(tokenizer, config, "eos_token", config_origin);
  tokenizer.set_bos_eos(bos ? bos : tokenizer.bos_id(), eos ? eos : tokenizer.eos_id());
}

}  // namespace

std::optional<std::string_view> config_token_text(simdjson::dom::element e) {
  std::string_view s;
  if (e.get_string().get(s) == simdjson::SUCCESS) return s;
  if (e.is_object() && e["content"].get_string().get(s) == simdjson::SUCCESS) return s;
  return std::nullopt;
}

Tokenizer hf_tokenizer_from_json(std::string_view json, const std::string& origin, std::string_view config_json) {
  Reader r(origin);
  simdjson::dom::parser parser;
  element root_element;
  auto error = parse_json_document(parser, json, root_element);
  if (error) fail("{}: not valid JSON ({})", origin, simdjson::error_message(error));
  object root = r.as_object(root_element, "the top level");

  TokenizerParts parts;
  parts.origin = origin;
  parts.byte_level_names = true;
  if (auto added = r.member(root, "added_tokens")) read_added_tokens(r, *added, parts.added_tokens);
  if (auto normalizer = r.member(root, "normalizer")) read_normalizer(r, *normalizer, "normalizer", parts.normalizers);
  bool byte_level = false;
  if (auto pre = r.member(root, "pre_tokenizer"))
    read_pre_tokenizer(r, *pre, "pre_tokenizer", parts.pre_tokenizer, byte_level);
  if (auto post = r.member(root, "post_processor")) read_post_processor(r, *post, "post_processor", parts);
  if (auto decoder = r.member(root, "decoder")) read_decoder(r, *decoder, "decoder", byte_level, parts.decoders);
  // Without ByteLevel anywhere this is SentencePiece-style BPE (Llama 2, Gemma, Mistral): tokens
  // are spelled in plain UTF-8, a piece starts as characters, and the decoder chain runs.
  parts.byte_level_names = byte_level;
  if (byte_level) parts.decoders.clear();  // ByteLevel decodes to the tokens' bytes
  parts.model = read_model(r, root, parts.added_tokens, byte_level);
  if (!parts.template_prefix.empty()) parts.bos_id = parts.template_prefix.front();
  if (!parts.template_suffix.empty()) parts.eos_id = parts.template_suffix.back();
  Tokenizer tokenizer(std::move(parts));
  if (!config_json.empty()) apply_config(tokenizer, config_json, origin);
  return tokenizer;
}

Tokenizer load_hf_tokenizer_json(const std::string& path) {
  const std::string json = read_file(path);
  const size_t slash = path.rfind('/');
  const std::string config_path =
      (slash == std::string::npos ? "" : path.substr(0, slash + 1)) + "tokenizer_config.json";
  return hf_tokenizer_from_json(json, path, path_exists(config_path) ? read_file(config_path) : std::string());
}

}  // namespace keel::data
