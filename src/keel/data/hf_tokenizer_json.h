// Hugging Face tokenizer.json for byte-level BPE (GPT-2, Llama 3, Qwen2, GLM-4-9b-hf):
//   model            BPE: vocab, merges ("a b" strings or ["a", "b"] pairs), unk_token,
//                    ignore_merges, fuse_unk
//   added_tokens     content, id, special, normalized, lstrip, rstrip, single_word
//   normalizer       NFC, NFD, NFKC, NFKD, Sequence of those, or null
//   pre_tokenizer    ByteLevel (add_prefix_space, use_regex), Split (Regex or String pattern,
//                    behavior, invert), Digits, Sequence of those
//   post_processor   TemplateProcessing (the single-sequence template: BOS/EOS), ByteLevel,
//                    Sequence, or null
//   decoder          ByteLevel (or null)
// Anything else is a keel::Error naming the file and the JSON path, not a silent difference.
// BOS/EOS come from the template, or from tokenizer_config.json next to the file when present.
#pragma once
#include <simdjson.h>

#include <optional>
#include <string>
#include <string_view>

#include "keel/data/tokenizer.h"

namespace keel::data {

Tokenizer load_hf_tokenizer_json(const std::string& path);

// From the text of a tokenizer.json; `config_json` is the text of tokenizer_config.json or empty.
Tokenizer hf_tokenizer_from_json(std::string_view json, const std::string& origin, std::string_view config_json = {});

// A token named in tokenizer_config.json ("bos_token": "<s>", or an AddedToken object with
// "content"): its text, or nullopt for anything else (null included).
std::optional<std::string_view> config_token_text(simdjson::dom::element e);

}  // namespace keel::data
