#include "keel/formats/gguf_writer.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <bit>
#include <cstring>
#include <set>

#include "keel/core/error.h"
#include "keel/core/file_io.h"
#include "keel/core/threads.h"

namespace keel::formats {

static_assert(std::endian::native == std::endian::little, "keel writes GGUF on little-endian hosts only");

namespace {

constexpr uint32_t kGgufMagic = 0x46554747;  // "GGUF" read as a little-endian u32
constexpr uint32_t kGgufVersion = 3;
constexpr size_t kGgmlMaxDims = 4;

template <class T>
void put(std::string& out, T v) {
  char bytes[sizeof(T)];
  std::memcpy(bytes, &v, sizeof(T));
  out.append(bytes, sizeof(T));
}

void put_string(std::string& out, std::string_view s) {
  put<uint64_t>(out, s.size());
  out.append(s);
}

uint64_t padded(uint64_t n) { return (n + kGgufAlignment - 1) / kGgufAlignment * kGgufAlignment; }

int64_t element_count(const GgufTensor& t) {
  int64_t n = 1;
  for (int64_t d : t.shape) n *= d;
  return n;
}

void check_tensors(const std::string& path, const std::vector<GgufTensor>& tensors) {
  std::set<std::string_view> names;
  for (const auto& t : tensors) {
    require(!t.name.empty() && t.name.size() <= kGgufMaxNameBytes,
            "{}: tensor name '{}': expected 1 to {} bytes (llama.cpp's GGML_MAX_NAME), found {}", path, t.name,
            kGgufMaxNameBytes, t.name.size());
    require(names.insert(t.name).second, "{}: tensor '{}' given twice; GGUF tensor names are unique", path, t.name);
    require(!t.shape.empty() && t.shape.size() <= kGgmlMaxDims,
            "{}: tensor '{}': expected 1 to {} dimensions, found shape [{}]", path, t.name, kGgmlMaxDims,
            fmt::join(t.shape, ", "));
    for (int64_t d : t.shape)
      require(d > 0, "{}: tensor '{}': expected positive dimensions, found shape [{}]", path, t.name,
              fmt::join(t.shape, ", "));
    require(ggml_row_fits(t.type, t.shape.back()),
            "{}: tensor '{}' as {}: rows of {} values are not whole blocks of {}; write it in a float type", path,
            t.name, ggml_type_name(t.type), t.shape.back(), ggml_block_size(t.type));
    require(bool(t.fill), "{}: tensor '{}' has no data source", path, t.name);
  }
}

// A piece of a tensor whose bytes already lie in the file's type, written as they are (after the
// converted piece before it, if any), with the tensor's padding when it is the last; false, and
// nothing written, when converting would change them (a NaN): the caller converts the piece.
bool write_stored_piece(AtomicFileWriter& out, const GgufTensor& t, int64_t begin, int64_t count, uint64_t size,
                        uint64_t padding, std::vector<uint8_t>& ready) {
  static constexpr uint8_t kZeros[kGgufAlignment] = {};
  bool written = false;
  t.stored(begin, count, [&](const uint8_t* bytes) {
    if (!ggml_converts_to_itself(t.type, bytes, count)) return;
    if (!ready.empty()) out.write(ready.data(), ready.size());
    ready.clear();
    out.write(bytes, size);
    out.write(kZeros, padding);
    written = true;
  });
  return written;
}

// Values per conversion task: whole rows, about 256 Ki values (1 MiB of fp32, in a core's cache).
constexpr int64_t kTaskElements = int64_t(1) << 18;

// The tensors' bytes, a piece at a time through two buffers: while the threads convert piece k
// (tasks of whole rows, into `next`), the first thread writes piece k - 1 (`ready`) and then joins
// them. The write() -- the kernel's copy into the page cache, the largest cost of a same-type copy
// -- overlaps the conversion, and one parallel region per piece leaves no serial gap in which
// OpenMP's waiting threads spin (~3,000 such gaps took more CPU than the conversion, perf).
void write_tensor_data(AtomicFileWriter& out, const std::string& path, const std::vector<GgufTensor>& tensors,
                       int64_t piece_elements, uint64_t total, WorkProgress* progress) {
  std::vector<uint8_t> ready, next;
  std::vector<std::vector<float>> scratch(size_t(std::max(1, max_threads())));  // one task's fp32, per thread
  double done = 0;
  for (const auto& t : tensors) {
    const int64_t n = element_count(t), row = t.shape.back();
    // Whole rows, so whole blocks: a block never crosses a row.
    const int64_t piece = std::max(row, piece_elements / row * row), task = std::max(row, kTaskElements / row * row);
    uint64_t tensor_bytes = 0;
    for (int64_t begin = 0; begin < n; begin += piece) {
      const int64_t count = std::min(piece, n - begin);
      const uint64_t size = ggml_nbytes(t.type, count);
      tensor_bytes += size;
      const uint64_t padding = begin + count == n ? padded(tensor_bytes) - tensor_bytes : 0;
      if (t.stored && write_stored_piece(out, t, begin, count, size, padding, ready)) {
        done += double(size);
        if (progress) progress->update("writing " + path, done / 1e6, double(total) / 1e6, "MB");
        continue;
      }
      next.resize(size + padding);
      std::fill(next.begin() + std::ptrdiff_t(size), next.end(), uint8_t(0));
      for_each_task(1 + (count + task - 1) / task, count > task, [&](int64_t i, int thread) {
        if (i == 0) {
          if (!ready.empty()) out.write(ready.data(), ready.size());
          return;
        }
        const int64_t first = (i - 1) * task, m = std::min(task, count - first);
        std::vector<float>& values = scratch[size_t(thread)];
        if (values.size() < size_t(m)) values.resize(size_t(m));
        t.fill(begin + first, m, values.data());
        ggml_quantize(t.type, values.data(), m, next.data() + ggml_nbytes(t.type, first));
      });
      std::swap(ready, next);
      done += double(size);
      if (progress) progress->update("writing " + path, done / 1e6, double(total) / 1e6, "MB");
    }
  }
  if (!ready.empty()) out.write(ready.data(), ready.size());
}

}  // namespace

void GgufMetadata::begin(std::string_view key, GgufValueType type) {
  require(!key.empty(), "GGUF metadata: expected a key, found an empty one");
  require(!has(key), "GGUF metadata: key '{}' added twice", key);
  keys_.emplace_back(key);
  put_string(bytes_, key);
  put<uint32_t>(bytes_, uint32_t(type));
}

void GgufMetadata::begin_array(std::string_view key, GgufValueType element, size_t count) {
  require(count > 0, "GGUF metadata: key '{}': expected a non-empty array (GGUF has no empty arrays)", key);
  begin(key, GgufValueType::Array);
  put<uint32_t>(bytes_, uint32_t(element));
  put<uint64_t>(bytes_, count);
}

bool GgufMetadata::has(std::string_view key) const {
  for (const auto& k : keys_)
    if (k == key) return true;
  return false;
}

void GgufMetadata::add_uint8(std::string_view key, uint8_t v) {
  begin(key, GgufValueType::Uint8);
  put(bytes_, v);
}
void GgufMetadata::add_int8(std::string_view key, int8_t v) {
  begin(key, GgufValueType::Int8);
  put(bytes_, v);
}
void GgufMetadata::add_uint16(std::string_view key, uint16_t v) {
  begin(key, GgufValueType::Uint16);
  put(bytes_, v);
}
void GgufMetadata::add_int16(std::string_view key, int16_t v) {
  begin(key, GgufValueType::Int16);
  put(bytes_, v);
}
void GgufMetadata::add_uint32(std::string_view key, uint32_t v) {
  begin(key, GgufValueType::Uint32);
  put(bytes_, v);
}
void GgufMetadata::add_int32(std::string_view key, int32_t v) {
  begin(key, GgufValueType::Int32);
  put(bytes_, v);
}
void GgufMetadata::add_uint64(std::string_view key, uint64_t v) {
  begin(key, GgufValueType::Uint64);
  put(bytes_, v);
}
void GgufMetadata::add_int64(std::string_view key, int64_t v) {
  begin(key, GgufValueType::Int64);
  put(bytes_, v);
}
void GgufMetadata::add_float32(std::string_view key, float v) {
  begin(key, GgufValueType::Float32);
  put(bytes_, v);
}
void GgufMetadata::add_float64(std::string_view key, double v) {
  begin(key, GgufValueType::Float64);
  put(bytes_, v);
}
void GgufMetadata::add_bool(std::string_view key, bool v) {
  begin(key, GgufValueType::Bool);
  put<uint8_t>(bytes_, v ? 1 : 0);
}
void GgufMetadata::add_string(std::string_view key, std::string_view v) {
  begin(key, GgufValueType::String);
  put_string(bytes_, v);
}
void GgufMetadata::add_strings(std::string_view key, const std::vector<std::string>& v) {
  begin_array(key, GgufValueType::String, v.size());
  for (const auto& s : v) put_string(bytes_, s);
}
void GgufMetadata::add_int32s(std::string_view key, const std::vector<int32_t>& v) {
  begin_array(key, GgufValueType::Int32, v.size());
  for (int32_t x : v) put(bytes_, x);
}
void GgufMetadata::add_uint32s(std::string_view key, const std::vector<uint32_t>& v) {
  begin_array(key, GgufValueType::Uint32, v.size());
  for (uint32_t x : v) put(bytes_, x);
}
void GgufMetadata::add_float32s(std::string_view key, const std::vector<float>& v) {
  begin_array(key, GgufValueType::Float32, v.size());
  for (float x : v) put(bytes_, x);
}

void write_gguf(const std::string& path, const GgufMetadata& metadata, const std::vector<GgufTensor>& tensors,
                WorkProgress* progress, int64_t piece_elements) {
  require(piece_elements > 0, "{}: expected a positive piece size, found {}", path, piece_elements);
  check_tensors(path, tensors);
  std::string head;
  put<uint32_t>(head, kGgufMagic);
  put<uint32_t>(head, kGgufVersion);
  put<uint64_t>(head, tensors.size());
  put<uint64_t>(head, metadata.size());
  head += metadata.encoded();
  uint64_t offset = 0, total = 0;
  for (const auto& t : tensors) {
    put_string(head, t.name);
    put<uint32_t>(head, uint32_t(t.shape.size()));
    for (auto d = t.shape.rbegin(); d != t.shape.rend(); ++d) put<uint64_t>(head, uint64_t(*d));
    put<uint32_t>(head, uint32_t(t.type));
    put<uint64_t>(head, offset);
    const uint64_t bytes = ggml_nbytes(t.type, element_count(t));
    offset += padded(bytes);
    total += bytes;
  }
  head.resize(padded(head.size()), '\0');

  AtomicFileWriter out(path);
  out.write(head);
  write_tensor_data(out, path, tensors, piece_elements, total, progress);
  out.commit();
}

}  // namespace keel::formats
