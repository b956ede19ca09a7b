// Data parallel's gradient path through one training step, for every ZeRO stage (Rajbhandari et
// al. 2020): the buckets fed by the decoder's grad-ready hook, the reductions, the global gradient
// norm and, under ZeRO, the all-gather of the updated weights.
//
// - stage 0 (replicated): gradients accumulate locally over the micro-batches and each bucket is
//   all-reduced during (overlap) or after the last backward pass; every rank steps everything.
// - stage 1: the same buckets are reduce-scattered onto each rank's shard; a rank steps its shard
//   with its shard of the moments, then the shards are all-gathered. With overlap the all-gather
//   runs span by span (model::Decoder::first_weight_reads) while the next step's forward pass
//   computes: each position waits only for the weights it reads first. In bf16 full fine-tuning
//   the fp32 masters are sharded as the moments (DeepSpeed's stage 1/2; DecoderOptions::
//   shard_masters): the optimizer step writes this rank's part of the bf16 copies, and what is
//   gathered is what the step reads (the bf16 matrices; norms, biases and the embedding in fp32),
//   into the decoder's resident buffers (Decoder::refresh_resident_weights), by the same
//   positions.
// - stage 2: no whole gradient buffer. Every micro-batch's backward pass writes each gradient
//   group (model::GradGroup) into a staging buffer, its buckets are reduce-scattered into this
//   rank's accumulated shard as they become final, and the decoder's position hook waits for a
//   group's reductions before its staging can be reused. Without overlap each bucket is reduced as
//   soon as it is final (the staging cannot wait for the end of the backward pass).
// - stage 3: stage 2, and the weights sharded too: no all-gather after the optimizer step; the
//   decoder's weight gathers (model::WeightGather) are all-gathers of the shards' parts of each
//   group, started one position ahead of the compute that reads them. Under LoRA the frozen base
//   weights are the sharded ones (their bf16 matrices gathered as bf16) and the adapter is
//   synchronised as in stage 2.
#pragma once
#include <cstdint>
#include <memory>
#include <vector>

#include "keel/core/flat_range.h"
#include "keel/distributed/communicator.h"
#include "keel/distributed/grad_buckets.h"
#include "keel/model/decoder.h"

namespace keel::train {

struct GradSyncOptions {
  int zero_stage = 0;
  int64_t bucket_bytes = int64_t(25) << 20;
  bool overlap = true;         // reduce buckets during the backward pass (train/sync_overlap.h decides)
  bool deterministic = false;  // rank-ordered sums (bit-identical reruns)
};

// What a step's reductions leave: sums over every rank.
struct SyncedStep {
  double loss_sum = 0;   // of the token losses
  double grad_norm = 0;  // the global L2 norm of the step's gradients
};

class GradSync {
 public:
  // Installs the decoder's hooks (removed by the destructor). The decoder's trainable store must
  // be sharded as `options.zero_stage` says (recipe::training_decoder_options does it).
  GradSync(model::Decoder& decoder, distributed::Communicator& comm, const GradSyncOptions& options);
  ~GradSync();
  GradSync(const GradSync&) = delete;
  GradSync& operator=(const GradSync&) = delete;

  // Each rank's part of the flat trainable buffer under ZeRO; empty when replicated.
  const std::vector<FlatRange>& shards() const { return shards_; }

  // The step's gradients start from zero (ZeRO-2's shard), or are overwritten by each tensor's
  // first write of the step (a whole buffer: ParamStore::begin_gradient_step).
  void begin_step();
  // Around each micro-batch's forward_backward; `last`: the step's last micro-batch.
  void before_micro_batch(bool last);
  void after_micro_batch();
  // After the last micro-batch: waits for the reductions still running (the exposed
  // communication), then sums the loss and the squares of the gradients over the ranks.
  SyncedStep finish(double local_loss_sum);
  // ZeRO-1/2: every rank's updated shard of the weights to every rank (and their bf16 copies).
  // With overlap (full fine-tuning) this starts the gathers and returns; the next step's forward
  // pass waits for each span where it first reads it, and settle_weights() for all of them.
  // Nothing under ZeRO-3, whose weights are gathered where the step reads them.
  void gather_weights();
  // Waits for the gathers gather_weights() started: before anything outside a training step reads
  // the weights (evaluation, a checkpoint, the final save). Returns the seconds waited.
  double settle_weights();
  // After this rank's masters were written outside a step (loading, initialisation, a resume):
  // with sharded masters the weights the step reads are gathered again. Every rank calls it.
  void weights_loaded();
  // The time the training thread spent in the decoder's hooks since the last call: queueing
  // buckets, and under ZeRO-2 waiting for reductions inside the backward pass (exposed
  // communication the step's compute time must not include).
  double take_hook_seconds();

 private:
  void position(int32_t position);
  void weights_read_at(int32_t position);  // waits for the post-step gathers read from `position` on
  // Each rank's part of `range` under `shards` (relative to the range's start; empty for ranks
  // holding none of it), in units of `unit` elements.
  static std::vector<FlatRange> parts_within(FlatRange range, const std::vector<FlatRange>& shards, int64_t unit = 1);
  model::Decoder& decoder_;
  distributed::Communicator& comm_;
  GradSyncOptions options_;
  std::vector<FlatRange> shards_;
  std::unique_ptr<distributed::GradBuckets> buckets_;
  std::vector<float*> staged_;  // ZeRO-2: where each trainable tensor's gradient is written
  // ZeRO-3: per weight gather, one all-gather per span of it (each run of masters read in fp32, the
  // bf16 copies the GEMMs read; under LoRA the frozen bf16 matrices, or QLoRA's 4-bit codes and
  // absmax values), each as fp32 words (the communicator's all-gather moves them as they are) with
  // every rank's part, and its ticket in flight.
  struct Transfer {
    float* data;
    std::vector<FlatRange> parts;
    distributed::Ticket ticket = 0;
  };
  std::vector<std::vector<Transfer>> gathers_;
  void start_gather(size_t g);
  void wait_gather(size_t g);
  // ZeRO-1/2: the post-step gather, one all-gather per span (first_weight_reads(), waited for
  // where each is read, when deferred; else one span, the whole buffer), each span's parts per
  // rank, the tickets in flight and the first span not waited for (post_step_.size() when none is
  // pending).
  bool defer_post_step_ = false;
  std::vector<model::WeightGather> post_step_;
  std::vector<std::vector<FlatRange>> post_step_parts_;
  std::vector<distributed::Ticket> post_step_tickets_;
  size_t next_post_step_wait_ = 0;
  bool began_ = false;          // the buckets of the current micro-batch (or step) have begun
  bool in_backward_ = false;    // the hooks feed the buckets
  size_t next_wait_ = 0;        // ZeRO-2: the first group whose reductions were not waited for
  double hook_seconds_ = 0;
};

}  // namespace keel::train
