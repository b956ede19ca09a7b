#include "keel/data/token_records.h"

#include <fcntl.h>
#include <simdjson.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

#include "keel/core/error.h"
#include "keel/core/file_io.h"

namespace keel::data {
namespace {

constexpr int32_t kIgnore = -100;

// The longest line read as one record. A record of max_seq_len = 1048576 tokens (the recipe's
// limit) with labels is about 16 MiB of JSON; a longer line is a corrupt or hostile file, refused
// before the parser allocates for it.
constexpr size_t kMaxLineBytes = size_t(64) << 20;

// The file memory-mapped read-only: lines are parsed in place (each one copied into the parser's
// padded buffer), so a large file costs page cache, not a heap copy of the whole file.
class MappedText {
 public:
  explicit MappedText(const std::string& path) {
    int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
    require(fd >= 0, "{}: cannot open the data file ({})", path, std::strerror(errno));
    struct stat st {};
    if (::fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
      ::close(fd);
      fail("{}: expected a regular data file (JSONL)", path);
    }
    size_ = size_t(st.st_size);
    if (size_ > 0) {
      addr_ = ::mmap(nullptr, size_, PROT_READ, MAP_PRIVATE, fd, 0);
      const int error = errno;
      ::close(fd);
      if (addr_ == MAP_FAILED) {
        addr_ = nullptr;
        fail("{}: cannot memory-map the data file ({})", path, std::strerror(error));
      }
      ::madvise(addr_, size_, MADV_SEQUENTIAL);
    } else {
      ::close(fd);
    }
  }
  ~MappedText() {
    if (addr_) ::munmap(addr_, size_);
  }
  MappedText(const MappedText&) = delete;
  MappedText& operator=(const MappedText&) = delete;
  std::string_view text() const { return {static_cast<const char*>(addr_), size_}; }

 private:
  void* addr_ = nullptr;
  size_t size_ = 0;
};

void append_ids(simdjson::dom::element value, const char* field, const std::string& at, int64_t vocab,
                bool allow_ignore, std::vector<int32_t>& out) {
  simdjson::dom::array array;
  require(value.get_array().get(array) == simdjson::SUCCESS, "{}: field '{}' must be an array of integers", at, field);
  for (auto item : array) {
    int64_t v;
    require(item.get_int64().get(v) == simdjson::SUCCESS, "{}: field '{}' must contain only integers", at, field);
    require((v >= 0 && v < vocab) || (allow_ignore && v == kIgnore),
            "{}: field '{}' holds {}, outside the vocabulary [0, {}){}", at, field, v, vocab,
            allow_ignore ? " and not -100" : "");
    out.push_back(int32_t(v));
  }
}

}  // namespace

TokenRecords read_token_records(const std::string& path, int64_t vocab_size) {
  require(path_exists(path), "{}: the data file does not exist", path);
  const MappedText file(path);
  TokenRecords records;
  records.offsets.push_back(0);
  simdjson::dom::parser parser;
  const std::string_view all = file.text();
  size_t line_start = 0;
  for (int64_t line_no = 1; line_start < all.size(); ++line_no) {
    // Look for the end of the line no further than the limit: a 10 GB line is refused after
    // reading 64 MiB of it, not after scanning (or allocating) all of it.
    const size_t window = std::min(all.size() - line_start, kMaxLineBytes + 1);
    const void* newline = std::memchr(all.data() + line_start, '\n', window);
    const size_t end = newline ? size_t(static_cast<const char*>(newline) - all.data()) : line_start + window;
    require(end - line_start <= kMaxLineBytes,
            "{}:{}: line longer than {} MiB (expected one JSON record per line; a corrupt file, or a record far "
            "beyond max_seq_len)",
            path, line_no, kMaxLineBytes >> 20);
    std::string_view line = all.substr(line_start, end - line_start);
    line_start = end + 1;
    if (line.find_first_not_of(" \t\r") == std::string_view::npos) continue;
    const std::string at = fmt::format("{}:{}", path, line_no);
    simdjson::dom::element doc;
    auto err = parser.parse(line.data(), line.size()).get(doc);
    require(err == simdjson::SUCCESS, "{}: invalid JSON ({})", at, simdjson::error_message(err));
    simdjson::dom::object object;
    require(doc.get_object().get(object) == simdjson::SUCCESS, "{}: expected a JSON object per line", at);
    simdjson::dom::element ids, labels;
    require(object["input_ids"].get(ids) == simdjson::SUCCESS, "{}: missing field 'input_ids'", at);
    const size_t begin = records.input_ids.size();
    append_ids(ids, "input_ids", at, vocab_size, false, records.input_ids);
    const size_t n = records.input_ids.size() - begin;
    require(n > 0, "{}: field 'input_ids' is empty", at);
    if (object["labels"].get(labels) == simdjson::SUCCESS) {
      append_ids(labels, "labels", at, vocab_size, true, records.labels);
      require(records.labels.size() - begin == n, "{}: 'labels' has {} entries but 'input_ids' has {}", at,
              records.labels.size() - begin, n);
    } else {
      records.labels.insert(records.labels.end(), records.input_ids.begin() + begin, records.input_ids.end());
    }
    records.offsets.push_back(int64_t(records.input_ids.size()));
  }
  require(records.size() > 0, "{}: no records (expected JSONL lines with \"input_ids\")", path);
  return records;
}

}  // namespace keel::data
