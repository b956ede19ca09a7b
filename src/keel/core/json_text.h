// Writing JSON text: keel writes its JSON (configs, manifests, reports, tokenizer files) with fmt
// and needs one correct string escaper; parsing goes through simdjson.
#pragma once
#include <string>
#include <string_view>

namespace keel {

// s as a JSON string literal, quotes included: ", \ and control characters escaped; UTF-8 bytes
// pass through unchanged (JSON allows them).
std::string json_quoted(std::string_view s);
// The same without the surrounding quotes.
std::string json_escaped(std::string_view s);

}  // namespace keel
