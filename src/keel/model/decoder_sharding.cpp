// The decoder's ZeRO weight machinery, apart from the block math in decoder.cpp: which weights a
// position reads first, the gathers started a position ahead and waited on at it (ZeRO-3), the
// tensors pointed at their gathered buffers, and the resident gathers of sharded masters (ZeRO-1/2
// in bf16) refreshed after each optimizer step. What each gather holds and when is planned in
// decoder_plan.cpp (plan_weight_gathers); the collectives themselves are train/'s, behind the hooks.
#include <algorithm>

#include "keel/core/error.h"
#include "keel/model/decoder.h"
#include "keel/model/decoder_plan.h"

namespace keel::model {

std::vector<WeightGather> Decoder::first_weight_reads() const {
  std::vector<WeightGather> first;
  std::vector<bool> seen(params_.params().size(), false);
  for (const WeightGather& g : plan_weight_gathers(config_, ids_, params_, false, false)) {  // sorted by position
    if (seen[size_t(g.first_param)]) continue;
    for (int p = g.first_param; p <= g.last_param; ++p) seen[size_t(p)] = true;
    first.push_back({g.first_param, g.last_param, g.range, g.position});
  }
  return first;
}

void Decoder::enter_position(int32_t position) {
  if (position_hook_) position_hook_(position);
  for (const GradGroup& g : grad_groups_)
    if (g.first_written == position) std::fill_n(g.staging, g.range.size(), 0.0f);
  if (weight_gathers_.empty()) return;
  if (resident_gathers()) {  // the refresh's gathers the position reads first (in position order)
    for (; resident_wait_ < weight_gathers_.size() && weight_gathers_[resident_wait_].position <= position;
         ++resident_wait_)
      gather_hooks_.wait(resident_wait_);
    return;
  }
  // ZeRO-3. The first position's gathers were not started ahead: start them now.
  if (position == StepTimeline{int32_t(config_.num_layers)}.forward(0)) start_gathers(position);
  for (size_t i = 0; i < weight_gathers_.size(); ++i) {
    const WeightGather& g = weight_gathers_[i];
    if (g.position != position) continue;
    if (!casts_per_position()) gather_hooks_.wait(i);
    point_at_gather(g, false);
  }
  if (position < last_position_) start_gathers(position + 1);
}

// Points the tensors of gather g at its buffers. `keep`: a tensor's address in another gather
// stays (resident gathers: the tied embedding is looked up from one and read by the LM head from
// another); otherwise what g does not hold is null (ZeRO-3: no address outlives its buffer).
void Decoder::point_at_gather(const WeightGather& g, bool keep) {
  for (int p = g.first_param; p <= g.last_param; ++p) {
    const Param& param = params_.param(p);
    if (casts_per_position()) {  // the masters stay where they are; only the bf16 copy moves
      params_.point_bf16_at(p, g.weights_bf16 + (param.offset - g.bf16_span.begin));
      continue;
    }
    if (param.storage == ParamStorage::Bf16) {  // a frozen bf16 matrix (LoRA)
      params_.point_at(p, nullptr, g.compute_only_weights + (param.offset - g.compute_only.begin));
      continue;
    }
    if (param.storage == ParamStorage::FourBit) {  // a frozen 4-bit matrix (QLoRA)
      const int64_t at = param.offset - g.four_bit.begin;
      params_.point_at_four_bit(p, g.four_bit_packed + at / 2, g.four_bit_absmax + at / kFourBitBlockSize);
      continue;
    }
    float* fp32 = keep ? params_.weight(p) : nullptr;
    for (const WeightGather::Run& run : g.fp32_runs)
      if (run.range.contains(param.offset)) fp32 = g.weights + run.at + (param.offset - run.range.begin);
    bf16* copy = keep ? params_.weight_bf16(p) : nullptr;
    if (g.bf16_span.size() > 0) copy = g.weights_bf16 + (param.offset - g.bf16_span.begin);
    params_.point_at(p, fp32, copy);
  }
}

void Decoder::stage_gather(size_t i, bool cast) {
  const FlatRange held = params_.master_range(), held_c = params_.compute_only_range(),
                  held_4 = params_.four_bit_range();
  const WeightGather& g = weight_gathers_[i];
  for (const WeightGather::Run& run : g.fp32_runs)
    if (const FlatRange mine = run.range.intersect(held); mine.size() > 0)
      std::copy_n(params_.masters() + (mine.begin - held.begin), mine.size(),
                  g.weights + run.at + (mine.begin - run.range.begin));
  // The GEMMs' bf16: this rank casts its part, the gather moves bf16 (the bits a cast after it gives).
  if (const FlatRange mine = g.bf16_span.intersect(held); cast && mine.size() > 0)
    backend_.cast_to_bf16(params_.masters() + (mine.begin - held.begin),
                          g.weights_bf16 + (mine.begin - g.bf16_span.begin), mine.size());
  const FlatRange mine_c = g.compute_only.intersect(held_c);
  if (mine_c.size() > 0)
    std::copy_n(params_.compute_only() + (mine_c.begin - held_c.begin), mine_c.size(),
                g.compute_only_weights + (mine_c.begin - g.compute_only.begin));
  if (const FlatRange mine_4 = g.four_bit.intersect(held_4); mine_4.size() > 0) {  // whole blocks
    const int64_t from = mine_4.begin - held_4.begin, to = mine_4.begin - g.four_bit.begin;
    std::copy_n(params_.four_bit_packed() + from / 2, mine_4.size() / 2, g.four_bit_packed + to / 2);
    std::copy_n(params_.four_bit_absmax() + from / kFourBitBlockSize, mine_4.size() / kFourBitBlockSize,
                g.four_bit_absmax + to / kFourBitBlockSize);
  }
}

// Copies this rank's part of each gather read at `position` into its buffers and starts it.
void Decoder::start_gathers(int32_t position) {
  for (size_t i = 0; i < weight_gathers_.size(); ++i) {
    if (weight_gathers_[i].position != position) continue;
    stage_gather(i, true);
    if (!casts_per_position()) gather_hooks_.start(i);
  }
}

void Decoder::refresh_resident_weights(bool bf16_written) {
  require(resident_gathers(),
          "decoder: refresh_resident_weights without sharded masters (DecoderOptions::shard_masters)");
  require(gather_hooks_.start && gather_hooks_.wait,
          "decoder: the masters are sharded (ZeRO-1/2) but nothing gathers them (set_weight_gather_hooks)");
  settle_resident_weights();  // a refresh still in flight writes the buffers this one stages into
  for (size_t i = 0; i < weight_gathers_.size(); ++i) {
    stage_gather(i, !bf16_written);
    gather_hooks_.start(i);
  }
  resident_wait_ = 0;
  resident_filled_ = true;
}

void Decoder::settle_resident_weights() {
  for (; resident_wait_ < weight_gathers_.size(); ++resident_wait_) gather_hooks_.wait(resident_wait_);
}

}  // namespace keel::model
