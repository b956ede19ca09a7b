#include "keel/core/json_text.h"
#include "keel/formats/safetensors.h"

#include <fcntl.h>
#include <fmt/format.h>
#include <fmt/ranges.h>
#include <simdjson.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <bit>
#include <cerrno>
#include <filesystem>
#include <limits>
#include <optional>
#include <set>
#include <string_view>
#include <system_error>
#include <type_traits>

#include "keel/core/error.h"
#include "keel/core/file_io.h"
#include "keel/core/mapped_file.h"
#include "keel/core/threads.h"

namespace keel::formats {

// Tensor bytes are little-endian in the file and are copied without swapping.
static_assert(std::endian::native == std::endian::little, "keel reads safetensors on little-endian hosts only");

namespace {

namespace dom = simdjson::dom;

// The header is JSON describing the tensors, a few hundred bytes per tensor; the reference
// implementation refuses headers over 100 MB, and so does keel, before allocating anything.
constexpr uint64_t kMaxHeaderBytes = 100ull << 20;
constexpr const char* kSingleFileName = "model.safetensors";
constexpr const char* kIndexFileName = "model.safetensors.index.json";

// Every dtype the safetensors format defines, with its width in bits, so that sizes of tensors
// keel cannot read are still checked (a wrong size means a corrupt file either way).
struct SafetensorsDtype {
  std::string_view name;
  unsigned bits;
};
constexpr SafetensorsDtype kSafetensorsDtypes[] = {
    {"BOOL", 8}, {"U8", 8},   {"I8", 8},    {"F8_E5M2", 8}, {"F8_E4M3", 8}, {"F8_E8M0", 8}, {"I16", 16},
    {"U16", 16}, {"F16", 16}, {"BF16", 16}, {"I32", 32},    {"U32", 32},    {"F32", 32},    {"F64", 64},
    {"I64", 64}, {"U64", 64}, {"C64", 64},  {"F4", 4},      {"F6_E2M3", 6}, {"F6_E3M2", 6},
};

std::optional<unsigned> safetensors_dtype_bits(std::string_view name) {
  for (const auto& d : kSafetensorsDtypes) {
    if (d.name == name) return d.bits;
  }
  return std::nullopt;
}

std::optional<DType> keel_dtype(std::string_view name) {
  for (DType t : {DType::F32, DType::BF16, DType::F16}) {
    if (dtype_name(t) == name) return t;
  }
  return std::nullopt;
}

std::string errno_text(int error) { return std::system_category().message(error); }

std::string shape_text(const std::vector<int64_t>& shape) { return fmt::format("[{}]", fmt::join(shape, ", ")); }

std::string_view json_type_name(dom::element e) {
  switch (e.type()) {
    case dom::element_type::ARRAY: return "an array";
    case dom::element_type::OBJECT: return "an object";
    case dom::element_type::INT64:
    case dom::element_type::UINT64: return "an integer";
    case dom::element_type::DOUBLE: return "a non-integer number";
    case dom::element_type::STRING: return "a string";
    case dom::element_type::BOOL: return "a boolean";
    case dom::element_type::NULL_VALUE: return "null";
  }
  return "an unknown JSON value";
}

// Non-negative JSON integer, or nullopt (the caller words the error).
std::optional<uint64_t> json_unsigned(dom::element e) {
  if (e.type() == dom::element_type::UINT64) return uint64_t(e.get_uint64());
  if (e.type() == dom::element_type::INT64) {
    int64_t v = e.get_int64();
    if (v >= 0) return uint64_t(v);
  }
  return std::nullopt;
}

[[noreturn]] void unsupported_dtype_error(const std::string& file, const std::string& name, const std::string& dtype) {
  fail("{}: tensor '{}': expected dtype F32, BF16 or F16 (the ones keel reads), found {}", file, name, dtype);
}

// --- reading -----------------------------------------------------------------------------------

// One tensor entry of the header, checked against the data section of `data_size` bytes.
struct HeaderEntry {
  std::string name;
  std::string dtype;
  std::vector<int64_t> shape;
  uint64_t begin = 0, end = 0;
};

std::vector<int64_t> parse_shape(const std::string& path, const std::string& name, dom::element e, int64_t* numel) {
  dom::array dims;
  if (e.get_array().get(dims) != simdjson::SUCCESS) {
    fail("{}: tensor '{}': expected \"shape\" to be an array of non-negative integers, found {}", path, name,
         json_type_name(e));
  }
  std::vector<int64_t> shape;
  int64_t product = 1;
  for (dom::element d : dims) {
    auto v = json_unsigned(d);
    if (!v || *v > uint64_t(std::numeric_limits<int64_t>::max())) {
      fail("{}: tensor '{}': expected \"shape\" entries to be non-negative integers, found {} {}", path, name,
           json_type_name(d), simdjson::minify(d));
    }
    shape.push_back(int64_t(*v));
    // Checked so that a hostile shape cannot wrap around to a small, plausible size.
    if (__builtin_mul_overflow(product, int64_t(*v), &product)) {
      fail("{}: tensor '{}': shape {} has more elements than fit in 64 bits", path, name, simdjson::minify(e));
    }
  }
  *numel = product;
  return shape;
}

HeaderEntry parse_entry(const std::string& path, std::string name, dom::element e, uint64_t data_size) {
  HeaderEntry entry;
  entry.name = std::move(name);
  const std::string& n = entry.name;
  dom::object fields;
  if (e.get_object().get(fields) != simdjson::SUCCESS) {
    fail("{}: tensor '{}': expected an object {{dtype, shape, data_offsets}}, found {}", path, n, json_type_name(e));
  }
  dom::element dtype, shape, offsets;
  if (fields["dtype"].get(dtype) != simdjson::SUCCESS || !dtype.is_string()) {
    fail("{}: tensor '{}': expected \"dtype\" to be a string", path, n);
  }
  entry.dtype = std::string(std::string_view(dtype));
  auto bits = safetensors_dtype_bits(entry.dtype);
  if (!bits)
    fail("{}: tensor '{}': expected a safetensors dtype (F32, BF16, F16, I64, ...), found \"{}\"", path, n,
         entry.dtype);

  if (fields["shape"].get(shape) != simdjson::SUCCESS) fail("{}: tensor '{}': expected a \"shape\" field", path, n);
  int64_t numel = 0;
  entry.shape = parse_shape(path, n, shape, &numel);

  dom::array pair;
  if (fields["data_offsets"].get(offsets) != simdjson::SUCCESS || offsets.get_array().get(pair) != simdjson::SUCCESS ||
      pair.size() != 2 || !json_unsigned(pair.at(0).value()) || !json_unsigned(pair.at(1).value())) {
    fail("{}: tensor '{}': expected \"data_offsets\" to be [begin, end] with non-negative integers", path, n);
  }
  entry.begin = *json_unsigned(pair.at(0).value());
  entry.end = *json_unsigned(pair.at(1).value());
  if (entry.begin > entry.end || entry.end > data_size) {
    fail("{}: tensor '{}': expected data_offsets within the {}-byte data section with begin <= end, found [{}, {}]",
         path, n, data_size, entry.begin, entry.end);
  }
  unsigned __int128 bits_total = static_cast<unsigned __int128>(numel) * *bits;
  if (bits_total % 8 != 0 || bits_total / 8 != entry.end - entry.begin) {
    fail("{}: tensor '{}': expected {} bytes for shape {} of {}, found data_offsets [{}, {}] spanning {} bytes", path,
         n, static_cast<uint64_t>(bits_total / 8), shape_text(entry.shape), entry.dtype, entry.begin, entry.end,
         entry.end - entry.begin);
  }
  return entry;
}

std::map<std::string, std::string> parse_metadata(const std::string& path, dom::element e) {
  dom::object object;
  if (e.get_object().get(object) != simdjson::SUCCESS) {
    fail("{}: expected \"__metadata__\" to be an object of strings, found {}", path, json_type_name(e));
  }
  std::map<std::string, std::string> metadata;
  for (dom::key_value_pair kv : object) {
    if (!kv.value.is_string()) {
      fail("{}: \"__metadata__\" key '{}': expected a string, found {}", path, kv.key, json_type_name(kv.value));
    }
    metadata[std::string(kv.key)] = std::string(std::string_view(kv.value));
  }
  return metadata;
}

// Two tensors sharing bytes would alias each other's weights; the reference writer never
// produces that, so it means a corrupt or hostile file.
void check_no_overlap(const std::string& path, std::vector<const HeaderEntry*> entries) {
  std::sort(entries.begin(), entries.end(), [](const HeaderEntry* a, const HeaderEntry* b) {
    return a->begin != b->begin ? a->begin < b->begin : a->end < b->end;
  });
  for (size_t i = 1; i < entries.size(); ++i) {
    const HeaderEntry& prev = *entries[i - 1];
    const HeaderEntry& cur = *entries[i];
    if (cur.begin < prev.end) {
      fail(
          "{}: tensor '{}': expected data_offsets not overlapping other tensors, found [{}, {}] overlapping "
          "tensor '{}' at [{}, {}]",
          path, cur.name, cur.begin, cur.end, prev.name, prev.begin, prev.end);
    }
  }
}

// Parses and checks the header; `data` is the first byte of the data section.
void parse_header(const std::string& path, std::string_view json, const uint8_t* data, uint64_t data_size,
                  std::vector<TensorInfo>& tensors, std::map<std::string, std::string>& unsupported,
                  std::vector<TensorInfo>& bytes, std::map<std::string, std::string>& metadata) {
  dom::parser parser;
  dom::element root;
  if (auto error = parser.parse(json.data(), json.size()).get(root)) {
    fail("{}: expected the {}-byte header to be valid JSON: {}", path, json.size(), simdjson::error_message(error));
  }
  dom::object object;
  if (root.get_object().get(object) != simdjson::SUCCESS) {
    fail("{}: expected the header to be a JSON object, found {}", path, json_type_name(root));
  }
  std::vector<HeaderEntry> entries;
  std::set<std::string_view> seen;
  for (dom::key_value_pair kv : object) {
    // JSON parsers disagree on which duplicate wins; refuse rather than guess.
    if (!seen.insert(kv.key).second)
      fail("{}: tensor '{}': expected unique names, found it twice in the header", path, kv.key);
    if (kv.key == "__metadata__") {
      metadata = parse_metadata(path, kv.value);
      continue;
    }
    entries.push_back(parse_entry(path, std::string(kv.key), kv.value, data_size));
  }
  std::vector<const HeaderEntry*> order;
  for (const auto& e : entries) order.push_back(&e);
  check_no_overlap(path, order);

  for (auto& e : entries) {
    auto dtype = keel_dtype(e.dtype);
    if (!dtype) {
      unsupported[e.name] = e.dtype;  // an error only if someone reads it as numbers
      if (e.dtype == "U8")            // bitsandbytes' packed codes and quantization states
        bytes.push_back({e.name, DType::F32, e.shape, data + e.begin, size_t(e.end - e.begin), path});
      continue;
    }
    TensorInfo info;
    info.name = std::move(e.name);
    info.dtype = *dtype;
    info.shape = std::move(e.shape);
    info.data = data + e.begin;
    info.nbytes = size_t(e.end - e.begin);
    info.file = path;
    tensors.push_back(std::move(info));
  }
}

// Shard file names in an index are relative to the model directory; anything that could
// point outside it (absolute paths, "..") is refused, since index files come from the internet.
void check_shard_name(const std::string& index_path, const std::string& tensor, const std::string& shard) {
  bool bad = shard.empty() || shard.front() == '/' || shard.find('\0') != std::string::npos;
  for (size_t start = 0; !bad && start <= shard.size();) {
    size_t slash = shard.find('/', start);
    std::string_view part(shard.data() + start, (slash == std::string::npos ? shard.size() : slash) - start);
    bad = part == "..";
    if (slash == std::string::npos) break;
    start = slash + 1;
  }
  if (bad) {
    fail("{}: weight_map: tensor '{}': expected a file name relative to the model directory, found \"{}\"", index_path,
         tensor, shard);
  }
}

// weight_map of model.safetensors.index.json, in file order.
std::vector<std::pair<std::string, std::string>> read_weight_map(const std::string& index_path) {
  std::string text = read_file(index_path, kMaxHeaderBytes);  // a few hundred bytes per tensor, as a header
  dom::parser parser;
  dom::element root;
  if (auto error = parser.parse(text.data(), text.size()).get(root)) {
    fail("{}: expected valid JSON: {}", index_path, simdjson::error_message(error));
  }
  dom::element map_element;
  dom::object map;
  if (!root.is_object() || root["weight_map"].get(map_element) != simdjson::SUCCESS ||
      map_element.get_object().get(map) != simdjson::SUCCESS) {
    fail("{}: expected an object with a \"weight_map\" object {{tensor name: shard file}}", index_path);
  }
  std::vector<std::pair<std::string, std::string>> entries;
  std::set<std::string_view> seen;
  for (dom::key_value_pair kv : map) {
    if (!seen.insert(kv.key).second)
      fail("{}: weight_map: tensor '{}': expected unique names, found it twice", index_path, kv.key);
    if (!kv.value.is_string()) {
      fail("{}: weight_map: tensor '{}': expected a shard file name, found {}", index_path, kv.key,
           json_type_name(kv.value));
    }
    entries.emplace_back(std::string(kv.key), std::string(std::string_view(kv.value)));
    check_shard_name(index_path, entries.back().first, entries.back().second);
  }
  require(!entries.empty(), "{}: expected a non-empty \"weight_map\"", index_path);
  return entries;
}

// --- writing -----------------------------------------------------------------------------------

// Checks the tensors and returns each one's size in bytes once converted to `dtype`.
std::vector<uint64_t> tensor_bytes(const std::string& where, const std::vector<TensorToWrite>& tensors, DType dtype) {
  std::vector<uint64_t> sizes;
  std::set<std::string_view> names;
  for (const auto& t : tensors) {
    require(!t.name.empty() && t.name != "__metadata__", "{}: expected a tensor name, found \"{}\"", where, t.name);
    require(simdjson::validate_utf8(t.name.data(), t.name.size()), "{}: tensor '{}': expected a UTF-8 name", where,
            t.name);
    require(names.insert(t.name).second, "{}: tensor '{}': expected unique names, found it twice", where, t.name);
    int64_t numel = 1;
    for (int64_t d : t.shape) {
      require(d >= 0, "{}: tensor '{}': expected non-negative dimensions, found shape {}", where, t.name,
              shape_text(t.shape));
      require(!__builtin_mul_overflow(numel, d, &numel), "{}: tensor '{}': shape {} overflows", where, t.name,
              shape_text(t.shape));
    }
    require(numel == 0 || t.data != nullptr || t.read,
            "{}: tensor '{}': expected data for shape {}, found a null pointer", where, t.name, shape_text(t.shape));
    uint64_t bytes = 0;
    require(!__builtin_mul_overflow(uint64_t(numel), uint64_t(dtype_size(dtype)), &bytes), "{}: tensor '{}': too large",
            where, t.name);
    sizes.push_back(bytes);
  }
  return sizes;
}

std::string header_json(const std::vector<TensorToWrite>& tensors, const std::vector<uint64_t>& sizes, DType dtype,
                        const std::map<std::string, std::string>& metadata) {
  std::string json = "{";
  if (!metadata.empty()) {
    json += "\"__metadata__\":{";
    bool first = true;
    for (const auto& [key, value] : metadata) {
      if (!first) json += ',';
      first = false;
      json += json_quoted(key) + ':' + json_quoted(value);
    }
    json += '}';
  }
  uint64_t offset = 0;
  for (size_t i = 0; i < tensors.size(); ++i) {
    if (json.size() > 1) json += ',';
    json += fmt::format("{}:{{\"dtype\":\"{}\",\"shape\":[{}],\"data_offsets\":[{},{}]}}", json_quoted(tensors[i].name),
                        dtype_name(dtype), fmt::join(tensors[i].shape, ","), offset, offset + sizes[i]);
    offset += sizes[i];
  }
  json += '}';
  // As the reference writer does: pad with spaces so the data section starts 8-byte aligned,
  // which lets readers use the mapped tensors in place.
  json.append((8 - json.size() % 8) % 8, ' ');
  return json;
}

void write_tensor_data(AtomicFileWriter& out, const TensorToWrite& t, uint64_t nbytes, DType dtype) {
  size_t n = size_t(nbytes / dtype_size(dtype));
  if (dtype == DType::F32 && !t.read) {
    out.write(t.data, nbytes);
    return;
  }
  // In bounded chunks: no second full copy of a multi-GB tensor in memory.
  constexpr size_t kChunk = size_t(1) << 20;
  std::vector<uint16_t> buffer(dtype == DType::F32 ? 0 : std::min(n, kChunk));
  for (size_t start = 0; start < n;) {
    int64_t count = int64_t(std::min(kChunk, n - start));
    const float* src = nullptr;
    if (t.read) {
      src = t.read(int64_t(start), count, &count);
      require(src != nullptr && count > 0 && size_t(count) <= std::min(kChunk, n - start),
              "tensor '{}': its source returned no data at element {}", t.name, start);
    } else {
      src = t.data + start;
    }
    if (dtype == DType::F32) {
      out.write(src, size_t(count) * sizeof(float));
    } else {
      if (dtype == DType::BF16) {
        convert_f32_to_bf16(src, reinterpret_cast<bf16*>(buffer.data()), size_t(count));
      } else {
        for (int64_t i = 0; i < count; ++i) buffer[size_t(i)] = float_to_f16(src[i]);
      }
      out.write(buffer.data(), size_t(count) * sizeof(uint16_t));
    }
    start += size_t(count);
  }
}

// Bytes written of a model's weights, for a progress line (core/work_progress.h).
struct WrittenBytes {
  WorkProgress* line = nullptr;
  std::string label;
  double done = 0, total = 0;
  void add(uint64_t bytes) {
    done += double(bytes);
    if (line) line->update(label, done / 1e6, total / 1e6, "MB");
  }
};

void write_safetensors_sized(const std::string& path, const std::vector<TensorToWrite>& tensors,
                             const std::vector<uint64_t>& sizes, DType dtype,
                             const std::map<std::string, std::string>& metadata, WrittenBytes* progress = nullptr) {
  for (const auto& [key, value] : metadata) {
    require(simdjson::validate_utf8(key.data(), key.size()) && simdjson::validate_utf8(value.data(), value.size()),
            "{}: metadata '{}': expected UTF-8 text", path, key);
  }
  std::string header = header_json(tensors, sizes, dtype, metadata);
  uint8_t length[8];
  uint64_t n = header.size();
  for (int i = 0; i < 8; ++i) length[i] = uint8_t(n >> (8 * i));  // little-endian u64
  AtomicFileWriter out(path);
  out.write(length, 8);
  out.write(header);
  for (size_t i = 0; i < tensors.size(); ++i) {
    write_tensor_data(out, tensors[i], sizes[i], dtype);
    if (progress) progress->add(sizes[i]);
  }
  out.commit();
}

std::string shard_file_name(size_t index, size_t count) {
  return fmt::format("model-{:05d}-of-{:05d}.safetensors", index + 1, count);
}

// "model-00001-of-00003.safetensors", the names transformers gives shards.
bool is_shard_file_name(std::string_view name) {
  constexpr std::string_view pattern = "model-#####-of-#####.safetensors";
  if (name.size() != pattern.size()) return false;
  for (size_t i = 0; i < name.size(); ++i) {
    if (pattern[i] == '#' ? (name[i] < '0' || name[i] > '9') : name[i] != pattern[i]) return false;
  }
  return true;
}

// Greedy in the given order, as transformers' sharding: a new shard starts when the next tensor
// would overflow the current one; a tensor larger than the limit gets a shard to itself.
std::vector<std::vector<size_t>> plan_shards(const std::vector<uint64_t>& sizes, uint64_t max_shard_bytes) {
  std::vector<std::vector<size_t>> shards;
  uint64_t current = 0;
  for (size_t i = 0; i < sizes.size(); ++i) {
    if (shards.empty() || (current > 0 && current + sizes[i] > max_shard_bytes)) {
      shards.emplace_back();
      current = 0;
    }
    shards.back().push_back(i);
    current += sizes[i];
  }
  return shards;
}

// Loaders pick model.safetensors over an index and follow the index to its shards, so files
// from an earlier save with a different layout would shadow or mix with the new weights.
void remove_stale_weight_files(const std::string& dir, const std::set<std::string>& keep) {
  std::error_code ec;
  std::vector<std::string> stale;
  for (const auto& entry : std::filesystem::directory_iterator(dir, ec)) {
    std::string name = entry.path().filename().string();
    bool weight_file = name == kSingleFileName || name == kIndexFileName || is_shard_file_name(name);
    if (weight_file && !keep.count(name)) stale.push_back(entry.path().string());
  }
  if (ec) fail("{}: cannot list directory: {}", dir, ec.message());
  for (const auto& path : stale) {
    if (!std::filesystem::remove(path, ec) && ec) fail("{}: cannot remove stale weight file: {}", path, ec.message());
  }
}

std::string index_json(const std::vector<TensorToWrite>& tensors, const std::vector<std::vector<size_t>>& shards,
                       uint64_t total_size) {
  std::map<std::string, std::string> weight_map;  // sorted by name, as transformers writes it
  for (size_t s = 0; s < shards.size(); ++s) {
    for (size_t i : shards[s]) weight_map[tensors[i].name] = shard_file_name(s, shards.size());
  }
  std::string json =
      fmt::format("{{\n  \"metadata\": {{\n    \"total_size\": {}\n  }},\n  \"weight_map\": {{", total_size);
  bool first = true;
  for (const auto& [name, file] : weight_map) {
    json += first ? "\n" : ",\n";
    first = false;
    json += fmt::format("    {}: {}", json_quoted(name), json_quoted(file));
  }
  json += "\n  }\n}\n";
  return json;
}

}  // namespace

int64_t TensorInfo::numel() const {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;  // checked against overflow when the header was parsed
  return n;
}

std::unique_ptr<SafetensorsFile> SafetensorsFile::open(const std::string& path) {
  std::unique_ptr<SafetensorsFile> file(new SafetensorsFile);
  file->path_ = path;
  // 8 bytes at least: the header's length.
  file->map_ = MappedFile(path, "safetensors file", 8);
  const uint8_t* bytes = file->map_.data();
  uint64_t header_size = 0;
  for (int i = 7; i >= 0; --i) header_size = header_size << 8 | bytes[i];
  uint64_t available = file->map_.size() - 8;
  if (header_size > available) {
    fail(
        "{}: expected a header length of at most {} bytes (the rest of the file), found {} (truncated or not "
        "a safetensors file?)",
        path, available, header_size);
  }
  if (header_size > kMaxHeaderBytes) {
    fail("{}: expected a header length of at most {} bytes, found {}", path, kMaxHeaderBytes, header_size);
  }
  std::string_view json(reinterpret_cast<const char*>(bytes + 8), header_size);
  const uint8_t* data = bytes + 8 + header_size;
  parse_header(path, json, data, available - header_size, file->tensors_, file->unsupported_, file->bytes_,
               file->metadata_);
  return file;
}

SafetensorsFile::~SafetensorsFile() = default;

const TensorInfo* SafetensorsFile::find(const std::string& name) const {
  for (const auto& t : tensors_) {
    if (t.name == name) return &t;
  }
  auto it = unsupported_.find(name);
  if (it != unsupported_.end()) unsupported_dtype_error(path_, name, it->second);
  return nullptr;
}

CheckpointReader CheckpointReader::open_file(const std::string& path) {
  CheckpointReader reader;
  reader.dir_ = path;
  auto file = std::shared_ptr<SafetensorsFile>(SafetensorsFile::open(path));
  for (const auto& t : file->tensors_) reader.by_name_.emplace(t.name, &t);
  for (const auto& [name, dtype] : file->unsupported_) reader.by_name_.emplace(name, nullptr);
  for (const auto& t : file->bytes_) reader.bytes_by_name_.emplace(t.name, &t);
  reader.files_.push_back(std::move(file));
  return reader;
}

bool holds_config_only(const std::string& dir) {
  namespace fs = std::filesystem;
  std::error_code ec;
  if (!fs::is_directory(dir, ec) || !fs::exists(fs::path(dir) / "config.json", ec)) return false;
  for (const auto& entry : fs::directory_iterator(dir, ec)) {
    const std::string ext = entry.path().extension().string();
    if (ext == ".safetensors" || ext == ".bin" || ext == ".pt" || ext == ".pth" || ext == ".gguf" ||
        entry.path().filename() == kIndexFileName)
      return false;
  }
  return !ec;
}

CheckpointReader CheckpointReader::open_dir(const std::string& dir) {
  struct stat st {};
  if (::stat(dir.c_str(), &st) != 0) fail("{}: cannot open model directory: {}", dir, errno_text(errno));
  require(S_ISDIR(st.st_mode), "{}: expected a model directory, found a file", dir);

  CheckpointReader reader;
  reader.dir_ = dir;
  auto add_file = [&reader](std::shared_ptr<SafetensorsFile> file) {
    auto claim = [&](const std::string& name, const TensorInfo* info) {
      auto [it, inserted] = reader.by_name_.emplace(name, info);
      if (inserted) return;
      // Find the other file for the message.
      std::string other = it->second ? it->second->file : "another shard";
      fail("{}: tensor '{}': expected in one shard only, found in {} and {}", reader.dir_, name, other, file->path());
    };
    for (const auto& t : file->tensors_) claim(t.name, &t);
    for (const auto& [name, dtype] : file->unsupported_) claim(name, nullptr);
    for (const auto& t : file->bytes_) reader.bytes_by_name_.emplace(t.name, &t);
    reader.files_.push_back(std::move(file));
  };

  // Same precedence as transformers' from_pretrained: the single file first, then the index.
  std::string single = dir + "/" + kSingleFileName;
  std::string index = dir + "/" + kIndexFileName;
  if (path_exists(single)) {
    add_file(SafetensorsFile::open(single));
    return reader;
  }
  if (!path_exists(index)) {
    std::string hint = path_exists(dir + "/pytorch_model.bin") || path_exists(dir + "/pytorch_model.bin.index.json")
                           ? " (found pytorch_model.bin: convert it to safetensors first)"
                           : "";
    fail("{}: expected model weights {} or {}, found neither{}", dir, kSingleFileName, kIndexFileName, hint);
  }

  auto weight_map = read_weight_map(index);
  std::map<std::string, std::shared_ptr<SafetensorsFile>> shards;  // each shard opened once
  for (const auto& [tensor, shard] : weight_map) {
    if (shards.count(shard)) continue;
    std::string path = dir + "/" + shard;
    require(path_exists(path), "{}: weight_map: tensor '{}': expected shard file {}, found no such file", index, tensor,
            path);
    auto file = std::shared_ptr<SafetensorsFile>(SafetensorsFile::open(path));
    shards[shard] = file;
    add_file(file);
  }
  for (const auto& [tensor, shard] : weight_map) {
    const SafetensorsFile& file = *shards.at(shard);
    bool present =
        file.unsupported_.count(tensor) != 0 ||
        std::any_of(file.tensors_.begin(), file.tensors_.end(), [&](const TensorInfo& t) { return t.name == tensor; });
    require(present, "{}: weight_map: tensor '{}': expected in {}, found no such tensor there", index, tensor,
            file.path());
  }
  return reader;
}

std::vector<std::string> CheckpointReader::names() const {
  std::vector<std::string> names;
  names.reserve(by_name_.size());
  for (const auto& [name, info] : by_name_) names.push_back(name);
  return names;
}

bool CheckpointReader::has(const std::string& name) const { return by_name_.count(name) != 0; }

const TensorInfo& CheckpointReader::get(const std::string& name) const {
  auto it = by_name_.find(name);
  if (it == by_name_.end()) fail("{}: tensor '{}': expected in the checkpoint, found no such tensor", dir_, name);
  if (!it->second) {
    for (const auto& file : files_) {
      auto u = file->unsupported_.find(name);
      if (u != file->unsupported_.end()) unsupported_dtype_error(file->path(), name, u->second);
    }
    fail("{}: tensor '{}': listed but not readable", dir_, name);  // unreachable: every null entry is unsupported
  }
  return *it->second;
}

namespace {

// Elements [first, first + count) of a tensor converted one by one into dst[0, count): to fp32
// (exact from BF16 and F16) or to bf16 (fp32 rounded to nearest even, as keel's bf16 copies are;
// F16 through fp32, where it is exact).
template <typename Out, typename Convert>
void convert_elements(const TensorInfo& t, int64_t first, int64_t count, Out* dst, Convert convert) {
  const size_t n = size_t(count);
  const uint8_t* src = t.data + size_t(first) * dtype_size(t.dtype);
  // memcpy per element: the mapped data need not be aligned for the element type (headers
  // from other writers are not always padded), and compilers turn it into a plain load.
  parallel_for(int64_t(n), n > (1u << 16), [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      float v = 0.0f;
      if (t.dtype == DType::F32) {
        std::memcpy(&v, src + 4 * i, 4);
      } else if (t.dtype == DType::BF16) {
        bf16 b;
        std::memcpy(&b.bits, src + 2 * i, 2);
        if constexpr (std::is_same_v<Out, bf16>) {
          dst[i] = b;  // as stored: no round trip
          continue;
        }
        v = bf16_to_float(b);
      } else {
        uint16_t h;
        std::memcpy(&h, src + 2 * i, 2);
        v = f16_to_float(h);
      }
      dst[i] = convert(v);
    }
  });
}

}  // namespace

namespace {

const TensorInfo& require_shape(const TensorInfo& t, const std::vector<int64_t>& expected_shape) {
  if (t.shape != expected_shape)
    fail("{}: tensor '{}': expected shape {}, found {}", t.file, t.name, shape_text(expected_shape),
         shape_text(t.shape));
  return t;
}

}  // namespace

const TensorInfo& CheckpointReader::get_shaped(const std::string& name,
                                               const std::vector<int64_t>& expected_shape) const {
  return require_shape(get(name), expected_shape);
}

namespace {

// A tensor's file pages, once read, leave this process's resident set: they stay in the page cache
// (shared with other ranks, re-read from there if touched again), but a load no longer peaks at the
// arena plus every file it read (17.5 GiB more for GLM-4-9B), only plus the tensor being read.
// Whole pages around the bytes read, their neighbours' bytes included: dropping a clean page of a
// read-only private mapping only means the next access faults it in again.
void release_pages(const uint8_t* data, size_t nbytes) {
  static const uintptr_t page = uintptr_t(::sysconf(_SC_PAGESIZE));
  const uintptr_t begin = reinterpret_cast<uintptr_t>(data) / page * page;
  const uintptr_t end = (reinterpret_cast<uintptr_t>(data) + nbytes + page - 1) / page * page;
  if (end > begin) ::madvise(reinterpret_cast<void*>(begin), end - begin, MADV_DONTNEED);  // advisory
}

void release_pages(const TensorInfo& t) { release_pages(t.data, t.nbytes); }

// Where elements [begin, begin + count) of t begin in its file's mapping; a range outside t is an
// error naming it.
const uint8_t* element_range(const TensorInfo& t, int64_t begin, int64_t count) {
  require(begin >= 0 && count >= 0 && begin <= t.numel() - count,
          "{}: tensor '{}': elements [{}, {}) asked for, outside its {} elements", t.file, t.name, begin, begin + count,
          t.numel());
  return t.data + size_t(begin) * dtype_size(t.dtype);
}

// Elements [begin, begin + count) of t as fp32 into dst, then their pages released.
void read_f32_range(const TensorInfo& t, int64_t begin, int64_t count, float* dst) {
  const uint8_t* first = element_range(t, begin, count);
  if (count == 0) return;
  const size_t element = dtype_size(t.dtype);
  if (t.dtype == DType::F32)
    std::memcpy(dst, first, size_t(count) * 4);
  else
    convert_elements(t, begin, count, dst, [](float v) { return v; });
  release_pages(first, size_t(count) * element);
}

}  // namespace

void CheckpointReader::read_f32(const std::string& name, const std::vector<int64_t>& expected_shape, float* dst) const {
  const TensorInfo& t = get_shaped(name, expected_shape);
  read_f32_range(t, 0, t.numel(), dst);
}

void CheckpointReader::read_f32_part(const std::string& name, const std::vector<int64_t>& expected_shape,
                                     int64_t begin, int64_t count, float* dst) const {
  read_f32_range(get_shaped(name, expected_shape), begin, count, dst);
}

void CheckpointReader::read_stored_part(const std::string& name, const std::vector<int64_t>& expected_shape,
                                        int64_t begin, int64_t count,
                                        const std::function<void(const uint8_t* bytes)>& use) const {
  const TensorInfo& t = get_shaped(name, expected_shape);
  const uint8_t* first = element_range(t, begin, count);
  if (count == 0) return;
  use(first);
  release_pages(first, size_t(count) * dtype_size(t.dtype));
}

const TensorInfo& CheckpointReader::get_bytes(const std::string& name) const {
  auto it = bytes_by_name_.find(name);
  if (it != bytes_by_name_.end()) return *it->second;
  if (!has(name)) fail("{}: tensor '{}': expected in the checkpoint, found no such tensor", dir_, name);
  for (const auto& file : files_) {
    auto u = file->unsupported_.find(name);
    if (u != file->unsupported_.end())
      fail("{}: tensor '{}': expected dtype U8, found {}", file->path(), name, u->second);
  }
  fail("{}: tensor '{}': expected dtype U8, found {}", get(name).file, name, dtype_name(get(name).dtype));
}

std::vector<int64_t> CheckpointReader::bytes_shape(const std::string& name) const { return get_bytes(name).shape; }

void CheckpointReader::read_u8(const std::string& name, const std::vector<int64_t>& expected_shape,
                               uint8_t* dst) const {
  const TensorInfo& t = require_shape(get_bytes(name), expected_shape);
  std::memcpy(dst, t.data, t.nbytes);
  release_pages(t);
}

void CheckpointReader::read_bf16(const std::string& name, const std::vector<int64_t>& expected_shape, bf16* dst) const {
  const TensorInfo& t = get_shaped(name, expected_shape);
  if (t.numel() == 0) return;
  convert_elements(t, 0, t.numel(), dst, [](float v) { return float_to_bf16(v); });
  release_pages(t);
}

void write_safetensors(const std::string& path, const std::vector<TensorToWrite>& tensors, DType dtype,
                       const std::map<std::string, std::string>& metadata) {
  write_safetensors_sized(path, tensors, tensor_bytes(path, tensors, dtype), dtype, metadata);
}

// Each file is replaced atomically; the directory as a whole is not (a crash between shards can
// leave a mix), so checkpoints that must survive a crash are written to a fresh directory and
// renamed into place by the caller.
void write_model_weights(const std::string& dir, const std::vector<TensorToWrite>& tensors, DType dtype,
                         uint64_t max_shard_bytes, WorkProgress* progress) {
  require(!tensors.empty(), "{}: expected model weights to write, found no tensors", dir);
  require(max_shard_bytes > 0, "{}: expected a positive shard size limit", dir);
  std::vector<uint64_t> sizes = tensor_bytes(dir, tensors, dtype);
  WrittenBytes written_bytes{progress, "writing " + dir};
  for (uint64_t b : sizes) written_bytes.total += double(b);
  make_dirs(dir);
  // transformers refuses to load safetensors files whose metadata lacks "format".
  const std::map<std::string, std::string> metadata = {{"format", "pt"}};
  auto shards = plan_shards(sizes, max_shard_bytes);

  if (shards.size() == 1) {
    write_safetensors_sized(dir + "/" + kSingleFileName, tensors, sizes, dtype, metadata, &written_bytes);
    remove_stale_weight_files(dir, {kSingleFileName});
    return;
  }
  std::set<std::string> written;
  uint64_t total_size = 0;
  for (size_t s = 0; s < shards.size(); ++s) {
    std::vector<TensorToWrite> part;
    std::vector<uint64_t> part_sizes;
    for (size_t i : shards[s]) {
      part.push_back(tensors[i]);
      part_sizes.push_back(sizes[i]);
      total_size += sizes[i];
    }
    std::string name = shard_file_name(s, shards.size());
    write_safetensors_sized(dir + "/" + name, part, part_sizes, dtype, metadata, &written_bytes);
    written.insert(name);
  }
  write_file_atomic(dir + "/" + kIndexFileName, index_json(tensors, shards, total_size));
  written.insert(kIndexFileName);
  remove_stale_weight_files(dir, written);
}

}  // namespace keel::formats
