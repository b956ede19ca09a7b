// Rank 0's side of a ZeRO-1 checkpoint. Every rank owns one shard of the flat optimizer state (the
// Adam moments m and v, "streams" 0 and 1); a checkpoint needs them whole, in one file, without
// rank 0 ever holding the whole of them: the other ranks send their shards with
// Communicator::send_to_root (m, then v, in kMessagePiece messages), and rank 0 reads the streams
// front to back, receiving each piece when it first needs it into one piece-sized buffer.
//
// Pieces arrive in one fixed order: stream by stream, and within a stream rank by rank (1, 2, ...),
// each rank's pieces in order; a read that skips pieces (alignment padding between tensors)
// receives and drops them. drain() receives what was never read, so that every sender completes
// even when the write failed midway; the destructor drains too, so a reader that goes out of scope
// (a write that threw) never leaves the other ranks blocked in send_to_root.
#pragma once
#include <cstdint>
#include <vector>

#include "keel/core/flat_range.h"
#include "keel/distributed/communicator.h"

namespace keel::distributed {

class ShardReader {
 public:
  // `shards`: one range of the flat buffer per rank (rank 0's first); `local[s]`: rank 0's own
  // shard of stream s (shards[0].size() floats).
  ShardReader(Communicator& comm, const std::vector<FlatRange>& shards, std::vector<const float*> local);
  ~ShardReader();

  // Elements [begin, begin + *n) of stream `stream`, 0 < *n <= max_count, valid until the next call.
  // Reads must not go back: (stream, begin) only increases from one call to the next.
  const float* read(int stream, int64_t begin, int64_t max_count, int64_t* n);

  // The whole of stream `stream` into out[0, total): pieces are received straight into place.
  // Only in order: stream 0, then 1, before any read().
  void read_all(int stream, float* out);

  // Receives every piece not read yet (the destructor calls it; calling it again does nothing).
  void drain();

 private:
  struct PieceId {
    int stream = 0, rank = 1;
    int64_t index = 0;  // the index-th kMessagePiece of that rank's shard
    bool operator==(const PieceId&) const = default;
  };
  bool done(const PieceId& p) const { return p.stream >= int(local_.size()); }
  bool before(const PieceId& a, const PieceId& b) const;
  int64_t pieces_of(int rank) const;
  PieceId next_of(PieceId p) const;  // the piece after p in arrival order (skips empty shards)
  void receive_next();               // the piece at next_ into buffer_

  Communicator& comm_;
  const std::vector<FlatRange>& shards_;
  std::vector<const float*> local_;
  std::vector<float> buffer_;  // the last received piece
  int64_t largest_piece_ = 0;
  PieceId held_{-1, 0, 0};  // which piece buffer_ holds
  PieceId next_;            // the next piece to arrive
};

}  // namespace keel::distributed
