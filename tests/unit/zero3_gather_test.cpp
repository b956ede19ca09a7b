// ZeRO-3 in one process: a decoder holding a shard of the masters, its weights gathered position
// by position through train::GradSync by a communicator that runs each gather only when it is
// waited for (as late as the protocol allows) and fills the other rank's parts from the replicated
// model, computes exactly what the replicated decoder computes: the same losses bit for bit, every
// rank's shard of the gradients twice the replicated ones (two identical ranks), evaluation the
// same. A gather waited for at the wrong position, a tensor pointed at the wrong buffer, a buffer
// reused while its gather is in flight or this rank's part not copied in would show here. Under
// LoRA and QLoRA the frozen base is what is gathered (fp32 norms, bf16 matrices, 4-bit codes and
// absmax values) and the adapter's gradients are what is reduced. bf16 ZeRO-1/2's sharded masters
// use the same gathers into resident buffers, filled once after loading and after each optimizer
// step (ResidentGather).
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <algorithm>
#include <deque>
#include <random>
#include <string>
#include <vector>

#include "decoder_test_support.h"
#include "fake_communicator.h"
#include "keel/core/error.h"
#include "keel/core/four_bit.h"
#include "keel/model/decoder.h"
#include "keel/train/grad_sync.h"
#include "keel/train/optimizer.h"

namespace keel::model {
namespace {

// Rank `rank` of two identical ranks. Reductions and gathers run in wait(), in submission order.
class LateCommunicator final : public distributed::FakeCommunicator {
 public:
  // What a gather's all-gathers read from the replicated model: per WeightGather span (in GradSync's
  // order: runs of fp32 masters, the masters' bf16 copies, frozen bf16 matrices, 4-bit codes,
  // absmax values), the replicated buffer as fp32 words and the span's first word.
  struct Transfer {
    const float* data;        // the gather's buffer
    const float* replicated;  // the replicated model's buffer of the same kind
    int64_t begin;            // the span's first word in it
  };
  LateCommunicator(int rank, ParamStore& whole) : FakeCommunicator(2, rank) {
    masters_ = whole.masters();
    mirror_ = reinterpret_cast<const float*>(whole.weights_bf16());  // the masters' bf16 copies (bf16 precision)
    compute_only_ = whole.compute_only_total() ? reinterpret_cast<const float*>(whole.compute_only()) : nullptr;
    packed_ = reinterpret_cast<const float*>(whole.four_bit_packed());
    absmax_ = whole.four_bit_absmax();
  }
  // The decoder's gathers: a call starts them in this order from the first on (buffers of
  // different positions may share bytes, so a buffer's address alone does not say which it is).
  void follow(const std::vector<WeightGather>& gathers) {
    for (const WeightGather& g : gathers) {
      for (const WeightGather::Run& run : g.fp32_runs)
        expected_.push_back({g.weights + run.at, masters_, run.range.begin});
      if (g.bf16_span.size() > 0)
        expected_.push_back({reinterpret_cast<const float*>(g.weights_bf16), mirror_, g.bf16_span.begin / 2});
      if (g.compute_only.size() > 0)
        expected_.push_back(
            {reinterpret_cast<const float*>(g.compute_only_weights), compute_only_, g.compute_only.begin / 2});
      if (g.four_bit.size() > 0) {
        expected_.push_back({reinterpret_cast<const float*>(g.four_bit_packed), packed_, g.four_bit.begin / 8});
        expected_.push_back({g.four_bit_absmax, absmax_, g.four_bit.begin / kFourBitBlockSize});
      }
    }
  }
  size_t transfers() const { return expected_.size(); }

  distributed::Ticket reduce_scatter_accumulate_async(float* staged, FlatRange range,
                                                      const std::vector<FlatRange>& shards, float* sums, bool,
                                                      ComputeEvent) override {
    pending_.push_back({Job::Reduce, staged, nullptr, range, &shards, sums});
    return ++submitted_;
  }
  distributed::Ticket allgather_shards_async(float* data, const std::vector<FlatRange>& parts) override {
    if (next_ >= expected_.size() || expected_[next_].data != data) next_ = 0;  // a new call
    EXPECT_EQ(expected_[next_].data, data) << "gathers start in the order of their positions";
    const Transfer t = expected_[next_++];
    // This rank's part must be in place when the gather starts (bytes: 4-bit codes are no floats).
    const FlatRange mine = parts[size_t(rank())];
    if (mine.size() > 0 && std::memcmp(data + mine.begin, t.replicated + t.begin + mine.begin, size_t(mine.size()) * 4))
      ++own_part_mismatches_;
    pending_.push_back({Job::Gather, data, t.replicated, {t.begin, t.begin}, &parts, nullptr});
    ++gathers_;
    return ++submitted_;
  }
  void wait(distributed::Ticket ticket) override {
    while (done_ < ticket && !pending_.empty()) {
      const Job j = pending_.front();
      pending_.pop_front();
      if (j.kind == Job::Reduce) {
        const FlatRange shard = (*j.shards)[size_t(rank())], mine = j.range.intersect(shard);
        for (int64_t e = mine.begin; e < mine.end; ++e) j.sums[e - shard.begin] += 2.0f * j.data[e - j.range.begin];
      } else {
        const FlatRange other = (*j.shards)[size_t(1 - rank())];
        if (other.size() > 0)
          std::memcpy(j.data + other.begin, j.replicated + j.range.begin + other.begin, size_t(other.size()) * 4);
      }
      ++done_;
    }
  }
  void allreduce_totals(double* data, int64_t n) override {
    for (int64_t i = 0; i < n; ++i) data[i] *= 2;
  }
  int64_t gathers() const { return gathers_; }
  int64_t own_part_mismatches() const { return own_part_mismatches_; }

 private:
  struct Job {
    enum Kind { Reduce, Gather } kind;
    float* data;
    const float* replicated;  // Gather: the replicated buffer the other rank's part comes from
    FlatRange range;          // Reduce: the staged range; Gather: {the span's first word, same}
    const std::vector<FlatRange>* shards;
    float* sums;
  };
  const float *masters_ = nullptr, *mirror_ = nullptr, *compute_only_ = nullptr, *packed_ = nullptr, *absmax_ = nullptr;
  std::vector<Transfer> expected_;
  size_t next_ = 0;
  std::deque<Job> pending_;
  uint64_t submitted_ = 0, done_ = 0;
  int64_t gathers_ = 0, own_part_mismatches_ = 0;
};

struct Case {
  std::string family;
  bool tied = false, checkpointing = false;
  Precision precision = Precision::F32;
  bool lora = false, four_bit = false;  // LoRA / QLoRA: the frozen base is what is sharded
};

// What every sharded rank must reproduce: the replicated model's evaluation loss on the first of
// two batches and the losses of both as the micro-batches of one step (gradients accumulated).
struct ReplicatedStep {
  test::Batch data[2];
  double eval_loss = 0, losses[2] = {0, 0};
  ReplicatedStep(Decoder& replicated, int64_t batch, int64_t seq)
      : data{test::random_batch(batch, seq, replicated.config().vocab_size, 11),
             test::random_batch(batch, seq, replicated.config().vocab_size, 12)} {
    eval_loss = replicated.forward_loss(data[0].view(batch, seq));
    replicated.trainable().zero_grads();
    for (int i = 0; i < 2; ++i) losses[i] = replicated.forward_backward(data[i].view(batch, seq), 0.01);
  }
};

void expect_gathered_step_equals_replicated(const Case& c, const std::string& backend) {
  // QLoRA's projections are quantized in 64-element blocks of whole rows.
  ModelConfig config =
      c.four_bit ? test::tiny_config_with_experts(c.family, 64, 128) : test::tiny_config_with_experts(c.family);
  config.tie_word_embeddings = c.tied;
  const int64_t batch = 2, seq = 12;
  DecoderOptions base = test::on_backend(backend, {c.checkpointing, true, 0});
  if (c.lora) base.lora.rank = 4;
  base.four_bit_base = c.four_bit;
  Decoder replicated(config, c.precision, batch, seq, base);
  replicated.init_random(3, 0.2);
  replicated.init_adapter(5);
  const ReplicatedStep step(replicated, batch, seq);
  const auto& [data, eval_loss, losses] = step;
  ParamStore& whole = replicated.params();

  for (int rank = 0; rank < 2; ++rank) {
    SCOPED_TRACE("rank " + std::to_string(rank));
    const DecoderOptions options = test::zero_rank_options(base, rank, 3);
    Decoder sharded(config, c.precision, batch, seq, options);
    sharded.init_random(3, 0.2);
    sharded.init_adapter(5);
    ParamStore& params = sharded.params();
    ASSERT_TRUE(params.sharded_weights());
    EXPECT_THROW(params.weights(), Error) << "no whole weight buffer under ZeRO-3";
    // Initialisation keeps this rank's part of every draw.
    const FlatRange held = params.master_range();
    if (!c.lora) ASSERT_EQ(held.size(), params.optimizer_range().size());
    int64_t init_mismatches = 0;
    for (int64_t e = held.begin; e < held.end; ++e)
      init_mismatches += params.masters()[e - held.begin] != whole.masters()[e];
    EXPECT_EQ(init_mismatches, 0);

    LateCommunicator comm(rank, whole);
    comm.follow(sharded.weight_gathers());
    EXPECT_THROW(sharded.forward_loss(data[0].view(batch, seq)), Error) << "no gatherer, no weights";
    train::GradSync sync(sharded, comm, {.zero_stage = 3, .bucket_bytes = 600, .overlap = true});
    // Evaluation gathers the forward's weights: the same loss bit for bit.
    EXPECT_EQ(sharded.forward_loss(data[0].view(batch, seq)), eval_loss);
    const int64_t eval_gathers = comm.gathers();
    EXPECT_GE(eval_gathers, int64_t(config.num_layers) + 2 + (c.tied ? 1 : 0));
    sync.begin_step();
    for (int i = 0; i < 2; ++i) {
      sync.before_micro_batch(i == 1);
      EXPECT_EQ(sharded.forward_backward(data[i].view(batch, seq), 0.01), losses[i]) << "micro-batch " << i;
      sync.after_micro_batch();
    }
    EXPECT_EQ(comm.gathers() - eval_gathers, 2 * int64_t(comm.transfers()));
    EXPECT_EQ(comm.own_part_mismatches(), 0) << "this rank's part copied into each gather before it starts";
    for (const Param& p : params.params()) {
      const int i = int(&p - params.params().data());
      EXPECT_TRUE(params.weight(i) == nullptr && params.weight_bf16(i) == nullptr && !params.four_bit(i)) << p.name;
    }
    test::expect_shard_is_twice_replicated(sharded.trainable(), replicated.trainable());
  }
}

class ZeroThreeGather : public ::testing::TestWithParam<std::string> {};

TEST_P(ZeroThreeGather, StepComputesWhatReplicatedTrainingComputes) {
  for (const Case& c :
       {Case{"llama"}, Case{"llama", true}, Case{"llama", false, true}, Case{"qwen3", true, true}, Case{"gemma2", true},
        Case{"glm_original"}, Case{"qwen2", false, false, Precision::BF16}, Case{"llama", true, true, Precision::BF16},
        Case{"qwen2", false, false, Precision::BF16, true}, Case{"llama", true, true, Precision::F32, true},
        Case{"llama", false, false, Precision::BF16, true, true},
        Case{"glm_original", false, true, Precision::F32, true, true},
        // Mixtures of experts: the router and the experts are one block's parameters like any other,
        // gathered with it; a sparse layer's products read them through the pointers the gather sets.
        Case{"qwen3_moe"}, Case{"mixtral", false, true}, Case{"qwen3_moe", true, true, Precision::BF16},
        Case{"mixtral", false, false, Precision::BF16, true}, Case{"mixtral", false, true, Precision::F32, true, true},
        Case{"glm4_moe"}, Case{"glm4_moe", false, true, Precision::BF16}}) {
    SCOPED_TRACE(c.family + (c.tied ? " tied" : "") + (c.checkpointing ? " checkpointing" : "") +
                 (c.precision == Precision::BF16 ? " bf16" : "") +
                 (c.four_bit ? " QLoRA"
                  : c.lora   ? " LoRA"
                             : ""));
    expect_gathered_step_equals_replicated(c, GetParam());
  }
}

INSTANTIATE_TEST_SUITE_P(Backends, ZeroThreeGather, test::each_backend());

// bf16 ZeRO-2 with sharded masters (DecoderOptions::shard_masters): after loading, every gather runs
// once into resident buffers, and evaluation and the step read them (the same losses bit for bit,
// no gather inside a call, every tensor pointed at its buffers for good). After an optimizer step
// on the same summed gradients as the replicated model's, this rank's part of each gather (the
// optimizer's bf16 casts, the fp32 runs copied) is the replicated model's, and the next evaluation
// computes what the replicated one does.
void expect_resident_step_equals_replicated(const std::string& family, bool tied, const std::string& backend) {
  ModelConfig config = test::tiny_config_with_experts(family);
  config.tie_word_embeddings = tied;
  const int64_t batch = 2, seq = 12;
  const DecoderOptions base = test::on_backend(backend, {false, true, 0});
  Decoder replicated(config, Precision::BF16, batch, seq, base);
  replicated.init_random(3, 0.2);
  const ReplicatedStep step(replicated, batch, seq);
  const auto& [data, eval_loss, losses] = step;
  ParamStore& whole = replicated.params();
  // The sharded ranks' summed gradients are twice these (two identical ranks): the replicated
  // optimizer steps on twice its own, exactly (a power of two).
  const std::vector<float> single(whole.grads(), whole.grads() + whole.total());
  std::vector<float> doubled(single.size());
  for (size_t e = 0; e < single.size(); ++e) doubled[e] = 2.0f * single[e];
  std::copy(doubled.begin(), doubled.end(), whole.grads());
  train::AdamW replicated_adam(replicated.backend(), whole, {0.9, 0.999, 1e-8, 0.1});
  replicated_adam.step(1e-2, 1);
  std::copy(single.begin(), single.end(), whole.grads());  // what the shards are compared with
  const double eval_after = replicated.forward_loss(data[1].view(batch, seq));

  for (int rank = 0; rank < 2; ++rank) {
    SCOPED_TRACE("rank " + std::to_string(rank));
    Decoder replicated_again(config, Precision::BF16, batch, seq, base);  // the model before the step
    replicated_again.init_random(3, 0.2);
    DecoderOptions options = test::zero_rank_options(base, rank, 2);
    options.shard_masters = true;
    Decoder sharded(config, Precision::BF16, batch, seq, options);
    sharded.init_random(3, 0.2);
    ParamStore& params = sharded.params();
    ASSERT_TRUE(params.sharded_weights() && sharded.resident_gathers());
    EXPECT_THROW(params.weights(), Error) << "no whole fp32 buffer with sharded masters";
    LateCommunicator comm(rank, replicated_again.params());
    comm.follow(sharded.weight_gathers());
    train::GradSync sync(sharded, comm, {.zero_stage = 2, .bucket_bytes = 600, .overlap = true});
    EXPECT_THROW(sharded.forward_loss(data[0].view(batch, seq)), Error) << "never gathered: nothing to read";
    sync.weights_loaded();
    EXPECT_EQ(comm.gathers(), int64_t(comm.transfers()));
    EXPECT_EQ(comm.own_part_mismatches(), 0) << "this rank's part cast and copied before each gather";
    EXPECT_EQ(sharded.forward_loss(data[0].view(batch, seq)), eval_loss);
    sync.begin_step();
    for (int i = 0; i < 2; ++i) {
      sync.before_micro_batch(i == 1);
      EXPECT_EQ(sharded.forward_backward(data[i].view(batch, seq), 0.01), losses[i]) << "micro-batch " << i;
      sync.after_micro_batch();
    }
    EXPECT_EQ(comm.gathers(), int64_t(comm.transfers())) << "no gather inside a call: the buffers stay";
    for (const Param& p : params.params()) {
      const int i = int(&p - params.params().data());
      EXPECT_TRUE(params.weight(i) != nullptr || params.weight_bf16(i) != nullptr) << p.name << " points nowhere";
    }
    test::expect_shard_is_twice_replicated(sharded.trainable(), replicated.trainable());
    // The optimizer step on exactly the replicated gradients' shard, then the gather after it.
    const FlatRange mine = params.optimizer_range();
    std::copy_n(doubled.begin() + mine.begin, mine.size(), params.shard_grads());
    train::AdamW adam(sharded.backend(), params, {0.9, 0.999, 1e-8, 0.1});
    adam.step(1e-2, 1);
    LateCommunicator after(rank, whole);  // the other rank's parts from the stepped replicated model
    after.follow(sharded.weight_gathers());
    sharded.set_weight_gather_hooks({});
    train::GradSync sync_after(sharded, after, {.zero_stage = 2, .bucket_bytes = 600, .overlap = true});
    sync_after.gather_weights();
    EXPECT_EQ(after.own_part_mismatches(), 0) << "the optimizer step's bf16 casts and the fp32 runs, this rank's part";
    EXPECT_EQ(sharded.forward_loss(data[1].view(batch, seq)), eval_after);
  }
}

TEST_P(ZeroThreeGather, ResidentGathersOfShardedMastersComputeWhatReplicatedTrainingComputes) {
  for (const auto& [family, tied] :
       {std::pair<std::string, bool>{"llama", false}, {"llama", true}, {"qwen3", true}, {"glm_original", false},
        {"qwen3_moe", true}, {"mixtral", false}, {"glm4_moe", false}}) {
    SCOPED_TRACE(family + (tied ? " tied" : ""));
    expect_resident_step_equals_replicated(family, tied, GetParam());
  }
}

// The plan: a shard of the masters, no whole bf16 copy, and of the gathered buffers at most the
// ones of two positions alive at once (the one computing, the next one's in flight). In bf16 a
// block's matrices travel as bf16 alone and only its norms in fp32; the embedding, looked up in
// fp32, travels in fp32 alone.
TEST(ZeroThreePlan, MastersAreAShardAndGatheredWeightsTwoPositions) {
  const ModelConfig config = test::tiny_config("llama");
  DecoderOptions two{false, true, 0};
  two.optimizer_shards = 4;
  two.shard_gradients = true;
  DecoderOptions three = two;
  three.shard_weights = true;
  const MemoryPlan stage2 = decoder_memory_plan(config, Precision::BF16, 2, 64, two);
  const MemoryPlan stage3 = decoder_memory_plan(config, Precision::BF16, 2, 64, three);
  const size_t masters2 = stage2.category_bytes_at_peak(MemoryCategory::MasterWeights);
  const size_t masters3 = stage3.category_bytes_at_peak(MemoryCategory::MasterWeights);
  EXPECT_LE(masters3, masters2 / 4 + 64 * sizeof(float));
  EXPECT_GE(masters3, masters2 / 4);
  ParamStore whole;
  DecoderParamIds ids;
  declare_model_params(config, whole, ids);
  const StepTimeline t{int32_t(config.num_layers)};
  const int64_t block = whole.param(ids.layers[1].input_norm).offset - whole.param(ids.layers[0].input_norm).offset;
  const int64_t embed = whole.param(ids.embed).numel;
  int gathered = 0;
  size_t block_fp32 = 0;
  for (const auto& b : stage3.buffers()) {
    if (b.name.find("weights.gathered") == std::string::npos) continue;
    ++gathered;
    EXPECT_LE(b.last_use - b.first_use, 1) << b.name;
    EXPECT_GE(b.first_use, t.forward(0)) << b.name;
    EXPECT_EQ(b.name.find("weights.bf16"), std::string::npos);
    const bool as_bf16 = b.name.size() > 5 && b.name.compare(b.name.size() - 5, 5, ".bf16") == 0;
    if (b.name.find("(layers.") != std::string::npos) {
      if (as_bf16)
        EXPECT_EQ(b.bytes, size_t(block) * sizeof(bf16)) << b.name << ": the block's span as bf16";
      else
        EXPECT_LT(b.bytes, size_t(block) * sizeof(float) / 8) << b.name << ": only the norms in fp32";
      if (!as_bf16) block_fp32 = std::max(block_fp32, b.bytes);
    }
    if (b.name.find("(embed, read in the forward") != std::string::npos) {
      EXPECT_FALSE(as_bf16) << "the embedding is looked up in fp32";
      EXPECT_EQ(b.bytes, size_t(embed) * sizeof(float));
    }
  }
  // Per block position a bf16 span and an fp32 run of norms; the embedding in fp32; the head's
  // final norm in fp32 and the LM head in bf16.
  EXPECT_EQ(gathered, 2 * 2 * int(config.num_layers) + 3);
  // The first position holds the embedding and block 0 with block 1's gather in flight; later ones
  // at most three groups.
  const size_t group = size_t(block) * sizeof(bf16) + block_fp32;
  EXPECT_LE(stage3.category_bytes_at_peak(MemoryCategory::ComputeWeights),
            std::max(size_t(embed) * sizeof(float) + 2 * group, 3 * group) + 4096);
  EXPECT_LT(stage3.total_bytes(), stage2.total_bytes());
}

}  // namespace
}  // namespace keel::model

namespace keel::model {
namespace {

// ZeRO-3 under LoRA/QLoRA: a frozen store's shards. Whatever writes a tensor (initialisation,
// loading, a checkpoint's 4-bit codes read as they are) hands over the whole tensor and each rank
// keeps its part: every rank's held bytes are the whole store's bytes at the same places, and the
// ranks' parts together are all of them. Quantization sees the whole tensor (its absmax values are
// double-quantized together), so a rank's codes are the whole store's.
TEST(ZeroThreeShards, FrozenStoresKeepTheirPartOfEveryTensor) {
  auto declare = [](ParamStore& s) {
    s.add("norm", {40}, false);
    s.add("embed", {24, 40}, true, ParamStorage::Bf16);
    s.add("q", {32, 64}, true, ParamStorage::FourBit);
    s.add("norm2", {40}, false);
    s.add("down", {48, 64}, true, ParamStorage::FourBit);
  };
  std::mt19937 rng(5);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  auto draws = [&](int64_t n) {
    std::vector<float> v(static_cast<size_t>(n));
    for (float& x : v) x = normal(rng);
    return v;
  };
  struct Buffers {
    std::vector<float> weights, absmax;
    std::vector<bf16> bf;
    std::vector<uint8_t> packed;
    void bind(ParamStore& s, FlatRange m, FlatRange c, FlatRange f) {
      weights.assign(size_t(m.size()), 0.0f);
      bf.assign(size_t(c.size() + 1), bf16{0});
      packed.assign(size_t(f.size() / 2 + 1), 0);
      absmax.assign(size_t(f.size() / kFourBitBlockSize + 1), 0.0f);
      s.bind(weights.data(), nullptr, bf.data(), nullptr, nullptr);
      s.bind_four_bit(packed.data(), absmax.data());
    }
  };
  ParamStore whole;
  declare(whole);
  Buffers w;
  whole.allocate(true);  // fp32 and the bf16 buffer
  w.packed.assign(size_t(whole.four_bit_total() / 2), 0);
  w.absmax.assign(size_t(whole.four_bit_total() / kFourBitBlockSize), 0.0f);
  whole.bind_four_bit(w.packed.data(), w.absmax.data());
  // One value set per tensor; "down" as a prequantized checkpoint's codes (write_four_bit).
  std::vector<std::vector<float>> values;
  for (const Param& p : whole.params()) values.push_back(draws(p.numel));
  auto fill = [&](ParamStore& s, bool sharded) {
    for (size_t i = 0; i < values.size(); ++i) {
      const Param& p = s.param(int(i));
      if (p.storage == ParamStorage::Master) {
        s.write_master(int(i), 0, values[i].data(), p.numel);
      } else if (p.storage == ParamStorage::Bf16) {
        std::vector<bf16> b(values[i].size());
        convert_f32_to_bf16(values[i].data(), b.data(), b.size());
        s.write_compute_only(int(i), 0, b.data(), p.numel);
      } else if (p.name == "q") {
        s.store_four_bit(int(i), 0, values[i].data(), p.numel, true);
      } else {  // codes as saved: quantized elsewhere, written as they are
        std::vector<uint8_t> packed(size_t(p.numel / 2));
        std::vector<float> absmax(size_t(p.numel / kFourBitBlockSize));
        four_bit_quantize(FourBitType::Nf4, values[i].data(), p.numel, packed.data(), absmax.data());
        if (sharded) {
          s.write_four_bit(int(i), 0, p.numel, packed.data(), absmax.data());
        } else {
          auto slot = s.four_bit_slot(int(i), 0, p.numel);
          std::copy(packed.begin(), packed.end(), slot.packed);
          std::copy(absmax.begin(), absmax.end(), slot.absmax);
        }
      }
    }
  };
  fill(whole, false);
  const int ranks = 3;
  const auto m = shard_ranges(whole.total(), ranks), c = shard_ranges(whole.compute_only_total(), ranks),
             f = shard_ranges(whole.four_bit_total(), ranks, kFourBitShardAlign);
  int64_t held_4bit = 0;
  for (int r = 0; r < ranks; ++r) {
    SCOPED_TRACE("rank " + std::to_string(r));
    ParamStore s;
    declare(s);
    s.shard_weights(m[size_t(r)], c[size_t(r)], f[size_t(r)]);
    Buffers b;
    b.bind(s, m[size_t(r)], c[size_t(r)], f[size_t(r)]);
    fill(s, true);
    for (int64_t e = m[size_t(r)].begin; e < m[size_t(r)].end; ++e)
      ASSERT_EQ(s.masters()[e - m[size_t(r)].begin], whole.masters()[e]) << "master element " << e;
    for (int64_t e = c[size_t(r)].begin; e < c[size_t(r)].end; ++e)
      ASSERT_EQ(s.compute_only()[e - c[size_t(r)].begin].bits, whole.compute_only()[e].bits) << "bf16 element " << e;
    const FlatRange h = s.four_bit_range();
    for (int64_t e = h.begin; e < h.end; e += 2)
      ASSERT_EQ(s.four_bit_packed()[(e - h.begin) / 2], w.packed[size_t(e / 2)]) << "4-bit element " << e;
    for (int64_t e = h.begin; e < h.end; e += kFourBitBlockSize)
      ASSERT_EQ(s.four_bit_absmax()[(e - h.begin) / kFourBitBlockSize], w.absmax[size_t(e / kFourBitBlockSize)])
          << "absmax of 4-bit element " << e;
    held_4bit += h.size();
    EXPECT_FALSE(s.four_bit(2)) << "a sharded 4-bit tensor is nowhere outside a gather";
  }
  EXPECT_EQ(held_4bit, whole.four_bit_total());
  EXPECT_GT(f[1].size(), 0) << "the 4-bit elements span more than one shard";
}

}  // namespace
}  // namespace keel::model
