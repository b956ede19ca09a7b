// The manifest of a sharded checkpoint (docs/checkpoints.md): which piece of which tensor lies where.
//
//   step-00000200/
//     shard-00000-of-00004.bin   rank 0's pieces: raw little-endian fp32, one after another
//     ...                        (PyTorch DCP's __0_0.distcp, DeepSpeed's zero_pp_rank_0_*)
//     trainer_state.json, recipe.toml
//     manifest.json              every piece: tensor, kind (weights, m, v), element range in the
//                                whole tensor, shard file, byte offset, XXH3 (written last, by rank 0)
//
// A piece is a contiguous run of elements of one tensor (row-major, flattened) held by one rank.
// The manifest says where each whole tensor's elements are, so a reader of any world size and ZeRO
// stage reads only the pieces overlapping what it holds, and every piece it reads is checked
// against its own checksum (a corrupt byte names its piece, not a 30 GB file).
#pragma once
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

namespace keel::checkpoint {

enum class PieceKind : uint8_t { Weights, M, V };  // fp32 masters, AdamW first and second moments
std::string_view piece_kind_name(PieceKind kind);  // "weights", "m", "v"
// The tensor name the single-file layout gives it: "<name>", "m.<name>", "v.<name>".
std::string piece_tensor_name(PieceKind kind, const std::string& tensor);

struct Piece {
  std::string tensor;  // keel's internal tensor name
  PieceKind kind = PieceKind::Weights;
  int64_t begin = 0, end = 0;  // elements [begin, end) of the flattened tensor
  int shard = 0;               // index into ShardedManifest::shards
  int64_t offset = 0;          // byte offset in that shard file
  uint64_t xxh3 = 0;           // of the piece's end - begin fp32 values as stored
  int64_t bytes() const { return 4 * (end - begin); }
  // "m.layers.3.qkv.weight[4096:8192] in shard-00001-of-00002.bin at byte 1234" for messages.
  std::string describe(const std::string& file) const;
};

struct ShardFile {
  std::string name;  // relative to the step directory
  int64_t size = 0;  // bytes
};

struct FileChecksum {
  std::string name;
  int64_t size = 0;
  uint64_t xxh3 = 0;
};

struct TensorShape {
  std::string name;
  std::vector<int64_t> shape;
  int64_t numel() const;
};

struct ShardedManifest {
  int64_t step = 0;
  int world_size = 1, zero_stage = 0;  // of the run that wrote it (informational: any may read it)
  std::vector<TensorShape> tensors;    // every tensor the pieces cover, in layout order
  std::vector<FileChecksum> files;     // trainer_state.json, recipe.toml
  std::vector<ShardFile> shards;       // one per rank
  std::vector<Piece> pieces;
};

// The file name of rank `rank`'s pieces among `ranks`.
std::string shard_file_name(int rank, int ranks);

std::string sharded_manifest_json(const ShardedManifest& m);
// Parses and checks what can be checked without the files: kinds, ranges inside their tensor,
// shard indices, pieces inside their file and not overlapping there. Errors name `path`.
ShardedManifest parse_sharded_manifest(std::string_view text, const std::string& path);
// Whether manifest text is a sharded one ("layout": "sharded"), without parsing it all.
bool is_sharded_manifest(std::string_view text);

// One rank's report to rank 0 (its pieces, fsynced): the same piece records, for its shard only.
std::string shard_report_json(const ShardFile& file, const std::vector<Piece>& pieces);
void parse_shard_report(std::string_view text, const std::string& path, ShardFile* file, std::vector<Piece>* pieces);

}  // namespace keel::checkpoint
