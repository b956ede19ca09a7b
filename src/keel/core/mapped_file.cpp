#include "keel/core/mapped_file.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <system_error>
#include <utility>

#include "keel/core/error.h"

namespace keel {
namespace {
std::string errno_text(int error) { return std::system_category().message(error); }
}  // namespace

MappedFile::MappedFile(const std::string& path, std::string_view what, size_t min_bytes) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) fail("{}: cannot open {}: {}", path, what, errno_text(errno));
  struct stat st {};
  if (::fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
    ::close(fd);
    fail("{}: expected a regular {}, found {}", path, what, S_ISDIR(st.st_mode) ? "a directory" : "something else");
  }
  const size_t size = size_t(st.st_size);
  if (size < min_bytes || size == 0) {
    ::close(fd);
    fail("{}: expected a {} of at least {} bytes, found a {}-byte file (truncated?)", path, what,
         std::max<size_t>(min_bytes, 1), size);
  }
  void* addr = ::mmap(nullptr, size, PROT_READ, MAP_PRIVATE, fd, 0);
  const int error = errno;
  ::close(fd);
  if (addr == MAP_FAILED) fail("{}: cannot memory-map {} bytes: {}", path, size, errno_text(error));
  addr_ = addr;
  size_ = size;
}

MappedFile::~MappedFile() {
  if (addr_) ::munmap(addr_, size_);
}

MappedFile::MappedFile(MappedFile&& other) noexcept
    : addr_(std::exchange(other.addr_, nullptr)), size_(std::exchange(other.size_, 0)) {}

MappedFile& MappedFile::operator=(MappedFile&& other) noexcept {
  if (this != &other) {
    if (addr_) ::munmap(addr_, size_);
    addr_ = std::exchange(other.addr_, nullptr);
    size_ = std::exchange(other.size_, 0);
  }
  return *this;
}

void MappedFile::release(size_t offset, size_t size) const {
  if (!addr_ || offset >= size_) return;
  const size_t page = size_t(::sysconf(_SC_PAGESIZE));
  const size_t begin = (offset + page - 1) / page * page, end = std::min(offset + size, size_) / page * page;
  if (end > begin) ::madvise(static_cast<char*>(addr_) + begin, end - begin, MADV_DONTNEED);
}

}  // namespace keel
