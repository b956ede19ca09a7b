// A chat template is untrusted input (a model directory from a hub): any text must either parse
// and render within keel's limits or be a keel::Error naming the template — never a crash, a
// hang, or unbounded memory. The input is the template, optionally followed by "\n\0\n" and a
// JSONL conversation record to render it with (else a fixed two-turn conversation with a tool).
// A rendering must also be deterministic and keep its data marks inside the text.
#include <simdjson.h>

#include <string>

#include "fuzz_support.h"
#include "keel/core/json_text.h"
#include "keel/data/jinja/template.h"
#include "keel/data/model_chat_template.h"

namespace {

constexpr const char* kDefaultRecord =
    R"({"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi <|im_end|>"},)"
    R"( {"role": "assistant", "content": "Hello!", "reasoning_content": "greet", "tool_calls": [{"type": "function",)"
    R"( "function": {"name": "f", "arguments": {"x": 1.5, "y": [true, null]}}}]}, {"role": "tool", "content": "42"}],)"
    R"( "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]})";

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace keel;
  const std::string input(reinterpret_cast<const char*>(data), size);
  const size_t cut = input.find(std::string("\n\0\n", 3));
  const std::string source = input.substr(0, cut);
  const std::string record = cut == std::string::npos ? kDefaultRecord : input.substr(cut + 3);

  simdjson::dom::parser parser;
  simdjson::dom::element doc;
  data::ChatInput chat;
  if (parse_json_document(parser, record, doc) != simdjson::SUCCESS || !doc.is_object() ||
      !data::chat_input_from_record(doc, chat).empty())
    return 0;
  chat.add_generation_prompt = size % 2 == 1;
  const std::string origin = "fuzz.jinja";
  data::jinja::Dict special_tokens;  // the template's defaults, as a tokenizer directory gives them
  special_tokens.set("bos_token", data::jinja::Value("<s>"));
  special_tokens.set("eos_token", data::jinja::Value("</s>"));
  // Small limits: the fuzzer's time goes to finding crashes, not to legal long renderings.
  const data::jinja::RenderLimits limits{.max_steps = 200'000, .max_output_bytes = 1 << 20, .max_call_depth = 32};
  try {
    const data::jinja::Template templ(source, origin, special_tokens);
    const auto vars = data::template_variables(chat);
    const data::jinja::Rendered a = templ.render(vars, limits);
    const data::jinja::Rendered b = templ.render(vars, limits);
    if (a.text.text != b.text.text || a.generation != b.generation) fuzz::property_failed("renders deterministically");
    for (const auto& run : a.text.runs)
      if (run.begin >= run.end || run.end > a.text.text.size()) fuzz::property_failed("data marks lie inside the text");
    for (const auto& [begin, end] : a.generation)
      if (begin > end || end > a.text.text.size()) fuzz::property_failed("generation spans lie inside the text");
  } catch (const Error& e) {
    if (std::string(e.what()).rfind("fuzz.jinja", 0) != 0) fuzz::property_failed("errors name the template", e.what());
  }
  return 0;
}
