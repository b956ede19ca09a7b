// Reading a sharded checkpoint (sharded_manifest.h) into any layout of ranks: each reader asks for
// the part of the flat parameter buffer it holds (its ZeRO shard, or all of it) and reads only the
// pieces that overlap it, each checked against its checksum before a value of it is used.
#pragma once
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "keel/checkpoint/sharded_manifest.h"
#include "keel/core/flat_range.h"
#include "keel/model/params.h"

namespace keel::checkpoint {

class ShardedCheckpoint {
 public:
  // Reads and parses step_dir/manifest.json, checks trainer_state.json and recipe.toml against their
  // checksums and every shard file against its size (a truncated file is named before any read).
  explicit ShardedCheckpoint(std::string step_dir);
  ~ShardedCheckpoint();
  const ShardedManifest& manifest() const { return manifest_; }

  // Elements `window` of the flat buffer laid out as `layout`, of `kind`, into base (which holds
  // that window). The tensors must be the manifest's with the same shapes, and the pieces must
  // cover every element asked for; errors name the tensor, the piece and the file.
  void read(const std::vector<model::Param>& layout, PieceKind kind, float* base, FlatRange window);
  // Elements [begin, begin + n) of one tensor's values of `kind` (keel export, a tensor at a time).
  void read_tensor(const std::string& tensor, PieceKind kind, int64_t begin, int64_t n, float* out);
  // Every piece against its checksum (verify_checkpoint: keel export, --resume auto's fallback).
  void verify_all();

 private:
  // Piece i's values, read and checked (into scratch_).
  const float* load_piece(size_t i);
  int fd_of(int shard);
  std::string dir_;
  ShardedManifest manifest_;
  std::vector<int> fds_;
  std::vector<float> scratch_;
};

}  // namespace keel::checkpoint
