// A GGUF file's tokenizer and chat template (its tokenizer.* keys, as gguf_export.h writes them and
// llama.cpp's converter does) as Hugging Face tokenizer files (data/llama_cpp_vocab_hf.h), written
// into a directory that the run then reads like any model's tokenizer directory: the data is
// tokenized from it, the chat template found in it, and output_dir/final gets its files.
#pragma once
#include <optional>
#include <ostream>
#include <string>

#include "keel/data/llama_cpp_vocab.h"
#include "keel/data/tokenizer.h"
#include "keel/formats/gguf_reader.h"
#include "keel/recipe/recipe.h"

namespace keel::checkpoint {

// gguf-py's key for a special token id ("bos" -> tokenizer.ggml.bos_token_id, "pad" -> ...
// padding_token_id, "sep" -> the misspelt seperator_token_id); nullopt for a type it has none for.
std::optional<std::string> gguf_special_id_key(const std::string& type);

// general.architecture ("" without it): which of transformers' builders a "llama" vocabulary gets.
std::string gguf_architecture_of(const formats::GgufFile& file);

// The tokenizer.* keys of `file` (absent arrays empty, absent ids unset).
data::LlamaCppVocab read_gguf_vocab(const formats::GgufFile& file);

// The tokenizer of the GGUF file `gguf_path`, in memory: what the files below load as.
data::Tokenizer gguf_tokenizer(const std::string& gguf_path);

// Writes the tokenizer files of the GGUF file `gguf_path` into `dir` (created; each file replaced
// atomically) and says what it did on `log` (if not null).
void write_gguf_tokenizer_dir(const std::string& gguf_path, const std::string& dir, std::ostream* log);

// For a recipe whose model_name is a GGUF file and that names no tokenizer: writes that file's
// tokenizer into recipe::recipe_tokenizer_path(r) (output_dir/gguf_tokenizer), afresh each time
// (a second run into the same output_dir may start from another file). Nothing otherwise.
void prepare_recipe_gguf_tokenizer(const recipe::Recipe& r, std::ostream* log);

}  // namespace keel::checkpoint
