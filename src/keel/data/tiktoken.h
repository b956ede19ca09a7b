// tiktoken rank files: one "base64-token rank" line per token, ranks 0..N-1 (cl100k_base.tiktoken,
// o200k_base.tiktoken, GLM-4's tokenizer.model). A rank file holds no pre-tokenizer and no special
// tokens: the pattern is named (gpt2, cl100k, o200k, glm4, qwen2) and the special tokens of the named
// encoding are added when the vocabulary has that encoding's size.
#pragma once
#include <string>
#include <string_view>
#include <vector>

#include "keel/data/tokenizer.h"

namespace keel::data {

// The token bytes by rank. keel::Error naming `origin` and the line for malformed base64, a
// missing or non-numeric rank, a repeated rank or token, or ranks that leave a gap.
std::vector<std::string> parse_tiktoken_ranks(std::string_view text, std::string_view origin);

// The special tokens of the encoding `pattern` names when `rank_count` matches it (cl100k_base,
// o200k_base, gpt2, GLM-4's list after its ranks); empty otherwise.
std::vector<AddedToken> tiktoken_special_tokens(std::string_view pattern, size_t rank_count);

// The pattern name a vocabulary of `rank_count` tokens implies (cl100k_base: 100256, o200k_base:
// 199998, gpt2: 50256, GLM-4: 151329); empty when unknown.
std::string_view tiktoken_pattern_for(size_t rank_count);

Tokenizer tiktoken_tokenizer(std::vector<std::string> ranks, std::string_view pattern, std::string origin);

// `pattern` empty: inferred with tiktoken_pattern_for, keel::Error when that fails.
Tokenizer load_tiktoken(const std::string& path, std::string_view pattern);

}  // namespace keel::data
