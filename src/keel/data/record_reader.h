// Training records from JSONL, streamed: the file (plain, .gz through zlib, .zst through libzstd)
// is read in chunks of whole lines so memory stays bounded whatever the file size, and each line
// is parsed into one of the record shapes users bring:
//   {"text": "..."}                                   plain text, loss on every token
//   {"prompt": "...", "response": "..."}              one exchange (optional "system")
//   {"instruction": "...", "input": "...", "output": "..."}   Alpaca
//   {"messages": [{"role": ..., "content": ...}, ...]}        OpenAI / ShareGPT-in-OpenAI-form
//   {"conversations": [{"from": ..., "value": ...}, ...]}     ShareGPT
//   {"input_ids": [...], "labels": [...]}             already tokenized (labels optional, -100 = no loss)
// A line that is none of these (invalid JSON, missing or mistyped fields, invalid UTF-8) is a bad
// record: its line number and reason are returned so the caller counts and reports it.
#pragma once
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "keel/data/chat_template.h"
#include "keel/data/model_chat_template.h"

namespace keel::data {

// A run of whole lines from the input: `bytes` holds them back to back, `lines` cuts them
// (without the newline), and the first line's number is `first_line` (1-based).
struct LineChunk {
  int64_t index = 0;  // 0, 1, 2, ... in file order
  int64_t first_line = 1;
  std::string bytes;
  std::vector<std::string_view> lines;
  // Lines longer than the reader's max_line_bytes (bad records to report): their index in
  // `lines`, where they stand as empty views, and their length. One that does not fit in memory
  // is never held: it makes a chunk of its own.
  std::vector<std::pair<size_t, int64_t>> overlong;
  int64_t input_bytes() const;  // the chunk's share of the input, overlong lines included
};

// Reads a file in chunks of about `chunk_bytes` of whole lines; a line longer than that makes a
// chunk of its own, and one longer than `max_line_bytes` is skipped (streamed past, never held
// in memory); both are reported through LineChunk::overlong. The compression is chosen by the
// name (.gz, .zst; anything else is plain).
class LineChunkReader {
 public:
  static constexpr size_t kDefaultMaxLineBytes = size_t(64) << 20;
  explicit LineChunkReader(const std::string& path, size_t chunk_bytes = size_t(1) << 20,
                           size_t max_line_bytes = kDefaultMaxLineBytes);
  ~LineChunkReader();
  LineChunkReader(const LineChunkReader&) = delete;
  LineChunkReader& operator=(const LineChunkReader&) = delete;
  // Fills `chunk` with the next lines; false at the end of the input.
  bool next(LineChunk& chunk);
  int64_t bytes_read() const { return bytes_read_; }  // decompressed bytes so far

  class ByteSource;  // plain, gzip or zstd

 private:
  void skip_rest_of_line(LineChunk& chunk);
  std::string path_;
  std::unique_ptr<ByteSource> source_;
  size_t chunk_bytes_, max_line_bytes_;
  std::string carry_;  // the start of a line cut by the end of the last read
  bool eof_ = false;
  int64_t next_index_ = 0, next_line_ = 1, bytes_read_ = 0;
};

enum class RecordKind { text, conversation, tokens };

struct Record {
  RecordKind kind = RecordKind::text;
  std::string text;                   // kind == text
  std::vector<ChatMessage> messages;  // kind == conversation
  // kind == conversation from "messages"/"conversations", read for a model's own template
  // (RecordParser(true)): the messages as they are (tool_calls, reasoning_content, a null content,
  // any role: the template decides), with tools and documents; `messages` stays empty
  std::optional<ChatInput> chat;
  std::vector<int32_t> input_ids, labels;  // kind == tokens (labels same length, -100 = no loss)
  void clear() {
    text.clear();
    messages.clear();
    chat.reset();
    input_ids.clear();
    labels.clear();
  }
};

// ShareGPT speaker names ("human", "gpt", ...) to the roles chat templates know; "" when unknown.
std::string normalized_role(std::string_view role);

// Parses one JSONL line. Returns an empty string on success, else why the record is bad
// ("invalid JSON at ...", "missing field 'text' ...", "invalid UTF-8 in 'content'").
// A parser per thread: RecordParser is not thread-safe, and reuses its buffers across lines.
// for_model_template: conversations are read into Record::chat for a model's own template, once
// and with every field, instead of into role/content pairs for a built-in one.
class RecordParser {
 public:
  explicit RecordParser(bool for_model_template = false);
  ~RecordParser();
  RecordParser(RecordParser&&) noexcept;
  RecordParser& operator=(RecordParser&&) noexcept;
  std::string parse(std::string_view line, Record& out);

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace keel::data
