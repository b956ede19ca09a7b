// SHA-256 (FIPS 180-4), for identifiers other tools derive by hashing: llama.cpp's converter names
// a BPE pre-tokenizer by the SHA-256 of a tokenization (data/llama_cpp_vocab.h). Not for secrets.
#pragma once
#include <string>
#include <string_view>

namespace keel {

// The digest of `bytes` as 64 lowercase hex digits (Python's hashlib.sha256(...).hexdigest()).
std::string sha256_hex(std::string_view bytes);

}  // namespace keel
