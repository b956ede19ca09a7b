#include "keel/checkpoint/sharded_reader.h"

#include <fcntl.h>
#include <fmt/format.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <map>

#include "keel/core/checksum.h"
#include "keel/core/error.h"
#include "keel/core/file_io.h"

namespace keel::checkpoint {
namespace {
namespace fs = std::filesystem;
}

ShardedCheckpoint::ShardedCheckpoint(std::string step_dir) : dir_(std::move(step_dir)) {
  const std::string manifest_path = dir_ + "/manifest.json";
  manifest_ = parse_sharded_manifest(read_file(manifest_path), manifest_path);
  for (const char* name : {"trainer_state.json", "recipe.toml"}) {
    const auto it = std::find_if(manifest_.files.begin(), manifest_.files.end(),
                                 [&](const FileChecksum& f) { return f.name == name; });
    require(it != manifest_.files.end(), "{}: file '{}' is not listed", manifest_path, name);
  }
  for (const auto& f : manifest_.files) {
    const std::string path = dir_ + "/" + f.name;
    require(path_exists(path), "{}: file '{}' is missing", dir_, f.name);
    const std::string bytes = read_file(path);
    require(int64_t(bytes.size()) == f.size, "{}: size {} differs from the manifest's {} (truncated?)", path,
            bytes.size(), f.size);
    require(checksum(bytes) == f.xxh3, "{}: checksum {} differs from the manifest's {} (the file is corrupt)", path,
            checksum_hex(checksum(bytes)), checksum_hex(f.xxh3));
  }
  for (const auto& s : manifest_.shards) {
    const std::string path = dir_ + "/" + s.name;
    std::error_code ec;
    const auto size = fs::file_size(path, ec);
    require(!ec, "{}: shard file '{}' is missing", dir_, s.name);
    require(int64_t(size) == s.size, "{}: size {} differs from the manifest's {} (truncated?)", path, size, s.size);
  }
  fds_.assign(manifest_.shards.size(), -1);
}

ShardedCheckpoint::~ShardedCheckpoint() {
  for (int fd : fds_)
    if (fd >= 0) ::close(fd);
}

int ShardedCheckpoint::fd_of(int shard) {
  int& fd = fds_[size_t(shard)];
  if (fd < 0) {
    const std::string path = dir_ + "/" + manifest_.shards[size_t(shard)].name;
    fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
    require(fd >= 0, "{}: cannot open: {}", path, std::strerror(errno));
  }
  return fd;
}

const float* ShardedCheckpoint::load_piece(size_t i) {
  const Piece& p = manifest_.pieces[i];
  const std::string& file = manifest_.shards[size_t(p.shard)].name;
  if (scratch_.size() < size_t(p.end - p.begin)) scratch_.resize(size_t(p.end - p.begin));
  char* out = reinterpret_cast<char*>(scratch_.data());
  const int fd = fd_of(p.shard);
  for (int64_t done = 0; done < p.bytes();) {
    const ssize_t n = ::pread(fd, out + done, size_t(p.bytes() - done), p.offset + done);
    if (n < 0 && errno == EINTR) continue;
    require(n > 0, "{}/{}: cannot read {}: {}", dir_, file, p.describe(file),
            n == 0 ? std::string("the file ends early") : std::string(std::strerror(errno)));
    done += n;
  }
  const uint64_t actual = checksum(out, size_t(p.bytes()));
  require(actual == p.xxh3, "{}/{}: {}: checksum {} differs from the manifest's {} (the piece is corrupt)", dir_, file,
          p.describe(file), checksum_hex(actual), checksum_hex(p.xxh3));
  return scratch_.data();
}

void ShardedCheckpoint::read(const std::vector<model::Param>& layout, PieceKind kind, float* base, FlatRange window) {
  std::map<std::string, std::vector<size_t>> pieces_of;  // of `kind`, by tensor
  for (size_t i = 0; i < manifest_.pieces.size(); ++i)
    if (manifest_.pieces[i].kind == kind) pieces_of[manifest_.pieces[i].tensor].push_back(i);
  std::map<std::string, const TensorShape*> shapes;
  for (const auto& t : manifest_.tensors) shapes[t.name] = &t;
  for (const auto& param : layout) {
    const FlatRange part = FlatRange{param.offset, param.offset + param.numel}.intersect(window);
    if (part.size() <= 0) continue;
    const std::string name = piece_tensor_name(kind, param.name);
    const auto shape = shapes.find(param.name);
    require(shape != shapes.end(), "{}: tensor '{}' is missing (the manifest does not list it)", dir_, name);
    require(shape->second->shape == param.shape, "{}: tensor '{}' has shape [{}], expected [{}]", dir_, name,
            fmt::join(shape->second->shape, ", "), fmt::join(param.shape, ", "));
    // The tensor's elements this reader needs, [need.begin, need.end), covered piece by piece.
    const FlatRange need{part.begin - param.offset, part.end - param.offset};
    std::vector<size_t>& list = pieces_of[param.name];
    std::sort(list.begin(), list.end(),
              [&](size_t a, size_t b) { return manifest_.pieces[a].begin < manifest_.pieces[b].begin; });
    int64_t covered = need.begin;
    for (size_t i : list) {
      const Piece& p = manifest_.pieces[i];
      const FlatRange overlap = FlatRange{p.begin, p.end}.intersect(need);
      if (overlap.size() <= 0) continue;
      require(overlap.begin <= covered, "{}: tensor '{}' elements [{}, {}) are in no piece (a piece is missing)", dir_,
              name, covered, overlap.begin);
      const float* values = load_piece(i);
      std::memcpy(base + (param.offset + overlap.begin - window.begin), values + (overlap.begin - p.begin),
                  sizeof(float) * size_t(overlap.size()));
      covered = std::max(covered, overlap.end);
    }
    require(covered >= need.end, "{}: tensor '{}' elements [{}, {}) are in no piece (a piece is missing)", dir_, name,
            covered, need.end);
  }
}

void ShardedCheckpoint::read_tensor(const std::string& tensor, PieceKind kind, int64_t begin, int64_t n, float* out) {
  const auto shape = std::find_if(manifest_.tensors.begin(), manifest_.tensors.end(),
                                  [&](const TensorShape& t) { return t.name == tensor; });
  require(shape != manifest_.tensors.end(), "{}: tensor '{}' is missing (the manifest does not list it)", dir_,
          piece_tensor_name(kind, tensor));
  model::Param param;
  param.name = tensor;
  param.shape = shape->shape;
  param.offset = 0;
  param.numel = shape->numel();
  read({param}, kind, out - begin, FlatRange{begin, begin + n});
}

void ShardedCheckpoint::verify_all() {
  for (size_t i = 0; i < manifest_.pieces.size(); ++i) load_piece(i);
  // Every element of every tensor in some piece, for each kind.
  std::vector<model::Param> layout;
  for (const auto& t : manifest_.tensors) {
    model::Param p;
    p.name = t.name;
    p.shape = t.shape;
    p.numel = t.numel();
    layout.push_back(p);
  }
  for (PieceKind kind : {PieceKind::Weights, PieceKind::M, PieceKind::V}) {
    std::map<std::string, std::vector<std::pair<int64_t, int64_t>>> ranges;
    for (const auto& p : manifest_.pieces)
      if (p.kind == kind) ranges[p.tensor].push_back({p.begin, p.end});
    for (const auto& param : layout) {
      auto& list = ranges[param.name];
      std::sort(list.begin(), list.end());
      int64_t covered = 0;
      for (const auto& [b, e] : list) {
        require(b <= covered, "{}: tensor '{}' elements [{}, {}) are in no piece (a piece is missing)", dir_,
                piece_tensor_name(kind, param.name), covered, b);
        covered = std::max(covered, e);
      }
      require(covered >= param.numel, "{}: tensor '{}' elements [{}, {}) are in no piece (a piece is missing)", dir_,
              piece_tensor_name(kind, param.name), covered, param.numel);
    }
  }
}

}  // namespace keel::checkpoint
