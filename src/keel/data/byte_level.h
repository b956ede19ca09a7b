// GPT-2's byte-to-unicode spelling of byte-level tokens, the form tokenizer.json stores them in:
// each byte maps to one printable code point (the printable Latin-1 bytes to themselves, the other
// 68 bytes to U+0100 onwards in byte order), so " the" is spelled "Ġthe" and "\n" is "Ċ".
// (bytes_to_unicode in GPT-2's encoder.py and Hugging Face's ByteLevel pre-tokenizer.)
#pragma once
#include <string>
#include <string_view>

namespace keel::data {

// The byte-level spelling (UTF-8) of raw bytes.
std::string byte_level_spelling(std::string_view bytes);

// The raw bytes a byte-level spelling stands for, appended to `bytes`; false when `spelling` holds
// a character outside the 256-character alphabet (or is not valid UTF-8).
bool bytes_from_byte_level(std::string_view spelling, std::string& bytes);

}  // namespace keel::data
