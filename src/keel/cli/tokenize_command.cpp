// keel tokenize --tokenizer PATH [--pattern NAME] [--threads N] [--add-special-tokens]
//   JSONL {"text": ...} on stdin -> {"input_ids": [...]} lines on stdout, in input order.
// keel detokenize --tokenizer PATH [--skip-special-tokens]
//   JSONL {"input_ids": [...]} on stdin -> {"text": ...} lines on stdout.
// keel tokenizer train --data FILE --vocab-size N [--special TOKEN ...] [--pattern NAME] --out PATH
//   trains a byte-level BPE tokenizer.json.
//
// Input is read in batches of lines; each batch is cut into one contiguous block per thread, and
// the blocks' outputs are written in order, so the output never depends on the thread count.
#include <omp.h>
#include <simdjson.h>

#include <charconv>
#include <cstdio>
#include <memory>
#include <optional>
#include <thread>

#include "keel/checkpoint/gguf_tokenizer.h"
#include "keel/core/json_text.h"
#include "keel/cli/commands.h"
#include "keel/core/error.h"
#include "keel/core/file_io.h"
#include "keel/data/bpe_trainer.h"
#include "keel/data/hf_tokenizer_json.h"
#include "keel/data/tokenizer.h"
#include "keel/model/gguf_config.h"
#include "keel/cli/stdin_lines.h"

namespace keel::cli {
namespace {

struct TokenizeOptions {
  std::string tokenizer;
  std::string pattern;
  int threads = 0;
  bool add_special_tokens = false;
  bool skip_special_tokens = false;
};

int default_threads() { return std::max(1u, std::thread::hardware_concurrency()); }

// Line `line_no` of stdin as a JSON document, parsed by this thread's parser (valid until its next
// line); nothing for a blank line; keel::Error naming the line for invalid JSON.
std::optional<simdjson::dom::element> stdin_document(std::string_view line, size_t line_no) {
  thread_local simdjson::dom::parser parser;
  if (line.find_first_not_of(" \t\r") == std::string_view::npos) return std::nullopt;
  simdjson::dom::element doc;
  const auto error = parser.parse(line.data(), line.size()).get(doc);
  if (error) fail("stdin:{}: invalid JSON ({})", line_no, simdjson::error_message(error));
  return doc;
}

// --tokenizer, --pattern and --threads, shared by tokenize and detokenize.
void add_tokenizer_options(CLI::App& cmd, TokenizeOptions& o, const char* work) {
  cmd.add_option("--tokenizer", o.tokenizer,
                 "tokenizer.json, a tiktoken rank file, a model directory, or a GGUF file (its metadata's)")
      ->required();
  cmd.add_option("--pattern", o.pattern, "Pre-tokenizer of a tiktoken file: gpt2, cl100k, o200k, glm4, qwen2");
  cmd.add_option("--threads", o.threads, fmt::format("{} threads (default: all cores)", work))
      ->check(CLI::Range(1, 1024));
}

// A GGUF file's tokenizer as a run from it has it (checkpoint/gguf_tokenizer.h), else load_tokenizer's.
data::Tokenizer options_tokenizer(const TokenizeOptions& o) {
  if (model::is_gguf_path(o.tokenizer)) return checkpoint::gguf_tokenizer(o.tokenizer);
  return data::load_tokenizer(o.tokenizer, o.pattern);
}

const CommandRegistration kTokenize{
    "tokenize", "Tokenize JSONL {\"text\": ...} from stdin into {\"input_ids\": [...]} lines",
    [](CLI::App& cmd) -> CommandAction {
      auto o = std::make_shared<TokenizeOptions>();
      add_tokenizer_options(cmd, *o, "Encoding");
      cmd.add_flag("--add-special-tokens", o->add_special_tokens, "Add the post-processor's BOS/EOS");
      return [o] {
        const data::Tokenizer tokenizer = options_tokenizer(*o);
        const data::EncodeOptions options{o->add_special_tokens, false};
        process_stdin(o->threads ? o->threads : default_threads(),
                      [&](std::string_view line, size_t line_no, std::string& out) {
                        thread_local std::vector<int32_t> ids;
                        const auto doc = stdin_document(line, line_no);
                        if (!doc) return;
                        std::string_view text;
                        if ((*doc)["text"].get_string().get(text) != simdjson::SUCCESS)
                          fail("stdin:{}: expected an object with a string field \"text\"", line_no);
                        ids.clear();
                        try {
                          tokenizer.encode(text, ids, options);
                        } catch (const Error& e) {
                          fail("stdin:{}: {}", line_no, e.what());
                        }
                        append_ids_json(out, ids);
                      });
        return 0;
      };
    }};

const CommandRegistration kDetokenize{
    "detokenize", "Decode JSONL {\"input_ids\": [...]} from stdin into {\"text\": ...} lines",
    [](CLI::App& cmd) -> CommandAction {
      auto o = std::make_shared<TokenizeOptions>();
      add_tokenizer_options(cmd, *o, "Decoding");
      cmd.add_flag("--skip-special-tokens", o->skip_special_tokens, "Leave special tokens out of the text");
      return [o] {
        const data::Tokenizer tokenizer = options_tokenizer(*o);
        process_stdin(
            o->threads ? o->threads : default_threads(), [&](std::string_view line, size_t line_no, std::string& out) {
              thread_local std::vector<int32_t> ids;
              const auto doc = stdin_document(line, line_no);
              if (!doc) return;
              simdjson::dom::array array;
              if ((*doc)["input_ids"].get_array().get(array) != simdjson::SUCCESS)
                fail("stdin:{}: expected an object with an array field \"input_ids\"", line_no);
              ids.clear();
              for (auto item : array) {
                int64_t id;
                if (item.get_int64().get(id) != simdjson::SUCCESS || id < 0 || id >= tokenizer.vocab_size())
                  fail("stdin:{}: \"input_ids\" must hold integers in [0, {})", line_no, tokenizer.vocab_size());
                ids.push_back(int32_t(id));
              }
              out += "{\"text\": ";
              try {
                out += json_quoted(valid_utf8(tokenizer.decode(ids, o->skip_special_tokens)));
              } catch (const Error& e) {
                fail("stdin:{}: {}", line_no, e.what());
              }
              out += "}\n";
            });
        return 0;
      };
    }};

struct TrainTokenizerOptions {
  std::string data;
  std::string out;
  data::BpeTrainingOptions training;
};

const CommandRegistration kTokenizer{
    "tokenizer", "Tokenizer tools: train a byte-level BPE tokenizer.json", [](CLI::App& cmd) -> CommandAction {
      cmd.require_subcommand(1);
      auto o = std::make_shared<TrainTokenizerOptions>();
      CLI::App* train = cmd.add_subcommand("train", "Train a byte-level BPE tokenizer.json from JSONL {\"text\": ...}");
      train->add_option("--data", o->data, "Training text: JSONL with a \"text\" field")->required();
      train->add_option("--vocab-size", o->training.vocab_size, "Vocabulary size (special tokens + 256 bytes + merges)")
          ->required();
      train->add_option("--special", o->training.special_tokens, "A special token (repeatable; ids 0, 1, ...)");
      train->add_option("--pattern", o->training.pattern, "Pre-tokenizer pattern: gpt2, cl100k, o200k, glm4, qwen2")
          ->capture_default_str();
      train->add_option("--min-frequency", o->training.min_frequency, "Merge only pairs seen at least this often")
          ->capture_default_str();
      train->add_option("--out", o->out, "Output tokenizer.json")->required();
      return [o, train] {
        if (!train->parsed()) return 0;  // require_subcommand(1) makes this unreachable today
        write_file_atomic(o->out, data::train_tokenizer_json_from_jsonl(o->data, o->training));
        const data::Tokenizer check = data::load_tokenizer(o->out);
        fmt::print("wrote {}: {} tokens\n", o->out, check.vocab_size());
        return 0;
      };
    }};

}  // namespace
}  // namespace keel::cli
