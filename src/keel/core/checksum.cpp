#include "keel/core/checksum.h"

#include <fmt/format.h>
#include <xxhash.h>

#include <array>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <memory>
#include <vector>

#include "keel/core/error.h"

namespace keel {

uint64_t checksum(const void* data, size_t size) { return XXH3_64bits(data, size); }

uint32_t crc32c(const void* data, size_t size) {
  // Byte-at-a-time with the reflected polynomial: event files are a few hundred bytes a step.
  static const auto table = [] {
    std::array<uint32_t, 256> t{};
    for (uint32_t i = 0; i < 256; ++i) {
      uint32_t c = i;
      for (int k = 0; k < 8; ++k) c = (c & 1) ? (c >> 1) ^ 0x82F63B78u : c >> 1;
      t[i] = c;
    }
    return t;
  }();
  uint32_t crc = ~0u;
  const auto* p = static_cast<const unsigned char*>(data);
  for (size_t i = 0; i < size; ++i) crc = table[(crc ^ p[i]) & 0xFF] ^ (crc >> 8);
  return ~crc;
}

uint64_t file_checksum(const std::string& path) {
  std::unique_ptr<std::FILE, int (*)(std::FILE*)> file(std::fopen(path.c_str(), "rb"), std::fclose);
  require(file != nullptr, "{}: cannot open ({})", path, std::strerror(errno));
  std::unique_ptr<XXH3_state_t, XXH_errorcode (*)(XXH3_state_t*)> state(XXH3_createState(), XXH3_freeState);
  XXH3_64bits_reset(state.get());
  std::vector<char> buffer(1 << 20);
  size_t n;
  while ((n = std::fread(buffer.data(), 1, buffer.size(), file.get())) > 0)
    XXH3_64bits_update(state.get(), buffer.data(), n);
  require(!std::ferror(file.get()), "{}: read error ({})", path, std::strerror(errno));
  return XXH3_64bits_digest(state.get());
}

std::string checksum_hex(uint64_t value) { return fmt::format("{:016x}", value); }

std::optional<uint64_t> checksum_from_hex(std::string_view hex) {
  if (hex.size() != 16) return std::nullopt;
  uint64_t v = 0;
  for (char c : hex) {
    const int d = c >= '0' && c <= '9' ? c - '0' : c >= 'a' && c <= 'f' ? c - 'a' + 10 : -1;
    if (d < 0) return std::nullopt;
    v = v << 4 | uint64_t(d);
  }
  return v;
}

}  // namespace keel
