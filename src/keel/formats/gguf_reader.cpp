#include "keel/formats/gguf_reader.h"

#include <fmt/format.h>

#include <algorithm>
#include <bit>
#include <cstring>
#include <limits>

#include "keel/core/error.h"

namespace keel::formats {

static_assert(std::endian::native == std::endian::little, "keel reads GGUF files on little-endian hosts only");

namespace {

constexpr GgmlTypeTraits kTypes[] = {
    {0, "F32", 1, 4},          {1, "F16", 1, 2},          {2, "Q4_0", 32, 18},      {3, "Q4_1", 32, 20},
    {6, "Q5_0", 32, 22},       {7, "Q5_1", 32, 24},       {8, "Q8_0", 32, 34},      {9, "Q8_1", 32, 36},
    {10, "Q2_K", 256, 84},     {11, "Q3_K", 256, 110},    {12, "Q4_K", 256, 144},   {13, "Q5_K", 256, 176},
    {14, "Q6_K", 256, 210},    {15, "Q8_K", 256, 292},    {16, "IQ2_XXS", 256, 66}, {17, "IQ2_XS", 256, 74},
    {18, "IQ3_XXS", 256, 98},  {19, "IQ1_S", 256, 50},    {20, "IQ4_NL", 32, 18},   {21, "IQ3_S", 256, 110},
    {22, "IQ2_S", 256, 82},    {23, "IQ4_XS", 256, 136},  {24, "I8", 1, 1},         {25, "I16", 1, 2},
    {26, "I32", 1, 4},         {27, "I64", 1, 8},         {28, "F64", 1, 8},        {29, "IQ1_M", 256, 56},
    {30, "BF16", 1, 2},        {34, "TQ1_0", 256, 54},    {35, "TQ2_0", 256, 66},   {39, "MXFP4", 32, 17},
    {40, "NVFP4", 64, 36},     {41, "Q1_0", 128, 18},     {42, "Q2_0", 64, 18},
};

constexpr uint32_t kMaxDims = 4;             // GGML_MAX_DIMS
constexpr uint64_t kMaxKeyBytes = 65535;     // what llama.cpp's gguf reader accepts for a key
constexpr size_t kMaxNameBytes = 63;         // GGML_MAX_NAME less the NUL

// A cursor over the file's bytes: every read checks what is left and names the offset.
class Cursor {
 public:
  Cursor(std::string_view bytes, const std::string& path) : bytes_(bytes), path_(path) {}
  uint64_t offset() const { return pos_; }
  uint64_t left() const { return bytes_.size() - pos_; }

  template <typename T>
  T read(std::string_view what) {
    need(sizeof(T), what);
    T v;
    std::memcpy(&v, bytes_.data() + pos_, sizeof(T));
    pos_ += sizeof(T);
    return v;
  }
  std::string string(std::string_view what, uint64_t max_bytes) {
    const uint64_t at = pos_;
    const auto n = read<uint64_t>(what);
    require(n <= max_bytes, "{}: byte {}: {} of {} bytes, expected at most {}", path_, at, what, n, max_bytes);
    need(n, what);
    std::string s(bytes_.substr(pos_, size_t(n)));
    pos_ += n;
    return s;
  }
  void need(uint64_t n, std::string_view what) const {
    require(n <= left(), "{}: byte {}: {} needs {} bytes, and the file ends {} bytes later (truncated?)", path_, pos_,
            what, n, left());
  }
  void skip(uint64_t n, std::string_view what) {
    need(n, what);
    pos_ += n;
  }

 private:
  std::string_view bytes_;
  const std::string& path_;
  uint64_t pos_ = 0;
};

size_t scalar_bytes(GgufValueType t) {
  switch (t) {
    case GgufValueType::Uint8: case GgufValueType::Int8: case GgufValueType::Bool: return 1;
    case GgufValueType::Uint16: case GgufValueType::Int16: return 2;
    case GgufValueType::Uint32: case GgufValueType::Int32: case GgufValueType::Float32: return 4;
    case GgufValueType::Uint64: case GgufValueType::Int64: case GgufValueType::Float64: return 8;
    default: return 0;
  }
}

// A numeric or Bool scalar at the cursor, as a double and (for integers) exactly.
double read_number(Cursor& c, GgufValueType t, int64_t* integer) {
  int64_t i = 0;
  double d = 0;
  switch (t) {
    case GgufValueType::Uint8: i = c.read<uint8_t>("a uint8"); d = double(i); break;
    case GgufValueType::Int8: i = c.read<int8_t>("an int8"); d = double(i); break;
    case GgufValueType::Bool: i = c.read<uint8_t>("a bool") != 0; d = double(i); break;
    case GgufValueType::Uint16: i = c.read<uint16_t>("a uint16"); d = double(i); break;
    case GgufValueType::Int16: i = c.read<int16_t>("an int16"); d = double(i); break;
    case GgufValueType::Uint32: i = c.read<uint32_t>("a uint32"); d = double(i); break;
    case GgufValueType::Int32: i = c.read<int32_t>("an int32"); d = double(i); break;
    case GgufValueType::Uint64: { const auto u = c.read<uint64_t>("a uint64"); i = int64_t(u); d = double(u); break; }
    case GgufValueType::Int64: i = c.read<int64_t>("an int64"); d = double(i); break;
    case GgufValueType::Float32: d = c.read<float>("a float32"); break;
    case GgufValueType::Float64: d = c.read<double>("a float64"); break;
    default: break;
  }
  if (integer) *integer = i;
  return d;
}

bool known_value_type(uint32_t t) { return t <= uint32_t(GgufValueType::Float64); }

}  // namespace

const GgmlTypeTraits* ggml_type_traits(uint32_t id) {
  for (const auto& t : kTypes)
    if (t.id == id) return &t;
  return nullptr;
}

int64_t GgufTensorInfo::elements() const {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

GgufFile::GgufFile(const std::string& path) : mapped_(path, "GGUF file", 24), path_(path) {
  bytes_ = mapped_.bytes();
  parse();
}

GgufFile::GgufFile(std::string_view bytes, std::string path) : bytes_(bytes), path_(std::move(path)) { parse(); }

void GgufFile::parse() {
  Cursor c(bytes_, path_);
  c.need(4, "the magic \"GGUF\"");
  require(bytes_.substr(0, 4) == "GGUF", "{}: expected a GGUF file (it begins with the bytes \"GGUF\"), found {:?}",
          path_, std::string(bytes_.substr(0, 4)));
  c.skip(4, "the magic");
  version_ = c.read<uint32_t>("the version");
  require(version_ == 2 || version_ == 3,
          "{}: GGUF version {}; keel reads versions 2 and 3 (version 1 files predate 2023: convert them again with "
          "llama.cpp)",
          path_, version_);
  const auto n_tensors = c.read<uint64_t>("the tensor count");
  const auto n_kv = c.read<uint64_t>("the metadata count");
  // Each entry takes at least 12 bytes (key length, type, a value), each tensor info 28: counts
  // the file cannot hold are refused before anything is reserved for them.
  require(n_kv <= c.left() / 12 && n_tensors <= c.left() / 28,
          "{}: {} metadata entries and {} tensors announced, more than the file's {} bytes can hold (truncated?)", path_, n_kv,
          n_tensors, bytes_.size());

  metadata_.reserve(size_t(n_kv));
  for (uint64_t k = 0; k < n_kv; ++k) {
    GgufEntry e;
    e.key = c.string("a metadata key", kMaxKeyBytes);
    require(!e.key.empty(), "{}: byte {}: metadata entry {}: an empty key", path_, c.offset(), k);
    require(find(e.key) == nullptr, "{}: metadata key '{}' appears twice", path_, e.key);
    const uint64_t at = c.offset();
    const auto type = c.read<uint32_t>("a value type");
    require(known_value_type(type), "{}: byte {}: key '{}': value type {}, expected 0-12 (gguf_type)", path_, at,
            e.key, type);
    e.type = GgufValueType(type);
    if (e.type == GgufValueType::String) {
      e.string = c.string("a string value", c.left());
    } else if (e.type == GgufValueType::Array) {
      const auto element = c.read<uint32_t>("an array's element type");
      require(known_value_type(element) && element != uint32_t(GgufValueType::Array),
              "{}: byte {}: key '{}': array element type {}, expected 0-8 or 10-12 (arrays of arrays are not read)",
              path_, at + 4, e.key, element);
      e.element = GgufValueType(element);
      e.count = c.read<uint64_t>("an array's length");
      const uint64_t least = e.element == GgufValueType::String ? 8 : scalar_bytes(e.element);
      require(e.count <= c.left() / least, "{}: byte {}: key '{}': an array of {} values, more than the file holds",
              path_, at, e.key, e.count);
      if (e.element == GgufValueType::String) {
        e.strings.reserve(size_t(e.count));
        for (uint64_t i = 0; i < e.count; ++i) e.strings.push_back(c.string("an array's string", c.left()));
      } else {
        e.numbers.reserve(size_t(e.count));
        for (uint64_t i = 0; i < e.count; ++i) e.numbers.push_back(read_number(c, e.element, nullptr));
      }
    } else {
      e.number = read_number(c, e.type, &e.integer);
    }
    metadata_.push_back(std::move(e));
  }

  if (const GgufEntry* a = find("general.alignment")) {
    require(a->type == GgufValueType::Uint32 && a->integer > 0 && std::has_single_bit(uint64_t(a->integer)),
            "{}: general.alignment: expected a uint32 power of two, found {}", path_,
            a->type == GgufValueType::Uint32 ? std::to_string(a->integer) : "another type");
    alignment_ = uint64_t(a->integer);
  }

  tensors_.reserve(size_t(n_tensors));
  for (uint64_t t = 0; t < n_tensors; ++t) {
    GgufTensorInfo info;
    info.name = c.string("a tensor name", kMaxNameBytes);
    require(!info.name.empty(), "{}: byte {}: tensor {}: an empty name", path_, c.offset(), t);
    const uint64_t at = c.offset();
    const auto n_dims = c.read<uint32_t>("a tensor's dimension count");
    require(n_dims >= 1 && n_dims <= kMaxDims, "{}: byte {}: tensor '{}': {} dimensions, expected 1 to {}", path_, at,
            info.name, n_dims, kMaxDims);
    std::vector<int64_t> ne(n_dims);
    int64_t elements = 1;
    for (auto& d : ne) {
      const auto v = c.read<uint64_t>("a tensor dimension");
      require(v >= 1 && v <= uint64_t(std::numeric_limits<int64_t>::max()) / uint64_t(elements),
              "{}: tensor '{}': dimension {} (the dimensions' product must be positive and fit 63 bits)", path_,
              info.name, v);
      d = int64_t(v);
      elements *= d;
    }
    info.shape.assign(ne.rbegin(), ne.rend());
    info.type = c.read<uint32_t>("a tensor type");
    const GgmlTypeTraits* traits = ggml_type_traits(info.type);
    require(traits != nullptr, "{}: tensor '{}': ggml type {}, which keel does not know", path_, info.name, info.type);
    require(ne[0] % traits->block_size == 0, "{}: tensor '{}': rows of {} values are not whole {} blocks of {}",
            path_, info.name, ne[0], traits->name, traits->block_size);
    const uint64_t blocks = uint64_t(elements / traits->block_size);
    require(blocks <= std::numeric_limits<uint64_t>::max() / uint64_t(traits->type_size),
            "{}: tensor '{}': too large", path_, info.name);
    info.nbytes = blocks * uint64_t(traits->type_size);
    info.offset = c.read<uint64_t>("a tensor offset");
    require(info.offset % alignment_ == 0, "{}: tensor '{}': data offset {} is not a multiple of the alignment {}",
            path_, info.name, info.offset, alignment_);
    for (const auto& other : tensors_)
      require(other.name != info.name, "{}: tensor '{}' appears twice", path_, info.name);
    tensors_.push_back(std::move(info));
  }

  data_offset_ = (c.offset() + alignment_ - 1) / alignment_ * alignment_;
  const uint64_t data_bytes = bytes_.size() >= data_offset_ ? bytes_.size() - data_offset_ : 0;
  require(tensors_.empty() || bytes_.size() >= data_offset_,
          "{}: the header ends at byte {} and the file with it: no tensor data (truncated?)", path_, c.offset());
  std::vector<const GgufTensorInfo*> by_offset;
  for (const auto& t : tensors_) {
    require(t.offset <= data_bytes && t.nbytes <= data_bytes - t.offset,
            "{}: tensor '{}': {} bytes at data offset {}, past the file's end ({} bytes of data; truncated?)", path_,
            t.name, t.nbytes, t.offset, data_bytes);
    by_offset.push_back(&t);
  }
  std::sort(by_offset.begin(), by_offset.end(), [](auto* a, auto* b) { return a->offset < b->offset; });
  for (size_t i = 1; i < by_offset.size(); ++i)
    require(by_offset[i - 1]->offset + by_offset[i - 1]->nbytes <= by_offset[i]->offset,
            "{}: tensors '{}' and '{}' overlap in the file", path_, by_offset[i - 1]->name, by_offset[i]->name);
}

const GgufEntry* GgufFile::find(std::string_view key) const {
  for (const auto& e : metadata_)
    if (e.key == key) return &e;
  return nullptr;
}

std::optional<std::string> GgufFile::string_value(std::string_view key) const {
  const GgufEntry* e = find(key);
  if (!e) return std::nullopt;
  require(e->type == GgufValueType::String, "{}: {}: expected a string", path_, key);
  return e->string;
}

std::optional<int64_t> GgufFile::integer_value(std::string_view key) const {
  const GgufEntry* e = find(key);
  if (!e) return std::nullopt;
  require(scalar_bytes(e->type) > 0 && e->type != GgufValueType::Float32 && e->type != GgufValueType::Float64 &&
              e->type != GgufValueType::Bool,
          "{}: {}: expected an integer", path_, key);
  return e->integer;
}

std::optional<double> GgufFile::number_value(std::string_view key) const {
  const GgufEntry* e = find(key);
  if (!e) return std::nullopt;
  require(scalar_bytes(e->type) > 0 && e->type != GgufValueType::Bool, "{}: {}: expected a number", path_, key);
  return e->number;
}

std::optional<bool> GgufFile::bool_value(std::string_view key) const {
  const GgufEntry* e = find(key);
  if (!e) return std::nullopt;
  require(e->type == GgufValueType::Bool, "{}: {}: expected a boolean", path_, key);
  return e->number != 0;
}

std::span<const uint8_t> GgufFile::tensor_bytes(const GgufTensorInfo& t) const {
  return {reinterpret_cast<const uint8_t*>(bytes_.data()) + data_offset_ + t.offset, size_t(t.nbytes)};
}

}  // namespace keel::formats
