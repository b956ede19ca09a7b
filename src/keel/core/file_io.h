// Files written atomically (temporary file in the same directory, fsync, rename, fsync of the
// directory) so a killed process leaves either the old file or the new one, never a torn one.
#pragma once
#include <cstddef>
#include <cstdint>
#include <functional>
#include <string>
#include <string_view>

namespace keel {

void write_file_atomic(const std::string& path, std::string_view contents);
// Files read whole are configuration and metadata (config.json, recipes, manifests, tokenizer
// files, index files), never datasets or weights: a file over `max_bytes` is a keel::Error naming
// it, raised before anything is allocated, so a hostile or mistaken path cannot make keel reserve
// gigabytes. Parsers of small formats pass a tighter limit.
inline constexpr size_t kMaxReadFileBytes = size_t(1) << 30;
std::string read_file(const std::string& path,
                      size_t max_bytes = kMaxReadFileBytes);  // keel::Error naming the path on failure
// Streams a text file line by line without holding it: fn(line, complete) for each line, where
// `complete` is false for a last line without its newline (a write cut short). A line longer than
// max_line_bytes is skipped (counted in the return value) rather than held. For files that grow
// without bound over a run (metrics.jsonl). keel::Error naming the path when it cannot be read.
int64_t for_each_line(const std::string& path, size_t max_line_bytes,
                      const std::function<void(std::string_view line, bool complete)>& fn);
bool path_exists(const std::string& path);
void make_dirs(const std::string& path);  // mkdir -p; keel::Error on failure

// The streaming form of write_file_atomic, for files too large to assemble in memory first
// (checkpoints, safetensors): bytes go to ".<name>.tmp.<pid>" next to `path`, and commit()
// fsyncs it, renames it over `path` and fsyncs the directory. Destroyed without commit()
// (an exception on the way), the temporary file is removed and `path` is untouched.
class AtomicFileWriter {
 public:
  explicit AtomicFileWriter(std::string path);
  ~AtomicFileWriter();
  AtomicFileWriter(const AtomicFileWriter&) = delete;
  AtomicFileWriter& operator=(const AtomicFileWriter&) = delete;

  void write(const void* data, size_t size);
  void write(std::string_view bytes) { write(bytes.data(), bytes.size()); }
  void commit();
  const std::string& path() const { return path_; }

 private:
  std::string path_;
  std::string tmp_path_;
  int fd_ = -1;
  bool committed_ = false;
};

}  // namespace keel
