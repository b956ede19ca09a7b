#include "keel/data/token_records.h"

#include <simdjson.h>

#include "keel/core/error.h"
#include "keel/core/file_io.h"

namespace keel::data {
namespace {

constexpr int32_t kIgnore = -100;

void append_ids(simdjson::dom::element value, const char* field, const std::string& at, int64_t vocab,
                bool allow_ignore, std::vector<int32_t>& out) {
  simdjson::dom::array array;
  require(value.get_array().get(array) == simdjson::SUCCESS, "{}: field '{}' must be an array of integers", at,
          field);
  for (auto item : array) {
    int64_t v;
    require(item.get_int64().get(v) == simdjson::SUCCESS, "{}: field '{}' must contain only integers", at, field);
    require((v >= 0 && v < vocab) || (allow_ignore && v == kIgnore),
            "{}: field '{}' holds {}, outside the vocabulary [0, {}){}", at, field, v, vocab,
            allow_ignore ? " and not -100" : "");
    out.push_back(int32_t(v));
  }
}

}  // namespace

TokenRecords read_token_records(const std::string& path, int64_t vocab_size) {
  require(path_exists(path), "{}: the data file does not exist", path);
  simdjson::padded_string text;
  auto load_error = simdjson::padded_string::load(path).get(text);
  require(load_error == simdjson::SUCCESS, "{}: cannot read the data file ({})", path,
          simdjson::error_message(load_error));
  TokenRecords records;
  records.offsets.push_back(0);
  simdjson::dom::parser parser;
  std::string_view all(text.data(), text.size());
  size_t line_start = 0;
  for (int64_t line_no = 1; line_start < all.size(); ++line_no) {
    size_t end = all.find('\n', line_start);
    if (end == std::string_view::npos) end = all.size();
    std::string_view line = all.substr(line_start, end - line_start);
    line_start = end + 1;
    if (line.find_first_not_of(" \t\r") == std::string_view::npos) continue;
    const std::string at = fmt::format("{}:{}", path, line_no);
    simdjson::dom::element doc;
    auto err = parser.parse(line.data(), line.size()).get(doc);
    require(err == simdjson::SUCCESS, "{}: invalid JSON ({})", at, simdjson::error_message(err));
    simdjson::dom::object object;
    require(doc.get_object().get(object) == simdjson::SUCCESS, "{}: expected a JSON object per line", at);
    simdjson::dom::element ids, labels;
    require(object["input_ids"].get(ids) == simdjson::SUCCESS, "{}: missing field 'input_ids'", at);
    const size_t begin = records.input_ids.size();
    append_ids(ids, "input_ids", at, vocab_size, false, records.input_ids);
    const size_t n = records.input_ids.size() - begin;
    require(n > 0, "{}: field 'input_ids' is empty", at);
    if (object["labels"].get(labels) == simdjson::SUCCESS) {
      append_ids(labels, "labels", at, vocab_size, true, records.labels);
      require(records.labels.size() - begin == n, "{}: 'labels' has {} entries but 'input_ids' has {}", at,
              records.labels.size() - begin, n);
    } else {
      records.labels.insert(records.labels.end(), records.input_ids.begin() + begin, records.input_ids.end());
    }
    records.offsets.push_back(int64_t(records.input_ids.size()));
  }
  require(records.size() > 0, "{}: no records (expected JSONL lines with \"input_ids\")", path);
  return records;
}

}  // namespace keel::data
