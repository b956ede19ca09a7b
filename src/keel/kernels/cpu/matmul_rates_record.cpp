#include "keel/kernels/cpu/matmul_rates_record.h"

#include <fmt/format.h>

#include <cmath>
#include <cstdlib>
#include <ctime>
#include <exception>
#include <filesystem>
#include <fstream>
#include <vector>

#include "keel/core/file_io.h"
#include "keel/core/json_text.h"

namespace keel::kernels {
namespace {

struct Entry {
  std::string machine, measured_on;
  double bf16_flops = 0, f32_flops = 0;
};

// The file's entries; none when it is absent, unreadable or not a record (it is then rewritten).
std::vector<Entry> read_entries(const std::string& path) {
  std::vector<Entry> entries;
  try {
    if (!path_exists(path)) return entries;
    const std::string text = read_file(path, size_t(1) << 20);
    simdjson::dom::parser parser;
    simdjson::dom::element root;
    simdjson::dom::array machines;
    std::string_view format;
    if (parse_json_document(parser, text, root) != simdjson::SUCCESS ||
        root["format"].get_string().get(format) != simdjson::SUCCESS || format != "keel-matmul-rates" ||
        root["machines"].get_array().get(machines) != simdjson::SUCCESS)
      return entries;
    for (simdjson::dom::element m : machines) {
      Entry e;
      std::string_view machine, day;
      if (m["machine"].get_string().get(machine) != simdjson::SUCCESS ||
          m["measured_on"].get_string().get(day) != simdjson::SUCCESS ||
          m["bf16_flops"].get_double().get(e.bf16_flops) != simdjson::SUCCESS ||
          m["f32_flops"].get_double().get(e.f32_flops) != simdjson::SUCCESS)
        continue;  // a damaged entry is measured again
      if (!(e.bf16_flops > 0 && e.f32_flops > 0 && std::isfinite(e.bf16_flops) && std::isfinite(e.f32_flops))) continue;
      e.machine = machine;
      e.measured_on = day;
      entries.push_back(std::move(e));
    }
  } catch (const std::exception&) {
    entries.clear();  // unreadable: measure, and rewrite it if we can
  }
  return entries;
}

std::string record_json(const std::vector<Entry>& entries) {
  std::string out =
      "{\n  \"format\": \"keel-matmul-rates\",\n  \"version\": 1,\n"
      "  \"about\": \"oneDNN matmul rates keel measured on this machine to choose how bf16 products run "
      "(docs/design.md); delete this file to measure again\",\n  \"machines\": [";
  for (size_t i = 0; i < entries.size(); ++i) {
    const Entry& e = entries[i];
    out += fmt::format(
        "{}\n    {{\"machine\": \"{}\", \"measured_on\": \"{}\", \"bf16_flops\": {:.6e}, "
        "\"f32_flops\": {:.6e}}}",
        i ? "," : "", json_escaped(e.machine), json_escaped(e.measured_on), e.bf16_flops, e.f32_flops);
  }
  return out + "\n  ]\n}\n";
}

std::string today() {
  const std::time_t now = std::time(nullptr);
  std::tm tm{};
  gmtime_r(&now, &tm);
  char day[16];
  std::strftime(day, sizeof day, "%Y-%m-%d", &tm);
  return day;
}

}  // namespace

RecordedRates recorded_rates(const std::string& path, const std::string& machine,
                             const std::function<std::pair<double, double>()>& measure) {
  std::vector<Entry> entries = path.empty() ? std::vector<Entry>{} : read_entries(path);
  for (const Entry& e : entries)
    if (e.machine == machine) return {e.bf16_flops, e.f32_flops, e.measured_on, true, true};
  RecordedRates r;
  std::tie(r.bf16_flops, r.f32_flops) = measure();
  r.measured_on = today();
  if (path.empty()) return r;
  entries.push_back({machine, r.measured_on, r.bf16_flops, r.f32_flops});
  try {
    make_dirs(std::filesystem::path(path).parent_path().string());
    write_file_atomic(path, record_json(entries));
    r.kept = true;
  } catch (const std::exception&) {
    // A read-only home or a full disk: this process decides from its own measurement.
  }
  return r;
}

std::string matmul_rates_path() {
  const char* xdg = std::getenv("XDG_CACHE_HOME");
  if (xdg != nullptr && *xdg == '/') return std::string(xdg) + "/keel/matmul-rates.json";
  const char* home = std::getenv("HOME");
  if (home != nullptr && *home == '/') return std::string(home) + "/.cache/keel/matmul-rates.json";
  return "";
}

std::string cpu_model_name() {
  std::ifstream cpuinfo("/proc/cpuinfo");
  std::string line;
  while (std::getline(cpuinfo, line))
    if (line.rfind("model name", 0) == 0) {
      const size_t colon = line.find(':');
      if (colon == std::string::npos) break;
      const size_t first = line.find_first_not_of(" \t", colon + 1);
      return first == std::string::npos ? "" : line.substr(first);
    }
  return "";
}

}  // namespace keel::kernels
