#include "keel/checkpoint/sharded_writer.h"

#include <fcntl.h>
#include <fmt/format.h>
#include <unistd.h>

#include <chrono>
#include <cerrno>
#include <cstring>
#include <system_error>
#include <filesystem>
#include <utility>

#include "keel/checkpoint/checkpoint_files.h"
#include "keel/core/checksum.h"
#include "keel/core/error.h"
#include "keel/core/file_io.h"

namespace keel::checkpoint {
namespace {

namespace fs = std::filesystem;
using Clock = std::chrono::steady_clock;

// Where piece p's values live in this rank's memory.
const float* source_of(const Piece& p, const model::Param& param, const HeldState& s) {
  const int64_t flat = param.offset + p.begin;
  switch (p.kind) {
    case PieceKind::Weights: return s.masters + (flat - s.master_range.begin);
    case PieceKind::M: return s.m + (flat - s.optimizer_range.begin);
    case PieceKind::V: return s.v + (flat - s.optimizer_range.begin);
  }
  return nullptr;
}

int64_t bytes_of(const std::vector<Piece>& pieces) {
  int64_t n = 0;
  for (const auto& p : pieces) n += p.bytes();
  return n;
}

// A file of a step directory that is not yet published: written in place and fsynced, without the
// temporary name and rename of write_file_atomic (the directory itself is renamed into place, after
// rank 0 fsyncs it: publish_checkpoint), which saves each rank two of its four fsyncs per save.
class DurableFile {
 public:
  explicit DurableFile(std::string path) : path_(std::move(path)) {
    fd_ = ::open(path_.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    require(fd_ >= 0, "{}: cannot create: {}", path_, std::system_category().message(errno));
  }
  ~DurableFile() {
    if (fd_ >= 0) ::close(fd_);
  }
  DurableFile(const DurableFile&) = delete;
  DurableFile& operator=(const DurableFile&) = delete;
  void write(const void* data, size_t size) {
    const char* p = static_cast<const char*>(data);
    while (size > 0) {
      const ssize_t n = ::write(fd_, p, size);
      if (n < 0 && errno == EINTR) continue;
      require(n > 0, "{}: cannot write: {}", path_, std::system_category().message(n < 0 ? errno : EIO));
      p += n;
      size -= size_t(n);
    }
  }
  void sync_and_close() {
    require(::fsync(fd_) == 0, "{}: cannot sync: {}", path_, std::system_category().message(errno));
    const int rc = ::close(fd_);
    fd_ = -1;
    require(rc == 0, "{}: cannot close: {}", path_, std::system_category().message(errno));
  }

 private:
  std::string path_;
  int fd_ = -1;
};

void write_durable(const std::string& path, std::string_view text) {
  DurableFile f(path);
  f.write(text.data(), text.size());
  f.sync_and_close();
}

std::string report_name(int rank, int ranks) {
  std::string name = shard_file_name(rank, ranks);
  return name.substr(0, name.size() - 4) + ".json";
}

}  // namespace

std::vector<Piece> plan_pieces(const std::vector<model::Param>& layout, FlatRange window, int shard,
                               int64_t max_piece) {
  std::vector<Piece> out;
  int64_t offset = 0;
  for (PieceKind kind : {PieceKind::Weights, PieceKind::M, PieceKind::V})
    for (const auto& p : layout) {
      const FlatRange part = FlatRange{p.offset, p.offset + p.numel}.intersect(window);
      for (int64_t begin = part.begin; begin < part.end; begin += max_piece) {
        Piece piece;
        piece.tensor = p.name;
        piece.kind = kind;
        piece.begin = begin - p.offset;
        piece.end = std::min(part.end, begin + max_piece) - p.offset;
        piece.shard = shard;
        piece.offset = offset;
        offset += piece.bytes();
        out.push_back(std::move(piece));
      }
    }
  return out;
}

std::string sharded_step_tmp(const std::string& checkpoint_dir, int64_t step) {
  return fmt::format("{}/.tmp-{}-sharded", checkpoint_dir, step_name(step));
}

ShardWriter::ShardWriter(bool async, int64_t staging_bytes) : async_(async), staging_limit_(async ? staging_bytes : 0) {
  if (async_) worker_ = std::make_unique<WorkerThread>();
}

ShardWriter::~ShardWriter() = default;  // worker_ first: the write in flight finishes

void ShardWriter::prepare(const std::vector<model::Param>& layout, FlatRange window) {
  if (!async_) return;
  // The window's weights, m and v (alignment gaps included: the figure keel plan counts exactly).
  const int64_t bytes = std::min(staging_limit_, 3 * int64_t(sizeof(float)) * window.size());
  std::lock_guard<std::mutex> lock(mutex_);
  staging_.assign(size_t(bytes / int64_t(sizeof(float))), 0.0f);
}

// The file is the pieces one after another. The last `staging` bytes are copied aside first and
// every checksum taken from the live state; the head is written from the live state; then the state
// is released and the tail written from the copy. Synchronous saves have no staging: all of it is
// written from the live state.
void ShardWriter::write_now(const std::string& step_tmp, int rank, int ranks, const std::vector<model::Param>& layout,
                            FlatRange window, const HeldState& state, bool staged) {
  auto release = [&] {
    if (!staged) return;
    std::lock_guard<std::mutex> lock(mutex_);
    released_ = true;
    cv_.notify_all();
  };
  const std::string file = shard_file_name(rank, ranks);
  const std::string path = step_tmp + "/" + file;
  std::vector<Piece> pieces = plan_pieces(layout, window, rank);
  std::vector<const model::Param*> param_of;
  {
    size_t i = 0;
    for (const auto& p : pieces) {
      while (layout[i].name != p.tensor) i = (i + 1) % layout.size();
      param_of.push_back(&layout[i]);
    }
  }
  const int64_t total = bytes_of(pieces);
  const int64_t tail = staged ? std::min<int64_t>(total, int64_t(staging_.size() * sizeof(float))) : 0;
  const int64_t head = total - tail;
  char* stage = reinterpret_cast<char*>(staging_.data());
  try {
    make_dirs(step_tmp);
    DurableFile out(path);
    for (size_t i = 0; i < pieces.size(); ++i) {
      Piece& p = pieces[i];
      const char* src = reinterpret_cast<const char*>(source_of(p, *param_of[i], state));
      p.xxh3 = checksum(src, size_t(p.bytes()));
      // The part of this piece past the head goes to the staging buffer, the rest to the file.
      const int64_t first_tail = std::max(p.offset, head);
      if (first_tail < p.offset + p.bytes())
        std::memcpy(stage + (first_tail - head), src + (first_tail - p.offset), size_t(p.offset + p.bytes() - first_tail));
      if (p.offset < head) {
        try {
          out.write(src, size_t(std::min(p.offset + p.bytes(), head) - p.offset));
        } catch (const Error& e) {
          fail("rank {}: writing {}: {}", rank, p.describe(file), e.what());
        }
      }
    }
    release();
    if (tail > 0) {
      try {
        out.write(stage, size_t(tail));
      } catch (const Error& e) {
        fail("rank {}: writing the last {} bytes of {} (staged): {}", rank, tail, file, e.what());
      }
    }
    out.sync_and_close();
    write_durable(step_tmp + "/" + report_name(rank, ranks), shard_report_json({file, total}, pieces));
  } catch (...) {
    release();
    throw;
  }
}

void ShardWriter::write(const std::string& step_tmp, int rank, int ranks, const std::vector<model::Param>& layout,
                        FlatRange window, const HeldState& state) {
  if (!async_) {
    write_now(step_tmp, rank, ranks, layout, window, state, false);
    return;
  }
  require(worker_->idle(), "checkpoint {}: a shard write is still in flight", step_tmp);
  if (staging_.empty()) prepare(layout, window);  // unless prepare() did it
  {
    std::lock_guard<std::mutex> lock(mutex_);
    released_ = false;
    failure_.clear();
  }
  worker_->run([this, step_tmp, rank, ranks, &layout, window, state] {
    std::string error;
    try {
      write_now(step_tmp, rank, ranks, layout, window, state, true);
    } catch (const std::exception& e) {
      error = e.what();
    }
    std::lock_guard<std::mutex> lock(mutex_);
    failure_ = error;
    released_ = true;
    cv_.notify_all();
  });
}

double ShardWriter::wait_released() {
  const auto t0 = Clock::now();
  std::unique_lock<std::mutex> lock(mutex_);
  if (released_) return 0.0;
  cv_.wait(lock, [this] { return released_; });
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

bool ShardWriter::finished() { return !worker_ || worker_->idle(); }

std::string ShardWriter::wait() {
  if (worker_) worker_->wait();
  std::lock_guard<std::mutex> lock(mutex_);
  return std::exchange(failure_, {});
}

void commit_sharded_checkpoint(const std::string& checkpoint_dir, const std::string& step_tmp,
                               const std::vector<FlatRange>& windows, int zero_stage,
                               const std::vector<model::Param>& layout, const TrainingState& state,
                               const std::string& recipe, int64_t keep_last_n) {
  const int ranks = int(windows.size());
  ShardedManifest m;
  m.step = state.step;
  m.world_size = ranks;
  m.zero_stage = zero_stage;
  for (const auto& p : layout) m.tensors.push_back({p.name, p.shape});
  for (int rank = 0; rank < ranks; ++rank) {
    const std::string report = step_tmp + "/" + report_name(rank, ranks);
    ShardFile file;
    std::vector<Piece> pieces;
    parse_shard_report(read_file(report), report, &file, &pieces);
    const std::vector<Piece> expected = plan_pieces(layout, windows[size_t(rank)], rank);
    require(file.name == shard_file_name(rank, ranks) && file.size == bytes_of(expected) &&
                pieces.size() == expected.size(),
            "{}: rank {} reports {} pieces in {} ({} bytes), expected {} pieces in {} ({} bytes)", report, rank,
            pieces.size(), file.name, file.size, expected.size(), shard_file_name(rank, ranks), bytes_of(expected));
    for (size_t i = 0; i < pieces.size(); ++i) {
      const Piece &p = pieces[i], &e = expected[i];
      require(p.tensor == e.tensor && p.kind == e.kind && p.begin == e.begin && p.end == e.end && p.offset == e.offset,
              "{}: rank {}'s piece {} is {}, expected {}", report, rank, i, p.describe(file.name),
              e.describe(file.name));
    }
    const std::string data = step_tmp + "/" + file.name;
    std::error_code ec;
    require(int64_t(fs::file_size(data, ec)) == file.size && !ec, "{}: expected {} bytes as its rank reported", data,
            file.size);
    m.shards.push_back(file);
    for (auto& p : pieces) {
      p.shard = rank;
      m.pieces.push_back(std::move(p));
    }
  }
  const std::string state_text = state_json(state);
  write_durable(step_tmp + "/trainer_state.json", state_text);
  write_durable(step_tmp + "/recipe.toml", recipe);
  m.files.push_back({"trainer_state.json", int64_t(state_text.size()), checksum(state_text)});
  m.files.push_back({"recipe.toml", int64_t(recipe.size()), checksum(recipe)});
  write_durable(step_tmp + "/manifest.json", sharded_manifest_json(m));
  // The reports said what the manifest now says: nothing else reads them.
  for (int rank = 0; rank < ranks; ++rank) fs::remove(step_tmp + "/" + report_name(rank, ranks));
  try {
    publish_checkpoint(checkpoint_dir, step_tmp, step_name(state.step), keep_last_n);
  } catch (const fs::filesystem_error& e) {
    fail("checkpoint {}: {}", checkpoint_dir + "/" + step_name(state.step), e.what());
  }
}

}  // namespace keel::checkpoint
