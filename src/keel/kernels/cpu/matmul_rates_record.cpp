#include "keel/kernels/cpu/matmul_rates_record.h"

#include <fcntl.h>
#include <fmt/format.h>
#include <sys/file.h>
#include <sys/utsname.h>
#include <unistd.h>

#include <cerrno>
#include <cmath>
#include <cstdlib>
#include <ctime>
#include <exception>
#include <filesystem>
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

// An exclusive flock on a file beside the record, for as long as it lives; nothing where the file
// cannot be made (a read-only directory: the record cannot be written either).
class RecordLock {
 public:
  explicit RecordLock(const std::string& path) {
    if (path.empty()) return;
    try {
      make_dirs(std::filesystem::path(path).parent_path().string());
    } catch (const std::exception&) {
      return;
    }
    fd_ = ::open((path + ".lock").c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0644);
    if (fd_ >= 0)
      while (::flock(fd_, LOCK_EX) != 0 && errno == EINTR) {}
  }
  ~RecordLock() {
    if (fd_ >= 0) ::close(fd_);  // releases the lock
  }
  RecordLock(const RecordLock&) = delete;
  RecordLock& operator=(const RecordLock&) = delete;

 private:
  int fd_ = -1;
};

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
  const RecordLock lock(path);
  std::vector<Entry> entries = path.empty() ? std::vector<Entry>{} : read_entries(path);
  for (const Entry& e : entries)
    if (e.machine == machine) return {e.bf16_flops, e.f32_flops, e.measured_on, true, true};
  RecordedRates r;
  std::tie(r.bf16_flops, r.f32_flops) = measure();
  r.measured_on = today();
  if (path.empty()) return r;
  entries.push_back({machine, r.measured_on, r.bf16_flops, r.f32_flops});
  try {
    make_dirs(std::filesystem::path(path).parent_path().string());  // where the lock could not be made
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

std::string cpu_model_name_from(std::string_view cpuinfo, std::string_view machine) {
  std::string arm;
  size_t begin = 0;
  while (begin < cpuinfo.size()) {
    size_t end = cpuinfo.find('\n', begin);
    if (end == std::string_view::npos) end = cpuinfo.size();
    const std::string_view line = cpuinfo.substr(begin, end - begin);
    begin = end + 1;
    const size_t colon = line.find(':');
    const size_t first = colon == std::string_view::npos ? colon : line.find_first_not_of(" \t", colon + 1);
    const std::string value(first == std::string_view::npos ? std::string_view() : line.substr(first));
    if (line.starts_with("model name")) return value;
    // Arm lists no model name: the first core's implementer, variant and part name its design.
    for (const char* field : {"CPU implementer", "CPU variant", "CPU part"})
      if (line.starts_with(field) && arm.find(field) == std::string::npos)
        arm += fmt::format("{}{} {}", arm.empty() ? "" : ", ", field, value);
  }
  return arm.empty() ? "" : fmt::format("{} {}", machine, arm);
}

std::string cpu_model_name() {
  std::string cpuinfo;
  try {
    cpuinfo = read_file("/proc/cpuinfo", size_t(16) << 20);
  } catch (const std::exception&) {}
  struct utsname u {};
  return cpu_model_name_from(cpuinfo, ::uname(&u) == 0 ? u.machine : "");
}

}  // namespace keel::kernels
