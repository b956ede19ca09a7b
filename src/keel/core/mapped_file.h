// A regular file mapped read-only into memory, unmapped when the object goes. Pages come from the
// page cache on demand (MAP_PRIVATE + PROT_READ), so opening a 20 GB model file costs nothing
// until its bytes are read, and processes reading the same file share its pages.
#pragma once
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

namespace keel {

class MappedFile {
 public:
  MappedFile() = default;
  // `what` names the kind of file in errors ("GGUF file"): a file that cannot be opened, is not a
  // regular file, or is shorter than `min_bytes` is a keel::Error naming the path.
  MappedFile(const std::string& path, std::string_view what, size_t min_bytes = 0);
  ~MappedFile();
  MappedFile(MappedFile&& other) noexcept;
  MappedFile& operator=(MappedFile&& other) noexcept;
  MappedFile(const MappedFile&) = delete;
  MappedFile& operator=(const MappedFile&) = delete;

  const uint8_t* data() const { return static_cast<const uint8_t*>(addr_); }
  size_t size() const { return size_; }
  std::string_view bytes() const { return {static_cast<const char*>(addr_), size_}; }
  // Drops the pages wholly inside [offset, offset + size) from this process's memory (madvise
  // MADV_DONTNEED): a reader done with a part of a large file keeps its resident set at what it
  // still needs. Read again, they come back from the page cache. Advice only: failures are ignored.
  void release(size_t offset, size_t size) const;

 private:
  void* addr_ = nullptr;
  size_t size_ = 0;
};

}  // namespace keel
