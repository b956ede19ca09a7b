// keel chat-template --tokenizer DIR [--template FILE] [--template-name NAME] [--add-generation-prompt]
//   JSONL conversations on stdin ({"messages": [...], "tools": [...], "kwargs": {...},
//   "add_generation_prompt": bool}) -> one line each on stdout: {"text", "input_ids",
//   "assistant_masks", "mask_rule"} rendered with the model's own chat template, or {"error"} when
//   the template refuses the conversation. With --template and no --tokenizer: {"text"} only.
// What `keel prepare` does to a conversation, one record at a time, for checking a template.
#include <simdjson.h>

#include <filesystem>
#include <memory>
#include <thread>

#include "keel/cli/commands.h"
#include "keel/cli/stdin_lines.h"
#include "keel/core/error.h"
#include "keel/core/json_text.h"
#include "keel/data/chat_encoding.h"
#include "keel/data/model_chat_template.h"
#include "keel/data/tokenizer.h"

namespace keel::cli {
namespace {

struct ChatTemplateOptions {
  std::string tokenizer, template_file, template_name;
  bool add_generation_prompt = false, control_tokens_in_data = false;
  int threads = 0;
};

void append_numbers(std::string& out, const char* key, const auto& values) {
  out += fmt::format("\"{}\": [", key);
  for (size_t i = 0; i < values.size(); ++i) {
    if (i) out += ", ";
    out += std::to_string(int64_t(values[i]));
  }
  out += "]";
}

const CommandRegistration kChatTemplate{
    "chat-template",
    "Render JSONL conversations from stdin with a model's own chat template: text, ids and assistant mask",
    [](CLI::App& cmd) -> CommandAction {
      auto o = std::make_shared<ChatTemplateOptions>();
      cmd.add_option("--tokenizer", o->tokenizer, "Model or tokenizer directory (its template and tokenizer)");
      cmd.add_option("--template", o->template_file,
                     "A .jinja file (or a JSON file with \"chat_template\") to use instead");
      cmd.add_option("--template-name", o->template_name, "A named template of the directory (e.g. tool_use)");
      cmd.add_flag("--add-generation-prompt", o->add_generation_prompt, "End with the assistant's header");
      cmd.add_flag("--control-tokens-in-data", o->control_tokens_in_data,
                   "Match special-token strings inside messages as the tokens (default: encoded as text)");
      cmd.add_option("--threads", o->threads, "Worker threads (default: all cores)")->check(CLI::Range(1, 1024));
      return [o] {
        require(!o->tokenizer.empty() || !o->template_file.empty(),
                "keel chat-template: give --tokenizer or --template");
        std::string dir = o->tokenizer;
        if (!dir.empty() && !std::filesystem::is_directory(dir))
          dir = std::filesystem::path(dir).parent_path().string();
        std::shared_ptr<const data::Tokenizer> tokenizer;
        if (!o->tokenizer.empty()) tokenizer = std::make_shared<data::Tokenizer>(data::load_tokenizer(o->tokenizer));
        // With tools the directory's tool_use template may apply: both encoders, chosen per record.
        auto encoder_for = [&](bool with_tools) -> std::shared_ptr<const data::ChatTemplateEncoder> {
          std::optional<data::ModelChatTemplate> t;
          if (!o->template_file.empty())
            t = data::chat_template_from_file(o->template_file, dir);
          else
            t = data::find_model_chat_template(dir, o->template_name, with_tools);
          require(t.has_value(),
                  "{}: no chat template (looked for chat_template.jinja, chat_template.json and "
                  "\"chat_template\" in tokenizer_config.json)",
                  dir);
          return std::make_shared<data::ChatTemplateEncoder>(std::move(*t), tokenizer.get(), o->control_tokens_in_data);
        };
        const auto plain = encoder_for(false), with_tools = encoder_for(true);
        const int threads = o->threads ? o->threads : int(std::max(1u, std::thread::hardware_concurrency()));
        process_stdin(threads, [&](std::string_view line, size_t line_no, std::string& out) {
          thread_local simdjson::dom::parser parser;
          if (line.find_first_not_of(" \t\r") == std::string_view::npos) return;
          simdjson::dom::element doc;
          if (parse_json_document(parser, line, doc) != simdjson::SUCCESS || !doc.is_object())
            fail("stdin:{}: not a JSON object", line_no);
          data::ChatInput input;
          std::string why;
          try {
            why = data::chat_input_from_record(doc, input);
            simdjson::dom::object kwargs;
            if (doc["kwargs"].get_object().get(kwargs) == simdjson::SUCCESS)
              for (auto field : kwargs)
                input.variables.set(std::string(field.key), data::json_to_value(field.value, data::jinja::kOtherData));
          } catch (const Error& e) {  // a value keel cannot hold (an integer beyond 64 bits): this record only
            out += "{\"error\": " + json_quoted(fmt::format("stdin:{}: {}", line_no, e.what())) + "}\n";
            return;
          }
          if (!why.empty()) fail("stdin:{}: {}", line_no, why);
          input.add_generation_prompt = o->add_generation_prompt;
          bool flag;
          if (doc["add_generation_prompt"].get_bool().get(flag) == simdjson::SUCCESS)
            input.add_generation_prompt = flag;
          const auto& encoder = input.tools.is_list() ? *with_tools : *plain;
          try {
            if (!tokenizer) {
              out += "{\"text\": " + json_quoted(encoder.render(input)) + "}\n";
              return;
            }
            const data::EncodedChat e = encoder.encode(input);
            out += "{\"text\": " + json_quoted(e.text) + ", ";
            append_numbers(out, "input_ids", e.ids);
            out += ", ";
            append_numbers(out, "assistant_masks", e.assistant_mask);
            out += fmt::format(", \"mask_rule\": \"{}\", \"control_strings_in_data\": {}}}\n",
                               e.from_generation_tags ? "generation" : "derived", e.control_strings_in_data);
          } catch (const Error& e) {
            out += "{\"error\": " + json_quoted(e.what()) + "}\n";
          }
        });
        return 0;
      };
    }};

}  // namespace
}  // namespace keel::cli
