// What reading (config.cpp) and writing (config_json.cpp) a config.json share: each family's format
// (its names, model_type, architectures, the config class's defaults) and where each size lives in
// it, and the JSON text helpers both use. Private to model/.
#pragma once
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include <simdjson.h>

#include "keel/model/config.h"

namespace keel::model::config_formats {

// --- the four formats ---------------------------------------------------------------------------

// Where each size lives in a format's config.json, so parser, writer and error messages agree.
struct FormatKeys {
  const char* vocab;
  const char* hidden;
  const char* intermediate;
  const char* layers;
  const char* heads;
  const char* kv_heads;
  const char* head_dim;
  const char* norm_eps;
  const char* max_positions;
};
constexpr FormatKeys kTransformersKeys{"vocab_size",        "hidden_size",         "intermediate_size",
                                       "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                                       "head_dim",          "rms_norm_eps",        "max_position_embeddings"};
// THUDM's remote-code ChatGLMConfig (configuration_chatglm.py).
constexpr FormatKeys kChatGlmKeys{"padded_vocab_size", "hidden_size",         "ffn_hidden_size",
                                  "num_layers",        "num_attention_heads", "multi_query_group_num",
                                  "kv_channels",       "layernorm_epsilon",   "seq_length"};

inline const FormatKeys& keys_of(Family f) { return f == Family::GlmOriginal ? kChatGlmKeys : kTransformersKeys; }

struct FamilyFormat {
  Family family;
  std::string_view name;                        // keel's name (recipes, CLI)
  std::string_view display_name;                // what users call it (`keel --help`)
  std::string_view model_type;                  // config.json "model_type"
  std::vector<std::string_view> architectures;  // first one is what keel writes
  int64_t default_max_positions;                // the config class's default
  // pad_token_id when config.json has no such key: the config class's default (-1: None).
  int64_t default_pad_token_id;
  // Whether the family's modeling file builds its embedding as nn.Embedding(vocab, hidden,
  // padding_idx=config.pad_token_id), so the pad row gets no gradient from its lookups (every
  // transformers class does; THUDM's ChatGLM remote code does not).
  bool embedding_padding_idx;
};

// Every family's format, in the order of the table the loader tries (config_formats.cpp).
const std::vector<FamilyFormat>& family_formats();
const FamilyFormat& format_of(Family f);

constexpr double kGlmRopeBase = 10000.0;  // ChatGLM: base = 10000 * rope_ratio

// Shortest text that reads back to the same double, written as Python's json does (10000.0,
// 1e-05) so that a float stays a float for readers that care.
std::string json_number(double v);
const char* json_bool(bool v);
// The top-level object of `text`; a keel::Error naming `path` if it is not valid JSON or not an object.
simdjson::dom::element parse_json(simdjson::dom::parser& parser, const std::string& text, const std::string& path);

}  // namespace keel::model::config_formats
