#include "keel/model/params.h"

#include <algorithm>

#include "keel/core/error.h"

namespace keel::model {

namespace {

// Elements [first, first + n) of tensor p := values, for the part `held` of its buffer this process
// holds (at `held_data`).
template <typename T>
void copy_held(const Param& p, int64_t first, int64_t n, const T* values, FlatRange held, T* held_data) {
  const FlatRange part = FlatRange{p.offset + first, p.offset + first + n}.intersect(held);
  if (part.size() > 0)
    std::copy_n(values + (part.begin - p.offset - first), part.size(), held_data + (part.begin - held.begin));
}

}  // namespace

int ParamStore::add(std::string name, std::vector<int64_t> shape, bool weight_decay, ParamStorage storage) {
  require(!allocated(), "ParamStore: parameter '{}' declared after allocation", name);
  Param p;
  p.name = std::move(name);
  p.shape = std::move(shape);
  p.numel = 1;
  for (int64_t d : p.shape) p.numel *= d;
  p.weight_decay = weight_decay;
  p.storage = storage;
  // 4-bit tensors start on a 64-byte line of both their codes and their absmax values.
  const int64_t align = storage == ParamStorage::FourBit ? kFourBitShardAlign : kParamAlignElements;
  require(storage != ParamStorage::FourBit || p.numel % kFourBitBlockSize == 0,
          "4-bit: tensor '{}' has {} elements, not a multiple of the {}-element block", p.name, p.numel,
          kFourBitBlockSize);
  int64_t& end = storage == ParamStorage::Master ? total_
                 : storage == ParamStorage::Bf16 ? compute_only_total_
                                                 : four_bit_total_;
  p.offset = end;
  end += (p.numel + align - 1) / align * align;
  params_.push_back(std::move(p));
  return int(params_.size()) - 1;
}

void ParamStore::allocate(bool with_bf16_copy) {
  owned_weights_.assign(total_, 0.0f);
  owned_grads_.assign(total_, 0.0f);
  require(with_bf16_copy || compute_only_total_ == 0, "ParamStore: compute-only parameters need the bf16 buffer");
  if (with_bf16_copy) owned_weights_bf16_.assign(size_t(bf16_total()), bf16{0});
  weights_ = owned_weights_.data();
  grads_ = owned_grads_.data();
  weights_bf16_ = with_bf16_copy ? owned_weights_bf16_.data() : nullptr;
}

void ParamStore::bind(float* weights, float* grads, bf16* weights_bf16, float* adam_m, float* adam_v) {
  require(weights && (adam_m == nullptr) == (adam_v == nullptr) && (grads || !adam_m || staged_grads()),
          "ParamStore::bind: weights are required, Adam moments come in pairs and need gradients");
  require(!grads || !staged_grads(), "ParamStore::bind: the gradients are staged (ZeRO-2); no whole buffer");
  require(weights_bf16 || compute_only_total_ == 0, "ParamStore::bind: compute-only parameters need the bf16 buffer");
  require(!grads || (compute_only_total_ == 0 && four_bit_total_ == 0),
          "ParamStore::bind: compute-only parameters are frozen (no gradients)");
  weights_ = weights;
  grads_ = grads;
  weights_bf16_ = weights_bf16;
  adam_m_ = adam_m;
  adam_v_ = adam_v;
}

void ParamStore::bind_four_bit(uint8_t* packed, float* absmax) {
  require(packed && absmax, "ParamStore::bind_four_bit: both buffers are required");
  four_bit_packed_ = packed;
  four_bit_absmax_ = absmax;
}

FourBitWeight ParamStore::four_bit(int i) const {
  if (!four_bit_at_.empty()) return four_bit_at_[size_t(i)];
  const Param& p = params_[size_t(i)];
  if (p.storage != ParamStorage::FourBit || !four_bit_packed_) return {};
  return {four_bit_packed_ + p.offset / 2, four_bit_absmax_ + p.offset / kFourBitBlockSize, four_bit_type_};
}

namespace {

void require_four_bit_blocks(const Param& p, bool bound, int64_t first, int64_t n) {
  require(p.storage == ParamStorage::FourBit && bound, "ParamStore: '{}' is not a 4-bit tensor", p.name);
  require(first % kFourBitBlockSize == 0 && n % kFourBitBlockSize == 0 && first >= 0 && first + n <= p.numel,
          "4-bit: elements [{}, {}) of '{}' are not whole {}-element blocks inside its {}", first, first + n, p.name,
          kFourBitBlockSize, p.numel);
}

// Double quantization's round trip of `count` absmax values in place (core/four_bit.h): what the
// dequantization reads afterwards is what bitsandbytes' dequantized statistics give.
void round_trip_absmax(float* absmax, int64_t count) {
  std::vector<uint8_t> codes(static_cast<size_t>(count));
  std::vector<float> absmax2(static_cast<size_t>((count + kAbsmaxBlockSize - 1) / kAbsmaxBlockSize));
  float offset = 0.0f;
  quantize_absmax(absmax, count, codes.data(), absmax2.data(), &offset);
  dequantize_absmax(codes.data(), absmax2.data(), offset, count, absmax);
}

}  // namespace

ParamStore::FourBitSlot ParamStore::four_bit_slot(int i, int64_t first, int64_t n) {
  const Param& p = params_[size_t(i)];
  require_four_bit_blocks(p, four_bit_packed_ != nullptr && !sharded_weights(), first, n);
  return {four_bit_packed_ + (p.offset + first) / 2, four_bit_absmax_ + (p.offset + first) / kFourBitBlockSize};
}

void ParamStore::write_four_bit(int i, int64_t first, int64_t n, const uint8_t* packed, const float* absmax) {
  const Param& p = params_[size_t(i)];
  require_four_bit_blocks(p, four_bit_packed_ != nullptr, first, n);
  // Shard bounds are whole blocks (kFourBitShardAlign), so the held part is too.
  const FlatRange held = four_bit_range();
  const FlatRange part = FlatRange{p.offset + first, p.offset + first + n}.intersect(held);
  if (part.size() == 0) return;
  const int64_t from = part.begin - p.offset - first, to = part.begin - held.begin;
  std::copy_n(packed + from / 2, part.size() / 2, four_bit_packed_ + to / 2);
  std::copy_n(absmax + from / kFourBitBlockSize, part.size() / kFourBitBlockSize,
              four_bit_absmax_ + to / kFourBitBlockSize);
}

void ParamStore::store_four_bit(int i, int64_t first, const float* values, int64_t n, bool double_quantization) {
  const Param& p = params_[size_t(i)];
  require_four_bit_blocks(p, four_bit_packed_ != nullptr, first, n);
  // ZeRO-3: the tensor is quantized whole (its blocks' absmax values are double-quantized together,
  // as bitsandbytes does), this rank keeping its part.
  std::vector<uint8_t> packed_whole;
  std::vector<float> absmax_whole;
  uint8_t* packed = four_bit_packed_ + (p.offset + first) / 2;
  float* absmax = four_bit_absmax_ + (p.offset + first) / kFourBitBlockSize;
  if (sharded_weights()) {
    packed_whole.resize(size_t(n / 2));
    absmax_whole.resize(size_t(n / kFourBitBlockSize));
    packed = packed_whole.data();
    absmax = absmax_whole.data();
  }
  four_bit_quantize(four_bit_type_, values, n, packed, absmax);
  if (double_quantization) round_trip_absmax(absmax, n / kFourBitBlockSize);
  if (sharded_weights()) write_four_bit(i, first, n, packed, absmax);
}

void ParamStore::double_quantize_four_bit(int i) {
  const Param& p = params_[size_t(i)];
  require_four_bit_blocks(p, four_bit_packed_ != nullptr && !sharded_weights(), 0, p.numel);
  round_trip_absmax(four_bit_absmax_ + p.offset / kFourBitBlockSize, p.numel / kFourBitBlockSize);
}

void ParamStore::set_optimizer_range(FlatRange range) {
  require(range.begin >= 0 && range.begin <= range.end && range.end <= total_,
          "ParamStore: optimizer range [{}, {}) outside the {} parameters", range.begin, range.end, total_);
  optimizer_shard_ = range;
}

void ParamStore::allocate_optimizer_state() {
  const auto n = size_t(optimizer_range().size());
  if (adam_m_) {  // planned and bound: no allocation, only a fresh start for a new optimizer
    std::fill(adam_m_, adam_m_ + n, 0.0f);
    std::fill(adam_v_, adam_v_ + n, 0.0f);
    return;
  }
  owned_adam_m_.assign(n, 0.0f);
  owned_adam_v_.assign(n, 0.0f);
  adam_m_ = owned_adam_m_.data();
  adam_v_ = owned_adam_v_.data();
}

void ParamStore::bind_staged_grads(std::vector<float*> grad_at, float* shard) {
  require(grad_at.size() == params_.size() && shard && compute_only_total_ == 0 && four_bit_total_ == 0,
          "ParamStore::bind_staged_grads: one gradient address per tensor and a shard, for a store whose tensors "
          "all train");
  grads_ = nullptr;
  grad_at_ = std::move(grad_at);
  grad_shard_ = shard;
}

void ParamStore::shard_weights(FlatRange masters, FlatRange compute_only, FlatRange four_bit) {
  auto within = [](FlatRange r, int64_t total) { return r.begin >= 0 && r.begin <= r.end && r.end <= total; };
  require(!allocated() && within(masters, total_) && within(compute_only, compute_only_total_) &&
              within(four_bit, four_bit_total_) && four_bit.begin % kFourBitShardAlign == 0 &&
              (four_bit.end % kFourBitShardAlign == 0 || four_bit.end == four_bit_total_) &&
              (!optimizer_shard_ || (optimizer_shard_->begin == masters.begin && optimizer_shard_->end == masters.end)),
          "ParamStore::shard_weights: shards [{}, {}) of {} masters, [{}, {}) of {} bf16 and [{}, {}) of {} 4-bit "
          "elements (whole {}-element units), before bind(), a trained store's own optimizer range",
          masters.begin, masters.end, total_, compute_only.begin, compute_only.end, compute_only_total_, four_bit.begin,
          four_bit.end, four_bit_total_, kFourBitShardAlign);
  master_shard_ = masters;
  compute_only_shard_ = compute_only;
  four_bit_shard_ = four_bit;
  weight_at_.assign(params_.size(), nullptr);
  weight_bf16_at_.assign(params_.size(), nullptr);
  four_bit_at_.assign(params_.size(), FourBitWeight{});
}

void ParamStore::cast_bf16_per_position() {
  require(
      allocated() && !sharded_weights() && weights_bf16_ == nullptr && compute_only_total_ == 0 && four_bit_total_ == 0,
      "ParamStore::cast_bf16_per_position: a bound store with whole masters, no bf16 copy bound and only "
      "trained tensors");
  weight_bf16_at_.assign(params_.size(), nullptr);
}

void ParamStore::point_nowhere() {
  std::fill(weight_at_.begin(), weight_at_.end(), nullptr);
  std::fill(weight_bf16_at_.begin(), weight_bf16_at_.end(), nullptr);
  std::fill(four_bit_at_.begin(), four_bit_at_.end(), FourBitWeight{});
}

float* ParamStore::whole_weights() {
  require(!sharded_weights(), "ParamStore: the fp32 masters are sharded (ZeRO); this rank holds [{}, {}) of them only",
          master_range().begin, master_range().end);
  return weights_;
}

void ParamStore::write_master(int i, int64_t first, const float* values, int64_t n) {
  const Param& p = params_[size_t(i)];
  require(p.master() && first >= 0 && n >= 0 && first + n <= p.numel,
          "ParamStore::write_master: elements [{}, {}) of '{}' ({} elements, {})", first, first + n, p.name, p.numel,
          p.master() ? "an fp32 master" : "no fp32 master");
  copy_held(p, first, n, values, master_range(), weights_);
}

void ParamStore::write_compute_only(int i, int64_t first, const bf16* values, int64_t n) {
  const Param& p = params_[size_t(i)];
  require(p.storage == ParamStorage::Bf16 && first >= 0 && n >= 0 && first + n <= p.numel,
          "ParamStore::write_compute_only: elements [{}, {}) of '{}' ({} elements, {})", first, first + n, p.name,
          p.numel, p.storage == ParamStorage::Bf16 ? "compute-only bf16" : "not compute-only bf16");
  copy_held(p, first, n, values, compute_only_range(), compute_only());
}

void ParamStore::zero_grads() {
  if (grad_shard_)
    std::fill(grad_shard_, grad_shard_ + optimizer_range().size(), 0.0f);
  else if (grads_)
    std::fill(grads_, grads_ + total_, 0.0f);
  std::fill(written_.begin(), written_.end(), uint8_t(1));
}

void ParamStore::overwrite_first_gradient_writes(bool on) {
  // Only a whole gradient buffer: ZeRO-2's staging and shard keep their own zeroing. Zeroed once
  // here (the padding between tensors too, which no write touches), every tensor counted as
  // written: the first step's begin_gradient_step then zeroes nothing.
  written_.clear();
  if (!on || !grads_ || !grad_at_.empty() || grad_shard_) return;
  std::fill(grads_, grads_ + total_, 0.0f);
  written_.assign(params_.size(), uint8_t(1));
}

void ParamStore::begin_gradient_step() {
  if (written_.empty()) return zero_grads();
  for (size_t i = 0; i < params_.size(); ++i) {
    if (!written_[i]) std::fill_n(grads_ + params_[i].offset, params_[i].numel, 0.0f);
    written_[i] = 0;
  }
}

void ParamStore::refresh_bf16_copy() { refresh_bf16_copy({0, total_}); }

void ParamStore::refresh_bf16_copy(FlatRange range) {
  if (weights_bf16_ && !sharded_weights())
    convert_f32_to_bf16(weights_ + range.begin, weights_bf16_ + range.begin, range.size());
}

WeightShards weight_shards(const ParamStore& store, int shards) {
  return {shard_ranges(store.total(), shards), shard_ranges(store.compute_only_total(), shards),
          shard_ranges(store.four_bit_total(), shards, kFourBitShardAlign)};
}

}  // namespace keel::model
