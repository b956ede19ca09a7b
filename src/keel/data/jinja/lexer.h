// Jinja's lexer with the settings transformers renders chat templates with: trim_blocks and
// lstrip_blocks on, keep_trailing_newline off, "\r\n" and "\r" read as "\n", `{%-`/`-%}` and
// `{%+` whitespace control, `{# comments #}` and `{% raw %}` blocks. Text between tags comes out
// as one data token with the whitespace rules already applied, so the parser never sees them.
#pragma once
#include <string>
#include <string_view>
#include <vector>

namespace keel::data::jinja {

struct Token {
  enum class Type { data, variable_begin, variable_end, block_begin, block_end, name, string, integer, real, op, end };
  Type type;
  std::string text;  // data text, a name, an operator, a decoded string literal, a number's digits
  int line;
};

// keel::Error naming the line for an unterminated tag, string or comment.
std::vector<Token> tokenize_template(std::string_view source);

}  // namespace keel::data::jinja
