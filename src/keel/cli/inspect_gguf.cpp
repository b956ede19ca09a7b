#include "keel/cli/inspect_gguf.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <map>
#include <vector>

#include "keel/cli/stdin_lines.h"
#include "keel/core/json_text.h"
#include "keel/formats/gguf_dequantize.h"
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

// min, max, mean, RMS and the NaN/inf count of a tensor's values, dequantized a slab of rows at a
// time (the peak is the slab, not the tensor).
std::string value_stats(const formats::GgufFile& file, const formats::GgufTensorInfo& t) {
  if (!formats::ggml_can_dequantize(t.type))
    return fmt::format("(values not read: keel reads {})", formats::ggml_dequantizable_types());
  const auto* traits = formats::ggml_type_traits(t.type);
  const int64_t row = t.shape.back();
  const int64_t rows = t.elements() / row;
  const int64_t slab_rows = std::max<int64_t>(1, (int64_t(1) << 20) / row);
  const auto bytes = file.tensor_bytes(t);
  const uint64_t row_bytes = uint64_t(row / traits->block_size * traits->type_size);
  std::vector<float> values(size_t(std::min(rows, slab_rows) * row));
  double sum = 0, squares = 0;
  float lo = std::numeric_limits<float>::infinity(), hi = -lo;
  int64_t nonfinite = 0;
  for (int64_t r = 0; r < rows; r += slab_rows) {
    const int64_t n = std::min(slab_rows, rows - r) * row;
    formats::ggml_dequantize(t.type, bytes.data() + uint64_t(r) * row_bytes, n, values.data());
    for (int64_t i = 0; i < n; ++i) {
      const float v = values[size_t(i)];
      if (!std::isfinite(v)) {
        ++nonfinite;
        continue;
      }
      lo = std::min(lo, v), hi = std::max(hi, v);
      sum += v, squares += double(v) * v;
    }
  }
  const double finite = double(t.elements() - nonfinite);
  std::string out = finite > 0 ? fmt::format("min {:.6g} max {:.6g} mean {:.6g} rms {:.6g}", lo, hi, sum / finite,
                                             std::sqrt(squares / finite))
                               : std::string("no finite value");
  if (nonfinite) out += fmt::format("  {} NaN or inf", nonfinite);
  return out;
}

}  // namespace

void inspect_gguf(const std::string& path, int64_t tensor_limit, bool stats) {
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
    fmt::print("  {:<{}}  {:<7} {:<18} {:.2f} MB{}\n", t.name, width, formats::ggml_type_traits(t.type)->name,
               shape_text(t.shape), double(t.nbytes) / 1e6, stats ? "  " + value_stats(file, t) : "");
  }
  std::string types;
  for (const auto& [name, cb] : by_type)
    types += fmt::format("{}{} {} ({:.1f} MB)", types.empty() ? "" : ", ", cb.first, name, double(cb.second) / 1e6);
  fmt::print("by type: {}\n", types);
}

}  // namespace keel::cli
