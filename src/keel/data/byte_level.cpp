#include "keel/data/byte_level.h"

#include <array>
#include <cstdint>

namespace keel::data {
namespace {

struct ByteLevelAlphabet {
  std::array<uint16_t, 256> code_point_of_byte{};
  std::array<int16_t, 324> byte_of_code_point{};  // every code point of the alphabet is below 324
  ByteLevelAlphabet() {
    byte_of_code_point.fill(-1);
    int next = 256;
    for (int b = 0; b < 256; ++b) {
      const bool printable = (b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE && b <= 0xFF);
      code_point_of_byte[b] = uint16_t(printable ? b : next++);
      byte_of_code_point[code_point_of_byte[b]] = int16_t(b);
    }
  }
};

const ByteLevelAlphabet& alphabet() {
  static const ByteLevelAlphabet table;
  return table;
}

}  // namespace

std::string byte_level_spelling(std::string_view bytes) {
  const auto& a = alphabet();
  std::string out;
  out.reserve(bytes.size() * 2);
  for (unsigned char b : bytes) {
    const uint16_t cp = a.code_point_of_byte[b];
    if (cp < 0x80) {
      out += char(cp);
    } else {  // all below U+0800: two UTF-8 bytes
      out += char(0xC0 | (cp >> 6));
      out += char(0x80 | (cp & 0x3F));
    }
  }
  return out;
}

bool bytes_from_byte_level(std::string_view spelling, std::string& bytes) {
  const auto& a = alphabet();
  for (size_t i = 0; i < spelling.size();) {
    const auto c = static_cast<unsigned char>(spelling[i]);
    uint32_t cp;
    if (c < 0x80) {
      cp = c;
      i += 1;
    } else if ((c & 0xE0) == 0xC0 && i + 1 < spelling.size() &&
               (static_cast<unsigned char>(spelling[i + 1]) & 0xC0) == 0x80) {
      cp = (uint32_t(c & 0x1F) << 6) | (static_cast<unsigned char>(spelling[i + 1]) & 0x3F);
      i += 2;
      if (cp < 0x80) return false;  // overlong
    } else {
      return false;
    }
    if (cp >= a.byte_of_code_point.size() || a.byte_of_code_point[cp] < 0) return false;
    bytes += char(a.byte_of_code_point[cp]);
  }
  return true;
}

}  // namespace keel::data
