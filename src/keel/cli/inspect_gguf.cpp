#include "keel/cli/inspect_gguf.h"

#include <fmt/format.h>

#include <algorithm>
#include <map>

#include "keel/cli/stdin_lines.h"
#include "keel/core/json_text.h"
#include "keel/formats/gguf_reader.h"

namespace keel::cli {
namespace {

using formats::GgufEntry;
using formats::GgufValueType;

constexpr size_t kShownElements = 4;    // of an array
constexpr size_t kShownChars = 60;      // of a string

std::string shown_string(const std::string& s) {
  const std::string head = valid_utf8(s.substr(0, kShownChars));
  return s.size() > kShownChars ? fmt::format("{}... ({} bytes)", json_quoted(head), s.size()) : json_quoted(head);
}

std::string shown_number(const GgufEntry& e, double v) {
  if (e.type == GgufValueType::Bool || e.element == GgufValueType::Bool) return v != 0 ? "true" : "false";
  return fmt::format("{:g}", v);
}

std::string shown_value(const GgufEntry& e) {
  if (e.type == GgufValueType::String) return shown_string(e.string);
  if (!e.is_array()) return e.type == GgufValueType::Bool ? shown_number(e, e.number)
         : (e.type == GgufValueType::Float32 || e.type == GgufValueType::Float64) ? fmt::format("{:g}", e.number)
                                                                                 : std::to_string(e.integer);
  std::string out = fmt::format("[{} {}: ", e.count, e.element == GgufValueType::String ? "strings" : "values");
  for (size_t i = 0; i < std::min<size_t>(kShownElements, e.count); ++i) {
    if (i) out += ", ";
    out += e.element == GgufValueType::String ? shown_string(e.strings[i]) : shown_number(e, e.numbers[i]);
  }
  return out + (e.count > kShownElements ? ", ...]" : "]");
}

std::string shape_text(const std::vector<int64_t>& shape) {
  std::string out = "[";
  for (size_t i = 0; i < shape.size(); ++i) out += fmt::format("{}{}", i ? ", " : "", shape[i]);
  return out + "]";
}

}  // namespace

void inspect_gguf(const std::string& path, int64_t tensor_limit) {
  const formats::GgufFile file(path);
  uint64_t data_bytes = 0;
  int64_t parameters = 0;
  std::map<std::string, std::pair<int64_t, uint64_t>> by_type;  // type -> tensors, bytes
  for (const auto& t : file.tensors()) {
    data_bytes += t.nbytes;
    parameters += t.elements();
    auto& [count, bytes] = by_type[formats::ggml_type_traits(t.type)->name];
    ++count;
    bytes += t.nbytes;
  }
  fmt::print("{}: GGUF version {}, {} metadata keys, {} tensors, {} parameters, {:.1f} MB of tensor data\n", path,
             file.version(), file.metadata().size(), file.tensors().size(), parameters, double(data_bytes) / 1e6);
  for (const auto& e : file.metadata()) fmt::print("  {} = {}\n", e.key, shown_value(e));
  fmt::print("tensors ({} shown of {}):\n", std::min<int64_t>(tensor_limit, int64_t(file.tensors().size())),
             file.tensors().size());
  size_t width = 0;
  for (const auto& t : file.tensors()) width = std::max(width, t.name.size());
  int64_t shown = 0;
  for (const auto& t : file.tensors()) {
    if (shown++ >= tensor_limit) break;
    fmt::print("  {:<{}}  {:<7} {:<18} {:.2f} MB\n", t.name, width, formats::ggml_type_traits(t.type)->name,
               shape_text(t.shape), double(t.nbytes) / 1e6);
  }
  std::string types;
  for (const auto& [name, cb] : by_type)
    types += fmt::format("{}{} {} ({:.1f} MB)", types.empty() ? "" : ", ", cb.first, name, double(cb.second) / 1e6);
  fmt::print("by type: {}\n", types);
}

}  // namespace keel::cli
