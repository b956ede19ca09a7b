#include "keel/core/json_text.h"
#include "keel/data/prepare.h"

#include <fmt/format.h>
#include <fmt/ostream.h>
#include <unistd.h>

#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <filesystem>
#include <map>
#include <mutex>
#include <optional>
#include <ostream>
#include <thread>

#include "keel/core/checksum.h"
#include "keel/core/error.h"
#include "keel/core/file_io.h"
#include "keel/core/work_progress.h"
#include "keel/data/chat_template.h"
#include "keel/data/record_reader.h"
#include "keel/data/tokenizer.h"

namespace keel::data {

double PrepareReport::fill() const {
  return sequences > 0 && max_seq_len > 0 ? double(tokens) / (double(sequences) * double(max_seq_len)) : 0.0;
}

namespace {

namespace fs = std::filesystem;

// What a worker makes of one chunk of lines: the kept documents back to back, in line order.
struct ChunkResult : EncodedDocuments {
  std::vector<BadRecord> bad;
  int64_t lines = 0, blank = 0, bytes = 0;
  // A configuration error (a chat record with no template known) stops prepare, not a skip.
  std::optional<std::string> fatal;
};

void process_chunk(const DocumentEncoder& encoder, RecordParser& parser, const LineChunk& chunk, ChunkResult& out) {
  Record record;
  std::vector<int32_t> ids;
  out.lines = int64_t(chunk.lines.size());
  out.bytes = chunk.input_bytes();
  size_t next_overlong = 0;
  for (size_t i = 0; i < chunk.lines.size(); ++i) {
    const std::string_view line = chunk.lines[i];
    const int64_t number = chunk.first_line + int64_t(i);
    if (next_overlong < chunk.overlong.size() && chunk.overlong[next_overlong].first == i) {
      out.bad.push_back(
          {number, fmt::format("the line is {} bytes long, above the {} MiB limit for one record",
                               chunk.overlong[next_overlong++].second, LineChunkReader::kDefaultMaxLineBytes >> 20)});
      continue;
    }
    if (line.find_first_not_of(" \t\r") == std::string_view::npos) {
      ++out.blank;
      continue;
    }
    std::string why = parser.parse(line, record);
    std::string fatal;
    if (why.empty()) why = encoder.encode(record, number, out, ids, fatal);
    if (!fatal.empty()) {
      out.fatal = std::move(fatal);
      return;
    }
    if (!why.empty()) out.bad.push_back({number, std::move(why)});
  }
}

// Shards are written one at a time; this thread packs documents into them in input order.
class ShardSink {
 public:
  ShardSink(const PrepareOptions& o) : o_(o) {}
  void add(std::span<const uint32_t> tokens, std::span<const uint8_t> mask) {
    if (writer_ && open_ + int64_t(tokens.size()) > o_.max_seq_len) close_sequence();
    if (!writer_)
      writer_ = std::make_unique<ShardWriter>(fmt::format("{}/shard-{:05d}.bin", o_.out_dir, shards_.size()));
    writer_->add_document(tokens, mask);
    open_ += int64_t(tokens.size());
    if (o_.packing == Packing::pad) close_sequence();
  }
  std::vector<ShardInfo> finish() {
    if (writer_) shards_.push_back(writer_->finish());
    writer_.reset();
    return std::move(shards_);
  }

 private:
  // Ends the open sequence; a shard that has reached its size is finished (the next document
  // opens the next shard).
  void close_sequence() {
    writer_->end_sequence();
    open_ = 0;
    if (writer_->tokens() >= o_.shard_tokens) {
      shards_.push_back(writer_->finish());
      writer_.reset();
    }
  }
  const PrepareOptions& o_;
  std::unique_ptr<ShardWriter> writer_;
  std::vector<ShardInfo> shards_;
  int64_t open_ = 0;
};

// The reading and tokenizing half of prepare: one reader thread cuts the input into chunks of
// lines, `threads` workers tokenize them, and the caller takes the results back in input order
// (next()), writing each before it asks for the one after. At most max_in_flight chunks exist at
// once, read or tokenized or waiting to be written, so memory stays bounded whatever the input.
class ChunkPipeline {
 public:
  ChunkPipeline(const std::string& data_path, size_t chunk_bytes, const DocumentEncoder& encoder, int threads)
      // Two chunks per worker in flight: one being tokenized, one queued, so no worker waits on
      // the reader; more would only add memory.
      : encoder_(encoder), max_in_flight_(size_t(threads) * 2 + 2) {
    reader_ = std::thread([this, data_path, chunk_bytes] { guarded([&] { read(data_path, chunk_bytes); }); });
    for (int w = 0; w < threads; ++w) workers_.emplace_back([this] { guarded([&] { work(); }); });
  }
  ~ChunkPipeline() { join(); }
  ChunkPipeline(const ChunkPipeline&) = delete;
  ChunkPipeline& operator=(const ChunkPipeline&) = delete;

  // The next chunk's result in input order; nullptr when every chunk has been delivered or
  // something failed (finish() says what).
  std::unique_ptr<ChunkResult> next() {
    std::unique_lock lock(mu_);
    cv_.wait(lock, [&] { return abort_ || done_.count(next_) || (reading_done_ && next_ == chunks_read_); });
    if (abort_ || !done_.count(next_)) return nullptr;
    auto r = std::move(done_[next_]);
    done_.erase(next_++);
    return r;
  }
  // A delivered chunk is written: the reader may read another.
  void written() {
    std::lock_guard lock(mu_);
    --in_flight_;
    cv_.notify_all();
  }
  // Stops the threads; the first failure is the one finish() rethrows.
  void fail(std::exception_ptr e) {
    std::lock_guard lock(mu_);
    if (!failure_) failure_ = e;
    abort_ = true;
    cv_.notify_all();
  }
  void finish() {
    join();
    if (failure_) std::rethrow_exception(failure_);
  }
  bool failed() {
    std::lock_guard lock(mu_);
    return failure_ != nullptr;
  }

 private:
  template <class F>
  void guarded(F&& f) {
    try {
      f();
    } catch (...) {
      fail(std::current_exception());
    }
  }

  void read(const std::string& data_path, size_t chunk_bytes) {
    LineChunkReader lines(data_path, chunk_bytes);
    for (;;) {
      auto chunk = std::make_unique<LineChunk>();
      {
        std::unique_lock lock(mu_);
        cv_.wait(lock, [&] { return abort_ || in_flight_ < max_in_flight_; });
        if (abort_) return;
      }
      if (!lines.next(*chunk)) break;
      std::lock_guard lock(mu_);
      ++in_flight_;
      ++chunks_read_;
      queue_.push_back(std::move(chunk));
      cv_.notify_all();
    }
    std::lock_guard lock(mu_);
    reading_done_ = true;
    cv_.notify_all();
  }

  void work() {
    RecordParser parser = encoder_.record_parser();
    for (;;) {
      std::unique_ptr<LineChunk> chunk;
      {
        std::unique_lock lock(mu_);
        cv_.wait(lock, [&] { return abort_ || queue_head_ < queue_.size() || reading_done_; });
        if (abort_ || queue_head_ == queue_.size()) return;
        chunk = std::move(queue_[queue_head_++]);
        if (queue_head_ == queue_.size()) {
          queue_.clear();
          queue_head_ = 0;
        }
      }
      auto result = std::make_unique<ChunkResult>();
      process_chunk(encoder_, parser, *chunk, *result);
      const int64_t index = chunk->index;
      chunk.reset();  // its memory goes before the result is handed on
      std::lock_guard lock(mu_);
      done_.emplace(index, std::move(result));
      cv_.notify_all();
    }
  }

  void join() {
    if (reader_.joinable()) reader_.join();
    for (auto& w : workers_)
      if (w.joinable()) w.join();
  }

  const DocumentEncoder& encoder_;
  const size_t max_in_flight_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::vector<std::unique_ptr<LineChunk>> queue_;  // read, waiting for a worker (FIFO by index)
  size_t queue_head_ = 0;
  std::map<int64_t, std::unique_ptr<ChunkResult>> done_;  // tokenized, by chunk index
  size_t in_flight_ = 0;
  bool reading_done_ = false, abort_ = false;
  int64_t chunks_read_ = 0, next_ = 0;
  std::exception_ptr failure_;
  std::thread reader_;
  std::vector<std::thread> workers_;
};

// Progress while a large file is prepared (it used to print nothing until the end, minutes for a
// few GB): records and bytes so far, the share of the file, MB/s and the time left, as a live
// line on a terminal or a line every few seconds (core/work_progress.h).
class PrepareProgress {
 public:
  PrepareProgress(std::ostream* log, const std::string& data_path, bool live) : line_(log, live) {
    // The share of the file is known for plain JSONL only: compressed input is counted decompressed.
    const bool compressed = data_path.ends_with(".gz") || data_path.ends_with(".zst");
    std::error_code ec;
    const auto size = fs::file_size(data_path, ec);
    if (!compressed && !ec) file_bytes_ = double(size);
  }
  void chunk_done(const PrepareReport& report) {
    if (!line_.due()) return;
    const double mb = double(report.input_bytes) / 1e6, rate = mb / std::max(line_.elapsed_s(), 1e-9);
    std::string share;
    if (file_bytes_ > 0) {
      const double done = std::min(1.0, double(report.input_bytes) / file_bytes_);
      share = fmt::format(" ({:.0f}% of the file, about {:.0f} s left)", 100.0 * done,
                          rate > 0 ? (file_bytes_ / 1e6 - mb) / rate : 0.0);
    }
    line_.print(fmt::format("keel prepare: {} records, {:.1f} MB read{}, {:.1f} MB/s",
                            report.lines - report.blank_lines, mb, share, rate));
  }
 private:
  WorkProgress line_;
  double file_bytes_ = 0;
};

// Adds one chunk's counts to the report.
void tally(PrepareReport& report, ChunkResult& r) {
  report.lines += r.lines;
  report.blank_lines += r.blank;
  report.bad_records += int64_t(r.bad.size());
  for (auto& b : r.bad)
    if (report.bad_listed.size() < kMaxListedBadRecords) report.bad_listed.push_back(std::move(b));
  report.truncated_documents += r.truncated;
  report.truncated_tokens += r.truncated_tokens;
  report.split_documents += r.split;
  report.no_target_documents += r.no_target;
  if (report.records_with_special_strings == 0 && r.special_string_records > 0) {
    report.first_special_string_line = r.first_special_string_line;
    report.first_special_string = r.first_special_string;
  }
  report.records_with_special_strings += r.special_string_records;
  report.input_bytes += r.bytes;
  report.documents += int64_t(r.document_ends.size());
}

void print_report(std::ostream& log, const PrepareReport& report, const PrepareOptions& o) {
  fmt::print(log,
             "keel prepare: {} records ({} bad, {} blank lines), {} documents ({} truncated, {} long texts "
             "split, {} without targets)\n",
             report.records, report.bad_records, report.blank_lines, report.documents, report.truncated_documents,
             report.split_documents, report.no_target_documents);
  if (report.records_with_special_strings > 0)
    fmt::print(log,
               "keel prepare: {} {} special-token strings in their text (the first: {}:{}, {}): encoded as text, "
               "not as the tokens (--special-tokens-in-messages, or special_tokens_in_messages = true in a recipe, "
               "matches them)\n",
               report.records_with_special_strings,
               report.records_with_special_strings == 1 ? "record holds" : "records hold", o.data_path,
               report.first_special_string_line, json_quoted(report.first_special_string));
  for (size_t i = 0; i < std::min<size_t>(report.bad_listed.size(), 10); ++i)
    fmt::print(log, "  {}:{}: {}\n", o.data_path, report.bad_listed[i].line, report.bad_listed[i].reason);
  if (report.bad_records > 10) fmt::print(log, "  ... all listed in {}/report.json\n", o.out_dir);
  fmt::print(log,
             "keel prepare: {} sequences of <= {} tokens ({}, {:.1f}% filled), {} tokens in {} shard(s); "
             "{:.1f} MB/s, {:.2f} s\n",
             report.sequences, o.max_seq_len, packing_name(o.packing), 100.0 * report.fill(), report.tokens,
             report.shards, double(report.input_bytes) / 1e6 / std::max(report.seconds, 1e-9), report.seconds);
  // Rows that are mostly padding spend most of every step on nothing.
  if (o.packing == Packing::pad && report.sequences > 0 && report.fill() < 0.5)
    fmt::print(log,
               "warning: the rows are {:.0f}% padding ({:.1f} tokens per document in rows of {}): packing = \"pack\" "
               "fills them (packed documents never attend to each other), or a lower max_seq_len wastes less\n",
               100.0 * (1.0 - report.fill()), double(report.tokens) / double(std::max<int64_t>(report.documents, 1)),
               o.max_seq_len);
}

// keel::Error when the data is too bad to train on: too many bad records, or nothing left.
void require_usable(const PrepareReport& report, const PrepareOptions& o) {
  require(report.records == 0 || double(report.bad_records) <= o.max_bad_fraction * double(report.records),
          "{}: {} of {} records are bad ({:.2f}%, above the allowed fraction {}: --max-bad-fraction, or "
          "max_bad_fraction in a recipe); the first: {}:{}: {}; all listed in "
          "{}/report.json",
          o.data_path, report.bad_records, report.records, 100.0 * double(report.bad_records) / double(report.records),
          o.max_bad_fraction, o.data_path, report.bad_listed.empty() ? 0 : report.bad_listed[0].line,
          report.bad_listed.empty() ? "" : report.bad_listed[0].reason, o.out_dir);
  require(report.sequences > 0, "{}: no usable records (nothing to train on); see {}/report.json", o.data_path,
          o.out_dir);
}

// Removes what a previous prepare left in the directory, manifest first: from then on the
// directory is not valid prepared data until the new manifest lands.
void clear_previous_output(const std::string& dir) {
  std::error_code ec;
  fs::remove(fs::path(dir) / "manifest.json", ec);
  for (const auto& entry : fs::directory_iterator(dir, ec)) {
    const std::string name = entry.path().filename().string();
    if (name.rfind("shard-", 0) == 0 && name.size() > 4 && name.compare(name.size() - 4, 4, ".bin") == 0)
      fs::remove(entry.path(), ec);
  }
}

}  // namespace

namespace {

std::optional<ChatFormat> choose_chat_format(const std::string& name, const std::string& tokenizer_path,
                                             const Tokenizer* tokenizer, std::string& why) {
  why = "chosen by name";
  if (name == "none") return std::nullopt;
  if (name != "auto") return chat_format_from_name(name);
  why = "no tokenizer: records must be pre-tokenized";
  if (tokenizer_path.empty() || !tokenizer) return std::nullopt;
  const fs::path p(tokenizer_path);
  const std::string dir = fs::is_directory(p) ? p.string() : p.parent_path().string();
  try {
    why = fmt::format("detected from the model files in {}", dir.empty() ? "." : dir);
    return detect_chat_format(dir.empty() ? "." : dir);
  } catch (const Error&) {}
  // No model files around the tokenizer: its special tokens still tell the family.
  why = "detected from the tokenizer's special tokens";
  if (tokenizer->token_to_id("[gMASK]")) return ChatFormat::glm4;
  if (tokenizer->token_to_id("<|start_header_id|>")) return ChatFormat::llama3;
  if (tokenizer->token_to_id("<|im_start|>")) return ChatFormat::chatml;
  why = "none known for this tokenizer: conversations are refused, text records are used as they are";
  return std::nullopt;
}

}  // namespace

std::optional<ChatFormat> chat_format_for(const std::string& name, const std::string& tokenizer_path,
                                          const Tokenizer* tokenizer, std::string* why) {
  std::string reason;
  const auto format = choose_chat_format(name, tokenizer_path, tokenizer, reason);
  if (why) *why = reason;
  if (format && tokenizer)
    for (const auto& marker : chat_format_markers(*format))
      require(tokenizer->token_to_id(marker).has_value(),
              "{}: the {} chat template needs '{}' as one token, and this tokenizer has no such token: the "
              "conversation markers would be encoded as plain text. Use the tokenizer of the model the template is "
              "for, or the model's own template (chat_template = \"auto\")",
              tokenizer_path, chat_format_name(*format), marker);
  return format;
}

namespace {

// chat_template names a template file (.jinja, or a JSON file holding "chat_template").
bool is_template_file(const std::string& name) {
  return name.ends_with(".jinja") || (name != "auto" && name != "model" && path_exists(name));
}

}  // namespace

std::string choose_chat_template(DocumentEncoder& encoder, const std::string& name, const std::string& tokenizer_path,
                                 std::string* why) {
  encoder.format.reset();
  encoder.model_template.reset();
  std::optional<ModelChatTemplate> own;
  if (is_template_file(name)) {
    own = chat_template_from_file(name, tokenizer_path.empty() || fs::is_directory(tokenizer_path)
                                            ? tokenizer_path
                                            : fs::path(tokenizer_path).parent_path().string());
  } else if ((name == "auto" || name == "model") && !tokenizer_path.empty() && encoder.tokenizer) {
    const fs::path p(tokenizer_path);
    own = find_model_chat_template(fs::is_directory(p) ? p.string() : p.parent_path().string());
    require(own || name == "auto",
            "{}: chat_template = \"model\" but the directory has no chat template (chat_template.jinja, "
            "chat_template.json or \"chat_template\" in tokenizer_config.json)",
            tokenizer_path);
  } else {
    require(name != "model", "chat_template = \"model\" needs the model's tokenizer directory");
  }
  if (own) {
    require(encoder.tokenizer != nullptr, "{}: a chat template needs a tokenizer", own->origin);
    if (why) *why = fmt::format("the model's own template, {}", own->origin);
    const std::string recorded = "model:" + own->checksum;
    encoder.model_template =
        std::make_shared<ChatTemplateEncoder>(std::move(*own), encoder.tokenizer, encoder.special_tokens_in_messages);
    return recorded;
  }
  encoder.format = chat_format_for(name, tokenizer_path, encoder.tokenizer, why);
  return encoder.format ? chat_format_name(*encoder.format) : "none";
}

std::string chat_template_key(const std::string& name) {
  // "jinja1": since model templates are rendered, "auto" means something else than before.
  if (is_template_file(name))
    return fmt::format("{}|{}|jinja1", name, checksum_hex(file_checksum(name)));
  return name + "|jinja1";
}

namespace {

// The settings beside the template that change which tokens a conversation gives and trains.
std::string masking_key(const TrainingDataRequest& q) {
  return fmt::format("|prompt={}|specials={}", q.train_on_prompt, q.special_tokens_in_messages);
}

}  // namespace

std::string DocumentEncoder::configuration_error(const Record& r, int64_t line) const {
  if (r.kind == RecordKind::text && !tokenizer)
    return fmt::format("{}:{}: a text record needs a tokenizer (--tokenizer)", data_path, line);
  if (r.kind == RecordKind::conversation && (!tokenizer || (!format && !model_template)))
    return fmt::format(
        "{}:{}: a chat record needs a tokenizer and a chat template (--template glm4|llama3|chatml; "
        "'auto' found none for this tokenizer)",
        data_path, line);
  return {};
}

// Replaces the document at out[start..] by consecutive chunks of max_seq_len tokens that overlap
// by one: a chunk's first token is only context, so every token after the document's first is a
// target exactly once, and positions restart per chunk as for any document.
void split_into_chunks(EncodedDocuments& out, size_t start, int64_t max_seq_len) {
  const std::vector<uint32_t> tokens(out.tokens.begin() + std::ptrdiff_t(start), out.tokens.end());
  const std::vector<uint8_t> mask(out.mask.begin() + std::ptrdiff_t(start), out.mask.end());
  out.tokens.resize(start);
  out.mask.resize(start);
  const int64_t n = int64_t(tokens.size());
  for (int64_t begin = 0; begin + 1 < n; begin += max_seq_len - 1) {
    const int64_t end = std::min(n, begin + max_seq_len);
    out.tokens.insert(out.tokens.end(), tokens.begin() + begin, tokens.begin() + end);
    out.mask.insert(out.mask.end(), mask.begin() + begin, mask.begin() + end);
    out.document_ends.push_back(int64_t(out.tokens.size()));
  }
  ++out.split;
}

std::string DocumentEncoder::encode(const Record& r, int64_t line, EncodedDocuments& out, std::vector<int32_t>& ids,
                                    std::string& fatal) const {
  const size_t start = out.tokens.size();
  auto append = [&](const std::vector<int32_t>& piece, bool target) {
    for (int32_t id : piece) {
      out.tokens.push_back(uint32_t(id));
      out.mask.push_back(target ? 1 : 0);
    }
  };
  auto undo = [&] {
    out.tokens.resize(start);
    out.mask.resize(start);
  };
  fatal = configuration_error(r, line);
  if (!fatal.empty()) return {};
  // The first special-token string the record's own text held (encoded as text), counted once the
  // document is kept: a record skipped for having nothing to learn is not reported as encoded.
  std::string special_string;
  try {
    switch (r.kind) {
      case RecordKind::tokens:
        for (size_t t = 0; t < r.input_ids.size(); ++t) {
          if (r.input_ids[t] >= vocab_size) {
            undo();
            return fmt::format("input_ids[{}] = {} is outside the vocabulary ({} tokens)", t, r.input_ids[t],
                               vocab_size);
          }
          if (r.labels[t] != -100 && r.labels[t] != r.input_ids[t]) {
            undo();
            return fmt::format("labels[{}] = {} is neither -100 nor input_ids[{}]", t, r.labels[t], t);
          }
          out.tokens.push_back(uint32_t(r.input_ids[t]));
          out.mask.push_back(r.labels[t] != -100);
        }
        break;
      case RecordKind::text: {
        ids.clear();
        // Like a message's: special-token strings in the text are text unless the recipe says
        // otherwise (a scraped page quoting "<|endoftext|>" is not a document boundary).
        if (!special_tokens_in_messages)
          if (const std::string* s = tokenizer->special_strings().first_in(r.text)) special_string = *s;
        tokenizer->encode(
            r.text, ids,
            EncodeOptions{.add_special_tokens = true, .split_special_tokens = !special_tokens_in_messages});
        // Documents are packed back to back: without an end marker the model would learn to
        // run one into the next.
        if (tokenizer->eos_id() && (ids.empty() || ids.back() != *tokenizer->eos_id()))
          ids.push_back(*tokenizer->eos_id());
        append(ids, true);
        break;
      }
      case RecordKind::conversation: {
        if (model_template) {
          // Read whole by the encoder's record_parser(), or role/content pairs (prompt/response).
          const EncodedChat chat = model_template->encode(r.chat ? *r.chat : chat_input_from_messages(r.messages));
          if (chat.control_strings_in_data > 0) special_string = chat.first_control_string;
          for (size_t t = 0; t < chat.ids.size(); ++t) {
            out.tokens.push_back(uint32_t(chat.ids[t]));
            out.mask.push_back(chat.assistant_mask[t] || train_on_prompt ? 1 : 0);
          }
          break;
        }
        // Segment by segment, so each token's mask is exact; the cut between a header and its
        // content is at special tokens or newlines in every built-in template, where a BPE
        // pre-tokenizer splits anyway.
        // A message's content is encoded with special-token strings as plain text (a user cannot
        // forge a turn boundary); the template's markup with its special tokens.
        for (const auto& segment : render_chat(*format, r.messages, false)) {
          if (segment.content && !special_tokens_in_messages && special_string.empty())
            if (const std::string* s = tokenizer->special_strings().first_in(segment.text)) special_string = *s;
          ids.clear();
          tokenizer->encode(segment.text, ids,
                            EncodeOptions{.split_special_tokens = segment.content && !special_tokens_in_messages});
          append(ids, segment.assistant || train_on_prompt);
        }
        break;
      }
    }
  } catch (const Error& e) {
    undo();
    return e.what();
  }
  int64_t length = int64_t(out.tokens.size() - start);
  if (length > max_seq_len && split_long_text && r.kind == RecordKind::text && max_seq_len >= 2) {
    split_into_chunks(out, start, max_seq_len);
    if (!special_string.empty()) out.count_special_string(line, special_string);
    return {};
  }
  if (length > max_seq_len) {
    ++out.truncated;
    out.truncated_tokens += length - max_seq_len;
    length = max_seq_len;
    out.tokens.resize(start + size_t(length));
    out.mask.resize(start + size_t(length));
  }
  // Token 0 of a document is never predicted (nothing before it in its document).
  bool any_target = false;
  for (int64_t t = 1; t < length && !any_target; ++t) any_target = out.mask[start + size_t(t)] != 0;
  if (!any_target) {
    ++out.no_target;
    undo();
    return {};
  }
  out.document_ends.push_back(int64_t(out.tokens.size()));
  if (!special_string.empty()) out.count_special_string(line, special_string);
  return {};
}

std::string report_json(const PrepareReport& r) {
  std::string bad;
  for (size_t i = 0; i < r.bad_listed.size(); ++i)
    bad += fmt::format("{}    {{\"line\": {}, \"reason\": {}}}", i ? ",\n" : "", r.bad_listed[i].line,
                       json_quoted(r.bad_listed[i].reason));
  return fmt::format(
      "{{\n  \"lines\": {},\n  \"blank_lines\": {},\n  \"records\": {},\n  \"bad_records\": {},\n"
      "  \"bad_records_listed\": {},\n  \"documents\": {},\n  \"truncated_documents\": {},\n"
      "  \"truncated_tokens\": {},\n  \"split_documents\": {},\n  \"no_target_documents\": {},\n"
      "  \"records_with_special_strings\": {},\n  \"first_special_string\": {},\n"
      "  \"sequences\": {},\n  \"tokens\": {},\n"
      "  \"shards\": {},\n  \"max_seq_len\": {},\n  \"fill\": {:.4f},\n  \"chat_template\": {},\n"
      "  \"input_bytes\": {},\n  \"seconds\": {:.3f},\n  \"bad\": [\n{}\n  ]\n}}\n",
      r.lines, r.blank_lines, r.records, r.bad_records, r.bad_listed.size(), r.documents, r.truncated_documents,
      r.truncated_tokens, r.split_documents, r.no_target_documents, r.records_with_special_strings,
      r.first_special_string_line > 0 ? fmt::format("{{\"line\": {}, \"text\": {}}}", r.first_special_string_line,
                                                    json_quoted(r.first_special_string))
                                      : std::string("null"),
      r.sequences, r.tokens, r.shards, r.max_seq_len, r.fill(), json_quoted(r.chat_template), r.input_bytes, r.seconds,
      bad);
}

std::string tokenizer_hash(const std::string& path) {
  if (path.empty()) return "";
  if (!fs::is_directory(path)) return checksum_hex(file_checksum(path));
  std::string parts;
  for (const char* name :
       {"tokenizer.json", "tokenizer.model", "tokenizer_config.json", "chat_template.jinja", "chat_template.json"}) {
    const std::string file = path + "/" + name;
    if (path_exists(file)) parts += fmt::format("{}={};", name, checksum_hex(file_checksum(file)));
  }
  require(!parts.empty(), "{}: no tokenizer.json or tokenizer.model in the directory", path);
  return checksum_hex(checksum(parts));
}

PrepareReport prepare(const PrepareOptions& o, std::ostream* log) {
  const auto start = std::chrono::steady_clock::now();
  require(o.max_seq_len >= 2, "--max-seq-len must be at least 2 (got {})", o.max_seq_len);
  require(o.max_bad_fraction >= 0 && o.max_bad_fraction <= 1, "--max-bad-fraction must be in [0, 1] (got {})",
          o.max_bad_fraction);
  require(path_exists(o.data_path), "{}: no such file", o.data_path);
  std::optional<Tokenizer> tokenizer;
  if (!o.tokenizer_path.empty()) tokenizer.emplace(load_tokenizer(o.tokenizer_path));
  // A tokenizer larger than the model is refused before anything is tokenized (minutes, on a
  // large file) or written, not by the loader afterwards.
  require(!tokenizer || o.vocab_size <= 0 || tokenizer->vocab_size() <= o.vocab_size,
          "{}: the tokenizer has a {}-token vocabulary, larger than the model's vocab_size {}: its ids would fall "
          "outside the embedding. Nothing was tokenized; use the model's own tokenizer",
          o.tokenizer_path, tokenizer ? tokenizer->vocab_size() : 0, o.vocab_size);
  DocumentEncoder encoder;
  encoder.tokenizer = tokenizer ? &*tokenizer : nullptr;
  std::string template_reason;
  encoder.special_tokens_in_messages = o.special_tokens_in_messages;
  const std::string template_name = choose_chat_template(encoder, o.chat_template, o.tokenizer_path, &template_reason);
  encoder.max_seq_len = o.max_seq_len;
  encoder.vocab_size = tokenizer ? tokenizer->vocab_size() : o.vocab_size;
  encoder.train_on_prompt = o.train_on_prompt;
  encoder.split_long_text = o.packing == Packing::pack;
  encoder.data_path = o.data_path;
  require(encoder.vocab_size > 0, "prepare without a tokenizer needs the vocabulary size");

  if (log)  // the decisions taken for the user, before the work
    fmt::print(*log, "keel prepare: tokenizer {}; chat template {} ({}); {} into rows of {} tokens\n",
               tokenizer ? fmt::format("{} ({} tokens)", o.tokenizer_path, tokenizer->vocab_size())
                         : std::string("none (pre-tokenized records)"),
               template_name, template_reason,
               o.packing == Packing::pack ? "documents packed" : "one document per row, padded", o.max_seq_len);
  make_dirs(o.out_dir);
  clear_previous_output(o.out_dir);
  PrepareReport report;
  report.max_seq_len = o.max_seq_len;
  report.chat_template = template_name;
  std::vector<ShardInfo> shards;
  {
    const int threads = o.threads > 0 ? o.threads : int(std::max(1u, std::thread::hardware_concurrency()));
    ChunkPipeline pipeline(o.data_path, o.chunk_bytes, encoder, threads);
    PrepareProgress progress(log, o.data_path, o.live_progress);
    try {
      ShardSink sink(o);
      while (auto r = pipeline.next()) {
        if (r->fatal) fail("{}", *r->fatal);
        tally(report, *r);
        int64_t begin = 0;
        for (int64_t end : r->document_ends) {
          sink.add({r->tokens.data() + begin, size_t(end - begin)}, {r->mask.data() + begin, size_t(end - begin)});
          begin = end;
        }
        r.reset();
        pipeline.written();
        progress.chunk_done(report);
      }
      if (!pipeline.failed()) shards = sink.finish();
    } catch (...) {
      pipeline.fail(std::current_exception());
    }
    pipeline.finish();
  }

  report.records = report.lines - report.blank_lines;
  for (const auto& s : shards) {
    report.sequences += s.sequences;
    report.tokens += s.tokens;
  }
  report.shards = int64_t(shards.size());
  report.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  write_file_atomic(o.out_dir + "/report.json", report_json(report));
  if (log) print_report(*log, report, o);
  require_usable(report, o);

  // Last: a directory without a manifest is not prepared data.
  ShardManifest m;
  m.tokenizer_hash = tokenizer_hash(o.tokenizer_path);
  m.chat_template = report.chat_template;
  m.max_seq_len = o.max_seq_len;
  m.packing = o.packing;
  m.vocab_size = encoder.vocab_size;
  m.pad_id = o.pad_id >= 0 ? o.pad_id : tokenizer && tokenizer->eos_id() ? *tokenizer->eos_id() : 0;
  m.source = fs::absolute(o.data_path).string();
  m.source_checksum = file_checksum(o.data_path);
  m.shards = std::move(shards);
  write_file_atomic(o.out_dir + "/manifest.json", manifest_json(m));
  return report;
}

std::string training_tokenizer_path(const std::string& path) {
  // A model directory without tokenizer files (a scratch or test model) means pre-tokenized data.
  if (!path.empty() && fs::is_directory(path) && !path_exists(path + "/tokenizer.json") &&
      !path_exists(path + "/tokenizer.model"))
    return "";
  return path;
}

std::string training_data_fingerprint(const TrainingDataRequest& q) {
  require(path_exists(q.data_path) && !fs::is_directory(q.data_path), "{}: no such file", q.data_path);
  return checksum_hex(checksum(fmt::format("documents|{}|{}|{}|{}|{}|{}|{}", checksum_hex(file_checksum(q.data_path)),
                                           tokenizer_hash(training_tokenizer_path(q.tokenizer_path)),
                                           chat_template_key(q.chat_template) + masking_key(q),
                                           q.max_seq_len, packing_name(q.packing), q.vocab_size, q.pad_id)));
}

std::string resolve_training_data(const TrainingDataRequest& request, std::ostream* log) {
  TrainingDataRequest q = request;
  q.tokenizer_path = training_tokenizer_path(q.tokenizer_path);
  if (is_prepared_dir(q.data_path)) {
    const ShardManifest m = read_manifest(q.data_path);
    require(m.max_seq_len <= q.max_seq_len,
            "{}: prepared for max_seq_len {} but the recipe trains with {} (prepare again, or raise max_seq_len)",
            q.data_path, m.max_seq_len, q.max_seq_len);
    require(q.vocab_size <= 0 || m.vocab_size <= q.vocab_size,
            "{}: prepared with a {}-token vocabulary, larger than the model's {}", q.data_path, m.vocab_size,
            q.vocab_size);
    if (!q.tokenizer_path.empty() && !m.tokenizer_hash.empty() && log) {
      const std::string h = tokenizer_hash(q.tokenizer_path);
      if (h != m.tokenizer_hash)
        fmt::print(*log, "warning: {} was prepared with a different tokenizer than {}'s\n", q.data_path,
                   q.tokenizer_path);
    }
    return q.data_path;
  }
  require(path_exists(q.data_path), "{}: no such file or prepared directory", q.data_path);
  const std::string tok_hash = tokenizer_hash(q.tokenizer_path);
  // The cache key covers everything the shards depend on, the content first (a path can be reused).
  const std::string key = checksum_hex(checksum(
      fmt::format("{}|{}|{}|{}|{}|{}|{}|v{}", checksum_hex(file_checksum(q.data_path)), tok_hash,
                  chat_template_key(q.chat_template) + masking_key(q),
                  q.max_seq_len, packing_name(q.packing), q.vocab_size, q.pad_id, kShardFormatVersion)));
  std::string cache = q.cache_dir;
  if (cache.empty()) {
    const fs::path parent = fs::path(q.data_path).parent_path();
    cache = (parent.empty() ? fs::path(".") : parent).string() + "/.keel-cache";
  }
  const std::string dir = cache + "/" + key;
  if (is_prepared_dir(dir)) {
    if (log) fmt::print(*log, "keel: using data prepared earlier from {} in {}\n", q.data_path, dir);
    return dir;
  }
  // Prepared beside the final name and renamed into place: a killed run leaves no half directory
  // that a later run would take for prepared data.
  const std::string tmp = fmt::format("{}.tmp.{}", dir, ::getpid());
  std::error_code ec;
  fs::remove_all(tmp, ec);
  PrepareOptions o;
  o.data_path = q.data_path;
  o.tokenizer_path = q.tokenizer_path;
  o.out_dir = tmp;
  o.max_seq_len = q.max_seq_len;
  o.packing = q.packing;
  o.chat_template = q.chat_template;
  o.train_on_prompt = q.train_on_prompt;
  o.special_tokens_in_messages = q.special_tokens_in_messages;
  o.threads = q.threads;
  o.max_bad_fraction = q.max_bad_fraction;
  o.vocab_size = q.vocab_size;
  o.pad_id = q.pad_id;
  if (log) fmt::print(*log, "keel: preparing {} into {}\n", q.data_path, dir);
  try {
    prepare(o, log);
  } catch (const Error& e) {
    // The report of a failed preparation (bad records, all listed) outlives the temporary
    // directory, and the message names where it went.
    std::string message = e.what();
    const std::string report = tmp + "/report.json", kept = dir + ".failed-report.json";
    if (path_exists(report)) {
      fs::rename(report, kept, ec);
      for (size_t at; !ec && (at = message.find(tmp + "/report.json")) != std::string::npos;)
        message.replace(at, report.size(), kept);
    }
    fs::remove_all(tmp, ec);
    throw Error(message);
  } catch (...) {
    fs::remove_all(tmp, ec);
    throw;
  }
  fs::rename(tmp, dir, ec);
  if (ec) {
    // Another process prepared the same data meanwhile: theirs is as good as ours.
    fs::remove_all(tmp, ec);
    require(is_prepared_dir(dir), "{}: cannot move prepared data into place", dir);
  }
  return dir;
}

}  // namespace keel::data
