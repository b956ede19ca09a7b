// Commands that turn JSONL on stdin into JSONL on stdout (tokenize, detokenize, chat-template):
// stdin read in batches of whole lines, each batch cut into one block per thread, the blocks'
// outputs written in input order, so the output never depends on the thread count.
#pragma once
#include <omp.h>

#include <algorithm>
#include <charconv>
#include <cstdint>
#include <cstdio>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "keel/core/error.h"
#include "keel/data/tokenizer.h"

namespace keel::cli {

inline constexpr size_t kBatchBytes = size_t(8) << 20;

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

inline void append_ids_json(std::string& out, const std::vector<int32_t>& ids) {
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
inline std::string valid_utf8(std::string_view bytes) {
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

}  // namespace keel::cli
