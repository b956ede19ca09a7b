#include "keel/distributed/shard_reader.h"

#include <algorithm>
#include <tuple>

#include "keel/core/error.h"

namespace keel::distributed {

ShardReader::ShardReader(Communicator& comm, const std::vector<FlatRange>& shards, std::vector<const float*> local)
    : comm_(comm), shards_(shards), local_(std::move(local)) {
  require(shards_.size() >= 1 && shards_[0].begin == 0, "ShardReader: expected the ranks' shards, rank 0's first");
  next_ = next_of(PieceId{0, 1, -1});
  for (size_t r = 1; r < shards_.size(); ++r)
    largest_piece_ = std::max(largest_piece_, std::min(kMessagePiece, shards_[r].size()));
}

int64_t ShardReader::pieces_of(int rank) const {
  if (rank >= int(shards_.size())) return 0;
  return (shards_[size_t(rank)].size() + kMessagePiece - 1) / kMessagePiece;
}

ShardReader::PieceId ShardReader::next_of(PieceId p) const {
  for (++p.index; !done(p) && p.index >= pieces_of(p.rank);) {
    p.index = 0;
    if (++p.rank >= int(shards_.size())) {
      p.rank = 1;
      ++p.stream;
    }
  }
  return p;
}

bool ShardReader::before(const PieceId& a, const PieceId& b) const {
  return std::tie(a.stream, a.rank, a.index) < std::tie(b.stream, b.rank, b.index);
}

void ShardReader::receive_next() {
  const FlatRange shard = shards_[size_t(next_.rank)];
  const int64_t count = std::min(kMessagePiece, shard.size() - next_.index * kMessagePiece);
  buffer_.resize(size_t(largest_piece_));  // allocated at the first piece, then kept
  comm_.receive_piece(next_.rank, buffer_.data(), count);
  held_ = next_;
  next_ = next_of(next_);
}

const float* ShardReader::read(int stream, int64_t begin, int64_t max_count, int64_t* n) {
  require(stream >= 0 && stream < int(local_.size()) && begin >= 0 && begin < shards_.back().end && max_count > 0,
          "ShardReader: read of stream {} at {} is outside the shards", stream, begin);
  int rank = 0;
  while (!shards_[size_t(rank)].contains(begin)) ++rank;
  const FlatRange shard = shards_[size_t(rank)];
  if (rank == 0) {
    *n = std::min(max_count, shard.end - begin);
    return local_[size_t(stream)] + begin;
  }
  const PieceId want{stream, rank, (begin - shard.begin) / kMessagePiece};
  if (!(held_ == want)) {
    require(!before(want, next_), "ShardReader: read of stream {} at {} goes back to a piece already received", stream,
            begin);
    while (!(held_ == want)) receive_next();
  }
  const int64_t piece_begin = shard.begin + want.index * kMessagePiece;
  const int64_t piece_end = std::min(shard.end, piece_begin + kMessagePiece);
  *n = std::min(max_count, piece_end - begin);
  return buffer_.data() + (begin - piece_begin);
}

void ShardReader::read_all(int stream, float* out) {
  require(held_.stream < 0 && (done(next_) || next_.stream == stream),
          "ShardReader: read_all of stream {} out of order", stream);
  std::copy_n(local_[size_t(stream)], shards_[0].size(), out);
  for (; !done(next_) && next_.stream == stream; next_ = next_of(next_)) {
    const FlatRange shard = shards_[size_t(next_.rank)];
    const int64_t begin = shard.begin + next_.index * kMessagePiece;
    comm_.receive_piece(next_.rank, out + begin, std::min(kMessagePiece, shard.end - begin));
  }
}

ShardReader::~ShardReader() {
  try {
    drain();
  } catch (const std::exception&) {
    // Only reached while unwinding from the write's own error (a completed write drained
    // explicitly, which reports a failing communicator): that error is the one to report.
  }
}

void ShardReader::drain() {
  while (!done(next_)) receive_next();
}

}  // namespace keel::distributed
