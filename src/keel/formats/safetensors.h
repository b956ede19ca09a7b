// The safetensors format (https://github.com/huggingface/safetensors): an 8-byte little-endian
// header length N, N bytes of JSON {name: {dtype, shape, data_offsets: [begin, end]}, optional
// "__metadata__": {str: str}}, then the raw little-endian tensor bytes.
// Files are untrusted: every size, offset and shape is checked before use, and errors name the
// file and the tensor.
#pragma once
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "keel/core/dtype.h"
#include "keel/core/mapped_file.h"
#include "keel/core/work_progress.h"

namespace keel::formats {

struct TensorInfo {
  std::string name;
  DType dtype = DType::F32;
  std::vector<int64_t> shape;
  const uint8_t* data = nullptr;  // into the memory-mapped file
  size_t nbytes = 0;
  std::string file;  // path of the file it lives in (for error messages)
  int64_t numel() const;
};

// One memory-mapped .safetensors file. Unsupported dtypes (anything but F32, BF16, F16) are an
// error naming the tensor only when that tensor is read, so other tensors remain usable.
class SafetensorsFile {
 public:
  static std::unique_ptr<SafetensorsFile> open(const std::string& path);
  ~SafetensorsFile();
  SafetensorsFile(const SafetensorsFile&) = delete;
  SafetensorsFile& operator=(const SafetensorsFile&) = delete;

  const std::string& path() const { return path_; }
  const std::vector<TensorInfo>& tensors() const { return tensors_; }
  const TensorInfo* find(const std::string& name) const;  // nullptr if absent
  const std::map<std::string, std::string>& metadata() const { return metadata_; }

 private:
  SafetensorsFile() = default;
  std::string path_;
  MappedFile map_;  // tensors' bytes point into it
  std::vector<TensorInfo> tensors_;
  std::map<std::string, std::string> unsupported_;  // tensor name -> its dtype string
  std::vector<TensorInfo> bytes_;                   // the U8 tensors among them, read as bytes
  std::map<std::string, std::string> metadata_;
  friend class CheckpointReader;
};

// Whether `dir` is a model directory holding config.json and no weights in any format (no
// .safetensors, .bin, .pt, .pth or .gguf file): a model to create from its config, not to load.
bool holds_config_only(const std::string& dir);

// A model directory's weights: model.safetensors, or shards listed by model.safetensors.index.json
// ("weight_map": {tensor: file}). All tensors of all shards are visible by name.
class CheckpointReader {
 public:
  static CheckpointReader open_dir(const std::string& dir);
  // One .safetensors file on its own (a PEFT adapter's adapter_model.safetensors).
  static CheckpointReader open_file(const std::string& path);
  std::vector<std::string> names() const;
  bool has(const std::string& name) const;
  const std::string& dir() const { return dir_; }  // or the file, for open_file
  // Throws keel::Error naming the tensor and the directory if absent.
  const TensorInfo& get(const std::string& name) const;
  // Converts the tensor (F32, BF16 or F16) to fp32 into dst, after checking its shape equals
  // `expected_shape` exactly (error names tensor, file, expected and found shapes). Its file pages
  // then leave the process's resident set (they stay in the page cache): a load holds one
  // tensor's pages at a time.
  void read_f32(const std::string& name, const std::vector<int64_t>& expected_shape, float* dst) const;
  // The same for elements [begin, begin + count) of the tensor (row-major) only, and only their
  // pages released: a writer streaming a large tensor a piece at a time holds one piece. A range
  // outside the tensor is an error naming it.
  void read_f32_part(const std::string& name, const std::vector<int64_t>& expected_shape, int64_t begin,
                     int64_t count, float* dst) const;
  // Elements [begin, begin + count) as the file stores them (in dtype_of(name)), handed to `use`
  // where they lie in the file's mapping, then their pages released as above: a writer that keeps
  // the dtype writes them without converting (a bf16 checkpoint exported as bf16 GGUF). Range and
  // shape checked as read_f32_part checks them.
  void read_stored_part(const std::string& name, const std::vector<int64_t>& expected_shape, int64_t begin,
                        int64_t count, const std::function<void(const uint8_t* bytes)>& use) const;
  // The same into bf16: BF16 as stored, F32 rounded to nearest even, F16 through fp32.
  void read_bf16(const std::string& name, const std::vector<int64_t>& expected_shape, bf16* dst) const;
  DType dtype_of(const std::string& name) const { return get(name).dtype; }
  // U8 tensors (bitsandbytes' packed codes and quantization states: model/bnb_4bit.h), as bytes.
  // Errors name the tensor, its file and the dtype or shape found. Pages released as above.
  bool has_bytes(const std::string& name) const { return bytes_by_name_.count(name) != 0; }
  std::vector<int64_t> bytes_shape(const std::string& name) const;
  void read_u8(const std::string& name, const std::vector<int64_t>& expected_shape, uint8_t* dst) const;

 private:
  const TensorInfo& get_shaped(const std::string& name, const std::vector<int64_t>& expected_shape) const;
  const TensorInfo& get_bytes(const std::string& name) const;
  std::string dir_;
  std::vector<std::shared_ptr<SafetensorsFile>> files_;
  std::map<std::string, const TensorInfo*> by_name_;
  std::map<std::string, const TensorInfo*> bytes_by_name_;
};

// A tensor to write: fp32 source data converted to `dtype` on write. The data is `data`, or, when
// `read` is set, comes piece by piece from read(begin, max_count, &n): a pointer to the tensor's
// elements [begin, begin + n), 0 < n <= max_count, valid until the next call; pieces are asked
// for in increasing order (a streamed source: ZeRO-1 moments arriving from other ranks).
struct TensorToWrite {
  using Reader = std::function<const float*(int64_t begin, int64_t max_count, int64_t* n)>;
  TensorToWrite(std::string name, std::vector<int64_t> shape, const float* data)
      : name(std::move(name)), shape(std::move(shape)), data(data) {}
  TensorToWrite(std::string name, std::vector<int64_t> shape, Reader read)
      : name(std::move(name)), shape(std::move(shape)), read(std::move(read)) {}

  std::string name;
  std::vector<int64_t> shape;
  const float* data = nullptr;
  Reader read;
};

// Writes one .safetensors file atomically (temporary file, fsync, rename). Tensor order in the
// file follows the given order; names must be unique. metadata goes into "__metadata__".
void write_safetensors(const std::string& path, const std::vector<TensorToWrite>& tensors, DType dtype,
                       const std::map<std::string, std::string>& metadata = {});

// Writes the weights of a model directory: a single model.safetensors if the total fits in
// max_shard_bytes, else model-00001-of-0000N.safetensors shards plus model.safetensors.index.json
// (with "metadata": {"total_size": bytes}), as transformers' save_pretrained does.
// progress, if given, shows the bytes written (core/work_progress.h).
void write_model_weights(const std::string& dir, const std::vector<TensorToWrite>& tensors, DType dtype,
                         uint64_t max_shard_bytes = 5ull << 30, WorkProgress* progress = nullptr);

}  // namespace keel::formats
