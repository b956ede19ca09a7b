// keel inspect DATA [--tokenizer T] [--template NAME] [--max-seq-len N] [--limit N] [--text]
//   What training will see, before hours are spent on it: the documents of a `keel prepare`
//   directory, or of a raw JSONL file encoded on the fly exactly as prepare encodes it (the same
//   tokenizer, chat template and loss mask), as JSONL {"input_ids": [...], "labels": [...]}
//   (label -100 = no loss, as Hugging Face's labels); with --text, the decoded text with the
//   trained spans between « and ». Preference pairs (stage = "dpo") print as their two rows, prompt +
//   chosen and prompt + rejected, the answers trained, tokenized as training tokenizes them.
#include <filesystem>
#include <iostream>
#include <limits>
#include <memory>

#include "keel/cli/commands.h"
#include "keel/cli/inspect_gguf.h"
#include "keel/cli/stdin_lines.h"
#include "keel/core/error.h"
#include "keel/core/file_io.h"
#include "keel/core/json_text.h"
#include "keel/data/chat_encoding.h"
#include "keel/data/preference_pairs.h"
#include "keel/data/prepare.h"
#include "keel/data/record_reader.h"
#include "keel/data/shard_format.h"
#include "keel/data/tokenizer.h"

namespace keel::cli {
namespace {

struct InspectOptions {
  std::string data, tokenizer, chat_template = "auto";
  int64_t max_seq_len = 2048, limit = 5;
  bool text = false, train_on_prompt = false, special_tokens_in_messages = false, stats = false;
};

class DocumentPrinter {
 public:
  DocumentPrinter(const InspectOptions& o, const data::Tokenizer* tokenizer) : o_(o), tokenizer_(tokenizer) {}

  // false once --limit documents are printed
  bool print(std::span<const uint32_t> tokens, const std::vector<bool>& trained, const std::string& where) {
    if (printed_ >= o_.limit) return false;
    ++printed_;
    if (!o_.text) {
      std::string out = "{\"input_ids\": [";
      for (size_t t = 0; t < tokens.size(); ++t) out += fmt::format("{}{}", t ? ", " : "", tokens[t]);
      out += "], \"labels\": [";
      for (size_t t = 0; t < tokens.size(); ++t)
        out += fmt::format("{}{}", t ? ", " : "", trained[t] ? int64_t(tokens[t]) : int64_t(-100));
      std::cout << out << "]}\n";
      return true;
    }
    int64_t n_trained = 0;
    for (bool b : trained) n_trained += b;
    std::string out =
        fmt::format("--- document {} ({}, {} tokens, {} trained)\n", printed_, where, tokens.size(), n_trained);
    // Each run of trained or untrained tokens decoded on its own, so the marks fall between tokens.
    for (size_t begin = 0; begin < tokens.size();) {
      size_t end = begin;
      while (end < tokens.size() && trained[end] == trained[begin]) ++end;
      const std::vector<int32_t> ids(tokens.begin() + std::ptrdiff_t(begin), tokens.begin() + std::ptrdiff_t(end));
      const std::string piece = valid_utf8(tokenizer_->decode(ids));
      out += trained[begin] ? "«" + piece + "»" : piece;
      begin = end;
    }
    std::cout << out << "\n";
    return true;
  }

 private:
  const InspectOptions& o_;
  const data::Tokenizer* tokenizer_;
  int64_t printed_ = 0;
};

void inspect_prepared(const InspectOptions& o, DocumentPrinter& printer) {
  const data::PreparedData prepared(o.data);
  std::cerr << fmt::format("keel inspect: {}: {} sequences of <= {} tokens, chat template {}\n", o.data,
                           prepared.sequences(), prepared.manifest().max_seq_len, prepared.manifest().chat_template);
  for (int64_t s = 0; s < prepared.sequences(); ++s) {
    const auto v = prepared.sequence(s);
    for (size_t d = 0; d + 1 < v.document_offsets.size(); ++d) {
      const int64_t begin = std::max<int64_t>(int64_t(v.document_offsets[d]) - v.token_start, 0);
      const int64_t end =
          std::min<int64_t>(int64_t(v.document_offsets[d + 1]) - v.token_start, int64_t(v.tokens.size()));
      if (end <= begin) continue;
      std::vector<bool> trained;
      for (int64_t t = begin; t < end; ++t) trained.push_back(v.target(t));
      if (!printer.print(v.tokens.subspan(size_t(begin), size_t(end - begin)), trained, fmt::format("sequence {}", s)))
        return;
    }
  }
}

void inspect_jsonl(const InspectOptions& o, const data::Tokenizer* tokenizer, DocumentPrinter& printer) {
  data::DocumentEncoder encoder;
  encoder.tokenizer = tokenizer;
  encoder.train_on_prompt = o.train_on_prompt;
  encoder.special_tokens_in_messages = o.special_tokens_in_messages;
  std::string why;
  const std::string name = data::choose_chat_template(encoder, o.chat_template, o.tokenizer, &why);
  encoder.max_seq_len = o.max_seq_len;
  encoder.vocab_size = tokenizer ? tokenizer->vocab_size() : int64_t(1) << 31;
  encoder.data_path = o.data;
  std::cerr << fmt::format("keel inspect: {} encoded as keel prepare would: chat template {} ({}), rows of {} tokens\n",
                           o.data, name, why, o.max_seq_len);
  data::RecordParser parser = encoder.record_parser();
  data::Record record;
  std::vector<int32_t> scratch;
  bool more = true;
  int64_t line_no = 0;
  for_each_line(o.data, size_t(64) << 20, [&](std::string_view line, bool complete) {
    ++line_no;
    if (!complete) std::cerr << fmt::format("{}:{}: longer than 64 MiB, skipped by prepare\n", o.data, line_no);
    if (!complete || !more || line.find_first_not_of(" \t\r") == std::string_view::npos) return;
    if (std::string bad = parser.parse(line, record); !bad.empty()) {
      std::cerr << fmt::format("{}:{}: bad record, skipped by prepare: {}\n", o.data, line_no, bad);
      return;
    }
    data::EncodedDocuments docs;
    std::string fatal;
    const std::string bad = encoder.encode(record, line_no, docs, scratch, fatal);
    require(fatal.empty(), "{}", fatal);
    if (!bad.empty()) {
      std::cerr << fmt::format("{}:{}: bad record, skipped by prepare: {}\n", o.data, line_no, bad);
      return;
    }
    if (docs.no_target) std::cerr << fmt::format("{}:{}: nothing to learn, skipped by prepare\n", o.data, line_no);
    int64_t begin = 0;
    for (int64_t end : docs.document_ends) {
      std::vector<bool> trained(docs.mask.begin() + begin, docs.mask.begin() + end);
      more = more && printer.print(std::span(docs.tokens).subspan(size_t(begin), size_t(end - begin)), trained,
                                   fmt::format("line {}", line_no));
      begin = end;
    }
  });
}

void inspect_pairs(const InspectOptions& o, const data::Tokenizer& tokenizer, DocumentPrinter& printer) {
  data::DocumentEncoder chooser;  // the template training would choose for these names
  chooser.tokenizer = &tokenizer;
  chooser.special_tokens_in_messages = o.special_tokens_in_messages;
  std::string why;
  data::choose_chat_template(chooser, o.chat_template, o.tokenizer, &why);
  const data::PairEncoding encoding{&tokenizer, chooser.model_template, o.max_seq_len, 0};
  std::cerr << fmt::format(
      "keel inspect: {}: preference pairs, tokenized as stage = \"dpo\" training tokenizes them (TRL's rules){}; "
      "rows of {} tokens\n",
      o.data, chooser.model_template ? ", conversations through " + why : "", o.max_seq_len);
  data::TokenizedPair pair;
  bool more = true;
  int64_t line_no = 0;
  for_each_line(o.data, size_t(64) << 20, [&](std::string_view line, bool complete) {
    ++line_no;
    if (!complete || !more || line.find_first_not_of(" \t\r") == std::string_view::npos) return;
    if (std::string bad = data::tokenize_pair(line, encoding, pair); !bad.empty()) {
      std::cerr << fmt::format("{}:{}: bad pair, skipped by training: {}\n", o.data, line_no, bad);
      return;
    }
    if (int64_t(pair.prompt.size()) >= o.max_seq_len) {
      std::cerr << fmt::format("{}:{}: the prompt alone fills {} tokens; dropped by training\n", o.data, line_no,
                               o.max_seq_len);
      return;
    }
    for (const auto& [answer, side] : {std::pair{&pair.chosen, "chosen"}, {&pair.rejected, "rejected"}}) {
      std::vector<uint32_t> row(pair.prompt.begin(), pair.prompt.end());
      row.insert(row.end(), answer->begin(), answer->end());
      row.resize(std::min(row.size(), size_t(o.max_seq_len)));
      std::vector<bool> trained(row.size(), false);
      for (size_t t = pair.prompt.size(); t < row.size(); ++t) trained[t] = true;
      more = more && printer.print(row, trained, fmt::format("line {}, {}", line_no, side));
    }
  });
}

const CommandRegistration kInspect{
    "inspect",
    "Print the training documents of prepared data or of a JSONL file, with their loss mask; or what a .gguf file "
    "holds",
    [](CLI::App& cmd) -> CommandAction {
      auto o = std::make_shared<InspectOptions>();
      cmd.add_option("data", o->data,
                     "A keel prepare directory, JSONL records, or a GGUF file (its metadata and --limit tensors)")
          ->required();
      cmd.add_option("--tokenizer", o->tokenizer, "Tokenizer or model directory (JSONL: to encode; --text: to decode)");
      cmd.add_option("--template", o->chat_template, "Chat template, as keel prepare's --template")
          ->capture_default_str();
      cmd.add_option("--max-seq-len", o->max_seq_len, "JSONL: tokens per document before truncation")
          ->capture_default_str();
      CLI::Option* limit = cmd.add_option("--limit", o->limit, "Documents to print (a GGUF file: tensors; default all)")
          ->capture_default_str()
          ->check(CLI::Range(int64_t(1), int64_t(1) << 40));
      cmd.add_flag("--text", o->text, "Decoded text with the trained spans between « and »");
      cmd.add_flag("--stats", o->stats,
                   "A GGUF file: each tensor's values dequantized and summarised (min, max, mean, RMS, NaN/inf)");
      cmd.add_flag("--train-on-prompt", o->train_on_prompt, "JSONL: as keel prepare's --train-on-prompt");
      cmd.add_flag("--special-tokens-in-messages", o->special_tokens_in_messages,
                   "JSONL: as keel prepare's --special-tokens-in-messages");
      return [o, limit] {
        if (o->data.size() > 5 && o->data.ends_with(".gguf")) {
          inspect_gguf(o->data, limit->count() ? o->limit : std::numeric_limits<int64_t>::max(), o->stats);
          return 0;
        }
        require(!o->stats, "keel inspect --stats applies to a GGUF file (FILE.gguf); {} is training data", o->data);
        const bool prepared = data::is_prepared_dir(o->data);
        require(prepared || path_exists(o->data), "{}: no such file or prepared directory", o->data);
        require(prepared || !o->tokenizer.empty(), "keel inspect {}: a JSONL file needs --tokenizer to be encoded",
                o->data);
        require(!o->text || !o->tokenizer.empty(), "keel inspect --text needs --tokenizer to decode the ids");
        std::unique_ptr<data::Tokenizer> tokenizer;
        if (!o->tokenizer.empty()) tokenizer = std::make_unique<data::Tokenizer>(data::load_tokenizer(o->tokenizer));
        DocumentPrinter printer(*o, tokenizer.get());
        if (prepared)
          inspect_prepared(*o, printer);
        else if (data::holds_preference_pairs(o->data))
          inspect_pairs(*o, *tokenizer, printer);
        else
          inspect_jsonl(*o, tokenizer.get(), printer);
        return 0;
      };
    }};

}  // namespace
}  // namespace keel::cli
