#include "keel/data/batch_builder.h"

#include <algorithm>
#include <numeric>

namespace keel::data {
namespace {

constexpr int32_t kIgnore = -100;

// SplitMix64 (Steele et al. 2014): a tiny, well-mixed counter-based generator, identical everywhere.
uint64_t splitmix64(uint64_t& state) {
  uint64_t z = (state += 0x9e3779b97f4a7c15ull);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

// Uniform integer in [0, bound) without modulo bias (Lemire's method with rejection).
uint64_t uniform_below(uint64_t& state, uint64_t bound) {
  const uint64_t threshold = -bound % bound;
  for (;;) {
    __uint128_t m = __uint128_t(splitmix64(state)) * bound;
    if (uint64_t(m) >= threshold) return uint64_t(m >> 64);
  }
}

}  // namespace

SampleOrder::SampleOrder(int64_t records, bool shuffle, uint64_t seed)
    : records_(records), shuffle_(shuffle), seed_(seed) {}

int64_t SampleOrder::record_at(int64_t k) {
  const int64_t epoch = k / records_, index = k % records_;
  if (!shuffle_) return index;
  if (epoch != epoch_) {
    permutation_.resize(records_);
    std::iota(permutation_.begin(), permutation_.end(), int64_t(0));
    uint64_t state = seed_ * 0x100000001b3ull ^ uint64_t(epoch);
    for (int64_t i = records_ - 1; i > 0; --i)
      std::swap(permutation_[i], permutation_[uniform_below(state, uint64_t(i) + 1)]);
    epoch_ = epoch;
  }
  return permutation_[index];
}

MicroBatchData make_micro_batch_buffers(int64_t batch, int64_t seq) {
  MicroBatchData m;
  m.batch = batch;
  m.seq = seq;
  m.input_ids.resize(batch * seq);
  m.targets.resize(batch * seq);
  m.positions.resize(batch * seq);
  return m;
}

void fill_micro_batch(const TokenRecords& records, SampleOrder& order, int64_t first_sample, int32_t pad_id,
                      MicroBatchData& out, int32_t* segments) {
  const int64_t T = out.seq;
  out.input_tokens = out.target_tokens = 0;
  for (int64_t b = 0; b < out.batch; ++b) {
    const int64_t r = order.record_at(first_sample + b);
    const int64_t len = std::min(records.length(r), T);
    const int32_t* ids = records.input_ids.data() + records.offsets[r];
    const int32_t* labels = records.labels.data() + records.offsets[r];
    int32_t* in = out.input_ids.data() + b * T;
    int32_t* tg = out.targets.data() + b * T;
    int32_t* pos = out.positions.data() + b * T;
    for (int64_t t = 0; t < T; ++t) {
      in[t] = t < len ? ids[t] : pad_id;
      tg[t] = t + 1 < len ? labels[t + 1] : kIgnore;
      pos[t] = int32_t(t);
      if (segments) segments[b * T + t] = t < len ? 0 : 2;
      out.target_tokens += tg[t] != kIgnore;
    }
    out.input_tokens += len;
  }
}

}  // namespace keel::data
