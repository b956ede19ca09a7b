// ShardReader (rank 0's side of a ZeRO-1 checkpoint) against a fake communicator that plays the
// other ranks: each sends its shards of m, then of v, in kMessagePiece messages, exactly as
// Communicator::send_to_root does. Reads must see the right values, take the pieces in the one
// order the senders use, and leave nothing unreceived after drain().
#include "keel/distributed/shard_reader.h"

#include <gtest/gtest.h>

#include <deque>
#include <map>

#include "fake_communicator.h"
#include "keel/core/error.h"

namespace keel::distributed {
namespace {

float value(int stream, int64_t i) { return float(i % 65521) + (stream == 0 ? 0.25f : 0.75f); }

// The other ranks' sends, queued per rank in their send order, checked message by message.
class SendingRanks final : public FakeCommunicator {
 public:
  explicit SendingRanks(const std::vector<FlatRange>& shards) : FakeCommunicator(int(shards.size())) {
    for (size_t r = 1; r < shards.size(); ++r)
      for (int stream = 0; stream < 2; ++stream)
        for (int64_t b = shards[r].begin; b < shards[r].end; b += kMessagePiece)
          queued[int(r)].push_back({stream, b, std::min(kMessagePiece, shards[r].end - b)});
  }
  void receive_piece(int source, float* out, int64_t count) override {
    auto& q = queued[source];
    ASSERT_FALSE(q.empty()) << "rank " << source << " has nothing left to send";
    const Message m = q.front();
    q.pop_front();
    ASSERT_EQ(count, m.count) << "piece size from rank " << source;
    for (int64_t i = 0; i < count; ++i) out[i] = value(m.stream, m.begin + i);
    ++received;
  }
  bool all_received() const {
    for (const auto& [rank, q] : queued)
      if (!q.empty()) return false;
    return true;
  }
  struct Message {
    int stream;
    int64_t begin, count;
  };
  std::map<int, std::deque<Message>> queued;
  int received = 0;
};

struct Fixture {
  explicit Fixture(int64_t total, int ranks) : shards(shard_ranges(total, ranks)), comm(shards) {
    for (int s = 0; s < 2; ++s) {
      local[s].resize(size_t(shards[0].size()));
      for (int64_t i = 0; i < shards[0].size(); ++i) local[s][size_t(i)] = value(s, i);
    }
  }
  std::vector<FlatRange> shards;
  SendingRanks comm;
  std::vector<float> local[2];
  ShardReader reader() { return ShardReader(comm, shards, {local[0].data(), local[1].data()}); }
};

// Reads [begin, end) of a stream in requests of at most `step` elements; checks every value.
void read_and_check(ShardReader& reader, int stream, int64_t begin, int64_t end, int64_t step) {
  for (int64_t n = 0; begin < end; begin += n) {
    const float* p = reader.read(stream, begin, std::min(step, end - begin), &n);
    ASSERT_GT(n, 0);
    ASSERT_LE(n, std::min(step, end - begin));
    for (int64_t i = 0; i < n; ++i)
      ASSERT_EQ(p[i], value(stream, begin + i)) << "stream " << stream << " at " << begin + i;
  }
}

TEST(ShardReader, ReadsEveryRanksShardInOrderAcrossPieces) {
  Fixture f(3 * kMessagePiece + 12345, 3);  // rank 1 and 2 each send two pieces per stream
  ShardReader reader = f.reader();
  const int64_t total = f.shards.back().end;
  for (int stream = 0; stream < 2; ++stream) read_and_check(reader, stream, 0, total, 1 << 20);
  reader.drain();
  EXPECT_TRUE(f.comm.all_received());
  EXPECT_EQ(f.comm.received, 8);
}

TEST(ShardReader, SkippedPiecesAreReceivedAndDroppedAndDrainFinishesTheSends) {
  Fixture f(4 * kMessagePiece + 999, 2);
  ShardReader reader = f.reader();
  const FlatRange other = f.shards[1];
  // Stream 0: only a little of rank 1's last piece (the rest skipped, as padding would be).
  read_and_check(reader, 0, other.end - 10, other.end, 4);
  // Stream 1: rank 0's part, then nothing more (a write that failed midway).
  read_and_check(reader, 1, 0, 1000, 1000);
  EXPECT_FALSE(f.comm.all_received());
  reader.drain();
  EXPECT_TRUE(f.comm.all_received());
}

TEST(ShardReader, RefusesToGoBackToAPieceAlreadyPassed) {
  Fixture f(3 * kMessagePiece, 2);
  ShardReader reader = f.reader();
  const FlatRange other = f.shards[1];
  int64_t n = 0;
  reader.read(0, other.end - 1, 1, &n);  // rank 1's last piece of m: its first piece was dropped
  EXPECT_THROW(reader.read(0, other.begin, 1, &n), Error);
  reader.drain();
  EXPECT_TRUE(f.comm.all_received());
}

TEST(ShardReader, ReadAllReceivesEachStreamStraightIntoPlace) {
  Fixture f(5 * kMessagePiece + 77, 3);
  ShardReader reader = f.reader();
  const int64_t total = f.shards.back().end;
  std::vector<float> out(static_cast<size_t>(total));
  EXPECT_THROW(reader.read_all(1, out.data()), Error);  // stream 0 first
  for (int stream = 0; stream < 2; ++stream) {
    std::fill(out.begin(), out.end(), -1.0f);
    reader.read_all(stream, out.data());
    for (int64_t i = 0; i < total; ++i)
      ASSERT_EQ(out[size_t(i)], value(stream, i)) << "stream " << stream << " at " << i;
  }
  EXPECT_TRUE(f.comm.all_received());
  reader.drain();  // nothing left: a no-op
}

TEST(ShardReader, TinyModelsWithEmptyShards) {
  Fixture f(20, 4);  // 16-element alignment: shards of 16, 4, 0, 0 elements
  ShardReader reader = f.reader();
  for (int stream = 0; stream < 2; ++stream) read_and_check(reader, stream, 0, 20, 7);
  reader.drain();
  EXPECT_TRUE(f.comm.all_received());
  EXPECT_EQ(f.comm.received, 2);
}

}  // namespace
}  // namespace keel::distributed
