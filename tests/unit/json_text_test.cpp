// Every valid JSON text loads: integers beyond 64 bits (as in most Hugging Face tokenizer configs)
// are read as doubles; everything simdjson holds exactly stays exact; malformed numbers still fail.
#include "keel/core/json_text.h"

#include <gtest/gtest.h>

namespace keel {
namespace {

using simdjson::dom::element;

TEST(JsonText, BigIntegersGetAFractionAndNothingElseChanges) {
  EXPECT_EQ(json_with_big_integers_as_doubles(R"({"model_max_length": 1000000000000000019884624838656})"),
            R"({"model_max_length": 1000000000000000019884624838656.0})");
  // The 64-bit edges stay integers; one past them becomes a double.
  EXPECT_EQ(json_with_big_integers_as_doubles("[18446744073709551615,18446744073709551616]"),
            "[18446744073709551615,18446744073709551616.0]");
  EXPECT_EQ(json_with_big_integers_as_doubles("[-9223372036854775808,-9223372036854775809]"),
            "[-9223372036854775808,-9223372036854775809.0]");
  // Digits inside strings, escaped quotes, fractions and exponents are left alone.
  const std::string untouched =
      R"({"a\"99999999999999999999999": "123456789012345678901234", "b": 1.5e300, "c": 123456789012345678901234.5})";
  EXPECT_EQ(json_with_big_integers_as_doubles(untouched), untouched);
}

TEST(JsonText, ParsesBigIntegersAsDoubles) {
  simdjson::dom::parser parser;
  element root;
  ASSERT_EQ(parse_json_document(parser, R"({"n": 1000000000000000019884624838656, "id": 128000})", root),
            simdjson::SUCCESS);
  double n = 0;
  ASSERT_EQ(root["n"].get_double().get(n), simdjson::SUCCESS);
  EXPECT_DOUBLE_EQ(n, 1e30);
  int64_t id = 0;
  ASSERT_EQ(root["id"].get_int64().get(id), simdjson::SUCCESS);  // ordinary integers stay integers
  EXPECT_EQ(id, 128000);
}

TEST(JsonText, MalformedNumbersStillFail) {
  simdjson::dom::parser parser;
  element root;
  EXPECT_NE(parse_json_document(parser, R"({"n": 01})", root), simdjson::SUCCESS);
  EXPECT_NE(parse_json_document(parser, R"({"n": 1.})", root), simdjson::SUCCESS);
  EXPECT_NE(parse_json_document(parser, R"({"n": -})", root), simdjson::SUCCESS);
}

}  // namespace
}  // namespace keel
