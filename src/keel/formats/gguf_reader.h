// Reading GGUF files (ggml's docs/gguf.md, versions 2 and 3), the format gguf_writer.h writes: the
// key-value metadata decoded, the tensor infos checked against the file (names, at most four
// dimensions, known ggml types, whole blocks per row, data inside the file at the alignment, no two
// tensors overlapping), and each tensor's bytes as a view into the mapped file. Every malformed
// part is a keel::Error naming the file, the byte offset and what was expected, never a read past
// the end: a GGUF file is often a download from a stranger.
#pragma once
#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "keel/core/mapped_file.h"
#include "keel/formats/gguf_writer.h"

namespace keel::formats {

// Every ggml tensor type a GGUF file may hold (ggml.h `enum ggml_type`, gguf-py's
// GGML_QUANT_SIZES): its name, elements per block and bytes per block. nullptr for an unknown id.
struct GgmlTypeTraits {
  uint32_t id;
  const char* name;
  int64_t block_size, type_size;
};
const GgmlTypeTraits* ggml_type_traits(uint32_t id);

// One metadata entry. Scalars are held in the member of their kind; arrays of strings in
// `strings`, arrays of numbers or booleans in `numbers` (every GGUF integer fits a double's 53
// bits up to 2^53; larger 64-bit values are kept exactly in `integers` too).
struct GgufEntry {
  std::string key;
  GgufValueType type = GgufValueType::Uint8;
  GgufValueType element = GgufValueType::Uint8;  // for arrays
  uint64_t count = 1;                            // elements of an array; 1 for a scalar
  std::string string;                            // String
  double number = 0;                             // the numeric and Bool scalars
  int64_t integer = 0;                           // the integer scalars, exactly (Uint64 above 2^63 wraps)
  std::vector<std::string> strings;              // array of String
  std::vector<double> numbers;                   // array of a numeric type or Bool
  bool is_array() const { return type == GgufValueType::Array; }
};

struct GgufTensorInfo {
  std::string name;
  std::vector<int64_t> shape;  // outermost first, as torch and numpy (the file holds it reversed)
  uint32_t type = 0;           // the ggml type id (ggml_type_traits)
  uint64_t offset = 0;         // from the start of the data section
  uint64_t nbytes = 0;
  int64_t elements() const;
};

class GgufFile {
 public:
  // Maps and checks `path`.
  explicit GgufFile(const std::string& path);
  // Checks `bytes` (held by the caller for the object's life); `path` names them in errors.
  GgufFile(std::string_view bytes, std::string path);

  const std::string& path() const { return path_; }
  uint32_t version() const { return version_; }
  const std::vector<GgufEntry>& metadata() const { return metadata_; }
  const GgufEntry* find(std::string_view key) const;  // nullptr if absent
  // The value of a string / integer key; nullopt if absent, a keel::Error naming the key if it
  // holds another type.
  std::optional<std::string> string_value(std::string_view key) const;
  std::optional<int64_t> integer_value(std::string_view key) const;
  // A numeric scalar (float or integer) as a double: a Float32 widened exactly, as gguf-py reads it.
  std::optional<double> number_value(std::string_view key) const;
  // A Bool scalar; a keel::Error naming the key if it holds another type.
  std::optional<bool> bool_value(std::string_view key) const;
  const std::vector<GgufTensorInfo>& tensors() const { return tensors_; }
  uint64_t alignment() const { return alignment_; }
  uint64_t data_offset() const { return data_offset_; }  // where the data section begins in the file
  std::span<const uint8_t> tensor_bytes(const GgufTensorInfo& t) const;
  // Done with tensor t's bytes: their pages leave the resident set (MappedFile::release).
  void release_tensor_bytes(const GgufTensorInfo& t) const { mapped_.release(data_offset_ + t.offset, t.nbytes); }

 private:
  void parse();
  MappedFile mapped_;
  std::string_view bytes_;
  std::string path_;
  uint32_t version_ = 0;
  std::vector<GgufEntry> metadata_;
  std::vector<GgufTensorInfo> tensors_;
  uint64_t alignment_ = kGgufAlignment;
  uint64_t data_offset_ = 0;
};

}  // namespace keel::formats
