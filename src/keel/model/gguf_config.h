// A model's architecture from a GGUF file's metadata (the `<arch>.*` keys llama.cpp's converter
// writes, gguf-py's Keys), the inverse of what checkpoint/gguf_export.h writes, and read as
// transformers' GGUF loader reads it into a config (integrations/gguf/gguf_config_mapping.py):
//   hidden_size        <- <arch>.embedding_length        num_hidden_layers  <- <arch>.block_count
//   intermediate_size  <- <arch>.feed_forward_length     max_position_emb.  <- <arch>.context_length
//   num_attention_heads <- <arch>.attention.head_count   num_key_value_heads <- ...head_count_kv (= heads)
//   head_dim           <- <arch>.attention.key_length (= hidden / heads)
//   rope_theta         <- <arch>.rope.freq_base (10000)  rms_norm_eps <- ...layer_norm_rms_epsilon
//   vocab_size         <- token_embd.weight's rows       tie_word_embeddings <- no output.weight tensor
//   bos/eos/pad ids    <- tokenizer.ggml.{bos,eos,padding}_token_id
// Gemma 2 and 3 (their norms stored plus one: gguf_weights.h) as llama.cpp runs them: the soft caps
// and the window from the file, the attention scale and the windowed layers from llama.cpp's
// tables (no key carries them); gguf_config_notes says where transformers' loader differs.
// Floats are the file's float32 values widened exactly (1e-5 is read as 9.99999974737875e-06, as
// transformers reads it). Architectures keel does not train from GGUF, and what would make the
// model run otherwise than llama.cpp runs it (RoPE scaling, a rope_freqs tensor), are errors
// naming the file and the key.
#pragma once
#include <string>
#include <vector>

#include "keel/formats/gguf_reader.h"
#include "keel/model/config.h"

namespace keel::model {

// The GGUF architectures keel reads, for messages ("llama, qwen2, qwen3").
std::string gguf_readable_architectures();

// The config of the model in `file` (config_json: the config.json keel writes for it).
ModelConfig gguf_model_config(const formats::GgufFile& file);

// What keel decided for the model in a file that transformers' GGUF loader decides otherwise
// (Gemma: the scale and soft caps), to be printed; empty for other families.
std::vector<std::string> gguf_config_notes(const ModelConfig& config);

// Whether `path` names a GGUF file (by its extension: model_name = "x.gguf").
bool is_gguf_path(const std::string& path);

}  // namespace keel::model
