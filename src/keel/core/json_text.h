// JSON text helpers: keel writes its JSON (configs, manifests, reports, tokenizer files) with fmt
// and needs one correct string escaper; parsing goes through simdjson, and its errors describe the
// values they reject the same way everywhere.
#pragma once
#include <simdjson.h>

#include <string>
#include <string_view>

namespace keel {

// s as a JSON string literal, quotes included: ", \ and control characters escaped; UTF-8 bytes
// pass through unchanged (JSON allows them).
std::string json_quoted(std::string_view s);
// The same without the surrounding quotes.
std::string json_escaped(std::string_view s);

// Parses a JSON document the way every valid JSON text must load, which simdjson alone does not:
// integers beyond 64 bits (tokenizer_config.json's "model_max_length":
// 1000000000000000019884624838656, in most Hugging Face tokenizers) are read as the nearest double,
// as JavaScript reads them. Nesting is limited to simdjson's 1024 levels. `root` refers into
// `parser`; simdjson's error code otherwise.
simdjson::error_code parse_json_document(simdjson::dom::parser& parser, std::string_view text,
                                         simdjson::dom::element& root);
// The text with every integer literal outside [-2^63, 2^64) given a fraction (".0"), so that a
// 64-bit parser reads it as a double; strings and all other bytes are unchanged.
std::string json_with_big_integers_as_doubles(std::string_view text);

// For error messages about parsed JSON: "array", "integer", "string", ... and the type with its
// (shortened) value, e.g. `string "4096"`, so the user can find it in the file.
std::string_view json_type_name(simdjson::dom::element e);
std::string json_describe(simdjson::dom::element e);

}  // namespace keel
