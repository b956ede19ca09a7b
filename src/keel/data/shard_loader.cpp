#include "keel/data/shard_loader.h"

#include <chrono>

#include "keel/core/error.h"

namespace keel::data {

namespace {
constexpr int32_t kIgnore = -100;
}

PackedMicroBatch make_packed_micro_batch_buffers(int64_t batch, int64_t seq) {
  PackedMicroBatch m;
  static_cast<MicroBatchData&>(m) = make_micro_batch_buffers(batch, seq);
  m.segments.resize(size_t(batch * seq));
  return m;
}

void fill_packed_row(const ShardFile::SequenceView& s, int64_t seq, int32_t pad_id, int64_t vocab_size, int32_t* in,
                     int32_t* tg, int32_t* pos, int32_t* seg, int64_t& input_tokens, int64_t& target_tokens) {
  const int64_t len = std::min<int64_t>(int64_t(s.tokens.size()), seq);
  const auto& docs = s.document_offsets;  // absolute offsets: docs[j] .. docs[j+1] is document j of the row
  size_t j = 0;
  for (int64_t t = 0; t < len; ++t) {
    const uint64_t at = uint64_t(s.token_start + t);
    while (j + 2 < docs.size() && at >= docs[j + 1]) ++j;
    const uint32_t id = s.tokens[size_t(t)];
    require(int64_t(id) < vocab_size, "prepared data: token id {} is outside the model's vocabulary ({})", id,
            vocab_size);
    in[t] = int32_t(id);
    pos[t] = int32_t(at - docs[j]);
    seg[t] = int32_t(j);
    // The last token of a document predicts nothing: the next token belongs to another document.
    const bool next_in_doc = t + 1 < len && at + 1 < docs[j + 1];
    tg[t] = next_in_doc && s.target(t + 1) ? int32_t(s.tokens[size_t(t + 1)]) : kIgnore;
    target_tokens += tg[t] != kIgnore;
  }
  // Padding: its own segment (no real token attends to it, and it to none), positions from 0. Its
  // id, docs.size(), is one past the next document id: keel.DataLoader (python/keel/data.py)
  // finds where padding starts by that step of two.
  const int32_t pad_segment = int32_t(docs.size());
  for (int64_t t = len; t < seq; ++t) {
    in[t] = pad_id;
    tg[t] = kIgnore;
    pos[t] = int32_t(t - len);
    seg[t] = pad_segment;
  }
  input_tokens += len;
}

ShardLoader::ShardLoader(const std::string& dir, const ShardLoaderOptions& options)
    : o_(options), data_(std::make_unique<PreparedData>(dir, options.verify_checksums)) {
  const ShardManifest& m = data_->manifest();
  require(o_.batch_size > 0 && o_.micro_batches_per_step > 0 && o_.ranks > 0 && o_.rank >= 0 && o_.rank < o_.ranks,
          "loader: batch_size, micro_batches_per_step and ranks must be positive and rank in [0, ranks)");
  if (o_.seq_len == 0) o_.seq_len = m.max_seq_len;
  require(m.max_seq_len <= o_.seq_len,
          "{}: prepared for max_seq_len {}, longer than the {} tokens of a training row (prepare again, or raise "
          "max_seq_len)",
          dir, m.max_seq_len, o_.seq_len);
  vocab_size_ = o_.vocab_size > 0 ? o_.vocab_size : m.vocab_size;
  require(m.vocab_size <= vocab_size_, "{}: prepared with a {}-token vocabulary, larger than the model's {}", dir,
          m.vocab_size, vocab_size_);
  pad_id_ = o_.pad_id >= 0 ? o_.pad_id : m.pad_id;
  require(pad_id_ < vocab_size_, "{}: pad id {} is outside the vocabulary ({})", dir, pad_id_, vocab_size_);
  samples_per_step_ = o_.micro_batches_per_step * o_.ranks * o_.batch_size;

  const int slots = o_.num_workers > 0 ? std::max(1, o_.prefetch_factor) + 1 : 1;
  for (int s = 0; s < slots; ++s)
    slots_.push_back({std::vector<PackedMicroBatch>(size_t(o_.micro_batches_per_step),
                                                    make_packed_micro_batch_buffers(o_.batch_size, o_.seq_len)),
                      -1});
  if (o_.num_workers == 0) {
    caller_order_ = std::make_unique<SampleOrder>(data_->sequences(), o_.shuffle, o_.seed);
    return;
  }
  for (int w = 0; w < o_.num_workers; ++w) workers_.emplace_back([this] { worker_loop(); });
}

ShardLoader::~ShardLoader() {
  {
    std::lock_guard lock(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  for (auto& w : workers_) w.join();
}

void ShardLoader::fill(int64_t first, SampleOrder& order, Slot& slot) const {
  for (int64_t i = 0; i < o_.micro_batches_per_step; ++i) {
    PackedMicroBatch& mb = slot.micro[size_t(i)];
    mb.input_tokens = mb.target_tokens = 0;
    const int64_t T = mb.seq;
    for (int64_t b = 0; b < o_.batch_size; ++b) {
      const int64_t sequence = order.record_at(sample_index(first, i, o_.rank, b));
      fill_packed_row(data_->sequence(sequence), T, pad_id_, vocab_size_, mb.input_ids.data() + b * T,
                      mb.targets.data() + b * T, mb.positions.data() + b * T, mb.segments.data() + b * T,
                      mb.input_tokens, mb.target_tokens);
    }
  }
}

void ShardLoader::worker_loop() {
  // Each worker keeps its own SampleOrder (one permutation of the sequences, rebuilt once per
  // epoch): the order is a pure function of (seed, sample index), so workers agree without sharing.
  SampleOrder order(data_->sequences(), o_.shuffle, o_.seed);
  const int64_t slots = int64_t(slots_.size());
  std::unique_lock lock(mu_);
  for (;;) {
    // Unit n may be filled once its slot is free: the caller holds unit handed_ - 1, so units up
    // to handed_ - 1 + slots - 1 fit.
    cv_.wait(lock, [&] { return stop_ || (!failure_ && next_fill_ < handed_ + slots - 1); });
    if (stop_) return;
    const int64_t unit = next_fill_++, generation = generation_;
    const int64_t first = origin_ + unit * samples_per_step_;
    Slot& slot = slots_[size_t(unit % slots)];
    ++filling_;
    lock.unlock();
    std::exception_ptr error;
    try {
      fill(first, order, slot);
    } catch (...) {
      error = std::current_exception();
    }
    lock.lock();
    --filling_;
    if (error && !failure_) failure_ = error;
    if (!error && generation == generation_) slot.unit = unit;
    cv_.notify_all();
  }
}

void ShardLoader::seek(int64_t samples_consumed) {
  require(samples_consumed >= 0, "loader: negative position {}", samples_consumed);
  std::unique_lock lock(mu_);
  ++generation_;
  // Workers still filling write into slots: wait for them before the ring is renumbered.
  cv_.wait(lock, [&] { return filling_ == 0; });
  origin_ = samples_consumed;
  handed_ = next_fill_ = 0;
  for (auto& s : slots_) s.unit = -1;
  position_ = samples_consumed;
  cv_.notify_all();
}

std::span<const PackedMicroBatch> ShardLoader::next_step() {
  const auto t0 = std::chrono::steady_clock::now();
  Slot* slot;
  if (o_.num_workers == 0) {
    slot = &slots_[0];
    fill(position_, *caller_order_, *slot);
  } else {
    std::unique_lock lock(mu_);
    const int64_t unit = handed_++;  // also frees the slot of the unit handed out before
    cv_.notify_all();
    slot = &slots_[size_t(unit % int64_t(slots_.size()))];
    cv_.wait(lock, [&] { return failure_ || slot->unit == unit; });
    if (failure_) std::rethrow_exception(failure_);
  }
  last_wait_s_ = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  total_wait_s_ += last_wait_s_;
  position_ += samples_per_step_;
  return slot->micro;
}

std::span<const PackedMicroBatch> ShardLoader::step_batches(int64_t step) {
  require(step >= 1, "loader: steps count from 1 (got {})", step);
  const int64_t first = (step - 1) * samples_per_step_;
  if (first != position_) seek(first);
  return next_step();
}

}  // namespace keel::data
