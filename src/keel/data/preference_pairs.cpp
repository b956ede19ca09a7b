#include "keel/data/preference_pairs.h"

#include <fmt/format.h>
#include <fmt/ostream.h>
#include <simdjson.h>

#include <algorithm>
#include <fstream>

#include "keel/core/checksum.h"
#include "keel/core/error.h"
#include "keel/core/file_io.h"
#include "keel/core/json_text.h"
#include "keel/data/chat_encoding.h"
#include "keel/data/model_chat_template.h"
#include "keel/data/tokenizer.h"

namespace keel::data {
namespace {

using simdjson::dom::element;

size_t common_prefix_length(std::span<const int32_t> a, std::span<const int32_t> b) {
  const size_t n = std::min(a.size(), b.size());
  size_t i = 0;
  while (i < n && a[i] == b[i]) ++i;
  return i;
}

// The length, in bytes, of the first `count` code points of UTF-8 text (Python slices strings by
// code points, and trl.extract_prompt cuts where the characters first differ).
size_t code_point_bytes(std::string_view s, size_t count) {
  size_t at = 0;
  for (size_t k = 0; k < count && at < s.size(); ++k) {
    ++at;
    while (at < s.size() && (uint8_t(s[at]) & 0xC0) == 0x80) ++at;
  }
  return at;
}
std::vector<std::string_view> code_points(std::string_view s) {
  std::vector<std::string_view> out;
  for (size_t at = 0; at < s.size();) {
    const size_t n = code_point_bytes(s.substr(at), 1);
    out.push_back(s.substr(at, n));
    at += n;
  }
  return out;
}

// trl.extract_prompt's cut: the first index where chosen and rejected differ; a space before it is
// left to the answers. When one is a prefix of the other the loop ends without a break and Python's
// loop variable is left at the last index compared (min length - 1): the same cut here.
template <class Item>
size_t implicit_prompt_length(const std::vector<Item>& chosen, const std::vector<Item>& rejected,
                              bool space_moves_back) {
  const size_t n = std::min(chosen.size(), rejected.size());
  if (n == 0) return 0;
  for (size_t i = 0; i < n; ++i)
    if (chosen[i] != rejected[i]) return space_moves_back && i > 0 && chosen[i - 1] == Item(" ") ? i - 1 : i;
  return n - 1;
}

// A message list's items as JSON text (what equality between two messages compares).
std::string messages_json(element list, std::vector<std::string>& items, const char* field) {
  simdjson::dom::array array;
  if (list.get_array().get(array) != simdjson::SUCCESS) return fmt::format("field '{}' is not a list of messages", field);
  items.clear();
  for (element m : array) {
    if (!m.is_object()) return fmt::format("{}[{}] is not a message (an object with 'role' and 'content')", field,
                                           items.size());
    items.push_back(simdjson::minify(m));
  }
  return {};
}

std::string join_messages(std::span<const std::string> a, std::span<const std::string> b) {
  std::string out = "[";
  for (auto part : {a, b})
    for (const auto& m : part) out += (out.size() > 1 ? "," : "") + m;
  return out + "]";
}

// `messages` (JSON text of a list) and the record's tools through the model's template.
std::string encode_conversation(const std::string& messages, const std::string& tools, bool generation_prompt,
                                const ChatTemplateEncoder& chat, std::vector<int32_t>& ids) {
  const std::string record = "{\"messages\":" + messages + (tools.empty() ? "" : ",\"tools\":" + tools) + "}";
  simdjson::dom::parser parser;
  element root;
  if (parse_json_document(parser, record, root) != simdjson::SUCCESS) return "the messages are not valid JSON";
  ChatInput input;
  std::string why = chat_input_from_record(root, input);
  if (!why.empty()) return why;
  input.add_generation_prompt = generation_prompt;
  try {
    ids = chat.encode(input).ids;
  } catch (const Error& e) {
    return e.what();
  }
  return {};
}

std::string tokenize_conversation(element record, element chosen, element rejected, bool has_prompt,
                                  const PairEncoding& enc, TokenizedPair& out, std::vector<int32_t> (&full)[3]) {
  if (!enc.model_template)
    return "conversational pairs go through the model's chat template, and this run has none (chat_template names a "
           "built-in format or none; give the model's template: chat_template = \"model\" or a .jinja file)";
  std::vector<std::string> prompt, answers[2];
  std::string why = messages_json(chosen, answers[0], "chosen");
  if (why.empty()) why = messages_json(rejected, answers[1], "rejected");
  if (!why.empty()) return why;
  if (has_prompt) {
    element p = record["prompt"].value_unsafe();
    if (!p.is_array()) return "field 'prompt' is a string but 'chosen' is a list of messages (give both as messages)";
    why = messages_json(p, prompt, "prompt");
    if (!why.empty()) return why;
  } else {  // implicit prompt: the messages chosen and rejected start with alike
    const size_t n = implicit_prompt_length(answers[0], answers[1], false);
    prompt.assign(answers[0].begin(), answers[0].begin() + std::ptrdiff_t(n));
    for (auto& a : answers) a.erase(a.begin(), a.begin() + std::ptrdiff_t(n));
  }
  std::string_view system;
  if (record["system"].get(system) == simdjson::SUCCESS && !system.empty())
    prompt.insert(prompt.begin(), fmt::format("{{\"role\":\"system\",\"content\":\"{}\"}}", json_escaped(system)));
  std::string tools;
  element t;
  if (record["tools"].get(t) == simdjson::SUCCESS && !t.is_null()) {
    std::string_view text;  // TRL accepts tools as a JSON string too
    tools = t.get(text) == simdjson::SUCCESS ? std::string(text) : simdjson::minify(t);
  }
  if (prompt.empty()) return "empty prompt: no message before the answers";
  why = encode_conversation(join_messages(prompt, {}), tools, true, *enc.model_template, out.prompt);
  for (int k = 0; k < 2 && why.empty(); ++k)
    why = encode_conversation(join_messages(prompt, answers[k]), tools, false, *enc.model_template, full[k + 1]);
  return why;
}

std::string tokenize_strings(element record, element chosen, element rejected, bool has_prompt,
                             const PairEncoding& enc, TokenizedPair& out, std::vector<int32_t> (&full)[3]) {
  std::string_view c, r, p;
  if (chosen.get(c) != simdjson::SUCCESS || rejected.get(r) != simdjson::SUCCESS)
    return "fields 'chosen' and 'rejected' must both be strings or both lists of messages";
  std::string prompt, answers[2] = {std::string(c), std::string(r)};
  if (has_prompt) {
    if (record["prompt"].get(p) != simdjson::SUCCESS) return "field 'prompt' must be a string as 'chosen' is";
    prompt = p;
  } else {
    const auto cc = code_points(c), rc = code_points(r);
    const size_t n = implicit_prompt_length(cc, rc, true);
    prompt = std::string(c.substr(0, code_point_bytes(c, n)));
    for (auto& a : answers) a.erase(0, code_point_bytes(a, n));
  }
  if (prompt.empty()) return "empty prompt";
  const auto eos = enc.tokenizer->eos_id();
  if (!eos)
    return "plain-string answers end with the tokenizer's EOS (as TRL appends it), and this tokenizer has none";
  const std::string eos_text = enc.tokenizer->decode(std::span<const int32_t>(&*eos, 1));
  const EncodeOptions with_specials{.add_special_tokens = true};
  out.prompt = enc.tokenizer->encode(prompt, with_specials);
  for (int k = 0; k < 2; ++k) {
    if (!answers[k].ends_with(eos_text)) answers[k] += eos_text;
    full[k + 1] = enc.tokenizer->encode(prompt + answers[k], with_specials);
  }
  return {};
}

}  // namespace

std::span<const int32_t> PreferencePairs::span(int64_t i, int part) const {
  const Pair& p = pairs_[size_t(i)];
  int64_t at = p.start;
  for (int k = 0; k < part; ++k) at += p.lengths[k];
  return {ids_.data() + at, size_t(p.lengths[part])};
}

void PreferencePairs::add(std::span<const int32_t> prompt, std::span<const int32_t> chosen,
                          std::span<const int32_t> rejected, int64_t line) {
  Pair p{int64_t(ids_.size()), {int64_t(prompt.size()), int64_t(chosen.size()), int64_t(rejected.size())}, line};
  for (auto part : {prompt, chosen, rejected}) ids_.insert(ids_.end(), part.begin(), part.end());
  pairs_.push_back(p);
}

uint64_t PreferencePairs::checksum() const {
  std::vector<int64_t> lengths;
  lengths.reserve(pairs_.size() * 3);
  for (const auto& p : pairs_) lengths.insert(lengths.end(), std::begin(p.lengths), std::end(p.lengths));
  const uint64_t parts[2] = {keel::checksum(ids_.data(), ids_.size() * sizeof(int32_t)),
                             keel::checksum(lengths.data(), lengths.size() * sizeof(int64_t))};
  return keel::checksum(parts, sizeof(parts));
}

bool is_preference_record(std::string_view line) {
  simdjson::dom::parser parser;
  element root;
  if (parse_json_document(parser, line, root) != simdjson::SUCCESS || !root.is_object()) return false;
  element e;
  return root["chosen"].get(e) == simdjson::SUCCESS && root["rejected"].get(e) == simdjson::SUCCESS;
}

bool holds_preference_pairs(const std::string& path) {
  if (!path_exists(path) || !path.ends_with(".jsonl")) return false;
  bool pair = false, seen = false;
  for_each_line(path, size_t(64) << 20, [&](std::string_view line, bool complete) {
    if (seen || !complete || line.find_first_not_of(" \t\r") == std::string_view::npos) return;
    seen = true;
    pair = is_preference_record(line);
  });
  return pair;
}

std::string tokenize_pair(std::string_view line, const PairEncoding& enc, TokenizedPair& out) {
  simdjson::dom::parser parser;
  element record;
  if (const auto error = parse_json_document(parser, line, record); error != simdjson::SUCCESS)
    return fmt::format("not valid JSON ({})", simdjson::error_message(error));
  if (!record.is_object()) return "not a JSON object";
  element chosen, rejected, prompt;
  if (record["chosen"].get(chosen) != simdjson::SUCCESS) return "missing field 'chosen' (a preference pair has "
                                                                "'chosen' and 'rejected', and 'prompt' unless implicit)";
  if (record["rejected"].get(rejected) != simdjson::SUCCESS) return "missing field 'rejected'";
  const bool has_prompt = record["prompt"].get(prompt) == simdjson::SUCCESS && !prompt.is_null();
  std::vector<int32_t> full[3];
  const std::string why = chosen.is_array() != rejected.is_array()
                              ? "fields 'chosen' and 'rejected' must both be strings or both lists of messages"
                          : chosen.is_array() ? tokenize_conversation(record, chosen, rejected, has_prompt, enc, out, full)
                                              : tokenize_strings(record, chosen, rejected, has_prompt, enc, out, full);
  if (!why.empty()) return why;
  // TRL's rule: the answers start where the prompt's ids and prompt + answer's part.
  const size_t prompt_len =
      std::min(common_prefix_length(out.prompt, full[1]), common_prefix_length(out.prompt, full[2]));
  out.prompt.resize(prompt_len);
  out.chosen.assign(full[1].begin() + std::ptrdiff_t(prompt_len), full[1].end());
  out.rejected.assign(full[2].begin() + std::ptrdiff_t(prompt_len), full[2].end());
  if (out.prompt.empty()) return "empty prompt: the tokenized prompt shares no token with prompt + answer";
  if (out.chosen.empty()) return "empty chosen answer (no token of its own)";
  if (out.rejected.empty()) return "empty rejected answer (no token of its own)";
  if (out.chosen == out.rejected) return "chosen and rejected are the same answer";
  for (const auto* part : {&out.prompt, &out.chosen, &out.rejected})
    for (int32_t id : *part)
      if (enc.vocab_size > 0 && id >= enc.vocab_size)
        return fmt::format("token id {} is outside the model's vocabulary ({})", id, enc.vocab_size);
  return {};
}

PreferencePairs read_preference_pairs(const std::string& path, const PairEncoding& enc, double max_bad_fraction,
                                      std::ostream& log) {
  require(enc.tokenizer != nullptr, "{}: preference pairs need a tokenizer", path);
  std::ifstream in(path, std::ios::binary);
  require(bool(in), "{}: cannot open", path);
  PreferencePairs pairs;
  std::string line, first_bad;
  TokenizedPair pair;
  int64_t number = 0;
  const size_t T = size_t(enc.max_seq_len);
  while (std::getline(in, line)) {
    ++number;
    if (!line.empty() && line.back() == '\r') line.pop_back();
    if (line.find_first_not_of(" \t") == std::string::npos) continue;
    ++pairs.records;
    const std::string why = tokenize_pair(line, enc, pair);
    if (!why.empty()) {
      if (pairs.bad < 10) fmt::print(log, "  {}:{}: {}\n", path, number, why);
      if (first_bad.empty()) first_bad = fmt::format("{}:{}: {}", path, number, why);
      ++pairs.bad;
      continue;
    }
    if (pair.prompt.size() >= T) {  // TRL drops it: keep_start would leave no answer token
      ++pairs.dropped;
      continue;
    }
    const size_t room = T - pair.prompt.size();
    pairs.truncated += pair.chosen.size() > room || pair.rejected.size() > room;
    pairs.add(pair.prompt, std::span(pair.chosen).first(std::min(room, pair.chosen.size())),
              std::span(pair.rejected).first(std::min(room, pair.rejected.size())), number);
  }
  require(pairs.records > 0, "{}: no records (a preference pair per line: {{\"prompt\", \"chosen\", \"rejected\"}})",
          path);
  require(double(pairs.bad) <= max_bad_fraction * double(pairs.records),
          "{}: {} of {} pairs are bad ({:.2f}%, above the {}% allowed by max_bad_fraction); the first: {}", path,
          pairs.bad, pairs.records, 100.0 * double(pairs.bad) / double(pairs.records), 100 * max_bad_fraction,
          first_bad);
  require(pairs.size() > 0, "{}: no usable pairs ({} bad, {} whose prompt alone fills max_seq_len = {})", path,
          pairs.bad, pairs.dropped, enc.max_seq_len);
  fmt::print(log,
             "keel: {} of {} preference pairs of {} kept ({} bad, {} dropped: the prompt alone fills max_seq_len = "
             "{}; {} with an answer cut at it)\n",
             pairs.size(), pairs.records, path, pairs.bad, pairs.dropped, enc.max_seq_len, pairs.truncated);
  return pairs;
}

}  // namespace keel::data
