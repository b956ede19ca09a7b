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

// For error messages about parsed JSON: "array", "integer", "string", ... and the type with its
// (shortened) value, e.g. `string "4096"`, so the user can find it in the file.
std::string_view json_type_name(simdjson::dom::element e);
std::string json_describe(simdjson::dom::element e);

}  // namespace keel
