// Raw training records (JSONL: text, prompt/response, Alpaca, messages, ShareGPT, input_ids):
// RecordParser::parse on every line of the input, and LineChunkReader over the input written to a
// tmpfs file (chunking must give back exactly the input's lines). A bad record must come back as a
// reason, never as an exception.
#include <fmt/format.h>

#include <string>
#include <vector>

#include "fuzz_support.h"
#include "keel/data/record_reader.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace keel;
  const std::string_view text(reinterpret_cast<const char*>(data), size);
  data::RecordParser parser;
  data::Record record;
  std::vector<std::string_view> lines;
  for (size_t start = 0; start < text.size();) {
    size_t end = text.find('\n', start);
    if (end == std::string_view::npos) end = text.size();
    lines.push_back(text.substr(start, end - start));
    start = end + 1;
  }
  for (std::string_view line : lines) {
    record.clear();
    const std::string why = parser.parse(line, record);
    if (!why.empty()) continue;
    if (record.kind == data::RecordKind::tokens && record.labels.size() != record.input_ids.size())
      fuzz::property_failed("a token record with labels of another length");
  }

  static const std::string path = fuzz::scratch_dir() + "/records.jsonl";
  fuzz::write_bytes(path, data, size);
  try {
    data::LineChunkReader reader(path, 4096);
    data::LineChunk chunk;
    size_t n = 0;
    int64_t expected_line = 1;
    while (reader.next(chunk)) {
      if (chunk.first_line != expected_line) fuzz::property_failed("chunks skip or repeat lines");
      for (std::string_view line : chunk.lines) {
        // Trailing CRs are compared loosely: the reader may take "\r\n" as the line end.
        std::string_view want = n < lines.size() ? lines[n] : std::string_view();
        while (!want.empty() && want.back() == '\r') want.remove_suffix(1);
        std::string_view got = line;
        while (!got.empty() && got.back() == '\r') got.remove_suffix(1);
        if (got != want) {
          auto shown = [](std::string_view v) {
            std::string out;
            for (unsigned char c : v)
              out += (c >= 0x20 && c < 0x7f) ? std::string(1, char(c)) : fmt::format("\\x{:02x}", c);
            return out;
          };
          fuzz::property_failed("LineChunkReader changes a line",
                                fmt::format("line {}: read '{}', expected '{}'", n + 1, shown(got), shown(want)));
        }
        ++n;
      }
      expected_line += int64_t(chunk.lines.size());
    }
  } catch (const Error&) {}
  return 0;
}
