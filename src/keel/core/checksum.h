// Content checksums (XXH3, 64-bit): fast enough to verify multi-GB checkpoints and shards at
// load time, so corruption is an error rather than silently wrong weights.
#pragma once
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>

namespace keel {

uint64_t checksum(const void* data, size_t size);
inline uint64_t checksum(std::string_view bytes) { return checksum(bytes.data(), bytes.size()); }
// Streams the file; keel::Error naming the path if it cannot be read.
uint64_t file_checksum(const std::string& path);
std::string checksum_hex(uint64_t value);  // 16 lowercase hex digits
// The inverse, for a checksum read from a manifest: nullopt unless `hex` is exactly 16 lowercase
// hex digits (the caller names the file and field in its error).
std::optional<uint64_t> checksum_from_hex(std::string_view hex);

// CRC-32C (Castagnoli), the checksum of the TFRecord framing TensorBoard's event files use: not
// for keel's own files (XXH3 above is faster), only where a format prescribes it.
uint32_t crc32c(const void* data, size_t size);
inline uint32_t crc32c(std::string_view bytes) { return crc32c(bytes.data(), bytes.size()); }

}  // namespace keel
