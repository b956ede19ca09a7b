#include "keel/core/process_memory.h"

#include <fcntl.h>
#include <unistd.h>

#include <cstdlib>
#include <cstring>

namespace keel {
namespace {

// The value of a "Key:   1234 kB" line of /proc/self/status, in bytes. Read with plain system
// calls into a stack buffer, so asking allocates nothing (the step loop may ask).
size_t status_kib_field(const char* key) {
  const int fd = ::open("/proc/self/status", O_RDONLY | O_CLOEXEC);
  if (fd < 0) return 0;
  char text[8192];
  size_t used = 0;
  for (ssize_t n; used + 1 < sizeof text && (n = ::read(fd, text + used, sizeof text - 1 - used)) > 0;)
    used += size_t(n);
  ::close(fd);
  text[used] = '\0';
  const size_t key_len = std::strlen(key);
  for (const char* line = text; line && *line; line = std::strchr(line, '\n') ? std::strchr(line, '\n') + 1 : nullptr) {
    if (std::strncmp(line, key, key_len) == 0 && line[key_len] == ':')
      return size_t(std::strtoull(line + key_len + 1, nullptr, 10)) * 1024;  // the kernel writes kB = KiB
  }
  return 0;
}

}  // namespace

size_t peak_resident_bytes() { return status_kib_field("VmHWM"); }
size_t resident_bytes() { return status_kib_field("VmRSS"); }

size_t physical_memory_bytes() {
  const long pages = sysconf(_SC_PHYS_PAGES), page = sysconf(_SC_PAGESIZE);
  return pages > 0 && page > 0 ? size_t(pages) * size_t(page) : 0;
}

}  // namespace keel
