#include "keel/core/file_io.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdint>
#include <cstring>
#include <system_error>

#include "keel/core/error.h"

namespace keel {
namespace {

// std::system_category().message is strerror_r underneath: safe from several threads at once,
// unlike strerror.
std::string errno_text(int error) { return std::system_category().message(error); }

std::string parent_dir(const std::string& path) {
  size_t slash = path.rfind('/');
  if (slash == std::string::npos) return ".";
  if (slash == 0) return "/";
  return path.substr(0, slash);
}

std::string base_name(const std::string& path) {
  size_t slash = path.rfind('/');
  return slash == std::string::npos ? path : path.substr(slash + 1);
}

// A rename is durable only once the directory entry itself reaches the disk.
void fsync_dir(const std::string& dir) {
  int fd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd < 0) fail("{}: cannot open directory to sync it: {}", dir, errno_text(errno));
  int rc = ::fsync(fd);
  int error = errno;
  ::close(fd);
  // Some file systems (e.g. certain network or FUSE mounts) cannot fsync a directory; the
  // rename has still happened, so only real I/O errors count.
  if (rc != 0 && error != EINVAL && error != ENOTSUP) {
    fail("{}: cannot sync directory: {}", dir, errno_text(error));
  }
}

}  // namespace

AtomicFileWriter::AtomicFileWriter(std::string path) : path_(std::move(path)) {
  require(!path_.empty() && path_.back() != '/', "'{}': expected a file path, found a directory path", path_);
  // Same directory as the target so that rename() is atomic (never crosses a file system).
  size_t slash = path_.rfind('/');
  std::string dir_prefix = slash == std::string::npos ? "" : path_.substr(0, slash + 1);
  tmp_path_ = dir_prefix + "." + base_name(path_) + ".tmp." + std::to_string(::getpid());
  fd_ = ::open(tmp_path_.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd_ < 0) fail("{}: cannot create temporary file {}: {}", path_, tmp_path_, errno_text(errno));
}

AtomicFileWriter::~AtomicFileWriter() {
  if (committed_) return;
  if (fd_ >= 0) ::close(fd_);
  ::unlink(tmp_path_.c_str());
}

void AtomicFileWriter::write(const void* data, size_t size) {
  require(fd_ >= 0 && !committed_, "{}: write after commit", path_);
  const char* p = static_cast<const char*>(data);
  while (size > 0) {
    // write() may write fewer bytes than asked (signals, pipes, large requests): loop.
    ssize_t n = ::write(fd_, p, size);
    if (n < 0) {
      if (errno == EINTR) continue;
      fail("{}: cannot write temporary file {}: {}", path_, tmp_path_, errno_text(errno));
    }
    p += n;
    size -= size_t(n);
  }
}

void AtomicFileWriter::commit() {
  require(fd_ >= 0 && !committed_, "{}: commit called twice", path_);
  if (::fsync(fd_) != 0) fail("{}: cannot sync temporary file {}: {}", path_, tmp_path_, errno_text(errno));
  int rc = ::close(fd_);
  fd_ = -1;
  if (rc != 0) fail("{}: cannot close temporary file {}: {}", path_, tmp_path_, errno_text(errno));
  if (::rename(tmp_path_.c_str(), path_.c_str()) != 0) {
    fail("{}: cannot rename {} over it: {}", path_, tmp_path_, errno_text(errno));
  }
  committed_ = true;
  fsync_dir(parent_dir(path_));
}

void write_file_atomic(const std::string& path, std::string_view contents) {
  AtomicFileWriter file(path);
  file.write(contents);
  file.commit();
}

std::string read_file(const std::string& path, size_t max_bytes) {
  int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) fail("{}: cannot open: {}", path, errno_text(errno));
  struct stat st {};
  if (::fstat(fd, &st) == 0 && S_ISDIR(st.st_mode)) {
    ::close(fd);
    fail("{}: expected a file, found a directory", path);
  }
  auto too_large = [&](uint64_t found) {
    ::close(fd);
    fail("{}: expected a file of at most {} bytes, found {} bytes (not a configuration or metadata file?)", path,
         max_bytes, found);
  };
  if (st.st_size > 0 && uint64_t(st.st_size) > max_bytes) too_large(uint64_t(st.st_size));
  std::string contents;
  if (st.st_size > 0) contents.reserve(size_t(st.st_size));
  // Read to end of file rather than trusting st_size: pipes and /proc files report 0.
  char buffer[1 << 16];
  for (;;) {
    ssize_t n = ::read(fd, buffer, sizeof buffer);
    if (n == 0) break;
    if (n < 0) {
      if (errno == EINTR) continue;
      int error = errno;
      ::close(fd);
      fail("{}: cannot read: {}", path, errno_text(error));
    }
    if (contents.size() + size_t(n) > max_bytes) too_large(contents.size() + size_t(n));
    contents.append(buffer, size_t(n));
  }
  ::close(fd);
  return contents;
}

int64_t for_each_line(const std::string& path, size_t max_line_bytes,
                      const std::function<void(std::string_view, bool)>& fn) {
  int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) fail("{}: cannot open: {}", path, errno_text(errno));
  struct Closer {
    int fd;
    ~Closer() { ::close(fd); }
  } closer{fd};
  std::string line;
  bool skipping = false;  // inside a line already longer than max_line_bytes
  int64_t skipped = 0;
  char buffer[1 << 16];
  for (;;) {
    const ssize_t n = ::read(fd, buffer, sizeof buffer);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) fail("{}: cannot read: {}", path, errno_text(errno));
    if (n == 0) break;
    for (size_t pos = 0; pos < size_t(n);) {
      const void* found = std::memchr(buffer + pos, '\n', size_t(n) - pos);
      const size_t end = found ? size_t(static_cast<const char*>(found) - buffer) : size_t(n);
      if (!skipping) {
        if (line.size() + (end - pos) > max_line_bytes) {
          skipping = true;
          line.clear();
        } else {
          line.append(buffer + pos, end - pos);
        }
      }
      if (found) {
        if (skipping)
          ++skipped;
        else
          fn(line, true);
        line.clear();
        skipping = false;
      }
      pos = end + 1;
    }
  }
  if (skipping)
    ++skipped;
  else if (!line.empty())
    fn(line, false);
  return skipped;
}

bool path_exists(const std::string& path) {
  struct stat st {};
  return ::stat(path.c_str(), &st) == 0;
}

void make_dirs(const std::string& path) {
  require(!path.empty(), "make_dirs: expected a directory path, found an empty string");
  // Create each prefix in turn, as mkdir -p does; existing directories are fine.
  for (size_t end = path.find('/', 1);; end = path.find('/', end + 1)) {
    std::string prefix = path.substr(0, end);
    if (!prefix.empty() && ::mkdir(prefix.c_str(), 0755) != 0) {
      int error = errno;
      struct stat st {};
      if (error != EEXIST) fail("{}: cannot create directory {}: {}", path, prefix, errno_text(error));
      if (::stat(prefix.c_str(), &st) != 0 || !S_ISDIR(st.st_mode)) {
        fail("{}: cannot create directory: {} exists and is not a directory", path, prefix);
      }
    }
    if (end == std::string::npos) break;
  }
}

}  // namespace keel
