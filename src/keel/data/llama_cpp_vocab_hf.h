// The inverse of llama_cpp_vocab.h: a vocabulary as a GGUF file carries it (tokenizer.ggml.*,
// tokenizer.chat_template) back to Hugging Face tokenizer files, built as transformers' GGUF
// loader builds its tokenizer (integrations/gguf/gguf_tokenizer_mapping.py, transformers 5.24)
// and saves it, so that training from a .gguf file tokenizes as training from the directory
// `AutoTokenizer.from_pretrained(dir, gguf_file=...).save_pretrained(...)` makes of it:
//   - model: byte-level BPE ("gpt2"), the tokens as the file spells them (a token with a character
//     outside GPT-2's byte alphabet respelled from its UTF-8 bytes), the merges in the file's order;
//   - pre-tokenizer: the Split regex transformers' table gives tokenizer.ggml.pre, then ByteLevel;
//     a name it lacks keeps GPT-2's ByteLevel regex (as GPT2Tokenizer has it);
//   - added tokens: CONTROL tokens as special, USER_DEFINED ones as plain added tokens, and the
//     bos/eos/unk/pad tokens special (transformers adds the tokens its config names);
//   - no post-processor tokens: transformers' GGUF tokenizer adds no BOS whatever
//     tokenizer.ggml.add_bos_token says (a chat template that writes bos_token still has it);
//   - tokenizer_config.json: bos/eos/pad/unk tokens; chat_template.jinja: the file's template.
// SentencePiece vocabularies ("llama"), as transformers' sentencepiece builders make them
// (gguf_tokenizer_mapping.py): for gemma/gemma2/gemma3 files GemmaTokenizer (spaces to U+2581 by a
// normalizer, BPE with byte fallback, the merges transformers' generate_merges derives from the
// vocabulary ranked by the tokens' order in the file), for others (Llama 2, Mistral v0.1,
// TinyLlama: architecture "llama") LlamaTokenizer (Metaspace with U+2581 prepended to the text,
// BPE with byte fallback, the merges ranked by the file's scores); the file's merges instead
// where it has tokenizer.ggml.merges; the class's special tokens, the file's control and
// user-defined tokens; BOS added as tokenizer.ggml.add_bos_token says (true where absent). Phi-3's
// (a third pipeline) and other tokenizer models are a keel::Error naming what is read.
#pragma once
#include <optional>
#include <string>
#include <vector>

#include "keel/data/llama_cpp_vocab.h"

namespace keel::data {

struct HfTokenizerFiles {
  std::string tokenizer_json, tokenizer_config_json;
  std::optional<std::string> chat_template;  // chat_template.jinja
  std::string pre_tokenizer;                 // for the message: "'llama-bpe' (cl100k regex)"
  std::string merges;                        // for the message: "280147 merges", or how they were derived
  std::vector<std::string> notes;            // what keel decided that the file may have said otherwise
};

// `origin` names the GGUF file in errors and notes; `architecture` (general.architecture) picks
// transformers' SentencePiece builder for a "llama" vocabulary.
HfTokenizerFiles hf_tokenizer_files(const LlamaCppVocab& vocab, const std::string& origin,
                                    const std::string& architecture = "");

}  // namespace keel::data
