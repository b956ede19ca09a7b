// Writing GGUF files, the format of llama.cpp's models (ggml's docs/gguf.md, version 3): the magic
// "GGUF", the version, the tensor and key-value counts, the key-value metadata, one info per tensor
// (name, dimensions innermost first, ggml type, offset), then the tensors' data, each at a multiple
// of the alignment (32 bytes, ggml's default, which a file states in `general.alignment` only when it
// differs). All integers little-endian; strings are a u64 length and UTF-8 bytes.
//
// The file is written atomically (core/file_io.h): a crash or Ctrl-C leaves no partial .gguf.
// Tensors are converted and written a piece at a time, so the peak is a few MiB, not a tensor.
#pragma once
#include <cstdint>
#include <functional>
#include <string>
#include <string_view>
#include <vector>

#include "keel/core/work_progress.h"
#include "keel/formats/gguf_quants.h"

namespace keel::formats {

// GGUF's value types (gguf.h `enum gguf_type`), written into the file as they are.
enum class GgufValueType : uint32_t {
  Uint8 = 0, Int8 = 1, Uint16 = 2, Int16 = 3, Uint32 = 4, Int32 = 5, Float32 = 6, Bool = 7,
  String = 8, Array = 9, Uint64 = 10, Int64 = 11, Float64 = 12,
};

// The key-value section, in the order the keys are added (llama.cpp reads them by name; the order
// is kept so a file can match another writer's byte for byte). A key added twice is an error.
class GgufMetadata {
 public:
  void add_uint8(std::string_view key, uint8_t v);
  void add_int8(std::string_view key, int8_t v);
  void add_uint16(std::string_view key, uint16_t v);
  void add_int16(std::string_view key, int16_t v);
  void add_uint32(std::string_view key, uint32_t v);
  void add_int32(std::string_view key, int32_t v);
  void add_uint64(std::string_view key, uint64_t v);
  void add_int64(std::string_view key, int64_t v);
  void add_float32(std::string_view key, float v);
  void add_float64(std::string_view key, double v);
  void add_bool(std::string_view key, bool v);
  void add_string(std::string_view key, std::string_view v);
  // Arrays of one element type; GGUF has no empty arrays (gguf-py refuses them), nor does keel.
  void add_strings(std::string_view key, const std::vector<std::string>& v);
  void add_int32s(std::string_view key, const std::vector<int32_t>& v);
  void add_uint32s(std::string_view key, const std::vector<uint32_t>& v);
  void add_float32s(std::string_view key, const std::vector<float>& v);

  bool has(std::string_view key) const;
  const std::vector<std::string>& keys() const { return keys_; }
  size_t size() const { return keys_.size(); }
  // The key-value section as it goes into the file.
  const std::string& encoded() const { return bytes_; }

 private:
  void begin(std::string_view key, GgufValueType type);
  void begin_array(std::string_view key, GgufValueType element, size_t count);
  std::vector<std::string> keys_;
  std::string bytes_;
};

// Fills dst[0, count) with a tensor's fp32 values [begin, begin + count), in row-major order (the
// product of its shape in all).
using GgufFill = std::function<void(int64_t begin, int64_t count, float* dst)>;

// Where a tensor's bytes in the file's type already lie (a bf16 checkpoint written as bf16, its rows
// in the file's order): hands `use` the bytes of elements [begin, begin + count), contiguous and
// valid during the call. The writer writes them as they are: no conversion and no copy of keel's,
// only the kernel's copy into the page cache, which every writer of new bytes pays.
using GgufStoredBytes =
    std::function<void(int64_t begin, int64_t count, const std::function<void(const uint8_t* bytes)>& use)>;

// One tensor of the file. `shape` is the row-major shape torch and numpy give (outermost first):
// the file stores it reversed, as ggml's ne[] (gguf-py's writer does the same). The writer asks
// `fill` for the values a piece of whole rows (of shape.back() values) at a time, and converts
// each piece to `type` on the way: blocks never cross rows, so the bytes are those of the tensor
// converted whole. A large tensor's pieces are asked for from several threads at once (disjoint
// ranges, in no particular order), so fill must be safe to call so.
struct GgufTensor {
  std::string name;
  std::vector<int64_t> shape;
  GgmlType type = GgmlType::F32;
  GgufFill fill;
  // Optional: the values' bytes as `type` (F32, F16 or BF16). A piece that converting would change
  // (a NaN: ggml_converts_to_itself) is converted from `fill` instead, so the file is the same
  // either way.
  GgufStoredBytes stored;
};

inline constexpr uint64_t kGgufAlignment = 32;  // GGUF_DEFAULT_ALIGNMENT
inline constexpr size_t kGgufMaxNameBytes = 63;  // GGML_MAX_NAME (64) less the terminating NUL
// Values per piece: 4 MiB of fp32, converted in tasks of 1 MiB while the piece before is written,
// large enough that the calls and write()s per piece cost nothing next to the bytes (~1,200 for 1B).
inline constexpr int64_t kGgufPieceElements = int64_t(1) << 20;

// Writes `path` (atomically). Errors name the file and the tensor: names empty, longer than 63
// bytes or repeated, a shape of no or more than 4 dimensions (GGML_MAX_DIMS), rows that are not
// whole blocks of a block type. progress, if given, shows the bytes written. Memory: two pieces
// converted (of piece_elements values, or one row where a row is longer) and a task's fp32 per thread.
void write_gguf(const std::string& path, const GgufMetadata& metadata, const std::vector<GgufTensor>& tensors,
                WorkProgress* progress = nullptr, int64_t piece_elements = kGgufPieceElements);

}  // namespace keel::formats
