#include "keel/report/tensorboard.h"

#include <fmt/format.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstring>

#include "keel/core/checksum.h"
#include "keel/core/error.h"
#include "keel/core/file_io.h"

namespace keel::report {

namespace {

// Protocol-buffer wire format, just what the Event messages below need.
enum Wire : uint32_t { Varint = 0, Fixed64 = 1, Bytes = 2, Fixed32 = 5 };

void put_varint(std::string& out, uint64_t v) {
  while (v >= 0x80) {
    out.push_back(char(v | 0x80));
    v >>= 7;
  }
  out.push_back(char(v));
}
void put_key(std::string& out, uint32_t field, Wire wire) { put_varint(out, (uint64_t(field) << 3) | wire); }
void put_bytes(std::string& out, uint32_t field, std::string_view bytes) {
  put_key(out, field, Bytes);
  put_varint(out, bytes.size());
  out.append(bytes);
}
void put_int(std::string& out, uint32_t field, int64_t v) {
  put_key(out, field, Varint);
  put_varint(out, uint64_t(v));
}
template <class T>
void put_fixed(std::string& out, uint32_t field, T v) {  // little-endian, as x86 and ARM store it
  put_key(out, field, sizeof(T) == 8 ? Fixed64 : Fixed32);
  char raw[sizeof(T)];
  std::memcpy(raw, &v, sizeof(T));
  out.append(raw, sizeof(T));
}

// tensorflow/core/util/event.proto: Event { double wall_time = 1; int64 step = 2; oneof what {
// string file_version = 3; Summary summary = 5; SessionLog session_log = 7; } }
std::string event(int64_t step) {
  std::string e;
  const double now = std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
  put_fixed(e, 1, now);
  put_int(e, 2, step);
  return e;
}

// TFRecord's checksum: CRC-32C rotated and offset, so that a CRC of data containing CRCs stays strong.
uint32_t masked_crc(std::string_view bytes) {
  const uint32_t crc = crc32c(bytes);
  return ((crc >> 15) | (crc << 17)) + 0xa282ead8u;
}

std::string host_name() {
  char name[256] = {};
  if (::gethostname(name, sizeof(name) - 1) != 0) return "localhost";
  return name;
}

}  // namespace

EventFileWriter::EventFileWriter(const std::string& dir) {
  static std::atomic<int> files{0};
  make_dirs(dir);
  const auto seconds =
      std::chrono::duration_cast<std::chrono::seconds>(std::chrono::system_clock::now().time_since_epoch()).count();
  path_ = fmt::format("{}/events.out.tfevents.{}.{}.{}.{}", dir, seconds, host_name(), ::getpid(), files++);
  file_ = std::fopen(path_.c_str(), "wb");
  require(file_ != nullptr, "{}: cannot create TensorBoard event file ({})", path_, std::strerror(errno));
  std::string version = event(0);
  put_bytes(version, 3, "brain.Event:2");
  write_record(version);
}

EventFileWriter::~EventFileWriter() {
  if (file_) std::fclose(file_);
}

void EventFileWriter::write_record(const std::string& data) {
  std::string record;
  const uint64_t length = data.size();
  char raw_length[8];
  std::memcpy(raw_length, &length, 8);
  record.append(raw_length, 8);
  const uint32_t length_crc = masked_crc(std::string_view(raw_length, 8));
  record.append(reinterpret_cast<const char*>(&length_crc), 4);
  record.append(data);
  const uint32_t data_crc = masked_crc(data);
  record.append(reinterpret_cast<const char*>(&data_crc), 4);
  require(std::fwrite(record.data(), 1, record.size(), file_) == record.size(), "{}: write failed ({})", path_,
          std::strerror(errno));
}

void EventFileWriter::add_scalar(std::string_view tag, double value, int64_t step) {
  std::string v;  // Summary.Value { string tag = 1; float simple_value = 2; }
  put_bytes(v, 1, tag);
  put_fixed(v, 2, float(value));
  std::string summary;  // Summary { repeated Value value = 1; }
  put_bytes(summary, 1, v);
  std::string e = event(step);
  put_bytes(e, 5, summary);
  write_record(e);
}

void EventFileWriter::add_text(std::string_view tag, std::string_view text, int64_t step) {
  std::string plugin;  // PluginData { string plugin_name = 1; }
  put_bytes(plugin, 1, "text");
  std::string metadata;  // SummaryMetadata { PluginData plugin_data = 1; }
  put_bytes(metadata, 1, plugin);
  std::string dim;  // TensorShapeProto.Dim { int64 size = 1; }
  put_int(dim, 1, 1);
  std::string shape;  // TensorShapeProto { repeated Dim dim = 2; }
  put_bytes(shape, 2, dim);
  std::string tensor;  // TensorProto { DataType dtype = 1 (DT_STRING = 7); shape = 2; string_val = 8; }
  put_int(tensor, 1, 7);
  put_bytes(tensor, 2, shape);
  put_bytes(tensor, 8, text);
  std::string v;  // Summary.Value { tag = 1; TensorProto tensor = 8; SummaryMetadata metadata = 9; }
  put_bytes(v, 1, fmt::format("{}/text_summary", tag));
  put_bytes(v, 8, tensor);
  put_bytes(v, 9, metadata);
  std::string summary;
  put_bytes(summary, 1, v);
  std::string e = event(step);
  put_bytes(e, 5, summary);
  write_record(e);
}

void EventFileWriter::add_session_start(int64_t step) {
  std::string log;  // SessionLog { SessionStatus status = 1 (START = 1); }
  put_int(log, 1, 1);
  std::string e = event(step);
  put_bytes(e, 7, log);
  write_record(e);
}

void EventFileWriter::flush() {
  require(std::fflush(file_) == 0, "{}: write failed ({})", path_, std::strerror(errno));
}

TensorBoardLog::TensorBoardLog(const std::string& output_dir, std::string_view recipe_toml, int64_t first_step,
                               int64_t log_interval)
    : events_(output_dir + "/runs"), log_interval_(std::max<int64_t>(1, log_interval)) {
  if (first_step > 1) events_.add_session_start(first_step);
  // Markdown: the text plugin renders it, and a fenced block keeps the TOML as written.
  events_.add_text("recipe", fmt::format("```toml\n{}```\n", recipe_toml), first_step);
  events_.flush();
}

void TensorBoardLog::write(const StepMetrics& m) {
  for (const MetricField& f : step_metric_fields(m)) {
    const std::string_view name = f.name;
    if (name.rfind("eval_", 0) == 0)
      events_.add_scalar(fmt::format("eval/{}", name.substr(5)), f.value, m.step);
    else
      events_.add_scalar(fmt::format("train/{}", name), f.value, m.step);
  }
  if (m.step % log_interval_ == 0) events_.flush();
}

}  // namespace keel::report
