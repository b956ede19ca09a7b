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

#include "keel/core/json_text.h"
#include "keel/cli/commands.h"
#include "keel/core/error.h"
#include "keel/core/file_io.h"
#include "keel/data/bpe_trainer.h"
#include "keel/data/hf_tokenizer_json.h"
#include "keel/data/tokenizer.h"

namespace keel::cli {
namespace {

constexpr size_t kBatchBytes = size_t(8) << 20;

// Reads stdin in batches of whole lines; the last line may lack its newline.
class LineBatches {
 public:
  // Fills `lines` with the next batch; false at the end of input.
  bool next(std::vector<std::string_view>& lines) {
    lines.clear();
    buffer_.erase(0, consumed_);
    consumed_ = 0;
    first_line_ += previous_lines_;
    while (!eof_ && buffer_.size() < kBatchBytes) read_more();
    // A single line longer than a batch: keep reading until it ends.
    while (!eof_ && buffer_.find('\n') == std::string::npos) read_more();
    size_t pos = 0;
    while (pos < buffer_.size()) {
      size_t end = buffer_.find('\n', pos);
      if (end == std::string::npos) {
        if (!eof_) break;  // incomplete: finished in the next batch
        end = buffer_.size();
      }
      lines.emplace_back(buffer_.data() + pos, end - pos);
      pos = end + 1;
    }
    consumed_ = std::min(pos, buffer_.size());
    previous_lines_ = lines.size();
    return !lines.empty();
  }
  size_t first_line_number() const { return first_line_ + 1; }

 private:
  void read_more() {
    const size_t old = buffer_.size();
    buffer_.resize(old + (size_t(1) << 20));
    const size_t got = std::fread(buffer_.data() + old, 1, size_t(1) << 20, stdin);
    buffer_.resize(old + got);
    if (got == 0) {
      require(!std::ferror(stdin), "stdin: read error");
      eof_ = true;
    }
  }
  std::string buffer_;
  size_t consumed_ = 0;
  bool eof_ = false;
  size_t first_line_ = 0, previous_lines_ = 0;
};

void append_ids_json(std::string& out, const std::vector<int32_t>& ids) {
  out += "{\"input_ids\": [";
  char number[16];
  for (size_t i = 0; i < ids.size(); ++i) {
    if (i) out += ", ";
    auto end = std::to_chars(number, number + sizeof number, ids[i]).ptr;
    out.append(number, end);
  }
  out += "]}\n";
}

// Decoded ids may end inside a character; JSON needs valid UTF-8, so malformed bytes become
// U+FFFD as in Hugging Face's lossy decode.
std::string valid_utf8(std::string_view bytes) {
  std::string out;
  size_t pos = 0;
  while (pos < bytes.size()) {
    size_t bad = data::find_invalid_utf8(bytes.substr(pos));
    if (bad == std::string_view::npos) {
      out.append(bytes.substr(pos));
      break;
    }
    out.append(bytes.substr(pos, bad));
    out += "\xEF\xBF\xBD";
    pos += bad + 1;
  }
  return out;
}

// Runs `work(line, line_number, out)` over every stdin line on `threads` threads, writing each
// batch's outputs in input order. The first error (by line order) is rethrown.
template <typename Work>
void process_stdin(int threads, Work work) {
  LineBatches batches;
  std::vector<std::string_view> lines;
  std::vector<std::string> outputs(threads);
  std::vector<std::optional<std::pair<size_t, std::string>>> errors(threads);
  while (batches.next(lines)) {
    const size_t first = batches.first_line_number();
    const size_t n = lines.size();
#pragma omp parallel num_threads(threads)
    {
      const int t = omp_get_thread_num(), nt = omp_get_num_threads();
      const size_t begin = n * t / nt, end = n * (t + 1) / nt;
      std::string& out = outputs[t];
      out.clear();
      errors[t].reset();
      try {
        for (size_t i = begin; i < end; ++i) work(lines[i], first + i, out);
      } catch (const std::exception& e) {
        errors[t] = std::make_pair(size_t(t), std::string(e.what()));
      }
    }
    for (int t = 0; t < threads; ++t) {
      if (errors[t]) throw Error(errors[t]->second);
      std::fwrite(outputs[t].data(), 1, outputs[t].size(), stdout);
    }
  }
  std::fflush(stdout);
}

struct TokenizeOptions {
  std::string tokenizer;
  std::string pattern;
  int threads = 0;
  bool add_special_tokens = false;
  bool skip_special_tokens = false;
};

int default_threads() { return std::max(1u, std::thread::hardware_concurrency()); }

// --tokenizer, --pattern and --threads, shared by tokenize and detokenize.
void add_tokenizer_options(CLI::App& cmd, TokenizeOptions& o, const char* work) {
  cmd.add_option("--tokenizer", o.tokenizer, "tokenizer.json, a tiktoken rank file, or a model directory")->required();
  cmd.add_option("--pattern", o.pattern, "Pre-tokenizer of a tiktoken file: gpt2, cl100k, o200k, glm4, qwen2");
  cmd.add_option("--threads", o.threads, fmt::format("{} threads (default: all cores)", work))
      ->check(CLI::Range(1, 1024));
}

const CommandRegistration kTokenize{
    "tokenize", "Tokenize JSONL {\"text\": ...} from stdin into {\"input_ids\": [...]} lines",
    [](CLI::App& cmd) -> CommandAction {
      auto o = std::make_shared<TokenizeOptions>();
      add_tokenizer_options(cmd, *o, "Encoding");
      cmd.add_flag("--add-special-tokens", o->add_special_tokens, "Add the post-processor's BOS/EOS");
      return [o] {
        const data::Tokenizer tokenizer = data::load_tokenizer(o->tokenizer, o->pattern);
        const data::EncodeOptions options{o->add_special_tokens, false};
        process_stdin(o->threads ? o->threads : default_threads(),
                      [&](std::string_view line, size_t line_no, std::string& out) {
                        thread_local simdjson::dom::parser parser;
                        thread_local std::vector<int32_t> ids;
                        if (line.find_first_not_of(" \t\r") == std::string_view::npos) return;
                        simdjson::dom::element doc;
                        auto error = parser.parse(line.data(), line.size()).get(doc);
                        if (error) fail("stdin:{}: invalid JSON ({})", line_no, simdjson::error_message(error));
                        std::string_view text;
                        if (doc["text"].get_string().get(text) != simdjson::SUCCESS)
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
        const data::Tokenizer tokenizer = data::load_tokenizer(o->tokenizer, o->pattern);
        process_stdin(
            o->threads ? o->threads : default_threads(), [&](std::string_view line, size_t line_no, std::string& out) {
              thread_local simdjson::dom::parser parser;
              thread_local std::vector<int32_t> ids;
              if (line.find_first_not_of(" \t\r") == std::string_view::npos) return;
              simdjson::dom::element doc;
              auto error = parser.parse(line.data(), line.size()).get(doc);
              if (error) fail("stdin:{}: invalid JSON ({})", line_no, simdjson::error_message(error));
              simdjson::dom::array array;
              if (doc["input_ids"].get_array().get(array) != simdjson::SUCCESS)
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
