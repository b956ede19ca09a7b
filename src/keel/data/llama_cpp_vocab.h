// A Hugging Face tokenizer directory as llama.cpp's converter (convert_hf_to_gguf.py) puts it into
// a GGUF file's `tokenizer.*` keys: the vocabulary, the token types, the merges, the pre-tokenizer's
// name, the special token ids, whether BOS/EOS are added and the chat template. What the converter
// decides, keel decides the same way (its get_vocab_base, get_vocab_base_pre and gguf-py's
// SpecialVocab); the GGUF keys themselves are written by checkpoint/gguf_export.h.
//
// Two of the converter's paths: "gpt2", tokenizer.json's BPE vocabulary (Llama 3, Qwen2/3, Gemma 3's
// tokenizer.json), and "llama", a SentencePiece tokenizer.model's pieces with their scores
// (_set_vocab_sentencepiece: Gemma 2, and every family keel writes whose directory holds one, as
// Llama 2, Mistral and Gemma's published ones do).
#pragma once
#include <cstdint>
#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace keel::data {

// llama.cpp's token types (llama_token_type / gguf-py's TokenType).
enum class LlamaCppTokenType : int32_t { Normal = 1, Unknown = 2, Control = 3, UserDefined = 4, Unused = 5, Byte = 6 };

struct LlamaCppVocab {
  std::string model = "gpt2";  // tokenizer.ggml.model: "gpt2" or "llama" (SentencePiece)
  std::string pre;             // tokenizer.ggml.pre
  std::vector<std::string> tokens;
  std::vector<float> scores;   // tokenizer.ggml.scores: "llama" vocabularies only
  std::vector<int32_t> token_types;
  std::vector<std::string> merges;  // "left right"; a space inside a part as U+0120 (' ' + 256, as gguf-py)
  // In the order SpecialVocab sets them: tokenizer_config.json's first, then config.json's.
  std::vector<std::pair<std::string, int64_t>> special_ids;  // "bos", "eos", "unk", "sep", "pad", "cls", "mask"
  std::vector<std::pair<std::string, bool>> add_special;     // "bos", "eos", "sep"
  std::optional<std::string> chat_template;
  std::optional<bool> normalizer_lowercase, normalizer_strip_accents;
  std::optional<bool> add_prefix_space;  // tokenizer_config.json's, which the Llama converter writes
  // tokenizer.json's model.byte_fallback: a SentencePiece-style vocabulary, which the converter
  // reads this way for some families (Gemma 3, Qwen) and as "llama" with scores for others (Llama).
  bool byte_fallback = false;
  int64_t tokenizer_json_entries = 0, added_tokens = 0;  // model.vocab's and added_tokens' lengths
  // tokenizer.ggml.pre named by keel's GLM-4 rule (a GLM-4 tokenizer.json whose hash llama.cpp's table lacks:
  // its pre-tokenizer, GLM-4's regex, and [gMASK] and <sop>), not by the converter's hash.
  bool pre_by_glm4_rule = false;
};

// The files it reads, as text (what the fuzz target feeds it).
struct LlamaCppVocabFiles {
  std::string origin;  // the directory, for messages
  std::string tokenizer_json;
  std::optional<std::string> tokenizer_config_json, chat_template_jinja, chat_template_json;
  std::string config_json;  // the model's config.json ("" for none)
  // For the SentencePiece path: tokenizer.model's bytes and added_tokens.json.
  std::string sentencepiece_model;
  std::optional<std::string> added_tokens_json;
};
LlamaCppVocab llama_cpp_bpe_vocab(const LlamaCppVocabFiles& files, int64_t vocab_size);
// _create_vocab_sentencepiece and SpecialVocab(n_vocab): vocab_size entries ("[PAD<id>]", unused,
// score -10000 past the model's pieces), each piece's text, score and type (user-defined pieces
// normal, as SentencePieceProcessor has no IsUserDefined), added_tokens.json's and
// tokenizer_config.json's added_tokens_decoder over them (score -1000); "llama", pre "default".
LlamaCppVocab llama_cpp_sentencepiece_vocab(const LlamaCppVocabFiles& files, int64_t vocab_size);

// The vocabulary the converter writes for `dir`: llama_cpp_sentencepiece_vocab where it holds a
// SentencePiece tokenizer.model (the families keel writes try that first), else
// llama_cpp_bpe_vocab. `sentencepiece_only` (Gemma 2, whose converter reads nothing else): without
// a tokenizer.model, a keel::Error saying so.
LlamaCppVocab llama_cpp_vocab(const std::string& dir, int64_t vocab_size, const std::string& config_json,
                              bool sentencepiece_only = false);

// Reads `dir`'s tokenizer.json, tokenizer_config.json, chat_template.jinja / .json, and the model's
// config.json text (`config_json`, for the *_token_id keys SpecialVocab falls back to). vocab_size
// is the model's (the embedding's rows): ids the tokenizer lacks below it become "[PAD<id>]",
// unused. Errors name the file and what is not supported.
LlamaCppVocab llama_cpp_bpe_vocab(const std::string& dir, int64_t vocab_size, const std::string& config_json);

// Whether llama.cpp ends generation on token `id` of a file with this vocabulary: its
// special_eog_ids (llama-vocab.cpp), the eos/eot/eom ids and the tokens it knows by their text
// (<|eot_id|>, <|im_end|>, <end_of_turn>, <|endoftext|>, ...).
bool llama_cpp_ends_generation(const LlamaCppVocab& vocab, int64_t id);

// The pre-tokenizer name the converter gives a tokenizer whose ids for
// llama_cpp_pre_tokenizer_text() (special tokens added) are `ids`; empty when its table has none.
std::string llama_cpp_pre_tokenizer_name(const std::vector<int32_t>& ids);

}  // namespace keel::data
