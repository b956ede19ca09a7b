// A chat template: Jinja source parsed once, rendered for any number of conversations from any
// number of threads. It renders as transformers' apply_chat_template does (its sandboxed, immutable
// Jinja environment with trim_blocks, lstrip_blocks, loop controls, `raise_exception`,
// `strftime_now`, `namespace`, its `tojson` and the `{% generation %}` tag), and as untrusted input:
// no file or network access, and bounded work, recursion and output.
#pragma once
#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "keel/data/jinja/value.h"

namespace keel::data::jinja {

struct TemplateAst;
class Recorder;

struct RenderLimits {
  uint64_t max_steps = 20'000'000;  // expressions and statements evaluated
  size_t max_output_bytes = size_t(64) << 20;
  int max_call_depth = 32;  // nested macro calls (each may hold 128 levels of syntax)
};

struct Rendered {
  Str text;                                           // with the data marks of its strings
  std::vector<std::pair<size_t, size_t>> generation;  // byte ranges of {% generation %} blocks
};

class Template {
 public:
  // `origin` names the template in messages ("Qwen3/tokenizer_config.json"). `defaults`: variables
  // every rendering sees unless its own variables name them (a tokenizer's special tokens), bound
  // here once rather than copied into every rendering's variables. keel::Error for a syntax
  // error, naming the line.
  Template(std::string source, std::string origin, const Dict& defaults = {});
  ~Template();
  Template(Template&&) noexcept;

  // Renders with `variables` (messages, tools, add_generation_prompt, bos_token, ...). keel::Error
  // naming the origin and line for a template error, a raise_exception(...) (its message), or a
  // limit reached.
  Rendered render(const Dict& variables, const RenderLimits& limits = {}, Recorder* recorder = nullptr) const;

  bool has_generation() const;
  // The template's literal text and string constants.
  const std::vector<std::string>& literals() const;
  const std::string& source() const { return source_; }
  const std::string& origin() const { return origin_; }
  const TemplateAst& syntax() const { return *ast_; }

 private:
  std::string source_, origin_;
  std::unique_ptr<TemplateAst> ast_;
};

}  // namespace keel::data::jinja
