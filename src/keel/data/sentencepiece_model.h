// A SentencePiece model file (tokenizer.model: the ModelProto message of sentencepiece's
// sentencepiece_model.proto, as Llama 2, Mistral and Gemma ship it) read for its pieces: each id's
// text, score and type, as SentencePieceProcessor's IdToPiece, GetScore and IsUnknown / IsControl
// / IsUnused / IsByte report them. llama.cpp's converter writes these into a GGUF file's "llama"
// vocabulary (data/llama_cpp_vocab.h). The trainer and normalizer specs are not read: keel
// tokenizes with the model's tokenizer.json, which transformers converts from this file.
#pragma once
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

namespace keel::data {

// sentencepiece_model.proto's ModelProto.SentencePiece.Type (the same numbers as llama.cpp's token types).
enum class SentencePieceType : int32_t { Normal = 1, Unknown = 2, Control = 3, UserDefined = 4, Unused = 5, Byte = 6 };

struct SentencePiece {
  std::string piece;
  float score = 0.0f;                                  // the proto's default
  SentencePieceType type = SentencePieceType::Normal;  // the proto's default
};

// Whether `bytes` can be a SentencePiece model rather than another file named tokenizer.model (the
// tiktoken ranks GLM-4 ships, which are text): a ModelProto begins with its first piece, field 1.
bool looks_like_sentencepiece_model(std::string_view bytes);

// The pieces of the ModelProto `bytes` (read from `path`, for messages), in id order. A malformed
// message, a piece type outside the enum or a model without pieces is a keel::Error naming the
// file and the byte offset.
std::vector<SentencePiece> read_sentencepiece_model(std::string_view bytes, const std::string& path);

}  // namespace keel::data
