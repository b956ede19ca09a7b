// ZeRO-2 in one process: the decoder's staged gradients, reduced through train::GradSync by a
// communicator that runs each reduction only when it is waited for (as late as the protocol
// allows), give every rank's shard exactly the gradients replicated training accumulates. A
// staging buffer reused before its reduction ran, a group zeroed too late or a bucket crossing
// two groups would show here as wrong gradients; and the plan holds a shard of the gradients, not
// the whole buffer.
#include <gtest/gtest.h>

#include <cmath>
#include <deque>
#include <string>
#include <vector>

#include "decoder_test_support.h"
#include "fake_communicator.h"
#include "keel/core/error.h"
#include "keel/model/decoder.h"
#include "keel/train/grad_sync.h"

namespace keel::model {
namespace {

// Rank `rank` of two identical ranks: every sum over ranks is twice this rank's contribution.
// Reductions run in wait(), in submission order, never earlier.
class LateCommunicator final : public distributed::FakeCommunicator {
 public:
  explicit LateCommunicator(int rank) : FakeCommunicator(2, rank) {}
  distributed::Ticket reduce_scatter_accumulate_async(float* staged, FlatRange range,
                                                      const std::vector<FlatRange>& shards, float* sums, bool,
                                                      ComputeEvent) override {
    pending_.push_back({staged, range, &shards, sums});
    return ++submitted_;
  }
  void wait(distributed::Ticket ticket) override {
    while (done_ < ticket && !pending_.empty()) {
      const Job j = pending_.front();
      pending_.pop_front();
      const FlatRange shard = (*j.shards)[size_t(rank())], mine = j.range.intersect(shard);
      for (int64_t e = mine.begin; e < mine.end; ++e) j.sums[e - shard.begin] += 2.0f * j.staged[e - j.range.begin];
      ++done_;
    }
  }
  void allreduce_totals(double* data, int64_t n) override {
    for (int64_t i = 0; i < n; ++i) data[i] *= 2;
  }
  uint64_t reductions() const { return submitted_; }

 private:
  struct Job {
    float* staged;
    FlatRange range;
    const std::vector<FlatRange>* shards;
    float* sums;
  };
  std::deque<Job> pending_;
  uint64_t submitted_ = 0, done_ = 0;
};

struct Case {
  std::string family;
  bool tied = false, checkpointing = false, lora = false;
};

void expect_staged_shards_equal_replicated(const Case& c, const std::string& backend) {
  ModelConfig config = test::tiny_config(c.family);
  config.tie_word_embeddings = c.tied;
  const int64_t batch = 2, seq = 12;
  DecoderOptions base = test::on_backend(backend, {c.checkpointing, true, 0});
  if (c.lora) {
    base.lora.rank = 3;
    base.lora.alpha = 6;
    base.lora.targets = {"all"};
  }
  Decoder replicated(config, Precision::F32, batch, seq, base);
  replicated.init_random(3, 0.2);
  const test::Batch data[2] = {test::random_batch(batch, seq, config.vocab_size, 11),
                               test::random_batch(batch, seq, config.vocab_size, 12)};
  auto randomise = [](Decoder& d) {  // B is zero after init: random adapters make every gradient count
    ParamStore& a = d.trainable();
    for (int64_t i = 0; i < a.total(); ++i) a.weights()[i] = float(std::sin(0.37 * double(i))) * 0.3f;
    a.refresh_bf16_copy();
  };
  if (c.lora) randomise(replicated);
  replicated.trainable().zero_grads();
  for (const auto& b : data) replicated.forward_backward(b.view(batch, seq), 0.01);
  ParamStore& whole = replicated.trainable();

  for (int rank = 0; rank < 2; ++rank) {
    SCOPED_TRACE("rank " + std::to_string(rank));
    const DecoderOptions options = test::zero_rank_options(base, rank, 2);
    Decoder sharded(config, Precision::F32, batch, seq, options);
    sharded.init_random(3, 0.2);
    if (c.lora) randomise(sharded);
    ParamStore& params = sharded.trainable();
    ASSERT_TRUE(params.staged_grads());
    ASSERT_EQ(params.grads(), nullptr) << "ZeRO-2 has no whole gradient buffer";
    LateCommunicator comm(rank);
    train::GradSync sync(sharded, comm, {.zero_stage = 2, .bucket_bytes = 600, .overlap = true});
    sync.begin_step();
    for (int i = 0; i < 2; ++i) {
      sync.before_micro_batch(i == 1);
      sharded.forward_backward(data[i].view(batch, seq), 0.01);
      sync.after_micro_batch();
    }
    EXPECT_GT(comm.reductions(), 2 * sharded.grad_groups().size()) << "small buckets: several per group";
    const FlatRange mine = params.optimizer_range();
    ASSERT_EQ(mine.size(), sync.shards()[size_t(rank)].size());
    test::expect_shard_is_twice_replicated(params, whole);
  }
}

class ZeroTwoStaging : public ::testing::TestWithParam<std::string> {};

TEST_P(ZeroTwoStaging, ShardsHoldTheReplicatedGradients) {
  for (const Case& c : {Case{"llama"}, Case{"llama", true}, Case{"llama", false, true}, Case{"qwen3", true, true},
                        Case{"gemma2", true}, Case{"glm_original"}, Case{"llama", false, false, true},
                        Case{"qwen2", true, true, true}}) {
    SCOPED_TRACE(c.family + (c.tied ? " tied" : "") + (c.checkpointing ? " checkpointing" : "") +
                 (c.lora ? " lora" : ""));
    expect_staged_shards_equal_replicated(c, GetParam());
  }
}

INSTANTIATE_TEST_SUITE_P(Backends, ZeroTwoStaging, test::each_backend());

// The plan: a shard of the gradients and the staging of the groups in flight, less than the whole
// buffer; every group is planned once, from its first write to one position after its last.
TEST(ZeroTwoPlan, GradientsAreAShardPlusTheGroupsInFlight) {
  const ModelConfig config = test::tiny_config("llama");
  DecoderOptions replicated{false, true, 0};
  DecoderOptions staged = replicated;
  staged.optimizer_shards = 4;
  staged.shard_gradients = true;
  const MemoryPlan whole = decoder_memory_plan(config, Precision::BF16, 2, 64, replicated);
  const MemoryPlan sharded = decoder_memory_plan(config, Precision::BF16, 2, 64, staged);
  const size_t full = whole.category_bytes_at_peak(MemoryCategory::Gradients);
  const size_t part = sharded.category_bytes_at_peak(MemoryCategory::Gradients);
  EXPECT_LT(part, full);
  EXPECT_GT(part, full / 4);
  const StepTimeline t{int32_t(config.num_layers)};
  int staging = 0;
  for (const auto& b : sharded.buffers()) {
    if (b.name.find("grads.staged") == std::string::npos) continue;
    ++staging;
    EXPECT_GE(b.first_use, t.head()) << b.name;
    EXPECT_LE(b.last_use, t.optimizer()) << b.name;
    EXPECT_GT(b.last_use, b.first_use) << b.name << ": lives one position past its last write";
  }
  EXPECT_EQ(staging, int(config.num_layers) + 1) << "head, each block (block 0 with the embedding)";
  DecoderOptions unsharded = replicated;
  unsharded.shard_gradients = true;  // without optimizer shards: nothing to shard the gradients over
  EXPECT_THROW(decoder_memory_plan(config, Precision::BF16, 2, 64, unsharded), Error);
}

}  // namespace
}  // namespace keel::model
