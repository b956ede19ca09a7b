// A .safetensors file (8-byte header length, JSON header, data): SafetensorsFile::open on the
// file, then CheckpointReader::open_dir on a model directory holding it as model.safetensors,
// reading every tensor keel accepts to fp32 (the bytes behind each TensorInfo must exist), whole
// and a piece at a time, and a piece's stored bytes as they lie.
#include <cstring>
#include <vector>

#include "fuzz_support.h"
#include "keel/formats/safetensors.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace keel;
  static const std::string dir = fuzz::scratch_dir() + "/model";
  static const bool made = std::filesystem::create_directories(dir) || true;
  (void)made;
  const std::string path = dir + "/model.safetensors";
  fuzz::write_bytes(path, data, size);
  try {
    auto file = formats::SafetensorsFile::open(path);
    uint64_t sum = 0;
    for (const auto& t : file->tensors()) {
      if (t.nbytes > 0) sum += t.data[0] + t.data[t.nbytes - 1];  // first and last byte: in the mapping
      if (file->find(t.name) != &t) fuzz::property_failed("find(name) returns another tensor", t.name);
    }
    (void)sum;
  } catch (const Error&) {}
  try {
    auto reader = formats::CheckpointReader::open_dir(dir);
    std::vector<float> out;
    uint64_t sum_bytes = 0;
    for (const auto& name : reader.names()) {
      try {
        const formats::TensorInfo& t = reader.get(name);
        out.assign(size_t(t.numel()), 0.0f);  // numel * element size == bytes in the file: bounded by the input
        reader.read_f32(name, t.shape, out.data());
        // A piece (as the GGUF export streams a tensor) equals the same values of the whole read,
        // and a piece past the end is an error, not a read outside the mapping.
        const int64_t n = t.numel(), begin = n / 3, count = n - begin - n / 5;
        std::vector<float> part(size_t(count), 0.0f);
        reader.read_f32_part(name, t.shape, begin, count, part.data());
        if (count > 0 && std::memcmp(part.data(), out.data() + begin, size_t(count) * sizeof(float)) != 0)
          fuzz::property_failed("read_f32_part differs from read_f32's values", name);
        bool refused = false;
        try {
          reader.read_f32_part(name, t.shape, n - count + 1, count, part.data());
        } catch (const Error&) {
          refused = true;
        }
        if (!refused) fuzz::property_failed("read_f32_part read past the tensor's end", name);
        // The piece's stored bytes are the tensor's own bytes there (the GGUF export copies them).
        reader.read_stored_part(name, t.shape, begin, count, [&](const uint8_t* bytes) {
          const size_t element = dtype_size(t.dtype);
          if (bytes != t.data + size_t(begin) * element)
            fuzz::property_failed("read_stored_part hands over other bytes than the piece's", name);
          if (count > 0) sum_bytes += bytes[0] + bytes[size_t(count) * element - 1];  // both ends in the mapping
        });
      } catch (const Error&) {  // an unsupported dtype: an error for that tensor only
      }
    }
    (void)sum_bytes;
  } catch (const Error&) {}
  return 0;
}
