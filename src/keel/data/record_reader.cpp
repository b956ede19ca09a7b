#include "keel/data/record_reader.h"

#include <simdjson.h>
#include <zlib.h>
#include <zstd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>

#include "keel/core/error.h"

namespace keel::data {

// ---------------------------------------------------------------------------------------------
// Byte sources

class LineChunkReader::ByteSource {
 public:
  virtual ~ByteSource() = default;
  // Up to `size` bytes; 0 at the end. keel::Error naming the file on a read or format error.
  virtual size_t read(char* out, size_t size) = 0;
};

namespace {

bool ends_with(const std::string& s, std::string_view suffix) {
  return s.size() >= suffix.size() && s.compare(s.size() - suffix.size(), suffix.size(), suffix) == 0;
}

class PlainSource final : public LineChunkReader::ByteSource {
 public:
  explicit PlainSource(const std::string& path) : path_(path), file_(std::fopen(path.c_str(), "rb")) {
    require(file_ != nullptr, "{}: cannot open ({})", path, std::strerror(errno));
  }
  ~PlainSource() override { std::fclose(file_); }
  size_t read(char* out, size_t size) override {
    const size_t got = std::fread(out, 1, size, file_);
    require(got > 0 || !std::ferror(file_), "{}: read error ({})", path_, std::strerror(errno));
    return got;
  }

 private:
  std::string path_;
  std::FILE* file_;
};

class GzipSource final : public LineChunkReader::ByteSource {
 public:
  explicit GzipSource(const std::string& path) : path_(path), file_(gzopen(path.c_str(), "rb")) {
    require(file_ != nullptr, "{}: cannot open ({})", path, std::strerror(errno));
    gzbuffer(file_, 1 << 20);
  }
  ~GzipSource() override { gzclose(file_); }
  size_t read(char* out, size_t size) override {
    const int got = gzread(file_, out, unsigned(std::min<size_t>(size, 1u << 30)));
    if (got < 0) {
      int code = 0;
      const char* message = gzerror(file_, &code);
      fail("{}: gzip data is corrupt after {} decompressed bytes ({})", path_, total_, message);
    }
    total_ += got;
    return size_t(got);
  }

 private:
  std::string path_;
  gzFile file_;
  int64_t total_ = 0;
};

class ZstdSource final : public LineChunkReader::ByteSource {
 public:
  explicit ZstdSource(const std::string& path)
      : path_(path),
        file_(std::fopen(path.c_str(), "rb")),
        stream_(ZSTD_createDStream()),
        in_buffer_(ZSTD_DStreamInSize()) {
    require(file_ != nullptr, "{}: cannot open ({})", path, std::strerror(errno));
    require(stream_ != nullptr, "{}: cannot create a zstd decompression stream", path);
    ZSTD_initDStream(stream_);
  }
  ~ZstdSource() override {
    ZSTD_freeDStream(stream_);
    std::fclose(file_);
  }
  size_t read(char* out, size_t size) override {
    ZSTD_outBuffer output{out, size, 0};
    while (output.pos == 0) {
      if (input_.pos == input_.size) {
        const size_t got = std::fread(in_buffer_.data(), 1, in_buffer_.size(), file_);
        require(got > 0 || !std::ferror(file_), "{}: read error ({})", path_, std::strerror(errno));
        if (got == 0) {
          // A frame cut short is a truncated file, not a clean end.
          require(frame_done_, "{}: zstd stream ends in the middle of a frame (truncated file?)", path_);
          return 0;
        }
        input_ = {in_buffer_.data(), got, 0};
      }
      const size_t r = ZSTD_decompressStream(stream_, &output, &input_);
      require(!ZSTD_isError(r), "{}: zstd data is corrupt after {} decompressed bytes ({})", path_, total_,
              ZSTD_getErrorName(r));
      frame_done_ = r == 0;
    }
    total_ += int64_t(output.pos);
    return output.pos;
  }

 private:
  std::string path_;
  std::FILE* file_;
  ZSTD_DStream* stream_;
  std::vector<char> in_buffer_;
  ZSTD_inBuffer input_{nullptr, 0, 0};
  bool frame_done_ = true;
  int64_t total_ = 0;
};

}  // namespace

LineChunkReader::LineChunkReader(const std::string& path, size_t chunk_bytes, size_t max_line_bytes)
    : path_(path),
      chunk_bytes_(std::max<size_t>(chunk_bytes, 4096)),
      max_line_bytes_(std::max<size_t>(max_line_bytes, 1)) {
  if (ends_with(path, ".gz"))
    source_ = std::make_unique<GzipSource>(path);
  else if (ends_with(path, ".zst") || ends_with(path, ".zstd"))
    source_ = std::make_unique<ZstdSource>(path);
  else
    source_ = std::make_unique<PlainSource>(path);
}

LineChunkReader::~LineChunkReader() = default;

bool LineChunkReader::next(LineChunk& chunk) {
  chunk.bytes.swap(carry_);
  carry_.clear();
  chunk.lines.clear();
  chunk.overlong.clear();
  chunk.index = next_index_;
  chunk.first_line = next_line_;
  // Read until the chunk is full and holds at least one newline (or the input ends). Only new
  // bytes are searched, so a long line costs linear time.
  bool newline = chunk.bytes.find('\n') != std::string::npos;
  while (!eof_ && (chunk.bytes.size() < chunk_bytes_ || !newline)) {
    if (!newline && chunk.bytes.size() > max_line_bytes_) {  // one line, already too long
      skip_rest_of_line(chunk);
      return true;
    }
    const size_t old = chunk.bytes.size();
    const size_t want = std::max<size_t>(chunk_bytes_ - std::min(old, chunk_bytes_), 64 << 10);
    // A line longer than a chunk: make room up to the line limit at once, rather than letting the
    // string double its way there (each doubling copies, and the old buffers add to the peak).
    if (!newline && old >= chunk_bytes_ && old + want > chunk.bytes.capacity())
      chunk.bytes.reserve(std::max(max_line_bytes_, old) + want);
    chunk.bytes.resize(old + want);
    const size_t got = source_->read(chunk.bytes.data() + old, want);
    chunk.bytes.resize(old + got);
    bytes_read_ += int64_t(got);
    if (got == 0) eof_ = true;
    newline = newline || std::memchr(chunk.bytes.data() + old, '\n', got) != nullptr;
  }
  if (chunk.bytes.empty()) return false;
  // Everything after the last newline waits for the next chunk, unless the input has ended.
  size_t keep = chunk.bytes.size();
  if (!eof_) {
    keep = chunk.bytes.rfind('\n') + 1;
    carry_.assign(chunk.bytes, keep, std::string::npos);
    chunk.bytes.resize(keep);
  }
  size_t pos = 0;
  while (pos < keep) {
    size_t end = chunk.bytes.find('\n', pos);
    if (end == std::string::npos) end = keep;
    size_t stop = end;
    if (stop > pos && chunk.bytes[stop - 1] == '\r') --stop;  // CRLF files
    if (stop - pos > max_line_bytes_) {  // held (it came with its newline) but over the limit all the same
      chunk.overlong.push_back({chunk.lines.size(), int64_t(end - pos)});
      chunk.lines.emplace_back();
    } else {
      chunk.lines.emplace_back(chunk.bytes.data() + pos, stop - pos);
    }
    pos = end + 1;
  }
  ++next_index_;
  next_line_ += int64_t(chunk.lines.size());
  return true;
}

int64_t LineChunk::input_bytes() const {
  int64_t n = int64_t(bytes.size());
  if (bytes.empty())  // a skipped line: only its length is known (and its newline)
    for (const auto& [index, length] : overlong) n += length + 1;
  return n;
}

// `chunk.bytes` is the start of a line longer than max_line_bytes: read past its end without
// keeping it, and return it as one empty, overlong line. What follows its newline is carried.
void LineChunkReader::skip_rest_of_line(LineChunk& chunk) {
  int64_t length = int64_t(chunk.bytes.size());
  std::string buffer(64 << 10, '\0');
  while (!eof_) {
    const size_t got = source_->read(buffer.data(), buffer.size());
    bytes_read_ += int64_t(got);
    if (got == 0) {
      eof_ = true;
      break;
    }
    const void* found = std::memchr(buffer.data(), '\n', got);
    if (found) {
      const size_t end = size_t(static_cast<const char*>(found) - buffer.data());
      length += int64_t(end);
      carry_.assign(buffer.data() + end + 1, got - end - 1);
      break;
    }
    length += int64_t(got);
  }
  chunk.bytes.clear();
  chunk.bytes.shrink_to_fit();  // give the memory of the line's start back
  chunk.lines.assign(1, std::string_view());
  chunk.overlong.assign(1, {size_t(0), length});
  ++next_index_;
  ++next_line_;
}

// ---------------------------------------------------------------------------------------------
// Record parsing

struct RecordParser::Impl {
  simdjson::dom::parser parser;
  bool for_model_template = false;
};

RecordParser::RecordParser(bool for_model_template) : impl_(std::make_unique<Impl>()) {
  impl_->for_model_template = for_model_template;
}
RecordParser::~RecordParser() = default;
RecordParser::RecordParser(RecordParser&&) noexcept = default;
RecordParser& RecordParser::operator=(RecordParser&&) noexcept = default;

// ShareGPT speaker names to the roles the chat templates know.
std::string normalized_role(std::string_view role) {
  if (role == "human" || role == "user") return "user";
  if (role == "gpt" || role == "assistant" || role == "chatgpt" || role == "model" || role == "bing")
    return "assistant";
  if (role == "system") return "system";
  if (role == "tool" || role == "function" || role == "observation" || role == "ipython") return std::string(role);
  return {};
}

namespace {

using simdjson::dom::element;
using simdjson::dom::object;

// A string field: "" when present, else the reason. `optional` fields may be absent.
std::string string_field(const object& o, std::string_view key, std::string& out, bool optional = false) {
  element e;
  if (o.at_key(key).get(e) != simdjson::SUCCESS) {
    if (optional) {
      out.clear();
      return {};
    }
    return fmt::format("missing field '{}'", key);
  }
  std::string_view s;
  if (e.get_string().get(s) != simdjson::SUCCESS) return fmt::format("field '{}' is not a string", key);
  out.assign(s);
  return {};
}

bool has_key(const object& o, std::string_view key) {
  element e;
  return o.at_key(key).get(e) == simdjson::SUCCESS;
}

std::string parse_messages(const element& list, bool sharegpt, std::vector<ChatMessage>& out) {
  const char* field = sharegpt ? "conversations" : "messages";
  const char* role_key = sharegpt ? "from" : "role";
  const char* content_key = sharegpt ? "value" : "content";
  simdjson::dom::array array;
  if (list.get_array().get(array) != simdjson::SUCCESS) return fmt::format("field '{}' is not an array", field);
  size_t i = 0;
  for (element m : array) {
    object o;
    if (m.get_object().get(o) != simdjson::SUCCESS) return fmt::format("{}[{}] is not an object", field, i);
    std::string role, content;
    if (auto why = string_field(o, role_key, role); !why.empty()) return fmt::format("{}[{}]: {}", field, i, why);
    if (auto why = string_field(o, content_key, content); !why.empty()) return fmt::format("{}[{}]: {}", field, i, why);
    std::string normalized = normalized_role(role);
    if (normalized.empty()) return fmt::format("{}[{}]: unknown role '{}'", field, i, role);
    out.push_back({std::move(normalized), std::move(content)});
    ++i;
  }
  if (out.empty()) return fmt::format("field '{}' is empty", field);
  return {};
}

std::string parse_ids(const object& o, std::string_view key, std::vector<int32_t>& out, bool allow_ignore) {
  element e;
  if (o.at_key(key).get(e) != simdjson::SUCCESS) return fmt::format("missing field '{}'", key);
  simdjson::dom::array array;
  if (e.get_array().get(array) != simdjson::SUCCESS) return fmt::format("field '{}' is not an array", key);
  size_t i = 0;
  for (element v : array) {
    int64_t id;
    if (v.get_int64().get(id) != simdjson::SUCCESS) return fmt::format("{}[{}] is not an integer", key, i);
    if (!(id >= 0 && id <= INT32_MAX) && !(allow_ignore && id == -100))
      return fmt::format("{}[{}] = {} is out of range", key, i, id);
    out.push_back(int32_t(id));
    ++i;
  }
  return {};
}

}  // namespace

std::string RecordParser::parse(std::string_view line, Record& out) {
  out.clear();
  element doc;
  // realloc_if_needed: the line sits inside a larger buffer without simdjson's padding after it.
  const auto error = impl_->parser.parse(line.data(), line.size(), true).get(doc);
  if (error == simdjson::UTF8_ERROR) return "invalid UTF-8";
  if (error != simdjson::SUCCESS) return fmt::format("invalid JSON ({})", simdjson::error_message(error));
  object o;
  if (doc.get_object().get(o) != simdjson::SUCCESS) return "not a JSON object";

  element e;
  const bool messages = o.at_key("messages").get(e) == simdjson::SUCCESS;
  if (messages || o.at_key("conversations").get(e) == simdjson::SUCCESS) {
    out.kind = RecordKind::conversation;
    if (!impl_->for_model_template) return parse_messages(e, !messages, out.messages);
    try {
      return chat_input_from_record(doc, out.chat.emplace());
    } catch (const Error& x) {  // a value a template cannot be given (an integer beyond 64 bits)
      return x.what();
    }
  }
  if (has_key(o, "prompt") || has_key(o, "response")) {
    out.kind = RecordKind::conversation;
    std::string system, prompt, response;
    if (auto why = string_field(o, "system", system, true); !why.empty()) return why;
    if (auto why = string_field(o, "prompt", prompt); !why.empty()) return why;
    if (auto why = string_field(o, "response", response); !why.empty()) return why;
    if (!system.empty()) out.messages.push_back({"system", std::move(system)});
    out.messages.push_back({"user", std::move(prompt)});
    out.messages.push_back({"assistant", std::move(response)});
    return {};
  }
  if (has_key(o, "instruction") || has_key(o, "output")) {
    // Alpaca: the input, when given, follows the instruction after a blank line.
    out.kind = RecordKind::conversation;
    std::string system, instruction, input, output;
    if (auto why = string_field(o, "system", system, true); !why.empty()) return why;
    if (auto why = string_field(o, "instruction", instruction); !why.empty()) return why;
    if (auto why = string_field(o, "input", input, true); !why.empty()) return why;
    if (auto why = string_field(o, "output", output); !why.empty()) return why;
    if (!input.empty()) instruction += "\n\n" + input;
    if (!system.empty()) out.messages.push_back({"system", std::move(system)});
    out.messages.push_back({"user", std::move(instruction)});
    out.messages.push_back({"assistant", std::move(output)});
    return {};
  }
  if (has_key(o, "input_ids")) {
    out.kind = RecordKind::tokens;
    if (auto why = parse_ids(o, "input_ids", out.input_ids, false); !why.empty()) return why;
    if (has_key(o, "labels")) {
      if (auto why = parse_ids(o, "labels", out.labels, true); !why.empty()) return why;
      if (out.labels.size() != out.input_ids.size())
        return fmt::format("'labels' has {} entries but 'input_ids' has {}", out.labels.size(), out.input_ids.size());
    } else {
      out.labels = out.input_ids;
    }
    if (out.input_ids.empty()) return "field 'input_ids' is empty";
    return {};
  }
  if (has_key(o, "text")) {
    out.kind = RecordKind::text;
    if (auto why = string_field(o, "text", out.text); !why.empty()) return why;
    if (out.text.empty()) return "field 'text' is empty";
    return {};
  }
  return "no known fields (expected text, prompt/response, instruction/output, messages, conversations or input_ids)";
}

}  // namespace keel::data
